"""The bytes on the wire: SGLang's ``FlattenedTensorBucket`` metadata and the
JSON request fields every transport parses (never a pickle).

Pure data plus one torch view helper; the senders and receivers of every
transport import from here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from colo.core.buckets import ITEMSIZE, Bucket, itemsize, numel


class RequestError(ValueError):
    """A request or init info that does not have the fields its transport expects."""


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


@dataclass(frozen=True)
class TensorMeta:
    """One tensor of a bucket: where its bytes are in the flat buffer (SGLang's
    ``FlattenedTensorBucket`` entry: name, shape, dtype, start_idx, end_idx, numel)."""

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
                "start_idx": self.start, "end_idx": self.end, "numel": numel(self.shape)}

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
        start, end = d.get("start_idx", 0), d.get("end_idx", numel(shape) * itemsize(dtype))
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (start, end)):
            raise RequestError(f"{what}: start_idx and end_idx must be integers")
        limit = buffer_nbytes if buffer_nbytes is not None else end
        if not 0 <= start <= end <= limit or end - start != numel(shape) * itemsize(dtype):
            raise RequestError(f"bucket entry {name!r}: bytes [{start}, {end}) do not fit "
                               f"shape {shape} {dtype} in a {limit} B buffer")
        return cls(name, shape, dtype, start, end)

    @classmethod
    def of_bucket(cls, bucket: Bucket) -> list[TensorMeta]:
        return [cls(e.spec.name, e.spec.shape, e.spec.dtype, e.start, e.end) for e in bucket.entries]


def parse_tensors(d: Any, key: str, what: str, *, buffer_nbytes: int | None = None) -> tuple[TensorMeta, ...]:
    raw = get_field(d, key, list, what)
    return tuple(TensorMeta.from_json(m, buffer_nbytes=buffer_nbytes) for m in raw)


def views(flat: Any, tensors: Sequence[TensorMeta]) -> list[tuple[str, Any]]:
    """``(name, tensor)`` views into a flat uint8 buffer: no copy; valid while ``flat`` is."""
    import torch

    out = []
    for m in tensors:
        if m.end > flat.numel():
            raise RequestError(f"bucket entry {m.name!r}: bytes [{m.start}, {m.end}) do not fit "
                               f"shape {m.shape} {m.dtype} in a {flat.numel()} B buffer")
        out.append((m.name, flat[m.start:m.end].view(getattr(torch, m.dtype)).view(m.shape)))
    return out
