"""Packing a bucket's tensors into one flat staging buffer, at the bucket's offsets.

Every transport that stages (``packed``, ``ipc``'s per-tensor export, ``broadcast``)
copies through here: tensors that lie back to back in one source go as one copy,
copies from pinned host memory are queued on the sender's upload stream, and the
caller learns through an event when the bytes are in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from colo.core.buckets import Bucket
from colo.digest import Copies
from colo.transports.base import check_bucket_tensors, is_piece


def pack_into(flat: Any, bucket: Bucket, tensors: Sequence[tuple[str, Any]]) -> int:
    """Copy ``tensors`` into ``flat`` at the bucket's offsets (a piece: its byte range of
    the tensor); check names and sizes first. Tensors that lie back to back in one
    source buffer, at the same distances as in the bucket, go as one copy."""
    check_bucket_tensors(bucket, tensors, flat.device)
    for start, end, src in source_runs(bucket, tensors):
        dst = flat[start:end]
        if src.device == dst.device and src.data_ptr() == dst.data_ptr():
            continue  # the extractor wrote it in place (PackedTransport._destinations)
        # Straight from a pinned host copy into the device buffer: one upload,
        # no intermediate device tensor; queued, and settled once per bucket.
        dst.copy_(src, non_blocking=src.device.type == "cpu" and src.is_pinned())
    return bucket.payload_bytes


def pack_batched(flat: Any, bucket: Bucket, tensors: Sequence[tuple[str, Any]]) -> bool:
    """Pack a bucket of whole tensors already on the buffer's GPU in one launch
    (``colo.digest.Copies``), after the same check as :func:`pack_into`; False, with
    nothing copied, where they are not all that (a piece, a host source, a size or an
    address the kernel cannot take): then :func:`pack_into` copies them.

    Why: one ``copy_`` per tensor, with the byte view and the run it needs, was most of a
    sharded trainer's ``sync-first`` pack (20 ms for 338 tensors in six buckets on an H200,
    where copying the bytes takes 1.5 ms; issue 44)."""
    if not Copies.available():
        return False
    if not tensors or tensors[0][1].device != flat.device or any(not e.whole for e in bucket.entries):
        return False  # (a host source, offload-first: uploaded by the copy engine, checked once there)
    check_bucket_tensors(bucket, tensors, flat.device)
    # a tensor the extractor already wrote at its entry (PackedTransport._destinations) stays
    base = flat.data_ptr()
    todo = [(e.start, t) for e, (_, t) in zip(bucket.entries, tensors) if t.data_ptr() != base + e.start]
    if not todo:
        return True
    copies = Copies.into(flat, [a for a, _ in todo], [t for _, t in todo])
    if copies is None:
        return False
    copies.run()
    return True


def source_runs(bucket: Bucket, tensors: Sequence[tuple[str, Any]]) -> list[tuple[int, int, Any]]:
    """``(start, end, source bytes)`` per copy the bucket needs: consecutive entries
    whose sources sit in one storage at the same distance apart as their offsets in
    the bucket are merged into one run, gaps included (a gap is padding on both sides).

    Why: a trainer that keeps its weights (or their pinned host copy) in one flat
    buffer laid out with the bucket's alignment, as ``colo.device.flat_weights`` and
    Megatron's DDP do, has every bucket's tensors back to back, and one copy of a
    bucket costs the copy engine one setup instead of one per tensor (about 25 us
    each, measured on an H100 uploading 338 tensors: 0.94 of one copy of the same
    bytes; issue 18)."""
    runs: list[tuple[int, int, Any]] = []
    first: Any = None  # the run's first source: the run's bytes start at its first byte
    start = end = ptr = base = 0
    for (_, t), e in zip(tensors, bucket.entries):
        src = entry_bytes(t, e)
        p = src.data_ptr()
        b = src.untyped_storage().data_ptr()
        if first is not None and b == base and p - ptr == e.start - start and src.device == first.device \
                and e.start >= end:
            end = e.end
            continue
        if first is not None:
            runs.append((start, end, _extend(first, end - start)))
        first, start, end, ptr, base = src, e.start, e.end, p, b
    if first is not None:
        runs.append((start, end, _extend(first, end - start)))
    return runs


def _extend(src: Any, nbytes: int) -> Any:
    """``nbytes`` of ``src``'s storage from ``src``'s first byte (``src`` itself when that is all)."""
    return src if src.numel() == nbytes else src.as_strided((nbytes,), (1,), src.storage_offset())


def entry_bytes(t: Any, e: Any) -> Any:
    """The bytes of ``t`` that entry ``e`` carries, as a uint8 view (no copy of a contiguous
    tensor); ``t`` itself when it is the piece's own bytes (gathered by range)."""
    if is_piece(t, e):
        return t
    flat = t.contiguous().view(-1).view(torch.uint8)
    return flat if e.whole else flat[e.offset:e.offset + e.nbytes]


def queue_pack(flat: Any, bucket: Bucket, tensors: Sequence[tuple[str, Any]], stream: Any = None, *,
               in_place: bool = False) -> Any:
    """Queue the copies of one bucket into ``flat``; return an event recorded after
    them on ``stream``, or None when the copies are already done (off the GPU, or
    with no upload stream: then the device is synchronised here).

    With a ``stream`` (the sender's upload stream) the copies run there, after
    what produced the tensors, and the caller waits only for that stream's work,
    through the event, not for the whole device. Returning before the copies
    finish is what keeps the copy engine busy: the next bucket's upload is queued
    behind this one while this one is still moving (issue 18).

    ``in_place``: the caller knows every tensor already lies in ``flat`` at its
    entry (the extractor wrote it there): nothing is copied, and the event still
    follows what wrote them. Working that out per tensor (a byte view of each, the
    runs) was most of a small bucket's host time."""
    if stream is None or not flat.is_cuda:
        if not in_place:
            pack_into(flat, bucket, tensors)
        if flat.is_cuda:
            torch.cuda.synchronize(flat.device)
        return None
    stream.wait_stream(torch.cuda.current_stream(flat.device))
    with torch.cuda.stream(stream):
        if not in_place and not pack_batched(flat, bucket, tensors):
            pack_into(flat, bucket, tensors)
        done = torch.cuda.Event()
        done.record(stream)
    if in_place:
        return done  # the slot's own views: nothing the allocator could hand out meanwhile
    # The caller drops the sources when this returns, before the queued copies have
    # read them. A source made on another stream (an extractor without an upload
    # device gathers on the default stream) would go back to that stream's pool, and
    # the next bucket's gather could be handed the same block and overwrite it while
    # the copies still read it: the allocator keeps such a block until this stream is
    # past them. (Found on two H200s: FSDP2 under sync-first, whose all-gather outputs
    # come from the default stream, loaded bytes into the engine that differed from run
    # to run; the commit before the queued upload loaded them exactly.)
    for _, t in tensors:
        if t.is_cuda:
            t.record_stream(stream)
    return done


def pack_and_settle(flat: Any, bucket: Bucket, tensors: Sequence[tuple[str, Any]],
                    stream: Any = None) -> None:
    """Pack, then wait until the bytes are in ``flat``.

    The engine reads the buffer from another process, outside any stream order
    of ours: the copies must be done before the handle goes out."""
    done = queue_pack(flat, bucket, tensors, stream)
    if done is not None:
        done.synchronize()
