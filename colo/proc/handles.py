"""Tensor handles that cross the control channel, and the only code that rebuilds them.

A handle is a small JSON object: ``{"kind": "shm", "name": ..., "nbytes": ...}``
for a host shared-memory segment, ``{"kind": "cuda_ipc", ...}`` for a CUDA IPC
allocation. The receiving side calls :func:`open_handle`, which dispatches on
``kind`` through a fixed table; nothing else turns channel bytes into memory.

Shared memory lives in ``/dev/shm`` as files we create with ``O_EXCL`` and
unlink ourselves: ``multiprocessing.shared_memory`` would hand the segment to
a resource tracker that unlinks it behind our back when the engine exits.

The receiving side maps a segment read-only (``O_RDONLY``, ``PROT_READ``): it only
copies out of it, and the bytes are the sender's (a staging bucket it reuses, or with
the one-copy flat buffer the trainer's own weights). A store through the receiver's
mapping ends its process (SIGSEGV) instead of changing them. It guards against the
reader only: another process of the same user can still open the file read-write.
"""

from __future__ import annotations

import mmap
import os
import re
import uuid
import warnings
from collections.abc import Callable
from typing import Any

import torch
from colo.core.errors import HandleError

SHM_DIR = "/dev/shm"
_SHM_NAME = re.compile(r"^colo-[0-9]+-[0-9a-f]{32}$")


class ShmSegment:
    """One shared-memory segment mapped into this process, viewable as a uint8 tensor."""

    def __init__(self, name: str, nbytes: int, *, create: bool, writable: bool = True):
        if not _SHM_NAME.match(name):
            raise HandleError(f"shared-memory name {name!r} is not a colo segment name")
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise HandleError(f"shared-memory size must be a positive integer, got {nbytes!r}")
        if create and not writable:
            raise ValueError("a segment is created to be written: create=True needs writable=True")
        self.name, self.nbytes, self.owner, self.writable = name, nbytes, create, writable
        path = os.path.join(SHM_DIR, name)
        flags = (os.O_RDWR if writable else os.O_RDONLY) | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, nbytes)
            elif os.fstat(fd).st_size < nbytes:
                raise HandleError(f"segment {name} holds {os.fstat(fd).st_size} B, handle says {nbytes} B")
            self._mm: mmap.mmap | None = mmap.mmap(fd, nbytes, access=mmap.ACCESS_DEFAULT if writable
                                                   else mmap.ACCESS_READ)
        finally:
            os.close(fd)
        with warnings.catch_warnings():
            # torch warns that it cannot mark a tensor over read-only memory read-only; the
            # pages themselves refuse a store, which is the point
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            self.tensor: torch.Tensor | None = torch.frombuffer(self._mm, dtype=torch.uint8)

    @classmethod
    def create(cls, nbytes: int) -> ShmSegment:
        return cls(f"colo-{os.getpid()}-{uuid.uuid4().hex}", nbytes, create=True)

    def handle(self) -> dict:
        return {"kind": "shm", "name": self.name, "nbytes": self.nbytes}

    def close(self) -> None:
        # Views of the mapping must be gone before it closes, or mmap refuses.
        self.tensor = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                # a caller still holds a view: leave the mapping to the GC
                pass
            self._mm = None
        if self.owner:
            try:
                os.unlink(os.path.join(SHM_DIR, self.name))
            except FileNotFoundError:
                pass
            self.owner = False


def shm_room() -> int:
    """Bytes ``/dev/shm`` can still take. A segment is created sparse: one larger than
    this is only found out when a page is touched, by a SIGBUS that kills the process,
    so whoever creates a large one asks first (a container's /dev/shm is often 64 MiB)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def _open_shm(handle: dict) -> ShmSegment:
    return ShmSegment(handle.get("name", ""), handle.get("nbytes"), create=False, writable=False)


#: kind -> the one function allowed to rebuild it
REBUILDERS: dict[str, Callable[[dict], Any]] = {"shm": _open_shm}


def register_rebuilder(kind: str, fn: Callable[[dict], Any]) -> None:
    """Add a handle kind (the CUDA backend adds ``cuda_ipc``); refuse overwriting one."""
    if kind in REBUILDERS and REBUILDERS[kind] is not fn:
        raise ValueError(f"handle kind {kind!r} is already registered")
    REBUILDERS[kind] = fn


def open_handle(handle: Any) -> Any:
    if not isinstance(handle, dict):
        raise HandleError(f"a handle must be a JSON object, got {type(handle).__name__}")
    kind = handle.get("kind")
    fn = REBUILDERS.get(kind)
    if fn is None:
        raise HandleError(f"handle kind {kind!r} is not allowed; expected one of {', '.join(sorted(REBUILDERS))}")
    return fn(handle)


def leftover_segments(pid: int | None = None) -> list[str]:
    """Segments in /dev/shm created by ``pid`` (default: this process) — for leak checks."""
    prefix = f"colo-{pid if pid is not None else os.getpid()}-"
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))
    except FileNotFoundError:
        return []
