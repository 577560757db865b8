"""Small staging kept from sync to sync (issue 18: a small model's sync in milliseconds).

The packed sender keeps its two buffers, and the engine keeps them mapped,
while both together take at most ``keep_staging_bytes`` (64 MiB on a GPU by
default; here on the CPU, where the default keeps none, it is asked for): the next sync
allocates, exports and opens nothing. Each sync still counts them in its own
staging budget while it runs and gives them back to the budget at its end; a
buffer is written again only after the last sync's every acknowledgement (the
weights prove it, sync after sync); a new bucket size or ``aclose`` frees them
after the engine let go. Real engine process, real /dev/shm segments.
"""

from __future__ import annotations

import pytest
import torch

from colo.core.interfaces import SyncContext
from colo.core.memory import StagingBudget
from colo.engine.reference.weights import expected_digest
from colo.testing.engines import RecordingEngine
from colo.testing.trainers import StateTrainer
from colo.trainers.models import build_trainer_model
from colo.transports import make_transport
from tests.leaks import new_segments

pytestmark = pytest.mark.usefixtures("no_leftover_segments")

BUCKET = 16 << 10
#: kept on the CPU only when asked (by default a /dev/shm buffer is not kept: it would
#: outlive a sender killed between syncs); the GPU keeps up to 64 MiB by default
KEEP = 64 << 20


def state_of(config, seed):
    return {n: p.detach().clone() for n, p in build_trainer_model(config, seed=seed).named_parameters()}


async def sync(transport, engine, state, version, bucket=BUCKET):
    budget = StagingBudget(None)
    ctx = SyncContext(step=version, weight_version=version, bucket_bytes=bucket, source="host", staging=budget)
    result = await transport.sync(StateTrainer(state), engine, ctx)
    return result, budget


async def test_small_staging_is_kept_mapped_and_reused_only_after_every_ack(small_engine):
    client, config = small_engine
    engine = RecordingEngine(client, only=("drop_handles",))
    transport = make_transport("packed", keep_staging_bytes=KEEP)
    try:
        first = None
        for version in (1, 2, 3):
            state = state_of(config, version)  # new weights every sync: a stale reuse would show
            result, budget = await sync(transport, engine, state, version)
            assert result.buckets > 2  # both buffers in use, each reused within the sync too
            assert await client.digest() == expected_digest(state, config, torch.float32), version
            # in each sync's budget while it ran (both buffers), out of it at its end,
            # still allocated and the same segments
            assert BUCKET < budget.peak_bytes <= 2 * BUCKET and budget.held_bytes == 0
            names = new_segments()
            assert len(names) == 2, names
            first = first or names
            assert names == first, "a kept buffer was reallocated"
        assert engine.calls == []  # the engine was never asked to let go of them
    finally:
        await transport.aclose()
    assert new_segments() == []
    assert engine.calls == ["drop_handles"]  # aclose: the engine let go first, then they were freed


@pytest.fixture
async def kept(small_engine):
    """(client, config, the client recording its drop_handles, a packed sender that keeps its staging)."""
    client, config = small_engine
    transport = make_transport("packed", keep_staging_bytes=KEEP)
    try:
        yield client, config, RecordingEngine(client, only=("drop_handles",)), transport
    finally:
        await transport.aclose()


async def test_a_new_bucket_size_frees_the_kept_buffers_after_the_engine_lets_go(kept):
    client, config, engine, transport = kept
    await sync(transport, engine, state_of(config, 1), 1)
    before = new_segments()
    state = state_of(config, 2)
    await sync(transport, engine, state, 2, bucket=2 * BUCKET)
    assert await client.digest() == expected_digest(state, config, torch.float32)
    after = new_segments()
    assert engine.calls == ["drop_handles"] and len(after) == 2 and not set(after) & set(before)


@pytest.mark.parametrize("keep", [2 * BUCKET - 1, None])
async def test_staging_above_the_limit_or_on_the_cpu_by_default_is_freed_after_every_sync(small_engine, keep):
    client, config = small_engine
    transport = make_transport("packed", keep_staging_bytes=keep)
    try:
        for version in (1, 2):
            state = state_of(config, version)
            await sync(transport, client, state, version)
            assert await client.digest() == expected_digest(state, config, torch.float32)
            assert new_segments() == []
    finally:
        await transport.aclose()


def test_keep_staging_bytes_is_checked():
    for bad in (-1, 1.5, True, "64"):
        with pytest.raises(ValueError, match="keep_staging_bytes must be a non-negative int or None"):
            make_transport("packed", keep_staging_bytes=bad)


def test_a_run_already_in_the_buffer_is_not_copied_again():
    """An extractor that wrote a bucket's tensors straight into the staging buffer (its
    typed views at the bucket's offsets) leaves pack nothing to copy; the bytes are
    the bucket's, and a source elsewhere is still copied beside them."""
    from colo.core.buckets import plan_buckets, spec
    from colo.transports.pack import pack_into

    specs = [spec("a", (3, 5), "float32"), spec("b", (7,), "float32"), spec("c", (2, 2), "float32")]
    (bucket,) = plan_buckets(specs, 1 << 20)
    flat = torch.zeros(bucket.nbytes, dtype=torch.uint8)
    views = {e.spec.name: flat[e.start:e.end].view(torch.float32).view(e.spec.shape) for e in bucket.entries}
    want = {s.name: torch.randn(s.shape) for s in specs}
    for n in ("a", "b"):
        views[n].copy_(want[n])  # written in place, as the extractor would
    before = flat.clone()
    pack_into(flat, bucket, [("a", views["a"]), ("b", views["b"]), ("c", want["c"])])
    for e in bucket.entries:
        assert torch.equal(flat[e.start:e.end].view(torch.float32).view(e.spec.shape), want[e.spec.name])
    c = next(e for e in bucket.entries if e.spec.name == "c")
    assert torch.equal(flat[:c.start], before[:c.start])  # the in-place run untouched


def test_the_engine_keeps_a_kept_buffers_views_until_it_lets_go_of_the_buffer():
    """A buffer its sender keeps is viewed once per layout on the engine: the same views
    sync after sync, reading each sync's bytes; a layout change makes new ones; an
    ordinary end of sync keeps the mapping, ``release(kept=True)`` drops it; a buffer
    not marked kept is viewed anew every time."""
    import json

    from colo.core.buckets import plan_buckets, spec
    from colo.proc.handles import ShmSegment
    from colo.transports.pack import pack_into
    from colo.transports.packed import PackedReceiver
    from colo.transports.wire import TensorMeta

    receiver = PackedReceiver()
    seg = ShmSegment.create(1024)
    try:
        def request(shape, value, *, keep=True):
            (bucket,) = plan_buckets([spec("x", shape, "float32")], 1024)
            pack_into(seg.tensor, bucket, [("x", value)])
            handle = {**seg.handle(), "keep": True} if keep else seg.handle()
            return json.loads(json.dumps({"handle": handle,
                                          "tensors": [m.to_json() for m in TensorMeta.of_bucket(bucket)]}))

        a = torch.arange(6, dtype=torch.float32).reshape(2, 3)
        with receiver.receive(request((2, 3), a)) as first:
            assert torch.equal(first[0][1], a)
        receiver.release()  # the end of a sync: a kept buffer stays mapped
        with receiver.receive(request((2, 3), a + 1)) as again:
            assert again is first and torch.equal(again[0][1], a + 1)  # the same views, the new bytes
        with receiver.receive(request((3, 2), a.reshape(3, 2))) as other:
            assert other is not first and tuple(other[0][1].shape) == (3, 2)
        receiver.release(kept=True)  # drop_handles: the engine lets go
        with receiver.receive(request((3, 2), a.reshape(3, 2))) as fresh:
            assert fresh is not other and torch.equal(fresh[0][1], a.reshape(3, 2))
        receiver.release(kept=True)
        with receiver.receive(request((3, 2), a.reshape(3, 2), keep=False)) as plain1:
            pass
        with receiver.receive(request((3, 2), a.reshape(3, 2), keep=False)) as plain2:
            assert plain2 is not plain1
    finally:
        receiver.close()
        seg.close()


async def test_kept_buffers_survive_a_refused_sync_and_abort_frees_them(kept):
    """A sync the engine refuses (a shape it cannot take) leaves the kept buffers kept and
    the next sync exact; the scheduler's abort after a failure frees them, the engine
    having let go first, and a later sync makes new ones."""
    client, config, engine, transport = kept
    await sync(transport, engine, state_of(config, 1), 1)
    held = new_segments()
    assert len(held) == 2
    grown = state_of(config, 2)
    grown["lm_head.weight"] = torch.zeros(config.vocab_size + 1, config.hidden_size)
    with pytest.raises(Exception, match="wrong shape"):
        await sync(transport, engine, grown, 2)
    assert new_segments() == held  # refused before a byte moved: the buffers stay
    state = state_of(config, 3)
    await sync(transport, engine, state, 3)
    assert await client.digest() == expected_digest(state, config, torch.float32)
    assert new_segments() == held and engine.calls == []
    await transport.abort()
    assert new_segments() == [] and engine.calls == ["drop_handles"]
    state = state_of(config, 4)
    await sync(transport, engine, state, 4)
    assert await client.digest() == expected_digest(state, config, torch.float32)
    assert len(new_segments()) == 2 and not set(new_segments()) & set(held)


async def test_a_new_engine_opens_the_kept_buffers_afresh(tmp_path):
    """The engine died between syncs (its mappings with it); a new engine process is sent
    the same kept buffers and loads them exactly."""
    from colo.engine.reference.client import EngineClient
    from colo.trainers.models import demo_config
    from tests.conftest import SMALL_CFG

    config = demo_config(**SMALL_CFG)
    build = {"config": config.to_dict(), "dtype": "float32", "device": "cpu", "total_bytes": 64 << 20,
             "mem_fraction_static": 0.5, "checkpoint": None, "log_path": str(tmp_path / "engine.log")}
    transport = make_transport("packed", keep_staging_bytes=KEEP)
    first = await EngineClient.spawn(build)
    second = None
    try:
        await sync(transport, first, state_of(config, 1), 1)
        kept = new_segments()
        first.kill()
        await first.aclose()
        second = await EngineClient.spawn(build)
        state = state_of(config, 2)
        await sync(transport, second, state, 2)
        assert await second.digest() == expected_digest(state, config, torch.float32)
        assert new_segments() == kept
    finally:
        await transport.aclose()
        for engine in (first, second):
            if engine is not None:
                await engine.aclose()


def test_convert_run_lays_results_out_as_the_planner_pads_them():
    """One buffer, each result at the next 16-byte boundary in order (so a pack moves the
    run in one copy), converted with the same rounding as a per-tensor ``to``; off the
    GPU a host tensor has no device view."""
    from colo.core.buckets import plan_buckets, spec
    from colo.device.zero_copy import convert_run, device_view

    src = [torch.randn(3), torch.randn(5, 7), torch.randn(1000)]
    out = convert_run(src, torch.bfloat16, torch.device("cpu"), 16)
    for got, want in zip(out, src):
        assert got.shape == want.shape and torch.equal(got, want.to(torch.bfloat16))
    (bucket,) = plan_buckets([spec(f"t{i}", t.shape, "bfloat16") for i, t in enumerate(src)], 1 << 20)
    base = out[0].data_ptr()
    assert [o.data_ptr() - base for o in out] == [e.start for e in bucket.entries]
    assert device_view(torch.randn(4), torch.device("cpu")) is None


def test_a_bucket_marked_in_place_is_not_walked_or_copied():
    """queue_pack(in_place=True): the caller vouches that every tensor is already the
    buffer's own view at its entry; nothing is copied (even a tensor that is not, here
    on purpose, so the test can see that no copy ran)."""
    from colo.core.buckets import plan_buckets, spec
    from colo.transports.pack import queue_pack

    specs = [spec("a", (4, 4), "float32"), spec("b", (9,), "float32")]
    (bucket,) = plan_buckets(specs, 1 << 20)
    flat = torch.zeros(bucket.nbytes, dtype=torch.uint8)
    elsewhere = [("a", torch.ones(4, 4)), ("b", torch.ones(9))]
    assert queue_pack(flat, bucket, elsewhere, None, in_place=True) is None
    assert int(flat.count_nonzero()) == 0
    queue_pack(flat, bucket, elsewhere, None)
    assert int(flat.count_nonzero()) > 0
