"""Recording ``colo.trace/1``: one JSON line per event, written through structlog.

Every line is flushed as it is written, so a run that crashes leaves a trace
whose complete lines replay; at most the last line is cut. The writer only
writes: the scheduler checks each record against the invariants before it asks
for it to be written. Listeners are passive sinks (the demo's phase summary)
that see each event after it is written; they must not raise or change state.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import structlog

from colo.core.errors import UsageError
from colo.core.schema import BUCKET_STAGES, EVENTS, SCHEMA  # noqa: F401 (re-exported)

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


class TraceWriter:
    """Writes one rank's events; ``ts`` is monotonic seconds since ``trace.started``."""

    def __init__(self, path: str | os.PathLike | None, *, rank: int = 0, world_size: int = 1,
                 clock: Callable[[], float] = time.monotonic, keep_events: bool = False):
        if rank < 0 or world_size < 1 or rank >= world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank={rank} world_size={world_size}")
        self.path = Path(path) if path is not None else None
        self.rank, self.world_size = rank, world_size
        self._clock = clock
        self._t0: float | None = None
        self._fh: IO[str] | None = None
        self._log = None
        self._listeners: list[Listener] = []
        self.events: list[dict] | None = [] if keep_events else None
        self.closed = False
        self._last_ts = 0.0
        self._lock_fd: int | None = None
        self._lock_path: Path | None = None

    def add_listener(self, fn: Listener) -> None:
        self._listeners.append(fn)

    def _lock(self) -> None:
        """Own the trace file before truncating it: an exclusive ``flock`` on the
        sibling ``<name>.lock``, holding this process's pid. A second writer of the
        same path (another run, or another writer in this process) is refused and
        told who holds it. The lock file is removed when the trace is finished; a
        run that crashed leaves it, unlocked, and the next run takes it over."""
        lock_path = self.path.with_name(self.path.name + ".lock")
        while True:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "unknown"
                os.close(fd)
                raise UsageError(f"trace {self.path} is being written by another run (pid {holder}); "
                                 f"give this run its own --trace path") from None
            try:
                same = os.fstat(fd).st_ino == os.stat(lock_path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # its holder removed the file as we opened it: take the new one
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd, self._lock_path = fd, lock_path

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            try:
                os.unlink(self._lock_path)  # while still held: a waiter re-checks the inode
            except FileNotFoundError:
                pass
            os.close(self._lock_fd)
            self._lock_fd = None

    def _open(self) -> None:
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._lock()
            self._fh = open(self.path, "w", encoding="utf-8")
            # structlog's WriteLogger writes and flushes each line under a lock.
            self._log = structlog.wrap_logger(
                structlog.WriteLogger(self._fh),
                wrapper_class=structlog.BoundLogger,
                processors=[_event_first, structlog.processors.JSONRenderer(separators=(",", ":"))],
            )

    def now(self) -> float:
        return 0.0 if self._t0 is None else round(self._clock() - self._t0, 6)

    def start(self, *, device: dict, config: dict, **extra: Any) -> dict:
        if self._t0 is not None:
            raise RuntimeError("trace already started")
        self._open()  # refused before anything is stamped if another writer owns the path
        self._t0 = self._clock()
        return self.emit("trace.started", schema=SCHEMA, world_size=self.world_size,
                         device=device, config=config, **extra)

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
        if self._log is not None:
            body = dict(record)
            self._log.msg(body.pop("event"), **body)
        if self.events is not None:
            self.events.append(record)
        for fn in self._listeners:
            fn(record)
        return record

    def emit(self, event: str, *, at: float | None = None, **fields: Any) -> dict:
        return self.write(self.record(event, at=at, **fields))

    def finish(self) -> None:
        if self._t0 is None or self.closed:
            return
        self.emit("trace.finished")
        self.closed = True
        if self._fh is not None:
            self._fh.close()
        self._unlock()


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
