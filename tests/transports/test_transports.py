"""The four transports with real processes: same digests, pipelining, preflight, requests.

The demo runs (one per transport, two small steps each) are shared by the
tests of this module; every other test spawns its own small engine.
"""

from __future__ import annotations

import anyio
import pytest
import torch

from colo.core.buckets import plan_buckets
from colo.apps.demo import DemoConfig, run
from colo.engine.reference.client import EngineError
from colo.engine.reference.weights import expected_digest
from colo.extractors.plain import PlainExtractor
from colo.core.interfaces import SyncContext
from colo.core.invariants import InvariantChecker
from colo.core.memory import MemoryLedger, StagingBudget
from colo.trainers.models import build_trainer_model, demo_config
from colo.core.phases import Phase
from colo.scheduler import Scheduler
from colo.testing.engines import RecordingEngine
from colo.testing.trainers import StateTrainer
from colo.trace.writer import TraceWriter, read_trace
from colo.transports import ENGINE_OWN, REGISTRY, STRATEGIES, get_strategy, make_transport
from tests.leaks import new_segments

TRANSPORTS = ("ipc", "packed", "broadcast", "disk")
#: transports that run only between a rank's two Ray actors (tests/ranks/test_ray_rdt.py)
RAY_ONLY = ("rdt",)
# a bfloat16 engine beside the fp32 trainer, so every transport converts through staging buckets
# (with the engine in the trainer's dtype, the CPU default, packed sends the trainer's own buffer)
DEMO = dict(steps=2, batch=8, new_tokens=8, bucket_mib=0.5, engine_dtype="bfloat16")
#: what the scheduler books for a trainer that only syncs
TAG_BYTES = {"weights": 1 << 20, "optimizer": 2 << 20}

pytestmark = pytest.mark.usefixtures("no_leftover_segments")


def test_every_transport_is_registered_with_a_strategy():
    # and the senders whose receiver is an engine's own (SGLang's) beside them, without one
    assert sorted(STRATEGIES) == sorted(TRANSPORTS + RAY_ONLY)
    assert sorted(REGISTRY) == sorted([*TRANSPORTS, *RAY_ONLY, *ENGINE_OWN])
    for name in TRANSPORTS + RAY_ONLY:
        s = get_strategy(name)
        assert s.name == name == make_transport(name).name
        assert all(hasattr(s, a) for a in ("create_init_info", "create_sender", "create_receiver",
                                           "request_type", "init_info_type"))
    with pytest.raises(ValueError, match="unknown transport 'pickle'; expected one of packed, ipc"):
        make_transport("pickle")


# -- the demo under each transport ------------------------------------------------

@pytest.fixture(scope="module")
def demo_traces(tmp_path_factory):
    out = {}
    for name in TRANSPORTS:
        path = tmp_path_factory.mktemp(name) / "t.jsonl"
        res = anyio.run(lambda: run(DemoConfig(transport=name, trace=str(path), **DEMO), progress=False))
        assert res.error is None, f"{name}: {res.error}"
        assert new_segments() == []
        out[name] = read_trace(path)
    return out


def syncs(events):
    """Per sync: the bucket.finished events in trace order, and the sync.finished event."""
    out, current = [], None
    for e in events:
        if e["event"] == "phase.entered" and e["to_phase"] == "sync":
            current = []
        elif e["event"] == "bucket.finished":
            current.append(e)
        elif e["event"] == "sync.finished":
            out.append((current, e))
    return out


def test_all_four_transports_yield_the_same_digests_and_valid_traces(demo_traces):
    digests = {}
    for name, events in demo_traces.items():
        checker = InvariantChecker()
        assert [str(v) for i, e in enumerate(events, 1) for v in checker.feed(e, i)] == []
        assert events[0]["config"]["transport"] == name
        finished = [s for _, s in syncs(events)]
        assert [s["weight_version"] for s in finished] == [1, 2]
        assert all(s["tensors"] == s["params"] and s["buckets"] > 1 for s in finished)
        digests[name] = [s["digest"] for s in finished]
    # the same seed, the same weights after every sync, whatever carried them
    assert digests["ipc"] == digests["packed"] == digests["broadcast"] == digests["disk"]
    assert len(set(digests["packed"])) == 2


def _planned():
    specs = PlainExtractor(build_trainer_model(demo_config(), 0), dtype=torch.bfloat16).specs()
    return plan_buckets(specs, int(DEMO["bucket_mib"] * (1 << 20)))


@pytest.mark.parametrize("name", TRANSPORTS)
def test_pipelining_overlaps_buckets_and_reuses_a_buffer_only_after_its_ack(demo_traces, name):
    buckets = _planned()
    for stages, done in syncs(demo_traces[name]):
        assert done["buckets"] == len(buckets) >= 3
        at = {(e["bucket"], e["stage"]): k for k, e in enumerate(stages)}
        assert sorted(at) == sorted((b.index, s) for b in buckets for s in ("gather", "pack", "handoff", "load"))
        # that bucket i+1 is gathered and packed while bucket i is handed off and loaded is
        # pipeline()'s own order (tests/transports/test_pipeline_order.py): the spans here are
        # measured, and on a busy machine a 6 ms handoff can end before the next gather starts
        for i in range(len(buckets) - 1):
            assert at[i, "pack"] < at[i + 1, "gather"]
            # bucket i+1 goes out only after bucket i was acknowledged
            assert at[i, "load"] < at[i + 1, "handoff"]
        for i in range(len(buckets) - 2):
            # bucket i+2 reuses bucket i's buffer: only after bucket i's ack
            assert at[i, "load"] < at[i + 2, "pack"]


def test_packed_holds_exactly_two_staging_buffers(demo_traces):
    cap = max(b.nbytes for b in _planned())
    events = demo_traces["packed"]
    staging = [e["mem"]["by_tag"]["staging"] for e in events if "mem" in e]
    assert max(staging) == 2 * cap
    # at every bucket event 0, 1 or 2 whole buffers are live, never more
    in_sync = [e["mem"]["by_tag"]["staging"] for stages, _ in syncs(events) for e in stages]
    assert set(in_sync) == {0, cap, 2 * cap}
    # freed by the end of each sync
    assert all(s["mem"]["by_tag"]["staging"] == 0 for _, s in syncs(events))


def test_other_transports_stage_at_most_two_buckets_on_the_trainer_side(demo_traces):
    buckets = _planned()
    cap = max(b.nbytes for b in buckets)
    pairs = max(a.payload_bytes + b.payload_bytes for a, b in zip(buckets, buckets[1:]))
    peak = {n: max(e["mem"]["by_tag"]["staging"] for e in demo_traces[n] if "mem" in e) for n in TRANSPORTS}
    # ipc: one segment per tensor, two buckets' worth at most
    assert 0 < peak["ipc"] <= pairs + sum(len(b.entries) for b in buckets)
    # broadcast: two trainer buffers plus the engine's receive buffer
    assert 2 * cap < peak["broadcast"] <= 3 * cap
    # disk: the shard being written and the one being read back
    assert 0 < peak["disk"] <= pairs


# -- direct syncs through a small engine ------------------------------------------

async def test_each_transport_loads_the_trainers_weights_with_its_own_request_count(small_engine, tmp_path):
    client, config = small_engine
    for seed, name in enumerate(TRANSPORTS):
        state = {n: p.detach() for n, p in build_trainer_model(config, seed=seed).named_parameters()}
        options = {"root": str(tmp_path / "ckpt")} if name == "disk" else {}
        transport = make_transport(name, **options)
        engine = RecordingEngine(client)
        pool = StagingBudget(None)
        ctx = SyncContext(step=0, weight_version=seed, bucket_bytes=64 << 10, source="host", staging=pool)
        try:
            result = await transport.sync(StateTrainer(state), engine, ctx)
            again = await transport.sync(StateTrainer(state), engine, ctx) if name == "broadcast" else None
            group = transport._group.info.group_name if name == "broadcast" else None
        finally:
            await transport.aclose()
        buckets = plan_buckets(PlainExtractor(state, dtype=torch.float32).specs(), 64 << 10)
        assert (result.buckets, result.tensors) == (len(buckets), len(state)) and result.bytes == sum(
            t.numel() * 4 for t in state.values())
        # verl's baseline: one request per tensor; the others: one per bucket
        per_sync = len(state) if name == "ipc" else len(buckets)
        assert engine.loads == per_sync * (2 if again else 1), name
        assert await client.digest() == expected_digest(state, config, torch.float32), name
        assert pool.held_bytes == 0 and pool.peak_bytes > 0 and new_segments() == []
        stages = {(r.bucket, r.stage) for r in ctx.stages}
        assert stages == {(b.index, s) for b in buckets for s in ("gather", "pack", "handoff", "load")}
        if name == "broadcast":
            assert group is not None and again is not None  # the second sync reused the group
            with pytest.raises(EngineError, match="'broadcast' is not initialised on the engine"):
                await client.transport_load("broadcast", {"nbytes": 8, "tensors": []})
    # the engine builds receivers only for registered transports
    with pytest.raises(EngineError, match="unknown transport 'os:system'; expected one of packed, ipc"):
        await client.transport_load("os:system", {})
    assert new_segments() == []


# -- preflight through a real sync ------------------------------------------------

def mismatched_trainer(config):
    """A trainer whose tensors disagree with the engine in four ways."""
    state = {n: p.detach().clone() for n, p in build_trainer_model(config, seed=1).named_parameters()}
    del state["model.norm.weight"]                                            # missing
    state["model.layers.9.mlp.up_proj.weight"] = torch.zeros(4, 4)            # unexpected
    state["lm_head.weight"] = torch.zeros(config.vocab_size, config.hidden_size + 1)  # wrong shape
    state["model.layers.0.input_layernorm.weight"] = torch.ones(config.hidden_size, dtype=torch.int32)  # dtype
    return StateTrainer(state, tag_bytes=TAG_BYTES)


MISMATCHES = ("missing (1): model.norm.weight", "unexpected (1): model.layers.9.mlp.up_proj.weight",
              "lm_head.weight (128, 65) (expected (128, 64))",
              "model.layers.0.input_layernorm.weight int32 (expected float32)")


async def test_a_mismatched_trainer_fails_the_sync_phase_before_any_byte_for_every_transport(small_engine, tmp_path):
    client, config = small_engine
    trainer = mismatched_trainer(config)
    memory = MemoryLedger(total_bytes=256 << 20, reserved_bytes=0)
    trace = TraceWriter(tmp_path / "t.jsonl")
    root = tmp_path / "ckpt"
    root.mkdir()
    sched = Scheduler(trainer, client, memory, make_transport("ipc"), trace=trace, engine_synced=False)
    async with sched:
        for name in TRANSPORTS:
            sched.transports[0] = make_transport(name, **({"root": str(root)} if name == "disk" else {}))
            for phase in (Phase.ENGINE_RELEASE, Phase.TRAINER_OFFLOAD, Phase.ENGINE_WAKE_WEIGHTS):
                await sched.run_phase(phase)
            before = await client.digest()
            with pytest.raises(EngineError) as ei:
                await sched.run_phase(Phase.SYNC)
            msg = str(ei.value)
            assert "engine preflight failed: WeightMismatch" in msg
            assert all(m in msg for m in MISMATCHES), (name, msg)
            # the engine's weights are untouched, nothing was staged or written
            assert await client.digest() == before, name
            assert memory.staging_bytes == 0 and list(root.iterdir()) == [] and new_segments() == []
    events = read_trace(tmp_path / "t.jsonl")
    failed = [e for e in events if e["event"] == "phase.failed"]
    assert [(e["phase"], e["error_type"]) for e in failed] == [("sync", "EngineError")] * 4
    assert all(all(m in e["error"] for m in MISMATCHES) for e in failed)
    assert [e for e in events if e["event"] == "bucket.finished"] == []
    assert max(e["mem"]["by_tag"]["staging"] for e in events if "mem" in e) == 0


# -- requests are plain JSON, checked field by field ------------------------------

def test_requests_round_trip_as_json_and_bad_ones_name_the_field():
    import json

    from colo.transports.base import RequestError, TensorMeta
    from colo.transports.broadcast import BroadcastRequest, BroadcastTransport, DistributedInitInfo
    from colo.transports.ipc import IpcRequest
    from colo.transports.packed import PackedRequest

    m = TensorMeta("w", (2, 3), "bfloat16", 16, 28)
    for req in (PackedRequest({"kind": "shm", "name": "x", "nbytes": 32}, (m,)),
                IpcRequest({"kind": "shm", "name": "x", "nbytes": 12}, TensorMeta("w", (2, 3), "bfloat16", 0, 12)),
                BroadcastRequest(32, (m,))):
        assert type(req).from_json(json.loads(json.dumps(req.to_json()))) == req
    info = get_strategy("broadcast").create_init_info(master_port=29500)
    assert DistributedInitInfo.from_json(json.loads(json.dumps(info.to_json()))) == info
    with pytest.raises(RequestError, match=r"bucket entry 'w': bytes \[16, 28\) do not fit shape \(2, 3\) "
                                           r"bfloat16 in a 20 B buffer"):
        PackedRequest.from_json({"handle": {"kind": "shm", "nbytes": 20}, "tensors": [m.to_json()]})
    with pytest.raises(RequestError, match="dtype 'object' is not allowed"):
        BroadcastRequest.from_json({"nbytes": 32, "tensors": [{**m.to_json(), "dtype": "object"}]})
    with pytest.raises(RequestError, match="broadcast request field 'nbytes' must be int, got str"):
        BroadcastRequest.from_json({"nbytes": "32", "tensors": []})
    with pytest.raises(RequestError, match="ipc request must be a JSON object with a 'handle' object"):
        IpcRequest.from_json({"tensor": m.to_json()})
    with pytest.raises(RequestError, match="backend must be one of gloo, nccl, got 'mpi'"):
        DistributedInitInfo.from_json({**info.to_json(), "backend": "mpi"})
    with pytest.raises(ValueError, match="master_addr must be a loopback address, got '0.0.0.0'"):
        BroadcastTransport(master_addr="0.0.0.0")


# -- a failure mid-sync, then recovery --------------------------------------------

async def test_a_failure_mid_sync_is_cleaned_up_and_the_recovery_sync_loads_the_weights(small_engine, tmp_path):
    from colo.core.config import SchedulerConfig

    client, config = small_engine
    root = tmp_path / "ckpt"
    for seed, name in enumerate(TRANSPORTS):
        state = {n: p.detach() for n, p in build_trainer_model(config, seed=10 + seed).named_parameters()}
        trainer = StateTrainer(state, tag_bytes=TAG_BYTES, fail_at=2)
        transport = make_transport(name, **({"root": str(root)} if name == "disk" else {}))
        memory = MemoryLedger(total_bytes=256 << 20)
        trace = tmp_path / f"{name}.jsonl"
        # after the previous recovery every engine tag is resident again, as a fresh scheduler assumes
        sched = Scheduler(trainer, client, memory, transport, trace=TraceWriter(trace), engine_synced=False,
                          config=SchedulerConfig(plan="offload-first", bucket_bytes=16 << 10))
        try:
            async with sched:
                for phase in (Phase.ENGINE_RELEASE, Phase.TRAINER_OFFLOAD, Phase.ENGINE_WAKE_WEIGHTS):
                    await sched.run_phase(phase)
                with pytest.raises(RuntimeError, match="simulated trainer crash while gathering bucket 2"):
                    await sched.run_phase(Phase.SYNC)
                assert memory.staging_bytes == 0 and new_segments() == []
                if name == "broadcast":
                    assert transport._group is None  # the group a failure may have broken is gone
                trainer.fail_at = None
                await sched.recover()
                assert sched.engine_version == 0 and not sched.stale
        finally:
            await transport.aclose()
        assert await client.digest() == expected_digest(state, config, torch.float32), name
        events = read_trace(trace)
        checker = InvariantChecker()
        assert [str(v) for i, e in enumerate(events, 1) for v in checker.feed(e, i)] == []
        assert [e["phase"] for e in events if e["event"] == "phase.failed"] == ["sync"]
        assert new_segments() == []
    # disk: only the recovery's checkpoint exists
    assert sorted(p.name for p in root.iterdir()) == ["step-0"]


def test_packed_receiver_keeps_two_buffers_of_one_segment_apart():
    # A CUDA IPC handle names the allocator's segment; two staging buffers cut
    # from one segment differ only by offset. The receiver's cache must not
    # hand bucket i+1 the attachment of bucket i (found on an H100, sync-first).
    from colo.proc.handles import REBUILDERS, register_rebuilder
    from colo.transports.packed import PackedReceiver

    opened = []

    class Seg:
        def __init__(self, handle):
            self.nbytes, self.offset = handle["nbytes"], handle["storage_offset"]
            opened.append(self)

        def close(self):
            pass

    register_rebuilder("test_segment", Seg)
    try:
        rx = PackedReceiver()
        one = {"kind": "test_segment", "handle": "SEG", "storage_offset": 0, "tensor_offset": 0, "nbytes": 64}
        two = {**one, "storage_offset": 1 << 20}
        a, b, a_again = rx._attach(one), rx._attach(two), rx._attach(dict(one))
        assert (a.offset, b.offset) == (0, 1 << 20) and a_again is a and len(opened) == 2
    finally:
        REBUILDERS.pop("test_segment")
