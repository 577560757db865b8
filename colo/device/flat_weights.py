"""A trainer's weights as views into one flat, exportable buffer (issue 18, item 2).

Megatron's DDP keeps every parameter as a view into one contiguous buffer; here
that buffer is also what the engine reads from, so a ``sync-first`` sync needs
no packing: one handle covers the whole model, and the engine copies each
tensor straight out of the trainer's memory into its own parameters (one device
copy of the model instead of two).

Why not the memory saver's regions: they are virtual-memory mappings
(``cuMemCreate`` without a shareable handle type) that neither
``cudaIpcGetMemHandle`` nor ``cuMemExportToShareableHandle`` can export. The
flat buffer is ONE plain caching-allocator block (``torch.empty`` outside any
region), exported like a staging buffer (:func:`colo.device.cuda_ipc.export_cuda`).
Pausing it is done here instead of by the saver: copy to a pinned host backup
(allocated once and kept across cycles, as the saver's retained backup is),
free the storage with ``resize_(0)`` and hand the block back to the driver;
resuming reallocates and copies back. Every parameter view shares the buffer's
``StorageImpl``, so it follows the storage across the resize (what FSDP1's
``_free_storage``/``_alloc_storage`` relied on); ``tests/device/test_one_copy.py``
checks that rather than trusting it.

The pinned host backup is itself shared (``share_host``, the default): a
``/dev/shm`` segment page-locked on both sides (:class:`colo.device.cuda_ipc.PinnedShm`).
An ``offload-first`` sync then needs no packing either: the engine copies each
tensor straight out of the backup into its parameters, one host-to-device copy
of the model and no device staging (issue 18, item 1). Where ``/dev/shm`` has
no room for it the backup is private pinned memory (``host_unshared``
says why) and the sync stages it through device buffers as before.

On the CPU the buffer is a ``/dev/shm`` segment that the engine process maps;
pause and resume free nothing there (as for the CPU trainers' other state), and
a paused buffer is still what the engine reads.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch

from colo.core.buckets import ALIGN, strided_span
from colo.device import canonical_device
from colo.dtypes import dtype_name

#: the CUDA caching allocator rounds an allocation of 10 MiB or more up to this
SEGMENT_ROUND = 2 << 20


class FlatWeights:
    """Tensors of the given shapes and dtypes, each a view at an ``align``-byte
    boundary of one flat uint8 buffer on ``device``.

    ``tensors`` holds the views (fill them in place). :meth:`adopt` moves a
    module's parameters into a new one; :meth:`check` says whether they are
    all still there."""

    def __init__(self, layout: Mapping[str, tuple[tuple[int, ...], torch.dtype]], *,
                 device: torch.device | str, align: int = ALIGN, share_host: bool = True):
        if isinstance(align, bool) or not isinstance(align, int) or align < ALIGN or align & (align - 1):
            raise ValueError(f"align must be a power of two of at least {ALIGN} bytes, got {align!r}")
        if not isinstance(share_host, bool):
            raise ValueError(f"share_host must be a bool, got {share_host!r}")
        #: the pinned host backup of paused GPU weights is a shared segment the engine reads
        self.share_host = share_host
        #: why the backup is private pinned memory after all (None: shared, or not made yet)
        self.host_unshared: str | None = None if share_host else "share_host=False"
        self._host_seg: Any = None
        if not layout:
            raise ValueError("flat weights: no tensors to lay out (empty model)")
        self.device = canonical_device(device)
        if self.device.type not in ("cuda", "cpu"):
            raise ValueError(f"flat weights live on cuda or cpu, got {self.device}")
        #: name -> (shape, dtype) as built
        self._layout = {name: (tuple(shape), dtype) for name, (shape, dtype) in layout.items()}
        #: name -> (start, end) byte range in the buffer
        self.slots: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, (shape, dtype) in layout.items():
            if not isinstance(dtype, torch.dtype):
                raise TypeError(f"flat weights: {name!r} has dtype {dtype!r}; expected a torch.dtype")
            start = (offset + align - 1) // align * align
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            self.slots[name] = (start, start + nbytes)
            offset = start + nbytes
        self.nbytes = max(offset, 1)
        self._seg: Any = None
        if self.device.type == "cuda":
            # A whole number of the allocator's 2 MiB large-segment rounding: the block
            # then fills its segment, no other tensor is carved from the tail, and
            # empty_cache can hand the whole segment back when the buffer is paused.
            self.nbytes = -(-self.nbytes // SEGMENT_ROUND) * SEGMENT_ROUND
            # a plain caching-allocator block (never a memory-saver region): one IPC handle covers it
            self._flat = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        else:
            from colo.proc.handles import ShmSegment

            self._seg = ShmSegment.create(self.nbytes)
            self._flat = self._seg.tensor
        self.tensors: dict[str, torch.Tensor] = {}
        for name, (shape, dtype) in layout.items():
            a, b = self.slots[name]
            self.tensors[name] = self._flat[a:b].view(dtype).view(tuple(shape))
        #: the tensors :meth:`check` looks at: the views (this very dict, so a view
        #: replaced in it is seen), or the parameters that adopted them
        self._owners: Mapping[str, torch.Tensor] = self.tensors
        self._host: torch.Tensor | None = None
        #: views of the host copy, made once: it is allocated once and kept
        self._host_views: dict[str, torch.Tensor] | None = None
        self.paused = False
        #: the last pause's seconds on a GPU: ``wait`` for the device (and, the first time, the
        #: host backup made), ``copy`` to the host, ``free`` (the block back to the driver)
        self.last_pause_s: dict[str, float] = {}
        #: the digest's spans of the last order and dtype asked (:meth:`digest`)
        self._spans: tuple[tuple[tuple[str, ...], torch.dtype], Any] | None = None

    # -- building --------------------------------------------------------------
    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], *, device: torch.device | str | None = None,
                     align: int = ALIGN, share_host: bool = True) -> FlatWeights:
        """A new buffer holding copies of ``tensors`` (on ``device``, default theirs)."""
        if not tensors:
            raise ValueError("flat weights: no tensors to lay out (empty model)")
        first = next(iter(tensors.values()))
        flat = cls({n: (tuple(t.shape), t.dtype) for n, t in tensors.items()},
                   device=device if device is not None else first.device, align=align, share_host=share_host)
        with torch.no_grad():
            for n, t in tensors.items():
                flat.tensors[n].copy_(t)
        return flat

    @classmethod
    def adopt(cls, module: torch.nn.Module, *, device: torch.device | str | None = None,
              align: int = ALIGN, share_host: bool = True) -> FlatWeights:
        """Move every parameter of ``module`` (a tied one once) into a new buffer:
        ``param.data`` becomes its view, so the optimizer, the forward and the
        extractor all read and write the flat buffer from now on. The old
        storage is freed when nothing else holds it."""
        return cls.adopt_params(dict(module.named_parameters()), device=device, align=align, share_host=share_host)

    @classmethod
    def adopt_params(cls, params: Mapping[str, torch.nn.Parameter], *, device: torch.device | str | None = None,
                     align: int = ALIGN, share_host: bool = True) -> FlatWeights:
        """:meth:`adopt` for some parameters only, under the names given (a LoRA trainer's
        adapter: what its syncs move, beside a frozen model that stays where it is)."""
        params = dict(params)
        flat = cls.from_tensors({n: p.detach() for n, p in params.items()}, device=device, align=align,
                                share_host=share_host)
        for n, p in params.items():
            p.data = flat.tensors[n]
        flat.track(params)
        return flat

    def track(self, owners: Mapping[str, torch.Tensor]) -> None:
        """Let :meth:`check` look at ``owners`` (name -> the tensor that must still be its
        view of the buffer) instead of the views themselves: the parameters that adopted
        them, or a mapping that reads where a wrapper keeps its storage now (an FSDP2
        parameter's local shard, :func:`colo.trainers.fsdp.adopt_shards`)."""
        self._owners = owners

    # -- what the sender asks ------------------------------------------------------
    def check(self) -> None:
        """Refuse weights that left the buffer: a parameter replaced or resized after
        it was built lives elsewhere now, so pausing the buffer would not move it
        and a sync out of the buffer would send its old bytes."""
        flat_storage = self._flat.untyped_storage()
        if self._owners.keys() != self.slots.keys():
            added = sorted(self._owners.keys() - self.slots.keys())
            gone = sorted(self.slots.keys() - self._owners.keys())
            raise ValueError(f"flat weights: the tensors are not the ones the buffer was built for (added "
                             f"{added}, removed {gone}); build the flat weights again after changing the model")
        for name, t in self._owners.items():
            a, b = self.slots[name]
            if (t.untyped_storage()._cdata != flat_storage._cdata or t.storage_offset() * t.element_size() != a
                    or t.numel() * t.element_size() != b - a or not t.is_contiguous()):
                shape, dtype = self._layout[name]
                raise ValueError(
                    f"flat weights: {name!r} is no longer its view of the flat buffer (now {tuple(t.shape)} "
                    f"{dtype_name(t.dtype)}, built as {tuple(shape)} {dtype_name(dtype)} at bytes "
                    f"[{a}, {b})): it was replaced or resized after the buffer was built; build the flat "
                    f"weights again after changing the model")

    def digest(self, order: Any, dtype: torch.dtype) -> str | None:
        """The contract digest (:mod:`colo.digest`) of the tensors named ``order`` as the buffer
        holds them now, if they all lie in it in ``dtype`` (None otherwise: a tensor the sender
        converts or that is not here), read where they lie: on a GPU one launch for all of them
        (:class:`colo.digest.Spans`, derived once per order), no work per tensor. Resident only
        (paused, the weights' digest is taken as they go to the host); the parameters must
        still be the buffer's views (:meth:`check`), or the buffer is not the weights."""
        from colo.digest import ReceivedDigest, Spans

        if self.paused and self.device.type == "cuda":
            return None
        self.check()
        key = (tuple(order), dtype)
        held = self._spans
        if held is None or held[0] != key:
            if any(n not in self.slots or self._layout[n][1] != dtype for n in key[0]):
                return None
            spans = Spans([(n, dtype_name(self._layout[n][1]), self._layout[n][0], self.slots[n][0],
                            self.slots[n][1] - self.slots[n][0]) for n in key[0]])
            held = self._spans = (key, spans)
        got = ReceivedDigest()
        got.add_spans(self._flat, held[1])
        return got.digest(key[0])

    def readable(self) -> torch.Tensor | None:
        """The bytes an engine can read the weights from now: the buffer while it is
        resident (and on the CPU always), the shared host backup while paused on a GPU;
        None when paused into a private backup."""
        if not self.paused or self.device.type != "cuda":
            return self._flat
        return self._host if self._host_seg is not None else None

    def locate(self, t: torch.Tensor) -> tuple[int, int] | None:
        """The byte range of ``t`` in :meth:`readable`, or None when ``t`` is not a
        contiguous view of it (a converted copy, a stale device view of paused
        weights, another buffer's)."""
        buf = self.readable()
        if buf is None or t.device != buf.device or not t.is_contiguous():
            return None
        if t.untyped_storage()._cdata != buf.untyped_storage()._cdata:
            return None
        start = t.storage_offset() * t.element_size()
        end = start + t.numel() * t.element_size()
        return (start, end) if end <= self.nbytes else None

    def locate_view(self, t: torch.Tensor) -> tuple[int, int, tuple[int, ...]] | None:
        """Where a view of :meth:`readable` lies, contiguous or not: ``(start, end, strides)``,
        ``start`` the byte of its first element, ``end`` past its last, ``strides`` in
        elements (a one-copy entry's ``view``: q of a fused QKV of several query groups is
        one run per group, other tensors' rows between). None where ``t`` is not a view of
        it or reaches outside it."""
        buf = self.readable()
        if buf is None or t.device != buf.device:
            return None
        if t.untyped_storage()._cdata != buf.untyped_storage()._cdata:
            return None
        strides = tuple(int(s) for s in t.stride())
        if any(s < 0 for s in strides):
            return None
        size = t.element_size()
        start = t.storage_offset() * size - buf.storage_offset() * buf.element_size()
        end = start + strided_span(t.shape, strides) * size
        return (start, end, strides) if 0 <= start and end <= self.nbytes else None

    def export(self) -> dict:
        """One handle for the whole of :meth:`readable`.

        Resident on a GPU, every call wraps the block in a new IPC reference count
        (torch's ``_share_cuda_``): send it to exactly one engine, which drops it
        at ``end_load``; the caller first makes sure no queued kernel still writes
        the weights (the engine reads outside our stream order). Paused, it is the
        shared host backup's handle, which the engine keeps mapped from sync to
        sync (registering it again each time would cost more than the sync)."""
        if self.paused and self.device.type == "cuda":
            if self._host_seg is None:
                raise RuntimeError(f"flat weights are paused into a private host backup ({self.host_unshared}): "
                                   f"there is nothing another process can read")
            return self._host_seg.handle()
        if self._seg is not None:
            return self._seg.handle()
        from colo.device.cuda_ipc import export_cuda

        return export_cuda(self._flat)

    # -- the memory backend's side ---------------------------------------------------
    def pause(self) -> None:
        """Copy to the pinned host backup and give the device memory back.

        The engine must have closed its mapping first (``end_load`` or
        ``drop_handles``): a block still mapped by another process stays
        allocated (torch keeps it until that process lets go) and the device
        does not get it back."""
        if self.paused:
            raise RuntimeError("flat weights are already paused")
        self.check()
        if self.device.type == "cuda":
            # kernels still reading or writing the weights finish before the copy
            t0 = time.perf_counter()
            torch.cuda.synchronize(self.device)
            if self._host is None:  # the first pause only
                self._host = self._new_host()
            t1 = time.perf_counter()
            self._host.copy_(self._flat)
            t2 = time.perf_counter()
            before = torch.cuda.memory_allocated(self.device)
            self._flat.untyped_storage().resize_(0)
            # the IPC reference counts of earlier exports, closed by the engine: freed now,
            # then the block goes back to the driver, not just to our cache
            torch.cuda.ipc_collect()
            held = self.nbytes - (before - torch.cuda.memory_allocated(self.device))
            torch.cuda.empty_cache()
            self.paused = True
            self.last_pause_s = {"wait": t1 - t0, "copy": t2 - t1, "free": time.perf_counter() - t2}
            if held > 0:
                # the weights are safe in the host copy; the memory is not back, and a
                # ledger that counted it free would let the engine's wake-up run out
                raise RuntimeError(
                    f"flat weights paused, but {held} B of their {self.nbytes} B buffer stay allocated: "
                    f"another process (the engine) still maps it; it must drop its handles "
                    f"(end_load or drop_handles) before the trainer offloads (torch.cuda.ipc_collect() "
                    f"frees it once it has). An export the engine never closed keeps it too: a request "
                    f"that failed before the engine opened the handle, an engine that died holding it")
            return
        self.paused = True

    def _new_host(self) -> torch.Tensor:
        """The pinned host backup, made at the first pause and kept: a shared segment
        when ``share_host`` and /dev/shm has room, else private pinned memory."""
        if self.share_host:
            from colo.device.cuda_ipc import PinnedShm
            from colo.core.errors import HandleError

            try:
                self._host_seg = PinnedShm.create(self.nbytes)
                self.host_unshared = None
                return self._host_seg.tensor
            except (HandleError, OSError) as e:
                self.host_unshared = f"{type(e).__name__}: {e}"
        return torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True)

    @property
    def host(self) -> torch.Tensor | None:
        """The whole host copy, flat (None on a GPU before the first pause made it)."""
        return self._flat if self.device.type == "cpu" else self._host

    @property
    def segment_names(self) -> list[str]:
        """The ``/dev/shm`` segments this buffer lives in: the buffer itself on the CPU, the
        shared host backup of paused GPU weights once made. Live storage, not leftovers."""
        return [seg.name for seg in (self._seg, self._host_seg) if seg is not None]

    @property
    def host_shared(self) -> bool:
        """The host backup exists and another process can read it."""
        return self._host_seg is not None

    def resume(self) -> None:
        """Take the device memory again and copy the weights back (queued on the
        current stream, ahead of whatever reads them next)."""
        if not self.paused:
            raise RuntimeError("flat weights are already resident")
        if self.device.type == "cuda":
            self._flat.untyped_storage().resize_(self.nbytes)
            self._flat.copy_(self._host, non_blocking=True)
        self.paused = False
        self.check()

    def host_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor as a view of the host copy (the pinned backup of paused GPU
        weights; the buffer itself on the CPU): an ``offload-first`` sync's source."""
        if self._seg is not None:
            return dict(self.tensors)
        if not self.paused:
            # the backup holds the weights of the last pause, not what the device holds now
            raise RuntimeError("flat weights are resident: their host copy is stale until they are paused")
        if self._host_views is None:
            # the same views every sync: an extractor built on them once stays valid
            self._host_views = {n: self._host[a:b].view(dtype).view(shape)
                                for (n, (shape, dtype)), (a, b) in zip(self._layout.items(), self.slots.values())}
        return dict(self._host_views)

    @property
    def resident_bytes(self) -> int:
        return 0 if self.paused and self.device.type == "cuda" else self.nbytes

    def close(self) -> None:
        """Free the buffer and the host copy; the views must not be used after."""
        self._owners = {}
        self.tensors = {}
        self._host = None
        self._host_views = None
        if self._host_seg is not None:
            self._host_seg.close()
            self._host_seg = None
        if self._seg is not None:
            self._flat = None
            self._seg.close()
            self._seg = None
        else:
            self._flat = None
