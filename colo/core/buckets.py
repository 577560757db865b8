"""Pure bucket planning from tensor metadata.

A bucket is one flat byte buffer (SGLang's ``FlattenedTensorBucket`` layout:
one uint8 tensor plus, per tensor, name, shape, dtype, start and end offsets
and numel). Planning needs no tensors, so replay, tuning and the engine's
preflight can run it offline and agree with the sender byte for byte.

Staging is bounded: a tensor larger than the budget is cut into pieces, each
a byte range of the tensor's row-major bytes (``Entry.offset`` on), that fill
consecutive buckets and are written back in place by the engine. So no
bucket exceeds the budget (unless the budget is below one aligned unit,
:data:`ALIGN` bytes), and the two buffers a pipelined sender holds never
exceed twice the budget, whatever the largest tensor (Qwen2-7B's embedding
alone is 1.09 GB). A tensor that fits the budget is never cut: it moves to
the next bucket when the current one has no room for it.
"""

from __future__ import annotations

import functools

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


def strided_span(shape: Sequence[int], strides: Sequence[int]) -> int:
    """Elements from a strided view's first to its last, both counted (0 when it has none):
    the view reads nothing outside ``[first, first + span)``. Here, under the layers that use
    it (an ``Entry``'s ``view``; ``colo.device.flat_weights`` locating a view in its buffer, the
    wire's check of one), so that none of them imports another's layer for it."""
    if any(int(d) == 0 for d in shape):
        return 0
    return 1 + sum((int(d) - 1) * int(s) for d, s in zip(shape, strides))


def _check_shape(name: str, shape: tuple[int, ...]) -> None:
    if any(d < 0 for d in shape):
        raise ValueError(f"tensor {name!r}: shape {shape} has a negative dimension")


def spec(name: str, shape: Sequence[int], dtype: str) -> TensorSpec:
    dtype = dtype.removeprefix("torch.")
    shape = tuple(int(d) for d in shape)
    _check_shape(name, shape)
    return TensorSpec(name=name, shape=shape, dtype=dtype, nbytes=numel(shape) * itemsize(dtype))


def rank_slice_spec(name: str, whole_shape: Sequence[int], dtype: str, dim: int, start: int, length: int
                    ) -> TensorSpec:
    """The spec of block ``[start, start + length)`` of dimension ``dim`` of a tensor of
    ``whole_shape``: what travels when the sender cuts it for one engine rank
    (``TensorSpec.rank_slice``). Refuses a block outside the tensor."""
    whole = tuple(int(d) for d in whole_shape)
    _check_shape(name, whole)
    if not 0 <= dim < len(whole) or start < 0 or length <= 0 or start + length > whole[dim]:
        raise ValueError(f"tensor {name!r}: block [{start}, {start + length}) of dimension {dim} is not "
                         f"inside its shape {whole}")
    s = spec(name, (*whole[:dim], length, *whole[dim + 1:]), dtype)
    return TensorSpec(name=s.name, shape=s.shape, dtype=s.dtype, nbytes=s.nbytes, rank_slice=(dim, start, whole[dim]))


@dataclass(frozen=True)
class Entry:
    """Bytes ``[offset, offset + end - start)`` of tensor ``spec`` at ``[start, end)`` of
    the bucket: the whole tensor (``offset`` 0, ``end - start == spec.nbytes``) or a piece.

    Or, with ``view``, the whole tensor lying strided in ``[start, end)``: ``view`` is
    ``(shape, strides)`` in elements, from the element at ``start``, a shape whose
    row-major elements are the tensor's (q of a fused QKV of several query groups is
    ``(groups, rows of a group, hidden)``: one run per group, k and v between them). Only
    a one-copy bucket has such entries (the trainer's own buffer, read where it lies);
    a planned bucket's tensors are packed back to back."""

    spec: TensorSpec
    start: int  # byte offset in the bucket
    end: int
    offset: int = 0  # byte offset in the tensor (a piece of a tensor larger than the budget)
    view: tuple[tuple[int, ...], tuple[int, ...]] | None = None

    @property
    def nbytes(self) -> int:
        """The tensor's bytes this entry carries (a strided one's span holds others' too)."""
        return self.spec.nbytes if self.view is not None else self.end - self.start

    @property
    def whole(self) -> bool:
        return self.offset == 0 and self.nbytes == self.spec.nbytes

    @property
    def first(self) -> bool:
        """The tensor's first bytes are here: the extractor produces it in this bucket."""
        return self.offset == 0

    @property
    def last(self) -> bool:
        """The tensor's last bytes are here: once loaded, the tensor is complete."""
        return self.offset + self.nbytes == self.spec.nbytes


@dataclass(frozen=True)
class Bucket:
    index: int
    entries: tuple[Entry, ...]
    nbytes: int  # the flat buffer's size, padding included

    # computed once: a sync asks several times (its records, its result), over hundreds of
    # entries, and a frozen bucket's entries never change
    @functools.cached_property
    def payload_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    @property
    def extract_names(self) -> list[str]:
        """The tensors whose first bytes are in this bucket: what the sender asks the
        extractor for (a piece after the first comes from the tensor extracted in an
        earlier bucket). Every rank of a multi-rank trainer asks for exactly these,
        bucket by bucket, so their collectives line up."""
        return [e.spec.name for e in self.entries if e.first]

    @functools.cached_property
    def completed(self) -> int:
        """Tensors whose last bytes are in this bucket: how many a load of it completes."""
        return sum(1 for e in self.entries if e.last)


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def plan_buckets(specs: Sequence[TensorSpec], budget_bytes: int, *, align: int = ALIGN,
                 split: bool = True) -> list[Bucket]:
    """Greedy, order-preserving packing under ``budget_bytes``.

    Every byte of every tensor lands exactly once, in the given order. A
    tensor that fits the budget lands whole in one bucket; a larger one is
    cut into pieces: the first fills what is left of the current bucket, the
    next ones fill whole buckets, the last may share its bucket with the
    tensors after it. Each piece but the last is a multiple of
    ``max(align, itemsize)`` bytes long. No bucket exceeds the budget unless
    the budget is smaller than that unit. Each offset (in the bucket and in the
    tensor) is a multiple of ``align`` and of the tensor's itemsize, so the
    receiver can view the bytes as the tensor, or as a run of its elements,
    without a copy.

    ``split=False`` is the plan slime and the per-bucket baselines use: a
    tensor larger than the budget is never cut and gets a bucket of its own.
    A rank's slice (``TensorSpec.rank_slice``) larger than the budget is cut like a
    whole tensor: its pieces are runs of the slice's own elements (an engine rank's
    block is contiguous in its weights), and a 545 MB vocabulary block of Qwen2-7B at
    TP=2 stays within two 64 MiB buckets' staging.
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
        unit = max(align, itemsize(s.dtype))
        start = _round_up(offset, unit)
        if s.nbytes <= budget_bytes or not split:
            if current and start + s.nbytes > budget_bytes:
                close()
                start = 0
            current.append(Entry(s, start, start + s.nbytes))
            offset = start + s.nbytes
            if offset >= budget_bytes:
                close()
            continue
        done = 0
        while done < s.nbytes:
            room = (budget_bytes - start) // unit * unit
            if room <= 0:
                if current:
                    close()
                    start = 0
                    continue
                room = unit  # a budget below one unit: the least a piece can be
            n = min(room, s.nbytes - done)
            current.append(Entry(s, start, start + n, done))
            done += n
            offset = start + n
            if offset >= budget_bytes:
                close()
            start = _round_up(offset, unit)
    close()
    return buckets
