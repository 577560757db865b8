"""``colo demo --launcher ray --gpus 2`` on the CPU: each rank a Ray actor on its own
placement-group bundle of a local Ray cluster (gloo groups), the driver here.

Every sync is verified on every engine rank inside the run (shard digest and probe
logits), so a run that completes proves it. These tests check what the run left:
the same rewards and trainer weights as the 2-rank run of local worker processes,
per-rank traces that replay clean together, an engine rank killed mid-sync that
ends at the same weights, a rank actor killed from outside that fails the run
naming the rank, and no actor, placement group or /dev/shm segment left behind —
also after SIGINT to a driver in another process.

One local cluster serves the module (Ray takes seconds to start on two cores);
the launcher reuses a Ray that is already initialised.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import anyio
import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install -e '.[ray]'")

from tests.multirank import shared_run, two_rank_run  # noqa: E402
from colo.errors import RankDied, RankFailed  # noqa: E402
from colo.offline.replay import replay  # noqa: E402

#: small rollouts: four processes share two cores, and a TP=2 engine all-reduces per layer per token


def _events(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def _segments() -> set[str]:
    """colo's /dev/shm segments whose creator is gone (``colo-<pid>-...``): leaked ones. A live
    creator's segments are not counted: other colo runs on this machine may hold some right now."""
    names = os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []
    return {n for n in names if n.startswith("colo-") and not os.path.exists(f"/proc/{n.split('-')[1]}")}


def _live_rank_actors() -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("colo-rank")]


def _live_groups() -> list[str]:
    return [pg_id for pg_id, pg in ray.util.placement_group_table().items() if pg["state"] != "REMOVED"]


def _assert_nothing_left(segments_before: set[str]) -> None:
    deadline = time.monotonic() + 30  # ray.kill is asynchronous: the actor is dead a moment later
    while (_live_rank_actors() or _live_groups()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _live_rank_actors() == []
    assert _live_groups() == []
    assert _segments() - segments_before == set()


def _run(tmp_path, name: str, on_cycle=None, **kw):
    return two_rank_run(tmp_path, name, on_cycle=on_cycle, **kw)


@pytest.fixture(scope="module")
def cluster():
    # more CPUs than cores: each rank's bundle takes one CPU, and the SIGINT test's driver is a second job
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def runs(cluster, tmp_path_factory):
    """The same 3-step run by local worker processes, by Ray actors, and by Ray actors with
    rank 1's engine killed mid-sync at step 1."""
    tmp = tmp_path_factory.mktemp("ray")
    before = _segments()
    # the process launcher's run is the one tests/test_demo_multi.py checks too: run once
    out = {"process": shared_run(tmp_path_factory, trainer="hf"),
           "ray": _run(tmp, "ray", launcher="ray"),
           "ray-killed": _run(tmp, "ray-killed", launcher="ray", fault="kill-engine@sync", fault_step=1)}
    _assert_nothing_left(before)
    return out


def test_ray_run_verifies_every_sync_and_equals_the_process_run(runs):
    ray_out, paths = runs["ray"]
    proc_out, _ = runs["process"]
    assert ray_out.error is None and proc_out.error is None, (ray_out.error, proc_out.error)
    assert len(ray_out.rewards) == 3
    assert ray_out.rewards == proc_out.rewards
    assert ray_out.trainer_digest is not None and ray_out.trainer_digest == proc_out.trainer_digest
    report = replay([str(p) for p in paths])
    assert report.valid, [f.as_dict() for f in report.findings][:5]
    syncs = [[e for e in _events(p) if e["event"] == "sync.finished"] for p in paths]
    assert [len(s) for s in syncs] == [3, 3]  # one verified sync per cycle on every engine rank
    for a, b in zip(*syncs):
        assert a["weight_version"] == b["weight_version"] and a["digest"] != b["digest"]


def test_an_engine_rank_killed_mid_sync_under_ray_ends_at_the_same_weights(runs):
    clean, _ = runs["ray"]
    out, paths = runs["ray-killed"]
    assert out.error is None, out.error
    assert out.trainer_digest == clean.trainer_digest and out.rewards == clean.rewards
    failed = [e for e in _events(paths[1]) if e["event"] == "phase.failed"]
    assert [e["phase"] for e in failed] == ["sync"] and "EngineDied" in failed[0]["error"]
    assert failed[0]["failed_rank"] == 1
    assert replay([str(p) for p in paths]).valid


def test_a_rank_actor_killed_from_outside_fails_the_run_naming_the_rank_and_leaves_nothing(cluster, tmp_path):
    before = _segments()

    def kill_rank1(n: int) -> None:
        if n == 1:
            (name,) = [a for a in _live_rank_actors() if a.startswith("colo-rank1-")]
            ray.kill(ray.get_actor(name, namespace=ray.get_runtime_context().namespace))

    out, paths = _run(tmp_path, "actor-killed", on_cycle=kill_rank1, launcher="ray")
    assert len(out.rewards) == 1
    assert isinstance(out.error, RankFailed) and out.error.rank == 1, out.error
    assert isinstance(out.error.cause, RankDied) and "rank 1" in str(out.error.cause)
    failed = [e for e in _events(paths[1]) if e["event"] == "phase.failed"]
    assert len(failed) == 1 and failed[0]["failed_rank"] == 1
    _assert_nothing_left(before)


def test_sigint_to_a_ray_driver_leaves_no_actor_group_or_segment(cluster, tmp_path):
    before = _segments()
    trace = tmp_path / "int.jsonl"
    cmd = [sys.executable, "-m", "colo.cli", "demo", "--launcher", "ray", "--address", cluster, "--gpus", "2",
           "--steps", "50", "--trace", str(trace), "--quiet"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    rank0 = tmp_path / "int.rank0.jsonl"
    deadline = time.monotonic() + 150
    # interrupted in the middle of the loop: after the first rollout began
    while not (rank0.exists() and "rollout" in rank0.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted (SIGINT)" in err
    _assert_nothing_left(before)


def test_bundles_the_cluster_cannot_place_fail_the_start_naming_them_and_leave_no_group(cluster):
    from colo.ranks.ray_launcher import bundles_for, reserve

    # a CPU cluster has no GPU: neither bundle can be placed
    with pytest.raises(RankDied) as e:
        anyio.run(lambda: reserve(bundles_for(2, gpu=True), strategy="STRICT_PACK", timeout_s=3))
    assert "bundle 0 {'GPU': 1, 'CPU': 1}" in str(e.value) and "bundle 1" in str(e.value)
    assert "STRICT_PACK" in str(e.value)
    assert _live_groups() == []
