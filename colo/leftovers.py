"""What a killed run leaves on disk, and the sweep that removes it at the next start.

A SIGKILL runs no cleanup: the driver's ``colo-demo-<pid>-XXXXXXXX`` work dir
(with the initial checkpoint), an engine socket dir ``colo-engine-<pid>-XXXXXXXX``
and ``/dev/shm/colo-<pid>-<uuid>`` segments stay. Each name carries the pid of
the process that made it, so a later run can tell a leftover (its owner is dead)
from the live state of a run beside it (its owner is alive), and remove only the
former. Only these exact name shapes are touched, only those owned by this user,
and never this process's own.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile

from colo.handles import SHM_DIR

#: ``tempfile.mkdtemp(prefix=f"colo-demo-{pid}-")``: mkdtemp adds 8 of [a-z0-9_]
_DIR_NAME = re.compile(r"^colo-(?:demo|engine)-([0-9]+)-[a-z0-9_]{8}$")
#: :meth:`colo.handles.ShmSegment.create`'s names
_SHM_NAME = re.compile(r"^colo-([0-9]+)-[0-9a-f]{32}$")


def dir_prefix(kind: str) -> str:
    """The ``mkdtemp`` prefix of a ``kind`` (demo, engine) dir this process owns."""
    return f"colo-{kind}-{os.getpid()}-"


def owner_alive(pid: int) -> bool:
    """Whether a process ``pid`` runs (another user's counts as alive). A zombie does
    not: it ran no cleanup and never will; a SIGKILLed driver is one until its parent
    reaps it, and its orphaned engine sweeps in that moment."""
    if pid <= 0:
        return True  # not a pid we wrote: leave it
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[:1] not in ([b"Z"], [b"X"])
    except OSError:
        return True  # no /proc to ask: exists, so alive


def _dead_owner(name: str, pattern: re.Pattern[str]) -> bool:
    m = pattern.match(name)
    if m is None:
        return False
    pid = int(m.group(1))
    return pid != os.getpid() and not owner_alive(pid)


def _mine(path: str) -> bool:
    try:
        return os.lstat(path).st_uid == os.getuid()
    except OSError:
        return False


def sweep(dirs: tuple[str, ...] | None = None) -> list[str]:
    """Remove colo's work dirs and segments whose owning process is dead; the paths removed.

    ``dirs``: where work dirs are looked for (default: the temp dir, and the
    short directories an engine socket dir may have fallen back to)."""
    from colo.engine.client import _SHORT_DIRS

    if dirs is None:
        dirs = tuple(dict.fromkeys([tempfile.gettempdir(), os.environ.get("XDG_RUNTIME_DIR") or "",
                                    *_SHORT_DIRS]))
    removed = []
    for base in dirs:
        try:
            names = os.listdir(base) if base else []
        except OSError:
            continue
        for name in names:
            path = os.path.join(base, name)
            if _dead_owner(name, _DIR_NAME) and _mine(path) and not os.path.islink(path) and os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
                if not os.path.exists(path):
                    removed.append(path)
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        names = []
    for name in names:
        path = os.path.join(SHM_DIR, name)
        if _dead_owner(name, _SHM_NAME) and _mine(path):
            try:
                os.unlink(path)
                removed.append(path)
            except OSError:
                pass
    return removed


__all__ = ["dir_prefix", "owner_alive", "sweep"]
