"""A per-phase summary of one rank's ``colo.trace/1`` events (pure).

Fed event by event, so the same object serves a live run (the demo's
end-of-run table, as a trace listener) and ``colo replay``::

    summary = PhaseSummary()
    for event in events:
        summary.feed(event)
    print(summary.table())
    summary.as_dict()

One summary describes one rank: memory peaks are per device, so events of
several ranks must go to one summary each.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from colo.core.memory import fmt_bytes
from colo.core.phases import Phase

#: the label of memory seen before the first phase (the engine's start-up)
START = "start"


@dataclass
class PhaseStats:
    count: int = 0  # phases that ended (finished or failed)
    failed: int = 0
    seconds: float = 0.0


@dataclass
class Peak:
    bytes: int = -1
    phase: str = START
    ts: float = 0.0
    step: int | None = None


@dataclass
class PhaseSummary:
    phases: dict[str, PhaseStats] = field(default_factory=dict)
    peaks: dict[str, Peak] = field(default_factory=dict)  # by tag, plus "used" and "reserved"
    total_bytes: int | None = None
    sync_count: int = 0
    sync_bytes: int = 0
    sync_seconds: float = 0.0
    steps: int = 0
    events: int = 0
    first_ts: float | None = None
    last_ts: float = 0.0
    errors: list[dict] = field(default_factory=list)
    _phase: str = START
    _step: int | None = None
    _entered_ts: float = 0.0

    def feed(self, ev: dict) -> None:
        self.events += 1
        name = ev.get("event")
        ts = ev.get("ts")
        if isinstance(ts, (int, float)):
            if self.first_ts is None:
                self.first_ts = float(ts)
            self.last_ts = max(self.last_ts, float(ts))
        if isinstance(ev.get("step"), int):
            self._step = ev["step"]
            self.steps = max(self.steps, ev["step"] + 1)
        if name == "trace.started":
            total = (ev.get("device") or {}).get("total_bytes")
            if isinstance(total, int):
                self.total_bytes = total
        elif name == "phase.entered":
            self._phase = str(ev.get("to_phase"))
            self._entered_ts = float(ts) if isinstance(ts, (int, float)) else self.last_ts
        self._memory(ev)
        if name in ("phase.finished", "phase.failed"):
            stats = self.phases.setdefault(str(ev.get("phase")), PhaseStats())
            stats.count += 1
            d = ev.get("duration_s")
            # duration_s is the scheduler's own clock around the body; the ts
            # difference is the fallback for writers that do not record it.
            stats.seconds += float(d) if isinstance(d, (int, float)) else max(0.0, self.last_ts - self._entered_ts)
            if name == "phase.failed":
                stats.failed += 1
                self.errors.append({k: ev.get(k) for k in ("ts", "step", "phase", "error", "error_type",
                                                           "oom_tag", "oom_requested", "oom_free")
                                    if ev.get(k) is not None})
        elif name == "sync.finished":
            self.sync_count += 1
            if isinstance(ev.get("bytes"), int):
                self.sync_bytes += ev["bytes"]
            if isinstance(ev.get("duration_s"), (int, float)):
                self.sync_seconds += float(ev["duration_s"])

    def _memory(self, ev: dict) -> None:
        mem = ev.get("mem")
        if not isinstance(mem, dict):
            return
        by_tag = mem.get("by_tag") or {}
        if self.total_bytes is None and isinstance(mem.get("total"), int):
            self.total_bytes = mem["total"]
        ts = ev.get("ts", self.last_ts)
        peaks = self.peaks
        tagged = 0
        for key, value in by_tag.items():
            tagged += value
            self._bump(peaks, key, value, ts)
        used = mem.get("used")
        if isinstance(used, int):
            self._bump(peaks, "used", used, ts)
            # what no tag accounts for: the CUDA context, communicator buffers,
            # the allocator's cache; it can grow during a run, and tune cares.
            self._bump(peaks, "reserved", used - tagged, ts)

    def _bump(self, peaks: dict, key: str, value: int, ts: float) -> None:
        peak = peaks.get(key)
        # strictly greater: the first event that reaches a peak names the phase,
        # not a later one that merely carries the same snapshot
        if peak is None or value > peak.bytes:
            peaks[key] = Peak(value, self._phase, float(ts), self._step)

    # -- reading -----------------------------------------------------------------
    @property
    def sync_gb_per_s(self) -> float | None:
        if self.sync_seconds <= 0:
            return None
        return self.sync_bytes / self.sync_seconds / 1e9

    def _ordered_phases(self) -> list[str]:
        known = [p.value for p in Phase if p.value in self.phases]
        return known + sorted(p for p in self.phases if p not in known)

    def as_dict(self) -> dict:
        return {
            "events": self.events,
            "steps": self.steps,
            "duration_s": round(self.last_ts - (self.first_ts or 0.0), 6),
            "total_bytes": self.total_bytes,
            "phases": {
                p: {"count": s.count, "failed": s.failed, "seconds": round(s.seconds, 6),
                    "mean_s": round(s.seconds / s.count, 6) if s.count else None}
                for p in self._ordered_phases() for s in [self.phases[p]]
            },
            "sync": {"count": self.sync_count, "bytes": self.sync_bytes,
                     "seconds": round(self.sync_seconds, 6),
                     "gb_per_s": None if self.sync_gb_per_s is None else round(self.sync_gb_per_s, 4)},
            "peak_memory": {
                k: {"bytes": p.bytes, "phase": p.phase, "step": p.step, "ts": p.ts}
                for k, p in self.peaks.items()
            },
            "errors": list(self.errors),
        }

    def table(self) -> str:
        lines = [f"{'phase':<20} {'count':>6} {'failed':>6} {'total s':>10} {'mean s':>10}"]
        for p in self._ordered_phases():
            s = self.phases[p]
            mean = s.seconds / s.count if s.count else 0.0
            lines.append(f"{p:<20} {s.count:>6} {s.failed:>6} {s.seconds:>10.4f} {mean:>10.4f}")
        if self.sync_count:
            rate = self.sync_gb_per_s
            rate_text = f"{rate:.3f} GB/s" if rate is not None else "n/a (no sync time recorded)"
            lines.append(f"sync: {self.sync_count} syncs, {fmt_bytes(self.sync_bytes)} in "
                         f"{self.sync_seconds:.4f} s: {rate_text}")
        if self.peaks:
            total = f" (device {fmt_bytes(self.total_bytes)})" if self.total_bytes else ""
            lines.append(f"peak memory{total}:")
            lines.append(f"  {'tag':<20} {'peak':>14}  phase (step)")
            for key in sorted(self.peaks, key=_peak_order):
                p = self.peaks[key]
                step = f" ({p.step})" if p.step is not None else ""
                lines.append(f"  {key:<20} {fmt_bytes(p.bytes):>14}  {p.phase}{step}")
        for e in self.errors:
            lines.append(f"failed in {e.get('phase')} (step {e.get('step')}): {e.get('error')}")
        return "\n".join(lines)


def _peak_order(key: str) -> tuple[int, str]:
    # tags first, then the reserved remainder, then the device total
    return ({"reserved": 1, "used": 2}.get(key, 0), key)
