"""``ipc``: one handle and one request per tensor — verl's way, and the baseline.

verl hands SGLang every tensor as its own CUDA IPC handle; the engine opens
each (~0.15–0.2 ms apiece on a GPU) and loads it. With thousands of tensors
the handles, not the bytes, dominate the sync: that cost is what ``packed``
removes, and this transport exists to measure it.

On a GPU a tensor is exported where it lies (``colo.device.cuda_ipc``, keyed by GPU
UUID); on the CPU it is copied into its own ``/dev/shm`` segment. Buckets are
still planned and pipelined like the other transports, so the only
difference from ``packed`` is the number of handles: bucket i+1 is gathered
and exported while bucket i's tensors are handed off one request at a time.
Each tensor's memory is freed as soon as the engine acknowledged loading it.

Trace stages per bucket: ``pack`` is creating the per-tensor segments (empty
on a GPU, where nothing is copied); ``handoff`` spans the per-tensor round
trips up to the moment the last request is on the wire — these round trips
are the baseline's cost; ``load`` is the last tensor's load.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import anyio.to_thread
import torch

from colo.core.buckets import Bucket
from colo.proc.handles import ShmSegment, open_handle
from colo.core.interfaces import SyncContext
from colo.transports.base import BucketSender, EmptyInitInfo, RequestError, Staged, TensorMeta, views


@dataclass(frozen=True)
class IpcRequest:
    """One tensor: its handle (``shm`` or ``cuda_ipc``) and what it is."""

    handle: dict
    tensor: TensorMeta

    def to_json(self) -> dict:
        return {"handle": self.handle, "tensor": self.tensor.to_json()}

    @classmethod
    def from_json(cls, d: Any) -> IpcRequest:
        if not isinstance(d, dict) or not isinstance(d.get("handle"), dict) or "tensor" not in d:
            raise RequestError("ipc request must be a JSON object with a 'handle' object and a 'tensor'")
        nbytes = d["handle"].get("nbytes")
        return cls(d["handle"], TensorMeta.from_json(d["tensor"],
                                                     buffer_nbytes=nbytes if isinstance(nbytes, int) else None))


class _Exported:
    """One tensor's shareable memory, held until the engine acknowledged it."""

    def __init__(self, ctx: SyncContext, name: str, t: Any, entry: Any = None, upload_to: Any = None):
        from colo.transports.pack import entry_bytes

        # a piece of a tensor larger than the bucket is exported as its own bytes only
        flat = t.contiguous().view(-1).view(torch.uint8) if entry is None else entry_bytes(t, entry)
        device = torch.device(upload_to) if upload_to is not None else flat.device
        # a 0-byte tensor still gets a 1-byte segment: a handle needs memory behind it
        self.staged = Staged(ctx, max(1, flat.numel()))
        self.name = name
        self.nbytes = flat.numel()
        self.seg: ShmSegment | None = None
        self.tensor: Any = None
        try:
            if device.type == "cuda" and flat.numel() > 0:
                from colo.device.cuda_ipc import export_cuda

                # A copy into a plain cudaMalloc block, always: the tensor may
                # be the trainer's own parameter inside a memory-saver region (a
                # virtual-memory mapping that cudaIpcGetMemHandle cannot export).
                # A host source (offload-first) is uploaded straight into it: no
                # device copy of the bucket in between, so a bucket is held once.
                self.tensor = torch.empty(flat.numel(), dtype=torch.uint8, device=device)
                self.tensor.copy_(flat, non_blocking=flat.device.type == "cpu" and flat.is_pinned())
                self.handle = export_cuda(self.tensor)
            else:
                self.seg = ShmSegment.create(max(1, flat.numel()))
                self.seg.tensor[:flat.numel()].copy_(flat)
                self.handle = self.seg.handle()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.seg is not None:
            self.seg.close()
            self.seg = None
        self.tensor = None
        self.staged.free()


def _export_all(ctx: SyncContext, tensors: list[tuple[str, Any]], stream: Any = None,
                upload_to: Any = None, entries: Any = None) -> list[_Exported]:
    """Export every tensor of a bucket; with ``stream`` (the sender's upload stream)
    the copies are queued there, after the uploads and gathers they read.

    Those ran on the upload stream only where the extractor uploads (offload-first);
    one that reads device tensors (sync-first) gathered on the default stream, which
    the upload stream does not follow by itself: it must wait for it here, or the
    copies read a gather's output before the all-gather wrote it. (Seen on two H200s,
    2026-11-27: Qwen2-7B TP=2 sync-first, 19 and 37 gathered tensors differing on the
    two engine ranks, every one a gathered tensor; offload-first exact.)"""
    if stream is None:
        return _export_each(ctx, tensors, upload_to, entries)
    stream.wait_stream(torch.cuda.default_stream(stream.device))
    with torch.cuda.stream(stream):
        return _export_each(ctx, tensors, upload_to, entries)


def _export_each(ctx: SyncContext, tensors: list[tuple[str, Any]], upload_to: Any,
                 entries: Any = None) -> list[_Exported]:
    entries = list(entries) if entries is not None else [None] * len(tensors)
    out: list[_Exported] = []
    try:
        for (name, t), e in zip(tensors, entries):
            # verl's way on a GPU is one CUDA IPC handle per tensor: a host source
            # is uploaded into that tensor's block, not shared through host memory
            out.append(_Exported(ctx, name, t, e, upload_to))
    except BaseException:
        for e in out:
            e.close()
        raise
    if any(e.tensor is not None for e in out):
        # the engine reads these from another process, outside this stream's
        # order: the conversions that produced them must be done
        torch.cuda.synchronize()
    return out


class IpcTransport(BucketSender):
    name = "ipc"

    def __init__(self, *, pipelined: bool = True):
        super().__init__(pipelined=pipelined)
        self._slots: list[list[_Exported]] = [[], []]
        self._cuda = False

    async def _pack(self, bucket: Bucket, tensors: list[tuple[str, Any]], slot: int, ctx: SyncContext) -> None:
        t0 = time.perf_counter()
        target = getattr(self._extractor, "upload_to", None)
        upload_to = torch.device(target) if target is not None and torch.device(target).type == "cuda" else None
        device = upload_to if upload_to is not None else tensors[0][1].device
        stream = self._upload_stream(device)
        self._slots[slot] = await anyio.to_thread.run_sync(_export_all, ctx, tensors, stream, upload_to,
                                                           bucket.entries)
        self._cuda = self._cuda or any(e.tensor is not None for e in self._slots[slot])
        ctx.record(bucket.index, "pack", bucket.payload_bytes, len(tensors), time.perf_counter() - t0)

    async def _handoff(self, engine: Any, bucket: Bucket, slot: int, ctx: SyncContext) -> None:
        exported = self._slots[slot]
        n = len(exported)
        t0 = time.perf_counter()
        last_sent = t0
        loaded = 0
        for k, (e, m) in enumerate(zip(exported, TensorMeta.of_bucket(bucket))):
            def on_sent(last: bool = k == n - 1) -> None:
                nonlocal last_sent
                last_sent = time.perf_counter()
                if last:  # the handoff ends where the last tensor's load begins
                    ctx.record(bucket.index, "handoff", bucket.payload_bytes, n, last_sent - t0)

            request = IpcRequest(e.handle, TensorMeta(m.name, m.shape, m.dtype, 0, m.nbytes, m.offset))
            reply = await engine.transport_load(self.name, request.to_json(), on_sent=on_sent)
            loaded += int(reply.get("tensors", 1))
            # acknowledged: the engine copied it and closed its mapping
            e.close()
        self._slots[slot] = []
        ctx.record(bucket.index, "load", bucket.payload_bytes, loaded, time.perf_counter() - last_sent)

    def _cleanup(self) -> None:
        for i, exported in enumerate(self._slots):
            for e in exported:
                e.close()
            self._slots[i] = []
        if self._cuda:
            # the engine dropped its references; without this every sync leaks
            torch.cuda.ipc_collect()
            self._cuda = False


class IpcReceiver:
    """Opens each tensor's handle, views it, and closes it right after the load."""

    def __init__(self, device: Any = None) -> None:
        self.device = device

    @contextlib.contextmanager
    def receive(self, request: Any) -> Iterator[list[tuple[str, Any]]]:
        req = request if isinstance(request, IpcRequest) else IpcRequest.from_json(request)
        if req.handle.get("kind") == "cuda_ipc":
            import colo.device.cuda_ipc  # noqa: F401  registers the cuda_ipc rebuilder
        seg = open_handle(req.handle)
        try:
            # one-use mapping: the sender frees the memory once we acknowledge
            yield views(seg.tensor, [req.tensor])
        finally:
            seg.close()

    def release(self, *, kept: bool = False) -> None:
        pass

    close = release


class IpcStrategy:
    name = "ipc"
    request_type = IpcRequest
    init_info_type = EmptyInitInfo

    def create_init_info(self) -> EmptyInitInfo:
        return EmptyInitInfo()

    def create_sender(self, **options: Any) -> IpcTransport:
        return IpcTransport(**options)

    def create_receiver(self, init_info: EmptyInitInfo, *, device: Any = None) -> IpcReceiver:
        return IpcReceiver(device)


STRATEGY = IpcStrategy()
