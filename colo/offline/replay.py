"""``colo replay``: re-run recorded traces through the phase table and invariants 1-6.

The checker is the one the scheduler runs live (:class:`colo.core.invariants.InvariantChecker`),
so a trace that replays clean is one the scheduler would have accepted event by
event. Reading is forgiving in exactly one way: a run that crashed mid-write
leaves its last line cut, and that line is dropped with a warning. Everything
else that cannot be read (not JSON, binary, a wrong or missing schema, an
unknown event or phase name, an empty file) is bad input: exit 2.

Pure: no torch, no anyio, no structlog.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field

from colo.core.invariants import InvariantChecker
from colo.core.phases import Phase
from colo.core.schema import EVENTS, SCHEMA
from colo.offline.summary import PhaseSummary

EXIT_OK, EXIT_FAILED = 0, 1

_PHASES = frozenset(p.value for p in Phase)
_EVENT_LIST = ", ".join(sorted(EVENTS))
_PHASE_LIST = ", ".join(p.value for p in Phase)


class BadTrace(ValueError):
    """Input that cannot be read as ``colo.trace/1`` (exit 2)."""


@dataclass(frozen=True)
class Finding:
    """One violation, located: the file, its line, the rank."""

    file: str
    line: int | None
    message: str
    invariant: int | None = None
    rank: int | None = None

    def text(self, with_file: bool) -> str:
        where = f"{self.file}: " if with_file else ""
        line = f"line {self.line}: " if self.line is not None else ""
        tag = f"invariant {self.invariant}: " if self.invariant else ""
        return f"{where}{line}{tag}{self.message}"

    def as_dict(self) -> dict:
        return {"line": self.line, "message": self.message, "invariant": self.invariant,
                "file": self.file, "rank": self.rank}


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
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as e:
        raise BadTrace(f"{path}: cannot read ({e.strerror or e})") from None
    if not data.strip():
        raise BadTrace(f"{path}: empty file; expected {SCHEMA} JSON lines starting with trace.started")
    if b"\0" in data:
        raise BadTrace(f"{path}: binary content (NUL bytes); expected {SCHEMA} JSON lines")
    # A crash cuts at most the last line: it is the one without a newline after it.
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
    last = len(raw_lines) if not data.endswith(b"\n") else -1
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
    rank = events[0]["rank"]
    for ev, n in zip(events, lines):
        if ev["rank"] != rank:
            raise _bad(path, n, f"{ev['event']} is for rank {ev['rank']} in the trace of rank {rank} "
                       "(expected one file per rank)")
    if rank >= out.world_size:
        raise _bad(path, lines[0], f"rank {rank} is not below world_size {out.world_size}")
    if not out.finished and not out.truncated:
        out.warnings.append(f"{path}: no trace.finished (the run did not end cleanly, or is still running)")
    return out


# -- checking ------------------------------------------------------------------------

@dataclass
class FileResult:
    trace: LoadedTrace
    findings: list[Finding]
    summary: PhaseSummary
    phases: list[tuple[str, int]]  # (phase entered, line), in order

    def as_dict(self) -> dict:
        t = self.trace
        return {"path": t.path, "rank": t.rank, "world_size": t.world_size, "events": len(t.events),
                "truncated": t.truncated, "finished": t.finished,
                "plan": (t.header.get("config") or {}).get("plan")}


def check_trace(trace: LoadedTrace) -> FileResult:
    checker = InvariantChecker()
    summary = PhaseSummary()
    findings: list[Finding] = []
    phases: list[tuple[str, int]] = []
    path, rank = trace.path, trace.rank
    finished_line: int | None = None
    first = trace.lines[0]
    for ev, n in zip(trace.events, trace.lines):
        name = ev["event"]
        if finished_line is not None:
            findings.append(Finding(path, n, f"{name} after trace.finished on line {finished_line} "
                                    "(expected nothing after it)", None, rank))
        if name == "trace.started" and n != first:
            findings.append(Finding(path, n, f"trace.started again (expected it once, on line {first})",
                                    None, rank))
        elif name == "trace.finished":
            finished_line = n
            st = checker.state(rank)
            if st.open:
                findings.append(Finding(path, n, f"trace.finished while phase {st.phase} is still open "
                                        f"(expected phase.finished or phase.failed for {st.phase} first)",
                                        None, rank))
        elif name == "phase.entered":
            phases.append((ev["to_phase"], n))
        for v in checker.feed(ev, n):
            findings.append(Finding(path, n, v.message, v.invariant, rank))
        summary.feed(ev)
    return FileResult(trace, findings, summary, phases)


def _cross_rank(results: list[FileResult]) -> tuple[list[Finding], list[str]]:
    """Ranks of one job move through the same phases in the same order."""
    findings: list[Finding] = []
    warnings: list[str] = []
    ref = min(results, key=lambda r: r.trace.rank)
    for other in results:
        if other is ref:
            continue
        a, b = ref.phases, other.phases
        r0, r1 = ref.trace.rank, other.trace.rank
        i = next((k for k, (x, y) in enumerate(zip(a, b)) if x[0] != y[0]), None)
        if i is not None:
            findings.append(Finding(
                other.trace.path, b[i][1],
                f"rank {r1} entered {b[i][0]} as its phase #{i + 1} but rank {r0} entered {a[i][0]} "
                f"({ref.trace.path} line {a[i][1]}); expected the same phases in the same order",
                None, r1))
            continue
        if len(a) == len(b):
            continue
        short, long_ = (ref, other) if len(a) < len(b) else (other, ref)
        k = len(short.phases)
        nxt, nxt_line = long_.phases[k]
        text = (f"rank {short.trace.rank} stops after {k} phases but rank {long_.trace.rank} "
                f"goes on to {nxt} ({long_.trace.path} line {nxt_line})")
        if short.trace.truncated or not short.trace.finished:
            warnings.append(f"{short.trace.path}: {text}; its trace ends early, so only the common "
                            "prefix was compared")
        else:
            findings.append(Finding(short.trace.path, short.trace.lines[-1],
                                    text + "; expected the same phases in the same order", None,
                                    short.trace.rank))
    return findings, warnings


@dataclass
class ReplayReport:
    results: list[FileResult]
    findings: list[Finding]
    warnings: list[str]

    @property
    def valid(self) -> bool:
        return not self.findings

    def as_dict(self) -> dict:
        return {
            "valid": self.valid,
            "violations": [f.as_dict() for f in self.findings],
            "warnings": list(self.warnings),
            "files": [r.as_dict() for r in self.results],
            "ranks": {str(r.trace.rank): r.summary.as_dict() for r in self.results},
        }


def replay(paths: list[str | os.PathLike]) -> ReplayReport:
    """Load and check every file; raise :class:`BadTrace` for unreadable input."""
    if not paths:
        raise BadTrace("no trace given; expected one or more trace files")
    traces = [load_trace(p) for p in paths]
    if len(traces) > 1:
        seen: dict[int, str] = {}
        for t in traces:
            if t.rank in seen:
                raise BadTrace(f"{t.path} and {seen[t.rank]} are both rank {t.rank}; "
                               "expected one file per rank")
            seen[t.rank] = t.path
        sizes = {t.world_size for t in traces}
        if len(sizes) > 1:
            raise BadTrace("the files disagree on world_size (" + ", ".join(
                f"{t.path}: {t.world_size}" for t in traces) + "); expected the ranks of one run")
    results = [check_trace(t) for t in traces]
    findings = [f for r in results for f in r.findings]
    warnings = [w for t in traces for w in t.warnings]
    if len(results) > 1:
        more, notes = _cross_rank(results)
        findings += more
        warnings += notes
        missing = sorted(set(range(traces[0].world_size)) - {t.rank for t in traces})
        if missing:
            warnings.append(f"ranks {', '.join(map(str, missing))} of world_size "
                            f"{traces[0].world_size} were not given")
    return ReplayReport(results, findings, warnings)


# -- the command ---------------------------------------------------------------------

def _usage_error(message: str):
    from colo.cli import UsageError  # the cli module is argparse only: still pure
    return UsageError(message)


def run_replay(args) -> int:
    try:
        report = replay(list(args.traces))
    except BadTrace as e:
        if args.json:
            print(json.dumps({"valid": False, "error": str(e), "violations": []}))
        raise _usage_error(str(e)) from None
    for w in report.warnings:
        print(f"warning: {w}", file=sys.stderr)
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
        return EXIT_OK if report.valid else EXIT_FAILED
    many = len(report.results) > 1
    if not report.valid:
        print(report.findings[0].text(with_file=many))
        rest = len(report.findings) - 1
        if rest:
            print(f"({rest} more violation{'s' if rest > 1 else ''}; --json lists all)")
        return EXIT_FAILED
    for r in report.results:
        t = r.trace
        plan = (t.header.get("config") or {}).get("plan")
        print(f"{t.path}: valid: {len(t.events)} events, rank {t.rank} of {t.world_size}"
              + (f", plan {plan}" if plan else "") + f", steps: {r.summary.steps}"
              + (" (cut off at the end)" if t.truncated else ""))
        print(r.summary.table())
    if many:
        n = len(report.results[0].phases)
        print(f"ranks {', '.join(str(r.trace.rank) for r in report.results)} moved through "
              f"the same phases in the same order ({n} phases on rank {report.results[0].trace.rank})")
    return EXIT_OK
