"""The demo end to end: a real trainer, a real engine process, real shared memory."""

import json
import subprocess
import sys

import pytest

from colo.apps.demo import DemoConfig, run
from colo.core.invariants import InvariantChecker
from colo.trace.writer import read_trace
from tests.leaks import new_segments

SMALL = dict(steps=2, batch=8, new_tokens=8)


def replay_clean(path):
    checker = InvariantChecker()
    events = read_trace(path)
    bad = [str(v) for i, e in enumerate(events, 1) for v in checker.feed(e, i)]
    assert bad == []
    return events


@pytest.mark.parametrize("plan", ["offload-first", "sync-first", "single-stage"])
async def test_each_plan_completes_with_verified_syncs(plan, tmp_path):
    out = await run(DemoConfig(plan=plan, trace=str(tmp_path / "t.jsonl"), bucket_mib=0.5, **SMALL),
                    progress=False)
    assert out.error is None
    events = replay_clean(out.trace_path)
    syncs = [e for e in events if e["event"] == "sync.finished"]
    # every sync covered every parameter of the model, in several buckets
    assert [s["weight_version"] for s in syncs] == [1, 2]
    assert all(s["tensors"] == s["params"] and s["buckets"] > 1 for s in syncs)
    assert len({s["digest"] for s in syncs}) == 2  # the weights changed between syncs
    rollouts = [e for e in events if e["event"] == "rollout.finished"]
    assert len(rollouts) == 2 and all(0.0 <= r["reward"] <= 1.0 and r["tokens"] == 8 * 8 for r in rollouts)
    assert max(e["mem"]["by_tag"]["staging"] for e in events if "mem" in e) <= 2 * int(0.5 * (1 << 20))
    assert new_segments() == []


# The documented size: at mem_fraction_static 0.84 the KV pool fills the
# simulated device, so only a plan that stages buckets while KV is away fits.
OOM_ARGS = dict(mem_fraction_static=0.84, bucket_mib=2.0, steps=1, batch=8, new_tokens=8)


@pytest.mark.parametrize("plan,fits", [("offload-first", True), ("sync-first", True), ("single-stage", False)])
async def test_single_stage_runs_out_of_memory_where_the_others_fit(plan, fits, tmp_path):
    out = await run(DemoConfig(plan=plan, trace=str(tmp_path / "t.jsonl"), **OOM_ARGS), progress=False)
    events = replay_clean(out.trace_path)
    if fits:
        assert out.error is None
    else:
        failed = [e for e in events if e["event"] == "phase.failed"]
        assert [(e["phase"], e["error_type"], e["oom_tag"]) for e in failed] == [("sync", "OutOfMemory", "staging")]
        assert "out of memory in phase sync: staging asks" in failed[0]["error"]
    assert new_segments() == []


def test_cli_demo_exits_zero_prints_table_and_writes_trace(tmp_path):
    trace = tmp_path / "cli.jsonl"
    proc = subprocess.run([sys.executable, "-m", "colo.cli", "demo", "--steps", "1", "--quiet",
                           "--trace", str(trace)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "engine_wake_kv" in proc.stdout and "reward per step" in proc.stdout
    first = json.loads(trace.read_text().splitlines()[0])
    assert first["event"] == "trace.started" and first["schema"] == "colo.trace/1"


@pytest.mark.parametrize("argv,msg", [
    (["--mem-fraction-static", "1.5"], "expected a number in (0, 1)"),
    (["--bucket-mib", "0"], "expected a positive float"),
    (["--plan", "fast"], "invalid choice"),
])
def test_cli_demo_bad_input_exits_two(argv, msg):
    proc = subprocess.run([sys.executable, "-m", "colo.cli", "demo", *argv], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and msg in proc.stderr
