"""``colo demo --engine vllm``: the RL loop with a real vLLM as the rollout engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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


def test_a_short_demo_verifies_every_sync_and_its_trace_replays_clean(tmp_path):
    proc, events = run_demo(tmp_path, "--steps", "3")
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
    assert replay(tmp_path / "run.jsonl")["valid"] is True
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
