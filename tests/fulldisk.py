"""A disk that is full, or nearly: a private tmpfs of a few pages, mounted for one test.

ENOSPC is reproduced for real (the kernel's own error from the kernel's own
filesystem), not by a patched write. Mounting needs root (CAP_SYS_ADMIN); where
it is refused the test is skipped and says so.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

PAGE = 4096


@contextlib.contextmanager
def small_disk(path: Path, *, size_kib: int = 64, free_kib: int = 0) -> Iterator[Path]:
    """A tmpfs of ``size_kib`` at ``path``, filled by one file (``filler``) so that
    ``free_kib`` are left; unmounted (lazily: a killed writer may still hold a file) after."""
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k,mode=0755", "tmpfs", str(path)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"a full disk is a tmpfs mounted for the test, and mounting was refused: {r.stderr.strip()}")
    try:
        filler = path / "filler"
        with open(filler, "wb", buffering=0) as fh:
            try:
                while True:
                    fh.write(b"\0" * PAGE)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
        if free_kib:
            os.truncate(filler, max(0, filler.stat().st_size - free_kib * 1024))
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)
