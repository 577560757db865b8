"""``colo demo --engine vllm``: the RL loop with a real vLLM as the rollout engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_demo(tmp_path: Path, *args: str, timeout: int = 600) -> tuple[subprocess.CompletedProcess, list[dict]]:
    trace = tmp_path / "run.jsonl"
    proc = subprocess.run([sys.executable, "-m", "colo.cli", "demo", "--engine", "vllm", "--quiet",
                           "--trace", str(trace), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)})
    events = [json.loads(line) for line in trace.read_text().splitlines()] if trace.exists() else []
    return proc, events


def replay(trace: Path) -> dict:
    proc = subprocess.run([sys.executable, "-m", "colo.cli", "replay", str(trace), "--json"], capture_output=True,
                          text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout)


def test_a_short_demo_verifies_every_sync_and_its_trace_replays_clean(fault_free_run):
    tmp, proc, events = fault_free_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    syncs = [e for e in events if e["event"] == "sync.finished"]
    probes = [e for e in events if e["event"] == "probe.finished"]
    assert len(syncs) == 3 and all(s["verify_s"] is not None and s["digest"] for s in syncs)
    # vLLM answers the probe through its KV cache: after each sync, once the cache is back
    assert len(probes) == 3 and [p["weight_version"] for p in probes] == [s["weight_version"] for s in syncs]
    started = events[0]
    caps = started["config"]["engine_capabilities"]
    assert caps["tags"] == ["weights", "kv_cache"] and caps["probe"] == "logprobs" and caps["frees_memory"] is False
    # on a CPU vLLM's sleep moves nothing: the ledger says so and keeps the bytes counted
    paused = [e for e in events if e["event"] == "memory.paused" and e["owner"] == "engine"]
    assert paused and all(e["freed"] is False and "is_sleep_mode_available" in e["engine_note"] for e in paused)
    assert replay(tmp / "run.jsonl")["valid"] is True
    assert "engine log:" in proc.stdout and not [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]


def test_a_vllm_killed_mid_sync_is_replaced_and_recovered_to_the_trainers_digest(tmp_path):
    """vLLM in its own engine-core and worker processes; its worker is SIGKILLed after the
    first bucket of a sync loaded: the sync fails, a new vLLM starts, the recovery sync brings
    it to the trainer's weights (its digest equal to the trainer's), and the run goes on."""
    proc, events = run_demo(tmp_path, "--steps", "3", "--vllm-processes", "--fault", "kill-engine@sync",
                            "--bucket-mib", "2", timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "fault kill-engine@sync injected" in proc.stdout
    assert "recovered: engine digest" in proc.stdout and "equals the trainer's" in proc.stdout
    failed = [e for e in events if e["event"] == "phase.failed"]
    assert [e["phase"] for e in failed] == ["sync"] and failed[0]["error_type"] == "EngineDied"
    rollouts = [e for e in events if e["event"] == "rollout.finished"]
    assert len(rollouts) == 3
    assert replay(tmp_path / "run.jsonl")["valid"] is True


def _sync_digests(events: list[dict]) -> dict[int, str]:
    return {e["weight_version"]: e["digest"] for e in events if e["event"] == "sync.finished"}


@pytest.fixture(scope="module")
def fault_free_run(tmp_path_factory):
    """One fault-free run of three steps, the short demo's test's and the fault kinds' reference
    (one vLLM start fewer than a run for each)."""
    tmp = tmp_path_factory.mktemp("vllm-fault-free")
    return tmp, *run_demo(tmp, "--steps", "3", "--bucket-mib", "2")


@pytest.fixture(scope="module")
def fault_free(fault_free_run):
    _, proc, events = fault_free_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return _sync_digests(events)


#: a deadline fault cancels the sync as cancel@sync does, from the scheduler's own timer (tested
#: with colo's engine in tests/testing/test_faults.py): what reaches vLLM is the same cancelled
#: call, so CI runs cancel@sync and COLO_MATRIX=1 adds the deadline
@pytest.mark.parametrize("fault", ["raise@sync", "cancel@sync", pytest.param("deadline@sync", marks=pytest.mark.matrix),
                                   "oom@trainer_onload"])
def test_each_fault_kind_on_a_real_vllm_recovers_to_the_fault_free_digests(tmp_path, fault_free, fault):
    """Issue 45, item 5: the fault kinds against a real vLLM (a kill is the test above): the
    phase fails once, the run recovers to the trainer's digest and goes on. A sync that failed
    after its cycle trained is redone with the same weights, so every weight version vLLM then
    holds is the fault-free run's, digest for digest; a failure before train (the trainer's
    onload) redoes the cycle with a new rollout, one more than the steps."""
    proc, events = run_demo(tmp_path, "--steps", "3", "--fault", fault, "--bucket-mib", "2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"fault {fault} injected" in proc.stdout
    assert "recovered: engine digest" in proc.stdout and "equals the trainer's" in proc.stdout
    phase = fault.split("@")[1]
    assert [e["phase"] for e in events if e["event"] == "phase.failed"] == [phase]
    syncs = [e for e in events if e["event"] == "sync.finished"]
    assert syncs and all(s["verify_s"] is not None and s["digest"] for s in syncs)
    rollouts = len([e for e in events if e["event"] == "rollout.finished"])
    if phase == "sync":
        assert rollouts == 3
        got = _sync_digests(events)
        assert len(fault_free) == 3 and {v: got.get(v) for v in fault_free} == fault_free
    else:
        assert rollouts == 4
    assert replay(tmp_path / "run.jsonl")["valid"] is True


def test_an_oom_where_vllm_takes_no_memory_back_is_said_not_passed_over(tmp_path):
    """On a CPU vLLM's sleep mode moves no memory, so its engine_wake_kv allocates nothing: an
    oom fault there can fail nothing. The run says so and exits 1, instead of passing as if the
    fault had been injected and recovered from."""
    proc, _ = run_demo(tmp_path, "--steps", "2", "--fault", "oom@engine_wake_kv")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "fault oom@engine_wake_kv failed nothing: engine_wake_kv at step 0 allocated nothing" in out, out[-3000:]
    assert "is_sleep_mode_available() is False" in out
