import dataclasses

import anyio
import pytest

from colo.core.config import SchedulerConfig
from colo.core.invariants import InvariantChecker, InvariantViolation
from colo.core.memory import MemoryLedger, OutOfMemory
from colo.core.phases import PLANS, IllegalTransition, Phase
from colo.scheduler import Scheduler
from colo.trace.writer import TraceWriter, read_trace
from colo.testing.fakes import FakeEngine, FakeTrainer, FakeTransport

INNER = {
    "rollout": ["rollout.finished"],
    "engine_release": ["memory.paused:engine.kv_cache", "memory.paused:engine.cuda_graph",
                       "memory.paused:engine.weights"],
    "trainer_onload": ["memory.resumed:trainer.weights", "memory.resumed:trainer.optimizer"],
    "train": [],
    "trainer_offload": ["memory.paused:trainer.optimizer", "memory.paused:trainer.weights"],
    "engine_wake_weights": ["memory.resumed:engine.weights"],
    "engine_wake_kv": ["memory.resumed:engine.kv_cache", "memory.resumed:engine.cuda_graph"],
}


def project(ev):
    name = ev["event"]
    if name == "phase.entered":
        return f"{name}:{ev['to_phase']}"
    if name in ("phase.finished", "phase.failed"):
        return f"{name}:{ev['phase']}"
    if name.startswith("memory."):
        return f"{name}:{ev['owner']}.{ev['tag']}"
    if name == "bucket.finished":
        return f"bucket:{ev['bucket']}:{ev['stage']}"
    return name


def expected_cycle(plan, n_buckets, source):
    out = []
    for p in PLANS[plan]:
        out.append(f"phase.entered:{p.value}")
        if p is Phase.SYNC:
            stages = ["upload", "gather", "pack", "handoff", "load"] if source == "host" else \
                ["gather", "pack", "handoff", "load"]
            out += [f"bucket:{b}:{s}" for b in range(n_buckets) for s in stages]
            out.append("sync.finished")
        else:
            out += INNER[p.value]
        out.append(f"phase.finished:{p.value}")
    return out


def make(plan="offload-first", total=10_000, bucket=50, transport=None, path=None, **kw):
    trainer, engine = FakeTrainer(), FakeEngine()
    memory = MemoryLedger(total_bytes=total)
    trace = TraceWriter(path, keep_events=True)
    s = Scheduler(trainer, engine, memory, transport or FakeTransport(), trace=trace,
                  config=SchedulerConfig(plan=plan, bucket_bytes=bucket), **kw)
    return s, trainer, engine, memory, trace


@pytest.mark.parametrize("plan", sorted(PLANS))
async def test_each_plan_runs_three_cycles_with_the_expected_events(plan, tmp_path):
    path = tmp_path / "t.jsonl"
    s, trainer, engine, memory, trace = make(plan, path=path)
    async with s:
        for _ in range(3):
            await s.cycle()
    events = read_trace(path)
    assert events == trace.events  # the file holds exactly what was emitted
    assert events[0]["event"] == "trace.started" and events[-1]["event"] == "trace.finished"
    body = [project(e) for e in events[1:-1]]
    source = "device" if plan == "sync-first" else "host"
    # 10 tensors of 10 B, 16-byte aligned under 50 B: 3 per bucket -> 4 buckets
    assert body == expected_cycle(plan, 4, source) * 3
    syncs = [e for e in events if e["event"] == "sync.finished"]
    assert [e["weight_version"] for e in syncs] == [1, 2, 3]
    assert all(e["bytes"] == 100 and e["tensors"] == 10 and e["params"] == 10 for e in syncs)
    assert [e["step"] for e in events if e["event"] == "rollout.finished"] == [0, 1, 2]
    assert s.engine_version == s.trainer_version == 3 and engine.version == 3
    assert memory.staging_bytes == 0
    # replaying the recorded file through a fresh checker finds nothing
    checker = InvariantChecker()
    assert [v for i, e in enumerate(events, 1) for v in checker.feed(e, i)] == []


async def test_every_phase_event_carries_memory_by_tag():
    s, *_ , trace = make()
    async with s:
        await s.cycle()
    for e in trace.events:
        if e["event"].startswith("phase."):
            assert set(e["mem"]) == {"used", "total", "by_tag"}
            assert e["mem"]["used"] == sum(e["mem"]["by_tag"].values())
    rollout = next(e for e in trace.events if e["event"] == "phase.entered" and e["to_phase"] == "rollout")
    assert rollout["mem"]["by_tag"] == {"engine.weights": 100, "engine.kv_cache": 300,
                                        "engine.cuda_graph": 20, "trainer.weights": 0,
                                        "trainer.optimizer": 0, "staging": 0}


async def test_staging_never_exceeds_two_buckets_and_is_freed():
    s, _, _, memory, trace = make(bucket=50)
    async with s:
        await s.cycle()
    peak = max(e["mem"]["by_tag"]["staging"] for e in trace.events if "mem" in e and e["event"] == "bucket.finished")
    assert 0 < peak <= 2 * 42  # two live buckets of 42 B (3 x 10 B, 16-byte aligned)
    assert memory.staging_bytes == 0


async def test_failed_sync_leaves_engine_stale_refuses_rollout_and_retry_recovers():
    transport = FakeTransport(fail_at_bucket=2)
    s, trainer, engine, memory, trace = make(transport=transport)
    async with s:
        with pytest.raises(RuntimeError, match="receiver failed in bucket 2"):
            await s.cycle()
        assert s.phase is Phase.FAILED
        assert s.stale and engine.version is None
        assert memory.staging_bytes == 0 and transport.aborted == 1
        failed = [e for e in trace.events if e["event"] == "phase.failed"]
        assert len(failed) == 1 and failed[0]["phase"] == "sync"
        assert "receiver failed in bucket 2" in failed[0]["error"]
        n = len(trace.events)
        with pytest.raises(IllegalTransition, match="from phase failed on trigger 'rollout'"):
            await s.run_phase(Phase.ROLLOUT)
        with pytest.raises(IllegalTransition):
            await s.cycle()
        assert len(trace.events) == n and s.phase is Phase.FAILED  # refused: nothing written
        transport.fail_at_bucket = None
        await s.recover()
        assert not s.stale and engine.version == s.trainer_version == 1
        await s.cycle()
    assert s.engine_version == 2
    recovery = [e["to_phase"] for e in trace.events if e["event"] == "phase.entered"][7:13]
    assert recovery == ["failed", "engine_release", "trainer_offload", "engine_wake_weights", "sync",
                        "engine_wake_kv"]


async def test_rollout_refused_while_engine_is_stale_and_state_unchanged():
    s, _, engine, _, trace = make(engine_synced=False)
    async with s:
        n = len(trace.events)
        with pytest.raises(InvariantViolation, match="invariant 1: rollout refused: the engine's weights are stale"):
            await s.run_phase(Phase.ROLLOUT)
        assert s.phase is None and len(trace.events) == n
        await s.recover()  # from a fresh start: release, offload (no-op), wake, sync, wake kv
        await s.cycle()
    assert s.engine_version == 1


async def test_train_refused_without_trainer_state_resident():
    s, *_ = make()
    async with s:
        await s.run_phase(Phase.ROLLOUT)
        await s.run_phase(Phase.ENGINE_RELEASE)
        s.machine.phase = Phase.TRAINER_ONLOAD  # skip the onload: the invariant must catch it
        with pytest.raises(InvariantViolation, match="invariant 2: train refused: trainer.weights is not resident"):
            await s.run_phase(Phase.TRAIN)


async def test_cancelling_mid_sync_frees_staging_and_writes_phase_failed():
    transport = FakeTransport(block_at_bucket=1)
    s, _, engine, memory, trace = make(transport=transport)
    async with s:
        async with anyio.create_task_group() as tg:
            tg.start_soon(s.cycle)
            await transport.blocked.wait()
            assert memory.staging_bytes > 0  # two buffers live at the moment of cancel
            tg.cancel_scope.cancel()
        assert memory.staging_bytes == 0
        assert s.phase is Phase.FAILED and s.stale and engine.version is None
    failed = [e for e in trace.events if e["event"] == "phase.failed"]
    assert [(e["phase"], e["error"]) for e in failed] == [("sync", "cancelled")]
    assert failed[0]["mem"]["by_tag"]["staging"] == 0
    assert trace.events[-1]["event"] == "trace.finished"


async def test_deadline_ends_the_phase_in_failed():
    transport = FakeTransport(block_at_bucket=0)
    s, *_, trace = make(transport=transport)
    s.config = SchedulerConfig(plan="offload-first", bucket_bytes=50, deadlines={"sync": 0.05})
    async with s:
        with pytest.raises(TimeoutError):
            await s.cycle()
    failed = [e for e in trace.events if e["event"] == "phase.failed"]
    assert failed[0]["phase"] == "sync" and failed[0]["error"] == "deadline of 0.05 s exceeded in sync"


async def test_a_deadline_raises_an_error_that_says_which_deadline_and_phase():
    """Issue 32, item 6: what the caller catches (and ``colo demo`` prints) names the phase and
    its deadline, as the trace does; it was an empty ``TimeoutError``. Still a TimeoutError."""
    from colo.core.errors import PhaseDeadline

    s, *_ = make(transport=FakeTransport(block_at_bucket=0))
    s.config = SchedulerConfig(plan="offload-first", bucket_bytes=50, deadlines={"sync": 0.05})
    async with s:
        with pytest.raises(PhaseDeadline) as ei:
            await s.cycle()
    assert isinstance(ei.value, TimeoutError)
    assert str(ei.value) == "deadline of 0.05 s exceeded in sync"


async def test_single_stage_runs_out_of_memory_where_kv_and_sync_buffers_meet():
    # engine: weights 100 + kv 300 + graphs 20 = 420; trainer: 100 + 200; buckets of 42 B.
    total = 450
    ok, *_ = make("offload-first", total=total)
    async with ok:
        for _ in range(2):
            await ok.cycle()
    assert ok.memory.peak_bytes == 420  # rollout / wake_kv bind; sync needs only 100 + 2 x 42

    s, _, _, memory, trace = make("single-stage", total=total)
    async with s:
        with pytest.raises(OutOfMemory) as ei:
            await s.cycle()
    err = ei.value
    assert (err.phase, err.tag, err.requested, err.free) == ("sync", "staging", 42, 30)
    assert "out of memory in phase sync: staging asks 42 B" in str(err)
    failed = next(e for e in trace.events if e["event"] == "phase.failed")
    assert failed["phase"] == "sync" and failed["oom_tag"] == "staging"
    assert max(e["mem"]["used"] for e in trace.events if "mem" in e) <= total


async def test_out_of_memory_on_wake_names_phase_and_tag_and_changes_nothing():
    # the KV pool grew while paused (a larger mem_fraction_static): it no longer fits
    s, _, engine, memory, trace = make(total=430)
    async with s:
        await s.run_phase(Phase.ROLLOUT)
        for p in PLANS["offload-first"][1:7]:
            await s.run_phase(p)
        memory.resize("engine.kv_cache", 340)
        with pytest.raises(OutOfMemory, match=r"out of memory in phase engine_wake_kv: engine.kv_cache asks"):
            await s.run_phase(Phase.ENGINE_WAKE_KV)
    assert not memory.is_resident("engine.kv_cache") and not memory.is_resident("engine.cuda_graph")
    assert ("resume", ("kv_cache", "cuda_graph")) not in engine.calls


class RemoteStyleTransport(FakeTransport):
    """A sender that, like a Ray actor, gets only the context's data (the staging
    limit, step, version) and hands its stage records back in its result."""

    async def sync(self, trainer, engine, ctx):
        from colo.core.interfaces import SyncContext
        from colo.core.memory import StagingBudget

        elsewhere = SyncContext(step=ctx.step, weight_version=ctx.weight_version, bucket_bytes=ctx.bucket_bytes,
                                source=ctx.source, staging=StagingBudget(ctx.staging.limit))
        return await super().sync(trainer, engine, elsewhere)


async def test_stage_records_that_come_back_as_data_are_written_like_live_ones(tmp_path):
    live, *_ , live_trace = make(path=tmp_path / "live.jsonl")
    remote, *_, remote_trace = make(path=tmp_path / "remote.jsonl", transport=RemoteStyleTransport())
    for s in (live, remote):
        async with s:
            await s.cycle()
    from colo.offline.replay import replay

    assert replay([tmp_path / "remote.jsonl"]).valid
    stages = [[(e["bucket"], e["stage"], e["mem"]["by_tag"]["staging"]) for e in t.events
               if e["event"] == "bucket.finished"] for t in (live_trace, remote_trace)]
    assert stages[0] == stages[1] and len(stages[1]) == 4 * 5
    # the staging peak the remote sender reported reached the ledger, as the live one did
    assert max(s for *_, s in stages[1]) > 0 and remote.memory.peak_bytes == live.memory.peak_bytes
    ts = [e["ts"] for e in remote_trace.events]
    assert ts == sorted(ts)


@pytest.mark.parametrize("trainers, engines", [(2, 1), (1, 2), (4, 2)])
def test_a_trainer_and_an_engine_of_different_tp_sizes_are_refused_naming_both(trainers, engines):
    """One engine rank per trainer rank, one of each per GPU: a TP=2 engine under a
    4-rank trainer would leave two GPUs' handles with nobody to load them."""
    with pytest.raises(ValueError) as e:
        Scheduler([FakeTrainer() for _ in range(trainers)], [FakeEngine() for _ in range(engines)],
                  [MemoryLedger(total_bytes=1 << 30) for _ in range(trainers)],
                  [FakeTransport() for _ in range(trainers)], plan="offload-first")
    assert f"the trainer has {trainers} ranks but the engine has {engines}" in str(e.value)


class EndFlushingTransport(FakeTransport):
    """A transport whose engine flushed its prefix cache as it ended the load (when asked)."""

    def __init__(self):
        super().__init__()
        self.asked = []

    async def sync(self, trainer, engine, ctx):
        self.asked.append(ctx.flush_cache)
        res = await super().sync(trainer, engine, ctx)
        if ctx.flush_cache:
            await engine.flush_cache()  # what an engine does at the end it was asked to flush with
            engine.calls.append(("flushed-with-end",))
        return dataclasses.replace(res, cache_flushed=ctx.flush_cache)


@pytest.mark.parametrize("transport", [FakeTransport, EndFlushingTransport])
async def test_the_prefix_cache_is_flushed_once_after_every_sync_by_the_engine_s_end_or_by_the_scheduler(
        transport):
    s, trainer, engine, *_ = make(transport=transport())
    async with s:
        for _ in range(2):
            await s.cycle()
    # the sync sits between the weights' wake and the KV cache's: exactly one flush there,
    # the engine's own with the end of the load where the transport says it flushed
    in_sync = ([("flush",), ("flushed-with-end",)] if transport is EndFlushingTransport else [("flush",)])
    cycle = [("generate", None), ("flush",), ("release", ("kv_cache", "cuda_graph", "weights")),
             ("resume", ("weights",)), *in_sync, ("resume", ("kv_cache", "cuda_graph"))]
    assert [(c[0], None) if c[0] == "generate" else c for c in engine.calls] == cycle * 2
    if transport is EndFlushingTransport:
        assert s.transport.asked == [True, True]  # the scheduler asked for it every sync


class CollectorWatchingTransport(FakeTransport):
    """Records whether the garbage collector could run while the sync moved its bytes."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.collector_on = []

    async def sync(self, trainer, engine, ctx):
        import gc

        self.collector_on.append(gc.isenabled())
        return await super().sync(trainer, engine, ctx)


async def test_the_garbage_collector_is_paused_for_the_transfer_and_back_on_after_it_even_after_a_failure():
    import gc

    assert gc.isenabled()
    s, *_ = make(transport=CollectorWatchingTransport())
    async with s:
        await s.cycle()
        assert s.transport.collector_on == [False] and gc.isenabled()
        s.transport.fail_at_bucket = 1
        with pytest.raises(RuntimeError, match="receiver failed in bucket 1"):
            await s.cycle()
    assert s.transport.collector_on == [False, False] and gc.isenabled()
    gc.disable()  # a caller that keeps it off finds it off afterwards
    try:
        s, *_ = make(transport=CollectorWatchingTransport())
        async with s:
            await s.cycle()
        assert not gc.isenabled()
    finally:
        gc.enable()


async def test_the_engine_declares_its_capabilities_and_the_trace_records_them():
    from colo.core.interfaces import EngineCapabilities

    s, _, engine, _, trace = make()
    engine.capabilities = EngineCapabilities(tags=("weights", "kv_cache"), frees_memory=False, probe="logprobs")
    async with s:
        pass
    started = trace.events[0]
    assert started["event"] == "trace.started"
    assert started["config"]["engine_capabilities"] == {"tags": ["weights", "kv_cache"], "frees_memory": False,
                                                        "probe": "logprobs"}
    with pytest.raises(ValueError, match="probe must be one of logits, logprobs"):
        EngineCapabilities(probe="vibes")


class SessionTransport(FakeTransport):
    """Opens and closes the engine's weight-update session around the buckets, as
    colo's SGLang sender does (its begin/end_weight_update), and says so in the trace."""

    async def sync(self, trainer, engine, ctx):
        ctx.mark("session.opened")
        result = await super().sync(trainer, engine, ctx)
        ctx.mark("session.closed")
        return result


def _session_run(plan, path):
    from colo.core.interfaces import EngineCapabilities

    s, _, engine, _, trace = make(plan, path=path, transport=SessionTransport())
    engine.capabilities = EngineCapabilities(tags=("weights", "kv_cache", "cuda_graph"), sessions=True,
                                             pauses_generation=True)
    return s, trace


@pytest.mark.parametrize("plan", sorted(PLANS))
async def test_an_engines_session_and_paused_generation_are_in_the_trace_and_replay_checks_them(plan, tmp_path):
    from colo.offline.replay import replay

    path = tmp_path / "t.jsonl"
    s, trace = _session_run(plan, path)
    async with s:
        for _ in range(2):
            await s.cycle()
    events = read_trace(path)
    where, phase = [], None
    for e in events:
        if e["event"] == "phase.entered":
            phase = e["to_phase"]
        if e["event"] in ("session.opened", "session.closed", "generation.paused", "generation.continued"):
            where.append((e["event"], phase))
    # a cycle starts with the rollout: the second one continues what the first paused
    assert where == [("generation.paused", "engine_release"), ("session.opened", "sync"),
                     ("session.closed", "sync"), ("generation.continued", "rollout"),
                     ("generation.paused", "engine_release"), ("session.opened", "sync"), ("session.closed", "sync")]
    # the pause comes before the engine's first memory.paused, the session closes before sync.finished
    names = [e["event"] for e in events]
    assert names.index("generation.paused") < min(i for i, e in enumerate(events)
                                                  if e["event"] == "memory.paused" and e["owner"] == "engine")
    assert names.index("session.closed") < names.index("sync.finished")
    assert replay([str(path)]).valid

    def tampered(drop, name):
        lines = path.read_text().splitlines()
        out = tmp_path / name
        out.write_text("\n".join(l for i, l in enumerate(lines) if i not in drop) + "\n")
        return replay([str(out)])

    # a load outside the session: the first session.opened taken out
    opened = names.index("session.opened")
    report = tampered({opened}, "no_open.jsonl")
    assert not report.valid
    first = report.findings[0]
    first_load = next(i for i, e in enumerate(events) if e["event"] == "bucket.finished" and e["stage"] == "load")
    assert first.line == first_load  # 1-based, one line above it taken out: the first load
    assert "bucket.finished load outside the engine's session (expected session.opened first" in first.message
    # a session still open at sync.finished
    report = tampered({names.index("session.closed")}, "no_close.jsonl")
    assert "sync.finished while the engine's session is open (expected session.closed first)" \
        in report.findings[0].message
    # the engine's memory released before its generation was paused
    report = tampered({names.index("generation.paused")}, "no_pause.jsonl")
    assert "memory.paused engine outside the engine's generation_paused (expected generation.paused first" \
        in report.findings[0].message
    # a rollout while its generation is still paused
    report = tampered({names.index("generation.continued")}, "no_continue.jsonl")
    assert "rollout.finished while the engine's generation_paused is open (expected generation.continued first)" \
        in report.findings[0].message


async def test_an_engine_without_sessions_is_never_held_to_them(tmp_path):
    from colo.offline.replay import replay

    path = tmp_path / "t.jsonl"
    s, *_ = make(path=path)
    async with s:
        await s.cycle()
    names = [e["event"] for e in read_trace(path)]
    assert not {"session.opened", "generation.paused"} & set(names)
    assert replay([str(path)]).valid


class StrictEngine(FakeEngine):
    """A fake engine rank that refuses to release what it gave back or resume what it holds
    (as colo's engine and vLLM do), and fails its next ``fail`` verb once."""

    def __init__(self):
        super().__init__()
        self.fail: str | None = None

    async def release(self, tags):
        if self.fail == "release":
            self.fail = None
            raise RuntimeError("this rank's release failed")
        if not set(tags) <= self.resident:
            raise RuntimeError(f"cannot release {tags}: already released")
        await super().release(tags)

    async def resume(self, tags):
        if self.fail == "resume":
            self.fail = None
            raise RuntimeError("this rank's resume failed")
        if set(tags) & self.resident:
            raise RuntimeError(f"cannot resume {tags}: already resident")
        await super().resume(tags)


@pytest.mark.parametrize("verb, phase", [("resume", "engine_wake_weights"), ("release", "engine_release")])
async def test_a_memory_verb_one_rank_failed_is_undone_on_the_ranks_that_did_it_and_the_recovery_runs(verb, phase):
    """Two ranks; rank 1's engine fails a release or a resume that rank 0's did: rank 0's is
    undone, so both ranks are what their ledgers say and the recovery (which releases and
    resumes again) meets no tag already released or already resident."""
    from colo.core.errors import RankFailed

    engines = [StrictEngine(), StrictEngine()]
    s = Scheduler([FakeTrainer(), FakeTrainer()], engines, [MemoryLedger(total_bytes=10_000) for _ in range(2)],
                  [FakeTransport(), FakeTransport()],
                  trace=[TraceWriter(None, keep_events=True, rank=r, world_size=2) for r in range(2)],
                  config=SchedulerConfig(plan="offload-first", bucket_bytes=50))
    async with s:
        await s.cycle()
        engines[1].fail = verb
        with pytest.raises(RankFailed, match="this rank's"):
            await s.cycle()
        assert s.phase is Phase.FAILED and s.last_error.rank == 1
        failed = [e for e in s.traces[1].events if e["event"] == "phase.failed"]
        assert [e["phase"] for e in failed] == [phase]
        undo = {"resume": "release", "release": "resume"}[verb]
        assert engines[0].calls[-1][0] == undo and engines[0].calls[-2][0] == verb  # done, then undone
        assert engines[0].resident == engines[1].resident
        await s.recover()
        await s.cycle()
        assert s.phase is not Phase.FAILED
        assert engines[0].resident == engines[1].resident == set(engines[0].sizes)


def test_the_engine_pauses_the_garbage_collector_for_each_request_and_restores_it_after_a_failure():
    """The engine's side of a sync (``EngineKit.transport_load``) keeps the collector out of
    each request's receive and load as the scheduler keeps it out of the sync, and leaves it
    as it found it: on after a load, also a refused one; off for a caller that had it off."""
    import contextlib
    import gc

    import torch

    from colo.engine.kit import EngineKit

    class Sink:
        device = torch.device("cpu")

        def __init__(self):
            self.collector_on, self.fail = [], False

        def begin_load(self):
            pass

        def load_weights(self, named):
            self.collector_on.append(gc.isenabled())
            if self.fail:
                raise RuntimeError("refused by the sink")
            return len(list(named))

    class Receiver:
        def __init__(self):
            self.collector_on = []

        @contextlib.contextmanager
        def receive(self, request):
            self.collector_on.append(gc.isenabled())
            yield [("w", torch.zeros(2))]

    sink, receiver = Sink(), Receiver()
    kit = EngineKit(sink)
    kit._receivers["watched"] = receiver
    assert gc.isenabled()
    assert kit.transport_load("watched", {})["tensors"] == 1
    assert sink.collector_on == receiver.collector_on == [False] and gc.isenabled()
    sink.fail = True
    with pytest.raises(RuntimeError, match="refused by the sink"):
        kit.transport_load("watched", {})
    assert sink.collector_on == [False, False] and gc.isenabled()
    gc.disable()
    try:
        sink.fail = False
        kit.transport_load("watched", {})
        assert not gc.isenabled()
    finally:
        gc.enable()
