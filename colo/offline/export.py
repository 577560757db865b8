"""``colo export``: a ``colo.trace/1`` trace as Chrome trace-event JSON for ui.perfetto.dev.

Per rank (one process each):

- thread "phases": one complete slice per phase, from ``phase.entered`` to its
  ``phase.finished`` / ``phase.failed``;
- threads "sync lane k": one slice per bucket spanning its stages, with the
  stages nested inside. Buckets of one sync overlap (bucket i+1 uploads while
  bucket i loads), and slices on one thread must nest, so overlapping buckets
  go to different lanes: the pipeline overlap is the staircase across lanes;
- counter "memory": one track per tag (bytes), and "device": used and total;
- instants for rollouts, finished syncs and failures.

Times are microseconds since ``trace.started``. Export reads anything replay
can read, valid or not (an OOM trace is exactly what one wants to look at).
Pure: no torch, no anyio, no structlog.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import tempfile

from colo.core.errors import UsageError
from colo.core.phases import SUBSTATES
from colo.offline.replay import BadTrace, LoadedTrace, first_violation, load_trace, require_valid
from colo.trace.outputs import output_path, replace_into

PHASE_TID = 1
#: the engine's own sub-states (colo.core.phases.SUBSTATES: SGLang's weight-update session, its
#: paused generation, an adapter's stage) as slices on a track of their own, beneath the phases
SUBSTATE_TID = 2
LANE_TID0 = 10  # sync lane k is thread LANE_TID0 + k
US = 1e6


def _us(seconds: float) -> float:
    # microsecond resolution is what the trace records (ts is rounded to 1e-6 s)
    return round(seconds * US, 3)


def _meta(pid: int, tid: int | None, name: str, value: str | int) -> dict:
    ev = {"ph": "M", "pid": pid, "name": name, "args": {"name" if name.endswith("_name") else "sort_index": value}}
    if tid is not None:
        ev["tid"] = tid
    return ev


def _mem_args(mem: dict) -> dict:
    return {"used": mem["used"], "by_tag": dict(mem.get("by_tag") or {})}


def _bucket_slices(pid: int, stages: list[dict]) -> list[dict]:
    """One sync's bucket stages as lanes of bucket slices with nested stage slices."""
    by_bucket: dict[int, list[dict]] = {}
    for ev in stages:
        by_bucket.setdefault(ev["bucket"], []).append(ev)
    spans = []
    for bucket, evs in by_bucket.items():
        parts = []
        prev_end = None
        for ev in evs:  # already in stage order (invariant 6; replay reports it otherwise)
            end = float(ev["ts"])
            d = ev.get("duration_s")
            start = end - float(d) if isinstance(d, (int, float)) and d > 0 else end
            # ts and duration_s are each rounded to 1e-6 s: clamp so that the
            # stages of one bucket never overlap and nest cleanly in its slice
            if prev_end is not None and start < prev_end:
                start = prev_end
            end = max(end, start)
            parts.append((start, end, ev))
            prev_end = end
        spans.append((parts[0][0], parts[-1][1], bucket, parts))
    spans.sort(key=lambda s: (s[0], s[2]))
    lanes: list[float] = []  # end of the last bucket on each lane
    out = []
    for start, end, bucket, parts in spans:
        lane = next((k for k, busy_until in enumerate(lanes) if busy_until <= start), None)
        if lane is None:
            lane = len(lanes)
            lanes.append(end)
        lanes[lane] = end
        tid = LANE_TID0 + lane
        first = parts[0][2]
        out.append({"ph": "X", "pid": pid, "tid": tid, "cat": "bucket", "name": f"bucket {bucket}",
                    "ts": _us(start), "dur": _us(end - start),
                    "args": {"bucket": bucket, "step": first.get("step"), "bytes": first.get("bytes"),
                             "tensors": first.get("tensors"), "lane": lane}})
        for s, e, ev in parts:
            out.append({"ph": "X", "pid": pid, "tid": tid, "cat": "stage", "name": ev["stage"],
                        "ts": _us(s), "dur": _us(e - s),
                        "args": {"bucket": bucket, "stage": ev["stage"], "bytes": ev.get("bytes"),
                                 "tensors": ev.get("tensors"), "duration_s": ev.get("duration_s")}})
    return out


_FAILURE_KEYS = ("error", "error_type", "oom_tag", "oom_requested", "oom_free")


class _Chrome:
    """One rank's trace as Chrome trace events: phases as slices on one track,
    bucket stages on sync lanes beneath, markers, and memory counters."""

    def __init__(self, trace: LoadedTrace):
        self.pid = pid = trace.rank
        device = trace.header.get("device") or {}
        self.out: list[dict] = [
            _meta(pid, None, "process_name", f"rank {pid} ({device.get('kind', '?')} {device.get('name', '')})".strip()),
            _meta(pid, None, "process_sort_index", pid),
            _meta(pid, PHASE_TID, "thread_name", "phases"),
            _meta(pid, PHASE_TID, "thread_sort_index", 0),
        ]
        self.open_phase: tuple[str, float, dict] | None = None
        self.stages: list[dict] = []
        self.last_counters: tuple | None = None
        self.lanes_seen = 0
        #: sub-state name -> (when it opened, the opening event)
        self.substates: dict[str, tuple[float, dict]] = {}

    def flush_stages(self) -> None:
        if self.stages:
            slices = _bucket_slices(self.pid, self.stages)
            self.out.extend(slices)
            self.lanes_seen = max([self.lanes_seen] + [s["tid"] - LANE_TID0 + 1 for s in slices])
        self.stages = []

    def close_phase(self, ts: float, ev: dict | None, failed: bool) -> None:
        name, start, entered = self.open_phase
        args = {"step": entered.get("step"), "from_phase": entered.get("from_phase")}
        if "mem" in entered:
            args["mem_at_entry"] = _mem_args(entered["mem"])
        if ev is None:
            args["unfinished"] = "the trace ends inside this phase"
        else:
            if "duration_s" in ev:
                args["duration_s"] = ev["duration_s"]
            if "mem" in ev:
                args["mem_at_end"] = _mem_args(ev["mem"])
            if failed:
                args.update({k: ev[k] for k in _FAILURE_KEYS if k in ev})
        self.out.append({"ph": "X", "pid": self.pid, "tid": PHASE_TID, "cat": "phase", "name": name,
                         "ts": _us(start), "dur": _us(max(0.0, ts - start)), "args": args})
        self.open_phase = None

    def marker(self, name: str, ts: float, args: dict, scope: str = "t") -> None:
        self.out.append({"ph": "i", "s": scope, "pid": self.pid, "tid": PHASE_TID, "name": name, "ts": _us(ts),
                         "args": args})

    def event(self, ev: dict) -> None:
        name, ts = ev["event"], float(ev["ts"])
        if name == "phase.entered":
            if self.open_phase is not None:  # a broken trace: still draw what is there
                self.close_phase(ts, None, False)
            self.open_phase = (ev["to_phase"], ts, ev)
        elif name in ("phase.finished", "phase.failed"):
            self.flush_stages()
            if self.open_phase is not None and self.open_phase[0] == ev["phase"]:
                self.close_phase(ts, ev, name == "phase.failed")
            if name == "phase.failed":
                self.marker("failed", ts, {k: ev[k] for k in ("phase", *_FAILURE_KEYS) if k in ev}, scope="p")
        elif name == "bucket.finished":
            self.stages.append(ev)
        elif name == "sync.finished":
            self.flush_stages()
            self.sync_finished(ev, ts)
        elif name == "rollout.finished":
            self.marker("rollout.finished", ts, {k: ev[k] for k in ("step", "reward", "tokens") if k in ev})
        self.substate(name, ts, ev)
        if ev.get("mem") is not None:
            self.counters(ev["mem"], ts)

    def substate(self, name: str, ts: float, ev: dict) -> None:
        """An engine sub-state's slice, from its opening event to its closing one (or to the
        failure that ends it)."""
        for sub_name, sub in SUBSTATES.items():
            if name == sub.opened:
                self.substates[sub_name] = (ts, ev)
            elif sub_name in self.substates and (name == sub.closed or (name == "phase.failed"
                                                                        and sub.ends_on_failure)):
                self.close_substate(sub_name, ts, ended_by=name)

    def close_substate(self, sub_name: str, ts: float, ended_by: str) -> None:
        start, opened = self.substates.pop(sub_name)
        args = {k: opened[k] for k in ("step", "weight_version") if k in opened}
        self.out.append({"ph": "X", "pid": self.pid, "tid": SUBSTATE_TID, "cat": "engine", "name": sub_name,
                         "ts": _us(start), "dur": _us(max(0.0, ts - start)),
                         "args": {**args, "opened_by": SUBSTATES[sub_name].opened, "ended_by": ended_by}})

    def sync_finished(self, ev: dict, ts: float) -> None:
        d = ev.get("duration_s")
        rate = ev["bytes"] / d / 1e9 if isinstance(d, (int, float)) and d > 0 and isinstance(ev.get("bytes"), int) \
            else None
        keys = ("step", "bytes", "buckets", "tensors", "duration_s", "weight_version", "digest", "source", "target")
        self.marker("sync.finished", ts, {**{k: ev[k] for k in keys if k in ev}, "gb_per_s": rate})

    def counters(self, mem: dict, ts: float) -> None:
        by_tag = dict(mem.get("by_tag") or {})
        key = (tuple(sorted(by_tag.items())), mem["used"], mem["total"])
        if key == self.last_counters:  # unchanged snapshots would only bloat the file
            return
        self.last_counters = key
        # Perfetto names each counter track "<name> <arg>": "memory engine.kv_cache"
        self.out.append({"ph": "C", "pid": self.pid, "name": "memory", "ts": _us(ts), "args": by_tag})
        self.out.append({"ph": "C", "pid": self.pid, "name": "device", "ts": _us(ts),
                         "args": {"used": mem["used"], "total": mem["total"],
                                  "reserved": mem["used"] - sum(by_tag.values())}})

    def finish(self, last_ts: float) -> list[dict]:
        self.flush_stages()
        if self.open_phase is not None:
            self.close_phase(last_ts, None, False)
        for sub_name in list(self.substates):
            self.close_substate(sub_name, last_ts, ended_by="the end of the trace")
        if any(e.get("tid") == SUBSTATE_TID for e in self.out):
            self.out.append(_meta(self.pid, SUBSTATE_TID, "thread_name", "engine sub-states"))
            self.out.append(_meta(self.pid, SUBSTATE_TID, "thread_sort_index", 0))
        for lane in range(self.lanes_seen):
            self.out.append(_meta(self.pid, LANE_TID0 + lane, "thread_name", f"sync lane {lane}"))
            self.out.append(_meta(self.pid, LANE_TID0 + lane, "thread_sort_index", 1 + lane))
        return self.out


def chrome_events(trace: LoadedTrace) -> list[dict]:
    chrome = _Chrome(trace)
    for ev in trace.events:
        chrome.event(ev)
    return chrome.finish(float(trace.events[-1]["ts"]))


def export(traces: list[LoadedTrace]) -> dict:
    events: list[dict] = []
    for t in traces:
        events.extend(chrome_events(t))
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"source": "colo export", "traces": [t.path for t in traces],
                      "config": [t.header.get("config") for t in traces]},
    }


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # the output does not exist yet
        return os.path.realpath(a) == os.path.realpath(b)


def _mode_of(out: str) -> int:
    try:
        return stat.S_IMODE(os.stat(out).st_mode)  # replacing a file keeps its mode
    except OSError:
        umask = os.umask(0o022)
        os.umask(umask)
        return 0o666 & ~umask


def write_json(doc: dict, out: str, flag: str = "-o") -> None:
    """Write ``doc`` as strict JSON (no NaN or Infinity: Perfetto and every other
    reader refuse them) to a temporary file beside ``out``, then rename it into
    place: a failed export leaves the previous ``out`` as it was. ``out`` is a
    new path or a regular file (:func:`colo.trace.outputs.output_path`): the
    rename would replace a device, a FIFO or a link with a regular file."""
    out = output_path(out, flag)
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(out)}.", suffix=".tmp", dir=parent)
    try:
        # mkstemp makes it 0600; give it the mode open() would have
        os.fchmod(fd, _mode_of(out))
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, separators=(",", ":"), allow_nan=False)
        replace_into(tmp, out, flag)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def run_export(args) -> int:
    out = os.fspath(args.output)
    if _same_file(args.trace, out):
        raise UsageError(f"-o {out} is the input trace {args.trace}; exporting would replace the trace "
                         "with its export: choose another output path")
    output_path(out, "-o")  # refused before the trace is read, and left as it was
    try:
        if not args.lenient:
            require_valid([args.trace], "export")
        elif (first := first_violation([args.trace])) is not None:
            print(f"warning: exported although colo replay rejects it (--lenient): {first}", file=sys.stderr)
        trace = load_trace(args.trace)
    except BadTrace as e:
        raise UsageError(str(e)) from None
    for w in trace.warnings:
        print(f"warning: {w}", file=sys.stderr)
    doc = export([trace])
    try:
        write_json(doc, out)
    except UsageError:
        raise
    except ValueError as e:  # a value JSON cannot hold: refused, and nothing was replaced
        raise UsageError(f"cannot export {args.trace}: {e}; {out} was left as it was") from None
    except OSError as e:
        raise UsageError(f"cannot write {out}: {e.strerror or e}") from None
    n = {k: sum(1 for e in doc["traceEvents"] if e.get("cat") == k) for k in ("phase", "bucket", "stage")}
    print(f"{out}: {n['phase']} phase slices, {n['bucket']} bucket slices with {n['stage']} stage slices, "
          f"rank {trace.rank}; open it at https://ui.perfetto.dev")
    return 0
