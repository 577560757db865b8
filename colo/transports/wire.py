"""The bytes on the wire: SGLang's ``FlattenedTensorBucket`` metadata and the
JSON request fields every transport parses (never a pickle).

Pure data plus one torch view helper; the senders and receivers of every
transport import from here.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from colo.core.buckets import ALIGN, ITEMSIZE, Bucket, Entry, itemsize, numel, strided_span
from colo.core.errors import RequestError


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
    """The same entries (whole tensors and pieces, cut where the plan cut them) in
    the same order and the same bucket index, back to back at the offsets
    :func:`plan_buckets` gives under ``align`` (e.g. ``UNPADDED``).

    A sender plans its buckets once, with the default alignment; a transport
    that writes another layout re-lays each bucket. A smaller ``align`` never
    makes a bucket larger, so buffers sized for the padded plan still fit.
    """
    out, offset = [], 0
    for e in bucket.entries:
        unit = max(align, itemsize(e.spec.dtype))
        start = (offset + unit - 1) // unit * unit
        out.append(Entry(e.spec, start, start + e.nbytes, e.offset))
        offset = start + e.nbytes
    return Bucket(bucket.index, tuple(out), offset)


@dataclass(frozen=True)
class Piece:
    """Part of a tensor larger than the bucket: elements ``[offset, offset + data.numel())``
    of the tensor's row-major elements, as ``data`` (1-D, the tensor's dtype).
    ``shape`` is the whole tensor's. The engine writes it in place; the tensor is
    complete once its last piece is written."""

    data: Any
    offset: int
    shape: tuple[int, ...]

    @property
    def end(self) -> int:
        return self.offset + self.data.numel()

    @property
    def dtype(self) -> Any:
        return self.data.dtype


@dataclass(frozen=True)
class Strided:
    """A whole tensor lying strided in the sender's buffer (a :class:`TensorMeta` with a
    ``view``): ``data`` is it in the view's shape, whose row-major elements are the
    tensor's (q of a fused QKV of several query groups: ``(groups, rows of a group,
    hidden)``), ``shape`` the tensor's own. An engine that copies it straight into its
    contiguous weight takes it (:meth:`copy_into`: one copy, no tensor in between) from
    :meth:`Views.sources`; every other receiver gets the tensor itself from :func:`views`
    (a copy of it made there: a strided view has no row-major shape of its own)."""

    data: Any
    shape: tuple[int, ...]

    @property
    def dtype(self) -> Any:
        return self.data.dtype

    @property
    def device(self) -> Any:
        return self.data.device

    def copy_into(self, dest: Any, *, non_blocking: bool = False) -> None:
        """``dest`` (contiguous, of the tensor's shape) gets the tensor's elements."""
        dest.view(self.data.shape).copy_(self.data, non_blocking=non_blocking)

    def tensor(self) -> Any:
        """The tensor in its own shape (a copy where the view cannot be reshaped in place)."""
        return self.data.reshape(self.shape)


@dataclass(frozen=True)
class RankSlice:
    """A tensor that arrives already cut for the receiving engine rank: ``data`` is the block
    ``[start, start + data.shape[dim])`` of dimension ``dim`` of the whole tensor, whose shape
    is ``shape`` (as a :class:`Piece`'s, the whole tensor's: an engine's accounting of names
    and shapes stays the one it has). Only an engine that holds that block as it is (colo's
    TP engine, ``colo.engine.reference.tp``) takes it, after checking that the block is the
    one this rank holds; any other loader refuses it by name. ``data`` may be a
    :class:`Piece` of the block (its ``shape`` the block's, its offsets in the block's
    row-major elements): the block arrives in pieces, in order (:func:`piece_in`)."""

    data: Any
    dim: int
    start: int
    shape: tuple[int, ...]

    @property
    def dtype(self) -> Any:
        return self.data.dtype

    @property
    def length(self) -> int:
        return int(self.data.shape[self.dim])  # a Piece's shape is the slice's: the same

    def describe(self) -> str:
        what = f"block [{self.start}, {self.start + self.length}) of dimension {self.dim} of {tuple(self.shape)}"
        if isinstance(self.data, Piece):
            return f"{what}, elements [{self.data.offset}, {self.data.end}) of it"
        return what


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

    A piece of a tensor larger than the bucket (see :mod:`colo.core.buckets`)
    is the same six fields plus one, ``piece_offset``: the byte offset of the
    piece in the whole tensor's row-major bytes. ``shape`` and ``dtype`` stay
    the whole tensor's; ``start_idx``/``end_idx``/``numel`` describe the
    piece's bytes in this bucket. A whole tensor never carries the field, so
    its entry stays SGLang's exactly; SGLang's dataclass refuses the extra
    keyword, so a piece can never be read by it as a whole tensor.

    A whole tensor that lies strided in the buffer (a one-copy sync out of a
    trainer's own buffer: q, k and v of a fused QKV of several query groups, rows
    interleaved per group) carries ``strides`` instead: its element strides from
    the element at ``start_idx``, for ``view_shape`` (given where it is not
    ``shape``; a shape whose row-major elements are the tensor's, e.g. ``(groups,
    rows of a group, hidden)``). ``end_idx`` is then the end of its last element,
    so ``[start_idx, end_idx)`` is every byte the view can read (others' bytes
    between its runs too) and ``numel`` that span. Without ``strides`` an entry is
    row-major, as ever; SGLang's dataclass refuses the field, as it does a piece.

    One engine rank's slice of a tensor (``TensorSpec.rank_slice``: an expert
    its owner cut for each TP-MoE rank) carries ``rank_slice``: ``{"dim": d,
    "start": s, "length": L}``, the block ``[s, s + shape[d])`` of dimension d
    of a tensor whose dimension d is L long. Here ``shape`` is the block's (the
    bytes are that contiguous tensor, so every size check is the same); the
    receiver hands it on as a :class:`RankSlice` of the whole shape. With
    ``piece_offset`` it is a piece of that slice (a slice larger than the bucket: a
    vocabulary block of Qwen2-7B at TP=2 is 545 MB), handed on as a :class:`RankSlice`
    whose ``data`` is the :class:`Piece` of the slice. Refused by SGLang for the same
    reason as a piece.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    start: int
    end: int
    offset: int = 0  # byte offset of these bytes in the whole tensor
    #: ``(view shape, element strides)`` of a whole tensor lying strided in the buffer
    view: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    rank_slice: tuple[int, int, int] | None = None  # (dim, start, whole length): see above

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def whole(self) -> bool:
        return self.offset == 0 and (self.view is not None or self.nbytes == numel(self.shape) * itemsize(self.dtype))

    def to_json(self) -> dict:
        out = {"name": self.name, "shape": list(self.shape), "dtype": self.dtype,
               "start_idx": self.start, "end_idx": self.end, "numel": self.nbytes}
        if self.view is not None:
            if tuple(self.view[0]) != tuple(self.shape):
                out["view_shape"] = list(self.view[0])
            out["strides"] = list(self.view[1])
        elif not self.whole:
            out["piece_offset"] = self.offset
        if self.rank_slice is not None:
            dim, start, length = self.rank_slice
            out["rank_slice"] = {"dim": dim, "start": start, "length": length}
        return out

    @property
    def whole_shape(self) -> tuple[int, ...]:
        """The whole tensor's shape: ``shape``, but for a rank's slice."""
        if self.rank_slice is None:
            return self.shape
        dim, _, length = self.rank_slice
        return (*self.shape[:dim], length, *self.shape[dim + 1:])

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
        offset = d.get("piece_offset", 0)
        if isinstance(offset, bool) or not isinstance(offset, int):
            raise RequestError(f"{what}: piece_offset must be an integer, got {offset!r}")
        view = None
        if "strides" in d:
            view = _parse_view(d, what, shape, dtype, start, end, limit)
        elif "view_shape" in d:
            raise RequestError(f"{what}: view_shape without strides; a strided entry gives both "
                               f"(or strides alone, for a view of the tensor's own shape)")
        elif "piece_offset" in d:
            if not 0 <= start <= end <= limit:
                raise RequestError(f"bucket entry {name!r}: bytes [{start}, {end}) do not fit "
                                   f"in a {limit} B buffer")
            if offset < 0 or offset + (end - start) > size or offset % itemsize(dtype) \
                    or (end - start) % itemsize(dtype):
                raise RequestError(f"{what}: piece of {end - start} B at piece_offset {offset} is not a run "
                                   f"of whole elements inside the {size} B of shape {shape} {dtype}")
        elif not 0 <= start <= end <= limit or end - start != size:
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
        if "strides" in d and "rank_slice" in d:
            raise RequestError(f"{what}: a rank's slice (rank_slice) travels contiguous; it cannot also lie "
                               f"strided (strides)")
        return cls(name, shape, dtype, start, end, offset, view, _rank_slice(d, what, shape))

    @classmethod
    def of_bucket(cls, bucket: Bucket) -> list[TensorMeta]:
        return [cls(e.spec.name, e.spec.shape, e.spec.dtype, e.start, e.end, e.offset, e.view, e.spec.rank_slice)
                for e in bucket.entries]


def _int_list(value: Any, what: str, field: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                              for x in value):
        raise RequestError(f"{what}: {field} must be a list of non-negative integers, got {value!r}")
    return tuple(value)


def _parse_view(d: dict, what: str, shape: tuple[int, ...], dtype: str, start: int, end: int,
                limit: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A strided entry's ``(view_shape, strides)``, checked: the view holds the tensor's
    elements (as many as ``shape``), its strides are one per dimension, and every byte it
    can read lies in ``[start_idx, end_idx)``, which lies in the buffer. A view is never
    made past the buffer's end, whatever the request says."""
    if "piece_offset" in d:
        raise RequestError(f"{what}: a strided entry is a whole tensor; it cannot be a piece (piece_offset)")
    strides = _int_list(d["strides"], what, "strides")
    view_shape = _int_list(d["view_shape"], what, "view_shape") if "view_shape" in d else shape
    if len(strides) != len(view_shape):
        raise RequestError(f"{what}: {len(strides)} strides {list(strides)} for the {len(view_shape)} "
                           f"dimensions of view_shape {list(view_shape)}; expected one stride per dimension")
    if numel(view_shape) != numel(shape):
        raise RequestError(f"{what}: view_shape {list(view_shape)} holds {numel(view_shape)} elements; "
                           f"expected the {numel(shape)} of shape {list(shape)}")
    size = itemsize(dtype)
    span = strided_span(view_shape, strides) * size
    if not 0 <= start <= end <= limit or end - start != span:
        raise RequestError(f"{what}: view_shape {list(view_shape)} with strides {list(strides)} from byte "
                           f"{start} reads bytes [{start}, {start + span}); expected end_idx {start + span} "
                           f"(got {end}) inside the {limit} B buffer")
    return view_shape, strides


def _rank_slice(d: dict, what: str, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
    """An entry's ``rank_slice`` field (:class:`TensorMeta`), checked: a block inside the whole
    tensor. The entry may be a piece of the slice (``piece_offset``: a run of the slice's own
    row-major elements, as a piece of a whole tensor is of the tensor's)."""
    if "rank_slice" not in d:
        return None
    raw = d["rank_slice"]
    dim, start, length = (get_field(raw, k, int, f"{what} rank_slice") for k in ("dim", "start", "length"))
    if not 0 <= dim < len(shape) or start < 0 or start + shape[dim] > length:
        raise RequestError(f"{what}: rank_slice {{'dim': {dim}, 'start': {start}, 'length': {length}}} is not "
                           f"a block of a whole tensor holding its shape {shape}")
    return dim, start, length


def parse_tensors(d: Any, key: str, what: str, *, buffer_nbytes: int | None = None) -> tuple[TensorMeta, ...]:
    raw = get_field(d, key, list, what)
    return tuple(TensorMeta.from_json(m, buffer_nbytes=buffer_nbytes) for m in raw)


def request_nbytes(d: Any, what: str) -> int:
    """A bucket request's ``nbytes``: the size of the one buffer its bytes travel in."""
    nbytes = get_field(d, "nbytes", int, what)
    if nbytes <= 0:
        raise RequestError(f"{what} nbytes must be positive, got {nbytes}")
    return nbytes


@dataclass(frozen=True)
class BucketRequest:
    """One bucket of a transport whose bytes travel beside the request, not in it (a
    collective, Ray's tensor transport): how many bytes and where each tensor lies. A
    transport's request is a subclass that names itself in errors (``what``)."""

    what = "bucket request"
    nbytes: int
    tensors: tuple[TensorMeta, ...]

    def to_json(self) -> dict:
        return {"nbytes": self.nbytes, "tensors": [m.to_json() for m in self.tensors]}

    @classmethod
    def from_json(cls, d: Any) -> BucketRequest:
        nbytes = request_nbytes(d, cls.what)
        return cls(nbytes, parse_tensors(d, "tensors", cls.what, buffer_nbytes=nbytes))


class Views(Sequence):
    """:func:`views`' answer: the ``(name, tensor)`` pairs, and what they were made of, ``flat``
    (the uint8 buffer) and ``layout`` (the ``TensorMeta`` tuple). A receiver that caches a
    layout hands the same tuple back sync after sync, so a sink can derive what it needs from
    a layout once, keyed by the tuple itself (:class:`colo.engine.adapter_host.AdapterStage`:
    one copy and one checksum launch for hundreds of small tensors, no work per tensor).

    The pairs are made on first use, not before: a sink that loads a layout it planned before
    reads ``flat`` and ``layout`` only (colo's engine, ``EngineModel._LayoutPlan``), and the
    339 views of a one-copy sync, made anew every sync because the trainer's buffer is exported
    anew, were most of the engine's 2.3 ms handoff of a 7 ms ``sync-first`` sync at Qwen2-1.5B
    on an H200, where opening the buffer took 0.36 ms (issue 44)."""

    __slots__ = ("flat", "layout", "_pairs")

    def __init__(self, flat: Any, layout: Sequence[TensorMeta]):
        self.flat, self.layout = flat, layout
        self._pairs: list[tuple[str, Any]] | None = None

    def _made(self) -> list[tuple[str, Any]]:
        if self._pairs is None:
            self._pairs = _make_views(self.flat, self.layout)
        return self._pairs

    @property
    def strided(self) -> bool:
        """Some tensor lies strided in the buffer (a ``TensorMeta`` with a ``view``)."""
        return any(m.view is not None for m in self.layout)

    def sources(self) -> list[tuple[str, Any]]:
        """The pairs with each strided tensor as it lies, a :class:`Strided` (not copied into a
        tensor of its own, as the pairs have it): for an engine that copies it straight into
        its weight. Made anew at each call."""
        return _make_views(self.flat, self.layout, strided_as_is=True)

    def __len__(self) -> int:
        return len(self.layout)

    def __getitem__(self, i: Any) -> Any:
        return self._made()[i]

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return iter(self._made())


def views(flat: Any, tensors: Sequence[TensorMeta]) -> Views:
    """``(name, tensor)`` views into a flat uint8 buffer, ``(name, Piece)`` for a
    piece: no copy; valid while ``flat`` is. An entry past the buffer's end is refused
    here; the views themselves are made when first read (:class:`Views`).

    Each start must be a multiple of its dtype's size (``from_json`` checks
    it): a uint8 slice can be viewed as a wider dtype only from such an offset."""
    total = flat.numel()
    for m in tensors:
        # a strided entry's end_idx is its last element's end (checked on parse); one built
        # here is checked by its own view, so that no view ever reaches past the buffer
        end = m.end if m.view is None else max(m.end, m.start + strided_span(*m.view) * itemsize(m.dtype))
        if end > total:
            raise RequestError(f"bucket entry {m.name!r}: bytes [{m.start}, {end}) do not fit "
                               f"shape {m.shape} {m.dtype} in a {total} B buffer")
    return Views(flat, tensors)


def _make_views(flat: Any, tensors: Sequence[TensorMeta], *, strided_as_is: bool = False) -> list[tuple[str, Any]]:
    """The pairs of :func:`views`. The buffer is viewed once per dtype and each tensor is
    one ``as_strided`` of that view: one torch call per tensor instead of three (slice,
    dtype view, shape view). A strided tensor is a :class:`Strided` where
    ``strided_as_is``, else the tensor in its own shape (copied where its view has none)."""
    import torch

    out: list[tuple[str, Any]] = []
    typed: dict[str, Any] = {}
    for m in tensors:
        base = typed.get(m.dtype)
        if base is None:
            base = typed[m.dtype] = _typed_base(flat, getattr(torch, m.dtype), itemsize(m.dtype))
        if m.view is not None:
            if base is False:
                data = flat[m.start:m.end].view(getattr(torch, m.dtype))
                data = data.as_strided(m.view[0], m.view[1], data.storage_offset())
            else:
                data = base.as_strided(m.view[0], m.view[1], base.storage_offset() + m.start // itemsize(m.dtype))
            s = Strided(data, m.shape)
            out.append((m.name, s if strided_as_is else s.tensor()))
            continue
        if base is False:  # the buffer cannot be viewed as this dtype as a whole
            data = flat[m.start:m.end].view(getattr(torch, m.dtype))
            out.append((m.name, _sliced(m, data.view(m.shape)) if m.whole else piece_of(m, data)))
            continue
        size = itemsize(m.dtype)
        at = base.storage_offset() + m.start // size
        if m.whole:
            out.append((m.name, _sliced(m, base.as_strided(m.shape, contiguous_strides(m.shape), at))))
        else:
            out.append((m.name, piece_of(m, base.as_strided(((m.end - m.start) // size,), (1,), at))))
    return out


def _typed_base(flat: Any, dtype: Any, size: int) -> Any:
    """``flat`` (contiguous uint8) viewed as ``dtype`` whole, or False where its start
    or length is not a multiple of the dtype's size (then each tensor is sliced
    first)."""
    if size == 1:
        return flat if flat.dtype == dtype else flat.view(dtype)
    if not flat.is_contiguous() or flat.storage_offset() % size or flat.numel() % size:
        return False
    return flat.view(dtype)


@functools.lru_cache(maxsize=4096)
def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A row-major tensor's strides, in elements."""
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


def _sliced(m: TensorMeta, data: Any) -> Any:
    """``data`` (the entry's tensor) as it goes to the loader: a :class:`RankSlice` where the
    entry is one rank's slice, else the tensor itself."""
    if m.rank_slice is None:
        return data
    return RankSlice(data, m.rank_slice[0], m.rank_slice[1], m.whole_shape)


def piece_of(m: TensorMeta, data: Any) -> Any:
    """``data`` (the piece's elements, 1-D) as the piece ``m`` describes: a :class:`Piece`,
    or where ``m`` is a piece of a rank's slice, a :class:`RankSlice` of that piece (its
    offsets and shape the slice's own)."""
    piece = Piece(data.reshape(-1), m.offset // itemsize(m.dtype), m.shape)
    return piece if m.rank_slice is None else RankSlice(piece, m.rank_slice[0], m.rank_slice[1], m.whole_shape)


def piece_in(tensor: Any) -> Piece | None:
    """The :class:`Piece` a loader is handed (a piece of a tensor, or of a rank's slice), or None."""
    if isinstance(tensor, RankSlice):
        tensor = tensor.data
    return tensor if isinstance(tensor, Piece) else None


# -- bucket layouts cached across syncs -------------------------------------------------

def layout_key(entries: Sequence[dict]) -> str:
    """A bucket layout's name: a hash of its entries as they travel (JSON), so two
    layouts that differ in any name, shape, dtype or offset never share a key."""
    import hashlib
    import json

    canon = json.dumps(list(entries), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()[:32]


class LayoutNotCached(RequestError):
    """A request named a bucket layout by its key alone, and the engine does not hold it."""


class PreflightNotCached(LayoutNotCached):
    """A sync named its spec list by key alone, and the engine does not hold that list
    (it began nothing): the client sends the list whole, then begins."""


#: in the message of a begin that named a spec list by a key the engine does not hold: the
#: driver sends the list whole then. A marker in the text, because an engine's channel may
#: carry only that (vLLM's ``collective_rpc`` from a worker process)
NOT_CACHED = "spec list not cached"


class LayoutCache:
    """The engine's side: per bucket index, the last layout a request carried in full.

    Names, shapes, dtypes and offsets do not change between steps (NeMo-RL
    caches them too), so after the first sync a request carries only
    ``"layout": {"bucket": i, "key": K}``. A request that carries its
    ``tensors`` replaces bucket i's entry; one that names a key the engine does
    not hold for bucket i (never sent, or replaced because the layout
    changed) is refused with :class:`LayoutNotCached`, naming both keys: a
    changed layout is never read through an old one.
    """

    def __init__(self) -> None:
        self._by_bucket: dict[int, tuple[str, tuple[TensorMeta, ...]]] = {}

    def resolve(self, d: Any, what: str, *, buffer_nbytes: int | None = None) -> tuple[TensorMeta, ...]:
        if not isinstance(d, dict) or "layout" not in d:
            return parse_tensors(d, "tensors", what, buffer_nbytes=buffer_nbytes)
        ref = d["layout"]
        bucket = get_field(ref, "bucket", int, f"{what} layout")
        key = get_field(ref, "key", str, f"{what} layout")
        if "tensors" in d:
            metas = parse_tensors(d, "tensors", what, buffer_nbytes=buffer_nbytes)
            got = layout_key(d["tensors"])
            if got != key:
                raise RequestError(f"{what}: bucket {bucket}'s layout key {key} is not the hash of its "
                                   f"tensors ({got})")
            self._by_bucket[bucket] = (key, metas)
            return metas
        held = self._by_bucket.get(bucket)
        if held is None or held[0] != key:
            raise LayoutNotCached(f"{what}: bucket {bucket}'s layout {key} is not cached on the engine "
                                  f"(it holds {held[0] if held else 'none'} for that bucket); "
                                  f"send the request with its tensors")
        metas = held[1]
        if buffer_nbytes is not None:
            for m in metas:
                if m.end > buffer_nbytes:
                    raise RequestError(f"bucket entry {m.name!r}: bytes [{m.start}, {m.end}) do not fit "
                                       f"in this request's {buffer_nbytes} B buffer")
        return metas

    def clear(self) -> None:
        self._by_bucket.clear()


class LayoutMemo:
    """The sender's side: which layout it last gave each bucket index of ``engine`` and
    the engine acknowledged, so a later sync sends only the key."""

    def __init__(self) -> None:
        self._engine: Any = None
        self._sent: dict[int, str] = {}
        #: bucket index -> (the Bucket, its entries as JSON, their key), for the last Bucket seen
        self._described: dict[int, tuple[Bucket, list[dict], str]] = {}

    def fields(self, engine: Any, laid: Bucket, *, full: bool = False) -> tuple[dict, str]:
        """The request's layout fields for bucket ``laid`` (its index and where its
        tensors lie), and the key to pass to :meth:`acked`."""
        if engine is not self._engine:  # another engine (a replaced one) holds nothing of ours
            self._engine, self._sent = engine, {}
        bucket = laid.index
        entries, key = self._describe(bucket, laid)
        ref = {"bucket": bucket, "key": key}
        if not full and self._sent.get(bucket) == key:
            return {"layout": ref}, key
        return {"tensors": entries, "layout": ref}, key

    def _describe(self, index: int, laid: Bucket) -> tuple[list[dict], str]:
        """The entries and key of ``laid``, made again only for another Bucket object: the
        sender keeps its plan (and a one-copy layout) across syncs, so the same model
        is described once, not per sync (serialising and hashing a one-copy 7B layout
        of 339 entries was about 1 ms of every sync's handoff on an H200, issue 18).
        The Bucket is held, so its identity cannot be taken by another one."""
        held = self._described.get(index)
        if held is not None and held[0] is laid:
            return held[1], held[2]
        entries = [m.to_json() for m in TensorMeta.of_bucket(laid)]
        key = layout_key(entries)
        self._described[index] = (laid, entries, key)
        return entries, key

    def acked(self, bucket: int, key: str) -> None:
        self._sent[bucket] = key

    def forget(self) -> None:
        self._sent = {}


def is_layout_not_cached(e: BaseException) -> bool:
    """The engine's refusal of a layout named by key alone, raised in this process or
    answered by an engine process (``EngineError.error_type``)."""
    return isinstance(e, LayoutNotCached) or getattr(e, "error_type", None) in ("LayoutNotCached", "PreflightNotCached")


def is_preflight_not_cached(e: BaseException) -> bool:
    """The engine's refusal of a spec list named by key alone (see :class:`PreflightNotCached`)."""
    return isinstance(e, PreflightNotCached) or getattr(e, "error_type", None) == "PreflightNotCached"
