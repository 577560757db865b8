"""``colo demo --gpus 2`` on the CPU: two worker processes (gloo), each with a trainer
rank and an engine rank of a TP=2 engine; every sync is verified on every engine
rank inside the run (shard digest and probe logits), so a run that completes
proves it. These tests check what the run left: per-rank traces that replay clean
together, shard digests that differ by rank, the same weights after an engine
rank was killed mid-sync, and refusals before any process starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import anyio
import pytest

from colo.apps.demo import DemoConfig, run
from colo.offline.replay import replay

#: small rollouts: four processes share two cores, and a TP=2 engine all-reduces per layer per token
SMALL = dict(device="cpu", batch=8, new_tokens=8, prompt_len=6)


def _events(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def _run(tmp_path, name: str, **kw):
    trace = tmp_path / f"{name}.jsonl"
    cfg = DemoConfig(**{**SMALL, "steps": 2, "gpus": 2, "trace": str(trace), **kw})
    out = anyio.run(lambda: run(cfg, progress=False))
    return out, [tmp_path / f"{name}.rank0.jsonl", tmp_path / f"{name}.rank1.jsonl"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One 2-rank run per trainer, and the hf run again with an engine rank killed mid-sync."""
    tmp = tmp_path_factory.mktemp("multi")
    return {kind: _run(tmp, kind, trainer=kind) for kind in ("hf", "megatron", "fsdp")} | {
        "hf-killed": _run(tmp, "hf-killed", trainer="hf", fault="kill-engine@sync", fault_step=1)}


@pytest.mark.parametrize("kind", ["hf", "megatron", "fsdp"])
def test_two_rank_demo_verifies_every_sync_and_its_traces_replay_clean_together(runs, kind):
    out, paths = runs[kind]
    assert out.error is None, out.error
    assert len(out.rewards) == 2 and all(0.0 <= r <= 1.0 for r in out.rewards)
    report = replay([str(p) for p in paths])
    assert report.valid, [f.as_dict() for f in report.findings][:5]
    syncs = [[e for e in _events(p) if e["event"] == "sync.finished"] for p in paths]
    # the start-up sync is not a sync of a trained step: one per cycle
    assert [len(s) for s in syncs] == [2, 2]
    for a, b in zip(*syncs):
        assert a["weight_version"] == b["weight_version"]
        # each engine rank holds its own shard: the two digests differ, and each equals
        # the trainer's shard digest for that rank (checked in the run, or it fails)
        assert a["digest"] != b["digest"]
        assert a["bytes"] == b["bytes"] > 0  # every rank gathered and handed off the whole model


def test_each_rank_writes_its_own_trace_with_its_rank_and_the_world_size(runs):
    _, paths = runs["hf"]
    for rank, p in enumerate(paths):
        start = _events(p)[0]
        assert start["event"] == "trace.started" and start["rank"] == rank and start["world_size"] == 2
        assert start["config"]["gpus"] == 2


def test_an_engine_rank_killed_mid_sync_is_failed_safe_recovered_and_ends_at_the_same_weights(runs):
    clean, _ = runs["hf"]
    out, paths = runs["hf-killed"]
    assert out.error is None, out.error
    assert out.final_digest == clean.final_digest and out.rewards == clean.rewards
    failed = [e for e in _events(paths[1]) if e["event"] == "phase.failed"]
    assert [e["phase"] for e in failed] == ["sync"] and "EngineDied" in failed[0]["error"]
    assert failed[0]["failed_rank"] == 1
    # rank 0's engine loaded everything and still was marked stale: rank 0 failed too
    assert [e["phase"] for e in _events(paths[0]) if e["event"] == "phase.failed"] == ["sync"]
    assert replay([str(p) for p in paths]).valid


def _cli(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "colo.cli", "demo", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.getcwd()})


@pytest.mark.parametrize("args, message", [
    (["--gpus", "3"], "does not divide num_attention_heads 4"),
    (["--gpus", "0"], "--gpus"),
    (["--gpus", "2", "--fault", "raise@train"], "kill-engine@sync"),
    (["--gpus", "2", "--device", "cuda"], "cuda"),
    (["--gpus", "2", "--engine-visible-devices", "0"], "--engine-visible-devices"),
])
def test_bad_multi_gpu_input_is_refused_with_exit_two_before_any_rank_starts(tmp_path, args, message):
    trace = tmp_path / "t.jsonl"
    res = _cli(*args, "--steps", "1", "--trace", str(trace), "--quiet", cwd=tmp_path)
    assert res.returncode == 2, res.stderr[-2000:]
    assert message in res.stderr + res.stdout
    assert not list(tmp_path.glob("t*.jsonl"))  # no trace written: nothing started
