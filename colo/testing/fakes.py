"""Fakes for scheduler unit tests only. They keep byte counts, not tensors."""

from __future__ import annotations

from collections.abc import Sequence

import anyio

from colo.core.buckets import plan_buckets, spec
from colo.core.interfaces import RolloutResult, SyncContext, SyncResult, TensorSpec
from colo.core.schema import BUCKET_STAGES


class FakeTrainer:
    def __init__(self, weights: int = 100, optimizer: int = 200, n_params: int = 10):
        self.sizes = {"weights": weights, "optimizer": optimizer}
        per = weights // n_params
        self.specs = [spec(f"layers.{i}.weight", (per,), "uint8") for i in range(n_params)]
        self.calls: list[tuple] = []
        self.resident: set[str] = set()

    def tag_bytes(self):
        return dict(self.sizes)

    def param_specs(self) -> Sequence[TensorSpec]:
        return self.specs

    def extractor(self):
        raise AssertionError("the fake transport never extracts tensors")

    async def onload(self, tags):
        self.calls.append(("onload", tuple(tags)))
        self.resident |= set(tags)

    async def offload(self, tags):
        self.calls.append(("offload", tuple(tags)))
        self.resident -= set(tags)

    async def train_step(self, rollout):
        self.calls.append(("train", rollout.reward))
        return {"loss": 1.0}


class FakeEngine:
    def __init__(self, weights: int = 100, kv_cache: int = 300, cuda_graph: int = 20):
        self.sizes = {"weights": weights, "kv_cache": kv_cache, "cuda_graph": cuda_graph}
        self.resident = set(self.sizes)
        self.version: int | None = 0
        self.loaded: list[str] = []
        self.calls: list[tuple] = []

    def tag_bytes(self):
        return dict(self.sizes)

    async def release(self, tags):
        self.calls.append(("release", tuple(tags)))
        self.resident -= set(tags)

    async def resume(self, tags):
        self.calls.append(("resume", tuple(tags)))
        self.resident |= set(tags)

    async def flush_cache(self):
        self.calls.append(("flush",))

    async def generate(self, step):
        if "kv_cache" not in self.resident or self.version is None:
            raise RuntimeError("fake engine: refused to generate")
        self.calls.append(("generate", step))
        return RolloutResult(reward=float(step), tokens=8)

    async def digest(self):
        return "fake:" + ",".join(self.loaded[-3:])

    async def set_weight_version(self, version):
        self.version = version


class FakeTransport:
    """Walks the buckets through every stage with two staging buffers at most."""

    name = "fake"

    def __init__(self, *, fail_at_bucket: int | None = None, block_at_bucket: int | None = None):
        self.fail_at_bucket = fail_at_bucket
        self.block_at_bucket = block_at_bucket
        self.blocked = anyio.Event()
        self.aborted = 0

    async def sync(self, trainer, engine, ctx: SyncContext) -> SyncResult:
        buckets = plan_buckets(list(trainer.param_specs()), ctx.bucket_bytes)
        live: list[int] = []
        total = 0
        for b in buckets:
            live.append(ctx.staging.alloc(b.nbytes))
            if self.fail_at_bucket == b.index:
                raise RuntimeError(f"receiver failed in bucket {b.index}")
            if self.block_at_bucket == b.index:
                self.blocked.set()
                await anyio.sleep_forever()
            stages = BUCKET_STAGES if ctx.source == "host" else BUCKET_STAGES[1:]
            for stage in stages:
                ctx.record(b.index, stage, b.nbytes, len(b.entries), 0.0)
            engine.loaded.extend(e.spec.name for e in b.entries)
            total += b.payload_bytes
            if len(live) == 2:  # the receiver acked the older one: free it
                ctx.staging.free(live.pop(0))
        for sid in live:
            ctx.staging.free(sid)
        return SyncResult(bytes=total, buckets=len(buckets), tensors=sum(len(b.entries) for b in buckets))

    async def abort(self):
        self.aborted += 1
