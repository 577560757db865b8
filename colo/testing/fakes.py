"""Fakes for scheduler unit tests only. They keep byte counts, not tensors."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import anyio.to_thread

from colo.core.buckets import plan_buckets, spec
from colo.core.interfaces import EngineCapabilities, RolloutResult, SyncContext, SyncResult, TensorSpec
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
    capabilities = EngineCapabilities()

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
                # a load counts the tensors it completes (a piece of a tensor larger than the bucket, none)
                ctx.record(b.index, stage, b.nbytes, b.completed if stage == "load" else len(b.entries), 0.0)
            engine.loaded.extend(e.spec.name for e in b.entries if e.last)
            total += b.payload_bytes
            if len(live) == 2:  # the receiver acked the older one: free it
                ctx.staging.free(live.pop(0))
        for sid in live:
            ctx.staging.free(sid)
        return ctx.result(bytes=total, buckets=len(buckets), tensors=sum(b.completed for b in buckets))

    async def abort(self):
        self.aborted += 1


class _DictSink:
    """The smallest engine the kit can host: one tensor per HF name, written in place
    (pieces too), accounted by the kit's :class:`~colo.engine.kit.LoadSession`."""

    def __init__(self, specs: Sequence[TensorSpec]):
        import torch

        self.device = torch.device("cpu")
        self.specs = {s.name: s for s in specs}
        self.params = {s.name: torch.zeros(s.shape, dtype=getattr(torch, s.dtype)) for s in specs}
        self.session: Any = None
        self.flushes = 0

    def preflight(self, specs):
        got = {(s.name, tuple(s.shape), s.dtype) for s in specs}
        want = {(s.name, tuple(s.shape), s.dtype) for s in self.specs.values()}
        if got != want:
            raise ValueError(f"protocol engine: preflight mismatch: {sorted(got ^ want)[:4]}")

    def begin_load(self):
        from colo.engine.kit import LoadSession

        self.session = LoadSession({n: s.shape for n, s in self.specs.items()})

    def load_weights(self, named):
        from colo.transports.wire import Piece

        items = list(named)
        self.session.check(items)
        done = 0
        for name, tensor in items:
            if isinstance(tensor, Piece):  # a run of a tensor larger than the bucket, in place
                self.params[name].view(-1)[tensor.offset:tensor.end].copy_(tensor.data)
            else:
                self.params[name].copy_(tensor.view(self.params[name].shape))
            done += self.session.advance(name, tensor)
        return done

    def end_load(self):
        session, self.session = self.session, None
        if session is None:
            raise ValueError("protocol engine: end_load without begin_load")
        return session.finish()

    def flush_cache(self):
        self.flushes += 1


def protocol_engine(specs: Sequence[TensorSpec], *, kv_cache: int = 64, cuda_graph: int = 0) -> Any:
    """An in-process engine that holds real tensors and implements exactly the
    declared engine protocols (``EngineSide`` and ``EngineReceiver``), nothing
    more: a transport that works against it works against any engine that
    satisfies them. It is the library's :class:`colo.engine.local.InProcessEngine`
    (the engine kit in this process) around a dict of tensors, ``engine.sink``."""
    from colo.engine.local import InProcessEngine

    sink = _DictSink(specs)

    async def generate(step: int) -> RolloutResult:
        return RolloutResult(reward=0.0, tokens=0)

    engine = InProcessEngine(sink, generate=generate, tag_bytes={
        "weights": sum(s.nbytes for s in specs), "kv_cache": kv_cache, "cuda_graph": cuda_graph})
    engine.sink = sink  # the tensors it holds (``params``) and its flushes, for the tests
    return engine
