"""``colo demo --launcher ray --gpus 2 --transport rdt`` on the CPU: every bucket goes from
rank r's trainer actor to its engine actor through Ray Direct Transport (colo's gloo pair
transport, registered with Ray), on a local Ray cluster.

Every sync is verified on every engine rank inside the run (shard digest, probe logits),
so a run that completes proves it; these tests check what the runs left: a run that
learns, traces that replay clean, each rank's actors on its bundle with exactly one pair
group between them, an engine actor killed mid-sync whose TP group is replaced and
whose new actors form new pairs (none of the old left), the fault-free weights at the
end, and nothing of the runs left in the cluster. One cluster serves the module, and
one clean run and one faulted run serve every test (Ray takes tens of seconds to start
on two cores).
"""

from __future__ import annotations

import json
import statistics

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install -e '.[ray]'")

from colo.offline.replay import replay  # noqa: E402
from colo.ranks.ray_launcher import WORKER_NICENESS  # noqa: E402
from tests.multirank import two_rank_run  # noqa: E402
from tests.ranks.test_ray import (_actor, _assert_each_rank_shares_its_bundle, _assert_nothing_left,  # noqa: E402
                                  _by_rank, _live_actors, _placements, _segments)

#: one worker runs the modules that start a Ray cluster, one after the other (tests/conftest.py):
#: two clusters starting at once on two busy cores outwait Ray's own start limits
pytestmark = pytest.mark.xdist_group("ray")

#: the demo's own rollouts (the shared 2-rank runs' are smaller): enough signal that the
#: REINFORCE task's reward rises within STEPS
LEARN = dict(batch=32, new_tokens=24, prompt_len=8)
STEPS = 12
#: the faulted run: its engine actor killed in step 2's sync, compared with the clean run after as many steps
FAULT_STEPS = 3


def _events(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def _rdt_states() -> dict[str, dict]:
    """What each live colo actor's process holds of the rdt transport (its pair groups)."""
    return {name: ray.get(_actor(name).rdt_state.remote(), timeout=60) for name in _live_actors()}


@pytest.fixture(scope="module")
def cluster():
    # its workers at colo's niceness, as a cluster colo starts has them (Ray's 15 starves them beside other load)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             _system_config={"worker_niceness": WORKER_NICENESS})
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def runs(cluster, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ray-rdt")
    before = _segments()
    seen: dict = {}

    def clean(n: int) -> None:
        if n == 1:
            seen["clean"] = (_placements(), _rdt_states())
        if n == FAULT_STEPS:
            trainers = [_actor(name) for name, _ in sorted(_by_rank(_placements(), "rank").values())]
            # a collective: every rank at once, asked straight through Ray
            seen["digest"] = [d["digest"] for d in ray.get([a.handle.remote("full_digest", {}) for a in trainers],
                                                           timeout=300)]

    def faulted(n: int) -> None:
        if n == 2:  # after the recovered cycle
            seen["recovered"] = (_placements(), _rdt_states())

    out = {"clean": two_rank_run(tmp, "rdt", on_cycle=clean, launcher="ray", transport="rdt", steps=STEPS, **LEARN),
           "killed": two_rank_run(tmp, "rdt-killed", on_cycle=faulted, launcher="ray", transport="rdt",
                                  steps=FAULT_STEPS, fault="kill-engine@sync", fault_step=1, **LEARN)}
    _assert_nothing_left(before)  # no actor, placement group or segment after a clean run and a fault
    out["seen"] = seen
    return out


def test_an_rdt_run_learns_with_every_sync_verified_and_its_traces_replay_clean(runs):
    out, paths = runs["clean"]
    assert out.error is None, out.error
    assert len(out.rewards) == STEPS
    first, last = statistics.mean(out.rewards[:3]), statistics.mean(out.rewards[-3:])
    assert last > first + 0.05, out.rewards  # it learns: more of the rewarded tokens than at the start
    report = replay([str(p) for p in paths])
    assert report.valid, [f.as_dict() for f in report.findings][:5]
    traces = [_events(p) for p in paths]
    assert [t[0]["config"]["transport"] for t in traces] == ["rdt", "rdt"]
    syncs = [[e for e in t if e["event"] == "sync.finished"] for t in traces]
    assert [len(s) for s in syncs] == [STEPS, STEPS]  # one per cycle on every engine rank
    for a, b in zip(*syncs):
        # verified on each rank (its engine's shard digest, checked against the trainer's in the run)
        assert a["verify_s"] is not None and b["verify_s"] is not None
        assert a["verify_parts"]["engine_digest_s"] is not None
        assert a["weight_version"] == b["weight_version"] and a["digest"] != b["digest"]
        assert a["bytes"] == b["bytes"] > 0 and a["buckets"] == b["buckets"] > 1
    for t, s in zip(traces, syncs):
        # every bucket of every sync passed gather, pack, handoff and load
        stages: dict = {}
        for e in t:
            if e["event"] == "bucket.finished":
                stages.setdefault((e["step"], e["bucket"]), []).append(e["stage"])
        assert len(stages) == sum(x["buckets"] for x in s)
        assert all(sorted(v) == ["gather", "handoff", "load", "pack"] for v in stages.values()), stages


def test_each_rank_hands_its_buckets_over_one_pair_group_of_its_two_actors(runs):
    placements, states = runs["seen"]["clean"]
    _assert_each_rank_shares_its_bundle(placements, engine_generation=1)
    trainers, engines = _by_rank(placements, "rank"), _by_rank(placements, "engine")
    names = []
    for r in (0, 1):
        t, e = states[trainers[r][0]], states[engines[r][0]]
        # the rank actor owns the pair (its transfers) and holds one end; its engine actor the other
        assert len(t["groups"]) == 1 and t["pairs"] == t["groups"] == e["groups"], (t, e)
        assert t["outgoing"] == e["outgoing"] == 0  # no staged bucket left between cycles
        names += t["groups"]
    assert names[0] != names[1]  # a pair per rank, not one group over the ranks


def test_a_killed_engine_actor_is_recovered_to_the_fault_free_weights_over_a_new_pair(runs):
    clean, _ = runs["clean"]
    out, paths = runs["killed"]
    seen = runs["seen"]
    assert out.error is None, out.error
    # failed safe: rank 1's engine actor died mid-sync; rank 0's was marked stale too
    failed = [[e for e in _events(p) if e["event"] == "phase.failed"] for p in paths]
    assert [f["phase"] for f in failed[1]] == ["sync"], failed
    assert "EngineDied" in failed[1][0]["error"] and failed[1][0]["failed_rank"] == 1, failed
    assert [f["phase"] for f in failed[0]] == ["sync"], failed
    # the recovery sync filled every new engine actor and the run ended at the clean run's weights
    assert out.rewards == clean.rewards[:FAULT_STEPS], (out.rewards, clean.rewards)
    assert out.trainer_digest is not None and seen["digest"] == [out.trainer_digest] * 2, (seen["digest"],
                                                                                           out.trainer_digest)
    assert replay([str(p) for p in paths]).valid
    syncs = [[e for e in _events(p) if e["event"] == "sync.finished"] for p in paths]
    assert [len(s) for s in syncs] == [FAULT_STEPS, FAULT_STEPS]  # the failed sync finished on neither rank
    # the engine TP group restarted whole, in the same bundles; each rank formed a new pair with its
    # new engine actor and kept nothing of the old one
    placements, states = seen["recovered"]
    _assert_each_rank_shares_its_bundle(placements, engine_generation=2)
    trainers, engines = _by_rank(placements, "rank"), _by_rank(placements, "engine")
    for r in (0, 1):
        t, e = states[trainers[r][0]], states[engines[r][0]]
        assert len(t["groups"]) == 1 and t["pairs"] == t["groups"] == e["groups"], (r, t, e)
        assert t["outgoing"] == 0
