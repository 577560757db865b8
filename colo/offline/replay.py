"""``colo replay``: re-run recorded traces through the phase table and invariants 1-6.

The checker is the one the scheduler runs live (:class:`colo.core.invariants.InvariantChecker`),
so a trace that replays clean is one the scheduler would have accepted event by
event. Reading is forgiving in exactly one way: a run that crashed mid-write
leaves its last line cut, and that line is dropped with a warning. Everything
else that cannot be read (not JSON, binary, a wrong or missing schema, an
unknown event or phase name, a mistyped field, a non-finite number, an empty
file, a FIFO) is bad input: exit 2.

Traces are streamed: one event of each file is held at a time, so memory does
not grow with the length of a trace (the checker keeps one small record per
phase entered, for the cross-rank lockstep check).

Pure: no torch, no anyio, no structlog.
"""

from __future__ import annotations

import json
import os
import sys
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from colo.core.invariants import InvariantChecker
from colo.core.errors import EXIT_FAILED, EXIT_OK, BadTrace, UsageError
from colo.offline.summary import PhaseSummary
from colo.trace.reader import LoadedTrace, TraceStream, check_one_run, load_trace  # noqa: F401 (re-exported)


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


# -- checking ------------------------------------------------------------------------

class PhaseLog(Sequence):
    """The (phase, line) of every phase entered, in 16 bytes each rather than a
    tuple's ~100: a million-event trace enters a few hundred thousand phases."""

    def __init__(self) -> None:
        self._names: list[str] = []
        self._lines = array("q")
        self._canon: dict[str, str] = {}  # one string object per phase name

    def append(self, name: Any, line: int) -> None:
        name = str(name)
        self._names.append(self._canon.setdefault(name, name))
        self._lines.append(line)

    def __len__(self) -> int:
        return len(self._names)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return list(zip(self._names[i], self._lines[i]))
        return self._names[i], self._lines[i]

    def __iter__(self) -> Iterator[tuple[str, int]]:
        return zip(self._names, self._lines)


@dataclass
class FileResult:
    trace: LoadedTrace | TraceStream
    findings: list[Finding]
    summary: PhaseSummary
    phases: PhaseLog  # (phase entered, line), in order

    def as_dict(self) -> dict:
        t = self.trace
        return {"path": t.path, "rank": t.rank, "world_size": t.world_size, "run_id": t.run_id, "events": t.count,
                "truncated": t.truncated, "finished": t.finished,
                "plan": (t.header.get("config") or {}).get("plan")}


def check_trace(trace: LoadedTrace | TraceStream, checker: InvariantChecker | None = None, *,
                locate: bool = True) -> FileResult:
    """One file through the checker; ranks of one run share a checker, which
    then also holds them in lockstep (the same phases in the same order).
    ``locate=False`` leaves out the file and line the checker keeps per phase for
    naming another rank's position: for a run of one rank there is none."""
    checker = checker if checker is not None else InvariantChecker()
    summary = PhaseSummary()
    findings: list[Finding] = []
    phases = PhaseLog()
    path, rank = trace.path, trace.rank
    finished_line: int | None = None
    first: int | None = None
    for ev, n in trace.iter_events():
        if first is None:
            first = n
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
            phases.append(ev["to_phase"], n)
        for v in checker.feed(ev, n, where=f"{path} line {n}" if locate else None):
            findings.append(Finding(path, n, v.message, v.invariant, rank))
        summary.feed(ev)
    return FileResult(trace, findings, summary, phases)


def _cross_rank(results: list[FileResult]) -> tuple[list[Finding], list[str]]:
    """Ranks of one job move through the same phases in the same order."""
    findings: list[Finding] = []
    warnings: list[str] = []
    # The order of phases is the checker's (it saw every rank); what is left is
    # a rank that stops early, which only the end of its file can tell.
    ref = min(results, key=lambda r: r.trace.rank)
    for other in results:
        if other is ref:
            continue
        a, b = ref.phases, other.phases
        if any(x[0] != y[0] for x, y in zip(a, b)):
            continue  # already reported, at the first phase that differs
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
            findings.append(Finding(short.trace.path, short.trace.last_line,
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


def _missing_ranks(world_size: int, given: set[int], shown: int = 8) -> str:
    # never range(world_size) in full: a corrupt header may claim a million ranks
    out: list[int] = []
    r = 0
    while len(out) < shown and r < world_size:
        if r not in given:
            out.append(r)
        r += 1
    more = world_size - len(given) - len(out)
    return ", ".join(map(str, out)) + (f" and {more} more" if more > 0 else "")


def replay(paths: list[str | os.PathLike]) -> ReplayReport:
    """Load and check every file; raise :class:`BadTrace` for unreadable input."""
    if not paths:
        raise BadTrace("no trace given; expected one or more trace files")
    traces: list[TraceStream] = []
    try:
        for p in paths:  # headers only: the events are read as they are checked
            traces.append(TraceStream(p))
        if len(traces) > 1:
            check_one_run(traces)  # the ranks of one run: not two runs' ranks taken as one
        # checked in rank order (the lockstep check compares with lower ranks),
        # reported in the order given
        checker = InvariantChecker()
        many = len(traces) > 1
        by_rank = {id(t): check_trace(t, checker, locate=many) for t in sorted(traces, key=lambda t: t.rank)}
    finally:
        for t in traces:
            t.close()
    results = [by_rank[id(t)] for t in traces]
    findings = [f for r in results for f in r.findings]
    warnings = [w for t in traces for w in t.warnings]
    if len(results) > 1:
        more, notes = _cross_rank(results)
        findings += more
        warnings += notes
        given = {t.rank for t in traces}
        if len(given) < traces[0].world_size:
            warnings.append(f"ranks {_missing_ranks(traces[0].world_size, given)} of world_size "
                            f"{traces[0].world_size} were not given")
    return ReplayReport(results, findings, warnings)


def first_violation(paths: list[str | os.PathLike]) -> str | None:
    """The first violation replay finds in ``paths`` (with how many more), None when they replay clean."""
    report = replay(list(paths))
    if report.valid:
        return None
    rest = len(report.findings) - 1
    return report.findings[0].text(with_file=True) + (f" ({rest} more: colo replay --json lists all)" if rest else "")


def require_valid(paths: list[str | os.PathLike], command: str) -> None:
    """Refuse (:class:`UsageError`, exit 2) a trace that replay rejects, naming its first
    violation: a recommendation or an export made from a trace that breaks the phase table
    or an invariant (decreasing timestamps, a second ``trace.started``) would be made from
    events that did not happen as written. Each file is replayed on its own: ``colo tune``
    also takes the traces of different runs together (several devices)."""
    for path in paths:
        first = first_violation([path])
        if first is not None:
            raise UsageError(f"colo replay rejects this trace, so colo {command} does not read it: {first}")


# -- the command ---------------------------------------------------------------------

def _usage_error(message: str):
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
        print(f"{t.path}: valid: {t.count} events, rank {t.rank} of {t.world_size}"
              + (f", plan {plan}" if plan else "") + f", steps: {r.summary.steps}"
              + (" (cut off at the end)" if t.truncated else ""))
        print(r.summary.table())
    if many:
        n = len(report.results[0].phases)
        print(f"ranks {', '.join(str(r.trace.rank) for r in report.results)} moved through "
              f"the same phases in the same order ({n} phases on rank {report.results[0].trace.rank})")
    return EXIT_OK
