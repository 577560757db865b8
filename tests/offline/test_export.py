"""``colo export``: Chrome trace-event JSON with phase slices, nested bucket stages, memory counters."""

import json

import pytest

from colo.cli import main
from colo.core.config import SchedulerConfig
from colo.core.interfaces import SyncResult
from colo.core.memory import MemoryLedger
from colo.core.schema import BUCKET_STAGES
from colo.scheduler import Scheduler
from colo.trace.writer import TraceWriter, read_trace
from colo.testing.fakes import FakeEngine, FakeTrainer, FakeTransport
from tests.offline.test_replay import record


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


class PipelinedTransport(FakeTransport):
    """Three buckets through the five stages as a pipeline: stage k of bucket b
    runs in [b + k, b + k + 1] ms, so bucket b+1 uploads while bucket b gathers."""

    name = "pipelined"

    def __init__(self, clock):
        super().__init__()
        self.clock = clock

    async def sync(self, trainer, engine, ctx):
        n, t0 = 3, self.clock.t
        specs = trainer.param_specs()
        per = [specs[0:4], specs[4:7], specs[7:10]]
        ms = 1e-3
        for t in range(1, n + len(BUCKET_STAGES) + 1):  # stages ending at t ms, in time order
            for b in range(n):
                k = t - 1 - b
                if 0 <= k < len(BUCKET_STAGES):
                    self.clock.t = t0 + t * ms
                    ctx.record(b, BUCKET_STAGES[k], sum(s.nbytes for s in per[b]), len(per[b]), ms)
        self.clock.t = t0 + (n + len(BUCKET_STAGES) + 1) * ms
        return SyncResult(bytes=100, buckets=n, tensors=10)


async def record_pipelined(path, cycles=1):
    clock = Clock()
    s = Scheduler(FakeTrainer(), FakeEngine(), MemoryLedger(total_bytes=10_000), PipelinedTransport(clock),
                  trace=TraceWriter(path, clock=clock), config=SchedulerConfig(bucket_bytes=50), clock=clock)
    async with s:
        for _ in range(cycles):
            await s.cycle()
    return path


def export(capsys, trace, out):
    code = main(["export", str(trace), "-o", str(out)])
    io = capsys.readouterr()
    return code, io.out, io.err


def assert_nests(slices):
    """Slices on one thread must nest: Perfetto (and Chrome) reject partial overlap."""
    by_thread = {}
    for s in slices:
        by_thread.setdefault((s["pid"], s["tid"]), []).append(s)
    for evs in by_thread.values():
        evs.sort(key=lambda s: (s["ts"], -s["dur"]))
        stack = []
        for s in evs:
            while stack and stack[-1][1] <= s["ts"]:
                stack.pop()
            if stack:
                assert s["ts"] + s["dur"] <= stack[-1][1] + 1e-6, f"{s['name']} overlaps its parent partially"
            stack.append((s["ts"], s["ts"] + s["dur"]))


async def test_phases_are_slices_per_rank_and_memory_is_counters(tmp_path, capsys):
    trace = await record(tmp_path / "t.jsonl", cycles=2)
    code, out, _ = export(capsys, trace, tmp_path / "out" / "t.json")
    assert code == 0
    assert out.startswith(f"{tmp_path / 'out' / 't.json'}: 16 phase slices, 8 bucket slices with 40 stage slices")
    doc = json.loads((tmp_path / "out" / "t.json").read_text())
    events = doc["traceEvents"]
    src = read_trace(trace)
    phases = [e for e in events if e.get("cat") == "phase"]
    entered = [e for e in src if e["event"] == "phase.entered"]
    finished = [e for e in src if e["event"] == "phase.finished"]
    assert [p["name"] for p in phases] == [e["to_phase"] for e in entered]
    assert all(p["ph"] == "X" and p["pid"] == 0 and p["tid"] == 1 for p in phases)
    assert [p["ts"] for p in phases] == [round(e["ts"] * 1e6, 3) for e in entered]
    assert [round(p["ts"] + p["dur"], 3) for p in phases] == pytest.approx([e["ts"] * 1e6 for e in finished])
    assert phases[0]["args"]["mem_at_entry"]["by_tag"]["engine.kv_cache"] == 300
    meta = {(e["tid"] if "tid" in e else None, e["name"]): e["args"] for e in events if e["ph"] == "M"}
    assert meta[(None, "process_name")] == {"name": "rank 0 (cpu simulated)"}
    assert meta[(1, "thread_name")] == {"name": "phases"}
    # counters: one "memory" sample per change, its args the bytes by tag
    mem = [e for e in events if e["ph"] == "C" and e["name"] == "memory"]
    kv = [m["args"]["engine.kv_cache"] for m in mem]
    assert kv[0] == 300 and set(kv) == {0, 300}
    staging = [m["args"]["staging"] for m in mem]
    assert max(staging) == 84 and staging[-1] == 0
    device = [e for e in events if e["ph"] == "C" and e["name"] == "device"]
    assert {d["args"]["total"] for d in device} == {10_000} and max(d["args"]["used"] for d in device) == 420
    snapshots = [(e["ts"], e["mem"]["by_tag"]) for e in src if "mem" in e]
    assert all(any(m["args"] == tags for m in mem) for _, tags in snapshots)
    assert len(mem) < len(snapshots)  # unchanged snapshots are not repeated
    assert [e["args"]["reward"] for e in events if e["name"] == "rollout.finished"] == [0.0, 1.0]
    assert_nests([e for e in events if e["ph"] == "X"])


async def test_bucket_stages_nest_in_bucket_slices_and_overlapping_buckets_take_lanes(tmp_path, capsys):
    trace = await record_pipelined(tmp_path / "p.jsonl")
    code, _, _ = export(capsys, trace, tmp_path / "p.json")
    assert code == 0
    events = json.loads((tmp_path / "p.json").read_text())["traceEvents"]
    buckets = {e["args"]["bucket"]: e for e in events if e.get("cat") == "bucket"}
    stages = [e for e in events if e.get("cat") == "stage"]
    sync = next(e for e in events if e.get("cat") == "phase" and e["name"] == "sync")
    t0 = sync["ts"]
    # bucket b spans [b, b + 5] ms after the sync began, on its own lane (all three overlap)
    for b, s in buckets.items():
        assert s["tid"] == 10 + b and s["name"] == f"bucket {b}"
        assert s["ts"] - t0 == pytest.approx(b * 1000, abs=1) and s["dur"] == pytest.approx(5000, abs=1)
        mine = sorted((e for e in stages if e["args"]["bucket"] == b), key=lambda e: e["ts"])
        assert [e["name"] for e in mine] == list(BUCKET_STAGES)
        assert all(e["tid"] == s["tid"] and e["dur"] == pytest.approx(1000, abs=1) for e in mine)
        assert mine[0]["ts"] == s["ts"] and mine[-1]["ts"] + mine[-1]["dur"] == pytest.approx(s["ts"] + s["dur"])
    # the overlap: bucket 1 uploads while bucket 0 gathers
    up1 = next(e for e in stages if e["args"]["bucket"] == 1 and e["name"] == "upload")
    ga0 = next(e for e in stages if e["args"]["bucket"] == 0 and e["name"] == "gather")
    assert up1["ts"] == ga0["ts"] and up1["tid"] != ga0["tid"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {1: "phases", 10: "sync lane 0", 11: "sync lane 1", 12: "sync lane 2"}
    assert_nests([e for e in events if e["ph"] == "X"])


async def test_a_failed_phase_carries_its_error_and_a_cut_trace_closes_the_open_phase(tmp_path, capsys):
    trace = await record(tmp_path / "oom.jsonl", plan="single-stage", total=450, fail="oom")
    code, _, _ = export(capsys, trace, tmp_path / "oom.json")
    events = json.loads((tmp_path / "oom.json").read_text())["traceEvents"]
    sync = next(e for e in events if e.get("cat") == "phase" and e["name"] == "sync")
    assert code == 0 and sync["args"]["oom_tag"] == "staging" and sync["args"]["oom_requested"] == 42
    assert sync["args"]["error"].startswith("OutOfMemory: out of memory in phase sync")
    assert [e["name"] for e in events if e.get("cat") == "phase"][-1] == "failed"

    lines = (await record(tmp_path / "ok.jsonl")).read_text().splitlines(keepends=True)
    cut = tmp_path / "cut.jsonl"
    cut.write_text("".join(lines[:40]) + lines[40][:5])
    code, _, err = export(capsys, cut, tmp_path / "cut.json")
    assert code == 0 and "line 41 is cut off" in err
    last = [e for e in json.loads((tmp_path / "cut.json").read_text())["traceEvents"] if e.get("cat") == "phase"][-1]
    assert last["args"]["unfinished"] == "the trace ends inside this phase"


def test_unreadable_input_and_unwritable_output_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"event": "trace.started", "schema": "other"}\n')
    code, _, err = export(capsys, bad, tmp_path / "x.json")
    assert code == 2 and "schema 'other'; expected 'colo.trace/1'" in err
    assert not (tmp_path / "x.json").exists()


async def test_unwritable_output_is_bad_input(tmp_path, capsys):
    trace = await record(tmp_path / "t.jsonl", cycles=1)
    (tmp_path / "file").write_text("")
    code, _, err = export(capsys, trace, tmp_path / "file" / "x.json")
    assert code == 2 and "cannot write" in err
