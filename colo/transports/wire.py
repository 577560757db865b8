"""The bytes on the wire: SGLang's ``FlattenedTensorBucket`` metadata and the
JSON request fields every transport parses (never a pickle).

Pure data plus one torch view helper; the senders and receivers of every
transport import from here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from colo.core.buckets import ALIGN, ITEMSIZE, Bucket, itemsize, numel, plan_buckets
from colo.errors import RequestError


def get_field(d: Any, key: str, kind: type | tuple[type, ...], what: str) -> Any:
    if not isinstance(d, dict):
        raise RequestError(f"{what} must be a JSON object, got {type(d).__name__}")
    if key not in d:
        raise RequestError(f"{what} has no field {key!r}")
    value = d[key]
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise RequestError(f"{what} field {key!r} must be {_kind_name(kind)}, got a bool")
    if not isinstance(value, kind):
        raise RequestError(f"{what} field {key!r} must be {_kind_name(kind)}, got {type(value).__name__}")
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


@dataclass(frozen=True)
class EmptyInitInfo:
    """Nothing to set up: the handles in each request are all the engine needs."""

    def to_json(self) -> dict:
        return {}

    @classmethod
    def from_json(cls, d: Any) -> EmptyInitInfo:
        if not isinstance(d, dict):
            raise RequestError(f"init info must be a JSON object, got {type(d).__name__}")
        return cls()


#: The two layouts of a bucket, as ``align`` values for :func:`colo.core.buckets.plan_buckets`.
#:
#: ``UNPADDED`` is SGLang's: tensors back to back, as ``FlattenedTensorBucket``
#: concatenates them and as its broadcast receiver (``FlattenedTensorBucket.empty``)
#: recomputes the offsets from names, dtypes and shapes alone. The only padding
#: left is the one a view needs (below): a tensor whose back-to-back offset is not
#: a multiple of its itemsize is moved up to the next multiple. SGLang cannot
#: carry such a bucket at all (its ``empty`` refuses it, and its
#: ``reconstruct_tensors`` fails on the view), so whenever SGLang's own layout is
#: valid, this one is byte for byte the same.
#:
#: ``PADDED`` is where colo pads: ``plan_buckets``' default, the plan
#: ``BucketSender`` makes for every transport; it starts each tensor on a 16-byte boundary.
#: Only the itemsize alignment is needed for correctness: ``flat[a:b].view(dtype)``
#: refuses a uint8 slice whose start is not a multiple of the dtype's size, and
#: that is how every receiver here (and SGLang's) rebuilds tensors without a copy.
#: The 16 bytes are for speed: the loader's copies out of the views and CUDA's
#: elementwise kernels take their 128-bit vectorised path only when a tensor's
#: address is 16-byte aligned, and fall back to narrower loads otherwise. It
#: costs under 16 bytes per tensor. SGLang's IPC receive path
#: (``FlattenedTensorBucket(flattened_tensor=..., metadata=...)``) takes padded
#: buckets as they are, since it reads the offsets from the metadata.
UNPADDED = 1
PADDED = ALIGN


def relayout(bucket: Bucket, *, align: int) -> Bucket:
    """The same tensors in the same order and the same bucket index, at the
    offsets :func:`plan_buckets` gives them under ``align`` (e.g. ``UNPADDED``).

    A sender plans its buckets once, with the default alignment; a transport
    that writes another layout re-lays each bucket. A smaller ``align`` never
    makes a bucket larger, so buffers sized for the padded plan still fit.
    """
    specs = [e.spec for e in bucket.entries]
    # room for every tensor and its worst-case padding: one bucket, never split
    room = sum(s.nbytes + max(align, itemsize(s.dtype)) for s in specs) + 1
    (out,) = plan_buckets(specs, room, align=align)
    return Bucket(bucket.index, out.entries, out.nbytes)


@dataclass(frozen=True)
class TensorMeta:
    """One tensor of a bucket: where its bytes are in the flat uint8 buffer.

    On the wire it is SGLang's ``FlattenedTensorMetadata``, field for field and
    in its order: ``name``, ``shape``, ``dtype``, ``start_idx``, ``end_idx``,
    ``numel``, where the offsets are bytes into the uint8 buffer and ``numel``
    is the entry's byte count (``end_idx - start_idx``; SGLang counts the
    elements of the tensor viewed as uint8), not the tensor's element count.
    ``shape`` is a list and ``dtype`` the torch dtype's name without the
    ``torch.`` prefix (``"bfloat16"``), the string form SGLang's receivers
    resolve with ``getattr(torch, dtype)``.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    def to_json(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype,
                "start_idx": self.start, "end_idx": self.end, "numel": self.nbytes}

    @classmethod
    def from_json(cls, d: Any, *, buffer_nbytes: int | None = None) -> TensorMeta:
        name = get_field(d, "name", str, "tensor entry")
        what = f"bucket entry {name!r}"
        dtype = get_field(d, "dtype", str, what)
        if dtype not in ITEMSIZE:
            raise RequestError(f"{what}: dtype {dtype!r} is not allowed; expected one of {', '.join(ITEMSIZE)}")
        shape_raw = get_field(d, "shape", list, what)
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in shape_raw):
            raise RequestError(f"{what}: shape must be a list of non-negative integers, got {shape_raw!r}")
        shape = tuple(shape_raw)
        size = numel(shape) * itemsize(dtype)
        start, end = d.get("start_idx", 0), d.get("end_idx", size)
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (start, end)):
            raise RequestError(f"{what}: start_idx and end_idx must be integers")
        limit = buffer_nbytes if buffer_nbytes is not None else end
        if not 0 <= start <= end <= limit or end - start != size:
            raise RequestError(f"bucket entry {name!r}: bytes [{start}, {end}) do not fit "
                               f"shape {shape} {dtype} in a {limit} B buffer")
        if "numel" in d:
            count = d["numel"]
            if isinstance(count, bool) or not isinstance(count, int) or count != end - start:
                raise RequestError(f"{what}: numel {count!r} is not the entry's byte count "
                                   f"end_idx - start_idx = {end - start} (SGLang's FlattenedTensorMetadata "
                                   f"counts bytes of the uint8 buffer, not elements)")
        if start % itemsize(dtype):
            raise RequestError(f"{what}: start_idx {start} is not a multiple of {dtype}'s "
                               f"{itemsize(dtype)} bytes; the tensor cannot be viewed in place")
        return cls(name, shape, dtype, start, end)

    @classmethod
    def of_bucket(cls, bucket: Bucket) -> list[TensorMeta]:
        return [cls(e.spec.name, e.spec.shape, e.spec.dtype, e.start, e.end) for e in bucket.entries]


def parse_tensors(d: Any, key: str, what: str, *, buffer_nbytes: int | None = None) -> tuple[TensorMeta, ...]:
    raw = get_field(d, key, list, what)
    return tuple(TensorMeta.from_json(m, buffer_nbytes=buffer_nbytes) for m in raw)


def views(flat: Any, tensors: Sequence[TensorMeta]) -> list[tuple[str, Any]]:
    """``(name, tensor)`` views into a flat uint8 buffer: no copy; valid while ``flat`` is.

    Each start must be a multiple of its dtype's size (``from_json`` checks
    it): a uint8 slice can be viewed as a wider dtype only from such an offset.
    """
    import torch

    out = []
    for m in tensors:
        if m.end > flat.numel():
            raise RequestError(f"bucket entry {m.name!r}: bytes [{m.start}, {m.end}) do not fit "
                               f"shape {m.shape} {m.dtype} in a {flat.numel()} B buffer")
        out.append((m.name, flat[m.start:m.end].view(getattr(torch, m.dtype)).view(m.shape)))
    return out
