"""``packed``: one flat buffer and one handle per bucket (slime's and SGLang's flattened bucket).

Per bucket: gather (extract full tensors in the engine dtype), pack (copy them
into a flat uint8 staging buffer at the planned offsets), handoff (send the
buffer's handle and the per-tensor metadata), load (the engine copies out of
the buffer into its parameters and acknowledges). Two staging buffers: while
bucket i is handed off and loaded, bucket i+1 is gathered and packed into the
other one. A buffer is reused only after the engine acknowledged the bucket it
held — reusing it earlier would overwrite weights the engine is still reading.

One copy (issue 18, items 1 and 2): when the trainer keeps its weights in one
flat, exportable buffer (``trainer.flat_weights``, :mod:`colo.device.flat_weights`) and
every tensor the extractor yields is a view of it (same dtype as the engine's,
nothing gathered or converted; a strided one, Megatron's q, k and v cut from the
fused QKV, carries its strides: :func:`one_copy_bucket`), there is nothing to pack: the
buffer's one handle goes to the engine in ONE request whose metadata gives each
tensor's byte range in it, and the engine copies straight out of the trainer's
memory into its parameters. No staging buffer, one copy of the model: a device
copy in ``sync-first``; in ``offload-first`` a host-to-device copy out of the
paused weights' shared pinned backup, which the engine keeps mapped across
syncs. Anything else (a conversion, a TP gather, a private pinned host copy)
is packed in buckets as above.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import anyio.to_thread
import torch

from colo.core.buckets import Bucket, Entry
from colo.device import canonical_device
from colo.proc.handles import ShmSegment, open_handle
from colo.core.interfaces import SyncContext
from colo.transports.base import (EVENT_POLL_S, BucketSender, EmptyInitInfo, RequestError, Staged, TensorMeta,
                                  parse_tensors, timed_ack, views, wait_event)
from colo.transports.pack import pack_and_settle, queue_pack
from colo.transports.wire import PADDED, LayoutCache, LayoutMemo, contiguous_strides, is_layout_not_cached, relayout

#: attachments the receiver keeps open across buckets: the sender double-buffers,
#: so two live segments is the steady state; a few more cover a restarted sync.
MAX_ATTACHED = 4
#: staging a sender keeps allocated between syncs (both buffers together): a small
#: model's buckets (the demo's 5.8 MB in one) stay mapped on both sides, while a
#: 7B sync's 2 x 512 MiB still goes back after every sync
KEEP_STAGING_BYTES = 64 << 20


@dataclass(frozen=True)
class PackedRequest:
    """One bucket: the flat buffer's handle and where each tensor lies in it."""

    handle: dict
    tensors: tuple[TensorMeta, ...]

    def to_json(self) -> dict:
        return {"handle": self.handle, "tensors": [m.to_json() for m in self.tensors]}

    @classmethod
    def from_json(cls, d: Any) -> PackedRequest:
        if not isinstance(d, dict) or not isinstance(d.get("handle"), dict):
            raise RequestError("packed request must be a JSON object with a 'handle' object and 'tensors'")
        nbytes = d["handle"].get("nbytes")
        return cls(d["handle"], parse_tensors(d, "tensors", "packed request",
                                              buffer_nbytes=nbytes if isinstance(nbytes, int) else None))


class _Slot:
    """One staging buffer: the memory, its handle, and its place in the budget.

    On the CPU a ``/dev/shm`` segment; on a GPU a plain ``cudaMalloc`` block
    exported as a CUDA IPC handle (never memory-saver memory: that cannot be
    exported). A slot ``kept`` across syncs says so in its handle, and the
    engine keeps it mapped after ``end_load`` (until ``drop_handles``)."""

    def __init__(self, nbytes: int, ctx: SyncContext, device: Any, *, kept: bool = False):
        self.nbytes = nbytes
        self.device = device
        self.kept = kept
        self.staged = Staged(ctx, nbytes)  # counted before it exists: OOM before allocation
        self.seg: ShmSegment | None = None
        self.cuda: Any = None
        #: (event, t0) of copies queued into this slot and not yet waited for
        self.pending: tuple[Any, float] | None = None
        try:
            if device.type == "cuda":
                from colo.device.cuda_ipc import export_cuda

                self.cuda = torch.empty(nbytes, dtype=torch.uint8, device=device)
                self._handle = export_cuda(self.cuda)
            else:
                self.seg = ShmSegment.create(nbytes)
                self._handle = self.seg.handle()
        except BaseException:
            self.close()
            raise
        if kept:
            self._handle = {**self._handle, "keep": True}

    @property
    def tensor(self) -> Any:
        return self.cuda if self.cuda is not None else self.seg.tensor

    def handle(self) -> dict:
        return self._handle

    def counted_in(self, ctx: SyncContext) -> None:
        """A kept slot enters the next sync's budget (its memory never left the device)."""
        self.staged.free()
        self.staged = Staged(ctx, self.nbytes)

    def uncount(self) -> None:
        """End of a sync for a kept slot: out of that sync's budget, still allocated."""
        self.pending = None
        self.staged.free()

    def close(self) -> None:
        if self.seg is not None:
            self.seg.close()
            self.seg = None
        self.cuda = None
        self.pending = None
        self.staged.free()


class PackedTransport(BucketSender):
    """``align``: ``PADDED`` (default: each tensor on a 16-byte boundary) or
    ``UNPADDED`` (SGLang's back-to-back layout); see :mod:`colo.transports.wire`.

    On a GPU a bucket's copies are queued on the sender's upload stream and
    ``_pack`` returns; the handoff waits for that bucket's event before the
    handle goes out. The pipeline queues bucket i+2 into bucket i's buffer right
    after bucket i's acknowledgement, while bucket i+1 is still uploading, so the
    copy engine always has the next bucket behind the current one: no idle gap
    per bucket for a thread hop, a host wait and the next gather (issue 18)."""

    name = "packed"
    ends_on_last_load = True
    #: its entries carry ``rank_slice`` (``TensorMeta.of_bucket``), which colo's TP engine takes
    carries_rank_slices = True

    def __init__(self, *, pipelined: bool = True, align: int = PADDED, one_copy: bool = True,
                 keep_staging_bytes: int | None = None):
        super().__init__(pipelined=pipelined)
        if keep_staging_bytes is not None and (isinstance(keep_staging_bytes, bool)
                                               or not isinstance(keep_staging_bytes, int) or keep_staging_bytes < 0):
            raise ValueError(f"keep_staging_bytes must be a non-negative int or None, got {keep_staging_bytes!r}")
        #: staging buffers are kept from sync to sync while both together take at most
        #: this much (0: freed after every sync); None: KEEP_STAGING_BYTES on a GPU and
        #: 0 on the CPU, where a buffer is a /dev/shm file that would outlive a sender
        #: killed between syncs (a GPU buffer goes with its process)
        self.keep_staging_bytes = keep_staging_bytes
        if isinstance(align, bool) or not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise ValueError(f"align must be a positive power of two, got {align!r}")
        if not isinstance(one_copy, bool):
            raise ValueError(f"one_copy must be a bool, got {one_copy!r}")
        self.align = align
        #: load straight from the trainer's flat weights when it has them (False: always
        #: pack, e.g. to measure the packed path against it)
        self.one_copy = one_copy
        self._slots: list[_Slot | None] = [None, None]
        #: (slot id, bucket index) -> (the laid bucket, the slot, its typed views by name)
        self._dests: dict[tuple[int, int], tuple[Bucket, _Slot, dict]] = {}
        self._layout: dict[int, Bucket] = {}
        #: bucket index -> (its layout, :func:`view_plan` of it)
        self._view_plans: dict[int, tuple[Bucket, Any]] = {}
        self._cap = 0
        self._cuda = False
        #: which bucket layouts the engine already holds: later syncs send only their keys
        self._memo = LayoutMemo()
        #: (extractor, flat weights, their one-copy bucket or None) of the last walk, weakly
        self._one_copy_memo: tuple[Any, Any, Bucket | None] | None = None
        #: the engine keeps a trainer buffer mapped across syncs (a flat weights' host backup)
        self._engine_keeps = False

    async def sync(self, trainer: Any, engine: Any, ctx: SyncContext) -> Any:
        flat = getattr(trainer, "flat_weights", None) if self.one_copy else None
        if flat is not None and flat.readable() is not None:
            # a parameter replaced after the buffer was built is refused here, by name,
            # not silently packed from wherever it lives now
            flat.check()
            t0 = time.perf_counter()
            extractor = trainer.extractor()
            bucket = self._one_copy_layout(flat, extractor)
            if bucket is not None:
                ctx.record(0, "gather", bucket.payload_bytes, len(bucket.entries), time.perf_counter() - t0)
                return await self._sync_one_copy(flat, bucket, engine, ctx)
        return await super().sync(trainer, engine, ctx)

    def _one_copy_layout(self, flat: Any, extractor: Any) -> Bucket | None:
        """:func:`one_copy_bucket`, walked once per (flat weights, extractor) pair and kept.

        Walking the extractor (339 tensors of a 7B model: convert, check, locate) was
        a fifth of a one-copy sync on an H200 (4.7 of 21.6 ms, issue 18). What it
        finds cannot change while both stay the same objects: an extractor's specs
        and conversions are fixed when it is built, it yields the tensors of its
        source, and ``flat.check()``, run before every sync, refuses a source
        tensor that is no longer its view of the buffer. A trainer that builds a
        new extractor per sync pays the walk every time."""
        memo = self._one_copy_memo
        if memo is not None and memo[0]() is extractor and memo[1]() is flat:
            return memo[2]
        bucket = one_copy_bucket(flat, extractor)
        try:
            self._one_copy_memo = (weakref.ref(extractor), weakref.ref(flat), bucket)
        except TypeError:  # an extractor that takes no weak reference is walked every sync
            self._one_copy_memo = None
        return bucket

    async def _sync_one_copy(self, flat: Any, bucket: Bucket, engine: Any, ctx: SyncContext) -> Any:
        """The whole model in one request out of the trainer's flat buffer: stages
        ``gather`` (the extractor's views, nothing copied), ``handoff`` and ``load``
        of bucket 0; no pack, no staging."""
        self._engine = engine
        specs = [e.spec for e in bucket.entries]
        await engine.preflight(specs)
        await engine.begin_load()
        if flat.device.type == "cuda":
            # The engine reads from another process, outside our stream order: what
            # the trainer queued (an optimizer step) must have landed first.
            written = torch.cuda.Event()
            written.record(torch.cuda.default_stream(flat.device))
            await wait_event(written)
        # exported per sync: the engine closes it at end_load (the receiver's release),
        # which is what lets a later pause give the memory back
        self._last_bucket, self._ended = bucket.index, False
        handle = flat.export()
        if handle.get("keep") is True:
            # the shared host backup: the engine keeps it mapped until drop_handles (aclose)
            self._engine_keeps = True
        await self._load(engine, bucket, bucket, handle, ctx)
        await self._end_load(engine, ctx)
        return ctx.result(bytes=bucket.payload_bytes, buckets=1, tensors=len(specs), cache_flushed=ctx.flush_cache)

    async def _begin(self, engine: Any, ctx: SyncContext, buckets: list[Bucket]) -> None:
        # The sender's plan fixes which tensors share a bucket; this transport
        # decides where they lie in its buffer.
        self._layout = {b.index: b if self.align == PADDED else relayout(b, align=self.align) for b in buckets}
        self._cap = max(b.nbytes for b in self._layout.values())
        if any(s is not None and s.nbytes != self._cap for s in self._slots):
            await self._free_kept()  # another bucket size: new buffers

    def _destinations(self, extractor: Any, bucket: Bucket, slot: int, ctx: SyncContext) -> dict | None:
        """Views of the slot at the bucket's offsets, for an extractor that can write its
        results there itself (``extracts_into``): one typed view per whole tensor (by
        name) and the bytes of each piece (by ``(name, offset)``). A conversion on a GPU
        (:class:`~colo.extractors.plain.PlainExtractor`) writes the engine's bytes
        straight into the staging buffer, a tensor-parallel gather
        (:class:`~colo.extractors.megatron.MegatronExtractor`, on any device) gathers
        there: neither a buffer of converted or gathered tensors to allocate (a
        cudaMalloc after every trainer offload) nor a pack copy (one copy-engine pass,
        slow while the driver clears a released KV pool). The views are made once per
        slot and bucket layout."""
        if self.align != PADDED or not getattr(extractor, "extracts_into", False):
            return None
        device = getattr(extractor, "upload_to", None) or getattr(extractor, "device", None) \
            or getattr(extractor, "source_device", None)
        if device is None or (torch.device(device).type != "cuda" and not hasattr(extractor, "extract_range")):
            return None
        s = self._slot(slot, ctx, torch.device(device))
        laid = self._layout[bucket.index]
        key = (id(s), bucket.index)
        held = self._dests.get(key)
        if held is not None and held[0] is laid and held[1] is s:
            return held[2]
        plan = self._view_plans.get(bucket.index)
        if plan is None or plan[0] is not laid:
            plan = self._view_plans[bucket.index] = (laid, view_plan(laid))
        views = slot_views(s.tensor, plan[1])
        self._dests[key] = (laid, s, views)
        return views

    def _slot(self, i: int, ctx: SyncContext, device: Any) -> _Slot:
        device = canonical_device(device)  # "cuda" and "cuda:0" are one GPU
        s = self._slots[i]
        if s is not None and s.device != device:
            raise RuntimeError(f"packed: staging slot {i} is on {s.device}, this bucket's tensors on {device}")
        if s is None:
            limit = self.keep_staging_bytes
            if limit is None:
                limit = KEEP_STAGING_BYTES if device.type == "cuda" else 0
            kept = 2 * self._cap <= limit
            self._slots[i] = s = _Slot(self._cap, ctx, device, kept=kept)
            self._cuda = self._cuda or device.type == "cuda"
        elif not s.staged.counted:  # kept from the last sync
            s.counted_in(ctx)
        return s

    async def _pack(self, bucket: Bucket, tensors: list[tuple[str, Any]], slot: int, ctx: SyncContext) -> None:
        # The buffer lives where the extractor put the tensors, or on the device
        # the extractor names as its upload target (a pinned host source packed
        # directly into device memory).
        target = getattr(self._extractor, "upload_to", None)
        device = torch.device(target) if target is not None else tensors[0][1].device
        s = self._slot(slot, ctx, device)
        t0 = time.perf_counter()
        laid = self._layout[bucket.index]
        stream = self._upload_stream(device)
        # every tensor the slot's own view at its entry (gathered in place): nothing to copy
        dests = self._dests.get((id(s), bucket.index))
        in_place = dests is not None and dests[1] is s and len(dests[2]) == len(tensors) == len(laid.entries) \
            and all(dests[2].get(name if e.whole else (name, e.offset)) is t
                    for (name, t), e in zip(tensors, laid.entries))
        if self._inline or in_place:
            # (gathered in place: nothing to copy, only an event to record; a hop to a worker
            # thread and back for that was about 0.3 ms of every bucket of a TP=2 sync)
            done = queue_pack(s.tensor, laid, tensors, stream, in_place=in_place)
        elif self.pipelined:
            done = await anyio.to_thread.run_sync(functools.partial(queue_pack, in_place=in_place),
                                                  s.tensor, laid, tensors, stream)
        else:
            # serial (slime's way): nothing is queued behind this bucket, so it is
            # waited for where it was queued, in one thread hop
            done = await anyio.to_thread.run_sync(pack_and_settle, s.tensor, laid, tensors, stream)
        if done is None:
            ctx.record(bucket.index, "pack", bucket.payload_bytes, len(tensors), time.perf_counter() - t0)
        else:
            # queued on the upload stream: the handoff waits for it (and records pack)
            s.pending = (done, t0)

    async def _settle(self, bucket: Bucket, s: _Slot, ctx: SyncContext) -> None:
        """Wait until the slot's queued copies are done (a host wait on the upload
        stream's event, off the event loop); ``pack`` spans queueing to done."""
        if s.pending is None:
            return
        done, t0 = s.pending
        # gathered in a thread (not inline), the next bucket's gather may run beside this
        # wait: no polling, which would hold the interpreter from it (wait_event)
        await wait_event(done, poll_s=EVENT_POLL_S if self._inline else 0.0)
        s.pending = None
        ctx.record(bucket.index, "pack", bucket.payload_bytes, len(bucket.entries), time.perf_counter() - t0)

    async def _handoff(self, engine: Any, bucket: Bucket, slot: int, ctx: SyncContext) -> None:
        s = self._slots[slot]
        # the engine reads the buffer from another process, outside our stream
        # order: the bytes must be there before the handle goes out
        await self._settle(bucket, s, ctx)
        await self._load(engine, bucket, self._layout[bucket.index], s.handle(), ctx)

    async def _load(self, engine: Any, bucket: Bucket, laid: Bucket, handle: dict, ctx: SyncContext) -> None:
        """One load request: ``handle`` and where each tensor of ``bucket`` lies in it
        (``laid``), or only the layout's key once the engine holds it."""
        on_sent, on_ack = timed_ack(ctx, bucket, len(bucket.entries))
        fields, key = self._memo.fields(engine, laid)
        end = self._end_of(bucket, ctx)
        try:
            reply = await engine.transport_load(self.name, {"handle": handle, **fields}, on_sent=on_sent, **end)
        except Exception as e:
            # the engine lost the layout (its receiver was rebuilt): it refused before
            # reading a byte (or opening the handle), so the same bucket goes again, with its tensors
            if "tensors" in fields or not is_layout_not_cached(e):
                raise
            fields, key = self._memo.fields(engine, laid, full=True)
            reply = await engine.transport_load(self.name, {"handle": handle, **fields}, on_sent=on_sent, **end)
        self._memo.acked(bucket.index, key)
        self._loaded(reply)
        on_ack(reply)

    def _cleanup(self) -> None:
        if self._stream is not None:
            # copies a failed sync queued may still be writing a slot (or reading
            # the trainer's tensors): they finish before the memory goes back
            self._stream.synchronize()
        # Small staging stays allocated and exported from sync to sync: the next sync
        # allocates nothing (the trainer's offload empties the allocator's cache, so
        # every sync paid cudaMalloc and a new IPC handle that the engine opened and
        # closed again: a few ms of a small model's sync). Reused only from the next
        # sync's first bucket on, after this sync's every acknowledgement.
        self._close_slots(keep_kept=True)

    def _close_slots(self, *, keep_kept: bool) -> None:
        for i, s in enumerate(self._slots):
            if s is None:
                continue
            if keep_kept and s.kept:
                s.uncount()
            else:
                s.close()
                self._slots[i] = None
        self._dests = {k: v for k, v in self._dests.items() if v[1] in self._slots}
        if self._cuda and not any(s is not None for s in self._slots):
            # the engine closed its mappings at end_load (or drop_handles);
            # without collecting, every sync leaks the exported blocks
            torch.cuda.ipc_collect()
            self._cuda = False

    async def _free_kept(self) -> None:
        """Free the kept slots: the engine lets go of its mappings first (a block the
        engine still maps is not returned to the device, only parked)."""
        if any(s is not None for s in self._slots) or self._engine_keeps:
            await super().abort()  # the engine's drop_handles, bounded; a dead engine holds nothing
            self._engine_keeps = False
            self._close_slots(keep_kept=False)

    async def abort(self) -> None:
        await super().abort()  # the engine drops every mapping, the kept ones too
        with anyio.CancelScope(shield=True):
            self._engine_keeps = False
            self._close_slots(keep_kept=False)

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            await self._free_kept()
        await super().aclose()


def view_plan(laid: Bucket) -> tuple[tuple[Any, torch.dtype, tuple[int, ...], tuple[int, ...], int], ...]:
    """``(key, dtype, shape, strides, element offset)`` of each entry's view of a slot laid
    out as ``laid`` (a whole tensor typed and shaped; a piece, its bytes): worked out once
    per layout (:meth:`PackedTransport._destinations` keeps it while the sync's layout is
    the same object, which it is sync after sync: :meth:`BucketSender._buckets`)."""
    plan = []
    for e in laid.entries:
        if e.whole:
            dtype, shape = getattr(torch, e.spec.dtype), e.spec.shape
            key: Any = e.spec.name
        else:
            dtype, shape, key = torch.uint8, (e.nbytes,), (e.spec.name, e.offset)
        shape = tuple(int(d) for d in shape)
        plan.append((key, dtype, shape, contiguous_strides(shape), e.start // dtype.itemsize))
    return tuple(plan)


def slot_views(flat: torch.Tensor, plan: Any) -> dict:
    """The views of ``plan`` (:func:`view_plan`) into ``flat`` (a slot's uint8 bytes): one
    ``as_strided`` each from the slot viewed once per dtype. Why: a slice and two views
    per tensor (1,017 view ops for Qwen2-7B's 339 tensors) on the event loop before every
    bucket's gather, rebuilt at every sync whose slots are not kept (on a GPU, buckets over
    32 MiB: :data:`KEEP_STAGING_BYTES`); the same views: contiguous, at the entry's bytes."""
    typed: dict = {}
    views: dict = {}
    for key, dtype, shape, strides, at in plan:
        base = typed.get(dtype)
        if base is None:
            size = dtype.itemsize
            base = typed[dtype] = flat if size == 1 else flat[:flat.numel() // size * size].view(dtype)
        views[key] = base.as_strided(shape, strides, base.storage_offset() + at)
    return views


def one_copy_bucket(flat: Any, extractor: Any) -> Bucket | None:
    """The sync as one bucket laid out by the trainer's flat buffer (or, paused, by
    its shared host backup: ``flat.readable()``), or None when some tensor the
    extractor yields is not a view of it (converted, gathered, a private host
    copy): then the sync is packed.

    A view need not be contiguous: an entry then carries its strides (``Entry.view``)
    and the engine copies it out as it lies. An extractor that cuts fused sources
    (:class:`~colo.extractors.megatron.MegatronExtractor`: q, k and v of a fused QKV,
    rows interleaved per query group) says where each output lies through
    ``source_views(names)``: each output as a view of its source, in a shape whose
    row-major elements are the output's, or None where it is not one. Its ``extract``
    must give the output in its own shape, which for q of several query groups no view
    has: it copies, and a sync walked through it would always be packed (Megatron's
    ``sync-first`` at Qwen2-7B on an H200: 67.3 ms packed in 32 buckets, 9.4x one
    device copy, where the hf trainer's one copy took 16.2; issue 44).

    The extractor is walked lazily and left at the first tensor that does not
    fit, so a sync that falls back converts one tensor here, not the model.
    Only single-rank extractors get here (a trainer with flat weights), so
    leaving the walk early skips no other rank's collective."""
    specs = list(extractor.specs())
    if not specs:
        return None  # the packed path says why an empty model cannot be synced
    entries = []
    names = [s.name for s in specs]
    source_views = getattr(extractor, "source_views", None)
    gen = source_views(names) if source_views is not None else extractor.extract(names)
    try:
        for s, (name, t) in zip(specs, gen):
            if (not isinstance(t, torch.Tensor) or name != s.name or str(t.dtype).removeprefix("torch.") != s.dtype
                    or t.numel() != math.prod(s.shape)
                    or (source_views is None and tuple(t.shape) != s.shape)):
                return None
            if t.is_contiguous():  # row-major: its bytes, whatever shape the view has
                where = flat.locate(t)
                if where is None:
                    return None
                entries.append(Entry(s, where[0], where[1]))
                continue
            at = flat.locate_view(t)
            if at is None:
                return None
            entries.append(Entry(s, at[0], at[1], 0, (tuple(int(d) for d in t.shape), at[2])))
    finally:
        close = getattr(gen, "close", None)
        if close is not None:
            close()
    if len(entries) != len(specs):
        return None
    return Bucket(0, tuple(entries), flat.nbytes)


class PackedReceiver:
    """Opens each bucket's segment (kept open: the sender reuses two) and views it."""

    def __init__(self) -> None:
        self._attached: dict[str, Any] = {}
        #: keys of attachments whose sender keeps the buffer across syncs
        self._kept: set[str] = set()
        #: kept attachment key -> (the attachment, the layout, its views)
        self._views: dict[str, tuple[Any, Any, list]] = {}
        #: bucket layouts, kept across syncs (``release`` at each end_load keeps them)
        self.layouts = LayoutCache()

    @staticmethod
    def _key(handle: dict) -> str | None:
        """What names one buffer. A CUDA IPC handle names the allocator's whole
        segment: two staging buffers carved from one cached segment share it and
        differ only in their offsets, so the offsets belong to the key. (Seen on
        an H100: after a training step the allocator put both slots in one
        segment, and a cache keyed by the handle alone read bucket i+1 from
        bucket i's buffer.)"""
        name = handle.get("name") or handle.get("handle")
        if not isinstance(name, str):
            return None
        return "|".join(str(handle.get(k)) for k in ("kind", "storage_offset", "tensor_offset", "nbytes")) + "|" + name

    def _attach(self, handle: dict) -> Any:
        name = self._key(handle)
        seg = self._attached.get(name) if name is not None else None
        if seg is None or getattr(seg, "nbytes", None) != handle.get("nbytes"):
            if seg is not None:
                seg.close()
            seg = open_handle(handle)
            if name is not None:
                self._attached[name] = seg
                if handle.get("keep") is True:
                    self._kept.add(name)
                while len(self._attached) > MAX_ATTACHED:
                    old = next(iter(self._attached))
                    self._kept.discard(old)
                    self._views.pop(old, None)
                    self._attached.pop(old).close()
        return seg

    @contextlib.contextmanager
    def receive(self, request: Any) -> Iterator[list[tuple[str, Any]]]:
        req = request if isinstance(request, PackedRequest) else self._parse(request)
        if req.handle.get("kind") in ("cuda_ipc", "pinned_shm"):
            import colo.device.cuda_ipc  # noqa: F401  registers the cuda_ipc and pinned_shm rebuilders
        seg = self._attach(req.handle)
        # Views into the sender's buffer: valid until the ack, which the server
        # sends only after the loader copied them into the parameters.
        yield self._views_of(seg, req)

    def _views_of(self, seg: Any, req: PackedRequest) -> list[tuple[str, Any]]:
        """The request's views of ``seg``; for a buffer its sender keeps, made once per
        layout and kept with the mapping (the same buffer, the same layout, sync after
        sync: a view per tensor was a few hundred microseconds of a small sync)."""
        name = self._key(req.handle)
        if name is None or name not in self._kept:
            return views(seg.tensor, req.tensors)
        held = self._views.get(name)
        if held is not None and held[0] is seg and (held[1] is req.tensors or held[1] == req.tensors):
            return held[2]
        made = views(seg.tensor, req.tensors)
        self._views[name] = (seg, req.tensors, made)
        return made

    def _parse(self, d: Any) -> PackedRequest:
        if not isinstance(d, dict) or not isinstance(d.get("handle"), dict):
            raise RequestError("packed request must be a JSON object with a 'handle' object and "
                               "'tensors' or a cached 'layout'")
        nbytes = d["handle"].get("nbytes")
        return PackedRequest(d["handle"], self.layouts.resolve(
            d, "packed request", buffer_nbytes=nbytes if isinstance(nbytes, int) else None))

    def release(self, *, kept: bool = False) -> None:
        """Close this sync's mappings; a buffer its sender keeps across syncs stays
        mapped (reopening it costs each sync an IPC open and close) unless ``kept``."""
        for name in [n for n in self._attached if kept or n not in self._kept]:
            self._views.pop(name, None)  # the views first: a mapping with views left cannot close
            self._kept.discard(name)
            self._attached.pop(name).close()

    def close(self) -> None:
        self.release(kept=True)
        self.layouts.clear()


class PackedStrategy:
    name = "packed"
    request_type = PackedRequest
    init_info_type = EmptyInitInfo

    def create_init_info(self) -> EmptyInitInfo:
        return EmptyInitInfo()

    def create_sender(self, **options: Any) -> PackedTransport:
        return PackedTransport(**options)

    def create_receiver(self, init_info: EmptyInitInfo, *, device: Any = None) -> PackedReceiver:
        return PackedReceiver()


STRATEGY = PackedStrategy()
