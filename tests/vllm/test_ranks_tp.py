"""``colo demo --gpus 2 --engine vllm --engine-layout tp``: one vLLM of TP=2 across the ranks'
workers, fed by each rank's own trainer rank, every sync verified on both. A module of its own
(tests/vllm/test_ranks.py has the replicas layout) so that tools/test runs it on another pytest
worker beside that module's runs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.vllm.test_ranks import REPO, _demo, _syncs


@pytest.fixture(scope="module")
def tp(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm-ranks-tp")
    return tmp, *_demo(tmp, "--steps", "3", "--engine-layout", "tp", "--bucket-mib", "2")


def test_one_vllm_of_tp_2_across_the_ranks_serves_with_every_sync_verified_on_both(tp):
    """``--engine-layout tp``: each rank's worker holds one rank of a vLLM of TP=2 (vLLM's
    ``external_launcher`` executor, the trainer's group its world), fed by its own trainer rank;
    both ranks roll out the same tokens, report the trainer's digest after every sync and pass
    the probe (answered by the TP engine once, its ranks together)."""
    tmp, proc, traces = tp
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank, events in enumerate(traces):
        assert events[0]["config"]["demo"]["engine_layout"] == "tp"
        caps = events[0]["config"]["engine_capabilities"]
        assert caps["probe"] == "logprobs", (rank, caps)
        syncs = _syncs(events)
        assert len(syncs) == 3 and all(s["verify_s"] is not None and s["digest"] for s in syncs), rank
        probes = [e for e in events if e["event"] == "probe.finished"]
        assert [p["weight_version"] for p in probes] == [s["weight_version"] for s in syncs], rank
        assert not [e for e in events if e["event"] == "phase.failed"], rank
    # one engine: both ranks generated the same completions (the same reward each step) and
    # received the same whole tensors every sync
    rewards = [[e["reward"] for e in events if e["event"] == "rollout.finished"] for events in traces]
    assert len(rewards[0]) == 3 and rewards[0] == rewards[1]
    assert [s["digest"] for s in _syncs(traces[0])] == [s["digest"] for s in _syncs(traces[1])]
    for r in range(2):
        replayed = subprocess.run([sys.executable, "-m", "colo.cli", "replay", str(tmp / f"run.rank{r}.jsonl"),
                                   "--json"], capture_output=True, text=True, cwd=REPO)
        assert replayed.returncode == 0 and json.loads(replayed.stdout)["valid"] is True, replayed.stdout[-2000:]
