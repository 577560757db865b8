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
"""

from __future__ import annotations

import base64
from typing import Any

import torch

from colo.handles import HandleError, register_rebuilder


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
