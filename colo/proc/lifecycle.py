"""A run's processes, and what they leave behind: one module for their whole lifetime.

colo starts processes of its own (the engine, rank workers) and makes files for
them (socket directories, work dirs, ``/dev/shm`` segments). This module holds
every rule about that lifetime, so that the engine's client, the engine's server
and the rank workers follow the same ones:

- where a socket directory goes (an AF_UNIX path is at most 107 bytes);
- how a child is started with an environment of its own (spawn copies ``os.environ``);
- how a child ends with the process that started it, however that one ends
  (:func:`die_with_parent`), and removes the run's work dir if it was the last;
- what a killed run leaves on disk and the sweep that removes it at the next
  start (:func:`sweep`).

A SIGKILL runs no cleanup: the driver's ``colo-demo-<pid>-XXXXXXXX`` work dir
(with the initial checkpoint), an engine socket dir ``colo-engine-<pid>-XXXXXXXX``,
a rank worker's ``colo-rank-*``, a disk sync's ``colo-ckpt-*``, a local Ray's
``colo-ray-*`` and ``/dev/shm/colo-<pid>-<uuid>`` segments stay. The pid in a
name does not say whose it is (a run in another PID namespace sharing ``/tmp``
and ``/dev/shm`` has pids that mean nothing here; a dead owner's pid is reused):
each of these holds a lock its owner keeps for its whole life
(:mod:`colo.proc.owner`), and the sweep removes only what it can lock. A dir
without a lock file (being made this instant, or made by an older colo) is left
alone; so is a segment whose named pid may still be its creator here (an older
colo took no lock on its segments). Only these exact name shapes are touched,
and only those owned by this user. A local Ray's dir has processes too (the
cluster a killed driver started: GCS, raylet, agents, workers, writing into it
for 10 to 90 s more): they are this user's processes that name the dir on their
command line or write a file in it, and they are ended before the dir is removed.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from colo.core.errors import ChannelError
from colo.proc.handles import SHM_DIR, unlink_opened_of, unlink_own_segments
from colo.proc.owner import TRIES, Swept, create_locked, unowned

#: what the engine binds, inside its socket directory
SOCKET_NAME = "engine.sock"
#: bytes of an AF_UNIX path, without its NUL: sun_path is 108 bytes on Linux, 104 on macOS
_SUN_PATH_MAX = 103 if sys.platform == "darwin" else 107
#: where to put the socket when $TMPDIR is too long for one: short, and present on any POSIX system
_SHORT_DIRS = ("/tmp", "/var/tmp", "/dev/shm")

#: ``tempfile.mkdtemp(prefix=f"colo-<kind>-{pid}-")``: mkdtemp adds 8 of [a-z0-9_]
_DIR_NAME = re.compile(r"^colo-(?:demo|engine|rank|ckpt|ray)-([0-9]+)-[a-z0-9_]{8}$")
#: :meth:`colo.proc.handles.ShmSegment.create`'s names; group 2, ``l``: its maker locked it
_SHM_NAME = re.compile(r"^colo-([0-9]+)-(l?)[0-9a-f]{32}$")
#: inside each dir :func:`make_dir` made: its owner holds a shared lock on it while the dir lives
LOCK_NAME = "colo.lock"
#: the dirs this process made, and the descriptor holding each one's lock
_HELD: dict[str, int] = {}


def dir_prefix(kind: str) -> str:
    """The ``mkdtemp`` prefix of a ``kind`` (demo, engine, rank, ckpt, ray) dir this process owns."""
    return f"colo-{kind}-{os.getpid()}-"


def make_dir(kind: str, base: str | None = None) -> str:
    """A new private (0700) dir ``colo-<kind>-<pid>-XXXXXXXX`` in ``base`` (default: the
    temp dir), owned by this process until :func:`release_dir` or its end: a sweep in
    any process, any PID namespace, leaves it alone while this process lives."""
    for _ in range(TRIES):
        path = tempfile.mkdtemp(prefix=dir_prefix(kind), dir=base)
        try:
            _HELD[path] = create_locked(os.path.join(path, LOCK_NAME), flags=os.O_RDONLY)
            return path
        except Swept:
            shutil.rmtree(path, ignore_errors=True)  # a sweeper's, half removed: make another
    raise OSError(errno.EAGAIN, f"no {kind} dir could be made: {TRIES} new ones were swept as they were made")


def release_dir(path: str) -> None:
    """Remove a dir :func:`make_dir` made (or one of its kind this process was handed),
    then give up its lock: held until then, so no sweeper races the removal."""
    shutil.rmtree(path, ignore_errors=True)
    fd = _HELD.pop(path, None)
    if fd is not None:
        os.close(fd)


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


#: how much later than a file's last change a process must have started to be surely
#: not the one that made it (/proc counts in clock ticks; the two clocks are read apart)
_START_SLACK_S = 1.0


def _may_have_made(pid: int, changed_at: float) -> bool:
    """Whether process ``pid`` of this namespace may have made a file last changed at
    ``changed_at`` (epoch seconds): it is alive and started before that. A process
    that started later got a dead maker's pid again."""
    if not owner_alive(pid):
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            ticks = int(f.read().rsplit(b")", 1)[-1].split()[19])  # field 22, starttime
        started = ticks / os.sysconf("SC_CLK_TCK")  # seconds after boot
        changed = changed_at - (time.time() - time.clock_gettime(time.CLOCK_BOOTTIME))
    except (OSError, ValueError, IndexError, AttributeError):
        return True  # nothing to tell them apart by: it may be
    return started <= changed + _START_SLACK_S


def _sweep_dir(path: str) -> bool:
    """Remove a dir whose lock nobody holds; whether it is gone. No lock file: left.

    A ``colo-ray-*`` dir is the temp dir of a local Ray cluster a driver started
    (:mod:`colo.ranks.ray_launcher`): its Ray processes (GCS, raylet, agents, workers)
    outlive a SIGKILLed driver by 10 to 90 s, writing into it, so they are ended
    first (:func:`end_processes_in`)."""
    if os.path.islink(path) or not os.path.isdir(path):
        return False
    with unowned(os.path.join(path, LOCK_NAME)) as st:
        if st is None or os.lstat(path).st_uid != os.getuid():
            return False
        if os.path.basename(path).startswith("colo-ray-"):
            end_processes_in(path)
        shutil.rmtree(path, ignore_errors=True)
    return not os.path.lexists(path)


def _names_path_in(text: bytes, root: bytes) -> bool:
    """Whether ``text`` holds ``root`` itself or a path inside it (``root`` ends without a
    slash; ``root-other`` is another path)."""
    start = text.find(root)
    while start >= 0:
        after = text[start + len(root):start + len(root) + 1]
        if after in (b"", b"/", b"\0"):
            return True
        start = text.find(root, start + 1)
    return False


def _writes_in(pid: int, root: str) -> bool:
    """Whether process ``pid`` has a file inside ``root`` open for writing (``/proc/<pid>/fd``
    and its ``fdinfo`` flags: a reader such as ``tail -f`` on a log does not count)."""
    fd_dir = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return False
    for fd in fds:
        try:
            target = os.readlink(os.path.join(fd_dir, fd))
            if not target.startswith(root + "/"):
                continue
            with open(f"/proc/{pid}/fdinfo/{fd}", "rb") as f:
                flags = int(f.read().split(b"flags:", 1)[1].split()[0], 8)
        except (OSError, IndexError, ValueError):
            continue
        if flags & (os.O_WRONLY | os.O_RDWR):
            return True
    return False


def processes_in(root: str) -> list[int]:
    """This user's processes (not this one) whose command line names ``root`` or a path
    inside it, or that have a file inside it open for writing: what a local Ray cluster
    started with ``root`` as its temp dir runs (its daemons name their session dir on
    their command line; its workers retitle themselves, ``ray::IDLE``, and keep their
    logs there open). A pid is no proof of who a process is (pids are reused); what it
    names and writes is."""
    root = os.path.abspath(root)
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    return [int(e) for e in entries if e.isdigit() and _runs_in(int(e), root)]


def _runs_in(pid: int, root: str) -> bool:
    """:func:`processes_in`'s test for one process (``root`` absolute)."""
    if pid == os.getpid():
        return False
    try:
        if os.stat(f"/proc/{pid}").st_uid != os.getuid():
            return False
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except OSError:
        return False
    return _names_path_in(cmdline, os.fsencode(root)) or _writes_in(pid, root)


#: how long :func:`end_processes_in` waits for the processes it killed to be gone
END_PROCESSES_S = 10.0


def end_processes_in(root: str, timeout_s: float = END_PROCESSES_S) -> list[int]:
    """SIGKILL every process :func:`processes_in` finds for ``root`` and wait (at most
    ``timeout_s``) until they and any they started meanwhile are gone or zombies; their pids.

    Each is pinned by a pidfd and checked again through it before the signal, so a pid
    that died and was handed to another process in between is not signalled."""
    root = os.path.abspath(root)
    ended: list[int] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = [p for p in processes_in(root) if owner_alive(p)]
        if not pids:
            break
        killed = [pid for pid in pids if _kill_if_still_in(pid, root)]
        ended += killed
        while any(owner_alive(p) for p in killed) and time.monotonic() < deadline:
            time.sleep(0.05)
    return ended


def _kill_if_still_in(pid: int, root: str) -> bool:
    pidfd_open = getattr(os, "pidfd_open", None)
    send = getattr(signal, "pidfd_send_signal", None)
    if pidfd_open is None or send is None:  # no pidfds (macOS, an old kernel): the pid, re-checked
        if not _runs_in(pid, root):
            return False
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            return False
        return True
    try:
        fd = pidfd_open(pid)
    except OSError:
        return False  # gone
    try:
        if not _runs_in(pid, root):  # the pidfd's process is this pid's now: still one of them?
            return False
        send(fd, signal.SIGKILL)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _sweep_segment(path: str, pid: int, locked: bool) -> bool:
    """Remove a segment whose lock nobody holds: its maker, who locked it as it made it
    (``locked``, its name says so), has ended. An older colo locked no segment, so one of
    its segments is left while its named pid may be its maker (:func:`_may_have_made`); a
    segment of ours needs no such guess, which compares two clocks and a second's slack
    (CI once kept a dead owner's segment so, its pid handed to a process that started
    1.5 s later)."""
    with unowned(path) as st:
        if st is None or not locked and _may_have_made(pid, st.st_ctime):
            return False
        try:
            os.unlink(path)
        except OSError:
            return False
    return True


def sweep(dirs: tuple[str, ...] | None = None) -> list[str]:
    """Remove colo's dirs and segments that nobody owns any more (their owner's lock is
    free: it ended); the paths removed.

    ``dirs``: where dirs are looked for (default: the temp dir, ``$RAY_TMPDIR``, and the
    short directories an engine socket dir or a local Ray's dir may have fallen back to).
    A dead driver's local Ray cluster goes with its dir: its processes are ended first."""
    if dirs is None:
        dirs = tuple(_swept_bases())
    removed = []
    for base in dirs:
        try:
            names = os.listdir(base) if base else []
        except OSError:
            continue
        for name in names:
            path = os.path.join(base, name)
            if _DIR_NAME.match(name) and _sweep_dir(path):
                removed.append(path)
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        names = []
    for name in names:
        m = _SHM_NAME.match(name)
        path = os.path.join(SHM_DIR, name)
        if m and _sweep_segment(path, int(m.group(1)), locked=m.group(2) == "l"):
            removed.append(path)
    return removed


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of ``pid`` (``R``, ``S``, ``D``, ``T``, ``Z`` ...),
    from ``/proc/<pid>/stat``; None where there is no such process or no /proc."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        return None
    fields = text.rsplit(b")", 1)[-1].split()  # the command name in (...) may hold spaces
    return fields[0].decode("ascii", "replace") if fields else None


#: how often a request waiting on a process of ours looks at it, and how long that process may
#: be seen stopped (SIGSTOP, a job-control stop) before it counts as dead
HEARTBEAT_S = 0.5
STOPPED_LIMIT_S = 3.0


async def stopped_for(pid: int | Sequence[int] | None) -> float:
    """Return once process ``pid`` (or any of several) has been seen stopped (state ``T``) for
    :data:`STOPPED_LIMIT_S`, with how long; while it runs, never.

    The heartbeat asks the kernel, not the process: a process of ours serves one request
    at a time, so a ping would wait behind a legitimately long one, and a busy process
    (running, sleeping, in I/O) is not a stopped one. A stopped process keeps its end of
    every socket open, so without this a request waits out its phase deadline."""
    import anyio

    pids = () if pid is None else (pid,) if isinstance(pid, int) else tuple(pid)
    since: float | None = None
    while True:
        await anyio.sleep(HEARTBEAT_S)
        if not any(process_state(p) in ("T", "t") for p in pids):
            since = None
            continue
        now = anyio.current_time()
        since = now if since is None else since
        if now - since >= STOPPED_LIMIT_S:
            return now - since


async def unless_stopped(pid: int | Sequence[int] | None, request: Any) -> tuple[Any, float | None]:
    """``(await request(), None)``, or ``(None, seconds)`` when process ``pid`` (or one of
    several) stayed stopped for :data:`STOPPED_LIMIT_S` first (the request is then cancelled;
    the caller kills it)."""
    import anyio

    out: list[Any] = []
    stopped: list[float] = []
    failed: list[Exception] = []

    async def watch(scope: Any) -> None:
        stopped.append(await stopped_for(pid))
        scope.cancel()

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch, tg.cancel_scope)
        try:
            out.append(await request())
        except Exception as e:  # raised below, outside the group: it would wrap it in an ExceptionGroup
            failed.append(e)
        tg.cancel_scope.cancel()
    if failed:
        raise failed[0]
    if out:
        return out[0], None
    return None, stopped[0]



def _bases(first: str | None = None) -> list[str]:
    """Where :func:`make_short_dir` tries, in order: ``first``, ``$TMPDIR``, ``$XDG_RUNTIME_DIR``,
    the short system dirs."""
    candidates = [first, tempfile.gettempdir(), os.environ.get("XDG_RUNTIME_DIR"), *_SHORT_DIRS]
    return list(dict.fromkeys(os.path.abspath(b) for b in candidates if b))


def _swept_bases() -> list[str]:
    """Where colo's dirs may be: :func:`_bases`, and ``$RAY_TMPDIR``, where a local Ray
    cluster's dir goes first (:mod:`colo.ranks.ray_launcher`)."""
    return list(dict.fromkeys([*_bases(), *_bases(os.environ.get("RAY_TMPDIR"))]))


def make_short_dir(kind: str, suffix: str, first: str | None = None) -> str:
    """:func:`make_dir` in the first of ``first`` (if given), ``$TMPDIR``, ``$XDG_RUNTIME_DIR``
    (per user, 0700) and the usual short system directories where it can be made and where
    ``suffix`` (the rest of the longest AF_UNIX path that will be made in it, after
    ``colo-<kind>-<pid>-XXXXXXXX``) still fits: a long ``$TMPDIR`` (a CI runner's, a
    notebook's) does not fit the 107 bytes Linux allows. :class:`OSError` if none does."""
    name = dir_prefix(kind) + "XXXXXXXX"  # mkdtemp adds 8 characters
    for base in _bases(first):
        if len(os.fsencode(os.path.join(base, name) + suffix)) > _SUN_PATH_MAX:
            continue
        try:
            return make_dir(kind, base)
        except OSError:
            continue
    raise OSError(errno.ENAMETOOLONG, f"an AF_UNIX path is at most {_SUN_PATH_MAX} bytes and none of "
                  f"{', '.join(_bases(first))} is short enough and writable; set TMPDIR to a short directory")


def socket_dir() -> str:
    """A new private (0700) directory whose ``engine.sock.tmp`` fits in an AF_UNIX path,
    owned by this process until :func:`release_dir` (:func:`make_short_dir`)."""
    try:
        return make_short_dir("engine", "/" + SOCKET_NAME + ".tmp")
    except OSError as e:
        raise ChannelError(f"no directory for the engine's socket: {e.strerror or e}") from None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago, for a library that takes a port
    number and listens on it itself (checkpoint-engine's ``ParameterServer`` in
    ``bench/peer.py``); another process may take it meanwhile, so colo's own process
    groups meet at a store instead (:mod:`colo.proc.rendezvous`)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextmanager
def scoped_env(values: Mapping[str, str | None] | None) -> Iterator[None]:
    """``os.environ`` with ``values`` set (None: unset) for the block, then as it was."""
    values = values or {}
    saved = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def start_with_env(proc: Any, env: dict[str, str] | None) -> Any:
    """``proc.start()`` with ``env`` added to the child's environment only, and SIGINT
    blocked in the child from its first instruction (:func:`leave_interrupts_to_parent`)."""
    # a spawned child copies os.environ at start(): set it for that moment only. Ctrl-C
    # sends SIGINT to the whole process group: a child that took it would die with a
    # KeyboardInterrupt traceback while its parent cancels the run. A blocked signal
    # stays blocked across fork and exec, so the child cannot take one even while it
    # imports; its entry point then ignores it and unblocks (multiprocessing starts its
    # resource tracker the same way). Blocked here only in this thread: a Ctrl-C to
    # this process meanwhile is taken by another thread or waits, never lost.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}) if _HAVE_SIGMASK else None
    try:
        with scoped_env(env):
            proc.start()
    finally:
        if blocked is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    return proc


_HAVE_SIGMASK = hasattr(signal, "pthread_sigmask")


def leave_interrupts_to_parent() -> None:
    """In a process colo started: SIGINT is its parent's to act on (it cancels the run
    and ends this process through its own cleanup), so ignore it, then unblock it
    (:func:`start_with_env` started this process with it blocked)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    if _HAVE_SIGMASK:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


# -- a child's own log -------------------------------------------------------------

_LOG: Any = None  # a file opened by open_log() when the starter asked for one


def open_log(path: str | None) -> None:
    """Send this process's :func:`log` lines to ``path`` (appended) instead of stderr."""
    global _LOG
    if path:
        try:
            _LOG = open(path, "a", encoding="utf-8")
        except OSError as e:  # a log is no reason not to run: its lines go to stderr instead
            log("log.unwritable", path=path, error=e.strerror or str(e))


def log(event: str, **fields: Any) -> None:
    """One JSON line, to the starter's log file or to stderr; flushed so a killed process
    leaves its last words behind. Never raises: a log whose disk filled up (or that was
    closed under it) is no reason for an engine to die mid-run with a traceback; its lines
    go to stderr from then on, after one saying so."""
    global _LOG
    line = json.dumps({"event": event, "pid": os.getpid(), **fields})
    if _LOG is not None:
        try:
            print(line, file=_LOG, flush=True)
            return
        except (OSError, ValueError) as e:
            lost, _LOG = _LOG, None
            with contextlib.suppress(OSError, ValueError):
                lost.close()
            _to_stderr(json.dumps({"event": "log.unwritable", "pid": os.getpid(), "path": getattr(lost, "name", "?"),
                                   "error": getattr(e, "strerror", None) or str(e)}))
    _to_stderr(line)


def _to_stderr(line: str) -> None:
    with contextlib.suppress(OSError, ValueError):  # a closed or broken stderr: nowhere left to say it
        print(line, file=sys.stderr, flush=True)


# -- a child ends with its parent ---------------------------------------------------

#: how often the engine checks that the process that started it is still there
PARENT_POLL_S = 0.2
#: after asking itself to stop (the parent is gone), how long the engine waits for its
#: own cleanup before leaving without it
ORPHAN_GRACE_S = 5.0
_PR_SET_PDEATHSIG = 1


def _on_sigterm(signum: int, frame: Any) -> None:
    # SystemExit unwinds serve(): its finally closes the receivers and removes the socket dir.
    # One is enough: the parent-death signal and the watchdog can both send one, and a
    # second SystemExit raised inside that cleanup would cut it short (a dir left behind).
    # For the same reason a first one that lands once the last clean-up has begun is only
    # noted: an engine shut down by its rank worker is in that clean-up when the worker,
    # killed with its driver, dies and its parent-death signal comes (under load, 3 runs
    # in 12 of a two-rank demo SIGKILLed mid-sync left their engine dirs so).
    global _SIGNALLED
    _SIGNALLED = True
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if not _CLEANING:
        raise SystemExit(128 + signum)


def serve_then_end(body: Callable[[], None], sock_path: str) -> None:
    """A started process's whole life: ``body``, then :func:`end_of_process` however it
    ended, whole even when a SIGTERM lands in the instant between the two (before
    ``end_of_process`` marks its clean-up begun: it is then run again, and the exit follows)."""
    try:
        body()
    finally:
        try:
            end_of_process(sock_path)
        except SystemExit:
            end_of_process(sock_path)
            raise


def end_of_process(sock_path: str) -> None:
    """What a process colo started (an engine, a rank worker) does last, however its
    work ended: remove its socket dir and every segment it made that is still there
    (:func:`colo.proc.handles.unlink_own_segments`: its main thread may not have got
    to its own cleanup), and, an orphan, its run's dir and what dead owners left.
    A SIGTERM from here on does not cut it short (:func:`_on_sigterm`)."""
    global _CLEANING
    _CLEANING = True
    remove_sockdir(sock_path)
    unlink_own_segments()
    remove_run_dir_if_orphaned()


def remove_sockdir(sock_path: str) -> None:
    d = os.path.dirname(os.path.abspath(sock_path))
    if os.path.basename(d).startswith("colo-engine-"):  # only the directory made for this engine
        shutil.rmtree(d, ignore_errors=True)


#: the run dirs an orphan removes (remove_run_dir_if_orphaned): a driver's work dir, a rank worker's
_RUN_DIRS = ("colo-demo-", "colo-rank-")
#: (the parent pid this process watches, the run's work dir): see remove_run_dir_if_orphaned
_ORPHAN: tuple[int | None, str | None] = (None, None)
#: a SIGTERM (the parent-death signal, the watchdog, a kill) is ending this process
_SIGNALLED = False
#: this process's last clean-up (end_of_process) has begun
_CLEANING = False


#: how long an orphan keeps sweeping for its dead parent's segments (see below)
ORPHAN_SWEEP_S = 3.0


def _shm_names() -> list[str]:
    try:
        return os.listdir(SHM_DIR)
    except OSError:
        return []


def remove_run_dir_if_orphaned() -> None:
    """The process that started this one died without its own cleanup (SIGKILL): the
    processes it started are the last of it, and the last thing they do is remove its
    run dir, where it has one (a driver's ``colo-demo-*``, a rank worker's ``colo-rank-*``;
    never a path of another shape), and sweep what dead owners left (:func:`sweep`: its
    segments, its dirs)."""
    parent_pid, run_dir = _ORPHAN
    if not _SIGNALLED or parent_pid is None:
        return
    # The parent-death signal comes when the parent's *thread* ends, which can be a
    # moment before its process is gone: wait a little for that, never long.
    # Re-parenting comes while the parent is still exiting, before it is a zombie: the
    # sweep below would take it for alive and keep its segments, so wait for that too.
    deadline = time.monotonic() + 2.0
    while not _parent_gone(parent_pid) or owner_alive(parent_pid):
        if time.monotonic() > deadline:
            return  # the parent lives: the dir is still its own
        time.sleep(0.05)
    # the dead parent's segments this process was sent: gone by name, proven by the
    # parent's death, not by a lock a descendant of it may still hold
    unlink_opened_of(parent_pid)
    if run_dir and os.path.basename(os.path.normpath(run_dir)).startswith(_RUN_DIRS):
        shutil.rmtree(run_dir, ignore_errors=True)
    # and what the next run's start-up sweep would remove: the dead parent's staging
    # segments (this process had them mapped), dirs of runs whose owner is gone. Also
    # without a run dir: a rank worker's engine rank has none, and a worker killed (or
    # stopped, then killed by the driver) mid-sync leaves segments it had not sent yet. A
    # lock can outlive the parent's pid by a moment (a process it forked, which inherited
    # the descriptor, still ending; or the parent's own threads, such as a disk sync's
    # writer, still exiting after its main thread is a zombie: descriptors close with the
    # last thread; a disk run's checkpoint dir was seen left so without this): sweep
    # again while a segment or dir named for the dead parent is there, for a bounded
    # time; what is still locked then is someone's.
    sweep()
    deadline = time.monotonic() + ORPHAN_SWEEP_S
    while time.monotonic() < deadline and _named_for(parent_pid):
        time.sleep(0.1)
        sweep()


def _named_for(pid: int) -> bool:
    """Whether a segment or a dir that :func:`sweep` would look at is named for ``pid``."""
    if any(n.startswith(f"colo-{pid}-") for n in _shm_names()):
        return True
    for base in _swept_bases():
        try:
            names = os.listdir(base)
        except OSError:
            continue
        if any((m := _DIR_NAME.match(n)) and int(m.group(1)) == pid for n in names):
            return True
    return False


def _parent_gone(parent_pid: int) -> bool:
    """Re-parented, or the parent is a zombie or gone (Linux's /proc; elsewhere: re-parented only)."""
    if os.getppid() != parent_pid:
        return True
    try:
        with open(f"/proc/{parent_pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return sys.platform.startswith("linux")
    return state in ("Z", "X")


def die_with_parent(parent_pid: int | None, sock_path: str, run_dir: str | None = None) -> None:
    """End this engine when the process that started it ends, however it ends.

    Linux's parent-death signal (SIGTERM, handled as a clean exit) fires when the
    *thread* that forked this process ends, not the process, and only on Linux;
    so a watchdog thread also compares the parent pid with the one the client
    passed, and stops the engine when it changed (re-parented to init or a
    subreaper). If the clean exit does not come within ``ORPHAN_GRACE_S`` (the
    main thread stuck in a native call), the watchdog removes the socket
    directory itself and leaves. An orphan also removes ``run_dir``, the driver's
    work dir, which a driver killed outright could not.
    """
    global _ORPHAN
    _ORPHAN = (parent_pid, run_dir)
    leave_interrupts_to_parent()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # the watchdog below still covers it
    if parent_pid is None:
        return

    def watch() -> None:
        global _SIGNALLED
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        log("engine.orphaned", parent_pid=parent_pid, new_parent_pid=os.getppid())
        # set here too: a main thread stuck in a native call never runs the handler,
        # and the leftovers below must still go
        _SIGNALLED = True
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(ORPHAN_GRACE_S)
        # the main thread is still inside a step (waiting on a peer that left, an engine
        # that does not answer): os._exit runs none of its cleanup, so this does it
        end_of_process(sock_path)
        os._exit(1)

    threading.Thread(target=watch, name="colo-engine-parent-watch", daemon=True).start()
