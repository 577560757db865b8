"""Fakes for scheduler unit tests only. They keep byte counts, not tensors."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import anyio.to_thread

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


class ProtocolEngine:
    """An in-process engine that holds real tensors and implements exactly the
    declared engine protocols (``EngineSide`` and ``EngineReceiver``), nothing
    more: a transport that works against it works against any engine that
    satisfies them.

    Receivers are built from the transport's own strategy, as the engine
    process does; receiving runs in a worker thread, because a receiver may
    join a collective that the sender in this same process joins at once.
    """

    def __init__(self, specs: Sequence[TensorSpec], *, kv_cache: int = 64, cuda_graph: int = 0):
        import torch

        self._specs = {s.name: s for s in specs}
        self.params = {s.name: torch.zeros(s.shape, dtype=getattr(torch, s.dtype)) for s in specs}
        self._sizes = {"weights": sum(s.nbytes for s in specs), "kv_cache": kv_cache, "cuda_graph": cuda_graph}
        self._resident = set(self._sizes)
        self._receivers: dict[str, Any] = {}
        self._version: int | None = 0
        self._loading: set[str] | None = None
        #: prefix-cache flushes, asked on their own or with the end of a load
        self.flushes = 0

    # -- EngineSide --------------------------------------------------------------
    def tag_bytes(self):
        return dict(self._sizes)

    async def release(self, tags):
        self._resident -= set(tags)

    async def resume(self, tags):
        self._resident |= set(tags)

    async def flush_cache(self):
        self.flushes += 1

    async def generate(self, step):
        if "kv_cache" not in self._resident or self._version is None:
            raise RuntimeError("protocol engine: refused to generate (KV cache released or weights stale)")
        return RolloutResult(reward=0.0, tokens=0)

    async def digest(self):
        import hashlib

        import torch

        h = hashlib.sha256()
        for name in sorted(self.params):
            h.update(name.encode())
            h.update(self.params[name].contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    async def set_weight_version(self, version):
        self._version = version

    # -- EngineReceiver ----------------------------------------------------------
    async def preflight(self, specs):
        got = {(s.name, tuple(s.shape), s.dtype) for s in specs}
        want = {(s.name, tuple(s.shape), s.dtype) for s in self._specs.values()}
        if got != want:
            raise ValueError(f"protocol engine: preflight mismatch: {sorted(got ^ want)[:4]}")

    async def begin_load(self):
        self._loading = set()

    async def transport_init(self, transport, init_info):
        from colo.transports import get_strategy

        strategy = get_strategy(transport)
        info = strategy.init_info_type.from_json(init_info)
        old = self._receivers.pop(transport, None)
        if old is not None:
            old.close()
        self._receivers[transport] = await anyio.to_thread.run_sync(
            lambda: strategy.create_receiver(info, device="cpu"))

    async def transport_load(self, transport, request, on_sent=None, *, end=False, flush_cache=False):
        from colo.transports import get_strategy
        from colo.transports.wire import EmptyInitInfo

        if transport not in self._receivers:
            strategy = get_strategy(transport)
            if strategy.init_info_type is not EmptyInitInfo:
                raise ValueError(f"transport {transport!r} is not initialised: call transport_init first")
            self._receivers[transport] = strategy.create_receiver(EmptyInitInfo(), device="cpu")
        receiver = self._receivers[transport]
        if on_sent is not None:
            on_sent()

        def receive() -> int:
            from colo.transports.wire import Piece

            done = 0
            with receiver.receive(request) as named:
                for name, tensor in named:
                    if isinstance(tensor, Piece):  # a run of a tensor larger than the bucket, in place
                        self.params[name].view(-1)[tensor.offset:tensor.end].copy_(tensor.data)
                        if tensor.end < self.params[name].numel():
                            continue
                    else:
                        self.params[name].copy_(tensor.view(self.params[name].shape))
                    self._loading.add(name)
                    done += 1
                return done

        reply = {"tensors": await anyio.to_thread.run_sync(receive)}
        if end:
            await self.end_load(flush_cache=flush_cache)
            reply["ended"] = True
        return reply

    async def transport_close(self, transport):
        receiver = self._receivers.pop(transport, None)
        if receiver is not None:
            receiver.close()

    async def end_load(self, flush_cache=False):
        missing = set(self.params) - (self._loading or set())
        self._loading = None
        if missing:
            raise ValueError(f"protocol engine: the sync did not cover {sorted(missing)}")
        for receiver in self._receivers.values():
            receiver.release()
        self.flushes += bool(flush_cache)

    async def drop_handles(self):
        for receiver in self._receivers.values():
            receiver.release(kept=True)

