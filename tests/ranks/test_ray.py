"""``colo demo --launcher ray --gpus 2`` on the CPU: rank r's trainer actor and engine actor
share bundle r of a placement group on a local Ray cluster (gloo groups), the driver here.

Every sync is verified on every engine rank inside the run (shard digest and probe
logits), so a run that completes proves it. These tests check what the runs left: the
same rewards and trainer weights as the 2-rank run of local worker processes, per-rank
traces that replay clean together, each rank's two actors on its own bundle (as Ray
accounts them), an engine actor killed mid-sync whose TP group is replaced in its
bundles and ends at the same weights, a trainer actor killed from outside that fails
the next phase naming the rank, and no actor, placement group or /dev/shm segment left
behind — also after SIGINT to a driver in another process.

One local cluster serves the module (Ray takes seconds to start on two cores), and the
launcher reuses a Ray that is already initialised; both faults share one run. What is
left is counted with Ray's own GCS-backed calls (``ray.util.list_named_actors``,
``ray.util.placement_group_table``): ``ray.util.state`` needs the dashboard, which a
plain ``pip install ray`` does not have.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import anyio
import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install -e '.[ray]'")

from tests.multirank import shared_run, two_rank_run  # noqa: E402
from tests.waits import CEILING_S  # noqa: E402
from colo.core.errors import RankDied, RankFailed  # noqa: E402
from colo.offline.replay import replay  # noqa: E402
from colo.proc.handles import leftover_segments  # noqa: E402
from colo.ranks.ray_launcher import WORKER_NICENESS  # noqa: E402
from tests.soak_probe import descendants  # noqa: E402

#: one worker runs the modules that start a Ray cluster, one after the other (tests/conftest.py):
#: two clusters starting at once on two busy cores outwait Ray's own start limits
pytestmark = pytest.mark.xdist_group("ray")

#: small rollouts: four processes share two cores, and a TP=2 engine all-reduces per layer per token


def _events(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def _segments(also: set[int] = frozenset()) -> set[str]:
    """/dev/shm segments made by this cluster's actor processes (Ray's GCS keeps a dead
    actor's pid) or by the pids in ``also``, whose maker is gone: leaked ones. Only those:
    other colo runs on this machine (another pytest worker's) make and leave their own
    meanwhile."""
    from ray._private import state

    pids = {int(a["Pid"]) for a in state.actors().values() if a.get("Pid")} | set(also)
    return {n for pid in pids if not os.path.exists(f"/proc/{pid}") for n in leftover_segments(pid)}


@contextlib.contextmanager
def _descendants_seen(poll_s: float = 0.05):
    """The pids of every process below this one while the block runs (sampled: a rank worker
    or an engine lives for seconds), for :func:`_segments` to count what they leave."""
    seen: set[int] = set()
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            seen.update(descendants(os.getpid()))
            stop.wait(poll_s)

    t = threading.Thread(target=sample, name="descendants-seen", daemon=True)
    t.start()
    try:
        yield seen
    finally:
        stop.set()
        t.join()


def _live_actors(prefix: str = "colo-") -> list[str]:
    """colo's named actors that are alive (or starting) in this cluster: rank and engine actors."""
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix))


def _live_groups() -> list[str]:
    """colo's placement groups not yet removed (the launcher names them ``colo-*``)."""
    return [pg_id for pg_id, pg in ray.util.placement_group_table().items()
            if pg["state"] != "REMOVED" and str(pg.get("name", "")).startswith("colo-")]


def _assert_nothing_left(segments_before: set[str], also: set[int] = frozenset()) -> None:
    deadline = time.monotonic() + CEILING_S  # ray.kill is asynchronous: the actor is dead a moment later
    while (_live_actors() or _live_groups()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _live_actors() == []
    assert _live_groups() == []
    assert _segments(also) - segments_before == set()


def _actor(name: str):
    return ray.get_actor(name, namespace=ray.get_runtime_context().namespace)


def _placements() -> dict[str, dict]:
    """Where Ray runs each live colo actor (its node, placement group and the bundle it draws on)."""
    return {name: ray.get(_actor(name).where.remote(), timeout=60) for name in _live_actors()}


def _by_rank(placements: dict[str, dict], kind: str) -> dict[int, tuple[str, dict]]:
    out = {}
    for name, where in placements.items():
        if name.startswith(f"colo-{kind}"):
            out[int(name.removeprefix(f"colo-{kind}").split("-")[0])] = (name, where)
    return out


def _run(tmp_path, name: str, on_cycle=None, **kw):
    return two_rank_run(tmp_path, name, on_cycle=on_cycle, **kw)


@pytest.fixture(scope="module")
def cluster():
    # more CPUs than cores: each rank's bundle takes one CPU, and the SIGINT test's driver is a second job
    # its workers at colo's niceness, as a cluster colo starts has them (Ray's 15 starves them beside other load)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             _system_config={"worker_niceness": WORKER_NICENESS})
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def runs(cluster, tmp_path_factory):
    """The same 3-step run by local worker processes and by Ray actors; and by Ray actors
    with rank 1's engine actor killed mid-sync in step 2 and, after step 3, rank 1's
    trainer actor killed, so that step 4 fails. What Ray says about the actors is taken
    between cycles: each rank's placement, and the trainer's weights before the kill."""
    tmp = tmp_path_factory.mktemp("ray")
    before = _segments()
    seen: dict[str, Any] = {}

    def look(n: int) -> None:
        if n == 1:
            seen["clean"] = _placements()

    def faults(n: int) -> None:
        if n == 2:  # after the recovered cycle
            seen["recovered"] = _placements()
        if n == 3:
            trainers = [_actor(name) for name, _ in sorted(_by_rank(_placements(), "rank").values())]
            # a collective: every rank at once, asked straight through Ray
            digests = ray.get([a.handle.remote("full_digest", {}) for a in trainers], timeout=120)
            seen["digest_before_kill"] = [d["digest"] for d in digests]
            ray.kill(trainers[1])

    # the process launcher's run is the one tests/apps/test_demo_multi.py checks too: run once
    # (its rank workers and engines are this process's children: their leftovers count too)
    with _descendants_seen() as children:
        out = {"process": shared_run(tmp_path_factory, trainer="hf"),
               "ray": _run(tmp, "ray", on_cycle=look, launcher="ray"),
               "ray-faults": _run(tmp, "ray-faults", on_cycle=faults, launcher="ray", steps=4,
                                  fault="kill-engine@sync", fault_step=1)}
    _assert_nothing_left(before, children)  # after a clean run, an engine actor's death and a trainer actor's
    out["seen"] = seen
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


def _assert_each_rank_shares_its_bundle(placements: dict[str, dict], engine_generation: int) -> None:
    """Rank r's trainer actor and engine actor draw on bundle r of one placement group, on one node."""
    trainers, engines = _by_rank(placements, "rank"), _by_rank(placements, "engine")
    assert sorted(trainers) == sorted(engines) == [0, 1], sorted(placements)
    groups = {w["placement_group_id"] for _, w in [*trainers.values(), *engines.values()]}
    assert len(groups) == 1 and None not in groups
    for r in (0, 1):
        (_, t), (name, e) = trainers[r], engines[r]
        assert t["bundles"] == e["bundles"] == [r], (r, t, e)
        assert t["node_id"] == e["node_id"] and t["pid"] != e["pid"]
        assert name.endswith(f"-{engine_generation}")  # the rank's n-th engine actor


def test_each_ranks_trainer_and_engine_actors_share_its_bundle(runs):
    _assert_each_rank_shares_its_bundle(runs["seen"]["clean"], engine_generation=1)


def test_an_engine_actor_killed_mid_sync_is_replaced_in_its_bundle_and_the_run_ends_at_the_same_weights(runs):
    clean, _ = runs["ray"]
    out, paths = runs["ray-faults"]
    seen = runs["seen"]
    # failed safe: rank 1's engine died mid-sync; rank 0's loaded everything and was marked stale too
    failed = [[e for e in _events(p) if e["event"] == "phase.failed"] for p in paths]
    assert failed[1][0]["phase"] == "sync" and "EngineDied" in failed[1][0]["error"]
    assert failed[1][0]["failed_rank"] == 1 and failed[0][0]["phase"] == "sync"
    # the engine TP group restarted as a whole: both ranks run their second engine actor, each
    # on its own rank's bundle; the first ones are gone
    _assert_each_rank_shares_its_bundle(seen["recovered"], engine_generation=2)
    # the recovery sync filled every engine rank, and the run went on to the clean run's weights
    syncs = [[e for e in _events(p) if e["event"] == "sync.finished"] for p in paths]
    assert [len(s) for s in syncs] == [3, 3]  # the failed sync finished on neither rank
    assert out.rewards == clean.rewards
    assert seen["digest_before_kill"] == [clean.trainer_digest] * 2
    assert replay([str(p) for p in paths]).valid


def test_a_trainer_actor_killed_from_outside_fails_the_next_phase_naming_the_rank(runs):
    out, paths = runs["ray-faults"]
    assert len(out.rewards) == 3  # the kill came after step 3; step 4 failed
    assert isinstance(out.error, RankFailed) and out.error.rank == 1, out.error
    assert isinstance(out.error.cause, RankDied) and "rank 1" in str(out.error.cause)
    assert "not replaced" in str(out.error.cause)  # it says why the run ends here
    failed = [e for e in _events(paths[1]) if e["event"] == "phase.failed"]
    assert [e["phase"] for e in failed] == ["sync", "rollout"] and failed[-1]["failed_rank"] == 1
    # nothing left of it, nor of its engine actor (Ray ends an actor whose owner died):
    # checked in the fixture, after the run


def test_sigint_to_a_ray_driver_leaves_no_actor_group_or_segment(cluster, tmp_path):
    before = _segments()
    trace = tmp_path / "int.jsonl"
    cmd = [sys.executable, "-m", "colo.cli", "demo", "--launcher", "ray", "--address", cluster, "--gpus", "2",
           "--steps", "50", "--trace", str(trace), "--quiet"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    rank0 = tmp_path / "int.rank0.jsonl"
    deadline = time.monotonic() + 2 * CEILING_S  # a hang guard: 41 s on a quiet machine
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


# -- issue 32, item 4: a rank actor killed mid-sync fails the run and leaves nothing ---------------


def _actor_pids(prefix: str) -> dict[str, int]:
    """The live colo actors' worker pids by name, as Ray's GCS records them."""
    from ray._private import state

    return {a["Name"]: int(a["Pid"]) for a in state.actors().values()
            if str(a.get("Name", "")).startswith(prefix) and a.get("State") == "ALIVE" and a.get("Pid")}


def test_a_rank_actor_sigkilled_mid_sync_fails_the_run_naming_it_and_leaves_nothing(cluster, tmp_path):
    """SIGKILL of rank 1's trainer actor's worker process while it holds its staging
    segments in a sync: the run fails naming rank 1 (exit 1, one FAILED line, no
    traceback, the sync's phase.failed with failed_rank 1 in both traces: the engines
    stale), and within 10 s of the driver's exit nothing of the run is left: no colo
    actor, no placement group, no actor process, no colo dir, and no segment of any of
    its actors (before: the killed actor's 2 segments stayed until the next run's start).
    Its segments are checked at the driver's exit too: any colo run started on this
    machine meanwhile sweeps them as well, which would hide a driver that does not."""
    import psutil

    trace = tmp_path / "t.jsonl"
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": os.getcwd()}
    cmd = [sys.executable, "-m", "colo.cli", "demo", "--launcher", "ray", "--address", cluster, "--gpus", "2",
           "--steps", "50", "--bucket-mib", "0.05", "--trace", str(trace), "--quiet"]
    with open(tmp_path / "stderr", "wb") as ferr, open(tmp_path / "stdout", "wb") as fout:
        proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=fout, stderr=ferr, env=env)
    try:
        deadline, pids, held = time.monotonic() + 2 * CEILING_S, {}, []
        while not held:  # rank 1's actor is inside a sync: it holds segments it made
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr").read_text()[-3000:]
            pids = pids if len(pids) == 4 else _actor_pids("colo-")  # 2 rank actors, 2 engine actors
            victim = next((pid for name, pid in pids.items() if name.startswith("colo-rank1-")), None)
            held = leftover_segments(victim) if victim and len(pids) == 4 else []
            time.sleep(0.005)
        os.kill(victim, signal.SIGKILL)
        code = proc.wait(120)
        # at the driver's exit: any colo run's start-up on this machine sweeps them too, later
        at_exit = leftover_segments(victim)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = (tmp_path / "stderr").read_text(errors="replace")
    out = (tmp_path / "stdout").read_text(errors="replace")
    assert code == 1, (code, err[-3000:])
    assert "Traceback" not in err + out, err[-3000:]
    failed = [ln for ln in (err + out).splitlines() if "FAILED" in ln]
    assert len(failed) == 1 and "FAILED in phase sync" in failed[0] and "rank 1" in failed[0], (failed, err[-2000:])
    traces = [tmp_path / "t.rank0.jsonl", tmp_path / "t.rank1.jsonl"]
    for t in traces:
        events = _events(t)
        assert events[-1]["event"] == "trace.finished", t
        (f,) = [e for e in events if e["event"] == "phase.failed"]
        assert (f["phase"], f["failed_rank"]) == ("sync", 1), f
    assert replay([str(t) for t in traces]).valid
    deadline = time.monotonic() + CEILING_S
    while time.monotonic() < deadline:
        left = ([n for pid in pids.values() for n in leftover_segments(pid)], _live_actors(), _live_groups(),
                [pid for pid in pids.values() if psutil.pid_exists(pid)
                 and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE],
                sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("colo-")))
        if not any(left):
            break
        time.sleep(0.2)
    assert held  # what rank 1's actor held when it was killed: gone below, and by the driver's exit
    assert at_exit == [], "the killed rank actor's segments outlived the driver"
    assert left == ([], [], [], [], []), "segments, actors, groups, actor processes, dirs of the run left behind"
