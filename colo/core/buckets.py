"""Pure bucket planning from tensor metadata.

A bucket is one flat byte buffer (SGLang's ``FlattenedTensorBucket`` layout:
one uint8 tensor plus, per tensor, name, shape, dtype, start and end offsets
and numel). Planning needs no tensors, so replay, tuning and the engine's
preflight can run it offline and agree with the sender byte for byte.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from colo.core.interfaces import TensorSpec

ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}
#: Offsets are rounded up to this many bytes: enough for every dtype above
#: and for 16-byte vector loads when a bucket is sliced back into tensors.
ALIGN = 16


def itemsize(dtype: str) -> int:
    name = dtype.removeprefix("torch.")
    try:
        return ITEMSIZE[name]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(ITEMSIZE)}") from None


def numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _check_shape(name: str, shape: tuple[int, ...]) -> None:
    if any(d < 0 for d in shape):
        raise ValueError(f"tensor {name!r}: shape {shape} has a negative dimension")


def spec(name: str, shape: Sequence[int], dtype: str) -> TensorSpec:
    dtype = dtype.removeprefix("torch.")
    shape = tuple(int(d) for d in shape)
    _check_shape(name, shape)
    return TensorSpec(name=name, shape=shape, dtype=dtype, nbytes=numel(shape) * itemsize(dtype))


@dataclass(frozen=True)
class Entry:
    spec: TensorSpec
    start: int  # byte offset in the bucket
    end: int


@dataclass(frozen=True)
class Bucket:
    index: int
    entries: tuple[Entry, ...]
    nbytes: int  # the flat buffer's size, padding included

    @property
    def payload_bytes(self) -> int:
        return sum(e.spec.nbytes for e in self.entries)


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def plan_buckets(specs: Sequence[TensorSpec], budget_bytes: int, *, align: int = ALIGN) -> list[Bucket]:
    """Greedy, order-preserving packing under ``budget_bytes``.

    Every tensor lands in exactly one bucket, in the given order. A bucket
    exceeds the budget only when it holds a single tensor larger than it.
    Each offset is a multiple of ``align`` and of the tensor's itemsize, so
    the receiver can view the bytes as the tensor without a copy.
    """
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
        raise ValueError(f"bucket budget must be a positive number of bytes, got {budget_bytes!r}")
    if isinstance(align, bool) or not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise ValueError(f"align must be a positive power of two, got {align!r}")
    seen: set[str] = set()
    for s in specs:
        if s.name in seen:
            raise ValueError(f"tensor {s.name!r} appears twice; every tensor must be sent once")
        seen.add(s.name)
        _check_shape(s.name, s.shape)
        expected = numel(s.shape) * itemsize(s.dtype)
        if s.nbytes != expected:
            raise ValueError(f"tensor {s.name!r}: nbytes {s.nbytes} does not match shape {s.shape} "
                             f"and dtype {s.dtype} (expected {expected})")
    buckets: list[Bucket] = []
    current: list[Entry] = []
    offset = 0

    def close() -> None:
        nonlocal current, offset
        if current:
            buckets.append(Bucket(len(buckets), tuple(current), current[-1].end))
        current, offset = [], 0

    for s in specs:
        # itemsizes are powers of two, so the larger of the two is a multiple of both
        start = _round_up(offset, max(align, itemsize(s.dtype)))
        if current and start + s.nbytes > budget_bytes:
            close()
            start = 0
        current.append(Entry(s, start, start + s.nbytes))
        offset = start + s.nbytes
        if offset >= budget_bytes:
            close()
    close()
    return buckets
