"""Issue 41, item 1: the handoff inside the caller's loop. ``to_train()`` and ``to_rollout()``
walk the same table as ``cycle()``; the caller's rollout and step happen in the open
``rollout`` and ``train`` phases; the trace replays clean; refusals change nothing; a failure
in the caller's work is recorded and recovered from; a synchronous loop drives the same
calls through :func:`colo.blocking`."""

from __future__ import annotations

import pytest

from colo.blocking import blocking
from colo.core.config import SchedulerConfig
from colo.core.errors import IllegalTransition
from colo.core.memory import MemoryLedger
from colo.core.phases import PLANS, RECOVERY, Phase, handoff_path
from colo.offline.replay import replay
from colo.scheduler import Scheduler
from colo.testing.fakes import FakeEngine, FakeTrainer, FakeTransport
from colo.trace.writer import TraceWriter, read_trace

P = Phase


def make(plan="offload-first", path=None, **kw):
    trainer, engine = FakeTrainer(), FakeEngine()
    s = Scheduler(trainer, engine, MemoryLedger(total_bytes=10_000), FakeTransport(),
                  trace=TraceWriter(path, keep_events=True), config=SchedulerConfig(plan=plan, bucket_bytes=50), **kw)
    return s, trainer, engine


def phases_of(events):
    return [e["to_phase"] for e in events if e["event"] == "phase.entered"]


def test_a_handoff_walks_the_plan_from_where_it_stands_to_its_target():
    for name, order in PLANS.items():
        after_train = order[order.index(P.TRAIN) + 1:] + (P.ROLLOUT,)
        assert handoff_path(order, P.TRAIN, P.ROLLOUT, engine_current=False) == after_train, name
        assert handoff_path(order, P.ROLLOUT, P.TRAIN, engine_current=True) == \
            (P.ENGINE_RELEASE, P.TRAINER_ONLOAD, P.TRAIN), name
        # a stale engine, from a fresh start or a failure: the recovery order syncs it first
        for start in (None, P.FAILED):
            assert handoff_path(order, start, P.ROLLOUT, engine_current=False) == RECOVERY[1:], name
            # towards train nothing rolls out stale: the release comes first
            assert handoff_path(order, start, P.TRAIN, engine_current=False) == \
                (P.ENGINE_RELEASE, P.TRAINER_ONLOAD, P.TRAIN), name
        # a synced engine with its KV cache back goes to rollout next, in every plan
        assert handoff_path(order, P.ENGINE_WAKE_KV, P.ROLLOUT, engine_current=True) == (P.ROLLOUT,), name
        assert handoff_path(order, P.TRAIN, P.TRAIN, engine_current=True) == ()
    with pytest.raises(ValueError, match="a handoff ends in rollout or train, got sync"):
        handoff_path(PLANS["offload-first"], P.TRAIN, P.SYNC, engine_current=True)


@pytest.mark.parametrize("plan", sorted(PLANS))
async def test_the_callers_loop_walks_what_cycle_walks_and_replays_clean(plan, tmp_path):
    """Three steps of a loop that keeps its own rollout and step, against three cycles:
    the same phases in the same order, the caller's rewards in the trace, a weight version
    per step, every sync of the trainer's weights, the trace valid offline."""
    own, trainer, engine = make(plan, tmp_path / "own.jsonl")
    async with own:
        await own.to_rollout()
        assert own.phase is P.ROLLOUT and not own.stale
        for step in range(3):
            assert engine.resident >= {"weights", "kv_cache"} and own.phase is P.ROLLOUT
            await own.to_train(reward=0.25 * step, tokens=8)
            assert own.phase is P.TRAIN and trainer.resident == {"weights", "optimizer"}
            assert own.trainer_version == step  # the step is the caller's: not counted until it ends
            await own.to_rollout()
            assert own.trainer_version == own.engine_version == step + 1
    assert trainer.calls.count(("train", 0.0)) == 0 and not [c for c in engine.calls if c[0] == "generate"]

    theirs, *_ = make(plan, tmp_path / "cycle.jsonl")
    async with theirs:
        for _ in range(3):
            await theirs.cycle()
    walked, cycled = phases_of(read_trace(tmp_path / "own.jsonl")), phases_of(read_trace(tmp_path / "cycle.jsonl"))
    # the loop's first call enters rollout, its last one enters it again
    assert walked[:-1] == cycled and walked[-1] == "rollout"
    events = read_trace(tmp_path / "own.jsonl")
    assert [(e["step"], e["reward"], e["tokens"]) for e in events if e["event"] == "rollout.finished"] == \
        [(0, 0.0, 8), (1, 0.25, 8), (2, 0.5, 8)]
    assert [e["weight_version"] for e in events if e["event"] == "sync.finished"] == [1, 2, 3]
    # every phase entered is finished, the last rollout by the block's end
    assert len(walked) == len([e for e in events if e["event"] == "phase.finished"])
    assert replay([tmp_path / "own.jsonl"]).valid


async def test_a_stale_engine_is_synced_before_the_first_rollout():
    s, _, engine = make(engine_synced=False)
    async with s:
        await s.to_rollout()
    assert phases_of(s.trace.events) == [p.value for p in RECOVERY[1:]]
    assert [e["weight_version"] for e in s.trace.events if e["event"] == "sync.finished"] == [0]


async def test_calls_out_of_turn_are_refused_and_change_nothing():
    s, *_ = make()
    async with s:
        with pytest.raises(ValueError, match=r"reward and tokens are those of the caller's rollout, which "
                                             r"to_rollout\(\) opens; the phase is not started"):
            await s.to_train(reward=1.0, tokens=4)
        await s.to_rollout()
        before = len(s.trace.events)
        with pytest.raises(IllegalTransition, match="from phase rollout on trigger 'to_rollout'"):
            await s.to_rollout()
        for bad, message in [(dict(reward=1.0), "give reward and tokens together or neither"),
                             (dict(reward=float("nan"), tokens=1), "reward must be a finite number, got nan"),
                             (dict(reward=True, tokens=1), "reward must be a finite number, got True"),
                             (dict(reward=0.5, tokens=-1), "tokens must be an integer >= 0, got -1")]:
            with pytest.raises(ValueError, match=message):
                await s.to_train(**bad)
        assert len(s.trace.events) == before and s.phase is P.ROLLOUT
        await s.to_train()
        with pytest.raises(IllegalTransition, match="from phase train on trigger 'to_train'"):
            await s.to_train()
        assert s.phase is P.TRAIN
        await s.to_rollout()


async def test_a_failure_in_the_callers_step_is_recorded_and_the_next_calls_recover(tmp_path):
    """The caller's step raises inside the scheduler's block: its train phase fails in the
    trace with that error, the engine is stale; a new block starts from the failure: to_train
    goes straight to the release (nothing rolls out stale), to_rollout re-syncs."""
    path = tmp_path / "t.jsonl"
    s, trainer, engine = make(path=path)
    with pytest.raises(RuntimeError, match="the caller's step blew up"):
        async with s:
            await s.to_rollout()
            await s.to_train(reward=0.5, tokens=4)
            raise RuntimeError("the caller's step blew up")
    failed = [e for e in s.trace.events if e["event"] == "phase.failed"]
    assert [(e["phase"], e["error"]) for e in failed] == [("train", "RuntimeError: the caller's step blew up")]
    assert s.phase is P.FAILED and s.stale and s.trainer_version == 0
    assert replay([path]).valid

    # a loop that catches a failed handoff carries on with the same scheduler
    class FlakyEngine(FakeEngine):
        fail_next_resume = False

        async def resume(self, tags):
            if self.fail_next_resume:
                self.fail_next_resume = False
                raise RuntimeError("the engine could not wake")
            await super().resume(tags)

    engine2 = FlakyEngine()
    s2 = Scheduler(FakeTrainer(), engine2, MemoryLedger(total_bytes=10_000), FakeTransport(),
                   trace=TraceWriter(None, keep_events=True), config=SchedulerConfig(bucket_bytes=50))
    async with s2:
        await s2.to_rollout()
        await s2.to_train()
        engine2.fail_next_resume = True
        with pytest.raises(RuntimeError, match="the engine could not wake"):
            await s2.to_rollout()
        assert s2.phase is P.FAILED and s2.stale
        await s2.to_train()
        assert phases_of(s2.trace.events)[-3:] == ["engine_release", "trainer_onload", "train"]
        assert s2.stale  # not synced on the way to train
        await s2.to_rollout()
        assert not s2.stale and s2.phase is P.ROLLOUT
    assert replay_events(s2.trace.events)


def replay_events(events) -> bool:
    import json
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        for e in events:
            f.write(json.dumps(e) + "\n")
    return replay([f.name]).valid


def test_a_synchronous_loop_drives_the_same_handoff_through_blocking(tmp_path):
    path = tmp_path / "sync.jsonl"
    trainer, engine = FakeTrainer(), FakeEngine()
    with blocking() as loop:
        sched = loop.enter(Scheduler(trainer, engine, MemoryLedger(total_bytes=10_000), FakeTransport(),
                                     trace=TraceWriter(path), engine_synced=False))
        sched.to_rollout()
        for step in range(2):
            sched.to_train(reward=1.0, tokens=2)
            trainer.calls.append(("my own step", step))  # the caller's training, on its thread
            sched.to_rollout()
        assert sched.engine_version == sched.trainer_version == 2 and sched.phase is P.ROLLOUT
        with pytest.raises(IllegalTransition):
            sched.to_rollout()  # raised here, from the loop's thread
    events = read_trace(path)
    assert events[-1]["event"] == "trace.finished"  # the block's end exited the scheduler
    assert [e["weight_version"] for e in events if e["event"] == "sync.finished"] == [0, 1, 2]
    assert replay([path]).valid


def test_the_synchronous_loop_in_docs_embedding_md_runs_and_keeps_the_engine_on_the_trainers_weights(tmp_path):
    """docs/embedding.md's runnable loop, as written (tests/docs runs every block; this one
    is also held to what it prints): after each of its steps the engine holds exactly the
    trainer's weights at that step's version, and its trace replays clean."""
    from tests.docs.blocks import blocks, run_python, scratch

    [block] = [b for b in blocks() if b.path.name == "embedding.md" and b.lang == "python"]
    proc = run_python(block, scratch(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert [ln.split(", engine at ")[1] for ln in lines[:3]] == [
        f"version {v}, holds the trainer's weights: True" for v in (1, 2, 3)]
    assert lines[3] == "the trace replays clean: True"
