"""Private stand-ins for the files the issue found replaced: a character device with
/dev/full's numbers, a FIFO, links, a directory, made in a test's own directory (never
the system's /dev files: a regression would replace them)."""

from __future__ import annotations

import os
import stat

import pytest

KINDS = ("chardev", "fifo", "symlink-to-chardev", "dangling-symlink", "directory")


def make_node(path, kind: str, tmp_path) -> None:
    """Make ``path`` a node of ``kind`` (one of :data:`KINDS`); a device is made beside it in
    ``tmp_path`` for a link to point at. Skips where making a device needs root."""
    if kind in ("chardev", "symlink-to-chardev"):
        dev = path if kind == "chardev" else tmp_path / "fulldev"
        try:
            os.mknod(dev, 0o600 | stat.S_IFCHR, os.makedev(1, 7))  # /dev/full's numbers
        except PermissionError:
            pytest.skip("making a character device needs root")
        if kind == "symlink-to-chardev":
            os.symlink(dev, path)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "dangling-symlink":
        os.symlink(tmp_path / "nowhere" / "x.json", path)
    elif kind == "directory":
        os.mkdir(path)
    else:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")


def identity(path) -> tuple:
    """What says a node is the same one, untouched: inode, mode, device numbers, size."""
    st = os.lstat(path)
    return st.st_ino, st.st_mode, st.st_rdev, st.st_size
