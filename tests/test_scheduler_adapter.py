"""A sync that moves a LoRA adapter (``SchedulerConfig(sync_target="adapter")``): the phase
table's adapter effects keep the engine's base weights resident through the cycle, the sync's
loads sit inside the engine's adapter stage (``adapter.staging`` .. ``adapter.activated``), and
replay refuses a trace that loads outside one. :class:`colo.engine.adapters.AdapterEngine`'s
stage bookkeeping against a scripted engine (the real one: tests/vllm/test_lora_demo.py)."""

from __future__ import annotations

import dataclasses

import anyio
import pytest

from colo.core.config import SchedulerConfig
from colo.core.errors import EngineStateError, VerificationError
from colo.core.invariants import InvariantChecker
from colo.core.memory import MemoryLedger
from colo.core.phases import EFFECTS, PLANS, Phase, effects_for
from colo.engine.adapters import AdapterEngine
from colo.scheduler import Scheduler
from colo.testing.fakes import FakeEngine, FakeTrainer, FakeTransport
from colo.trace.writer import TraceWriter


class StagingFake(FakeEngine):
    """The scheduler's view of an engine that stages adapters: its capabilities say so."""

    capabilities = dataclasses.replace(FakeEngine.capabilities, adapters=True)


def run(plan: str, cycles: int = 2, **kw):
    engine = StagingFake()
    trace = TraceWriter(None, keep_events=True)
    sched = Scheduler(FakeTrainer(), engine, MemoryLedger(total_bytes=10_000), FakeTransport(), trace=trace,
                      config=SchedulerConfig(plan=plan, bucket_bytes=50, sync_target="adapter"), **kw)

    async def go():
        async with sched:
            for _ in range(cycles):
                await sched.cycle()

    anyio.run(go)
    return sched, engine, trace.events


def test_the_adapter_effects_release_only_the_kv_cache_and_leave_the_rest_of_the_table():
    adapter = effects_for("adapter")
    assert adapter[Phase.ENGINE_RELEASE].pause == ("kv_cache", "cuda_graph")
    assert adapter[Phase.ENGINE_RELEASE].flush_first
    assert {p: e for p, e in adapter.items() if p is not Phase.ENGINE_RELEASE} == \
        {p: e for p, e in EFFECTS.items() if p is not Phase.ENGINE_RELEASE}
    assert effects_for("weights") == EFFECTS
    with pytest.raises(ValueError, match="unknown sync target 'lora'; expected one of weights, adapter"):
        effects_for("lora")
    with pytest.raises(ValueError, match="sync_target must be one of weights, adapter"):
        SchedulerConfig(sync_target="adapters")


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_an_adapter_run_never_releases_the_engines_weights_and_stages_every_load(plan):
    sched, engine, events = run(plan)
    assert ("release", ("weights",)) not in engine.calls
    assert all(c[0] != "release" or "weights" not in c[1] for c in engine.calls)
    paused = {(e["owner"], e["tag"]) for e in events if e["event"] == "memory.paused"}
    assert ("engine", "weights") not in paused and ("engine", "kv_cache") in paused
    names = [e["event"] for e in events]
    assert names.count("adapter.staging") == names.count("adapter.activated") == names.count("sync.finished") == 2
    for step in (0, 1):  # every load of a sync inside its stage; the stage closed before sync.finished
        mine = [e for e in events if e.get("step") == step]
        order = [e["event"] for e in mine]
        loads = [i for i, e in enumerate(mine) if e["event"] == "bucket.finished" and e["stage"] == "load"]
        assert loads and order.index("adapter.staging") < loads[0]
        assert loads[-1] < order.index("adapter.activated") < order.index("sync.finished")
    syncs = [e for e in events if e["event"] == "sync.finished"]
    assert [s["target"] for s in syncs] == ["adapter", "adapter"]
    assert events[0]["config"]["sync_target"] == "adapter" and events[0]["config"]["engine_capabilities"]["adapters"]
    checker = InvariantChecker()
    assert [v for ev in events for v in checker.feed(ev)] == []
    assert engine.version == sched.trainer_version == 2


def test_replay_refuses_a_load_outside_the_stage_and_a_sync_that_ends_with_it_open():
    _, _, events = run("offload-first", cycles=1)
    at = next(i for i, e in enumerate(events) if e["event"] == "adapter.staging")
    without_open = events[:at] + events[at + 1:]
    checker = InvariantChecker()
    found = [v.message for ev in without_open for v in checker.feed(ev)]
    assert any("bucket.finished load outside the engine's adapter_stage" in m for m in found), found
    at = next(i for i, e in enumerate(events) if e["event"] == "adapter.activated")
    without_close = events[:at] + events[at + 1:]
    checker = InvariantChecker()
    found = [v.message for ev in without_close for v in checker.feed(ev)]
    assert any("sync.finished while the engine's adapter_stage is open" in m for m in found), found


def test_an_engine_that_stages_no_adapters_is_refused_for_an_adapter_sync_and_the_other_way():
    with pytest.raises(ValueError, match="sync_target 'adapter' needs an engine that stages adapters"):
        Scheduler(FakeTrainer(), FakeEngine(), MemoryLedger(total_bytes=10_000), FakeTransport(),
                  config=SchedulerConfig(sync_target="adapter"))
    with pytest.raises(ValueError, match="sync_target 'weights' needs an engine that loads weights"):
        Scheduler(FakeTrainer(), StagingFake(), MemoryLedger(total_bytes=10_000), FakeTransport())


# -- AdapterEngine's stages, against a scripted engine -----------------------------------------------

class Stage:
    def __init__(self, engine, version):
        self.engine, self.version, self.digest = engine, version, None
        self.aborted = False

    async def preflight(self, specs):
        self.engine.log.append(("preflight", self.version))

    async def begin_load(self):
        pass

    async def end_load(self, flush_cache=False):
        self.digest = f"d{self.version}"
        self.engine.loaded[self.version] = self.digest

    async def drop_handles(self):
        self.aborted = True
        self.engine.log.append(("abort", self.version))


class Scripted:
    """An engine that stages adapters as vLLM's adapter verbs do (registered at the stage's end)."""

    def __init__(self, digest_live=False, base="base"):
        self.capabilities = dataclasses.replace(FakeEngine.capabilities, digest_live=digest_live)
        self.loaded: dict[int, str] = {}
        self.active_adapter = None
        self.version = 0
        self.log: list = []
        self.base = base

    def adapter_target(self, version, config):
        return Stage(self, version)

    async def activate_adapter(self, version, digest=None):
        self.active_adapter = version
        self.log.append(("activate", version))

    async def drop_adapter(self, version):
        del self.loaded[version]
        self.log.append(("drop", version))

    async def set_weight_version(self, version):
        self.version = version

    async def digest(self):
        return self.base

    async def logprobs(self, tokens, adapter=None):
        return adapter


async def a_sync(engine, version):
    await engine.set_weight_version(None)
    await engine.preflight([])
    await engine.begin_load()
    await engine.end_load()
    digest = await engine.digest()
    return digest


async def test_each_stage_is_a_new_version_activated_only_by_set_weight_version_and_a_failed_one_is_dropped():
    inner = Scripted()
    engine = AdapterEngine(inner, config=None)
    assert engine.capabilities.adapters and not engine.capabilities.digest_live
    assert await a_sync(engine, 1) == "d1"
    assert inner.active_adapter is None and await engine.logprobs([[1]]) == 1  # the probe asks the staged version
    await engine.set_weight_version(1)
    assert inner.active_adapter == 1 and inner.version == 1 and await engine.logprobs([[1]]) == 1  # then the active
    # a sync that failed after its stage ended (a digest mismatch, say): dropped, v1 serves on
    assert await a_sync(engine, 2) == "d2"
    await engine.set_weight_version(None)
    assert inner.active_adapter == 1 and 2 not in inner.loaded and ("drop", 2) in inner.log
    # the re-sync is a new version, never the failed one's
    assert await a_sync(engine, 2) == "d3"
    await engine.set_weight_version(2)
    assert inner.active_adapter == 3
    # a stage abandoned mid-transfer: its handles go, nothing registered
    await engine.set_weight_version(None)
    await engine.preflight([])
    await engine.set_weight_version(None)
    assert inner.log[-1] == ("abort", 4) and 4 not in inner.loaded and inner.active_adapter == 3
    with pytest.raises(EngineStateError, match="no adapter was staged"):
        await engine.digest()


async def test_the_base_weights_are_checked_once_where_the_engines_digest_reads_its_live_weights():
    good = AdapterEngine(Scripted(digest_live=True, base="B"), config=None, base_digest="B")
    assert await a_sync(good, 1) == "d1"
    good.inner.base = "changed"  # checked once per engine: not read again
    await good.set_weight_version(1)
    assert await a_sync(good, 2) == "d2"
    bad = AdapterEngine(Scripted(digest_live=True, base="other"), config=None, base_digest="B")
    with pytest.raises(VerificationError, match="base weights digest other != the trainer's base B"):
        await a_sync(bad, 1)
    # where the digest is of what arrived (vLLM), the probe answers for the base: no base check
    unread = AdapterEngine(Scripted(digest_live=False, base="other"), config=None, base_digest="B")
    assert await a_sync(unread, 1) == "d1"
    with pytest.raises(TypeError, match="stages no LoRA adapters"):
        AdapterEngine(FakeEngine(), config=None)


def test_perfetto_shows_each_adapter_stage_as_a_slice_around_its_loads_and_a_failed_one_ends_at_the_failure():
    from colo.offline.export import SUBSTATE_TID, chrome_events
    from colo.offline.replay import LoadedTrace

    _, _, events = run("offload-first", cycles=2)
    out = chrome_events(LoadedTrace("t.jsonl", events, list(range(1, len(events) + 1))))
    stages = [e for e in out if e.get("tid") == SUBSTATE_TID and e["ph"] == "X"]
    assert [(s["name"], s["args"]["weight_version"], s["args"]["ended_by"]) for s in stages] == \
        [("adapter_stage", 1, "adapter.activated"), ("adapter_stage", 2, "adapter.activated")]
    loads = [e for e in out if e.get("cat") == "stage" and e["name"] == "load"]
    assert len(loads) >= 2
    for load in loads:  # every load slice lies inside a stage slice
        assert any(s["ts"] <= load["ts"] and load["ts"] + load["dur"] <= s["ts"] + s["dur"] + 1 for s in stages)
    # a sync that failed mid-stage: its slice ends with the failure
    engine = StagingFake()
    trace = TraceWriter(None, keep_events=True)
    sched = Scheduler(FakeTrainer(), engine, MemoryLedger(total_bytes=10_000), FakeTransport(fail_at_bucket=1),
                      trace=trace, config=SchedulerConfig(bucket_bytes=50, sync_target="adapter"))

    async def go():
        async with sched:
            with pytest.raises(RuntimeError, match="receiver failed in bucket 1"):
                await sched.cycle()

    anyio.run(go)
    out = chrome_events(LoadedTrace("f.jsonl", trace.events, list(range(1, len(trace.events) + 1))))
    [stage] = [e for e in out if e.get("tid") == SUBSTATE_TID and e["ph"] == "X"]
    assert stage["args"]["ended_by"] == "phase.failed"
    checker = InvariantChecker()
    assert [v for ev in trace.events for v in checker.feed(ev)] == []
