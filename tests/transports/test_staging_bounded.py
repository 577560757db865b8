"""Bounded staging and buffer lifetimes (issue 18).

A tensor larger than the bucket is cut into pieces that fill consecutive
buckets and are written back in place by the engine; every transport carries
them bit-exact, and the sender's own staging ledger (a real ``StagingBudget``
whose limit is the bound) never holds more than two buckets. A staging buffer
is packed again only after the engine acknowledged the load that read it: an
engine that copies late still gets exact weights, and a sender that reuses its
buffer early is caught by the same check.
"""

from __future__ import annotations


import anyio
import pytest

import torch

from colo.core.buckets import plan_buckets, spec
from colo.core.interfaces import SyncContext
from colo.core.memory import StagingBudget
from colo.engine.reference.core import EngineCore
from colo.engine.reference.weights import expected_digest
from colo.engine.reference.tp import ShardPlan, TPLayout, write_slice, shard_state_from_hf
from colo.core.errors import OutOfMemory
from colo.extractors.plain import PlainExtractor
from colo.testing.engines import ReceiverOnCore
from colo.testing.trainers import StateTrainer
from colo.testing.transports import OneBufferPacked
from colo.trainers.models import build_trainer_model, demo_config
from colo.transports import make_transport
from colo.transports.disk import load_checkpoint
from colo.transports.ipc import IpcReceiver, IpcTransport
from colo.transports.pack import pack_into
from colo.transports.packed import PackedReceiver, PackedTransport
from colo.transports.wire import TensorMeta, views
from tests.conftest import SMALL_CFG
from tests.waits import CEILING_S
from tests.leaks import new_segments

pytestmark = pytest.mark.usefixtures("no_leftover_segments")

#: 8 KiB: SMALL_CFG's float32 embedding, lm_head and MLP weights (32 KiB each) and its
#: q_proj (16 KiB) are larger, so every sync below cuts tensors into pieces
BUCKET = 8 << 10
#: broadcast also counts the engine's receive buffer, which is on the same device when colocated
LIMIT = {"packed": 2 * BUCKET, "ipc": 2 * BUCKET, "disk": 2 * BUCKET, "broadcast": 3 * BUCKET}


def trainer_state(config, seed: int) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in build_trainer_model(config, seed=seed).named_parameters()}


async def test_every_transport_carries_tensors_larger_than_the_bucket_bit_exact(small_engine, tmp_path):
    client, config = small_engine
    for seed, name in enumerate(("packed", "ipc", "broadcast", "disk"), start=1):
        state = trainer_state(config, seed)
        buckets = plan_buckets(PlainExtractor(state, dtype=torch.float32).specs(), BUCKET)
        cut = {e.spec.name for b in buckets for e in b.entries if not e.whole}
        assert {"model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.up_proj.weight"} <= cut
        assert max(b.nbytes for b in buckets) <= BUCKET < max(t.numel() * 4 for t in state.values())
        # the sender's own ledger, limited to the bound: one byte more and it raises OutOfMemory
        budget = StagingBudget(LIMIT[name])
        ctx = SyncContext(step=0, weight_version=seed, bucket_bytes=BUCKET, source="host", staging=budget)
        transport = make_transport(name, **({"root": str(tmp_path / "ckpt")} if name == "disk" else {}))
        try:
            result = await transport.sync(StateTrainer(state), client, ctx)
        finally:
            await transport.aclose() if name != "disk" else None
        assert await client.digest() == expected_digest(state, config, torch.float32), name
        assert (result.buckets, result.tensors, result.bytes) == (
            len(buckets), len(state), sum(t.numel() * 4 for t in state.values()))
        # the engine counts a tensor once, at its last piece: the loads add up to the model
        loads = [r for r in ctx.stages if r.stage == "load"]
        assert [r.bucket for r in loads] == list(range(len(buckets)))
        assert sum(r.tensors for r in loads) == len(state) and any(r.tensors == 0 for r in loads)
        assert BUCKET < result.staging_peak <= LIMIT[name] and budget.held_bytes == 0, name
        if name == "disk":
            # the committed checkpoint reassembles the pieces into the trainer's tensors
            got = load_checkpoint(transport.last_checkpoint)
            assert sorted(got) == sorted(state)
            assert all(torch.equal(got[n], state[n]) for n in state)
            await transport.aclose()
    # the bound is real: the ledger that admitted 2 x bucket refuses one byte less, before allocating
    budget = StagingBudget(2 * BUCKET - 1)
    ctx = SyncContext(step=0, weight_version=9, bucket_bytes=BUCKET, source="host", staging=budget)
    transport = PackedTransport()
    with pytest.raises(OutOfMemory):
        await transport.sync(StateTrainer(trainer_state(config, 9)), client, ctx)
    await transport.abort()
    await transport.aclose()
    assert budget.held_bytes == 0 and budget.peak_bytes <= BUCKET
    assert new_segments() == []


@pytest.mark.parametrize("tp_size", [2, 4])
def test_engine_tp_ranks_load_pieces_in_place_as_they_load_whole_tensors(tp_size):
    """Every rank writes its slice of each piece (cut anywhere in a row, across the
    columns a row-parallel weight is split on) and ends with exactly the shard a whole
    load gives it; the vocabulary padding rows are zeroed as a whole load zeroes them."""
    config = demo_config(**{**SMALL_CFG, "vocab_size": 126, "num_key_value_heads": 2})
    state = trainer_state(config, 3)
    # 1000 bytes: pieces of 992 bytes, not a multiple of any row (64 or 128 floats)
    buckets = plan_buckets(PlainExtractor(state, dtype=torch.float32).specs(), 1000)
    for rank in range(tp_size):
        plan = ShardPlan.build(TPLayout.from_config(config, tp_rank=rank, tp_size=tp_size))
        params = {n: torch.full(s, float("nan")) for n, s in plan.local_map.params.items()}
        for b in buckets:
            flat = torch.zeros(b.nbytes, dtype=torch.uint8)
            pack_into(flat, b, [(e.spec.name, state[e.spec.name]) for e in b.entries])
            for name, t in views(flat, TensorMeta.of_bucket(b)):
                write_slice(params, plan.slices[name], t)
        want = shard_state_from_hf(state, config, torch.float32, rank, tp_size)
        assert list(params) == list(want)
        for n in want:
            assert torch.equal(params[n], want[n]), (rank, n)


# -- a buffer is reused only after the engine's acknowledgement --------------------------

def _late_sync(config, state, transport, receiver):
    """``state`` synced into the engine's side of a packed or ipc sync, in this process
    (the real receiver and EngineCore), which copies bucket i only after the sender
    recorded packing bucket i+1; the EngineCore it ends with.

    A pipelined sender packs bucket i+1 while bucket i is in flight; if it packed into
    the buffer bucket i is still being read from, this engine would copy bucket i+1's
    bytes under bucket i's names, and the digest would say so."""
    core = EngineCore(config, dtype=torch.float32, device="cpu", total_bytes=16 << 20, mem_fraction_static=0.5)
    ctx = SyncContext(step=0, weight_version=1, bucket_bytes=BUCKET, source="host",
                      staging=StagingBudget(None))
    buckets = plan_buckets(PlainExtractor(state, dtype=torch.float32).specs(), BUCKET)
    # the bucket index of each request, in order
    per_request = [b.index for b in buckets for _ in (b.entries if isinstance(transport, IpcTransport) else [0])]
    last = max(per_request)
    waited = []

    async def after_the_next_pack(i):
        bucket = per_request[i]
        with anyio.fail_after(CEILING_S):
            while bucket < last and not any(r.stage == "pack" and r.bucket == bucket + 1 for r in ctx.stages):
                await anyio.sleep(0.002)
        waited.append(bucket < last)

    engine = ReceiverOnCore(core, receiver, transport.name, before_copy=after_the_next_pack)

    async def go():
        try:
            await transport.sync(StateTrainer(state), engine, ctx)
        finally:
            receiver.close()
            await transport.aclose()

    anyio.run(go)
    assert len(engine.requests) == len(per_request) and sum(waited) > 0
    return core


@pytest.mark.parametrize("name", ["packed", "ipc"])
def test_an_engine_that_copies_late_still_gets_exact_weights(name):
    config = demo_config(**SMALL_CFG)
    state = trainer_state(config, 5)
    transport, receiver = (PackedTransport(), PackedReceiver()) if name == "packed" else (IpcTransport(),
                                                                                           IpcReceiver())
    core = _late_sync(config, state, transport, receiver)
    assert core.digest() == expected_digest(state, config, torch.float32)
    assert new_segments() == []


def test_a_sender_that_reuses_its_buffer_before_the_ack_is_caught():
    """The check above has teeth: the same late engine, with a sender that packs bucket
    i+1 into the buffer bucket i is read from, ends with weights that are not the trainer's."""
    config = demo_config(**SMALL_CFG)
    state = trainer_state(config, 5)
    core = _late_sync(config, state, OneBufferPacked(), PackedReceiver())
    assert core.digest() != expected_digest(state, config, torch.float32)
    assert new_segments() == []


# -- one copy per run of back-to-back sources -------------------------------------------------

def _reference_pack(bucket, tensors):
    """The bucket as a per-tensor pack writes it (padding left zero)."""
    from colo.transports.pack import entry_bytes

    out = torch.zeros(bucket.nbytes, dtype=torch.uint8)
    for (_, t), e in zip(tensors, bucket.entries):
        out[e.start:e.end] = entry_bytes(t, e)
    return out


def _entry_bytes_equal(flat, ref, bucket):
    return all(torch.equal(flat[e.start:e.end], ref[e.start:e.end]) for e in bucket.entries)


def test_sources_in_one_flat_buffer_go_as_one_copy_per_bucket_and_land_exactly():
    """A trainer whose weights are views of one buffer laid out like the bucket (colo's
    flat weights, Megatron's DDP buffer) is packed with one copy per bucket, pieces of a
    tensor larger than the bucket included; every entry's bytes are the tensor's."""
    from colo.device.flat_weights import FlatWeights
    from colo.transports.pack import pack_into, source_runs

    config = demo_config(num_hidden_layers=2)
    model = build_trainer_model(config, seed=5)
    state = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
    flat = FlatWeights.from_tensors(state, device="cpu")
    try:
        specs = PlainExtractor(flat.tensors).specs()
        embed = max(s.nbytes for s in specs)
        buckets = plan_buckets(list(specs), embed // 3)  # the embedding travels in pieces
        assert any(not e.whole for b in buckets for e in b.entries)
        for b in buckets:
            tensors = [(e.spec.name, flat.tensors[e.spec.name]) for e in b.entries]
            runs = source_runs(b, tensors)
            assert len(runs) == 1 and runs[0][:2] == (b.entries[0].start, b.entries[-1].end), b.index
            out = torch.full((b.nbytes,), 7, dtype=torch.uint8)
            assert pack_into(out, b, tensors) == b.payload_bytes
            assert _entry_bytes_equal(out, _reference_pack(b, tensors), b), b.index
    finally:
        flat.close()


def test_sources_apart_or_out_of_order_are_copied_one_by_one():
    """Separately allocated tensors, and views of one buffer whose distances differ from
    the bucket's (here: reversed), are never merged: each entry is its own copy, and the
    bucket holds each tensor's bytes, not its neighbour's."""
    from colo.transports.pack import pack_into, source_runs

    g = torch.Generator().manual_seed(2)
    specs = [spec(f"w{i}", (5, 8), "float32") for i in range(4)]
    bucket = plan_buckets(specs, 1 << 20)[0]
    apart = [(s.name, torch.randn(s.shape, generator=g)) for s in specs]
    backing = torch.randn(4 * 48, generator=g)  # 48 floats apart: the bucket has them 40 + 0 pad apart
    reversed_views = [(s.name, backing[(3 - i) * 48:(3 - i) * 48 + 40].view(5, 8)) for i, s in enumerate(specs)]
    for tensors in (apart, reversed_views):
        assert [r[:2] for r in source_runs(bucket, tensors)] == [(e.start, e.end) for e in bucket.entries]
        out = torch.zeros(bucket.nbytes, dtype=torch.uint8)
        pack_into(out, bucket, tensors)
        assert _entry_bytes_equal(out, _reference_pack(bucket, tensors), bucket)
