"""``packed``: one flat buffer and one handle per bucket (slime's and SGLang's flattened bucket).

Per bucket: gather (extract full tensors in the engine dtype), pack (copy them
into a flat uint8 staging buffer at the planned offsets), handoff (send the
buffer's handle and the per-tensor metadata), load (the engine copies out of
the buffer into its parameters and acknowledges). Two staging buffers: while
bucket i is handed off and loaded, bucket i+1 is gathered and packed into the
other one. A buffer is reused only after the engine acknowledged the bucket it
held — reusing it earlier would overwrite weights the engine is still reading.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import anyio
import anyio.to_thread

from colo.buckets import Bucket, plan_buckets
from colo.handles import ShmSegment
from colo.interfaces import SyncContext, SyncResult


class _Slot:
    """One staging buffer: the memory, its handle, and its place in the budget."""

    def __init__(self, nbytes: int, ctx: SyncContext):
        self.sid = ctx.staging.alloc(nbytes)  # count it before it exists: OOM before allocation
        try:
            self.seg = ShmSegment.create(nbytes)
        except BaseException:
            ctx.staging.free(self.sid)
            raise

    def close(self, ctx: SyncContext) -> None:
        self.seg.close()
        ctx.staging.free(self.sid)


def pack_into(flat: Any, bucket: Bucket, tensors: Sequence[tuple[str, Any]]) -> int:
    """Copy ``tensors`` into ``flat`` at the bucket's offsets; check names and sizes as we go."""
    if len(tensors) != len(bucket.entries):
        raise ValueError(f"bucket {bucket.index}: extractor gave {len(tensors)} tensors, "
                         f"planned {len(bucket.entries)}")
    for (name, t), e in zip(tensors, bucket.entries):
        if name != e.spec.name:
            raise ValueError(f"bucket {bucket.index}: extractor gave {name!r} where {e.spec.name!r} was planned")
        if str(t.dtype).removeprefix("torch.") != e.spec.dtype or tuple(t.shape) != e.spec.shape:
            raise ValueError(f"{name}: extractor gave {tuple(t.shape)} {t.dtype}, planned {e.spec.shape} {e.spec.dtype}")
        flat[e.start:e.end].copy_(t.contiguous().view(-1).view(flat.dtype))
    return bucket.payload_bytes


class PackedTransport:
    name = "packed"

    def __init__(self, *, pipelined: bool = True):
        self.pipelined = pipelined
        self._engine: Any = None

    async def sync(self, trainer: Any, engine: Any, ctx: SyncContext) -> SyncResult:
        extractor = trainer.extractor()
        specs = list(extractor.specs())
        if not specs:
            raise ValueError("the trainer has no parameters to sync (empty model)")
        buckets = plan_buckets(specs, ctx.bucket_bytes)
        self._engine = engine
        # The engine checks every name, shape and dtype before the first byte moves.
        await engine.preflight(specs)
        await engine.begin_load()
        cap = max(b.nbytes for b in buckets)
        slots: list[_Slot | None] = [None, None]
        try:
            def slot(i: int) -> _Slot:
                if slots[i % 2] is None:
                    slots[i % 2] = _Slot(cap, ctx)
                return slots[i % 2]

            await self._prepare(extractor, buckets[0], slot(0), ctx)
            for i, bucket in enumerate(buckets):
                nxt = buckets[i + 1] if i + 1 < len(buckets) else None
                if self.pipelined and nxt is not None:
                    try:
                        async with anyio.create_task_group() as tg:
                            tg.start_soon(self._handoff, engine, bucket, slot(i), ctx)
                            await self._prepare(extractor, nxt, slot(i + 1), ctx)
                    except BaseExceptionGroup as group:
                        # One side failed and the other was cancelled: the caller
                        # should see the failure (an OOM, an engine error), not a group.
                        real = [e for e in group.exceptions
                                if not isinstance(e, anyio.get_cancelled_exc_class())]
                        if len(real) == 1:
                            raise real[0] from None
                        raise
                else:
                    await self._handoff(engine, bucket, slot(i), ctx)
                    if nxt is not None:
                        await self._prepare(extractor, nxt, slot(i + 1), ctx)
            await engine.end_load()
        finally:
            with anyio.CancelScope(shield=True):
                for s in slots:
                    if s is not None:
                        s.close(ctx)
        return SyncResult(bytes=sum(b.payload_bytes for b in buckets), buckets=len(buckets),
                          tensors=len(specs))

    async def _prepare(self, extractor: Any, bucket: Bucket, slot: _Slot, ctx: SyncContext) -> None:
        names = [e.spec.name for e in bucket.entries]
        t0 = time.perf_counter()
        # Off the event loop: the engine's acknowledgement of the previous
        # bucket must be read while this one is being gathered and packed.
        tensors = await anyio.to_thread.run_sync(lambda: list(extractor.extract(names)))
        t1 = time.perf_counter()
        ctx.record(bucket.index, "gather", bucket.payload_bytes, len(names), t1 - t0)
        await anyio.to_thread.run_sync(pack_into, slot.seg.tensor, bucket, tensors)
        del tensors
        ctx.record(bucket.index, "pack", bucket.payload_bytes, len(names), time.perf_counter() - t1)

    async def _handoff(self, engine: Any, bucket: Bucket, slot: _Slot, ctx: SyncContext) -> None:
        meta = [e.meta() for e in bucket.entries]
        n = len(meta)
        t0 = time.perf_counter()
        sent = [t0]

        def on_sent() -> None:
            # recorded the moment the handle is on the wire, so the handoff
            # slice ends where the engine's load begins
            sent[0] = time.perf_counter()
            ctx.record(bucket.index, "handoff", bucket.payload_bytes, n, sent[0] - t0)

        reply = await engine.load_bucket(slot.seg.handle(), meta, on_sent=on_sent)
        ctx.record(bucket.index, "load", bucket.payload_bytes, reply.get("tensors", n),
                   time.perf_counter() - sent[0])

    async def abort(self) -> None:
        # The engine may still map our (now unlinked) segments: make it let go
        # so the memory really returns.
        if self._engine is not None:
            with anyio.move_on_after(5):
                try:
                    await self._engine.drop_handles()
                except Exception:
                    pass
