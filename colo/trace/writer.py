"""Recording ``colo.trace/1``: one JSON line per event, written through structlog.

Every line is flushed as it is written, so a run that crashes leaves a trace
whose complete lines replay; at most the last line is cut. The writer only
writes: the scheduler checks each record against the invariants before it asks
for it to be written. Listeners are passive sinks (the demo's phase summary)
that see each event after it is written; they must not raise or change state.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from colo.core.errors import TraceUnwritable, UsageError
from colo.core.schema import BUCKET_STAGES, EVENTS, SCHEMA  # noqa: F401 (re-exported)
from colo.trace.outputs import EXPECTED, kind_of, output_path

Listener = Callable[[dict], None]


def rank_path(base: str | os.PathLike, rank: int, world_size: int) -> Path:
    """One file per rank: ``run.jsonl`` for a single rank, ``run.rank1.jsonl`` otherwise."""
    base = Path(base)
    if world_size == 1:
        return base
    return base.with_name(f"{base.stem}.rank{rank}{base.suffix or '.jsonl'}")


def _event_first(_logger: Any, _name: str, event_dict: dict) -> dict:
    # structlog appends the event name last; the format reads better with it first.
    return {"event": event_dict.pop("event"), **event_dict}


#: room a trace must have on its disk before a run starts up: the header and the first
#: cycles of the demo (traces/cpu-demo.jsonl: 1.3 KiB of header, about 17 KiB a cycle). A
#: disk that is full already is then said at once, not after the engine's start-up (7 s;
#: 14 s with two ranks) and the first write
TRACE_ROOM_BYTES = 64 << 10
#: what posix_fallocate says on a filesystem that cannot reserve room (glibc's fallback
#: needs a readable fd): the first write tells instead
_CANNOT_TELL = frozenset({errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.EBADF})


def new_run_id() -> str:
    """An id for one run, unique across runs and machines (not derived from the seed: two runs
    of one seed are two runs)."""
    return uuid.uuid4().hex


class _LineSink:
    """structlog's logger for a trace: each rendered event is one line, written straight to
    the file descriptor. A buffered file would keep a line a full disk refused and raise
    again when closed; here a refused line is cut where the disk ended, as a crash cuts it."""

    def __init__(self, fd: int):
        self.fd = fd
        self._lock = threading.Lock()  # one line at a time from any thread

    def msg(self, line: str) -> None:
        data = memoryview((line + "\n").encode("utf-8"))
        with self._lock:
            while data:
                data = data[os.write(self.fd, data):]


def _lock_holder(st: os.stat_result) -> str:
    """The pid holding the ``flock`` on the file ``st`` describes, as /proc/locks lists it
    (this PID namespace's number; "unknown" where the kernel does not say)."""
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as fh:
            for line in fh:
                f = line.split()
                if len(f) >= 6 and f[1] == "FLOCK" and f[5] == key and f[4].isdigit():
                    return f[4]
    except OSError:
        pass
    return "unknown"


class TraceWriter:
    """Writes one rank's events; ``ts`` is monotonic seconds since ``trace.started``.

    The file is claimed by :meth:`open` (the demo does so before anything starts up;
    :meth:`start` does it otherwise): opened without truncating, an exclusive ``flock``
    on that open file, room for :data:`TRACE_ROOM_BYTES` asked of its disk. The lock is
    the file's own (its device and inode, whatever path spells it: a symlink, a hard
    link), and the kernel drops it with the process: a killed run leaves no lock behind,
    and nothing is made beside the trace. A second writer of the same file is refused and
    told who holds it. :meth:`start` truncates the file and writes the header; a run that
    never started gives the file back as it was (one it made is removed).

    ``follow_symlinks=False`` for a path colo derived itself (``run.rank1.jsonl``): it is
    never opened through a link nobody asked for.

    A write the disk refuses (ENOSPC) is not raised where it happens (inside a phase,
    while a bucket is in flight): it is kept as :attr:`failure` and :meth:`check` raises
    it; the scheduler calls that at each phase's end. Later events still reach the
    listeners, not the file: the file ends at the last line the disk took.
    """

    def __init__(self, path: str | os.PathLike | None, *, rank: int = 0, world_size: int = 1,
                 clock: Callable[[], float] = time.monotonic, keep_events: bool = False,
                 follow_symlinks: bool = True):
        if rank < 0 or world_size < 1 or rank >= world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank={rank} world_size={world_size}")
        self.path = Path(path) if path is not None else None
        self.rank, self.world_size = rank, world_size
        self.follow_symlinks = follow_symlinks
        self._clock = clock
        self._t0: float | None = None
        self._fd: int | None = None
        self._made = False  # this writer created the file: a run that never starts removes it
        self._log = None
        self._listeners: list[Listener] = []
        self.events: list[dict] | None = [] if keep_events else None
        self.closed = False
        self._last_ts = 0.0
        self._step: int | None = None
        self._phase: str | None = None
        #: the first write the file refused; raised by :meth:`check`
        self.failure: TraceUnwritable | None = None

    def add_listener(self, fn: Listener) -> None:
        self._listeners.append(fn)

    # -- the file --------------------------------------------------------------------
    def _unwritable(self, e: OSError, when: str) -> TraceUnwritable:
        return TraceUnwritable(f"cannot write the trace {self.path}: {e.strerror or e} ({when})",
                               errno=e.errno, step=self._step, phase=self._phase)

    def open(self) -> None:
        """Claim the trace file (see the class): refused with :class:`UsageError` if it is not
        a new path or a regular file, or another run writes it; :class:`TraceUnwritable` if
        its disk has no room. Nothing is truncated yet."""
        if self.path is None or self._fd is not None or self.closed:
            return
        path = self.path
        output_path(path, "trace", follow=self.follow_symlinks)
        flags = (os.O_WRONLY | os.O_CLOEXEC | os.O_NONBLOCK  # a FIFO put there meanwhile must not block
                 | (0 if self.follow_symlinks else os.O_NOFOLLOW))
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                fd, made = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o666), True
            except FileExistsError:
                fd, made = os.open(path, flags), False
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise self._unwritable(e, "checked before the run's start-up") from None
            if e.errno == errno.ELOOP and not self.follow_symlinks:
                raise UsageError(f"trace {path} is a symbolic link colo did not ask for (it derives this path "
                                 f"from the one given, and opens nothing through a link); {EXPECTED}") from None
            raise UsageError(f"cannot open the trace {path}: {e.strerror or e}") from None
        locked = False
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise UsageError(f"trace {path} is not a regular file ({kind_of(st.st_mode)}); {EXPECTED}")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise UsageError(f"trace {path} is being written by another run (pid {_lock_holder(st)}); "
                                 f"give this run its own --trace path") from None
            locked = True
            self._ask_for_room(fd, st.st_size)
            os.set_blocking(fd, True)
        except BaseException:
            if made and locked:
                self._remove_made(fd)
            os.close(fd)
            raise
        self._fd, self._made = fd, made

    def _ask_for_room(self, fd: int, size: int) -> None:
        try:
            os.posix_fallocate(fd, 0, max(size, TRACE_ROOM_BYTES))
        except OSError as e:
            if e.errno not in _CANNOT_TELL:
                raise self._unwritable(e, f"checked before the run's start-up: a trace needs room for "
                                          f"{TRACE_ROOM_BYTES >> 10} KiB at least") from None
        finally:
            os.ftruncate(fd, size)  # room was only asked for: the old content stays until start()

    def _remove_made(self, fd: int) -> None:
        """Remove the file this writer made, if the path still names it and it is still empty
        (called holding the lock: nobody else can have written it)."""
        try:
            mine, there = os.fstat(fd), os.lstat(self.path)
            if (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino) and mine.st_size == 0:
                os.unlink(self.path)
        except OSError:
            pass

    def _release(self, *, started: bool) -> None:
        if self._fd is None:
            return
        if not started and self._made:
            self._remove_made(self._fd)
        os.close(self._fd)  # and with it the lock
        self._fd = None

    # -- events ------------------------------------------------------------------------
    def now(self) -> float:
        return 0.0 if self._t0 is None else round(self._clock() - self._t0, 6)

    def start(self, *, device: dict, config: dict, run_id: str | None = None, **extra: Any) -> dict:
        """Write ``trace.started``. ``run_id`` is the run's, the same in every rank's trace (the
        scheduler gives one to all of its ranks); a writer started on its own makes a new one."""
        if self._t0 is not None:
            raise RuntimeError("trace already started")
        self.open()  # refused before anything is stamped if another writer owns the file
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            self._log = structlog.wrap_logger(
                _LineSink(self._fd),
                wrapper_class=structlog.BoundLogger,
                processors=[_event_first, structlog.processors.JSONRenderer(separators=(",", ":"))],
            )
        self._t0 = self._clock()
        started = self.emit("trace.started", schema=SCHEMA, world_size=self.world_size,
                            run_id=run_id if run_id is not None else new_run_id(),
                            device=device, config=config, **extra)
        self.check()
        return started

    def check(self) -> None:
        """Raise the first write the file refused, if any (:class:`TraceUnwritable`)."""
        if self.failure is not None:
            raise self.failure

    def record(self, event: str, *, at: float | None = None, **fields: Any) -> dict:
        """The event as it would be written, stamped now (or at clock reading ``at``,
        for a stage that ended earlier); nothing is written."""
        if event not in EVENTS:
            raise ValueError(f"unknown trace event {event!r}; expected one of {', '.join(sorted(EVENTS))}")
        if self._t0 is None:
            raise RuntimeError(f"trace not started: cannot write {event}")
        if self.closed:
            raise RuntimeError(f"trace already finished: cannot write {event}")
        ts = self.now() if at is None else round(at - self._t0, 6)
        # ts is monotonic in the file even when a record arrives after a later one was stamped
        ts = max(ts, self._last_ts)
        return {"event": event, "ts": ts, "rank": self.rank, **fields}

    def write(self, record: dict) -> dict:
        self._last_ts = record["ts"]
        if isinstance(record.get("step"), int):
            self._step = record["step"]
        self._phase = record.get("to_phase") or record.get("phase") or self._phase
        if self._log is not None and self.failure is None:
            body = dict(record)
            try:
                self._log.msg(body.pop("event"), **body)
            except OSError as e:
                at = f" at step {self._step}" if self._step is not None else ""
                self.failure = self._unwritable(
                    e, f"writing {record['event']}{at}" + (f" in phase {self._phase}" if self._phase else "")
                    + "; the trace holds every line before it")
        if self.events is not None:
            self.events.append(record)
        for fn in self._listeners:
            fn(record)
        return record

    def emit(self, event: str, *, at: float | None = None, **fields: Any) -> dict:
        return self.write(self.record(event, at=at, **fields))

    def finish(self) -> None:
        """Write ``trace.finished`` and let the file go; a writer that claimed the file but
        never started gives it back as it was."""
        if self.closed:
            return
        if self._t0 is None:
            self._release(started=False)
            return
        self.emit("trace.finished")
        self.closed = True
        self._release(started=True)


def read_trace(path: str | os.PathLike) -> list[dict]:
    """Every complete line of a trace (a strict reader; replay has the forgiving one)."""
    out = []
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}: line {n}: not JSON ({e.msg})") from None
    return out
