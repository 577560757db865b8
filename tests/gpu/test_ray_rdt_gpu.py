"""``--launcher ray --transport rdt`` on two GPUs: each bucket from rank r's trainer actor to
its engine actor, which shares its GPU, through Ray's CUDA IPC tensor transport (colo's
registration of it, which kills no actor when a transfer fails).

**Not run yet**: Ray's wheel cannot be carried to our GPU machines, and where this was
written Ray reaches no GPU. Skipped where there is no GPU or no Ray; on a machine with
both, it must pass. Every sync is verified inside the run, so exit 0 proves it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from colo.offline.replay import replay

pytest.importorskip("ray", reason="Ray is not installed: pip install -e '.[ray]'")
pytestmark = [pytest.mark.gpu, pytest.mark.gpu2,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]


def _demo(tmp_path, name: str, *args: str) -> tuple[subprocess.CompletedProcess, list]:
    trace = tmp_path / f"{name}.jsonl"
    env = {**os.environ}
    env.pop("RAY_ADDRESS", None)  # a local Ray of the run's own
    res = subprocess.run([sys.executable, "-m", "colo.cli", "demo", "--device", "cuda", "--gpus", "2", "--launcher",
                          "ray", "--transport", "rdt", "--mem-fraction-static", "0.25", "--quiet", "--trace",
                          str(trace), *args], capture_output=True, text=True, timeout=900, env=env)
    return res, [tmp_path / f"{name}.rank0.jsonl", tmp_path / f"{name}.rank1.jsonl"]


def _events(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_rdt_over_cuda_ipc_verifies_every_sync_on_two_gpus(tmp_path):
    res, paths = _demo(tmp_path, "rdt", "--steps", "3")
    assert res.returncode == 0, (res.stdout[-3000:], res.stderr[-3000:])
    assert replay([str(p) for p in paths]).valid
    syncs = [[e for e in _events(p) if e["event"] == "sync.finished"] for p in paths]
    assert [len(s) for s in syncs] == [3, 3]
    assert all(a["digest"] != b["digest"] and a["bytes"] == b["bytes"] for a, b in zip(*syncs))


def test_an_engine_actor_killed_mid_sync_over_cuda_ipc_is_recovered_and_the_trainer_lives(tmp_path):
    res, paths = _demo(tmp_path, "rdt-killed", "--steps", "3", "--fault", "kill-engine@sync")
    assert res.returncode == 0, (res.stdout[-3000:], res.stderr[-3000:])
    failed = [e for e in _events(paths[1]) if e["event"] == "phase.failed"]
    assert [e["phase"] for e in failed] == ["sync"] and "EngineDied" in failed[0]["error"]
    assert replay([str(p) for p in paths]).valid
