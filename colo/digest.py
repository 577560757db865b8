"""The digest every engine can pass: of exactly the HF-named tensors it received,
computed where the tensors lie.

A sync is verified by comparing what the engine says it received with what
the trainer sent. Engines fuse and repack what they receive (colo's engine
into ``qkv_proj``, vLLM on a CPU into oneDNN handles whose parameters are
then empty), so the digest is not of the engine's parameters but of the
tensors as they arrived, under their HF names.

**The checksum of a tensor** (format ``colo.digest/2``). Its row-major bytes
are read as unsigned little-endian 16-bit *words* (8-bit for 1-byte dtypes),
word ``j`` counted from the tensor's first byte, of value ``w_j``. Each of two
lanes is

    lane_L = sum_j  w_j * m_L(j)   mod 2**32,
    m_L(j) = (fmix32((j mod 2**22) ^ s_L) | 1) * (fmix32((j >> 22) + k_L) | 1)   mod 2**32

(``fmix32`` MurmurHash3's finalizer, ``s_L, k_L`` the lane's seeds): a
pseudo-random **odd** multiplier per word. A single flipped bit ``k`` of word
``j`` changes ``w_j`` by ``±2**k`` (``k < 16``) and so lane ``L`` by
``±2**k * m_L(j)``: an odd number times a power of two below ``2**32`` is never
``0 mod 2**32``, so **every single-bit flip in every tensor changes both lanes**,
whatever the data. Words are 16 bits while the sum is mod ``2**32`` so that
changes to many words leave room too: with an arithmetic progression of
multipliers, or 32-bit words, a whole tensor scaled by 2 (``+2**23`` on every
fp32 word) or two flipped sign bits sum to ``0 mod 2**32`` — the tests keep
those cases. The sum is of exact integers, so its order does not matter: the
CPU (numpy), a CUDA GPU (one Triton kernel, one pass over the bytes) and the
portable torch path give **identical** lanes for the same bytes, and a tensor
that arrives in pieces (each knowing its element offset) sums to the same lanes
as the whole. Temporaries are bounded (a block of ``2**22`` words on the host,
:data:`TORCH_CHUNK` words on the torch path, a fixed partials buffer on CUDA).

**The entry** of a tensor is ``sha256(header + lane_1 + lane_2)``, the header its
name, dtype and shape (length-prefixed JSON), so names, shapes and dtypes are
part of it; **the digest** is ``sha256`` over the entries **in the trainer's spec
order** (the order of the spec list the engine accepted at preflight). A
missing tensor, an extra one, a changed shape or dtype, tensors swapped between
names, or one flipped bit anywhere all change it.

The trainer side computes it over its own tensors with :func:`weights_digest`
(on the device they are on: no copy to the host); an engine records what it
receives with :class:`ReceivedDigest`, on the device the tensors arrive on.
Device work is queued on the current stream and read back once per digest.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import json
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from colo.core.buckets import itemsize
from colo.dtypes import dtype_name

#: the checksum's seeds, per lane: of the table over the word's low bits, and of the block factor
LANE_SEEDS = ((0x243F6A88, 0x13198A2E), (0x85A308D3, 0x03707344))
#: words per block of the multiplier (``j = block * 2**BLOCK_BITS + i``); part of the format
BLOCK_BITS = 22
#: the trainer side's converted temporaries (to the engine's dtype) held at once, at most
#: about this many bytes plus one tensor
CONVERT_BYTES = 1 << 30
_MASK = (1 << 32) - 1
_LOW = (1 << BLOCK_BITS) - 1
_WORD_VIEW = {1: torch.uint8, 2: torch.int16}


def _header(name: str, dtype: str, shape: Sequence[int]) -> bytes:
    return _header_of(name, dtype, tuple(int(s) for s in shape))


@functools.lru_cache(maxsize=1 << 16)
def _header_of(name: str, dtype: str, shape: tuple[int, ...]) -> bytes:
    # the same tensors are digested every sync: their headers are made once (a rank-8 adapter of
    # a 1.5B model is 392 of them per sync)
    header = json.dumps([name, dtype, list(shape)]).encode()
    return len(header).to_bytes(8, "little") + header


def word_size(element_size: int) -> int:
    """Bytes per checksum word for a dtype of ``element_size`` bytes."""
    return 1 if element_size == 1 else 2


def _words(t: torch.Tensor) -> torch.Tensor:
    """``t``'s row-major bytes as a 1-D tensor of words (a view where ``t`` is contiguous)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8).view(_WORD_VIEW[word_size(t.element_size())])


def fmix32(x: Any) -> Any:
    """MurmurHash3's 32-bit finalizer on Python ints or int64 numpy arrays in ``[0, 2**32)``."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _MASK
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _MASK
    return x ^ (x >> 16)


def multiplier(lane: int, j: int) -> int:
    """The odd multiplier of word ``j`` in ``lane``: a product of two odd numbers."""
    s_low, s_block = LANE_SEEDS[lane]
    return ((fmix32((j & _LOW) ^ s_low) | 1) * (fmix32(((j >> BLOCK_BITS) + s_block) & _MASK) | 1)) & _MASK


# -- the three paths (identical results; see the module docstring) ------------------------

_HOST_TABLES: list[np.ndarray] = []


def _host_tables() -> list[np.ndarray]:
    """Per lane, the odd factor of the low bits, ``fmix32(i ^ seed) | 1`` for every ``i`` of a block (uint32)."""
    if not _HOST_TABLES:
        i = np.arange(1 << BLOCK_BITS, dtype=np.uint64)
        _HOST_TABLES.extend((fmix32(i ^ np.uint64(s)) | np.uint64(1)).astype(np.uint32) for s, _ in LANE_SEEDS)
    return _HOST_TABLES


def _host_lanes(words: torch.Tensor, first: int) -> list[int]:
    """On the host, numpy: per block of the multiplier, one ``dot`` of the words with the
    table per lane (its uint32 accumulator wraps mod 2**32, as wanted) times the block's factor."""
    raw = words.numpy()
    return _host_lanes_np(raw.view({1: np.uint8, 2: np.uint16}[raw.itemsize]), first)


def _host_lanes_np(unsigned: np.ndarray, first: int) -> list[int]:
    """:func:`_host_lanes` of words already a uint8 or uint16 numpy array."""
    tables = _host_tables()
    lanes = [0, 0]
    start = 0
    while start < unsigned.size:
        j = first + start
        low, block = j & _LOW, j >> BLOCK_BITS
        n = min(unsigned.size - start, (1 << BLOCK_BITS) - low)
        w = unsigned[start:start + n]
        for lane, (_, s_block) in enumerate(LANE_SEEDS):
            dot = int(np.dot(w, tables[lane][low:low + n])) & _MASK
            factor = fmix32((block + s_block) & _MASK) | 1
            lanes[lane] = (lanes[lane] + dot * factor) & _MASK
        start += n
    return lanes


def _mulmod32(x: torch.Tensor, c: Any) -> torch.Tensor:
    """``x * c mod 2**32`` for int64 ``x, c`` in ``[0, 2**32)`` (tensor or int), without overflow:
    ``c`` split in 16-bit halves, each product below ``2**48``."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _MASK


def _fmix32_torch(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mulmod32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mulmod32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


#: words per step of the portable torch path (its temporaries are a few int64 tensors of this)
TORCH_CHUNK = 1 << 22


def _torch_lanes(words: torch.Tensor, first: int) -> torch.Tensor:
    """Any device: torch ops on int64, exact (no product overflows)."""
    out = torch.zeros(2, dtype=torch.int64, device=words.device)
    bits = words.element_size() * 8
    for start in range(0, words.numel(), TORCH_CHUNK):
        w = words[start:start + TORCH_CHUNK].to(torch.int64) & ((1 << bits) - 1)
        j = torch.arange(first + start, first + start + w.numel(), dtype=torch.int64, device=w.device)
        for lane, (s_low, s_block) in enumerate(LANE_SEEDS):
            m = _mulmod32(_fmix32_torch((j & _LOW) ^ s_low) | 1, _fmix32_torch(((j >> BLOCK_BITS) + s_block) & _MASK) | 1)
            out[lane] = (out[lane] + _mulmod32(w, m).sum()) & _MASK
    return out


_KERNEL: Any = None
_FMIX: Any = None


def _triton_kernel() -> Any:
    """The CUDA path: one pass over the words, uint32 arithmetic (wraps mod 2**32, as wanted),
    per-block sums in int64; ``None`` where Triton is not installed."""
    global _KERNEL
    if _KERNEL is None:
        try:
            import triton
            import triton.language as tl
        except ImportError:
            _KERNEL = False
            return None

        @triton.jit
        def fmix(x):
            x = x ^ (x >> 16)
            x = x * tl.full(x.shape, 0x85EBCA6B, tl.uint32)
            x = x ^ (x >> 13)
            x = x * tl.full(x.shape, 0xC2B2AE35, tl.uint32)
            return x ^ (x >> 16)

        global _FMIX
        _FMIX = fmix

        @triton.jit
        def lanes_kernel(words, n, first, out, S1: tl.constexpr, K1: tl.constexpr, S2: tl.constexpr,
                         K2: tl.constexpr, BITS: tl.constexpr, LOW_BITS: tl.constexpr, BLOCK: tl.constexpr):
            pid = tl.program_id(0)
            offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            keep = offs < n
            raw = tl.load(words + offs, mask=keep, other=0)
            if BITS == 8:
                w = raw.to(tl.uint32)  # the view is uint8
            else:
                w = raw.to(tl.uint16, bitcast=True).to(tl.uint32)
            j = offs + first
            low = (j & ((1 << LOW_BITS) - 1)).to(tl.uint32)
            block = (j >> LOW_BITS).to(tl.uint32)
            # seeds as uint32 tensors: a literal above 2**31 would widen the arithmetic to int64
            m1 = (fmix(low ^ tl.full((BLOCK,), S1, tl.uint32)) | 1) * (fmix(block + tl.full((BLOCK,), K1, tl.uint32)) | 1)
            m2 = (fmix(low ^ tl.full((BLOCK,), S2, tl.uint32)) | 1) * (fmix(block + tl.full((BLOCK,), K2, tl.uint32)) | 1)
            tl.store(out + pid * 2, tl.sum((w * m1).to(tl.int64), axis=0))
            tl.store(out + pid * 2 + 1, tl.sum((w * m2).to(tl.int64), axis=0))

        _KERNEL = lanes_kernel
    return _KERNEL or None


_BLOCK = 8192


def _cuda_lanes(words: torch.Tensor, first: int) -> torch.Tensor | None:
    kernel = _triton_kernel()
    if kernel is None:
        return None
    out = torch.zeros(2, dtype=torch.int64, device=words.device)
    step = _BLOCK * 65536  # a bounded partials buffer (65536 x 2 int64) per launch
    (s1, k1), (s2, k2) = LANE_SEEDS
    for start in range(0, words.numel(), step):
        part = words[start:start + step]
        blocks = -(-part.numel() // _BLOCK)
        partial = torch.empty(blocks, 2, dtype=torch.int64, device=words.device)
        kernel[(blocks,)](part, part.numel(), first + start, partial, S1=s1, K1=k1, S2=s2, K2=k2,
                          BITS=words.element_size() * 8, LOW_BITS=BLOCK_BITS, BLOCK=_BLOCK)
        out = (out + partial.sum(dim=0)) & _MASK  # < 65536 * 8192 * 2**32 < 2**63
    return out


def lanes(tensor: torch.Tensor, offset: int = 0, path: str = "auto") -> torch.Tensor | list[int]:
    """The two lanes of ``tensor``'s words, the tensor starting ``offset`` elements into the
    whole it is a piece of; on ``tensor``'s device (a list of ints for a CPU tensor).
    ``path`` forces ``"host"``, ``"torch"`` or ``"cuda"`` (the tests compare them)."""
    words = _words(tensor)
    first = int(offset) * (tensor.element_size() // words.element_size())
    device = words.device.type
    if path == "host" or (path == "auto" and device == "cpu"):
        return _host_lanes(words if device == "cpu" else words.cpu(), first)
    if path in ("cuda", "auto") and device == "cuda":
        got = _cuda_lanes(words, first)
        if got is not None:
            return got
        if path == "cuda":
            raise RuntimeError("the CUDA checksum needs Triton, which is not installed")
    return _torch_lanes(words, first)


_BATCH_KERNEL: Any = None
#: the batched kernel's words per iteration and iterations per program
_BATCH_BLOCK, _BATCH_ITERS = 2048, 128
# a program's span meets at most two blocks of the multiplier (the kernel relies on it)
assert _BATCH_BLOCK * _BATCH_ITERS <= 1 << BLOCK_BITS


def _batch_kernel() -> Any:
    """Many tensors in one launch (per-tensor launches cost ~0.1 ms of host time each, 30 ms
    for a 338-tensor model, where reading its bytes takes 1-5 ms): each program reads a span of
    one tensor, found through a table of addresses; its partial sums are added per tensor."""
    global _BATCH_KERNEL
    if _BATCH_KERNEL is None:
        if _triton_kernel() is None:
            _BATCH_KERNEL = False
            return None
        import triton
        import triton.language as tl

        # N and P (tensors, programs) change with every table: specialised on (Triton compiles
        # a variant for a value of 1 and for multiples of 16), each new kind of table would
        # compile the kernel again in the middle of a sync
        @triton.jit(do_not_specialize=["N", "P"])
        def batch_kernel(meta, N, P, out, S1: tl.constexpr, K1: tl.constexpr, S2: tl.constexpr,
                         K2: tl.constexpr, BITS: tl.constexpr, LOW_BITS: tl.constexpr, BLOCK: tl.constexpr,
                         ITERS: tl.constexpr):
            pid = tl.program_id(0)
            t = tl.load(meta + 3 * N + pid)
            start = tl.load(meta + 3 * N + P + pid)
            addr = tl.load(meta + t)
            n = tl.load(meta + N + t)
            first = tl.load(meta + 2 * N + t)
            if BITS == 8:
                words = addr.to(tl.pointer_type(tl.uint8))
            else:
                words = addr.to(tl.pointer_type(tl.int16))
            # The block factor of the multiplier is one of two values in a program: its span
            # (BLOCK * ITERS words, at most 2**LOW_BITS) crosses at most one block boundary.
            # Computed once here, not per word: two of the four hashes per word gone.
            base = ((start + first) >> LOW_BITS).to(tl.uint32)
            here = tl.full((BLOCK,), 0, tl.uint32) + base
            b1 = _FMIX(here + tl.full((BLOCK,), K1, tl.uint32)) | 1
            b1_next = _FMIX(here + 1 + tl.full((BLOCK,), K1, tl.uint32)) | 1
            b2 = _FMIX(here + tl.full((BLOCK,), K2, tl.uint32)) | 1
            b2_next = _FMIX(here + 1 + tl.full((BLOCK,), K2, tl.uint32)) | 1
            # uint32 sums wrap mod 2**32, which is all a lane keeps: no 64-bit adds per word
            acc1 = tl.zeros((BLOCK,), tl.uint32)
            acc2 = tl.zeros((BLOCK,), tl.uint32)
            for k in range(ITERS):
                offs = start + k * BLOCK + tl.arange(0, BLOCK)
                raw = tl.load(words + offs, mask=offs < n, other=0)
                if BITS == 8:
                    w = raw.to(tl.uint32)
                else:
                    w = raw.to(tl.uint16, bitcast=True).to(tl.uint32)
                j = offs + first
                low = (j & ((1 << LOW_BITS) - 1)).to(tl.uint32)
                nxt = (j >> LOW_BITS).to(tl.uint32) != base
                m1 = (_FMIX(low ^ tl.full((BLOCK,), S1, tl.uint32)) | 1) * tl.where(nxt, b1_next, b1)
                m2 = (_FMIX(low ^ tl.full((BLOCK,), S2, tl.uint32)) | 1) * tl.where(nxt, b2_next, b2)
                acc1 += w * m1
                acc2 += w * m2
            tl.store(out + pid * 2, tl.sum(acc1, axis=0).to(tl.int64))
            tl.store(out + pid * 2 + 1, tl.sum(acc2, axis=0).to(tl.int64))

        _BATCH_KERNEL = batch_kernel
    return _BATCH_KERNEL or None


def _program_table(ns: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The batched kernel's programs for tensors of ``ns`` words: per program, its tensor's
    index and its first word (each tensor one program at least)."""
    span = _BATCH_BLOCK * _BATCH_ITERS
    counts = np.maximum((ns + span - 1) // span, 1)
    item = np.repeat(np.arange(len(ns), dtype=np.int64), counts)
    starts = (np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)) * span
    return item, starts


class _UploadRing:
    """Small host tables (a kernel's meta) to one GPU through one pinned buffer kept for the
    process, used as a ring: each upload is a slice of it, queued on the current stream,
    and a slice is written again only once the event recorded after its upload has passed.

    Why: ``pin_memory()`` per upload was 0.2-0.3 ms of host time each (six per sync on
    each side of a sharded ``sync-first`` sync, one H200: issue 44), where copying the
    few kilobytes into memory already pinned is microseconds. A table larger than a
    quarter of the ring is pinned on its own, as before."""

    #: the ring's bytes; slices start on 64-byte boundaries
    NBYTES = 4 << 20

    def __init__(self, device: torch.device, *, buffer: torch.Tensor | None = None,
                 new_event: Any = None) -> None:
        self.device = device
        self.buf = buffer if buffer is not None else torch.empty(self.NBYTES, dtype=torch.uint8, pin_memory=True)
        self.nbytes = self.buf.numel()
        # written through numpy: one memcpy on this thread. torch's copy_ of a table above
        # its grain size (32 K elements: a 1.5B model's table is 107 KB) splits it over the
        # process's OpenMP threads, and the upload then waits for the slowest of them: 3.2-3.7
        # ms of a 7B load's planned launch in two of three syncs on an H200 (call67b), 0.3-0.6
        # in the others, with the allocations after it at 0.01-0.02 ms
        self._host = self.buf.numpy()
        self.head = 0
        #: (start, end, event) of uploads that may still be reading, oldest first
        self.pending: collections.deque = collections.deque()
        self._new_event = new_event or (lambda: torch.cuda.Event())
        self._lock = threading.Lock()

    def upload(self, meta: np.ndarray) -> torch.Tensor:
        """``meta`` (int64) on the ring's device, its copy queued on the current stream."""
        n = meta.nbytes
        if n > self.nbytes // 4:
            return torch.from_numpy(meta).pin_memory().to(self.device, non_blocking=True)
        size = (n + 63) & ~63
        with self._lock:
            if self.head + size > self.nbytes:
                self.head = 0
            start, end = self.head, self.head + size
            self.head = end
            while self.pending and self.pending[0][2].query():
                self.pending.popleft()  # passed: free whatever it held
            # the oldest uploads are the ones this slice overwrites first
            while self.pending and self.pending[0][0] < end and start < self.pending[0][1]:
                self.pending.popleft()[2].synchronize()
            self._host[start:start + n] = meta.view(np.uint8)
            out = self.buf[start:start + n].view(torch.int64).to(self.device, non_blocking=True)
            event = self._new_event()
            # behind the copy, on the stream it was queued on (the device's current one)
            event.record(torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None)
            self.pending.append((start, end, event))
        return out


_RINGS: dict[torch.device, _UploadRing] = {}
_RINGS_LOCK = threading.Lock()


def _to_device(meta: np.ndarray, device: torch.device) -> torch.Tensor:
    """A kernel's meta table on ``device``: through the device's pinned ring on a GPU
    (:class:`_UploadRing`), queued on the current stream; the array itself elsewhere."""
    if device.type != "cuda":
        return torch.from_numpy(meta)
    ring = _RINGS.get(device)
    if ring is None:
        with _RINGS_LOCK:
            ring = _RINGS.get(device) or _RINGS.setdefault(device, _UploadRing(device))
    return ring.upload(np.ascontiguousarray(meta, dtype=np.int64))


def _launch_batch(meta: np.ndarray, tensors: int, programs: int, word_bytes: int, device: torch.device) -> torch.Tensor:
    """``[tensors, 2]`` lanes from a meta table ``[addresses, words, firsts, item, starts]``
    (the first three ``tensors`` long, the last two ``programs`` long), one launch."""
    kernel = _batch_kernel()
    # From pinned memory, queued: a pageable upload waits for everything before it on the
    # stream, and an engine summing a load queues this behind copies still running (the
    # host would stall until they finish instead of queueing the next ones)
    meta_dev = _to_device(meta, device)
    partial = torch.empty(programs, 2, dtype=torch.int64, device=device)
    (s1, k1), (s2, k2) = LANE_SEEDS
    kernel[(programs,)](meta_dev, tensors, programs, partial, S1=s1, K1=k1, S2=s2, K2=k2,
                        BITS=word_bytes * 8, LOW_BITS=BLOCK_BITS, BLOCK=_BATCH_BLOCK,
                        ITERS=_BATCH_ITERS, num_warps=8)
    out = torch.zeros(tensors, 2, dtype=torch.int64, device=device)
    # exact integer sums of each program's lane mod 2**32 (< 2**32 each; < 2**31 programs), in any order
    out.index_add_(0, meta_dev[3 * tensors:3 * tensors + programs], partial)
    return out & _MASK


_COPY_KERNEL: Any = None
#: the copying kernel's 4-byte words per iteration and iterations per program: a program's
#: span (twice as many checksum words) meets at most two blocks of the multiplier
_COPY_BLOCK, _COPY_ITERS = 2048, 64
assert 2 * _COPY_BLOCK * _COPY_ITERS <= 1 << BLOCK_BITS
#: the copying kernel's warps per program, and whether a table of 16-byte aligned pairs runs its
#: 16-byte variant (``_unit``; bench/copy_kernel.py sweeps both and the launch's shape on a GPU)
_COPY_WARPS, _COPY_ALIGNED = 8, True


def _copy_kernel() -> Any:
    """Many tensors copied in one launch, each program a span of one tensor's 4-byte words
    found through a table of addresses; with ``LANES`` it also sums the checksum's lanes of
    the two 16-bit words in each 4-byte word it moves (in registers, between the load and
    the store): the digest of a copy for the price of the copy, not of a second read. Its
    uint32 arithmetic is the batched kernel's. ``None`` where Triton is not installed."""
    global _COPY_KERNEL
    if _COPY_KERNEL is None:
        if _triton_kernel() is None:
            _COPY_KERNEL = False
            return None
        import triton
        import triton.language as tl

        # one variant per LANES and UNIT (as the batched kernel's: not one per table size). The
        # table holds each pair's source and destination as offsets in units of UNIT int32s from
        # ``sbase`` and ``dbase`` (pointer arguments, so Triton knows their alignment), its size
        # in units and each program's start in blocks: with 16-byte units every address the loop
        # makes is known to start a 16-byte run, and its loads and stores are 16 bytes wide, not 4.
        # Offsets from a base, not addresses, so that a table of copies out of a buffer mapped
        # anew every sync is made and uploaded once (PlannedCopies)
        @triton.jit(do_not_specialize=["N", "P"])
        def copy_kernel(meta, N, P, out, sbase, dbase, LANES: tl.constexpr, UNIT: tl.constexpr,
                        S1: tl.constexpr, K1: tl.constexpr, S2: tl.constexpr, K2: tl.constexpr,
                        LOW_BITS: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr):
            pid = tl.program_id(0)
            t = tl.load(meta + 4 * N + pid)
            first = tl.load(meta + 3 * N + t)
            src = sbase + tl.load(meta + t) * UNIT
            dst = dbase + tl.load(meta + N + t) * UNIT
            units = tl.load(meta + 2 * N + t)
            start = tl.load(meta + 4 * N + P + pid) * BLOCK
            if LANES:
                base = ((2 * start + first) >> LOW_BITS).to(tl.uint32)
                here = tl.full((BLOCK,), 0, tl.uint32) + base
                b1 = _FMIX(here + tl.full((BLOCK,), K1, tl.uint32)) | 1
                b1_next = _FMIX(here + 1 + tl.full((BLOCK,), K1, tl.uint32)) | 1
                b2 = _FMIX(here + tl.full((BLOCK,), K2, tl.uint32)) | 1
                b2_next = _FMIX(here + 1 + tl.full((BLOCK,), K2, tl.uint32)) | 1
                acc1 = tl.zeros((BLOCK,), tl.uint32)
                acc2 = tl.zeros((BLOCK,), tl.uint32)
            for k in range(ITERS):
                offs = start + k * BLOCK + tl.arange(0, BLOCK)
                keep = offs // UNIT < units  # known constant over each unit's words
                x = tl.load(src + offs, mask=keep, other=0)
                tl.store(dst + offs, x, mask=keep)
                if LANES:
                    u = x.to(tl.uint32, bitcast=True)
                    for half in tl.static_range(2):  # little-endian: the low 16 bits are the first word
                        w = (u >> (16 * half)) & 0xFFFF
                        j = 2 * offs + half + first
                        low = (j & ((1 << LOW_BITS) - 1)).to(tl.uint32)
                        nxt = (j >> LOW_BITS).to(tl.uint32) != base
                        m1 = (_FMIX(low ^ tl.full((BLOCK,), S1, tl.uint32)) | 1) * tl.where(nxt, b1_next, b1)
                        m2 = (_FMIX(low ^ tl.full((BLOCK,), S2, tl.uint32)) | 1) * tl.where(nxt, b2_next, b2)
                        acc1 += w * m1
                        acc2 += w * m2
            if LANES:
                tl.store(out + pid * 2, tl.sum(acc1, axis=0).to(tl.int64))
                tl.store(out + pid * 2 + 1, tl.sum(acc2, axis=0).to(tl.int64))

        _COPY_KERNEL = copy_kernel
    return _COPY_KERNEL or None


#: devices on which the copying kernel's four variants (lanes or not, 4- or 16-byte units) are compiled
_COPY_PRIMED: set[torch.device] = set()


def _launch_copy(table: np.ndarray | torch.Tensor, tensors: int, programs: int, lanes: bool, device: torch.device,
                 sbase: torch.Tensor, dbase: torch.Tensor, unit: int) -> torch.Tensor | None:
    """Run the copying kernel over a table ``[sources, destinations, sizes, first checksum
    words, item, starts]`` (the first four ``tensors`` long, the last two ``programs`` long) as
    :func:`_relative_table` writes it: sources and destinations as offsets from ``sbase`` and
    ``dbase`` (int32 tensors, the kernel's pointer arguments) and sizes in ``unit``-byte units
    (4 or 16), starts in blocks. A host table is uploaded first (queued, through the device's
    ring); a device one (a plan's, uploaded once) is used as it is. One launch on the current
    stream; ``[tensors, 2]`` lanes where ``lanes``.

    The first launch on a device compiles every variant: Triton compiles each on its first
    use, and the one with lanes is first used by the first verified sync's summed load,
    which took 100 ms longer for it on an H200 (one of three verified syncs in a row)."""
    kernel = _copy_kernel()
    t0 = time.perf_counter()
    if device.type == "cuda" and device not in _COPY_PRIMED:
        _COPY_PRIMED.add(device)
        scratch = torch.zeros(8, dtype=torch.int32, device=device)  # its first unit copied onto itself
        for u in (4, 16):
            for variant in (False, True):
                _launch_copy(np.array([0, 0, 1, 0, 0, 0], dtype=np.int64), 1, 1, variant, device, scratch, scratch, u)
    t1 = time.perf_counter()
    meta_dev = table if isinstance(table, torch.Tensor) else _to_device(table, device)  # queued (see _launch_batch)
    t2 = time.perf_counter()
    partial = torch.empty(programs if lanes else 1, 2, dtype=torch.int64, device=device)
    t3 = time.perf_counter()
    (s1, k1), (s2, k2) = LANE_SEEDS
    kernel[(programs,)](meta_dev, tensors, programs, partial, sbase, dbase, LANES=lanes, UNIT=unit // 4,
                        S1=s1, K1=k1, S2=s2, K2=k2, LOW_BITS=BLOCK_BITS, BLOCK=_COPY_BLOCK, ITERS=_COPY_ITERS,
                        num_warps=_COPY_WARPS)
    t4 = time.perf_counter()
    out = None
    if lanes:
        out = torch.zeros(tensors, 2, dtype=torch.int64, device=device)
        out.index_add_(0, meta_dev[4 * tensors:4 * tensors + programs], partial)
        out &= _MASK
    COPY_LAUNCH_PARTS.update(prime=t1 - t0, upload=t2 - t1, scratch=t3 - t2, kernel=t4 - t3,
                             lanes=time.perf_counter() - t4)
    return out


def _unit(meta: np.ndarray, tensors: int, *bases: int) -> int:
    """The copying kernel's unit for a table of absolute addresses and its bases: 16 bytes
    where every source, destination, size and base allows it (and ``_COPY_ALIGNED``), else 4."""
    n = tensors
    if _COPY_ALIGNED and not any(b % 16 for b in bases) and not np.any(meta[:2 * n] % 16) \
            and not np.any(meta[2 * n:3 * n] % 4):
        return 16
    return 4


def _relative_table(meta: np.ndarray, tensors: int, programs: int, sbase: int, dbase: int, unit: int) -> np.ndarray:
    """The kernel's table (see :func:`_launch_copy`) from ``meta`` (``Copies``' own: sources and
    destinations as addresses, sizes in 4-byte words, starts in words): addresses become
    ``unit``-byte offsets from ``sbase`` and ``dbase``, sizes ``unit``-byte units, each program's
    start a count of blocks; the checksum words and items stay. Every address, size and base is
    a multiple of ``unit`` (``_unit`` says which unit a table allows)."""
    n = tensors
    out = meta.copy()
    out[:n] = (meta[:n] - sbase) // unit
    out[n:2 * n] = (meta[n:2 * n] - dbase) // unit
    out[2 * n:3 * n] = meta[2 * n:3 * n] * 4 // unit
    out[4 * n + programs:] //= _COPY_BLOCK
    return out


#: the host's seconds in each part of the last launch of the copying kernel (``_launch_copy``):
#: compiling it on a device's first launch, the table's upload, the scratch's allocation, the
#: launch itself, the lanes' reduction. Issue 44: an engine's planned load queued its one launch
#: in 0.8 ms in one run and 4.4 ms in another, with nothing to say which part took the rest
COPY_LAUNCH_PARTS: dict[str, float] = {}


class Copies:
    """Whole tensors copied into destinations of the same bytes, in one launch on a GPU from
    a table made once (:func:`_copy_kernel`): no torch call per tensor (each ``copy_`` was
    about 10 us of host time, 338 of them 3.7 ms for 1.5 ms of copying on an H200), and, where
    asked, the checksum's lanes of every tensor's bytes as they pass.

    ``pairs``: ``(destination, source)``, each pair the same number of bytes, every tensor
    contiguous and on one CUDA device, with addresses and sizes multiples of 4 bytes and
    elements of at least 2 bytes (checksum words of 16 bits), of one dtype per pair;
    :meth:`fits` says whether pairs are all that. The addresses are read once and the
    tensors are not held: run it only while every one of them is alive where it was (an
    engine's batch memo knows that by its views' weak references).

    ``owners``, where given: pair ``i`` is a run of tensor ``owners[i]``'s bytes starting at
    its checksum word ``firsts[i]`` (a tensor lying strided in the source, q of a fused QKV:
    one contiguous run per query group, each copied into its place in the destination), and
    the lanes are each owner's, its runs' summed (the checksum is a sum over words that each
    know their place in the tensor, so the runs' lanes add up to the whole's)."""

    def __init__(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], *, firsts: Sequence[int] | None = None,
                 owners: Sequence[int] | None = None):
        if not self.fits(pairs):
            raise ValueError("copies: every pair must be contiguous tensors of the same bytes on one CUDA device, "
                             "4-byte aligned and sized, elements of at least 2 bytes")
        self._table([s.data_ptr() for _, s in pairs], [d.data_ptr() for d, _ in pairs],
                    [s.numel() * s.element_size() for _, s in pairs], pairs[0][0].device, firsts, owners)

    @classmethod
    def into(cls, buffer: torch.Tensor, starts: Sequence[int], sources: Sequence[torch.Tensor]) -> Copies | None:
        """``sources`` copied into ``buffer`` (one contiguous buffer: a staging slot) at byte
        ``starts``, without a view of the buffer per tensor; None where they do not fit (as
        :meth:`fits`: contiguous, 4-byte aligned and sized, elements of 2 bytes or more, on
        the buffer's device). The caller has checked that each fits in the buffer."""
        if not sources or _copy_kernel() is None or not _batchable(buffer):
            return None
        base, device = buffer.data_ptr(), buffer.device
        dests = [base + int(a) for a in starts]
        sizes = []
        for s, d in zip(sources, dests):
            size = s.element_size()
            nbytes = s.numel() * size
            if (s.device != device or size < 2 or nbytes % 4 or d % 4 or s.data_ptr() % 4
                    or not s.is_contiguous()):
                return None
            sizes.append(nbytes)
        out = cls.__new__(cls)
        out._table([s.data_ptr() for s in sources], dests, sizes, device)
        return out

    @classmethod
    def at(cls, sources: Any, dests: Any, nbytes: Any, device: torch.device, firsts: Any = None,
           owners: Any = None) -> Copies:
        """Copies from addresses the caller has already found fit (``sources``, ``dests`` and
        ``nbytes`` as int64 arrays, all multiples of 4, one dtype of 2 bytes or more per pair,
        on ``device``): a plan's layout laid on a buffer whose address its kept table cannot
        take (``PlannedCopies.run_from``)."""
        out = cls.__new__(cls)
        out._table(sources, dests, nbytes, device, firsts, owners)
        return out

    def _table(self, sources: Sequence[int], dests: Sequence[int], nbytes: Sequence[int], device: torch.device,
               firsts: Any = None, owners: Any = None) -> None:
        self.count = len(sources)
        self.device = device
        words = np.array(nbytes, dtype=np.int64) // 4
        span = _COPY_BLOCK * _COPY_ITERS
        counts = np.maximum((words + span - 1) // span, 1)
        item = np.repeat(np.arange(len(words), dtype=np.int64), counts)
        starts = (np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)) * span
        self.programs = len(item)
        first = np.zeros(len(words), dtype=np.int64) if firsts is None else np.asarray(firsts, dtype=np.int64)
        #: each pair's tensor, where pairs are runs of tensors (None: each pair its own tensor)
        self.owners = None if owners is None else np.asarray(owners, dtype=np.int64)
        if self.owners is not None and (len(self.owners) != self.count or len(first) != self.count):
            raise ValueError(f"copies: {self.count} pairs, {len(self.owners)} owners and {len(first)} first words")
        #: how many tensors the lanes are of
        self.tensors = self.count if self.owners is None else int(self.owners.max(initial=-1)) + 1
        self.meta = np.concatenate([np.array(sources, dtype=np.int64), np.array(dests, dtype=np.int64),
                                    words, first, item, starts])

    @staticmethod
    def available() -> bool:
        """Triton is there to compile the kernel (where it is not, nothing fits)."""
        return _copy_kernel() is not None

    @staticmethod
    def reads(t: torch.Tensor) -> bool:
        """Whether the kernel reads and writes ``t``'s memory (a CUDA tensor)."""
        return _batchable(t)

    @staticmethod
    def fits(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        if not pairs or _copy_kernel() is None:
            return False
        device = pairs[0][0].device
        for d, s in pairs:
            size = s.element_size()
            nbytes = s.numel() * size
            if (not _batchable(d) or d.device != device or s.device != device or size < 2 or d.dtype != s.dtype
                    or d.numel() != s.numel() or nbytes % 4
                    or d.data_ptr() % 4 or s.data_ptr() % 4 or not d.is_contiguous() or not s.is_contiguous()):
                return False
        return True

    def run(self, lanes: bool = False) -> torch.Tensor | None:
        """Queue the copies on the current stream; with ``lanes``, ``[len(pairs), 2]`` lanes of
        each pair's bytes (those of ``colo.digest.lanes`` of its source, whole) on the device;
        with ``owners``, ``[tensors, 2]``, each tensor's runs summed."""
        COPY_LAUNCH_PARTS.clear()
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            # the table's base: a fresh small block (the caching allocator's start on 512-byte
            # boundaries), every address an offset from it
            anchor = torch.empty(4, dtype=torch.int32, device=self.device)
            at = anchor.data_ptr()
            unit = _unit(self.meta, self.count, at)
            table = _relative_table(self.meta, self.count, self.programs, at, at, unit)
            return self._owned(_launch_copy(table, self.count, self.programs, lanes, self.device, anchor, anchor, unit))

    def _owned(self, got: torch.Tensor | None, index: torch.Tensor | None = None) -> torch.Tensor | None:
        """Lanes per pair summed per owner, where pairs are runs of tensors (``index``: the
        owners on the lanes' device, where the caller holds them there)."""
        if got is None or self.owners is None:
            return got
        if index is None:
            index = torch.from_numpy(self.owners)
            if self.device.type == "cuda":
                index = index.pin_memory().to(self.device, non_blocking=True)
        out = torch.zeros(self.tensors, 2, dtype=torch.int64, device=got.device)
        return out.index_add_(0, index.to(got.device), got) & _MASK


class PlannedCopies(Copies):
    """:class:`Copies` out of a buffer mapped anew every sync at the same offsets (a sender's
    bucket, the same layout sync after sync) into the same destinations: the kernel's table is
    made and uploaded once, its sources offsets from the buffer given to :meth:`run_from`, so a
    sync's launch is the launch alone.

    Why: laying the table on each sync's buffer and uploading it took 0.4-0.7 ms of host time
    before the launch at Qwen2-1.5B on an H200 (route_plan_table_s and route_plan_upload_s,
    call68b), the device idle meanwhile, in a one-copy ``sync-first`` load of 2.3 ms.

    ``starts``: each pair's byte offset in the buffer; ``dests``, ``nbytes``, ``firsts``,
    ``owners`` as :meth:`Copies.at`. The destinations must stay where they are while this is
    used (an engine's plan is dropped with the allocation of its weights)."""

    def __init__(self, starts: Any, dests: Any, nbytes: Any, device: torch.device, firsts: Any = None,
                 owners: Any = None) -> None:
        self._table(starts, dests, nbytes, device, firsts, owners)
        # the sources' unit as offsets; a buffer whose own address does not allow it is copied
        # through a table laid on it (Copies.at), as before plans were kept
        self.unit = _unit(self.meta, self.count)
        self._anchor: torch.Tensor | None = None
        self._uploaded: torch.Tensor | None = None
        self._owners_dev: torch.Tensor | None = None

    def run_from(self, flat: torch.Tensor, lanes: bool = False) -> torch.Tensor | None:
        """Queue the copies out of ``flat`` (a contiguous uint8 buffer on the device, at least as
        large as the layout); lanes as :meth:`Copies.run`."""
        base = flat.data_ptr()
        if base % self.unit:
            laid = Copies.at(self.meta[:self.count] + base, self.meta[self.count:2 * self.count],
                             self.meta[2 * self.count:3 * self.count] * 4, self.device,
                             None if self.owners is None else self.meta[3 * self.count:4 * self.count], self.owners)
            return laid.run(lanes)
        COPY_LAUNCH_PARTS.clear()
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            if self._uploaded is None:
                self._anchor = torch.empty(4, dtype=torch.int32, device=self.device)
                table = _relative_table(self.meta, self.count, self.programs, 0, self._anchor.data_ptr(), self.unit)
                self._uploaded = _to_device(table, self.device) if self.device.type == "cuda" else torch.from_numpy(table)
                if self.owners is not None:
                    self._owners_dev = torch.from_numpy(self.owners).to(self.device)
            source = flat[:flat.numel() // 4 * 4].view(torch.int32)  # the buffer as the kernel's int32 pointer
            got = _launch_copy(self._uploaded, self.count, self.programs, lanes, self.device, source, self._anchor,
                               self.unit)
            return self._owned(got, self._owners_dev)


class Labels:
    """What a table of lanes is the lanes of: each tensor's name and entry header (name,
    dtype, shape), in the table's order (:meth:`ReceivedDigest.add_lanes`)."""

    def __init__(self, named: Sequence[tuple[str, torch.Tensor]]):
        self.names = [n for n, _ in named]
        self.index = {n: i for i, n in enumerate(self.names)}
        if len(self.index) != len(self.names):
            raise ValueError("labels: a name appears twice")
        self.headers = [_header(n, dtype_name(t.dtype), t.shape) for n, t in named]


def _word_groups(sizes: Sequence[int], starts: np.ndarray, nbytes: np.ndarray,
                 what: str) -> list[tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """Per word size, the indices of the tensors of that word (of element ``sizes``, at byte
    ``starts`` of ``nbytes``; the empty ones left out), their words, and the batched
    kernel's program table for them."""
    words = np.array([word_size(s) for s in sizes], dtype=np.int64)
    groups = []
    for word in (1, 2):
        idx = np.flatnonzero((words == word) & (nbytes > 0))
        if idx.size:
            if (starts[idx] % word).any() or (nbytes[idx] % word).any():
                raise ValueError(f"{what}: a tensor does not start at a multiple of its word")
            ns = nbytes[idx] // word
            groups.append((word, idx, ns, *_program_table(ns)))
    return groups


class Spans:
    """Whole tensors at fixed byte offsets of one contiguous buffer, as a digest reads them:
    derived once per layout, so that the lanes of all of them are one launch on a GPU with no
    torch object per tensor (:meth:`ReceivedDigest.add_spans`). ``entries``: ``(name, dtype,
    shape, start, nbytes)``, ``start`` in bytes from the buffer's first, a multiple of the
    dtype's size."""

    def __init__(self, entries: Sequence[tuple[str, str, Sequence[int], int, int]]):
        self.names = [e[0] for e in entries]
        #: each tensor's header (name, dtype, shape): its entry is sha256(header + lanes)
        self.headers = [_header(n, d, s) for n, d, s, _, _ in entries]
        self.index = {n: i for i, n in enumerate(self.names)}
        if len(self.index) != len(self.names):
            raise ValueError("spans: a name appears twice")
        self.starts = np.array([e[3] for e in entries], dtype=np.int64)
        self.nbytes = np.array([e[4] for e in entries], dtype=np.int64)
        self.end = int((self.starts + self.nbytes).max(initial=0))
        #: per word size, the tensors' indices, their words and the kernel's program table
        self.groups = _word_groups([itemsize(e[1]) for e in entries], self.starts, self.nbytes, "spans")

    def lanes(self, buffer: torch.Tensor) -> torch.Tensor | list[list[int]]:
        """``[len(names), 2]`` lanes of the tensors in ``buffer`` (contiguous, at least
        :attr:`end` bytes): on a GPU with Triton one launch per word size, queued on the
        current stream; elsewhere tensor by tensor (a list of ``[lane_1, lane_2]``)."""
        if buffer.dim() != 1 or not buffer.is_contiguous() or buffer.numel() * buffer.element_size() < self.end:
            raise ValueError(f"spans: a contiguous 1-D buffer of at least {self.end} bytes is needed")
        raw = buffer.view(torch.uint8)
        if _batch_kernel() is not None and _batchable(raw):
            out = torch.zeros(len(self.names), 2, dtype=torch.int64, device=raw.device)
            base = raw.data_ptr()
            with torch.cuda.device(raw.device) if raw.is_cuda else contextlib.nullcontext():
                for word, idx, ns, item, starts in self.groups:
                    meta = np.concatenate([base + self.starts[idx], ns, np.zeros(len(idx), dtype=np.int64),
                                           item, starts])
                    got = _launch_batch(meta, len(idx), len(item), word, raw.device)
                    if len(idx) == len(self.names):  # one dtype's size, the usual case: these are the lanes
                        return got
                    index = torch.from_numpy(idx)
                    out[index.pin_memory().to(raw.device, non_blocking=True) if raw.is_cuda else index] = got
            return out
        rows: list[list[int]] = [[0, 0] for _ in self.names]
        if raw.device.type == "cpu":
            host = raw.numpy()
            for word, idx, ns, _, _ in self.groups:
                view = host.view(np.uint8) if word == 1 else host[:host.size // 2 * 2].view(np.uint16)
                for i, n in zip(idx.tolist(), ns.tolist()):
                    a = int(self.starts[i]) // word
                    rows[i] = _host_lanes_np(view[a:a + n], 0)
            return rows
        for word, idx, ns, _, _ in self.groups:
            words = raw.view(_WORD_VIEW[word]) if word == 1 else raw[:raw.numel() // 2 * 2].view(_WORD_VIEW[word])
            for i, n in zip(idx.tolist(), ns.tolist()):
                a = int(self.starts[i]) // word
                rows[i] = [int(v) for v in _torch_lanes(words[a:a + n], 0).tolist()]
        return rows


class Blocks:
    """Whole tensors where they lie, at addresses that stay what they are while this is kept
    (an engine's row blocks, the same every sync until its weights are allocated anew): the
    table the batched kernel reads is made once, so that summing a load's blocks is one
    launch per word size with no torch object and no lookup per tensor
    (:meth:`ReceivedDigest.add_blocks`). Holds the tensors, so their addresses stay valid;
    let it go with them."""

    def __init__(self, named: Sequence[tuple[str, torch.Tensor]]):
        self.names = [n for n, _ in named]
        self.index = {n: i for i, n in enumerate(self.names)}
        if len(self.index) != len(self.names):
            raise ValueError("blocks: a name appears twice")
        self.tensors = [t.detach() for _, t in named]
        if any(not t.is_contiguous() for t in self.tensors):
            raise ValueError("blocks: every tensor must be contiguous (a row block of a parameter is)")
        if len({t.device for t in self.tensors}) > 1:
            raise ValueError("blocks: every tensor must be on one device")
        self.headers = [_header(n, dtype_name(t.dtype), t.shape) for n, t in zip(self.names, self.tensors)]
        sizes = [t.element_size() for t in self.tensors]
        starts = np.array([t.data_ptr() for t in self.tensors], dtype=np.int64)
        nbytes = np.array([t.numel() * z for t, z in zip(self.tensors, sizes)], dtype=np.int64)
        self.nbytes = int(nbytes.sum())
        #: per word size: the tensors' indices and the kernel's whole table (addresses, words,
        #: first words, each program's tensor and start)
        self.tables = [(word, idx, len(item), np.concatenate([starts[idx], ns, np.zeros(len(idx), dtype=np.int64),
                                                              item, first]))
                       for word, idx, ns, item, first in _word_groups(sizes, starts, nbytes, "blocks")]

    def lanes(self) -> torch.Tensor | list[list[int]]:
        """``[len(names), 2]`` lanes of the tensors as they are now: on a GPU with Triton one
        launch per word size, queued on the current stream; elsewhere tensor by tensor."""
        if self.tensors and _batch_kernel() is not None and _batchable(self.tensors[0]):
            device = self.tensors[0].device
            with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                if len(self.tables) == 1 and len(self.tables[0][1]) == len(self.names):
                    word, idx, programs, meta = self.tables[0]  # one word size, none empty: the usual case
                    return _launch_batch(meta, len(idx), programs, word, device)
                out = torch.zeros(len(self.names), 2, dtype=torch.int64, device=device)
                for word, idx, programs, meta in self.tables:
                    index = torch.from_numpy(idx)
                    out[index.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else index] = \
                        _launch_batch(meta, len(idx), programs, word, device)
                return out
        return [[int(v) & _MASK for v in (got if isinstance(got, list) else got.tolist())]
                for got in (lanes(t) for t in self.tensors)]


def _batchable(t: torch.Tensor) -> bool:
    """A tensor the batched kernel reads where it lies (the tests point this at host tensors,
    with a host stand-in for the kernel, to check the tables the kernel is given)."""
    return t.is_cuda


class LaneRow:
    """Row ``index`` of a batch's ``[n, 2]`` lanes on the device: read back with the rest of its
    batch (:func:`_read`), not as a tensor of its own (one view per tensor was host time)."""

    __slots__ = ("batch", "index")

    def __init__(self, batch: torch.Tensor, index: int):
        self.batch, self.index = batch, index

    @property
    def device(self) -> torch.device:
        return self.batch.device

    def tolist(self) -> list[int]:
        return self.batch[self.index].tolist()


def lanes_many(items: Sequence[tuple[torch.Tensor, int]]) -> list[torch.Tensor | list[int] | LaneRow]:
    """:func:`lanes` of many ``(tensor, offset)``: the CUDA ones in one launch per device and
    word size (the same values as one by one), read where they lie: no view per tensor (each
    was a few microseconds of host time, hundreds of tensors a sync), a copy only of one that
    is not contiguous."""
    out: list[Any] = [None] * len(items)
    #: (device, word size) -> (index in items, address, words, first word)
    groups: dict[tuple[torch.device, int], list[tuple[int, int, int, int]]] = {}
    held: list[torch.Tensor] = []  # contiguous copies, alive until their launch is queued
    batched = _batch_kernel() is not None
    for i, (t, offset) in enumerate(items):
        if batched and _batchable(t) and t.numel() > 0:
            size = t.element_size()
            word = 1 if size == 1 else 2
            if not t.is_contiguous():
                t = t.contiguous()
                held.append(t)
            groups.setdefault((t.device, word), []).append(
                (i, t.data_ptr(), t.numel() * size // word, int(offset) * (size // word)))
        else:
            out[i] = lanes(t, offset)
    for (device, word), group in groups.items():
        table = np.array(group, dtype=np.int64)
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            ns = table[:, 2]
            item, starts = _program_table(ns)
            meta = np.concatenate([table[:, 1], ns, table[:, 3], item, starts])
            got = _launch_batch(meta, len(group), len(item), word, device)
        for k, i in enumerate(table[:, 0].tolist()):
            out[i] = LaneRow(got, k)
    del held
    return out


def _read(parts: Sequence[torch.Tensor | list[int] | LaneRow]) -> list[list[int]]:
    """Lanes to ints: a batch's rows with one read-back per batch, other device lanes with one
    per device."""
    out: list[list[int] | None] = [p if isinstance(p, list) else None for p in parts]
    by_device: dict[torch.device, list[int]] = {}
    by_batch: dict[int, tuple[torch.Tensor, list[int]]] = {}
    for i, p in enumerate(parts):
        if isinstance(p, LaneRow):
            by_batch.setdefault(id(p.batch), (p.batch, []))[1].append(i)
        elif not isinstance(p, list):
            by_device.setdefault(p.device, []).append(i)
    for batch, idx in by_batch.values():
        values = batch.cpu().tolist()  # masked to 32 bits where it was made (_launch_batch)
        for i in idx:
            out[i] = values[parts[i].index]  # type: ignore[union-attr]
    for idx in by_device.values():
        values = torch.stack([parts[i] for i in idx]).cpu().tolist()
        for i, v in zip(idx, values):
            out[i] = [int(x) & _MASK for x in v]
    return out  # type: ignore[return-value]


def _entry(name: str, dtype: str, shape: Sequence[int], lane_values: Sequence[int]) -> bytes:
    body = b"".join(int(v).to_bytes(4, "little") for v in lane_values)
    return hashlib.sha256(_header(name, dtype, shape) + body).digest()


class TensorHash:
    """One tensor's entry, fed its elements as the whole or as pieces (each with its element offset)."""

    __slots__ = ("name", "dtype", "shape", "_lanes", "_seen", "_total")

    def __init__(self, name: str, dtype: str, shape: Sequence[int], nbytes: int):
        self.name, self.dtype, self.shape = name, dtype, tuple(int(s) for s in shape)
        self._lanes: list[torch.Tensor | list[int]] = []
        self._seen, self._total = 0, int(nbytes)

    def update(self, data: torch.Tensor, offset: int | None = None) -> None:
        """Add elements ``[offset, offset + data.numel())`` (after the last ones fed, by default)."""
        size = data.element_size()
        start = self._seen // size if offset is None else int(offset)
        self.add_lanes(lanes(data, start), data.numel() * size)

    def add_lanes(self, part: torch.Tensor | list[int], nbytes: int) -> None:
        """Add the lanes of ``nbytes`` of this tensor computed elsewhere (:func:`lanes_many`)."""
        self._lanes.append(part)
        self._seen += int(nbytes)

    @property
    def complete(self) -> bool:
        return self._seen == self._total

    def pending(self) -> list[torch.Tensor | list[int]]:
        if not self.complete:
            raise ValueError(f"{self.name}: hashed {self._seen} of its {self._total} bytes")
        return self._lanes

    def entry_from(self, parts: Sequence[Sequence[int]]) -> bytes:
        total = [sum(p[lane] for p in parts) & _MASK for lane in range(2)]
        return _entry(self.name, self.dtype, self.shape, total)

    def entry(self) -> bytes:
        return self.entry_from(_read(self.pending()))


def _new_hash(name: str, tensor: torch.Tensor) -> TensorHash:
    return TensorHash(name, dtype_name(tensor.dtype), tuple(tensor.shape), tensor.numel() * tensor.element_size())


def _hash_of(name: str, tensor: torch.Tensor) -> TensorHash:
    h = _new_hash(name, tensor)
    h.update(tensor, 0)
    return h


def hash_many(named: Sequence[tuple[str, torch.Tensor]]) -> list[TensorHash]:
    """Each pair's :class:`TensorHash`, its lanes queued (the device ones in one launch per
    device and word size) on the current stream; :func:`entries_of` reads them back."""
    hashes = [_new_hash(n, t) for n, t in named]
    for h, (_, t), part in zip(hashes, named, lanes_many([(t, 0) for _, t in named])):
        h.add_lanes(part, t.numel() * t.element_size())
    return hashes


def entries_of(hashes: Sequence[TensorHash]) -> list[bytes]:
    """Every entry, reading the device lanes back once per device."""
    flat, owner = [], []
    for i, h in enumerate(hashes):
        for p in h.pending():
            flat.append(p)
            owner.append(i)
    values = _read(flat)
    grouped: list[list[list[int]]] = [[] for _ in hashes]
    for i, v in zip(owner, values):
        grouped[i].append(v)
    return [h.entry_from(g) for h, g in zip(hashes, grouped)]


def tensor_entry(name: str, tensor: torch.Tensor) -> bytes:
    """The entry of one whole tensor."""
    return _hash_of(name, tensor).entry()


def combine(entries: Iterable[bytes]) -> str:
    """The digest of entries, in the order given."""
    h = hashlib.sha256()
    for e in entries:
        h.update(e)
    return h.hexdigest()


def weights_digest(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """The digest of ``(HF name, tensor)`` pairs in the order given, each on its own device:
    what the trainer computes over the tensors it sends, converted to the engine's dtype."""
    return combine(entries_of(hash_many(list(named))))


def weights_entries(named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, bytes]]:
    """Each pair's entry, in the order given: ``combine`` of them is :func:`weights_digest`.
    Compared entry by entry they name the tensors two digests disagree on."""
    items = list(named)
    return list(zip((n for n, _ in items), entries_of(hash_many(items))))


def expected_weights_digest(state: Mapping[str, torch.Tensor], order: Sequence[str], dtype: Any) -> str:
    """The digest an engine of ``dtype`` reports after receiving ``state`` under the spec
    list ``order`` (each tensor converted to the engine dtype on its own device, as the
    sender does)."""
    missing = [n for n in order if n not in state]
    if missing:
        raise KeyError(f"the trainer has no tensor named {', '.join(missing[:5])}"
                       + (f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""))
    hashes: list[TensorHash] = []
    group: list[tuple[str, torch.Tensor]] = []
    converted = 0
    for n in order:  # converted tensors in groups of at most CONVERT_BYTES, one launch a group
        t = state[n].detach()
        if t.dtype != dtype:
            t = t.to(dtype=dtype)
            converted += t.numel() * t.element_size()
        group.append((n, t))
        if converted >= CONVERT_BYTES:
            hashes += hash_many(group)
            group, converted = [], 0
    return combine(entries_of(hashes + hash_many(group)))


class ReceivedDigest:
    """An engine's record of the tensors it received in one sync, checksummed as they arrive,
    on the device they arrive on.

    ``add(name, tensor)`` takes a whole tensor or a piece (an object with ``data``,
    ``shape``, ``offset``: :class:`colo.transports.wire.Piece`), pieces in any order;
    :meth:`digest` combines the entries in the order asked for and names any tensor
    it did not (completely) receive. The checksum of a device tensor is queued on the
    current stream: the caller keeps the tensor's memory until that stream passes it
    (as it does for its own copy of the tensor).
    """

    def __init__(self) -> None:
        self._open: dict[str, TensorHash] = {}
        self._done: dict[str, TensorHash] = {}
        #: whole tensors recorded a table at a time (:meth:`add_spans`, :meth:`add_blocks`): the
        #: table and its lanes
        self._spans: list[tuple[Spans | Blocks | Labels, Any]] = []
        #: name -> its batch in ``_spans``
        self._in_spans: dict[str, int] = {}

    def clear(self) -> None:
        self._open.clear()
        self._done.clear()
        self._spans.clear()
        self._in_spans.clear()

    def add_spans(self, buffer: torch.Tensor, spans: Spans) -> None:
        """Record the whole tensors ``spans`` places in ``buffer`` (a copy of what arrived, the
        layout derived once): one launch on a GPU, whatever their number."""
        self._add_table(spans, lambda: spans.lanes(buffer))

    def add_blocks(self, blocks: Blocks) -> None:
        """Record the whole tensors of ``blocks`` as they lie now (written, or their writes
        queued on the current stream): one launch on a GPU, from a table made once."""
        self._add_table(blocks, blocks.lanes)

    def add_lanes(self, labels: Labels, lanes: Any) -> None:
        """Record whole tensors whose lanes were computed elsewhere (:meth:`Copies.run` as it
        copied them): ``lanes`` ``[len(labels.names), 2]``, on the device or as rows."""
        self._add_table(labels, lambda: lanes)

    def _add_table(self, table: Spans | Blocks | Labels, lanes_of: Any) -> None:
        taken = [n for n in table.names if n in self._in_spans or n in self._done or n in self._open]
        if taken:
            raise ValueError(f"received twice: {', '.join(taken[:5])}")
        self._spans.append((table, lanes_of()))
        self._in_spans.update(dict.fromkeys(table.names, len(self._spans) - 1))

    def add(self, name: str, tensor: Any) -> None:
        self.add_many([(name, tensor)])

    def add_many(self, items: Sequence[tuple[str, Any]]) -> None:
        """Record a batch as it arrived (whole tensors and pieces): the device ones in one launch."""
        cut = [n for n, t in items if not isinstance(t, torch.Tensor) and not hasattr(t, "offset")]
        if cut:
            # a rank's slice (colo.transports.wire.RankSlice) is not the tensor the name says
            raise ValueError(f"{', '.join(cut[:5])} arrived cut for one engine rank: a received digest covers "
                             f"whole tensors; compare the engine rank's shard digest instead")
        parts = [(t, 0) if isinstance(t, torch.Tensor) else (t.data, t.offset) for _, t in items]
        for (name, tensor), (data, _), got in zip(items, parts, lanes_many(parts)):
            if isinstance(tensor, torch.Tensor):
                h = self._done[name] = _new_hash(name, tensor)
                h.add_lanes(got, tensor.numel() * tensor.element_size())
                continue
            h = self._open.get(name)
            if h is None:
                numel = 1
                for s in tensor.shape:
                    numel *= int(s)
                h = self._open[name] = TensorHash(name, dtype_name(data.dtype), tensor.shape,
                                                   numel * data.element_size())
            h.add_lanes(got, data.numel() * data.element_size())
            if h.complete:
                self._done[name] = self._open.pop(name)

    @property
    def names(self) -> list[str]:
        return list(self._done) + list(self._in_spans)

    def digest(self, order: Sequence[str]) -> str:
        missing = [n for n in order if n not in self._done and n not in self._in_spans]
        if missing:
            partial = [n for n in missing if n in self._open]
            raise ValueError(f"no complete tensor received under {len(missing)} name(s) of the spec list: "
                             f"{', '.join(missing[:5])}" + (f" ({', '.join(partial[:5])} only in part)" if partial else ""))
        whole = iter(entries_of([self._done[n] for n in order if n in self._done]))
        # every batch's lanes read back together, as 8 little-endian bytes a tensor
        blobs = list(zip((spans for spans, _ in self._spans), _lane_blobs([got for _, got in self._spans])))
        out = []
        for n in order:
            b = self._in_spans.get(n)
            if b is None:
                out.append(next(whole))
                continue
            spans, blob = blobs[b]
            i = spans.index[n]
            out.append(hashlib.sha256(spans.headers[i] + blob[8 * i:8 * i + 8]).digest())
        return combine(out)


def _lane_blobs(tables: Sequence[torch.Tensor | list[list[int]]]) -> list[bytes]:
    """Each table of lanes ``[n, 2]`` (a tensor, or rows of ints summed on the host) as each
    tensor's 8 little-endian bytes of its entry, the tensors read back in one copy per device:
    each read-back waits for the device and is a copy of its own, and a 7B model's load sums
    its blocks in about 12 groups (issue 44: the engine's end digest took 2.8 ms, 0.91 ms so)."""
    rows: list[Any] = [None] * len(tables)
    on: dict[torch.device, list[int]] = {}
    for i, got in enumerate(tables):
        if isinstance(got, torch.Tensor):
            on.setdefault(got.device, []).append(i)
        else:
            rows[i] = np.array(got, dtype=np.int64).reshape(-1, 2)
    for idx in on.values():
        read = torch.cat([tables[i] for i in idx]).cpu().numpy()
        for i, part in zip(idx, np.split(read, np.cumsum([tables[i].shape[0] for i in idx])[:-1])):
            rows[i] = part
    return [(r & _MASK).astype("<u4").tobytes() for r in rows]


__all__ = ["BLOCK_BITS", "Blocks", "COPY_LAUNCH_PARTS", "combine", "Copies", "PlannedCopies", "Labels", "CONVERT_BYTES", "entries_of", "expected_weights_digest", "hash_many",
           "LANE_SEEDS", "lanes", "lanes_many", "multiplier", "ReceivedDigest", "Spans", "tensor_entry", "TensorHash",
           "weights_digest", "word_size"]
