"""The packed upload pipeline on a GPU (issue 18, item 1).

The sender queues a bucket's copies on its upload stream and returns; the
handoff waits for that bucket's event before the handle goes out, and bucket
i+2 is queued into bucket i's buffer right after bucket i's acknowledgement,
while bucket i+1 may still be uploading. A real engine process over CUDA IPC,
whose every load is held back: the upload stream runs ahead into the other
buffer meanwhile, and the weights must still be exact, sync after sync, from
pinned host memory (offload-first) and from device tensors (sync-first). A
sender that reuses one buffer before the ack fails the same check.
"""

from __future__ import annotations

import pytest
import torch

from colo.core.interfaces import SyncContext
from colo.core.memory import StagingBudget
from colo.engine.reference.weights import expected_digest
from colo.testing.engines import RecordingEngine
from colo.testing.trainers import StateTrainer
from colo.testing.transports import OneBufferPacked
from colo.trainers.models import build_trainer_model, demo_config
from colo.transports.packed import PackedTransport
from tests.conftest import SMALL_CFG

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytestmark = [pytest.mark.gpu, gpu]

#: 8 KiB: SMALL_CFG's float32 weights fill many buckets, several tensors cut into pieces
BUCKET = 8 << 10


def trainer_state(config, seed: int, *, pinned: bool) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in build_trainer_model(config, seed=seed).named_parameters():
        t = p.detach().clone()
        out[n] = t.pin_memory() if pinned else t.to("cuda")
    return out


async def test_queued_uploads_deliver_exact_weights_to_an_engine_that_loads_late():
    from colo.engine.reference.client import EngineClient

    config = demo_config(**SMALL_CFG)
    client = await EngineClient.spawn({"config": config.to_dict(), "dtype": "float32", "device": "cuda",
                                       "total_bytes": 256 << 20, "mem_fraction_static": 0.5, "checkpoint": None})
    try:
        transport = PackedTransport()
        try:
            for seed, pinned in ((1, True), (2, False), (3, True)):
                state = trainer_state(config, seed, pinned=pinned)
                budget = StagingBudget(2 * BUCKET)
                ctx = SyncContext(step=seed, weight_version=seed, bucket_bytes=BUCKET,
                                  source="host" if pinned else "device", staging=budget)
                # the real client, whose every load waits 10 ms before it is sent
                await transport.sync(StateTrainer(state, upload_to="cuda" if pinned else None),
                                     RecordingEngine(client, delay=0.01), ctx)
                want = expected_digest({n: t.cpu() for n, t in state.items()}, config, torch.float32)
                assert await client.digest() == want, seed
                assert budget.held_bytes == 0
                # every bucket's pack is recorded once, in order, before its handoff
                packs = [r.bucket for r in ctx.stages if r.stage == "pack"]
                assert packs == list(range(len(packs))) and len(packs) > 4
                order = [(r.bucket, r.stage) for r in ctx.stages if r.stage in ("pack", "handoff")]
                assert all(order.index((b, "pack")) < order.index((b, "handoff")) for b in packs)
        finally:
            await transport.aclose()
        # the check has teeth: one buffer reused before the ack gives the engine wrong weights
        state = trainer_state(config, 7, pinned=True)
        ctx = SyncContext(step=7, weight_version=7, bucket_bytes=BUCKET, source="host", staging=StagingBudget(None))
        broken = OneBufferPacked()
        try:
            await broken.sync(StateTrainer(state, upload_to="cuda"), RecordingEngine(client, delay=0.01), ctx)
        finally:
            await broken.aclose()
        assert await client.digest() != expected_digest(state, config, torch.float32)
    finally:
        await client.aclose()


class LateExtractor:
    """``inner``'s tensors, each made anew on the thread's current stream behind a
    ~10 ms kernel, as a tensor-parallel gather's output is on the default stream while
    its all-gather has not landed: the host has the tensor long before its bytes. No
    upload device, so the sender gathers on the default stream (sync-first)."""

    def __init__(self, inner):
        self.inner = inner

    def specs(self):
        return self.inner.specs()

    def extract(self, names):
        for name, t in self.inner.extract(names):
            out = torch.empty_like(t)
            torch.cuda._sleep(20_000_000)  # cycles: about 10 ms at a GPU's ~2 GHz
            out.copy_(t)
            yield name, out


class LateTrainer(StateTrainer):
    def extractor(self):
        return LateExtractor(super().extractor())


@pytest.mark.parametrize("transport", ["ipc", "packed"])
async def test_tensors_a_gather_is_still_writing_on_the_default_stream_reach_the_engine_exact(transport):
    """Issue 34, item 2: the per-tensor ``ipc`` transport queued its copies on its own
    upload stream, which did not wait for the default stream where a sync-first gather
    ran, and copied gathered tensors before their bytes arrived (two H200s, Qwen2-7B
    TP=2: 19 and 37 tensors differed). Every sync must be exact."""
    from colo.engine.reference.client import EngineClient
    from colo.transports import make_transport

    config = demo_config(**SMALL_CFG)
    client = await EngineClient.spawn({"config": config.to_dict(), "dtype": "float32", "device": "cuda",
                                       "total_bytes": 256 << 20, "mem_fraction_static": 0.5, "checkpoint": None})
    try:
        sender = make_transport(transport)
        try:
            for seed in (11, 12):
                state = trainer_state(config, seed, pinned=False)
                ctx = SyncContext(step=seed, weight_version=seed, bucket_bytes=64 << 10, source="device",
                                  staging=StagingBudget(None))
                await sender.sync(LateTrainer(state), client, ctx)
                want = expected_digest({n: t.cpu() for n, t in state.items()}, config, torch.float32)
                assert await client.digest() == want, (transport, seed)
        finally:
            await sender.aclose()
    finally:
        await client.aclose()
