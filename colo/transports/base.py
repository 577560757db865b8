"""What every transport shares: the seed's Strategy / Sender / Receiver split, kept small.

A transport is one module with

- an init-info dataclass (what the engine must know once, e.g. a process
  group's endpoint or a checkpoint root),
- a request dataclass (what travels per bucket: metadata and handles, plain
  JSON both ways — ``to_json()`` / ``from_json()``; never a pickle),
- the trainer-side sender (``name``, ``sync``, ``abort``, ``aclose``: the
  ``Transport`` the scheduler drives),
- the engine-side receiver (``receive(request)`` is a context manager that
  yields ``(name, tensor)`` pairs valid until it exits; ``release()`` drops
  per-sync resources, ``release(kept=True)`` also what the sender keeps from
  sync to sync; ``close()`` drops everything),
- a strategy (``STRATEGY``) that ties them together: ``create_init_info``,
  ``create_sender``, ``create_receiver``, ``request_type``, ``init_info_type``.

:class:`BucketSender` runs the part every sender has in common: preflight
before the first byte, the bucket plan, the two-slot pipeline (bucket i+1 is
gathered and packed while bucket i is handed off and loaded), and shielded
cleanup. Subclasses fill in ``_pack`` and ``_handoff``.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import anyio
import anyio.to_thread
import torch

from colo.core.buckets import Bucket, plan_buckets
from colo.device import canonical_device
from colo.core.interfaces import SyncContext, SyncResult  # noqa: F401
from colo.transports.wire import (EmptyInitInfo, RequestError, TensorMeta, get_field, parse_tensors,  # noqa: F401
                                  views)


# -- the split ------------------------------------------------------------------

class Receiver(Protocol):
    """Engine side: turns one request into ``(name, tensor)`` pairs for the loader."""

    def receive(self, request: Any) -> AbstractContextManager[list[tuple[str, Any]]]: ...
    def release(self, *, kept: bool = False) -> None: ...
    def close(self) -> None: ...


class Strategy(Protocol):
    name: str
    request_type: type
    init_info_type: type

    def create_init_info(self, **kwargs: Any) -> Any: ...
    def create_sender(self, **options: Any) -> Any: ...
    def create_receiver(self, init_info: Any, *, device: Any) -> Receiver: ...


# -- the sender's common part -------------------------------------------------------

def check_bucket_tensors(bucket: Bucket, tensors: Sequence[tuple[str, Any]], upload_to: Any = None) -> None:
    """The extractor must hand exactly the planned tensors: the bytes go to planned offsets.

    ``tensors`` holds one whole tensor per entry, a piece's tensor included
    (the sender cuts the piece's bytes out of it), or for a piece the extractor
    gathered by range, that piece's own bytes (:func:`is_piece`). ``upload_to``: the device of the
    buffer they go to, where host tensors are uploaded straight into it (an extractor's
    ``upload_to``): then host tensors may lie beside tensors already there."""
    if len(tensors) != len(bucket.entries):
        raise ValueError(f"bucket {bucket.index}: extractor gave {len(tensors)} tensors, "
                         f"planned {len(bucket.entries)}")
    # the distinct devices first (a bucket's tensors share one or two): canonicalising
    # every tensor's was most of this check's time, repeated at every bucket
    devices = {str(canonical_device(d)) for d in {t.device for _, t in tensors}}
    if upload_to is not None and devices == {"cpu", str(canonical_device(upload_to))}:
        devices = {"cpu"}  # the host's tensors are uploaded into the buffer beside the device's
    # One bucket is one buffer on one device: a tensor elsewhere (another GPU,
    # the meta device that holds no data) cannot be packed with the rest.
    if "meta" in devices or len(devices) > 1:
        where = ", ".join(f"{n} on {t.device}" for n, t in tensors)
        raise ValueError(f"bucket {bucket.index}: tensors must be on one device with data, got {where}")
    for (name, t), e in zip(tensors, bucket.entries):
        if name != e.spec.name:
            raise ValueError(f"bucket {bucket.index}: extractor gave {name!r} where {e.spec.name!r} was planned")
        if is_piece(t, e):
            continue  # the piece's own bytes (gathered by range): nothing left to cut
        if str(t.dtype).removeprefix("torch.") != e.spec.dtype or tuple(t.shape) != e.spec.shape:
            raise ValueError(f"{name}: extractor gave {tuple(t.shape)} {t.dtype}, "
                             f"planned {e.spec.shape} {e.spec.dtype}")


def is_piece(t: Any, e: Any) -> bool:
    """Whether ``t`` is entry ``e``'s own bytes (a flat uint8 tensor of exactly the piece,
    as :func:`extract_bucket` gathers a ranged piece), not the tensor it is cut from.
    Never ambiguous: a piece is shorter than its tensor."""
    return (not e.whole and t.dtype == torch.uint8 and t.dim() == 1 and t.numel() == e.nbytes
            and e.nbytes < e.spec.nbytes)


def extract_bucket(extractor: Any, bucket: Bucket, into: Any = None) -> tuple[list[tuple[str, Any]], dict]:
    """One bucket's collectives and tensors: ``(whole tensors by the extractor, pieces)``.

    Pieces of a tensor the extractor gathers by range (``ranged(name)``, a
    tensor-parallel tensor cut on its rows) are gathered one by one, each its own
    bytes (into ``into[(name, offset)]`` when the transport gave that view of its
    slot), keyed ``(name, offset)``; then the other tensors whose first bytes are
    here, by one ``extract(names[, into])``. Every rank of a trainer runs this
    for the same buckets in the same order, the sender and a failed rank's drain
    (``colo.ranks.host``) alike, so their collectives line up."""
    ranged = getattr(extractor, "ranged", None)
    cut = [e for e in bucket.entries if not e.whole and ranged is not None and ranged(e.spec.name)]
    skip = {e.spec.name for e in cut}
    pieces = {}
    for e in cut:
        out = into.get((e.spec.name, e.offset)) if into else None
        pieces[(e.spec.name, e.offset)] = extractor.extract_range(e.spec.name, e.offset, e.nbytes, out)
    names = [n for n in bucket.extract_names if n not in skip]
    fresh = list(extractor.extract(names) if into is None else extractor.extract(names, into))
    if [n for n, _ in fresh] != names:
        raise ValueError(f"bucket {bucket.index}: extractor gave {[n for n, _ in fresh]}, asked for {names}")
    return fresh, pieces


def raise_first_real(group: BaseExceptionGroup) -> None:
    """One side of a pipelined step failed and the other was cancelled: the caller
    should see the failure (an OOM, an engine error), not a group."""
    real = [e for e in group.exceptions if not isinstance(e, anyio.get_cancelled_exc_class())]
    if len(real) == 1:
        raise real[0] from None
    raise group


class Staged:
    """Bytes a transport holds for the sync, counted against the device budget.

    Counted before the memory exists, so an OOM is raised before allocating;
    ``free()`` is idempotent so shielded cleanup can call it on anything.
    """

    def __init__(self, ctx: SyncContext, nbytes: int):
        self._ctx = ctx
        self.nbytes = nbytes
        self._sid: int | None = ctx.staging.alloc(nbytes)

    @property
    def counted(self) -> bool:
        """Still in the budget (not freed)."""
        return self._sid is not None

    def free(self) -> None:
        if self._sid is not None:
            sid, self._sid = self._sid, None
            self._ctx.staging.free(sid)


class BucketSender:
    """Preflight, plan, two-slot pipeline, cleanup; subclasses move the bytes.

    ``_pack(bucket, tensors, slot, ctx)`` puts one gathered bucket into slot
    ``slot`` (0 or 1); ``_handoff(bucket, slot, ctx)`` hands it to the engine
    and returns once the engine acknowledged the load. A slot is packed again
    only after the handoff of the bucket it held returned: the engine may read
    a slot until it acknowledges, and overwriting it earlier corrupts weights.
    """

    name = "?"

    def __init__(self, *, pipelined: bool = True):
        if not isinstance(pipelined, bool):
            raise ValueError(f"pipelined must be a bool, got {pipelined!r}")
        self.pipelined = pipelined
        self._engine: Any = None
        self._extractor: Any = None
        self._stream: Any = None
        #: tensors cut into pieces whose last piece is not packed yet: extracted once,
        #: in the bucket of their first piece, and cut from in the later ones
        self._carry: dict[str, Any] = {}
        #: (specs, bucket_bytes, buckets) of the last sync
        self._plan_cache: tuple[list, int, list[Bucket]] | None = None
        #: gather and pack on the event loop (one or small buckets on a GPU), not in a thread
        self._inline = False
        #: this sync's last bucket, and whether its load request ended the load
        self._last_bucket = -1
        self._ended = False

    #: the sync's last load request carries its end (the transport passes ``_end_of``'s
    #: keywords to ``transport_load`` and its reply to ``_loaded``)
    ends_on_last_load = False
    #: its requests say which tensors are one engine rank's slice (``TensorSpec.rank_slice``,
    #: the wire's ``rank_slice``); a transport that does not would hand a slice to the engine
    #: as a whole tensor of the slice's shape, so :meth:`sync` refuses such specs first
    carries_rank_slices = False

    # -- hooks ---------------------------------------------------------------
    async def _begin(self, engine: Any, ctx: SyncContext, buckets: list[Bucket]) -> None:
        """After preflight, before ``begin_load``: per-sync setup (a tmp dir, a group)."""

    def _began(self, ctx: SyncContext) -> None:
        """After the engine's ``begin_load`` returned (an engine's own session is open)."""

    async def _pack(self, bucket: Bucket, tensors: list[tuple[str, Any]], slot: int, ctx: SyncContext) -> None:
        raise NotImplementedError

    def _destinations(self, extractor: Any, bucket: Bucket, slot: int, ctx: SyncContext) -> dict | None:
        """Where in slot ``slot`` each whole tensor of ``bucket`` goes, for an extractor
        that can write its results there itself (``extract(names, into)``); None: the
        extractor makes its own tensors and ``_pack`` copies them."""
        return None

    async def _handoff(self, engine: Any, bucket: Bucket, slot: int, ctx: SyncContext) -> None:
        raise NotImplementedError

    async def _commit(self, ctx: SyncContext, buckets: list[Bucket]) -> None:
        """After the engine's ``end_load`` accepted the whole sync."""

    def _cleanup(self) -> None:
        """Shielded, after every sync, success or not: free every slot."""

    # -- the sync --------------------------------------------------------------
    async def sync(self, trainer: Any, engine: Any, ctx: SyncContext) -> SyncResult:
        extractor = trainer.extractor()
        specs = list(extractor.specs())
        if not specs:
            raise ValueError("the trainer has no parameters to sync (empty model)")
        buckets = self._buckets(specs, ctx.bucket_bytes)
        self._engine = engine
        self._carry = {}
        # On a GPU a gather and a pack only queue device work. For one bucket there is
        # nothing to overlap them with, and a small bucket's take a fraction of a
        # millisecond of host time, less than the hop to a worker thread and back
        # (about 0.3 ms on an H100 host) that would keep the event loop free to read
        # the previous bucket's acknowledgement meanwhile: a small model's sync is
        # mostly such fixed costs (issue 18). Large buckets keep the hop.
        self._inline = _gpu_process() and (len(buckets) == 1 or max(b.nbytes for b in buckets) <= INLINE_BYTES)
        sliced = [s.name for s in specs if s.rank_slice is not None]
        if sliced and not self.carries_rank_slices:
            raise ValueError(f"transport {self.name!r} cannot carry tensors cut for one engine rank "
                             f"({len(sliced)} of them, e.g. {sliced[0]!r}): use 'packed', or extract "
                             f"them whole")
        # The engine checks every name, shape and dtype before the first byte moves: the
        # whole tensors' (a rank's slice is checked against what the rank holds as it loads)
        await engine.preflight([s.whole() for s in specs] if sliced else specs)
        self._last_bucket, self._ended = buckets[-1].index, False
        try:
            await self._begin(engine, ctx, buckets)
            await engine.begin_load()
            self._began(ctx)
            await pipeline(buckets, lambda b, s: self._prepare(extractor, b, s, ctx),
                           lambda b, s: self._handoff(engine, b, s, ctx), pipelined=self.pipelined)
            await self._end_load(engine, ctx)
            await self._commit(ctx, buckets)
        finally:
            with anyio.CancelScope(shield=True):
                self._carry = {}
                self._cleanup()
        return ctx.result(bytes=sum(b.payload_bytes for b in buckets), buckets=len(buckets), tensors=len(specs),
                          cache_flushed=ctx.flush_cache)

    def _end_of(self, bucket: Bucket, ctx: SyncContext) -> dict:
        """``transport_load``'s keywords for ``bucket``: the sync's last load request ends the
        load too, and flushes the prefix cache where the scheduler asked. Each was a round
        trip of its own, 0.5 ms of a 5 ms sync on an H100 (issue 18). Every earlier bucket
        was acknowledged before the last one's handoff begins (``pipeline``), so the end
        still comes after every load."""
        if not self.ends_on_last_load or bucket.index != self._last_bucket:
            return {}
        return {"end": True, "flush_cache": ctx.flush_cache}

    async def _end_load(self, engine: Any, ctx: SyncContext) -> None:
        """The load's end (with the flush where asked), unless the last load request carried it."""
        if not self._ended:
            await engine.end_load(flush_cache=ctx.flush_cache)

    def _loaded(self, reply: dict) -> None:
        """Note a load's reply: one that ended the load leaves nothing for ``end_load``."""
        if reply.get("ended") is True:
            self._ended = True

    def _buckets(self, specs: list, bucket_bytes: int) -> list[Bucket]:
        """The plan, made again only when the specs or the bucket size changed: the same
        model sync after sync has the same plan (NeMo-RL caches its metadata too; a
        7B plan is about 1 ms of Python before the first byte, issue 18). The specs
        are compared whole, so any change of a name, shape or dtype plans afresh."""
        cached = self._plan_cache
        if cached is not None and cached[1] == bucket_bytes and cached[0] == specs:
            return cached[2]
        buckets = plan_buckets(specs, bucket_bytes)
        self._plan_cache = (list(specs), bucket_bytes, buckets)
        return buckets

    async def _prepare(self, extractor: Any, bucket: Bucket, slot: int, ctx: SyncContext) -> None:
        self._extractor = extractor
        names = bucket.extract_names
        t0 = time.perf_counter()
        # Off the event loop: the engine's acknowledgement of the previous
        # bucket must be read while this one is being gathered and packed.
        stream = self._upload_stream(getattr(extractor, "device", None))
        into = self._destinations(extractor, bucket, slot, ctx)

        def gather() -> tuple[list, dict]:
            if stream is None:
                return extract_bucket(extractor, bucket, into)
            # Uploads and conversions of bucket i+1 run on the sender's own
            # stream, while the engine loads bucket i; pack follows on the same
            # stream, so it sees them in order.
            with torch.cuda.stream(stream):
                # after what the trainer queued on the default stream (an optimizer
                # step, a weight update): a side stream does not wait for it by itself,
                # and a gather could read the weights half-written
                stream.wait_stream(torch.cuda.default_stream(stream.device))
                return extract_bucket(extractor, bucket, into)

        fresh, pieces = gather() if self._inline else await anyio.to_thread.run_sync(gather)
        ctx.record(bucket.index, "gather", bucket.payload_bytes, len(names), time.perf_counter() - t0)
        tensors = self._with_carried(bucket, fresh, pieces)
        check_bucket_tensors(bucket, tensors, getattr(extractor, "upload_to", None))
        await self._pack(bucket, tensors, slot, ctx)

    def _with_carried(self, bucket: Bucket, fresh: list[tuple[str, Any]],
                      pieces: dict | None = None) -> list[tuple[str, Any]]:
        """One tensor per entry: the extracted ones; a piece gathered by range, its own
        bytes; and for a piece after the first the tensor extracted in its first
        piece's bucket (held until its last piece is packed; a pinned host tensor when
        the source is the host copy, so holding it costs no device memory)."""
        got = dict(fresh)
        pieces = pieces or {}
        out = []
        for e in bucket.entries:
            name = e.spec.name
            piece = pieces.get((name, e.offset))
            if piece is not None:
                out.append((name, piece))
                continue
            t = got[name] if e.first else self._carry.get(name)
            if t is None:  # the plan's order guarantees it: a bug, not bad input
                raise RuntimeError(f"bucket {bucket.index}: piece of {name!r} at byte {e.offset} "
                                   f"has no tensor carried from its first piece")
            if e.last:
                self._carry.pop(name, None)
            else:
                self._carry[name] = t
            out.append((name, t))
        return out

    def _upload_stream(self, device: Any) -> Any:
        """The sender's CUDA stream for uploads and packing (None off the GPU)."""
        if device is None or torch.device(device).type != "cuda":
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=torch.device(device))
        return self._stream

    async def abort(self) -> None:
        # The engine may still map our (now unlinked) buffers: make it let go
        # so the memory really returns.
        if self._engine is not None:
            with anyio.move_on_after(5):
                try:
                    await self._engine.drop_handles()
                except Exception:
                    pass

    async def aclose(self) -> None:
        """Release what outlives a sync (a process group, a temporary root)."""


def _gpu_process() -> bool:
    """This process drives a GPU (its CUDA context exists: device work is queued, not
    done) and no other rank: a rank's gather takes part in collectives with the others,
    which stay off the event loop as they were measured on two GPUs."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return False
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


#: a bucket this small is gathered and packed on the event loop, on a GPU
INLINE_BYTES = 32 << 20

#: how long a sender polls a CUDA event from the event loop before it waits in a
#: thread: a small bucket's copies finish within it, and a poll costs microseconds
#: where a hop to a worker thread and back costs about 0.3 ms
EVENT_POLL_S = 1e-3


async def wait_event(done: Any, *, poll_s: float = EVENT_POLL_S) -> None:
    """Until CUDA event ``done`` has completed: polled for up to ``poll_s``, then waited
    for in a worker thread (never blocking the event loop, which reads the engine's acks).

    ``poll_s=0`` where another thread works beside the event loop (a pipelined sender's
    gather of the next bucket): polling runs the event loop without a pause, and a
    thread that releases the interpreter around every short C call (each torch op and
    collective) waits to get it back for as long as the poll lasts. On the CPU, 20,000
    small in-place torch ops took 2.3x as long in a thread beside an ``anyio.sleep(0)``
    poll as alone, and as long as alone beside a poll that sleeps 1 ms."""
    deadline = time.perf_counter() + poll_s
    while not done.query():
        if time.perf_counter() >= deadline:
            await anyio.to_thread.run_sync(done.synchronize)
            return
        await anyio.sleep(0)


async def pipeline(buckets: Sequence[Bucket], prepare: Callable[[Bucket, int], Awaitable[None]],
                   handoff: Callable[[Bucket, int], Awaitable[None]], *, pipelined: bool = True) -> None:
    """prepare(0); then handoff(i) alongside prepare(i+1), slot = index % 2.

    prepare(i+2) reuses the slot of bucket i and starts only after handoff(i)
    returned, i.e. after the engine acknowledged bucket i.
    """
    await prepare(buckets[0], 0)
    for i, bucket in enumerate(buckets):
        nxt = buckets[i + 1] if i + 1 < len(buckets) else None
        if pipelined and nxt is not None:
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(handoff, bucket, i % 2)
                    await prepare(nxt, (i + 1) % 2)
            except BaseExceptionGroup as group:
                raise_first_real(group)
        else:
            await handoff(bucket, i % 2)
            if nxt is not None:
                await prepare(nxt, (i + 1) % 2)


def timed_ack(ctx: SyncContext, bucket: Bucket, n: int) -> tuple[Callable[[], None], Callable[[dict], None]]:
    """``on_sent`` and ``on_ack`` callbacks recording handoff (until the request is
    on the wire: where the engine's load begins) and load (until the ack)."""
    t0 = time.perf_counter()
    sent = [t0]
    recorded = [False]

    def on_sent() -> None:
        sent[0] = time.perf_counter()
        if not recorded[0]:  # a request sent again (a layout the engine lost) is one handoff
            recorded[0] = True
            ctx.record(bucket.index, "handoff", bucket.payload_bytes, n, sent[0] - t0)

    def on_ack(reply: dict) -> None:
        # the engine counts the tensors this load completed (a piece before the
        # last completes none), so a sync's loads add up to its tensors
        ctx.record(bucket.index, "load", bucket.payload_bytes, reply.get("tensors", bucket.completed),
                   time.perf_counter() - sent[0])
        for key, value in reply.items():
            if key.endswith("_s") and isinstance(value, float):
                ctx.engine_s[key] = ctx.engine_s.get(key, 0.0) + value

    return on_sent, on_ack


__all__ = ["BucketSender", "EmptyInitInfo", "Receiver", "RequestError", "Staged", "Strategy", "TensorMeta",
           "check_bucket_tensors", "extract_bucket", "is_piece", "parse_tensors", "pipeline", "raise_first_real",
           "timed_ack", "views", "wait_event"]
