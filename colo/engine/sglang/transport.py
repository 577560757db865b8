"""colo's sender for SGLang, the transport ``sglang`` (:data:`colo.transports.REGISTRY`).

Its receiving half is SGLang's own: ``update_weights_from_tensor`` with
``load_format="flattened_bucket"`` reads the payloads (:mod:`colo.engine.sglang.payload`) in
SGLang's ranks, so it speaks to an :class:`~colo.engine.sglang.engine.SglangEngine` only, and no
engine kit builds a receiver for it (``colo.transports.ENGINE_OWN``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import anyio
import anyio.to_thread
import torch

from colo.core.buckets import Bucket, plan_buckets
from colo.core.errors import BadInput
from colo.core.interfaces import SyncContext
from colo.engine.sglang.engine import TRANSPORT, SglangEngine
from colo.engine.sglang.payload import bucket_metadata, bucket_views, serialize_payload
from colo.transports.base import BucketSender, Staged, timed_ack
from colo.transports.pack import pack_into
from colo.transports.wire import UNPADDED, relayout

# -- the sender ------------------------------------------------------------------------------------

class SglangTransport(BucketSender):
    """colo's sender for SGLang: each bucket packed back to back (SGLang's layout), one copy
    per TP rank on that rank's device (``devices``; default the bucket's own device for
    every rank), each serialized into that rank's payload, one ``update_weights_from_tensor``
    per bucket. A tensor travels whole (SGLang has no pieces): a bucket grows to the
    largest tensor. Buffers are freed once SGLang acknowledged the bucket."""

    name = TRANSPORT

    def __init__(self, *, devices: Sequence[Any] | None = None, pipelined: bool = True):
        super().__init__(pipelined=pipelined)
        self.devices = None if devices is None else [torch.device(d) for d in devices]
        self._layout: dict[int, Bucket] = {}
        self._slots: list[tuple[Bucket, list[torch.Tensor], list[Staged]] | None] = [None, None]

    def _buckets(self, specs: list, bucket_bytes: int) -> list[Bucket]:
        largest = max(s.nbytes for s in specs)
        buckets = plan_buckets(specs, max(bucket_bytes, largest))
        self._layout = {b.index: relayout(b, align=UNPADDED) for b in buckets}
        return buckets

    async def sync(self, trainer: Any, engine: Any, ctx: SyncContext) -> Any:
        if not isinstance(engine, SglangEngine):
            raise BadInput(f"colo's {TRANSPORT!r} sender speaks to an SglangEngine, not {type(engine).__name__}")
        ranks = len(self.devices) if self.devices is not None else engine.model.tp_size
        if ranks != engine.model.tp_size:
            raise BadInput(f"{ranks} device(s) for SGLang's {engine.model.tp_size} TP ranks: one each")
        return await super().sync(trainer, engine, ctx)

    def _began(self, ctx: SyncContext) -> None:
        ctx.mark("session.opened")

    async def _end_load(self, engine: Any, ctx: SyncContext) -> None:
        await super()._end_load(engine, ctx)
        ctx.mark("session.closed")

    async def _pack(self, bucket: Bucket, tensors: list[tuple[str, Any]], slot: int, ctx: SyncContext) -> None:
        t0 = time.perf_counter()
        laid = self._layout[bucket.index]
        source = tensors[0][1].device
        devices = self.devices or [source] * self._engine.model.tp_size
        # counted against the budget before the memory exists
        staged = [Staged(ctx, laid.nbytes) for _ in devices]
        self._slots[slot] = (laid, [], staged)

        def pack() -> list[torch.Tensor]:
            flats = []
            for d in devices:
                flat = torch.empty(laid.nbytes, dtype=torch.uint8, device=d)
                pack_into(flat, laid, tensors)
                if flat.is_cuda:
                    # SGLang's ranks read from other processes, outside our stream order
                    torch.cuda.synchronize(flat.device)
                flats.append(flat)
            return flats

        self._slots[slot] = (laid, await anyio.to_thread.run_sync(pack), staged)
        ctx.record(bucket.index, "pack", bucket.payload_bytes, len(tensors), time.perf_counter() - t0)

    async def _handoff(self, engine: Any, bucket: Bucket, slot: int, ctx: SyncContext) -> None:
        laid, flats, _ = self._slots[slot]
        metadata = bucket_metadata(laid)
        payloads = [serialize_payload(f, metadata) for f in flats]
        on_sent, on_ack = timed_ack(ctx, bucket, len(bucket.entries))
        reply = await engine.transport_load(self.name, {"serialized_named_tensors": payloads,
                                                        "tensors": len(laid.entries)}, on_sent=on_sent)
        for name, view in bucket_views(flats[0], metadata):
            engine.received.add(name, view)
        self._free(slot)
        on_ack(reply)

    def _free(self, slot: int) -> None:
        held, self._slots[slot] = self._slots[slot], None
        if held is None:
            return
        _, flats, staged = held
        cuda = any(f.is_cuda for f in flats)
        del flats[:]
        for s in staged:
            s.free()
        if cuda:
            # SGLang's ranks dropped their mappings: the IPC-shared blocks can go back now
            torch.cuda.ipc_collect()

    def _cleanup(self) -> None:
        for slot in range(len(self._slots)):
            self._free(slot)


__all__ = ["SglangTransport"]
