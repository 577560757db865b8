"""``rdt``: Ray Direct Transport, from a trainer rank's Ray actor to its engine actor.

Under ``--launcher ray`` rank r is two actors on one placement-group bundle: the
rank actor (trainer rank r, this sender) and its engine actor (engine rank r).
Here each bucket goes from one to the other as a Ray object whose tensors travel
out of band, actor to actor, never through the object store nor a ``/dev/shm``
handle (Ray Direct Transport, Ray >= 2.60, ``ray.experimental.rdt``):

1. the bucket is packed into a staging slot of this actor, as ``packed`` packs it;
2. the sender asks its own actor for the slot as the return value of an actor task
   run with ``.options(tensor_transport=...)`` (:data:`SOURCE_METHOD`, on a
   concurrency group of its own: the actor's main group is busy running this
   sync). Ray keeps the returned tensor in the actor's RDT store and hands back a
   ref; a one-sided transport (CUDA IPC) takes ``ray.put(..., _tensor_transport=...)``;
3. the load request goes to the engine actor with that ref beside its JSON frame
   (:class:`colo.ranks.ray_launcher.TensorEngineActor`); Ray, in this process (the
   ref's owner), has the two actors' ``_ray_system`` threads send and receive the
   tensor over the transport before the engine's task runs, and the task gets the
   tensor itself. :func:`arrived` hands it to :class:`RdtReceiver`, which views it
   by the request's metadata, as every receiver does, and the engine loads it;
4. the reply acknowledges the load: the slot may be packed again (two slots, as
   ``packed``). The ref is dropped; Ray frees its entry in the RDT store.

Why colo registers transports of its own with Ray instead of using Ray's ``gloo``
and ``nccl`` (read in Ray 2.60's source, ``ray/util/collective/collective_group/
torch_gloo_collective_group.py`` and ``ray/experimental/rdt/rdt_manager.py``):

- Ray's GLOO collective group *is* the process's default ``torch.distributed``
  group: it initialises it when there is none, and otherwise calls
  ``dist.new_group`` over whatever default group exists. A rank actor's default
  group is the trainer's N-rank world and an engine actor's is the engine's TP
  group, so Ray's "pair" would be trainer rank 0 with trainer rank 1.
- Ray's collective and CUDA IPC transports say ``can_abort_transport() == False``,
  and on a failed or timed-out transfer Ray then ``ray.kill``\\ s both actors: an
  engine actor that dies mid-sync would take the trainer rank (its weights and
  optimizer, which exist nowhere else) with it. colo's sync must fail safe.

So :class:`ColoGlooTransport` (the CPU, tested) and :class:`ColoNcclTransport`
move the tensors over a two-member group of colo's own between the rank actor
(rank 0) and its engine actor (rank 1), built from a ``TCPStore`` like
``broadcast``'s and never the default group, and can abort (Ray then asks both
actors to abort the group, which ends a pending send or receive, and kills
neither). :class:`ColoCudaIpcTransport` is Ray's own CUDA IPC transport with
that one change. They are registered with ``ray.experimental.register_tensor_transport``,
Ray's documented way to add a tensor transport.

On a GPU the default is CUDA IPC: the two actors of a bundle share the GPU, and
NCCL refuses two ranks on one GPU; ``backend="nccl"`` is for an engine actor with
a GPU of its own. **Neither GPU variant has run**: Ray cannot reach a GPU on the
machines this was written on (its wheel cannot be carried to our GPU machines).

Every sync is verified like any other: the engine's digest of what it received
against the trainer's, by the scheduler, after the sync.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import itertools
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread
import torch

from colo.core.buckets import Bucket
from colo.core.errors import UsageError
from colo.core.interfaces import SyncContext
from colo.transports import launcher_refusal
from colo.transports.base import (BucketSender, RequestError, Staged, get_field, raise_first_real, timed_ack, views)
from colo.transports.broadcast import DistributedInitInfo, make_group
from colo.transports.wire import BucketRequest, LayoutCache, LayoutMemo, is_layout_not_cached, request_nbytes

try:  # Ray is an optional extra (colo-rl[ray]): without it the module imports, the sender refuses
    from ray.experimental.rdt import CommunicatorMetadata, TensorTransportManager, TensorTransportMetadata
    from ray.experimental.rdt.cuda_ipc_transport import CudaIpcTransport
except ImportError:  # pragma: no cover - the tests run with Ray
    CommunicatorMetadata = TensorTransportManager = CudaIpcTransport = object  # type: ignore[misc,assignment]
    TensorTransportMetadata = None  # type: ignore[assignment]

#: the one line that refuses the transport where its two actors do not exist
NEEDS = launcher_refusal("rdt", None)
#: the rank actor's method that returns a staged bucket through Ray's tensor transport
#: (:class:`colo.ranks.ray_launcher.TensorRankActor`)
SOURCE_METHOD = "rdt_tensors"
#: the pair group's ranks
TRAINER_RANK, ENGINE_RANK = 0, 1
#: every bucket is one send on the pair group; transfers of a pair never overlap (the
#: sender packs bucket i+2 only after bucket i's ack), so one tag serves them all
TAG = 0


# -- what each process of a pair holds (Ray calls the managers without context) ----------
#
# Ray makes one manager per transport name and process and calls it on the actors'
# ``_ray_system`` threads with only the metadata it carries: the group, the pair and
# the staged tensors it names must be found by name, in this process.

_lock = threading.Lock()
#: pair groups this process joined, by name
_groups: dict[str, Any] = {}
#: (rank actor, engine actor, group name): the pairs whose transfers this process owns
_pairs: list[tuple[Any, Any, str]] = []
#: staged buckets waiting for this actor's SOURCE_METHOD task, by key
_outgoing: dict[int, list[Any]] = {}
#: the tensors Ray delivered with the engine request being served (:func:`arrived`)
_arrived: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar("colo_rdt_arrived", default=None)


def _group(name: str) -> Any:
    with _lock:
        pg = _groups.get(name)
    if pg is None:
        raise RuntimeError(f"rdt pair group {name} is closed (its transfer was aborted or the pair replaced)")
    return pg


def _join(info: DistributedInitInfo, rank: int, store: Any = None) -> None:
    """Join pair group ``info`` as ``rank`` (blocks until the other side joins: run it in a thread)."""
    pg = make_group(info, rank, store)
    with _lock:
        _groups[info.group_name] = pg


def _leave(name: str | None, *, abort: bool = False) -> None:
    """Drop this process's end of a pair group; ``abort``: end a send or receive pending on it."""
    if name is None:
        return
    with _lock:
        pg = _groups.pop(name, None)
        _pairs[:] = [p for p in _pairs if p[2] != name]
    if pg is not None and abort:
        try:
            pg.abort()
        except Exception:  # a group that cannot abort ends with its last reference
            pass


def take_outgoing(key: int) -> list[Any]:
    """The staged bucket under ``key``, for :data:`SOURCE_METHOD` to return through Ray."""
    with _lock:
        tensors = _outgoing.pop(key, None)
    if tensors is None:
        raise RuntimeError(f"rdt: no staged bucket under key {key} in this actor")
    return tensors


@contextlib.contextmanager
def arrived(tensors: list[Any]) -> Iterator[None]:
    """While the engine serves one request: the tensors Ray delivered beside its frame,
    for :class:`RdtReceiver` to take (``TensorEngineActor.request_tensors``)."""
    token = _arrived.set(list(tensors))
    try:
        yield
    finally:
        _arrived.reset(token)


def process_state() -> dict:
    """What this process holds of rdt (the tests ask each actor: nothing stale after a run or a replacement)."""
    with _lock:
        return {"groups": sorted(_groups), "pairs": [name for _, _, name in _pairs], "outgoing": len(_outgoing)}


# -- Ray's side: the tensor transports colo registers ------------------------------------

@dataclass
class PairMetadata(CommunicatorMetadata):
    """Which pair group a transfer goes over (Ray hands it to both ends)."""

    group: str = ""


class _PairTransport(TensorTransportManager):
    """Two-sided: the rank actor sends, its engine actor receives, over colo's pair group."""

    NAME = ""

    def tensor_transport_backend(self) -> str:
        return self.NAME

    @staticmethod
    def is_one_sided() -> bool:
        return False

    @staticmethod
    def can_abort_transport() -> bool:
        # True, or Ray kills both actors when a transfer fails: the trainer rank with the
        # engine. Aborting is sound here: abort_transport aborts the pair group, which ends a
        # send or receive pending on it, and a transfer to a dead peer fails at once anyway.
        return True

    def actor_has_tensor_transport(self, actor: Any) -> bool:
        with _lock:
            return any(src == actor for src, _, _ in _pairs)

    def extract_tensor_transport_metadata(self, obj_id: str, rdt_object: list[Any]) -> Any:
        device = rdt_object[0].device.type if rdt_object else None
        return TensorTransportMetadata(tensor_meta=[(t.shape, t.dtype) for t in rdt_object], tensor_device=device)

    def get_communicator_metadata(self, src_actor: Any, dst_actor: Any, backend: str | None = None) -> PairMetadata:
        with _lock:
            for src, dst, name in _pairs:
                if src == src_actor and dst == dst_actor:
                    return PairMetadata(group=name)
        raise ValueError(f"rdt: no pair group joins {src_actor} to {dst_actor} in this process")

    def recv_multiple_tensors(self, obj_id: str, tensor_transport_metadata: Any, communicator_metadata: Any,
                              target_buffers: list[Any] | None = None) -> list[Any]:
        pg = _group(communicator_metadata.group)
        device = torch.device("cpu")
        if tensor_transport_metadata.tensor_device == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        out = target_buffers or [torch.empty(shape, dtype=dtype, device=device)
                                 for shape, dtype in tensor_transport_metadata.tensor_meta]
        for t in out:
            pg.recv([t], TRAINER_RANK, TAG).wait()
        if device.type == "cuda":
            # NCCL's wait orders the stream, not the host: the engine's task reads them next
            torch.cuda.current_stream(device).synchronize()
        return out

    def send_multiple_tensors(self, tensors: list[Any], tensor_transport_metadata: Any,
                              communicator_metadata: Any) -> None:
        pg = _group(communicator_metadata.group)
        for t in tensors:
            pg.send([t], ENGINE_RANK, TAG).wait()

    def garbage_collect(self, obj_id: str, tensor_transport_meta: Any, tensors: list[Any]) -> None:
        pass  # the tensor is the sender's staging slot (a view of it): the sender frees the slot

    def abort_transport(self, obj_id: str, communicator_metadata: Any) -> None:
        _leave(communicator_metadata.group, abort=True)


class ColoGlooTransport(_PairTransport):
    """CPU tensors over a gloo pair group (the transport the CPU tests run)."""

    NAME = "COLO_GLOO"


class ColoNcclTransport(_PairTransport):
    """CUDA tensors over an NCCL pair group: for an engine actor on a GPU of its own
    (NCCL refuses two ranks on one GPU, which is colo's colocated layout). Not run."""

    NAME = "COLO_NCCL"


class ColoCudaIpcTransport(CudaIpcTransport):
    """Ray's CUDA IPC transport (one-sided: the engine actor maps the rank actor's
    staging slot on the GPU they share), except that a failed transfer kills neither
    actor: there is nothing in flight to abort (the engine's mapping failed, or its
    actor is gone) and the sender frees its slot itself. Not run."""

    NAME = "COLO_CUDA_IPC"

    def tensor_transport_backend(self) -> str:  # type: ignore[override]
        return self.NAME

    @staticmethod
    def can_abort_transport() -> bool:
        return True

    def abort_transport(self, obj_id: str, communicator_metadata: Any) -> None:
        pass


#: backend -> (Ray's name of colo's transport, the devices it moves, its manager, two-sided)
RAY_TRANSPORTS: dict[str, tuple[str, tuple[str, ...], type, bool]] = {
    "gloo": (ColoGlooTransport.NAME, ("cpu",), ColoGlooTransport, True),
    "nccl": (ColoNcclTransport.NAME, ("cuda",), ColoNcclTransport, True),
    "cuda_ipc": (ColoCudaIpcTransport.NAME, ("cuda",), ColoCudaIpcTransport, False),
}
_registered = False


def register_ray_transports() -> None:
    """Register colo's tensor transports with Ray in this process, once. Ray hands them to
    every actor with tensor transport this process creates afterwards (the rank actor
    registers them before it creates its engine actor, as Ray's documentation asks), and
    to any other actor the first time a transfer needs them."""
    global _registered
    with _lock:
        if _registered:
            return
        from ray.experimental import register_tensor_transport

        for name, devices, manager, _ in RAY_TRANSPORTS.values():
            try:
                register_tensor_transport(name, list(devices), manager, torch.Tensor)
            except ValueError as e:  # registered already in this process (by Ray's own call)
                if "already registered" not in str(e):
                    raise
        _registered = True


# -- colo's side: init info, request, receiver, sender ------------------------------------

@dataclass(frozen=True)
class RdtInitInfo:
    """What the engine actor's receiver needs: the Ray tensor transport the buckets come
    through and, for a two-sided one, the pair group to join as rank 1."""

    tensor_transport: str
    group: DistributedInitInfo | None = None

    def __post_init__(self) -> None:
        known = {name: two for name, _, _, two in RAY_TRANSPORTS.values()}
        if self.tensor_transport not in known:
            raise RequestError(f"rdt init info: tensor_transport must be one of {', '.join(known)}, "
                               f"got {self.tensor_transport!r}")
        if known[self.tensor_transport] != (self.group is not None):
            raise RequestError(f"rdt init info: {self.tensor_transport} "
                               f"{'needs' if known[self.tensor_transport] else 'takes no'} pair group")

    def to_json(self) -> dict:
        return {"tensor_transport": self.tensor_transport,
                "group": None if self.group is None else self.group.to_json()}

    @classmethod
    def from_json(cls, d: Any) -> RdtInitInfo:
        name = get_field(d, "tensor_transport", str, "rdt init info")
        group = d.get("group")
        return cls(name, None if group is None else DistributedInitInfo.from_json(group))


@dataclass(frozen=True)
class RdtRequest(BucketRequest):
    """One bucket: its bytes (the tensor Ray delivers beside the request) and where each tensor lies."""

    what = "rdt request"


class RdtReceiver:
    """The engine actor's end: joins the pair group at init; each request's bytes are the
    tensor Ray delivered with it."""

    def __init__(self, info: RdtInitInfo, device: Any = None):
        self.info = info
        self.device = torch.device(device if device is not None else "cpu")
        devices = next(d for name, d, _, _ in RAY_TRANSPORTS.values() if name == info.tensor_transport)
        if self.device.type not in devices:
            raise RequestError(f"rdt: {info.tensor_transport} moves {'/'.join(devices)} tensors; "
                               f"this engine's are on {self.device}")
        self.group = info.group.group_name if info.group is not None else None
        if info.group is not None:
            _join(info.group, ENGINE_RANK)
        self.layouts = LayoutCache()  # bucket layouts, as long as this receiver lives

    @contextlib.contextmanager
    def receive(self, request: Any) -> Iterator[list[tuple[str, Any]]]:
        nbytes = request_nbytes(request, RdtRequest.what)
        got = _arrived.get()
        if got is None:
            raise RequestError("an rdt request carries its bucket beside its frame, through Ray's tensor "
                               "transport; this one came without it")
        if len(got) != 1 or got[0].dtype != torch.uint8 or got[0].dim() != 1 or got[0].numel() != nbytes:
            raise RequestError(f"rdt request of {nbytes} B came with "
                               f"{[(tuple(t.shape), str(t.dtype)) for t in got]}; expected one uint8 tensor of "
                               f"{nbytes} B")
        flat = got.pop()  # taken once: the views below are all that holds it after the load
        tensors = self.layouts.resolve(request, "rdt request", buffer_nbytes=nbytes)
        yield views(flat, tensors)

    def release(self, *, kept: bool = False) -> None:
        pass  # nothing mapped: each bucket's tensor goes when its views do

    def close(self) -> None:
        _leave(self.group)
        self.group = None
        self.layouts.clear()


class _Pair:
    """The sender's end of one pair: the two actors, the Ray transport between them, and
    for a two-sided one the store its group meets at (kept while the group lives)."""

    def __init__(self, me: Any, peer: Any, engine: Any, info: RdtInitInfo, store: Any):
        self.me, self.peer, self.engine, self.info, self.store = me, peer, engine, info, store

    @property
    def two_sided(self) -> bool:
        return self.info.group is not None

    @property
    def name(self) -> str | None:
        return self.info.group.group_name if self.info.group is not None else None

    def alive(self) -> bool:
        """Not aborted: Ray aborts a group whose transfer failed (``abort_transport``)."""
        with _lock:
            return self.name is None or self.name in _groups

    def produce(self, key: int, flat: Any) -> Any:
        """A ref to ``flat`` whose tensors Ray moves to whichever actor gets it. Blocking (the
        first call has Ray register colo's transports on this actor): run it in a thread."""
        import ray

        if not self.two_sided:
            return ray.put([flat], _tensor_transport=self.info.tensor_transport)
        with _lock:
            _outgoing[key] = [flat]
        method = getattr(self.me, SOURCE_METHOD)
        return method.options(tensor_transport=self.info.tensor_transport).remote(key)


class _Handoff:
    """One staged bucket's handoff: pending from its pack until it ends, then whether it failed.

    Ray aborts a pair group when a transfer on it fails (its engine actor died, say); the next
    bucket's pack, beside that handoff, can find the pair aborted before the handoff's own
    error arrives. The handoff's error is the cause and the sync's error, so a pack that finds
    the pair aborted waits for the handoff before it blames the pair."""

    def __init__(self) -> None:
        self.ended = anyio.Event()
        self.failed = False


class RdtTransport(BucketSender):
    """``backend``: ``gloo`` (the CPU), ``cuda_ipc`` or ``nccl`` (a GPU); None: ``gloo`` on
    the CPU and ``cuda_ipc`` on a GPU. Runs inside a rank actor of ``--launcher ray``
    (:class:`colo.ranks.ray_launcher.TensorRankActor`) against its engine actor; anywhere
    else its first sync is refused with :data:`NEEDS`."""

    name = "rdt"
    ends_on_last_load = True

    def __init__(self, *, pipelined: bool = True, backend: str | None = None, timeout_s: float = 60.0):
        super().__init__(pipelined=pipelined)
        if backend is not None and backend not in RAY_TRANSPORTS:
            raise ValueError(f"rdt backend must be one of {', '.join(RAY_TRANSPORTS)} or None, got {backend!r}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.backend, self.timeout_s = backend, float(timeout_s)
        self._pair: _Pair | None = None
        self._slots: list[tuple[Staged, Any] | None] = [None, None]
        self._pair_checked = False
        #: per slot, (key, ref) of the bucket staged in Ray and not yet handed off
        self._refs: list[tuple[int, Any] | None] = [None, None]
        self._cap = 0
        self._cuda = False
        self._keys = itertools.count()
        #: bucket layouts the engine's receiver holds; it lives as long as the pair
        self._memo = LayoutMemo()
        #: per slot, the handoff of the bucket packed into it (:class:`_Handoff`)
        self._handoffs: list[_Handoff | None] = [None, None]

    async def _begin(self, engine: Any, ctx: SyncContext, buckets: list[Bucket]) -> None:
        self._cap = max(b.nbytes for b in buckets)
        self._pair_checked = False  # the first bucket's pack forms the pair, or checks it
        self._handoffs = [None, None]  # nothing of an earlier sync's handoffs

    def _slot(self, i: int, ctx: SyncContext, device: torch.device) -> Any:
        if self._slots[i] is None:
            staged = Staged(ctx, self._cap)  # counted before it exists: OOM before allocation
            try:
                # a plain allocation: CUDA IPC cannot export memory-saver memory
                self._slots[i] = (staged, torch.empty(self._cap, dtype=torch.uint8, device=device))
            except BaseException:
                staged.free()
                raise
            self._cuda = self._cuda or device.type == "cuda"
        return self._slots[i][1]

    async def _pack(self, bucket: Bucket, tensors: list[tuple[str, Any]], slot: int, ctx: SyncContext) -> None:
        from colo.transports.pack import pack_and_settle

        target = getattr(self._extractor, "upload_to", None)
        device = torch.device(target) if target is not None else tensors[0][1].device
        flat = self._slot(slot, ctx, device)[:bucket.nbytes]
        t0 = time.perf_counter()
        # settled: the bytes must be in the slot before Ray reads it on another thread
        await anyio.to_thread.run_sync(pack_and_settle, flat, bucket, tensors)
        # Staged in Ray here, not at the handoff: the task that hands the slot to Ray's RDT
        # store is a round trip of its own (a few ms on two cores), and here it runs while
        # the previous bucket is handed off and loaded. Nothing moves before the handoff
        # passes the ref to the engine actor.
        pair = await self._sync_pair(device, slot)
        key = next(self._keys)
        self._refs[slot] = (key, await anyio.to_thread.run_sync(pair.produce, key, flat))
        self._handoffs[slot] = _Handoff()
        ctx.record(bucket.index, "pack", bucket.payload_bytes, len(tensors), time.perf_counter() - t0)

    async def _handoff(self, engine: Any, bucket: Bucket, slot: int, ctx: SyncContext) -> None:
        handoff = self._handoffs[slot]
        try:
            await self._handoff_bucket(engine, bucket, slot, ctx)
        except BaseException:
            handoff.failed = True
            raise
        finally:
            handoff.ended.set()

    async def _handoff_bucket(self, engine: Any, bucket: Bucket, slot: int, ctx: SyncContext) -> None:
        on_sent, on_ack = timed_ack(ctx, bucket, len(bucket.entries))
        pair = self._pair
        key, ref = self._refs[slot]
        self._refs[slot] = None
        # a two-sided transport receives into a tensor Ray allocates on the engine: counted
        # while the request runs (CUDA IPC maps this slot instead)
        receive = Staged(ctx, bucket.nbytes) if pair.two_sided else None
        try:
            fields, layout = self._memo.fields(engine, bucket)
            end = self._end_of(bucket, ctx)
            try:
                reply = await engine.transport_load(self.name, {"nbytes": bucket.nbytes, **fields}, on_sent=on_sent,
                                                    tensors=ref, **end)
            except Exception as e:
                # the engine lost the layout (its receiver was rebuilt): it refused before
                # loading a byte, so the same bucket goes again (Ray moves the same ref again)
                if "tensors" in fields or not is_layout_not_cached(e):
                    raise
                fields, layout = self._memo.fields(engine, bucket, full=True)
                reply = await engine.transport_load(self.name, {"nbytes": bucket.nbytes, **fields},
                                                    on_sent=on_sent, tensors=ref, **end)
        finally:
            with _lock:
                _outgoing.pop(key, None)  # a task that never ran leaves it here
            # dropping the last ref lets Ray free its RDT store's hold on the slot; the
            # engine acknowledged the load, so nothing reads the slot any more
            del ref
            if receive is not None:
                receive.free()
        self._memo.acked(bucket.index, layout)
        self._loaded(reply)
        on_ack(reply)

    async def _sync_pair(self, device: torch.device, slot: int) -> _Pair:
        """This sync's pair: formed (or checked) at its first bucket, then the same one; a pair
        Ray aborted mid-sync (a transfer failed) fails the sync, and the next one forms anew.
        ``slot``: the one being packed (the other's bucket may be in its handoff)."""
        if not self._pair_checked:
            self._pair_checked = True
            return await self._ensure_pair(self._engine, device)
        pair = self._pair
        if pair is None or not pair.alive():
            handoff = self._handoffs[1 - slot]
            if handoff is not None:
                await handoff.ended.wait()
                if handoff.failed:
                    # its error (say EngineDied) is the cause: the pipeline raises it and cancels this
                    await anyio.sleep_forever()
            raise RuntimeError("rdt: the pair group was aborted during this sync (a transfer failed)")
        return pair

    async def _ensure_pair(self, engine: Any, device: torch.device) -> _Pair:
        peer = getattr(engine, "ray_actor", None)
        if peer is None:
            raise UsageError(f"{NEEDS} (this engine is no Ray actor)")
        pair = self._pair
        if pair is not None and pair.peer == peer and pair.alive():
            return pair
        await self._close_pair()
        backend = self.backend or ("cuda_ipc" if device.type == "cuda" else "gloo")
        name, devices, _, two_sided = RAY_TRANSPORTS[backend]
        if device.type not in devices:
            raise ValueError(f"rdt backend {backend} moves {'/'.join(devices)} tensors; this sync's are on {device}")
        import ray

        me = ray.get_runtime_context().current_actor if ray.is_initialized() else None
        if me is None or not hasattr(me, SOURCE_METHOD):
            raise UsageError(f"{NEEDS} (this sender runs in no rank actor with tensor transport)")
        await anyio.to_thread.run_sync(register_ray_transports)
        store = None
        group = None
        if two_sided:
            import torch.distributed as dist

            # The engine actor shares this actor's bundle, hence its host: the store listens
            # on loopback only (it has no authentication). Port 0: the kernel picks it as it
            # listens, so no other process can take it in between.
            store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=self.timeout_s),
                                  wait_for_workers=False)
            group = DistributedInitInfo(master_addr="127.0.0.1", master_port=store.port, world_size=2,
                                        backend="nccl" if backend == "nccl" else "gloo",
                                        group_name=f"colo-rdt-{uuid.uuid4().hex}", timeout_s=self.timeout_s)
        info = RdtInitInfo(name, group)
        try:
            if group is None:
                await engine.transport_init(self.name, info.to_json())
            else:
                async with anyio.create_task_group() as tg:
                    # the engine joins inside its transport_init request while this side
                    # joins in a thread: both block until the other arrives
                    tg.start_soon(engine.transport_init, self.name, info.to_json())
                    await anyio.to_thread.run_sync(_join, group, TRAINER_RANK, store)
        except BaseExceptionGroup as exc:
            with anyio.CancelScope(shield=True):
                _leave(group.group_name if group else None, abort=True)
            raise_first_real(exc)
        except BaseException:
            with anyio.CancelScope(shield=True):
                _leave(group.group_name if group else None, abort=True)
            raise
        if group is not None:
            with _lock:
                _pairs.append((me, peer, group.group_name))
        self._pair = _Pair(me, peer, engine, info, store)
        self._memo.forget()  # a fresh receiver on the engine: it holds no layout yet
        return self._pair

    async def _close_pair(self) -> None:
        """Both ends let go of the pair (bounded: a dead engine actor has nothing to close)."""
        pair, self._pair = self._pair, None
        if pair is None:
            return
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(5):
                try:
                    await pair.engine.transport_close(self.name)
                except Exception:
                    pass
            # aborted: a send still pending on a dead peer (Ray's own abort may not have come) ends
            _leave(pair.name, abort=True)
            pair.store = None

    def _cleanup(self) -> None:
        # a failed sync may leave a bucket staged and never handed off: its ref and key go
        for i, staged in enumerate(self._refs):
            if staged is not None:
                with _lock:
                    _outgoing.pop(staged[0], None)
                self._refs[i] = None
        for i, s in enumerate(self._slots):
            if s is not None:
                s[0].free()
                self._slots[i] = None
        if self._cuda:
            # the engine actor unmapped each slot before its ack; without collecting, the
            # exported blocks are only parked
            torch.cuda.ipc_collect()
            self._cuda = False

    async def abort(self) -> None:
        # a failed transfer may leave the pair group unusable: both ends drop it and the next
        # sync forms a fresh one (with the same engine actor or its replacement)
        await self._close_pair()
        await super().abort()

    async def aclose(self) -> None:
        await self._close_pair()


class RdtStrategy:
    name = "rdt"
    request_type = RdtRequest
    init_info_type = RdtInitInfo
    #: the launcher whose actors it runs between (``colo.transports.launcher_refusal``)
    launcher = "ray"
    #: the Ray launcher starts rank and engine actors with tensor transport for it
    ray_tensor_transport = True

    def create_init_info(self, *, tensor_transport: str, group: DistributedInitInfo | None = None) -> RdtInitInfo:
        return RdtInitInfo(tensor_transport, group)

    def create_sender(self, **options: Any) -> RdtTransport:
        return RdtTransport(**options)

    def create_receiver(self, init_info: RdtInitInfo, *, device: Any = None) -> RdtReceiver:
        return RdtReceiver(init_info, device)


STRATEGY = RdtStrategy()
