"""``colo demo --launcher ray --gpus N --engine vllm``: each rank's vLLM a Ray actor of its own
on the rank's bundle (issue 42, item 4), on a local Ray cluster the run starts and stops.

One run of three steps with rank 1's vLLM actor killed by ``ray.kill`` after the first bucket
of the first sync: every sync that finished is verified on both ranks (digest and logprobs
probe), only the killed actor is replaced (from the first weights, stale until the recovery
sync), and both traces replay clean."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.vllm.test_ranks import REPO, _demo, _syncs

pytest.importorskip("ray", reason="Ray is not installed in vLLM's environment")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm-ray")
    return tmp, *_demo(tmp, "--launcher", "ray", "--steps", "3", "--fault", "kill-engine@sync", "--bucket-mib", "2")


def test_vllm_actors_serve_every_rank_and_a_killed_one_is_replaced_there_only(run):
    tmp, proc, traces = run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "fault kill-engine@sync injected" in proc.stdout
    assert "engine ranks alive [True, False]" in proc.stdout, proc.stdout[-2000:]
    assert re.search(r"engine rank\(s\) \[1\] replaced \(processes \d+ -> \d+\)\n", proc.stdout), proc.stdout[-2000:]
    for rank, events in enumerate(traces):
        config = events[0]["config"]
        assert config["demo"]["launcher"] == "ray" and config["engine_capabilities"]["probe"] == "logprobs"
        # the first sync failed (rank 1's actor killed mid-sync); the recovery sync and the rest verified
        assert [e["phase"] for e in events if e["event"] == "phase.failed"] == ["sync"], rank
        syncs = _syncs(events)
        assert len(syncs) == 3 and all(s["verify_s"] is not None and s["digest"] for s in syncs), rank
        probes = [e for e in events if e["event"] == "probe.finished"]
        assert [p["weight_version"] for p in probes] == [s["weight_version"] for s in syncs], rank
        assert len([e for e in events if e["event"] == "rollout.finished"]) == 3
    # replicas: both vLLM actors hold the whole model, so both report the same digest every sync
    assert [s["digest"] for s in _syncs(traces[0])] == [s["digest"] for s in _syncs(traces[1])]
    for r in range(2):
        replayed = subprocess.run([sys.executable, "-m", "colo.cli", "replay", str(tmp / f"run.rank{r}.jsonl"),
                                   "--json"], capture_output=True, text=True, cwd=REPO)
        assert replayed.returncode == 0 and json.loads(replayed.stdout)["valid"] is True, replayed.stdout[-2000:]
