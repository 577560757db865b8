"""Reading ``colo.trace/1``: every line validated, with the file and line of
anything wrong (:class:`~colo.core.errors.BadTrace`, exit 2).

Forgiving in exactly one way: a run that crashed mid-write leaves its last line
cut, and that line is dropped with a warning. Strict about the rest: numbers
are finite and of sane size, JSON is at most ``MAX_DEPTH`` deep, fields have
their types, and only regular files are read (a FIFO would block forever).

:class:`TraceStream` reads line by line, so ``colo replay`` holds one event at
a time however long the trace; :func:`load_trace` keeps them all (export and
tune want them). Pure: no torch, anyio, structlog.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

from colo.proc.channel import JSONLimitError, strict_loads
from colo.core.phases import Phase
from colo.core.schema import EVENTS, RUN_ID_MAX, SCHEMA
from colo.core.errors import BadTrace

_PHASES = frozenset(p.value for p in Phase)
_EVENT_LIST = ", ".join(sorted(EVENTS))
_PHASE_LIST = ", ".join(p.value for p in Phase)

#: a line longer than this is corruption, not an event (the header with a full config is a few KiB)
MAX_LINE = 16 << 20
#: more ranks than any job has; replay makes per-rank state, tune per-device results
MAX_WORLD_SIZE = 1 << 20
#: ts and duration_s: about 31 years. Beyond it export's microseconds overflow to inf
MAX_SECONDS = 1e9
#: byte counts: below 2**63
MAX_BYTES = (1 << 63) - 1


@dataclass
class LoadedTrace:
    path: str
    events: list[dict]
    lines: list[int]  # the file's line number of each event
    truncated: bool = False
    warnings: list[str] = field(default_factory=list)

    @property
    def header(self) -> dict:
        return self.events[0]

    @property
    def rank(self) -> int:
        return self.header["rank"]

    @property
    def world_size(self) -> int:
        return self.header.get("world_size", 1)

    @property
    def run_id(self) -> str | None:
        """The run this trace is a rank of (None: written before traces carried it)."""
        return self.header.get("run_id")

    @property
    def finished(self) -> bool:
        return self.events[-1]["event"] == "trace.finished"

    @property
    def count(self) -> int:
        return len(self.events)

    @property
    def last_line(self) -> int:
        return self.lines[-1]

    def iter_events(self) -> Iterator[tuple[dict, int]]:
        return zip(self.events, self.lines)


# -- reading -------------------------------------------------------------------------

# type() rather than isinstance(): a bool is not a byte count, and this runs
# a million times on a 100k-event trace
_INT, _NUM = {int}, {int, float}


def _is_int(v: object) -> bool:
    return type(v) is int


def _is_num(v: object) -> bool:
    return type(v) in _NUM


def _bad(path: str, n: int, what: str) -> BadTrace:
    return BadTrace(f"{path}: line {n}: {what}")


def _check_phase_name(path: str, n: int, ev: dict, key: str, nullable: bool = False) -> None:
    name = ev.get(key)
    if name is None and nullable:
        return
    if type(name) is not str or name not in _PHASES:
        shown = "missing" if key not in ev else repr(name)
        raise _bad(path, n, f"{ev['event']} has {key} {shown}; expected one of {_PHASE_LIST}")


def _check_mem(path: str, n: int, ev: dict) -> None:
    mem = ev["mem"]
    by_tag = mem.get("by_tag", {}) if type(mem) is dict else None
    if not (type(by_tag) is dict and _is_bytes(mem.get("used")) and _is_bytes(mem.get("total"))
            and all(_is_bytes(v) for v in by_tag.values())):
        raise _bad(path, n, f"{ev['event']} has a malformed mem {json.dumps(mem)[:120]}; expected "
                   '{"used": int, "total": int, "by_tag": {tag: int}}, bytes >= 0')


#: a count beyond this is corruption, not a model (the checker builds lists of that length)
_MAX_COUNT = 10_000_000
#: events whose bytes and duration_s readers compute with
_TIMED = frozenset({"phase.finished", "phase.failed", "bucket.finished", "sync.finished",
                    "memory.paused", "memory.resumed"})


def _is_bytes(v: object) -> bool:
    return type(v) is int and 0 <= v <= MAX_BYTES


def _is_seconds(v: object) -> bool:
    # finite already: the parser refuses NaN, Infinity and 1e400
    return type(v) in _NUM and 0 <= v <= MAX_SECONDS


def _check_count(path: str, n: int, ev: dict, key: str) -> None:
    if key in ev and not (_is_int(ev[key]) and 0 <= ev[key] <= _MAX_COUNT):
        raise _bad(path, n, f"{ev['event']} has {key} {ev[key]!r}; expected a count in [0, {_MAX_COUNT}]")


def _check_amounts(path: str, n: int, ev: dict) -> None:
    if "bytes" in ev and not _is_bytes(ev["bytes"]):
        raise _bad(path, n, f"{ev['event']} has bytes {ev['bytes']!r}; expected an integer in [0, 2**63)")
    d = ev.get("duration_s", 0.0)
    if not _is_seconds(d):
        raise _bad(path, n, f"{ev['event']} has duration_s {d!r}; expected seconds in [0, {MAX_SECONDS:g}]")


def _check_started(path: str, n: int, ev: dict) -> None:
    if not isinstance(ev.get("device", {}), dict) or not isinstance(ev.get("config", {}), dict):
        raise _bad(path, n, "trace.started needs device and config objects, got "
                   f"device {ev.get('device')!r} config {ev.get('config')!r}")
    total = (ev.get("device") or {}).get("total_bytes")
    if total is not None and not _is_bytes(total):
        raise _bad(path, n, f"trace.started has device total_bytes {total!r}; expected an integer in [0, 2**63)")
    tags = ev.get("tags", {})
    if not isinstance(tags, dict) or not all(isinstance(v, dict) for v in tags.values()):
        raise _bad(path, n, f"trace.started has tags {json.dumps(tags)[:120]}; expected "
                   '{"owner.tag": {"bytes", "resident", "host_copy"}}')
    ev_v, tr_v = ev.get("engine_weight_version"), ev.get("trainer_weight_version", 0)
    if not (ev_v is None or _is_int(ev_v)) or not _is_int(tr_v):
        raise _bad(path, n, f"trace.started has engine_weight_version {ev_v!r} and trainer_weight_version "
                   f"{tr_v!r}; expected integers (the engine's may be null: stale)")


def _validate(path: str, n: int, ev: dict) -> None:
    """Shape, names and types; what the events *mean* is the checker's business."""
    name = ev.get("event")
    if type(name) is not str or name not in EVENTS:
        shown = "no 'event' key" if "event" not in ev else f"unknown event {name!r}"
        raise _bad(path, n, f"{shown}; expected one of {_EVENT_LIST}")
    ts = ev.get("ts")
    if not _is_num(ts):
        raise _bad(path, n, f"{name} has ts {ts!r}; expected seconds since trace.started")
    if not 0 <= ts <= MAX_SECONDS:
        raise _bad(path, n, f"{name} has ts {ts!r}; expected seconds since trace.started in [0, {MAX_SECONDS:g}]")
    if not _is_int(ev.get("rank")) or ev["rank"] < 0:
        raise _bad(path, n, f"{name} has rank {ev.get('rank')!r}; expected an integer >= 0")
    step = ev.get("step")
    if step is not None and not (_is_int(step) and step >= 0):
        raise _bad(path, n, f"{name} has step {step!r}; expected an integer >= 0")
    if name == "phase.entered":
        _check_phase_name(path, n, ev, "from_phase", nullable=True)
        _check_phase_name(path, n, ev, "to_phase")
    elif name in ("phase.finished", "phase.failed"):
        _check_phase_name(path, n, ev, "phase")
    elif name in ("memory.paused", "memory.resumed"):
        if not isinstance(ev.get("owner"), str) or not isinstance(ev.get("tag"), str):
            raise _bad(path, n, f"{name} needs string owner and tag, got owner {ev.get('owner')!r} "
                       f"tag {ev.get('tag')!r}")
    elif name == "bucket.finished":
        if not (_is_int(ev.get("bucket")) and ev["bucket"] >= 0) or not isinstance(ev.get("stage"), str):
            raise _bad(path, n, f"bucket.finished needs an integer bucket >= 0 and a stage name, got "
                       f"bucket {ev.get('bucket')!r} stage {ev.get('stage')!r}")
        _check_count(path, n, ev, "tensors")
    elif name == "sync.finished":
        for key in ("buckets", "params", "tensors"):
            _check_count(path, n, ev, key)
        v = ev.get("weight_version")
        if v is not None and not _is_int(v):
            raise _bad(path, n, f"sync.finished has weight_version {v!r}; expected an integer")
    elif name == "rollout.finished":
        if "reward" in ev and not _is_num(ev["reward"]):
            raise _bad(path, n, f"rollout.finished has reward {ev['reward']!r}; expected a number")
        _check_count(path, n, ev, "tokens")
    elif name == "trace.started":
        _check_started(path, n, ev)
    if name in _TIMED:
        _check_amounts(path, n, ev)
    if "mem" in ev:
        _check_mem(path, n, ev)


def _check_header(path: str, n: int, ev: dict) -> None:
    if ev.get("event") != "trace.started":
        raise _bad(path, n, f"the first event is {ev.get('event')!r}; expected trace.started "
                   f"(is this a {SCHEMA} trace?)")
    if "schema" not in ev:
        raise _bad(path, n, f"trace.started has no schema; expected {SCHEMA!r}")
    if ev["schema"] != SCHEMA:
        raise _bad(path, n, f"schema {ev['schema']!r}; expected {SCHEMA!r}")
    ws = ev.get("world_size", 1)
    if not (_is_int(ws) and 1 <= ws <= MAX_WORLD_SIZE):
        raise _bad(path, n, f"trace.started has world_size {ws!r}; expected an integer in [1, {MAX_WORLD_SIZE}]")
    run = ev.get("run_id")
    if run is not None and not (isinstance(run, str) and 0 < len(run) <= RUN_ID_MAX
                                and run.isascii() and run.isprintable()):
        raise _bad(path, n, f"trace.started has run_id {json.dumps(run)[:80]}; expected a string of 1 to "
                   f"{RUN_ID_MAX} printable ASCII characters")


def _open_regular(path: str) -> BinaryIO:
    """The file opened for reading, if it is a regular file. Opened non-blocking
    first: a FIFO with no writer would otherwise block ``open`` itself."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise BadTrace(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                    else "a socket" if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                    else "not a regular file")
            raise BadTrace(f"{path}: {kind}, not a regular file; expected a {SCHEMA} JSON lines file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


class TraceStream:
    """One trace file, read and validated line by line.

    The header is read when the stream is made (``rank``, ``world_size`` are
    known before any other event); :meth:`iter_events` yields every event with
    its line number, once. ``count``, ``finished``, ``truncated`` and
    ``warnings`` are complete after the iteration.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self.truncated = False
        self.warnings: list[str] = []
        self.count = 0
        self.last_line = 0
        self.finished = False
        self._fh = _open_regular(self.path)
        try:
            self._events = self._read()
            first = next(self._events, None)
        except BaseException:
            self._fh.close()
            raise
        if first is None:
            self._fh.close()
            raise BadTrace(f"{self.path}: no complete line; expected {SCHEMA} JSON lines starting with trace.started")
        self.header, self._first_line = first
        self.rank: int = self.header["rank"]
        self.world_size: int = self.header.get("world_size", 1)
        self.run_id: str | None = self.header.get("run_id")
        if self.rank >= self.world_size:
            self._fh.close()
            raise _bad(self.path, self._first_line, f"rank {self.rank} is not below world_size {self.world_size}")
        self._started = False

    def iter_events(self) -> Iterator[tuple[dict, int]]:
        if self._started:
            raise RuntimeError(f"{self.path}: a TraceStream is read once")
        self._started = True
        try:
            yield self.header, self._first_line
            for ev, n in self._events:
                if ev["rank"] != self.rank:
                    raise _bad(self.path, n, f"{ev['event']} is for rank {ev['rank']} in the trace of rank "
                               f"{self.rank} (expected one file per rank)")
                yield ev, n
            if not self.finished and not self.truncated:
                self.warnings.append(f"{self.path}: no trace.finished (the run did not end cleanly, "
                                     "or is still running)")
        finally:
            self.close()

    def close(self) -> None:
        self._fh.close()

    def __enter__(self) -> TraceStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _lines(self) -> Iterator[tuple[int, bytes]]:
        fh, path = self._fh, self.path
        head = fh.read(1 << 16)  # a PNG or a core dump says so in its first bytes
        if b"\0" in head:
            raise BadTrace(f"{path}: binary content (NUL bytes); expected {SCHEMA} JSON lines")
        fh.seek(0)
        n = 0
        while True:
            raw = fh.readline(MAX_LINE + 1)
            if not raw:
                return
            n += 1
            if len(raw) > MAX_LINE:
                raise _bad(path, n, f"longer than {MAX_LINE} bytes; expected one {SCHEMA} event per line")
            yield n, raw

    def _read(self) -> Iterator[tuple[dict, int]]:
        path = self.path
        loads = strict_loads
        seen_text = False
        for n, raw in self._lines():
            complete = raw.endswith(b"\n")  # only the last line can lack its newline
            if b"\0" in raw:
                raise _bad(path, n, f"binary content (NUL bytes); expected {SCHEMA} JSON lines")
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                if not complete:  # the cut fell inside a multi-byte character
                    self._cut(n)
                    return
                raise _bad(path, n, "not UTF-8 text; expected one colo.trace/1 event per line") from None
            if not text.strip():
                continue
            seen_text = True
            try:
                ev = loads(text)
            except JSONLimitError as e:  # a crash cuts a line short; it never makes one of these
                raise _bad(path, n, f"{e}; expected one {SCHEMA} event per line") from None
            except ValueError as e:  # JSONDecodeError
                if not complete:
                    self._cut(n)
                    return
                msg = e.msg if isinstance(e, json.JSONDecodeError) else str(e)
                raise _bad(path, n, f"not JSON ({msg}); expected one {SCHEMA} event per line") from None
            if not isinstance(ev, dict):
                raise _bad(path, n, f"a JSON {type(ev).__name__}; expected one event object per line")
            if not self.count:
                _check_header(path, n, ev)
            _validate(path, n, ev)
            self.count += 1
            self.last_line = n
            self.finished = ev["event"] == "trace.finished"
            yield ev, n
        if not seen_text:
            raise BadTrace(f"{path}: empty file; expected {SCHEMA} JSON lines starting with trace.started")

    def _cut(self, n: int) -> None:
        self.truncated = True
        self.warnings.append(f"{self.path}: line {n} is cut off (the run stopped mid-write); "
                             f"replayed the {self.count} complete lines before it")


def check_one_run(traces: list) -> None:
    """Refuse, with :class:`BadTrace`, files that are not the ranks of one run: two files of one
    rank, different world sizes, or different runs (``run_id`` of ``trace.started``; a file
    without one, written before traces carried it, cannot be told apart from a file of the same
    age, but is from one that has an id)."""
    seen: dict[int, str] = {}
    for t in traces:
        if t.rank in seen:
            raise BadTrace(f"{t.path} and {seen[t.rank]} are both rank {t.rank}; expected one file per rank")
        seen[t.rank] = t.path
    if len({t.world_size for t in traces}) > 1:
        raise BadTrace("the files disagree on world_size (" + ", ".join(
            f"{t.path}: {t.world_size}" for t in traces) + "); expected the ranks of one run")
    runs = {t.run_id for t in traces}
    if len(runs) > 1:
        first = traces[0]
        other = next(t for t in traces if t.run_id != first.run_id)

        def which(t) -> str:
            return f"run {t.run_id}" if t.run_id is not None else "no run id (an older colo wrote it)"
        raise BadTrace(f"{first.path} (rank {first.rank}) is of {which(first)} but {other.path} (rank {other.rank}) "
                       f"is of {which(other)}; expected the ranks of one run")


def load_trace(path: str | os.PathLike) -> LoadedTrace:
    """Read and validate one trace file; raise :class:`BadTrace` naming what is wrong."""
    stream = TraceStream(path)
    out = LoadedTrace(stream.path, [], [])
    for ev, n in stream.iter_events():
        out.events.append(ev)
        out.lines.append(n)
    out.truncated, out.warnings = stream.truncated, stream.warnings
    return out


__all__ = ["LoadedTrace", "TraceStream", "check_one_run", "load_trace"]
