"""``broadcast``: a torch.distributed group between the trainer and the engine.

SGLang's ``update_weights_from_distributed``: for placements where the
trainer and the engine do not share a GPU, so there is no handle to pass.
The trainer (rank 0, the scheduler's process) and the engine (rank 1) form
their own group — gloo on the CPU, NCCL on a GPU — built from a
``TCPStore`` on 127.0.0.1 and never the default group, so a trainer that runs
its own ``torch.distributed`` world is not disturbed. The group is built at
the first sync and kept until :meth:`BroadcastTransport.aclose` (or an
abort, after which the next sync builds a fresh one).

Per bucket the sender packs the bucket into a flat staging buffer, sends the
metadata request, and both sides call ``broadcast`` on the flat buffer. The
engine serves one request at a time and enters the collective inside that
request, so the trainer's blocking collective runs in a worker thread while
the event loop waits for the engine's reply. Two trainer buffers alternate
like ``packed``; the engine's receive buffer lives for one request.
"""

from __future__ import annotations

import contextlib
import datetime
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread
import torch

from colo.core.buckets import Bucket
from colo.core.interfaces import SyncContext
from colo.transports.base import BucketSender, RequestError, Staged, get_field, raise_first_real, views
from colo.transports.wire import BucketRequest, LayoutCache, LayoutMemo, request_nbytes

BACKENDS = ("gloo", "nccl")
#: the engine is rank 1; engine tensor-parallel ranks would follow it
TRAINER_RANK, ENGINE_RANK = 0, 1


@dataclass(frozen=True)
class DistributedInitInfo:
    """Where the engine joins the group (seed: ``TorchDistributedWeightSyncInitInfo``)."""

    master_addr: str
    master_port: int
    world_size: int
    backend: str
    group_name: str
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise RequestError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if not 0 < self.master_port < 65536:
            raise RequestError(f"master_port must be in 1..65535, got {self.master_port}")
        if self.world_size != 2:
            raise RequestError(f"world_size must be 2 (trainer rank 0, engine rank 1), got {self.world_size}")
        if not self.timeout_s > 0:
            raise RequestError(f"timeout_s must be > 0, got {self.timeout_s}")

    def to_json(self) -> dict:
        return {"master_addr": self.master_addr, "master_port": self.master_port, "world_size": self.world_size,
                "backend": self.backend, "group_name": self.group_name, "timeout_s": self.timeout_s}

    @classmethod
    def from_json(cls, d: Any) -> DistributedInitInfo:
        what = "broadcast init info"
        timeout = d.get("timeout_s", 60.0) if isinstance(d, dict) else None
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise RequestError(f"{what} field 'timeout_s' must be a number")
        return cls(get_field(d, "master_addr", str, what), get_field(d, "master_port", int, what),
                   get_field(d, "world_size", int, what), get_field(d, "backend", str, what),
                   get_field(d, "group_name", str, what), float(timeout))


@dataclass(frozen=True)
class BroadcastRequest(BucketRequest):
    """One bucket: how many bytes the collective carries and where each tensor lies."""

    what = "broadcast request"


def make_group(info: DistributedInitInfo, rank: int, store: Any = None) -> Any:
    """This rank's process group. Blocks until every rank has joined (run it in a thread)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=info.timeout_s)
    if store is None:
        store = dist.TCPStore(info.master_addr, info.master_port, info.world_size, False, timeout=timeout)
    prefixed = dist.PrefixStore(info.group_name, store)
    if info.backend == "nccl":
        return dist.ProcessGroupNCCL(prefixed, rank, info.world_size)
    return dist.ProcessGroupGloo(prefixed, rank, info.world_size, timeout)


class _Group:
    """The trainer's end: the store it serves and the group over it."""

    def __init__(self, store: Any, pg: Any, info: DistributedInitInfo, engine: Any):
        self.store, self.pg, self.info, self.engine = store, pg, info, engine

    def close(self) -> None:
        self.pg = None
        self.store = None


class BroadcastTransport(BucketSender):
    name = "broadcast"

    def __init__(self, *, pipelined: bool = True, master_addr: str = "127.0.0.1", timeout_s: float = 60.0):
        super().__init__(pipelined=pipelined)
        if master_addr not in ("127.0.0.1", "localhost", "::1"):
            # the group's store has no authentication: never listen beyond this host
            raise ValueError(f"master_addr must be a loopback address, got {master_addr!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.master_addr, self.timeout_s = master_addr, float(timeout_s)
        self._group: _Group | None = None
        self._slots: list[tuple[Staged, Any] | None] = [None, None]
        self._cap = 0
        #: bucket layouts the engine's receiver holds; it lives as long as the group
        self._memo = LayoutMemo()

    async def _begin(self, engine: Any, ctx: SyncContext, buckets: list[Bucket]) -> None:
        self._cap = max(b.nbytes for b in buckets)

    async def _ensure_group(self, engine: Any, device: torch.device) -> _Group:
        if self._group is not None and self._group.engine is engine:
            return self._group
        await self._close_group()
        import torch.distributed as dist

        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=self.timeout_s)
        # port 0: the OS picks a free port, no race with another process choosing the same
        store = dist.TCPStore(self.master_addr, 0, 2, True, timeout=timeout, wait_for_workers=False)
        info = STRATEGY.create_init_info(master_addr=self.master_addr, master_port=store.port, backend=backend,
                                         timeout_s=self.timeout_s)
        holder: list[Any] = []
        try:
            async with anyio.create_task_group() as tg:
                # The engine joins inside its transport_init request while we
                # join here, in a thread: both block until the other arrives.
                tg.start_soon(engine.transport_init, self.name, info.to_json())
                holder.append(await anyio.to_thread.run_sync(make_group, info, TRAINER_RANK, store))
        except BaseExceptionGroup as group:
            raise_first_real(group)
        self._group = _Group(store, holder[0], info, engine)
        self._memo.forget()  # a fresh receiver on the engine: it holds no layout yet
        return self._group

    def _slot(self, i: int, ctx: SyncContext, device: torch.device) -> Any:
        if self._slots[i] is None:
            staged = Staged(ctx, self._cap)  # counted before it exists: OOM before allocation
            try:
                self._slots[i] = (staged, torch.empty(self._cap, dtype=torch.uint8, device=device))
            except BaseException:
                staged.free()
                raise
        return self._slots[i][1]

    async def _pack(self, bucket: Bucket, tensors: list[tuple[str, Any]], slot: int, ctx: SyncContext) -> None:
        from colo.transports.pack import pack_and_settle

        flat = self._slot(slot, ctx, tensors[0][1].device)
        t0 = time.perf_counter()
        await anyio.to_thread.run_sync(pack_and_settle, flat, bucket, tensors)
        ctx.record(bucket.index, "pack", bucket.payload_bytes, len(tensors), time.perf_counter() - t0)

    async def _handoff(self, engine: Any, bucket: Bucket, slot: int, ctx: SyncContext) -> None:
        t0 = time.perf_counter()
        flat = self._slots[slot][1]
        # the first sync's first handoff builds the group: part of its handoff
        group = await self._ensure_group(engine, flat.device)
        fields, key = self._memo.fields(engine, bucket)
        request = {"nbytes": bucket.nbytes, **fields}
        n = len(bucket.entries)
        # the engine's receive buffer, for as long as its request runs
        receive = Staged(ctx, bucket.nbytes)
        replies: list[dict] = []
        on_wire = anyio.Event()
        sent_request = False

        def on_sent() -> None:
            nonlocal sent_request
            sent_request = True
            on_wire.set()

        async def engine_side() -> None:
            try:
                replies.append(await engine.transport_load(self.name, request, on_sent=on_sent))
            finally:
                on_wire.set()

        def send() -> None:
            group.pg.broadcast(flat[:bucket.nbytes], TRAINER_RANK).wait()

        try:
            # Shielded: once the request is on the wire the engine enters the
            # collective, and a collective one side entered must be entered by
            # the other, or that side hangs until the group's timeout. A
            # cancellation takes effect when this bucket is done.
            with anyio.CancelScope(shield=True):
                try:
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(engine_side)
                        await on_wire.wait()  # set once sent, or when sending failed
                        if sent_request:
                            # the thread reads ``flat`` until the collective completes,
                            # so the slot outlives it
                            await anyio.to_thread.run_sync(send)
                            sent = time.perf_counter()
                            ctx.record(bucket.index, "handoff", bucket.payload_bytes, n, sent - t0)
                except BaseExceptionGroup as group_exc:
                    raise_first_real(group_exc)
            self._memo.acked(bucket.index, key)
            ctx.record(bucket.index, "load", bucket.payload_bytes, replies[0].get("tensors", bucket.completed),
                       time.perf_counter() - sent)
        finally:
            receive.free()

    def _cleanup(self) -> None:
        for i, s in enumerate(self._slots):
            if s is not None:
                s[0].free()
                self._slots[i] = None

    async def _close_group(self) -> None:
        group, self._group = self._group, None
        if group is None:
            return
        with anyio.CancelScope(shield=True), anyio.move_on_after(5):
            try:
                await group.engine.transport_close(self.name)
            except Exception:  # a dead engine has no group to close
                pass
        group.close()

    async def abort(self) -> None:
        # A failed collective leaves the group unusable: both ends drop it and
        # the next sync builds a fresh one.
        await self._close_group()
        await super().abort()

    async def aclose(self) -> None:
        await self._close_group()


class BroadcastReceiver:
    """The engine's end: joins the group at init, receives one bucket per request."""

    def __init__(self, info: DistributedInitInfo, device: Any = None):
        self.info = info
        self.device = torch.device(device if device is not None else "cpu")
        if (info.backend == "nccl") != (self.device.type == "cuda"):
            raise RequestError(f"backend {info.backend} does not fit the engine's device {self.device}")
        self.pg: Any = make_group(info, ENGINE_RANK)
        self.layouts = LayoutCache()  # bucket layouts, for as long as this group lives

    @contextlib.contextmanager
    def receive(self, request: Any) -> Iterator[list[tuple[str, Any]]]:
        if self.pg is None:
            raise RequestError("the broadcast group is closed: call transport_init first")
        nbytes = request_nbytes(request, BroadcastRequest.what)
        flat = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        # Enter the collective before checking anything else: the trainer is
        # already in it, and a refusal here would strand it until the timeout.
        self.pg.broadcast(flat, TRAINER_RANK).wait()
        tensors = self.layouts.resolve(request, "broadcast request", buffer_nbytes=nbytes)
        yield views(flat, tensors)

    def release(self, *, kept: bool = False) -> None:
        pass

    def close(self) -> None:
        self.pg = None
        self.layouts.clear()


class BroadcastStrategy:
    name = "broadcast"
    request_type = BroadcastRequest
    init_info_type = DistributedInitInfo

    def create_init_info(self, *, master_port: int, master_addr: str = "127.0.0.1", backend: str = "gloo",
                         timeout_s: float = 60.0) -> DistributedInitInfo:
        return DistributedInitInfo(master_addr=master_addr, master_port=master_port, world_size=2,
                                   backend=backend, group_name=f"colo-broadcast-{uuid.uuid4().hex}",
                                   timeout_s=timeout_s)

    def create_sender(self, **options: Any) -> BroadcastTransport:
        return BroadcastTransport(**options)

    def create_receiver(self, init_info: DistributedInitInfo, *, device: Any = None) -> BroadcastReceiver:
        return BroadcastReceiver(init_info, device)


STRATEGY = BroadcastStrategy()
