"""CUDA IPC handles as plain JSON, keyed by GPU UUID.

The sender exports a staging buffer with ``UntypedStorage._share_cuda_()``
(what ``torch.multiprocessing`` does under its pickler) and writes the fields
into a JSON handle, naming the GPU by UUID rather than by index: the engine may
run under a different ``CUDA_VISIBLE_DEVICES`` and see the same GPU as another
index. The receiver maps the UUID back to its local index and rebuilds the
tensor with torch's ``rebuild_cuda_tensor`` — the one allow-listed function
for this handle kind.

Staging buffers must be plain ``cudaMalloc`` allocations: memory inside a
torch_memory_saver region is a virtual-memory mapping that
``cudaIpcGetMemHandle`` cannot export.

The second kind, ``pinned_shm`` (:class:`PinnedShm`), is host memory: a shared
segment both processes page-lock, which the engine copies straight out of.
"""

from __future__ import annotations

import base64
import ctypes
import os
import weakref
from typing import Any

import torch

from colo.proc.handles import HandleError, ShmSegment, register_rebuilder, shm_room


def _b64(b: bytes | None) -> str | None:
    return None if b is None else base64.b64encode(b).decode("ascii")


def _unb64(s: Any, field: str) -> bytes | None:
    if s is None:
        return None
    if not isinstance(s, str):
        raise HandleError(f"cuda_ipc handle field {field} must be base64 text")
    return base64.b64decode(s.encode("ascii"), validate=True)


def gpu_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def local_index(uuid: str) -> int:
    for i in range(torch.cuda.device_count()):
        if gpu_uuid(i) == uuid:
            return i
    seen = ", ".join(gpu_uuid(i) for i in range(torch.cuda.device_count())) or "none"
    raise HandleError(f"GPU {uuid} is not visible to this process (visible: {seen})")


def export_cuda(t: torch.Tensor) -> dict:
    """A JSON handle for a contiguous 1-D uint8 CUDA tensor (a whole staging buffer)."""
    if t.device.type != "cuda" or t.dtype != torch.uint8 or t.dim() != 1 or not t.is_contiguous():
        raise ValueError(f"export_cuda takes a contiguous 1-D uint8 CUDA tensor, got {t.dtype} {tuple(t.shape)} on {t.device}")
    (device, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync) = t.untyped_storage()._share_cuda_()
    return {"kind": "cuda_ipc", "gpu_uuid": gpu_uuid(device), "handle": _b64(handle), "storage_size": size,
            "storage_offset": offset, "ref_counter_handle": _b64(rc_handle), "ref_counter_offset": rc_offset,
            "event_handle": _b64(ev_handle), "event_sync_required": bool(ev_sync), "nbytes": t.numel(),
            "tensor_offset": t.storage_offset()}


class CudaAttachment:
    """A staging buffer of another process, opened here."""

    def __init__(self, handle: dict):
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        nbytes = handle.get("nbytes")
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise HandleError(f"cuda_ipc handle nbytes must be a positive integer, got {nbytes!r}")
        self.name = handle.get("handle")
        self.nbytes = nbytes
        idx = local_index(str(handle.get("gpu_uuid")))
        self.tensor: torch.Tensor | None = rebuild_cuda_tensor(
            torch.Tensor, (nbytes,), (1,), int(handle.get("tensor_offset", 0)), torch.UntypedStorage, torch.uint8,
            idx, _unb64(handle.get("handle"), "handle"), int(handle["storage_size"]),
            int(handle["storage_offset"]), False, _unb64(handle.get("ref_counter_handle"), "ref_counter_handle"),
            int(handle["ref_counter_offset"]), _unb64(handle.get("event_handle"), "event_handle"),
            bool(handle.get("event_sync_required")))

    def close(self) -> None:
        # Dropping the last reference releases the producer's ref counter; the
        # producer's ipc_collect() can then free the block.
        self.tensor = None


register_rebuilder("cuda_ipc", CudaAttachment)


# -- pinned host memory another process can map ------------------------------------------

def _cudart_ok(err: Any, what: str) -> None:
    if int(err) != 0:
        raise HandleError(f"{what} failed: {torch.cuda.cudart().cudaGetErrorString(err)}")


class PinnedShm:
    """A ``/dev/shm`` segment page-locked with ``cudaHostRegister``: pinned host memory
    that another process maps and registers too.

    Why: the host copy of paused weights is what an ``offload-first`` sync uploads. In
    private pinned memory (``torch.empty(pin_memory=True)``) only the trainer can read
    it, so the sync uploads it into device staging buffers and the engine copies out of
    those: two copies, a cudaMalloc and an IPC open per buffer every sync, and the last
    bucket's load exposed at the end. Shared and registered on both sides, the engine
    copies straight out of it into its parameters at the pinned host-to-device rate
    (issue 18, item 1). Registering is slow (it pins every page), so both sides
    register once and keep the mapping from sync to sync (the handle says ``keep``).

    Off a GPU (a CPU engine reading it) the segment is mapped and not registered."""

    kind = "pinned_shm"

    def __init__(self, seg: ShmSegment, *, register: bool):
        self.seg = seg
        self.name, self.nbytes = seg.name, seg.nbytes
        self.tensor: torch.Tensor | None = seg.tensor
        self._ptr: int | None = None
        if register:
            try:
                ptr = self.tensor.data_ptr()
                # a read-only mapping (the engine's) is pinned read-only: the device only reads it
                flags = 0 if seg.writable else CUDA_HOST_REGISTER_READ_ONLY
                _cudart_ok(torch.cuda.cudart().cudaHostRegister(ptr, self.nbytes, flags),
                           f"cudaHostRegister{'' if seg.writable else ' (read-only)'} of {self.nbytes} B of "
                           f"shared memory {self.name}")
            except BaseException:
                self.tensor = None
                seg.close()
                raise
            self._ptr = ptr
        # A backup dropped without close() (a trainer object let go of) would otherwise
        # keep its pages registered and its file in /dev/shm, which holds them in RAM
        # until the machine's next boot: seen as a benchmark killed by the OOM killer
        # after its first model's 15 GB backup outlived the model.
        self._release = weakref.finalize(self, _release_pinned, self._ptr, seg)

    @property
    def registered(self) -> bool:
        return self._ptr is not None

    @classmethod
    def create(cls, nbytes: int) -> PinnedShm:
        room = shm_room()
        if nbytes > room:
            raise HandleError(f"pinned shared host memory: /dev/shm has {room} B free, {nbytes} B needed")
        return cls(ShmSegment.create(nbytes), register=True)

    def handle(self) -> dict:
        return {"kind": self.kind, "name": self.name, "nbytes": self.nbytes, "keep": True}

    def close(self) -> None:
        self.tensor = None
        self._ptr = None
        self._release()


def _release_pinned(ptr: int | None, seg: ShmSegment) -> None:
    """Unregister (before the pages are unmapped, whoever still holds a view), then
    close the segment: its owner unlinks the file."""
    try:
        if ptr is not None:
            _cudart_ok(torch.cuda.cudart().cudaHostUnregister(ptr), f"cudaHostUnregister of {seg.name}")
    finally:
        seg.close()


#: ``cudaHostRegisterReadOnly``: pin pages the device will only read (a PROT_READ mapping
#: cannot be pinned for writing)
CUDA_HOST_REGISTER_READ_ONLY = 0x08
#: ``cudaDevAttrHostRegisterReadOnlySupported``
_ATTR_HOST_REGISTER_READ_ONLY = 113


def read_only_pinning() -> bool:
    """Whether the current GPU can pin host memory read-only
    (``cudaDevAttrHostRegisterReadOnlySupported``). Asked of the CUDA runtime torch loaded;
    where it cannot be asked, False: the receiver then maps the backup read-write to pin it."""
    get = _cudart_function("cudaDeviceGetAttribute")
    if get is None:
        return False
    value = ctypes.c_int(0)
    err = get(ctypes.byref(value), _ATTR_HOST_REGISTER_READ_ONLY, ctypes.c_int(torch.cuda.current_device()))
    return int(err) == 0 and value.value == 1


def _cudart_function(name: str) -> Any:
    """``name`` from the CUDA runtime library this process already loaded (torch's), or None.
    torch's own binding (``torch.cuda.cudart()``) has no attribute query."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            paths = sorted({line.split()[-1] for line in f if "/libcudart.so" in line})
    except OSError:
        paths = []
    for path in paths:
        try:
            return getattr(ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL), name)
        except (OSError, AttributeError):
            continue
    try:  # a runtime linked into torch itself: the process's own namespace
        return getattr(ctypes.CDLL(None), name)
    except AttributeError:
        return None


def _open_pinned(handle: dict) -> PinnedShm:
    register = torch.cuda.is_available() and torch.cuda.is_initialized()
    # read-only wherever it can be pinned so (issue 32): the engine only copies out of it
    writable = register and not read_only_pinning()
    seg = ShmSegment(handle.get("name", ""), handle.get("nbytes"), create=False, writable=writable)
    return PinnedShm(seg, register=register)


register_rebuilder("pinned_shm", _open_pinned)
