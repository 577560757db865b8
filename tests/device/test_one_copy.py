"""One copy in sync-first (issue 18, item 2): the engine loads straight out of the
trainer's flat weight buffer, in one request, with nothing staged.

Real parts: a real model whose parameters were moved into a
:class:`colo.device.flat_weights.FlatWeights` buffer (a ``/dev/shm`` segment on the
CPU, one plain CUDA allocation on a GPU), a real AdamW stepping them in place,
a real engine process reading the buffer through its handle. The weights are
checked against the engine's digest of what it loaded, bit for bit.
"""

from __future__ import annotations

import os
import pytest
import pytest_asyncio
import torch

from colo.core.interfaces import SyncContext
from colo.core.memory import StagingBudget
from colo.engine.reference.weights import expected_digest
from colo.extractors.plain import PlainExtractor
from colo.device.flat_weights import FlatWeights
from colo.testing.engines import RecordingEngine
from colo.testing.trainers import CountingExtractor, FlatTrainer
from colo.trainers.models import build_trainer_model, demo_config
from colo.transports.packed import PackedTransport
from tests.conftest import SMALL_CFG, small_engine_build
from tests.leaks import new_segments

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

#: small enough that the packed path needs several buckets for SMALL_CFG's weights
BUCKET = 64 << 10


def context(step: int) -> tuple[SyncContext, StagingBudget]:
    budget = StagingBudget(None)
    return SyncContext(step=step, weight_version=step, bucket_bytes=BUCKET, source="device",
                       staging=budget), budget


# -- the buffer itself ----------------------------------------------------------------

def test_flat_weights_hold_the_parameters_as_aligned_views_that_an_optimizer_updates_in_place():
    config = demo_config(**SMALL_CFG)
    before = {n: p.detach().clone() for n, p in build_trainer_model(config, seed=3).named_parameters()}
    trainer = FlatTrainer(config, 3)
    flat = trainer.flat_weights
    try:
        assert set(flat.slots) == set(before)
        for n, p in trainer.model.named_parameters():
            a, b = flat.slots[n]
            assert torch.equal(p.detach(), before[n]) and a % 16 == 0
            assert flat.locate(p.detach()) == (a, b) and p.data_ptr() == flat._flat.data_ptr() + a
        # the slots do not overlap and fit the buffer
        ranges = sorted(flat.slots.values())
        assert all(x[1] <= y[0] for x, y in zip(ranges, ranges[1:])) and ranges[-1][1] <= flat.nbytes
        trainer.step()
        for n, p in trainer.model.named_parameters():
            a, b = flat.slots[n]
            assert not torch.equal(p.detach(), before[n])
            assert torch.equal(flat._flat[a:b].view(p.dtype).view(p.shape), p.detach())  # written in place
        # a converted copy or another tensor is not in the buffer
        w = trainer.model.lm_head.weight.detach()
        assert flat.locate(w.to(torch.bfloat16)) is None and flat.locate(w.clone()) is None
        # on the CPU pause and resume keep the bytes where they are
        want = trainer.state()
        flat.pause()
        with pytest.raises(RuntimeError, match="already paused"):
            flat.pause()
        # paused on the CPU the buffer is its own host copy: still what the engine reads
        assert flat.readable() is flat._flat and flat.locate(w) == flat.slots["lm_head.weight"]
        assert flat.export() == flat._seg.handle()
        assert all(torch.equal(flat.host_tensors()[n], t) for n, t in want.items())
        flat.resume()
        assert all(torch.equal(p.detach(), want[n]) for n, p in trainer.model.named_parameters())
    finally:
        flat.close()
    assert new_segments() == []


# -- syncs through a real engine process ------------------------------------------------

#: one engine process for the CPU tests below (spawning one costs seconds on the CI machine);
#: each test checks the digest of its own sync, whatever an earlier test loaded
on_cpu_engine = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cpu_engine(tmp_path_factory):
    from colo.engine.reference.client import EngineClient

    config = demo_config(**SMALL_CFG)
    client = await EngineClient.spawn(small_engine_build(tmp_path_factory.mktemp("one-copy") / "engine.log"))
    try:
        yield client, config
    finally:
        await client.aclose()


@on_cpu_engine
async def test_sync_first_from_flat_weights_is_one_request_with_nothing_staged(cpu_engine):
    client, config = cpu_engine
    trainer = FlatTrainer(config, 1)
    engine = RecordingEngine(client)
    transport = PackedTransport()
    try:
        for step in (1, 2):
            if step == 2:
                trainer.step()  # the weights change in place; the next sync must carry the new ones
            ctx, budget = context(step)
            result = await transport.sync(trainer, engine, ctx)
            assert await client.digest() == expected_digest(trainer.state(), config, torch.float32), step
            assert len(engine.requests) == step  # one request per sync
            assert (result.buckets, result.tensors, result.staging_peak) == (1, len(trainer.state()), 0)
            assert budget.peak_bytes == 0 and budget.held_bytes == 0
            assert result.bytes == sum(t.numel() * 4 for t in trainer.state().values())
            # the trace of a one-copy sync: bucket 0 gathered (views), handed off, loaded; never packed
            assert [(r.bucket, r.stage) for r in ctx.stages] == [(0, "gather"), (0, "handoff"), (0, "load")]
            assert [r.tensors for r in ctx.stages if r.stage == "load"] == [len(trainer.state())]
        first, second = engine.requests
        # the handle is the flat buffer's segment, whole; the ranges are the parameters' slots
        assert first["handle"] == trainer.flat_weights.export()
        assert {m["name"]: (m["start_idx"], m["end_idx"]) for m in first["tensors"]} == trainer.flat_weights.slots
        assert "tensors" not in second and second["layout"] == first["layout"]  # the layout went once
    finally:
        await transport.aclose()
        trainer.flat_weights.close()
    assert new_segments() == []


@on_cpu_engine
async def test_a_conversion_falls_back_to_packing_and_a_paused_buffer_is_still_read_in_place(cpu_engine):
    client, config = cpu_engine
    # bf16 trainer, float32 engine: every tensor is converted, so none lies in the buffer
    trainer = FlatTrainer(config, 2, dtype=torch.bfloat16, engine_dtype=torch.float32)
    engine = RecordingEngine(client)
    transport = PackedTransport()
    try:
        ctx, budget = context(1)
        result = await transport.sync(trainer, engine, ctx)
        assert await client.digest() == expected_digest(trainer.state(), config, torch.float32)
        assert result.buckets > 2 and len(engine.requests) == result.buckets
        assert budget.peak_bytes > 0 and budget.held_bytes == 0
        assert {r.stage for r in ctx.stages} == {"gather", "pack", "handoff", "load"}
        # a same-dtype trainer whose buffer is paused (the offload-first source): on the CPU
        # the buffer is its own host copy, so the engine still reads it in one request
        same = FlatTrainer(config, 4)
        same.flat_weights.pause()
        engine.requests.clear()
        ctx, budget = context(2)
        result = await transport.sync(same, engine, ctx)
        assert await client.digest() == expected_digest(same.state(), config, torch.float32)
        assert result.buckets == 1 == len(engine.requests) and budget.peak_bytes == 0
        assert engine.requests[0]["handle"] == same.flat_weights.export()
        # and a transport told not to load from the buffer packs a resident one
        same.flat_weights.resume()
        packing = PackedTransport(one_copy=False)
        engine.requests.clear()
        result = await packing.sync(same, engine, context(3)[0])
        await packing.aclose()
        assert len(engine.requests) == result.buckets > 2
        same.flat_weights.close()
    finally:
        await transport.aclose()
        trainer.flat_weights.close()
    assert new_segments() == []


@on_cpu_engine
@pytest.mark.parametrize("change", ["replaced", "resized"])
async def test_a_parameter_that_left_the_buffer_is_refused_by_name(cpu_engine, change):
    client, config = cpu_engine
    trainer = FlatTrainer(config, 5)
    engine = RecordingEngine(client)
    transport = PackedTransport()
    p = trainer.model.model.norm.weight
    p.data = p.detach().clone() if change == "replaced" else torch.ones(p.numel() + 1)
    try:
        with pytest.raises(ValueError, match=r"flat weights: 'model\.norm\.weight' is no longer its view of the "
                                             r"flat buffer .*replaced or resized"):
            await transport.sync(trainer, engine, context(1)[0])
        assert engine.requests == []  # refused before anything was sent
        with pytest.raises(ValueError, match=r"'model\.norm\.weight' is no longer its view"):
            trainer.flat_weights.pause()  # pausing the buffer would not move it
    finally:
        await transport.aclose()
        trainer.flat_weights.close()


@on_cpu_engine
async def test_a_kept_extractor_is_walked_once_and_a_parameter_that_left_later_is_still_refused(cpu_engine):
    """The one-copy layout is found once per (flat weights, extractor): later syncs of new
    weights reuse it and still arrive bit-exact; a parameter replaced after that is
    refused by name before anything is sent, not loaded from its stale slot."""
    client, config = cpu_engine
    trainer = FlatTrainer(config, 7, extractor="kept")
    engine = RecordingEngine(client)
    transport = PackedTransport()
    n = len(trainer.flat_weights.slots)
    try:
        for step in (1, 2, 3):
            if step > 1:
                trainer.step()
            await transport.sync(trainer, engine, context(step)[0])
            assert await client.digest() == expected_digest(trainer.state(), config, torch.float32), step
            assert trainer.kept.produced == n  # walked by the first sync only
        assert len(engine.requests) == 3
        p = trainer.model.model.norm.weight
        p.data = p.detach().clone()
        with pytest.raises(ValueError, match=r"'model\.norm\.weight' is no longer its view of the flat buffer"):
            await transport.sync(trainer, engine, context(4)[0])
        assert len(engine.requests) == 3
    finally:
        await transport.aclose()
        trainer.flat_weights.close()


def test_flat_weights_check_their_own_views_dict():
    """A trainer that uses the buffer's ``tensors`` dict as its parameters (the benchmark's
    trainer) is checked on that dict: an entry replaced, added or removed is refused."""
    flat = FlatWeights({"a": ((4,), torch.float32), "b": ((2, 3), torch.bfloat16)}, device="cpu")
    try:
        flat.check()
        flat.tensors["b"] = torch.zeros(2, 3, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match=r"'b' is no longer its view of the flat buffer \(now \(2, 3\) "
                                             r"bfloat16, built as \(2, 3\) bfloat16"):
            flat.check()
        del flat.tensors["b"]
        flat.tensors["c"] = torch.zeros(1)
        with pytest.raises(ValueError, match=r"added \['c'\], removed \['b'\]"):
            flat.check()
    finally:
        flat.close()


def test_a_fallback_is_decided_at_the_first_tensor_outside_the_buffer():
    from colo.transports.packed import one_copy_bucket

    config = demo_config(**SMALL_CFG)
    trainer = FlatTrainer(config, 6, dtype=torch.bfloat16, engine_dtype=torch.float32)
    try:
        counting = CountingExtractor(trainer.extractor())
        assert one_copy_bucket(trainer.flat_weights, counting) is None
        assert counting.produced == 1  # one tensor converted, not the whole model
        same = CountingExtractor(PlainExtractor(trainer.model, dtype=torch.bfloat16))
        bucket = one_copy_bucket(trainer.flat_weights, same)
        assert same.produced == len(bucket.entries) == len(trainer.flat_weights.slots)
        assert {e.spec.name: (e.start, e.end) for e in bucket.entries} == trainer.flat_weights.slots
    finally:
        trainer.flat_weights.close()


async def test_the_trainer_memory_backend_pauses_the_weights_tag_through_the_flat_weights():
    from colo.device.cuda_memory import TrainerMemory

    class NoSaver:  # the optimizer tag is not asked for here; the weights must not reach a saver
        paused: set = set()

        def pause(self, key):
            raise AssertionError(f"{key} went to the saver")

        resume = pause

    trainer = FlatTrainer(demo_config(**SMALL_CFG), 7)
    memory = TrainerMemory(NoSaver(), flats={"weights": trainer.flat_weights})
    try:
        assert memory.resident("weights")
        await memory.pause("trainer", ["weights"])
        assert not memory.resident("weights") and trainer.flat_weights.paused
        await memory.resume("trainer", ["weights"])
        assert memory.resident("weights") and not trainer.flat_weights.paused
    finally:
        trainer.flat_weights.close()


async def test_the_trainer_memory_backend_returns_the_allocator_cache_before_its_pauses(monkeypatch):
    """The allocator's cache (activations, gradients) goes back to the driver before the tags
    are paused: the driver's clearing of it then runs beside their device->host copies, not
    beside the offload-first sync that follows (cuda_memory.TrainerMemory.pause)."""
    from colo.device.cuda_memory import TrainerMemory

    calls = []

    class Saver:
        paused: set = set()

        def pause(self, key):
            calls.append(("pause", key))

        resume = pause

    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(("empty_cache",)))
    memory = TrainerMemory(Saver())
    await memory.pause("trainer", ["optimizer", "weights"])
    assert calls == [("empty_cache",), ("pause", "trainer.optimizer"), ("pause", "trainer.weights"),
                     ("empty_cache",)]
    # where the pause went: the cache, each tag whole (a pauser that reports no parts has none)
    assert sorted(memory.last_pause_s) == ["empty_cache", "optimizer", "weights"]
    assert all(v >= 0 for v in memory.last_pause_s.values())


async def test_the_trainer_memory_backend_reports_each_tags_pause_and_its_parts(monkeypatch):
    """``TrainerMemory.last_pause_s``: each tag's whole pause, and the parts its pauser timed under
    ``tag.part`` (the benchmark's rate of each tag's copy alone, issue 44), the last pause's only."""
    import time as _time

    from colo.device.cuda_memory import TrainerMemory

    class Saver:
        paused: set = set()

        def pause(self, key):
            _time.sleep(0.02)
            self.last_pause_s = {"wait": 0.001, "copy": 0.015 if key.endswith("optimizer") else 0.005}

        def resume(self, key):
            _time.sleep(0.01)

    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    memory = TrainerMemory(Saver())
    await memory.pause("trainer", ["optimizer", "weights"])
    got = memory.last_pause_s
    assert sorted(got) == ["empty_cache", "optimizer", "optimizer.copy", "optimizer.wait", "weights",
                           "weights.copy", "weights.wait"]
    assert (got["optimizer.copy"], got["weights.copy"], got["weights.wait"]) == (0.015, 0.005, 0.001)
    # a tag's whole pause holds the pauser's own time (it slept 20 ms), parts and all
    assert got["optimizer"] >= 0.02 and got["weights"] >= 0.02
    await memory.pause("trainer", ["weights"])
    assert sorted(memory.last_pause_s) == ["empty_cache", "weights", "weights.copy", "weights.wait"]
    await memory.resume("trainer", ["optimizer", "weights"])
    assert sorted(memory.last_resume_s) == ["optimizer", "weights"]
    assert min(memory.last_resume_s.values()) >= 0.01


def test_flat_weights_refuse_bad_input():
    with pytest.raises(ValueError, match="no tensors to lay out"):
        FlatWeights({}, device="cpu")
    with pytest.raises(ValueError, match="align must be a power of two of at least 16"):
        FlatWeights({"w": ((2,), torch.float32)}, device="cpu", align=24)
    with pytest.raises(TypeError, match="'w' has dtype 'float32'; expected a torch.dtype"):
        FlatWeights({"w": ((2,), "float32")}, device="cpu")
    with pytest.raises(ValueError, match="one_copy must be a bool"):
        PackedTransport(one_copy="yes")
    with pytest.raises(ValueError, match="share_host must be a bool, got 'yes'"):
        FlatWeights({"w": ((2,), torch.float32)}, device="cpu", share_host="yes")
    assert new_segments() == []


def test_a_pinned_shared_segment_opens_by_its_handle_and_refuses_what_dev_shm_cannot_hold(monkeypatch):
    """The engine side of the shared pinned backup, on the CPU (no registration here: a
    process without a CUDA context maps the segment as it is)."""
    import colo.device.cuda_ipc
    from colo.device.cuda_ipc import PinnedShm
    from colo.proc.handles import HandleError, ShmSegment, open_handle

    seg = ShmSegment.create(4096)
    mine = PinnedShm(seg, register=False)
    try:
        mine.tensor.copy_(torch.arange(4096, dtype=torch.int64).to(torch.uint8))
        handle = mine.handle()
        assert handle == {"kind": "pinned_shm", "name": seg.name, "nbytes": 4096, "keep": True}
        theirs = open_handle(handle)
        assert isinstance(theirs, PinnedShm) and not theirs.registered and not theirs.seg.owner
        assert torch.equal(theirs.tensor, mine.tensor)
        # issue 32, item 10: the reader's mapping is read-only; the writer's is not
        assert not theirs.seg.writable and mine.seg.writable
        assert sorted(map_perms(os.getpid(), seg.name)) == ["r--s", "rw-s"]
        theirs.close()
        with pytest.raises(HandleError, match="not a colo segment name"):
            open_handle({**handle, "name": "../etc/passwd"})
    finally:
        mine.close()
    assert new_segments() == []
    # one let go of without close() takes its file with it (its pages would stay in RAM)
    dropped = PinnedShm(ShmSegment.create(4096), register=False)
    assert len(new_segments()) == 1
    del dropped
    assert new_segments() == []
    # a /dev/shm too small for the backup is said before a page is touched (a SIGBUS otherwise)
    monkeypatch.setattr(colo.device.cuda_ipc, "shm_room", lambda: 1 << 20)
    with pytest.raises(HandleError, match=r"/dev/shm has 1048576 B free, 2097152 B needed"):
        PinnedShm.create(2 << 20)
    assert new_segments() == []


# -- on a GPU -----------------------------------------------------------------------------

#: large enough (about 150 MiB of float32 weights) that a pause returning the buffer is
#: plainly visible in the device's free memory, far above allocator rounding
GPU_CFG = dict(vocab_size=16384, hidden_size=1024, num_hidden_layers=2, num_attention_heads=8,
               num_key_value_heads=4, intermediate_size=2048, max_position_embeddings=64)


@pytest.mark.gpu
@gpu
async def test_one_copy_on_cuda_is_exact_and_a_pause_returns_the_buffer_once_the_engine_let_go():
    from colo.engine.reference.client import EngineClient

    MiB = 1 << 20
    config = demo_config(**GPU_CFG)
    torch.cuda.empty_cache()  # the buffer gets a segment of its own, which empty_cache can return
    trainer = FlatTrainer(config, 1, device="cuda")
    flat = trainer.flat_weights
    assert flat.nbytes > 100 * MiB
    client = await EngineClient.spawn({"config": config.to_dict(), "dtype": "float32", "device": "cuda",
                                       "total_bytes": 2 << 30, "mem_fraction_static": 0.5, "checkpoint": None})
    transport = PackedTransport()
    try:
        # 1. a sync out of the buffer right after an optimizer step that is still queued on the
        #    device (behind ~0.1 s of spinning): the engine must read the step's result
        for step in (1, 2):
            trainer.step(behind_cycles=200_000_000)
            ctx, budget = context(step)
            engine = RecordingEngine(client)
            result = await transport.sync(trainer, engine, ctx)
            assert await client.digest() == expected_digest(trainer.state(), config, torch.float32), step
            assert len(engine.requests) == 1 and engine.requests[0]["handle"]["kind"] == "cuda_ipc"
            assert (result.buckets, result.staging_peak, budget.peak_bytes) == (1, 0, 0)
        # 2. the engine closed its mapping at end_load: pausing returns the buffer to the device
        want = trainer.state()
        torch.cuda.synchronize()
        # what the step's gradients left in the allocator's cache goes back now, so that the
        # free memory below moves by the buffer alone
        torch.cuda.empty_cache()
        free0 = torch.cuda.mem_get_info()[0]
        flat.pause()
        free1 = torch.cuda.mem_get_info()[0]
        assert free1 - free0 >= flat.nbytes - 2 * MiB, (free0, free1, flat.nbytes)
        assert all(torch.equal(flat.host_tensors()[n], t) for n, t in want.items())
        flat.resume()
        torch.cuda.synchronize()
        assert torch.cuda.mem_get_info()[0] <= free1 - flat.nbytes + 2 * MiB
        assert all(torch.equal(p.detach().cpu(), want[n]) for n, p in trainer.model.named_parameters())
        # 3. an engine that still maps the buffer keeps it allocated: the pause says so
        held = RecordingEngine(client, hold_end=True)
        trainer.step()
        await transport.sync(trainer, held, context(3)[0])
        want = trainer.state()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        free0 = torch.cuda.mem_get_info()[0]
        with pytest.raises(RuntimeError, match="stay allocated: another process .* still maps it"):
            flat.pause()
        assert torch.cuda.mem_get_info()[0] - free0 < flat.nbytes - 2 * MiB
        await client.end_load()  # the engine lets go; the next collect frees the block
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()
        assert torch.cuda.mem_get_info()[0] - free0 >= flat.nbytes - 2 * MiB
        # 4. resumed, the weights are exact and the next sync is one request again
        flat.resume()
        assert all(torch.equal(p.detach().cpu(), want[n]) for n, p in trainer.model.named_parameters())
        engine = RecordingEngine(client)
        await transport.sync(trainer, engine, context(4)[0])
        assert len(engine.requests) == 1
        assert await client.digest() == expected_digest(want, config, torch.float32)
    finally:
        await transport.aclose()
        await client.aclose()
        flat.close()


def map_perms(pid: int, segment: str) -> list[str]:
    """The permissions of process ``pid``'s mappings of ``segment``, in address order."""
    with open(f"/proc/{pid}/maps", encoding="utf-8") as fh:
        return [line.split()[1] for line in fh if line.rstrip().endswith("/" + segment)]


def mapped_by(pid: int, segment: str) -> bool:
    """Whether process ``pid`` maps shared-memory segment ``segment`` now (its /proc maps)."""
    with open(f"/proc/{pid}/maps", encoding="utf-8") as fh:
        return any(segment in line for line in fh)


@pytest.mark.gpu
@gpu
async def test_offload_first_reads_the_shared_pinned_backup_in_one_request_with_nothing_staged():
    from colo.engine.reference.client import EngineClient

    config = demo_config(**GPU_CFG)
    trainer = FlatTrainer(config, 5, device="cuda", extractor="host-when-paused")
    flat = trainer.flat_weights
    client = await EngineClient.spawn({"config": config.to_dict(), "dtype": "float32", "device": "cuda",
                                       "total_bytes": 2 << 30, "mem_fraction_static": 0.5, "checkpoint": None})
    transport = PackedTransport()
    try:
        for step in (1, 2):
            trainer.step()  # new weights each time: the second sync must carry them, not the first's
            want = trainer.state()
            flat.pause()
            assert flat.host_shared and flat.host_unshared is None
            seg = flat.export()
            assert seg["kind"] == "pinned_shm" and seg["keep"] is True and seg["nbytes"] == flat.nbytes
            # registered: page-locked, so the engine's copies out of it run at the pinned rate
            assert all(t.is_pinned() for t in flat.host_tensors().values())
            ctx, budget = context(step)
            engine = RecordingEngine(client)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            result = await transport.sync(trainer, engine, ctx)
            assert torch.cuda.max_memory_allocated() == before  # not a byte of device staging
            assert await client.digest() == expected_digest(want, config, torch.float32), step
            assert len(engine.requests) == 1 and engine.requests[0]["handle"] == seg
            assert (result.buckets, result.staging_peak, budget.peak_bytes) == (1, 0, 0)
            assert result.bytes == sum(t.numel() * 4 for t in want.values())
            assert [(r.bucket, r.stage) for r in ctx.stages] == [(0, "gather"), (0, "handoff"), (0, "load")]
            # the engine keeps the backup mapped from sync to sync (registering it is the slow part),
            # read-only where the GPU pins read-only memory (issue 32, item 10)
            assert mapped_by(client.process.pid, seg["name"])
            from colo.device.cuda_ipc import read_only_pinning

            expect = "r--s" if read_only_pinning() else "rw-s"
            assert map_perms(client.process.pid, seg["name"]) == [expect]
            flat.resume()
            assert all(torch.equal(p.detach().cpu(), want[n]) for n, p in trainer.model.named_parameters())
        # the transport's close lets the engine go of it; the trainer's close removes it
        await transport.aclose()
        assert not mapped_by(client.process.pid, seg["name"])
        flat.close()
        assert new_segments() == []
    finally:
        await transport.aclose()
        await client.aclose()
        flat.close()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("why", ["asked", "no room"])
async def test_a_private_pinned_backup_is_packed_through_device_staging_and_arrives_exact(why, monkeypatch):
    import colo.device.cuda_ipc
    from colo.engine.reference.client import EngineClient

    config = demo_config(**GPU_CFG)
    if why == "no room":  # a container's small /dev/shm: the backup is private pinned memory, and says so
        monkeypatch.setattr(colo.device.cuda_ipc, "shm_room", lambda: 64 << 20)
    trainer = FlatTrainer(config, 6, device="cuda", share_host=why != "asked", extractor="host-when-paused")
    flat = trainer.flat_weights
    client = await EngineClient.spawn({"config": config.to_dict(), "dtype": "float32", "device": "cuda",
                                       "total_bytes": 2 << 30, "mem_fraction_static": 0.5, "checkpoint": None})
    transport = PackedTransport()
    try:
        trainer.step()
        want = trainer.state()
        flat.pause()
        assert not flat.host_shared and flat.readable() is None
        assert flat.host_unshared == ("share_host=False" if why == "asked" else
                                      f"HandleError: pinned shared host memory: /dev/shm has {64 << 20} B free, "
                                      f"{flat.nbytes} B needed")
        with pytest.raises(RuntimeError, match="private host backup"):
            flat.export()
        ctx, budget = context(1)
        engine = RecordingEngine(client)
        result = await transport.sync(trainer, engine, ctx)
        assert await client.digest() == expected_digest(want, config, torch.float32)
        assert result.buckets == len(engine.requests) > 2 and budget.peak_bytes > 0
        assert {r["handle"]["kind"] for r in engine.requests} == {"cuda_ipc"}
    finally:
        await transport.aclose()
        await client.aclose()
        flat.close()
    assert new_segments() == []
