"""Reading ``colo.trace/1``: every line validated, with the file and line of
anything wrong (:class:`~colo.errors.BadTrace`, exit 2).

Forgiving in exactly one way: a run that crashed mid-write leaves its last line
cut, and that line is dropped with a warning. Pure: no torch, anyio, structlog.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from colo.core.phases import Phase
from colo.core.schema import EVENTS, SCHEMA
from colo.errors import BadTrace

_PHASES = frozenset(p.value for p in Phase)
_EVENT_LIST = ", ".join(sorted(EVENTS))
_PHASE_LIST = ", ".join(p.value for p in Phase)


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
    def finished(self) -> bool:
        return self.events[-1]["event"] == "trace.finished"


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
    if not (type(by_tag) is dict and type(mem.get("used")) is int and type(mem.get("total")) is int
            and set(map(type, by_tag.values())) <= _INT):
        raise _bad(path, n, f"{ev['event']} has a malformed mem {json.dumps(mem)[:120]}; expected "
                   '{"used": int, "total": int, "by_tag": {tag: int}}')


#: a count beyond this is corruption, not a model (the checker builds lists of that length)
_MAX_COUNT = 10_000_000
#: events whose bytes and duration_s readers compute with
_TIMED = frozenset({"phase.finished", "phase.failed", "bucket.finished", "sync.finished",
                    "memory.paused", "memory.resumed"})


def _check_count(path: str, n: int, ev: dict, key: str) -> None:
    if key in ev and not (_is_int(ev[key]) and 0 <= ev[key] <= _MAX_COUNT):
        raise _bad(path, n, f"{ev['event']} has {key} {ev[key]!r}; expected a count in [0, {_MAX_COUNT}]")


def _check_amounts(path: str, n: int, ev: dict) -> None:
    if "bytes" in ev and not (_is_int(ev["bytes"]) and ev["bytes"] >= 0):
        raise _bad(path, n, f"{ev['event']} has bytes {ev['bytes']!r}; expected an integer >= 0")
    d = ev.get("duration_s", 0.0)
    if not (_is_num(d) and d >= 0):
        raise _bad(path, n, f"{ev['event']} has duration_s {d!r}; expected seconds >= 0")


def _check_started(path: str, n: int, ev: dict) -> None:
    if not isinstance(ev.get("device", {}), dict) or not isinstance(ev.get("config", {}), dict):
        raise _bad(path, n, "trace.started needs device and config objects, got "
                   f"device {ev.get('device')!r} config {ev.get('config')!r}")
    tags = ev.get("tags", {})
    if not isinstance(tags, dict) or not all(isinstance(v, dict) for v in tags.values()):
        raise _bad(path, n, f"trace.started has tags {json.dumps(tags)[:120]}; expected "
                   '{"owner.tag": {"bytes", "resident", "host_copy"}}')
    ev_v, tr_v = ev.get("engine_weight_version"), ev.get("trainer_weight_version", 0)
    if not (ev_v is None or _is_int(ev_v)) or not _is_int(tr_v):
        raise _bad(path, n, f"trace.started has engine_weight_version {ev_v!r} and trainer_weight_version "
                   f"{tr_v!r}; expected integers (the engine's may be null: stale)")


def _validate(path: str, n: int, ev: dict) -> None:
    """Shape and names only; what the events *mean* is the checker's business."""
    name = ev.get("event")
    if type(name) is not str or name not in EVENTS:
        shown = "no 'event' key" if "event" not in ev else f"unknown event {name!r}"
        raise _bad(path, n, f"{shown}; expected one of {_EVENT_LIST}")
    if not _is_num(ev.get("ts")):
        raise _bad(path, n, f"{name} has ts {ev.get('ts')!r}; expected seconds since trace.started")
    if not _is_int(ev.get("rank")) or ev["rank"] < 0:
        raise _bad(path, n, f"{name} has rank {ev.get('rank')!r}; expected an integer >= 0")
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
        if not _is_int(ev.get("bucket")) or not isinstance(ev.get("stage"), str):
            raise _bad(path, n, f"bucket.finished needs an integer bucket and a stage name, got "
                       f"bucket {ev.get('bucket')!r} stage {ev.get('stage')!r}")
        _check_count(path, n, ev, "tensors")
    elif name == "sync.finished":
        for key in ("buckets", "params", "tensors"):
            _check_count(path, n, ev, key)
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
    if not _is_int(ws) or ws < 1:
        raise _bad(path, n, f"trace.started has world_size {ws!r}; expected an integer >= 1")


def load_trace(path: str | os.PathLike) -> LoadedTrace:
    """Read and validate one trace file; raise :class:`BadTrace` naming what is wrong."""
    path = os.fspath(path)
    raw_lines, last = _read_lines(path)
    out = _parse(path, raw_lines, last)
    rank = out.rank
    for ev, n in zip(out.events, out.lines):
        if ev["rank"] != rank:
            raise _bad(path, n, f"{ev['event']} is for rank {ev['rank']} in the trace of rank {rank} "
                       "(expected one file per rank)")
    if rank >= out.world_size:
        raise _bad(path, out.lines[0], f"rank {rank} is not below world_size {out.world_size}")
    if not out.finished and not out.truncated:
        out.warnings.append(f"{path}: no trace.finished (the run did not end cleanly, or is still running)")
    return out


def _read_lines(path: str) -> tuple[list[str], int]:
    """The file's lines, and the number of the last one if it has no newline (a
    crash cuts at most that one), else -1."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as e:
        raise BadTrace(f"{path}: cannot read ({e.strerror or e})") from None
    if not data.strip():
        raise BadTrace(f"{path}: empty file; expected {SCHEMA} JSON lines starting with trace.started")
    if b"\0" in data:
        raise BadTrace(f"{path}: binary content (NUL bytes); expected {SCHEMA} JSON lines")
    cut_tail = ""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        end = data.rfind(b"\n") + 1
        if e.start < end or data.endswith(b"\n"):
            n = data.count(b"\n", 0, e.start) + 1
            raise _bad(path, n, "not UTF-8 text; expected one colo.trace/1 event per line") from None
        # the cut fell inside a multi-byte character of the last line
        text, cut_tail = data[:end].decode("utf-8"), "\ufffd"
    raw_lines = text.split("\n")
    if cut_tail:
        raw_lines[-1] = cut_tail
    return raw_lines, (len(raw_lines) if not data.endswith(b"\n") else -1)


def _parse(path: str, raw_lines: list[str], last: int) -> LoadedTrace:
    events: list[dict] = []
    lines: list[int] = []
    out = LoadedTrace(path, events, lines)
    loads = json.JSONDecoder().decode
    for n, raw in enumerate(raw_lines, 1):
        if not raw.strip():
            continue
        try:
            ev = loads(raw)
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError alike
            if n == last:
                out.truncated = True
                out.warnings.append(f"{path}: line {n} is cut off (the run stopped mid-write); "
                                    f"replayed the {len(events)} complete lines before it")
                break
            msg = e.msg if isinstance(e, json.JSONDecodeError) else "not UTF-8 text"
            raise _bad(path, n, f"not JSON ({msg}); expected one {SCHEMA} event per line") from None
        if not isinstance(ev, dict):
            raise _bad(path, n, f"a JSON {type(ev).__name__}; expected one event object per line")
        if not events:
            _check_header(path, n, ev)
        _validate(path, n, ev)
        events.append(ev)
        lines.append(n)
    if not events:
        raise BadTrace(f"{path}: no complete line; expected {SCHEMA} JSON lines starting with trace.started")
    return out
