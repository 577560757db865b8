"""Who owns a file colo made: a lock its owner holds for as long as it lives.

A run's dirs and ``/dev/shm`` segments are named with the pid of the process
that made them, but a pid proves nothing about ownership: a run in another PID
namespace (a container sharing ``/tmp`` and ``/dev/shm``) has pids that name no
process here, or someone else's; and a dead owner's pid is handed out again.
What does prove it is an ``flock``: the owner takes a shared lock on the file
(a segment) or on a lock file inside it (a dir) when it makes it, and keeps
that descriptor open for the file's lifetime. The kernel drops the lock when
the last descriptor closes, that is when the owner ends, however it ends, in
whatever namespace it runs, as long as the file system is shared. A sweeper
removes a thing only while it holds the lock exclusively: then nobody owns it,
and nobody can take it back until the sweeper is done.

Shared, not exclusive, for the owner: other processes of the same run may hold
it too, and only a sweeper needs it alone.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager

#: what :func:`create_locked` gives up after: each try lost its new file to a sweeper
TRIES = 16


class Swept(OSError):
    """A file just made was taken by a sweeper before its lock was: make another."""


def create_locked(path: str, mode: int = 0o600, *, flags: int = os.O_RDWR) -> int:
    """Create ``path`` (it must not exist) and hold a shared lock on it; the descriptor.

    Between ``O_CREAT`` and ``flock`` a sweeper can find the new file unlocked, lock it
    and unlink it. Then our lock is refused, or (the sweeper already done) granted on
    a file that has no name any more: either way :class:`Swept`, and the caller makes
    another with a new name. Once our shared lock is held and the name is still ours,
    no sweeper can take it."""
    fd = os.open(path, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise Swept(errno.EAGAIN, f"{path} was taken by a sweeper as it was made") from None
        st, now = os.fstat(fd), _lstat(path)
        if now is None or (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            raise Swept(errno.ENOENT, f"{path} was removed by a sweeper as it was made")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _lstat(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except OSError:
        return None


@contextmanager
def unowned(path: str) -> Iterator[os.stat_result | None]:
    """The block runs holding ``path``'s lock exclusively if nobody else holds it: yields
    the file's stat then, None when it is owned, missing, or not a regular file of ours.

    Opened without following a link and without blocking (a FIFO planted under the
    name would block an open for reading), never created."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        yield None
        return
    got = None
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid():
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                got = st
            except OSError:
                pass  # held: its owner lives (here or in another namespace)
        yield got
    finally:
        os.close(fd)


__all__ = ["Swept", "create_locked", "unowned"]
