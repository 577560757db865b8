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

Every segment a process makes is also listed until it is unlinked, so that a
process that ends without its own cleanup having run (its main thread still
inside a step when an orphan's grace is over) still unlinks it last
(:func:`unlink_own_segments`).
The creator also holds a shared ``flock`` on each for as long as it lives
(:mod:`colo.proc.owner`): that, not the pid in the name, is what tells the
start-up sweep a segment is still someone's.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import threading
import uuid
import warnings
from collections.abc import Callable
from typing import Any

import torch
from colo.core.errors import HandleError, SharedMemoryFull
from colo.core.units import fmt_bytes
from colo.proc.owner import TRIES, Swept, create_locked

SHM_DIR = "/dev/shm"
#: ``colo-<pid>-l<32 hex>``: the ``l`` says that its maker holds a lock on it for as long as
#: it lives (colo.proc.owner), which older colos' ``colo-<pid>-<32 hex>`` did not; they are
#: still opened (and swept) by that name
_SHM_NAME = re.compile(r"^colo-[0-9]+-l?[0-9a-f]{32}$")

#: name -> path of every segment this process made and has not unlinked yet
_MADE: dict[str, str] = {}
#: names of segments this process mapped from another (a handle it was sent): an orphan
#: unlinks those of its dead parent (:func:`unlink_opened_of`)
_OPENED: set[str] = set()
#: held from a segment's creation to its entry in _MADE, so that unlink_own_segments
#: (from another thread) never misses one being made; reentrant: a finalizer that
#: closes another segment may run in the creating thread while it holds the lock
_MADE_LOCK = threading.RLock()
#: unlink_own_segments ran: this process is ending and makes no segment any more
_ENDING = False


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
        #: the creator's descriptor, open until close(): its shared lock tells a sweeper
        #: (colo.proc.lifecycle.sweep) in any PID namespace that the segment is in use
        self._lock_fd: int | None = None
        path = os.path.join(SHM_DIR, name)
        if create:
            with _MADE_LOCK:
                if _ENDING:
                    raise HandleError(f"no new shared-memory segment: process {os.getpid()} is ending")
                fd = create_locked(path)
                _MADE[name] = path
        else:
            fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
            _OPENED.add(name)
        try:
            if create:
                os.ftruncate(fd, nbytes)
                _reserve(fd, nbytes)
            elif os.fstat(fd).st_size < nbytes:
                raise HandleError(f"segment {name} holds {os.fstat(fd).st_size} B, handle says {nbytes} B")
            self._mm: mmap.mmap | None = mmap.mmap(fd, nbytes, access=mmap.ACCESS_DEFAULT if writable
                                                   else mmap.ACCESS_READ)
        except BaseException:
            os.close(fd)
            if create:
                _unlink(name)
            raise
        if create:
            self._lock_fd = fd
        else:
            os.close(fd)
        with warnings.catch_warnings():
            # torch warns that it cannot mark a tensor over read-only memory read-only; the
            # pages themselves refuse a store, which is the point
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            self.tensor: torch.Tensor | None = torch.frombuffer(self._mm, dtype=torch.uint8)

    @classmethod
    def create(cls, nbytes: int) -> ShmSegment:
        for _ in range(TRIES):
            try:
                return cls(f"colo-{os.getpid()}-l{uuid.uuid4().hex}", nbytes, create=True)
            except Swept:
                continue  # a sweeper took the new file before its lock: another name
        raise HandleError(f"no shared-memory segment could be made: {TRIES} new ones were swept as they were made")

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
            _unlink(self.name)
            self.owner = False
        if self._lock_fd is not None:
            # after the unlink: until then the lock keeps a sweeper off the name
            os.close(self._lock_fd)
            self._lock_fd = None


def _unlink(name: str) -> None:
    with _MADE_LOCK:
        path = _MADE.pop(name, None) or os.path.join(SHM_DIR, name)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def unlink_own_segments() -> list[str]:
    """Unlink every segment this process made and still has, and make no more; their
    names. The last thing a process that is ending does (any thread may call it): a
    mapping another process holds stays valid, only the name goes, which is what
    would outlive us. Segments made by other processes are never touched."""
    global _ENDING
    with _MADE_LOCK:
        _ENDING = True
        names = list(_MADE)
        for name in names:
            _unlink(name)
    return names


def unlink_opened_of(pid: int) -> list[str]:
    """Unlink the segments process ``pid`` of this namespace made that this process
    mapped from a handle it was sent; their names. Called by an orphan once its parent
    ``pid`` is proven gone: the name carries that pid and the handle came from it, so
    the segment was its, whoever else may still hold its lock (a descendant of the
    parent that inherited the descriptor keeps the sweep from proving it free)."""
    prefix = f"colo-{pid}-"
    gone = []
    for name in sorted(n for n in _OPENED if n.startswith(prefix)):
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            gone.append(name)
        except FileNotFoundError:
            pass
        _OPENED.discard(name)
    return gone


def _forget_in_child() -> None:
    # a forked child shares its parent's segments but does not own them: it must never
    # unlink them as it ends (and a lock another thread held at the fork stays held)
    global _MADE_LOCK
    _MADE.clear()
    _OPENED.clear()
    _MADE_LOCK = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


#: what posix_fallocate says where it cannot reserve (a file system without it): the pages
#: are then found, or not, at first touch, as before
_CANNOT_RESERVE = frozenset({errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL})


def _reserve(fd: int, nbytes: int) -> None:
    """Allocate every page of a new segment now. ``ftruncate`` makes it sparse: a page that
    /dev/shm has no room for is only found when first touched, by a SIGBUS that kills the
    process with no word (a container's 64 MiB /dev/shm, another process filling it while
    a run syncs). Reserved here, a shortfall is :class:`SharedMemoryFull`, raised where the
    segment was asked for, and a segment once made can be written whole whatever else
    fills /dev/shm afterwards."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno in _CANNOT_RESERVE:
            return
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise SharedMemoryFull(where=SHM_DIR, what=f"a shared-memory segment of {fmt_bytes(nbytes)}",
                                   need=nbytes, room=shm_room()) from None
        raise


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
