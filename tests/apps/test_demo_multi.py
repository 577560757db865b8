"""``colo demo --gpus 2`` on the CPU: two worker processes (gloo), each with a trainer
rank and an engine rank of a TP=2 engine; every sync is verified on every engine
rank inside the run (shard digest and probe logits), so a run that completes
proves it. These tests check what the run left: per-rank traces that replay clean
together, shard digests that differ by rank, the same weights after an engine
rank was killed mid-sync, and refusals before any process starts.
"""

from __future__ import annotations

import json

import pytest

from colo.offline.replay import replay

from tests.multirank import shared_run, two_rank_run

#: on the Ray modules' pytest worker (tools/test): the hf run here is the process run that
#: tests/ranks/test_ray.py compares its Ray run with, made once per worker (shared_run), so
#: once, not once on each of two workers
pytestmark = pytest.mark.xdist_group("ray")


def _events(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One 2-rank run per trainer (hf's is shared with the Ray tests), and the hf run again
    with an engine rank killed mid-sync."""
    tmp = tmp_path_factory.mktemp("multi")
    return {"hf": shared_run(tmp_path_factory, trainer="hf"),
            # quarter-MiB buckets: the 1 MiB embedding and lm_head and the 512 KiB gate/up
            # (gathered piece by piece into staging) and down_proj (gathered whole, then cut)
            # each cross several buckets
            "megatron": two_rank_run(tmp, "megatron", trainer="megatron", steps=2, bucket_mib=0.25),
            "fsdp": two_rank_run(tmp, "fsdp", trainer="fsdp", steps=2),
            "hf-killed": two_rank_run(tmp, "hf-killed", trainer="hf", fault="kill-engine@sync", fault_step=1)}


@pytest.mark.parametrize("kind", ["hf", "megatron", "fsdp"])
def test_two_rank_demo_verifies_every_sync_and_its_traces_replay_clean_together(runs, kind):
    out, paths = runs[kind]
    assert out.error is None, out.error
    steps = len(out.rewards)
    assert steps == (3 if kind == "hf" else 2) and all(0.0 <= r <= 1.0 for r in out.rewards)
    report = replay([str(p) for p in paths])
    assert report.valid, [f.as_dict() for f in report.findings][:5]
    syncs = [[e for e in _events(p) if e["event"] == "sync.finished"] for p in paths]
    # the start-up sync is not a sync of a trained step: one per cycle
    assert [len(s) for s in syncs] == [steps, steps]
    for a, b in zip(*syncs):
        assert a["weight_version"] == b["weight_version"]
        # each engine rank holds its own shard: the two digests differ, and each equals
        # the trainer's shard digest for that rank (checked in the run, or it fails)
        assert a["digest"] != b["digest"]
        assert a["bytes"] == b["bytes"] > 0
        if kind == "megatron":
            assert a["buckets"] == b["buckets"] >= a["bytes"] // (256 << 10)
    # megatron's TP ranks are the engine's: each sends its engine rank its own slices (issue 46),
    # about half the model; the others gather and hand off the whole model
    whole = [e for e in _events(runs["hf"][1][0]) if e["event"] == "sync.finished"][0]["bytes"]
    start = _events(paths[0])[0]
    assert start["config"]["own_slices"] == [kind == "megatron"] * 2
    if kind == "megatron":
        assert whole / 2 < syncs[0][0]["bytes"] < 0.6 * whole
    else:
        assert syncs[0][0]["bytes"] == whole


def test_each_rank_writes_its_own_trace_with_its_rank_and_the_world_size(runs):
    _, paths = runs["hf"]
    for rank, p in enumerate(paths):
        start = _events(p)[0]
        assert start["event"] == "trace.started" and start["rank"] == rank and start["world_size"] == 2
        assert start["config"]["gpus"] == 2


def test_ranks_of_two_real_runs_are_refused_together_by_replay_and_tune(runs, capsys):
    """Issue 32, item 7: rank 0 of one ``colo demo --gpus 2`` and rank 1 of another were
    replayed as one valid run, and tuned as one."""
    from colo.cli import main

    (_, a), (_, b) = runs["hf"], runs["hf-killed"]
    ids = [[_events(p)[0]["run_id"] for p in paths] for paths in (a, b)]
    assert ids[0][0] == ids[0][1] != ids[1][0] == ids[1][1]  # one id per run, in every rank's trace
    for command in ("replay", "tune"):
        assert main([command, str(a[0]), str(b[1])]) == 2
        err = capsys.readouterr().err
        assert err.strip() == (f"colo {command}: {a[0]} (rank 0) is of run {ids[0][0]} but {b[1]} (rank 1) is of "
                               f"run {ids[1][0]}; expected the ranks of one run")


def test_an_engine_rank_killed_mid_sync_is_failed_safe_recovered_and_ends_at_the_same_weights(runs):
    clean, _ = runs["hf"]
    out, paths = runs["hf-killed"]
    assert out.error is None, out.error
    assert out.trainer_digest == clean.trainer_digest is not None and out.rewards == clean.rewards
    failed = [e for e in _events(paths[1]) if e["event"] == "phase.failed"]
    assert [e["phase"] for e in failed] == ["sync"] and "EngineDied" in failed[0]["error"]
    assert failed[0]["failed_rank"] == 1
    # rank 0's engine loaded everything and still was marked stale: rank 0 failed too
    assert [e["phase"] for e in _events(paths[0]) if e["event"] == "phase.failed"] == ["sync"]
    assert replay([str(p) for p in paths]).valid


def test_an_engine_rank_killed_mid_sync_of_its_own_slices_is_recovered_at_the_same_weights(runs, tmp_path):
    """The same fault where each Megatron rank sends its engine rank its own slices (issue 46):
    rank 1's engine dies after its first bucket of a sync in which no rank gathers anything,
    every rank fails the phase, the TP group is restarted, and the run ends at the weights and
    rewards of the fault-free megatron run."""
    clean, _ = runs["megatron"]
    out, paths = two_rank_run(tmp_path, "megatron-killed", trainer="megatron", steps=2, bucket_mib=0.25,
                              fault="kill-engine@sync", fault_step=1)
    assert out.error is None, out.error
    assert _events(paths[0])[0]["config"]["own_slices"] == [True, True]
    assert out.trainer_digest == clean.trainer_digest is not None and out.rewards == clean.rewards
    failed = [e for e in _events(paths[1]) if e["event"] == "phase.failed"]
    assert [e["phase"] for e in failed] == ["sync"] and "EngineDied" in failed[0]["error"]
    assert failed[0]["failed_rank"] == 1
    # rank 0's engine loaded its part and still was marked stale: rank 0 failed too
    assert [e["phase"] for e in _events(paths[0]) if e["event"] == "phase.failed"] == ["sync"]
    assert replay([str(p) for p in paths]).valid


#: a SIGKILLed engine rank is found dead by the next call into it, as the injected kill of
#: test_an_engine_rank_killed_mid_sync_... finds it (the same fail-safe and restart of the TP
#: group); a stopped one answers nothing and is found only by the stop watch, which nothing else
#: here takes. So CI runs the stop; COLO_MATRIX=1 adds the kill (146 s of a pytest worker in the
#: fresh-clone run under load of 2026-11-30), as tests/vllm/test_ranks.py does for vLLM's ranks
@pytest.mark.parametrize("sig", [pytest.param("SIGKILL", marks=pytest.mark.matrix), "SIGSTOP"])
def test_an_engine_rank_signalled_from_outside_is_replaced_and_the_run_ends_at_the_fault_free_weights(
        runs, tmp_path, sig):
    """Rank 1's engine process is killed, or stopped, from outside the run after its first cycle
    (nobody injected it): the next call into it reports the engine dead (a stopped one is seen
    stopped and killed), the run fails safe, the TP group is restarted, and the run goes on to the
    fault-free run's rewards and weights."""
    import os
    import signal

    from colo.proc.lifecycle import process_state

    clean, _ = runs["hf"]
    victim: list[int] = []

    def on_cycle(n: int) -> None:
        if n == 1:
            # which process is which rank's engine: the run's first event says
            pids = _events(tmp_path / "signalled.rank0.jsonl")[0]["config"]["pids"]
            victim.append(pids[1]["engine"])
            os.kill(victim[0], getattr(signal, sig))

    out, paths = two_rank_run(tmp_path, "signalled", trainer="hf", on_cycle=on_cycle)
    assert out.error is None, out.error
    assert out.rewards == clean.rewards and out.trainer_digest == clean.trainer_digest is not None
    assert [r["fault"] for r in out.recoveries] == ["engine-died"] and out.recoveries[0]["recovered"] is True
    assert out.recoveries[0]["replaced_ranks"] == [0, 1]  # a TP group restarts whole
    failed = [e for e in _events(paths[1]) if e["event"] == "phase.failed"]
    # the call failed on rank 1 (its engine dead) or first on rank 0 (its TP collective lost the
    # peer): whichever the driver heard first, rank 1's engine was found dead and rank 0's alive
    assert len(failed) == 1 and ("EngineDied" in failed[0]["error"] or failed[0]["failed_rank"] == 0), failed
    assert out.recoveries[0]["engine_ranks_alive"] == [True, False]
    assert replay([str(p) for p in paths]).valid
    # the signalled process is gone, not left stopped or running
    assert process_state(victim[0]) in (None, "Z", "X"), process_state(victim[0])


async def test_an_engine_death_is_recovered_from_whichever_ranks_error_arrived_first():
    """Rank 1's engine dies (or is stopped, then killed), and rank 0's engine, whose TP
    collective lost its peer, fails the same call: whichever error the driver sees first, the
    run recovers when an engine rank is found dead; not when every engine rank lives (a failure
    nobody injected that would recur), nor past MAX_ENGINE_DEATHS."""
    from types import SimpleNamespace

    from colo.apps.demo_multi import MultiDemoRun, RankRecovery
    from colo.apps.demo_setup import MAX_ENGINE_DEATHS
    from colo.core.errors import EngineDied, EngineError, RankFailed

    run = MultiDemoRun.__new__(MultiDemoRun)
    run.cfg, run.recoveries, run.transports = SimpleNamespace(fault=None), [], []
    alive = [True, False]

    async def each_worker(op: str, **_):
        assert op == "engine_alive"
        return [{"alive": a} for a in alive]

    run._each_worker = each_worker
    peer = RankFailed("engine", "generate", 0, EngineError("engine generate", "RuntimeError",
                                                           "Connection closed by peer"), {})
    assert await run._recoverable(peer) is True
    assert await run._recoverable(RankFailed("engine", "generate", 1, EngineDied("rank 1: stopped"), {})) is True
    alive[1] = True
    assert await run._recoverable(peer) is False
    run.recoveries = [RankRecovery(fault="engine-died")] * MAX_ENGINE_DEATHS
    assert await run._recoverable(EngineDied("again")) is False


def _cli(capsys, *args: str) -> tuple[int, str]:
    """``colo demo ARGS`` in this process (each is refused before anything starts)."""
    from colo.cli import main

    try:
        code = main(["demo", *args])
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.mark.parametrize("args, message", [
    (["--gpus", "3"], "does not divide num_attention_heads 4"),
    (["--gpus", "0"], "--gpus"),
    (["--gpus", "2", "--fault", "raise@train"], "kill-engine@sync"),
    (["--gpus", "2", "--device", "cuda"], "CUDA"),
    (["--gpus", "2", "--engine-visible-devices", "0"], "--engine-visible-devices"),
])
def test_bad_multi_gpu_input_is_refused_with_exit_two_before_any_rank_starts(tmp_path, capsys, args, message):
    trace = tmp_path / "t.jsonl"
    code, text = _cli(capsys, *args, "--steps", "1", "--trace", str(trace), "--quiet")
    assert code == 2, text[-2000:]
    assert message in text
    assert not list(tmp_path.glob("t*.jsonl"))  # no trace written: nothing started
