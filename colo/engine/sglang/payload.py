"""SGLang's flattened bucket as a payload: what colo's SGLang sender writes, and colo's own
allow-listed reader of it.

The payload of one bucket for TP rank r is what SGLang's own
``MultiprocessingSerializer.serialize`` makes of ``{"flattened_tensor": flat_r,
"metadata": [FlattenedTensorMetadata, ...]}``: a ForkingPickler pickle in which
a CUDA tensor is a CUDA IPC handle (its device as the GPU's UUID, as SGLang's
own ``monkey_patch_torch_reductions`` writes it) and the metadata are SGLang's
class by name, which SGLang's ``SafeUnpickler`` allows. colo writes it without
importing SGLang: the trainer's environment need not hold SGLang (0.5.23 pins
torch 2.14.1). ``flat_r`` is that rank's own copy of the bucket, on its GPU.

Importing this module imports no SGLang.
"""

from __future__ import annotations

import base64
import copyreg
import io
import os
import pickle
from collections.abc import Sequence
from typing import Any

import torch

from colo.core.buckets import Bucket
from colo.transports.wire import TensorMeta

#: where SGLang keeps the metadata class its SafeUnpickler allows in a payload
META_CLASS = ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata")
#: torch's reduce_tensor puts a CUDA tensor's device index at this argument (SGLang's
#: patch_torch._REDUCE_TENSOR_ARG_DEVICE_INDEX): colo writes the GPU's UUID there
_DEVICE_ARG = 6


# -- the payload ------------------------------------------------------------------------------

class _Meta:
    """One tensor of a bucket, pickled as SGLang's ``FlattenedTensorMetadata`` (a plain
    dataclass, rebuilt by ``__new__`` and its ``__dict__``: what pickling SGLang's own
    instance writes)."""

    def __init__(self, name: str, shape: torch.Size, dtype: torch.dtype, start_idx: int, end_idx: int,
                 numel: int):
        self.name, self.shape, self.dtype = name, shape, dtype
        self.start_idx, self.end_idx, self.numel = start_idx, end_idx, numel

    def __reduce_ex__(self, protocol: int) -> tuple:
        return copyreg.__newobj__, (_Meta,), dict(self.__dict__)


def _reduce_tensor(t: torch.Tensor) -> tuple:
    from torch.multiprocessing.reductions import reduce_tensor

    rebuild, args = reduce_tensor(t)
    if t.is_cuda and isinstance(args[_DEVICE_ARG], int):  # (SGLang's own patch, where loaded, wrote it)
        # The receiver may see other CUDA_VISIBLE_DEVICES: name the GPU by its UUID, which
        # SGLang's patched rebuild_cuda_tensor maps back to its own index
        uuid = str(torch.cuda.get_device_properties(args[_DEVICE_ARG]).uuid)
        args = (*args[:_DEVICE_ARG], uuid, *args[_DEVICE_ARG + 1:])
    return rebuild, args


class _Pickler(pickle._Pickler):
    """ForkingPickler's reductions in Python's own pickler, which lets colo name SGLang's
    metadata class without importing SGLang (the C pickler imports every class it names)."""

    def __init__(self, file: Any):
        import torch.multiprocessing  # noqa: F401  (registers torch's reductions with ForkingPickler)
        from multiprocessing.reduction import ForkingPickler

        super().__init__(file, protocol=pickle.DEFAULT_PROTOCOL)
        self.dispatch_table = copyreg.dispatch_table.copy()
        self.dispatch_table.update(ForkingPickler._extra_reducers)
        self.dispatch_table[torch.Tensor] = _reduce_tensor

    def save_global(self, obj: Any, name: str | None = None) -> None:
        if obj is not _Meta:
            return super().save_global(obj, name)
        module, qualname = META_CLASS
        self.save(module)
        self.save(qualname)
        self.write(pickle.STACK_GLOBAL)
        self.memoize(obj)


def bucket_metadata(laid: Bucket) -> list[dict]:
    """The bucket's entries as SGLang's metadata fields (JSON: name, shape, dtype, start_idx,
    end_idx, numel in bytes). SGLang loads whole tensors only: a piece, or one rank's slice
    (``rank_slice``: its metadata would read as a whole tensor of the slice's shape), is
    refused here."""
    metas = [m.to_json() for m in TensorMeta.of_bucket(laid)]
    pieces = [m["name"] for m in metas if "piece_offset" in m]
    if pieces:
        raise ValueError(f"SGLang's flattened_bucket has no pieces: {', '.join(pieces)} must travel whole")
    strided = [m["name"] for m in metas if "strides" in m]
    if strided:  # SGLang reads [start_idx, end_idx) as the tensor's row-major bytes
        raise ValueError(f"SGLang's flattened_bucket has no strided tensors: {', '.join(strided)} must be packed")
    sliced = [m["name"] for m in metas if "rank_slice" in m]
    if sliced:
        raise ValueError(f"SGLang's flattened_bucket takes whole tensors: {', '.join(sliced[:5])} arrived cut "
                         f"for one engine rank (rank_slice); extract them whole (no expert scatter)")
    return metas


def serialize_payload(flat: torch.Tensor, metadata: Sequence[dict]) -> str:
    """One rank's payload, base64 as SGLang's HTTP route and ``Engine`` both take it."""
    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError(f"a flattened bucket is a 1-d uint8 tensor, got {flat.dtype} of shape {tuple(flat.shape)}")
    metas = [_Meta(m["name"], torch.Size(m["shape"]), getattr(torch, m["dtype"]), int(m["start_idx"]),
                   int(m["end_idx"]), int(m["numel"])) for m in metadata]
    buf = io.BytesIO()
    _Pickler(buf).dump({"flattened_tensor": flat, "metadata": metas})
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _device_of_uuid(uuid: str) -> int:
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == uuid:
            return index
    raise ValueError(f"SGLang payload names GPU {uuid}, which this process cannot see "
                     f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})")


def _rebuild_cuda_tensor(*args: Any) -> torch.Tensor:
    """torch's rebuild of an IPC-shared CUDA tensor, its device given as the GPU's UUID
    (SGLang's ``_rebuild_cuda_tensor_modified`` reads it the same way)."""
    from torch.multiprocessing import reductions

    device = args[_DEVICE_ARG]
    if isinstance(device, str):
        device = _device_of_uuid(device)
    return reductions.rebuild_cuda_tensor(*args[:_DEVICE_ARG], device, *args[_DEVICE_ARG + 1:])


class _PayloadUnpickler(pickle.Unpickler):
    """colo's receiver of a payload: the globals a flattened bucket's pickle names and no
    other (a payload is never trusted with an arbitrary global: SGLang had a CVE there)."""

    REDUCTIONS = frozenset({"rebuild_tensor", "rebuild_storage_fd", "rebuild_storage_filename",
                            "rebuild_storage_empty", "rebuild_typed_storage", "rebuild_typed_storage_child"})

    def find_class(self, module: str, name: str) -> Any:
        from torch.multiprocessing import reductions

        if (module, name) == META_CLASS:
            return _Meta
        if module == "torch.multiprocessing.reductions" and name == "rebuild_cuda_tensor":
            return _rebuild_cuda_tensor
        if module == "torch.multiprocessing.reductions" and name in self.REDUCTIONS:
            return getattr(reductions, name)
        if module == "torch" and (name in ("Size", "Tensor", "UntypedStorage")
                                  or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        if (module, name) in (("copyreg", "__newobj__"), ("multiprocessing.resource_sharer", "DupFd"),
                              ("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage")):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"SGLang payload names {module}.{name}, which a flattened bucket "
                                     f"never holds: refused")


def decode_payload(payload: str | bytes) -> tuple[torch.Tensor, list[dict]]:
    """One rank's payload back to (the flat uint8 tensor, its metadata as JSON fields):
    colo's own receiver of SGLang's format. A CUDA tensor is mapped from the sender's
    GPU, found by its UUID among this process's devices."""
    import torch.multiprocessing  # noqa: F401  (torch's storage reductions)

    data = base64.b64decode(payload, validate=True) if isinstance(payload, str) else bytes(payload)
    obj = _PayloadUnpickler(io.BytesIO(data)).load()
    if not isinstance(obj, dict) or set(obj) != {"flattened_tensor", "metadata"}:
        raise ValueError(f"SGLang payload is not a flattened bucket: {type(obj).__name__} "
                         f"{sorted(obj) if isinstance(obj, dict) else ''}")
    flat = obj["flattened_tensor"]
    metadata = [{"name": m.name, "shape": list(m.shape), "dtype": str(m.dtype).removeprefix("torch."),
                 "start_idx": m.start_idx, "end_idx": m.end_idx, "numel": m.numel} for m in obj["metadata"]]
    return flat, metadata


def bucket_views(flat: torch.Tensor, metadata: Sequence[dict]) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a flat bucket as SGLang's ``FlattenedTensorBucket.reconstruct_tensors``
    reads them: bytes [start_idx, end_idx) viewed as the dtype, reshaped."""
    return [(m["name"], flat[m["start_idx"]:m["end_idx"]].view(getattr(torch, m["dtype"])).reshape(m["shape"]))
            for m in metadata]


__all__ = ["META_CLASS", "bucket_metadata", "bucket_views", "decode_payload", "serialize_payload"]
