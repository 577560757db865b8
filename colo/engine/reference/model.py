"""The engine's own dense decoder (Qwen2, Qwen3, Llama): the same math as Hugging Face's,
with fused parameters. What differs between them (Qwen2's q/k/v bias, Qwen3's per-head
q/k norms and its own head_dim) is read from the architecture table
(:mod:`colo.models.arch`) through the ``Dims`` the model is built on.

Like SGLang's and vLLM's model files, q/k/v live in one ``qkv_proj`` and
gate/up in one ``gate_up_proj``; the loader maps each trainer (HF) tensor to
its row block through a table (:mod:`colo.engine.reference.weights`), so a weight sync
must deliver every HF name exactly once and the engine can say precisely
which ones it did not get (the accounting is :class:`colo.engine.kit.LoadSession`).
With tied word embeddings (Qwen2/Qwen2.5 0.5B-3B) one parameter,
``model.embed_tokens.weight``, is both the embedding and lm_head: it is
loaded, held and hashed once, and a separate ``lm_head.weight`` is refused.

Memory is held in two independently releasable regions, mirroring the
engine's memory-saver tags: the parameters (``weights``) and one preallocated
KV pool (``kv_cache``) sized from ``mem_fraction_static`` the way SGLang sizes
it. Nothing here touches ``torch.cuda`` at import; the device is a parameter.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from colo.core.errors import EngineStateError, WeightMismatch
from colo.digest import (COPY_LAUNCH_PARTS, Blocks, Copies, Labels, PlannedCopies, ReceivedDigest, weights_digest,
                         weights_entries)
from colo.core.interfaces import TensorSpec
from colo.dtypes import DTypeLike, as_dtype, dtype_name
from colo.engine.reference.dims import Dims, dims_from_config
from colo.engine.kit import LoadSession
from colo.engine.reference.kvpool import KVPoolPlan, SlotAllocator
from colo.engine.reference.weights import WeightMap, _check_specs, _named_items, _spec_triples
from colo.transports.wire import Piece, RankSlice, Strided, piece_in


def _source(t: Any) -> torch.Tensor:
    """The tensor a batch item's bytes are in: a rank's slice's data, else the item itself."""
    return t.data if isinstance(t, RankSlice) else t


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


#: bucket layouts an engine keeps planned (``_LayoutPlan``): a sync's buckets, a few times over
MAX_LAYOUT_PLANS = 64
#: a strided tensor in more contiguous runs than this is copied on its own, not in the launch
#: (q of a fused QKV has one per query group: 8 at most in Qwen2 and Llama 3)
MAX_RUNS = 256
#: the ways ``EngineModel.load_weights`` writes a batch, fastest first: the same views as the last
#: batch (``memo_launch`` in one launch, ``memo`` by the foreach call and copies it used), a layout
#: planned before (``plan``: one launch from the buffer's address), a batch planned now and loaded
#: in one launch (``launch``), or tensor by tensor (``tensors``: host sources, pieces, conversions,
#: no Triton)
LOAD_ROUTES = ("memo_launch", "memo", "plan", "launch", "tensors")
#: whole tensors below this many bytes are loaded together by one ``torch._foreach_copy_``
#: (torch's multi-tensor copy, what its optimizers use); larger ones by their own copy_
FOREACH_BYTES = 16 << 20


class _BatchMemo:
    """One checked batch of whole tensors and how it was written, for the next sync that
    loads the very same tensors again.

    A receiver that keeps a sender's buffer mapped hands over the same views every
    sync (``PackedReceiver``: the same buffer, the same layout). Their names, shapes
    and dtypes, and where each goes, are then what they were when this batch was
    checked; what can differ is the session (a name already loaded in it). So the
    next load of those views checks the session in one set operation and writes in
    one foreach call: the per-tensor checks were most of a small model's engine load
    (51 tensors, 0.8 of its 1.5 ms round trip on an H100, issue 18).

    The views are held weakly: a receiver that lets go of a mapping must be able to
    free it, and a batch whose views are gone is never matched again."""

    __slots__ = ("names", "refs", "dests", "name_set", "small", "small_dst", "other", "batched")

    def __init__(self, items: list, dests: dict, small: list[int], small_dst: list, other: list[int],
                 batched: tuple[Copies, Labels] | None = None):
        self.names = [n for n, _ in items]
        self.refs = [weakref.ref(t) for _, t in items]
        self.dests, self.name_set = dests, frozenset(self.names)
        #: positions in the batch: copied in one foreach call (into ``small_dst``), or one by one
        self.small, self.small_dst, self.other = small, small_dst, other
        #: or the whole batch in one launch (``EngineModel._batched``); its table's addresses
        #: hold while ``fits`` finds the same views alive and the same allocation of the weights
        self.batched = batched

    def fits(self, batch: Any, dests: dict, session: LoadSession) -> bool:
        # the same (name, tensor) pairs, the same allocation of the weights (``_dests``
        # is renewed with it), and a session in which none of these names arrived yet
        # and nothing is half-loaded
        if type(batch) is not list or len(batch) != len(self.refs) or dests is not self.dests:
            return False
        for (name, tensor), n, ref in zip(batch, self.names, self.refs):
            if tensor is not ref() or name != n:
                return False
        return not session.partial and session.loaded.isdisjoint(self.name_set)

    def load(self, model: EngineModel, params: dict, batch: list, session: LoadSession) -> int:
        if self.batched is not None:
            model._run_batched(*self.batched)
            session.loaded |= self.name_set
            session.order += self.names
            return len(self.names)
        with torch.no_grad():
            for i in self.other:
                model._write(params, *batch[i])
                model._sum_one(params, batch[i][0])
            if self.small:
                torch._foreach_copy_(self.small_dst, [_source(batch[i][1]) for i in self.small])
            model._sum_written(params, [self.names[i] for i in self.small])
        session.loaded |= self.name_set
        session.order += self.names
        return len(self.names)


class _LayoutPlan:
    """A bucket's layout (the receiver's ``TensorMeta`` tuple, the same object sync after
    sync) as this engine last loaded it whole in one launch: each tensor's byte offset in
    the request's buffer, its row block's address and size, the names its lanes are of.

    The batch memo needs the very same views; a sender that frees its staging after each
    sync (a 7B model's, or any above ``KEEP_STAGING_BYTES``) maps a new buffer every sync,
    so the views are new while the layout is not. Checking and placing each tensor again
    (the session's check, the kernel's fit, its addresses) was the engine's whole load
    time on the host, 5-8 ms a sync at Qwen2-1.5B on an H200 (issue 44); with the layout
    planned once a load is the buffer's address plus the offsets, and one launch."""

    __slots__ = ("layout", "dests", "names", "name_set", "planned", "labels")

    def __init__(self, layout: Any, dests: dict, names: list[str], copies: Copies, base: int, labels: Labels):
        self.layout, self.dests, self.labels = layout, dests, labels
        self.names, self.name_set = names, frozenset(names)
        # the launch's own table, its sources made offsets into the buffer: a tensor lying
        # strided there (a one-copy sync's q, k, v) is one row per run, ``owners`` saying whose;
        # made and uploaded once (PlannedCopies), each sync's launch given its buffer
        n = copies.count
        sources, dst, words, firsts = (copies.meta[k * n:(k + 1) * n] for k in range(4))
        split = copies.owners is not None
        self.planned = PlannedCopies(sources - base, dst, words * 4, copies.device, firsts if split else None,
                                     copies.owners)

    def copies(self, flat: torch.Tensor, dests: dict, session: LoadSession) -> _FromBuffer | None:
        """This sync's copies out of ``flat`` (the request's buffer), or None where the plan
        does not hold: another allocation of the weights, a session that already has some of
        these names or a piece in progress, a buffer the kernel cannot read."""
        if dests is not self.dests or session.partial or not session.loaded.isdisjoint(self.name_set):
            return None
        if flat.data_ptr() % 4 or not Copies.reads(flat):
            return None
        return _FromBuffer(self.planned, flat)


class _FromBuffer:
    """A plan's copies out of one sync's buffer: ``run`` as ``Copies.run``."""

    __slots__ = ("planned", "flat")

    def __init__(self, planned: PlannedCopies, flat: torch.Tensor):
        self.planned, self.flat = planned, flat

    def run(self, lanes: bool = False) -> torch.Tensor | None:
        return self.planned.run_from(self.flat, lanes)


#: bytes of written blocks checksummed per launch during a load (see ``_LoadDigest``)
LOAD_DIGEST_BYTES = 256 << 20


class _LoadDigest:
    """The checksums (:mod:`colo.digest`) of the blocks a load writes, queued behind their
    copies as it writes them, so that a verified sync's digest is not a second pass over
    every weight after the load but reads back what the load already summed.

    Blocks are summed a group of about ``LOAD_DIGEST_BYTES`` at a time, each group one
    launch from a table (``colo.digest.Blocks``) made the first time the group was summed
    and kept in ``tables`` (the model's, until its weights are allocated anew): a sync
    writes the same blocks in the same groups every time, and per-tensor checksum objects
    over 338 blocks were most of what summing cost (issue 44: a verified one-copy sync
    13.2 ms against 5.8 ms unverified, on an H200).

    On a GPU the checksums run on a stream of their own, each group once the copies before
    it are done (an event): the copy engine moves the next tensors out of host memory while
    the SMs sum the last ones. What is summed is the engine's own block after the write, so
    the digest is still of the weights the engine holds, not of what arrived. On the host
    they are summed at once."""

    def __init__(self, device: torch.device, tables: dict[tuple[str, ...], Blocks]) -> None:
        self.received = ReceivedDigest()
        self._tables = tables
        self._group: list[tuple[str, torch.Tensor]] = []
        self._bytes = 0
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def add(self, name: str, block: torch.Tensor) -> None:
        """``block`` (a name's whole row block) is written, or its writes are queued on the current stream."""
        self._group.append((name, block))
        self._bytes += block.numel() * block.element_size()
        if self._bytes >= LOAD_DIGEST_BYTES:
            self.flush()

    def flush(self) -> None:
        group, self._group, self._bytes = self._group, [], 0
        if not group:
            return
        key = tuple(n for n, _ in group)
        blocks = self._tables.get(key)
        if blocks is None:
            blocks = self._tables[key] = Blocks(group)
        if self._stream is None:
            self.received.add_blocks(blocks)
            return
        written = torch.cuda.current_stream(self._stream.device)
        self._stream.wait_stream(written)
        with torch.cuda.stream(self._stream):
            self.received.add_blocks(blocks)

    def covers(self, names: Sequence[str]) -> bool:
        summed = set(self.received.names)
        return all(n in summed for n in names)

    def digest(self, names: Sequence[str]) -> str:
        """The digest of ``names`` (all summed here), read back after the sums are done."""
        if self._stream is not None:
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)
        return self.received.digest(names)


def _runs(dst: torch.Tensor, src: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(dst piece, src piece)`` pairs covering ``src`` (``dst`` shaped alike), each piece of
    ``src`` contiguous: split along leading dimensions until it is (q of a fused QKV: one
    run per query group)."""
    if src.is_contiguous() or src.dim() <= 1:
        yield dst, src
        return
    for i in range(src.shape[0]):
        yield from _runs(dst[i], src[i])


class EngineModel:
    """The dense forward, batched generation over a preallocated KV pool, and a sync loader.

    Parameters are plain tensors in a dict rather than an ``nn.Module`` so
    that releasing the ``weights`` region drops every reference at once and
    re-allocating it produces fresh, uninitialised storage.
    """

    #: takes a :class:`~colo.transports.wire.Strided` in place of a whole tensor (copied into
    #: its row block as it lies); a tensor-parallel rank cuts its slice out of the tensor's
    #: own shape, so it is given the tensor (``colo.engine.reference.tp``)
    loads_strided = True
    #: a sync may deliver a tensor already cut for this engine (``RankSlice``): not to a
    #: whole model, whose load session refuses it by name; a TP rank takes its own block
    takes_rank_slices = False

    def __init__(self, config: Any, *, dtype: DTypeLike = torch.bfloat16, device: str | torch.device = "cpu",
                 total_bytes: int, mem_fraction_static: float, saver: Any = None) -> None:
        # With a memory saver (the GPU backend), release pauses the region and
        # keeps the tensors' virtual addresses; without one it drops them.
        self.saver = saver
        self._held: dict[str, Any] = {}
        # a ``Dims`` is taken as is: a tensor-parallel rank (colo.engine.reference.tp) builds
        # this model on its shard's numbers (its heads, its slice of the vocabulary)
        self.dims = config if isinstance(config, Dims) else dims_from_config(config)
        self.dtype = as_dtype(dtype)
        if not self.dtype.is_floating_point:
            raise ValueError(f"engine dtype must be a floating point dtype, got {dtype_name(self.dtype)}")
        self.device = torch.device(device)
        # the architecture's attention (colo.models.arch), read once rather than per layer
        self._qkv_bias, self._qk_norm = self.dims.qkv_bias, self.dims.qk_norm
        self.map = WeightMap.build(self.dims)
        # What a sync delivers (HF names and full shapes) and the token ids accepted:
        # the same as the parameters here; a tensor-parallel rank holds a slice of each.
        self.sync_map = self.map
        self.vocab_size = self.dims.vocab_size
        self.weight_bytes = self.map.nbytes(self.dtype)
        self.pool_plan = KVPoolPlan(total_bytes=total_bytes, mem_fraction_static=mem_fraction_static,
                                    weight_bytes=self.weight_bytes, slot_bytes=self.dims.slot_bytes(self.dtype),
                                    min_slots=self.dims.max_positions)
        self.slots = SlotAllocator(self.pool_plan.num_slots)
        d = self.dims
        # derived from the config, not a weight: survives a release of the weights region
        self._inv_freq = 1.0 / (d.rope_theta ** (torch.arange(0, d.head_dim, 2, dtype=torch.float32,
                                                               device=self.device) / d.head_dim))
        self._params: dict[str, torch.Tensor] | None = None
        #: HF name -> the view of its row block in ``_params`` (dropped with the weights)
        self._dests: dict[str, torch.Tensor] = {}
        #: the summed load's tables by the names of their group (see ``_LoadDigest``): views
        #: of the weights, made once per allocation of them and dropped with them
        self._sum_tables: dict[tuple[str, ...], Blocks] = {}
        #: bucket layouts loaded in one launch, by the layout tuple's id (see ``_LayoutPlan``)
        self._layout_plans: dict[int, _LayoutPlan] = {}
        #: the last whole batch loaded, checked (see ``_BatchMemo``)
        self._batch_memo: _BatchMemo | None = None
        #: how the last ``load_weights`` call wrote its batch, one of ``LOAD_ROUTES`` (the engine's
        #: reply times its load under this name: which route a sync's loads took, on a GPU, is
        #: otherwise a guess from its host time, issue 44)
        self.last_route: str | None = None
        #: the host's seconds in the parts of the last batch's route, where it was ``plan``
        self.last_route_parts: dict[str, float] = {}
        self._pool: torch.Tensor | None = None
        self._load: LoadSession | None = None
        #: the HF names of the last complete load, in the order they arrived (the digest's
        #: order where no spec list says otherwise)
        self._last_order: list[str] = []
        # A load checksums what it writes (``_LoadDigest``) when the last load's digest was
        # asked for (``--verify every``: every sync after the first; ``first``: the second's
        # sums are the one pass wasted); ``_digested`` holds a complete load's sums until the
        # weights change (a new load, a release). A TP rank's digest is its shards' own.
        self._digest_asked = False
        self._load_digest: _LoadDigest | None = None
        self._digested: _LoadDigest | None = None
        #: LoRA adapters this engine holds: version -> {HF module name: (A, B, alpha / r)} in the
        #: engine's dtype on its device (:mod:`colo.engine.reference.adapters` registers them); a
        #: call's forward applies the version it names, ``W x + (alpha / r) B (A x)``
        self.adapters: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor, float]]] = {}
        #: the adapter of the call in progress (None: the base model)
        self._lora: dict[str, tuple[torch.Tensor, torch.Tensor, float]] | None = None
        self.allocate_weights()
        self.allocate_kv()

    # -- memory regions ------------------------------------------------------

    @property
    def kv_bytes(self) -> int:
        return self.pool_plan.kv_bytes

    @property
    def num_slots(self) -> int:
        return self.pool_plan.num_slots

    @property
    def weights_resident(self) -> bool:
        return self._params is not None

    @property
    def kv_resident(self) -> bool:
        return self._pool is not None

    def resident_bytes(self) -> dict[str, int]:
        """Bytes actually held now, counted from the live tensors."""
        weights = sum(t.numel() * t.element_size() for t in self._params.values()) if self._params else 0
        kv = self._pool.numel() * self._pool.element_size() if self._pool is not None else 0
        return {"weights": weights, "kv_cache": kv}

    def allocate_weights(self) -> None:
        """Fresh, uninitialised parameter storage; contents are garbage until a full load."""
        if self._params is not None:
            raise EngineStateError("engine weights are already allocated")
        self._load_digest = self._digested = None
        if self._resume_held("weights"):
            # the same tensors at the same addresses: their row blocks, the summed load's
            # tables, the planned layouts and the batch memo still hold (their contents are
            # garbage until the next load, as the weights' are)
            self._params = self._held.pop("weights")
            return
        self._dests = {}
        self._sum_tables = {}
        self._layout_plans = {}
        self._batch_memo = None
        with self._region("weights"):
            self._params = {name: torch.empty(shape, dtype=self.dtype, device=self.device)
                            for name, shape in self.map.params.items()}

    def free_weights(self) -> None:
        if self._params is None:
            raise EngineStateError("engine weights are already freed")
        self._hold("weights", self._params)
        self._params = None
        if "weights" not in self._held:
            # dropped: the views into them would keep their memory. Paused by the saver, they
            # keep their addresses and come back as they are (allocate_weights): the views,
            # tables and plans made for them stay, or every cycle of the colocated loop
            # (which releases the weights) would make them all again at its sync (5-8 ms of
            # the engine's load at Qwen2-1.5B on an H200, issue 44)
            self._dests = {}
            self._sum_tables = {}
            self._layout_plans = {}
            self._batch_memo = None
        self._load = None  # a half-done load has nothing left to finish
        self._load_digest = self._digested = None
        self._return_to_device()

    def allocate_kv(self) -> None:
        if self._pool is not None:
            raise EngineStateError("engine KV pool is already allocated")
        d = self.dims
        if self._resume_held("kv_cache"):
            self._pool = self._held.pop("kv_cache")
        else:
            with self._region("kv_cache"):
                self._pool = torch.empty((d.num_layers, 2, self.num_slots, d.num_kv_heads, d.head_dim),
                                         dtype=self.dtype, device=self.device)
        self.slots.reset()

    def free_kv(self) -> None:
        if self._pool is None:
            raise EngineStateError("engine KV pool is already freed")
        self._hold("kv_cache", self._pool)
        self._pool = None
        self.slots.reset()
        self._return_to_device()

    def _region(self, tag: str) -> Any:
        if self.saver is None:
            return contextlib.nullcontext()
        return self.saver.region(f"engine.{tag}")

    def _hold(self, tag: str, tensors: Any) -> None:
        # Paused, not dropped: the saver unmaps the pages but the tensors keep
        # their addresses, so a resume hands back the same storage (its
        # contents are garbage until the next load).
        if self.saver is not None:
            self.saver.pause(f"engine.{tag}")
            self._held[tag] = tensors

    def _resume_held(self, tag: str) -> bool:
        if tag not in self._held:
            return False
        self.saver.resume(f"engine.{tag}")
        return True

    def _return_to_device(self) -> None:
        # Dropping a CUDA tensor only returns its block to this process's caching
        # allocator; the trainer (another process) sees the bytes only once the
        # cache hands them back to the driver.
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def flush_cache(self) -> None:
        """Forget every slot assignment. There is no prefix reuse across calls,
        so after this no K/V written under older weights can be read again."""
        self.slots.reset()

    @property
    def kv_pool(self) -> torch.Tensor:
        """The pool, ``[layers, 2 (K, V), slots, kv_heads, head_dim]``; K is stored after RoPE."""
        if self._pool is None:
            raise EngineStateError("engine KV pool is released")
        return self._pool

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self._require_weights("read parameters").items())

    def _require_weights(self, what: str) -> dict[str, torch.Tensor]:
        if self._params is None:
            raise EngineStateError(f"cannot {what}: engine weights are released")
        return self._params

    def _require_pool(self, what: str) -> torch.Tensor:
        if self._pool is None:
            raise EngineStateError(f"cannot {what}: engine KV pool is released")
        return self._pool

    # -- loading -------------------------------------------------------------

    def expected_specs(self) -> list[TensorSpec]:
        return self.sync_map.hf_specs(self.dtype)

    def preflight(self, specs: Iterable[TensorSpec | tuple[str, Sequence[int], DTypeLike]]) -> None:
        """Check a whole sync's (name, shape, dtype) list before any byte is written.

        Raises one ``WeightMismatch`` listing every missing, unexpected,
        duplicate, wrongly shaped or wrongly typed tensor; touches nothing.
        """
        _check_specs(self.sync_map, _spec_triples(specs), dtype_name(self.dtype),
                     "sync does not match the engine's parameters")

    def begin_load(self) -> None:
        self._require_weights("begin a load")
        if self._load is not None:
            raise EngineStateError("a load is already in progress (begin_load called twice without end_load)")
        self._load = LoadSession({n: s.shape for n, s in self.sync_map.shards.items()},
                                 describe_unexpected=self.sync_map.unexpected, rank_slices=self.takes_rank_slices)
        self._digested = None
        self._load_digest = _LoadDigest(self.device, self._sum_tables) if self._digest_asked else None
        self._digest_asked = False

    def load_weights(self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy each (HF name, tensor) into its row block, converting dtype and device.

        A ``colo.transports.wire.Piece`` in place of a tensor is a run of the
        tensor's elements (a tensor larger than the sync's bucket arrives in
        pieces, in order): it is written in place, and the tensor counts as
        loaded once its last element is. The batch is checked as a whole first
        (unknown names, duplicates within it or of names already loaded, wrong
        shapes, a piece that does not continue where its tensor stopped): on
        any problem nothing from this batch is written and one
        ``WeightMismatch`` lists them all. Returns the number of tensors this
        batch completed.
        """
        params = self._require_weights("load weights")
        session = self._load
        if session is None:
            raise EngineStateError("load_weights called outside begin_load() / end_load()")
        self.last_route_parts = {}  # only a planned load splits its time (below)
        memo = self._batch_memo
        if memo is not None and memo.fits(named_tensors, self._dests, session):
            self.last_route = "memo" if memo.batched is None else "memo_launch"
            return memo.load(self, params, named_tensors, session)
        layout = getattr(named_tensors, "layout", None)  # a receiver's views (colo.transports.wire.Views)
        if layout is not None:
            t0 = time.perf_counter()
            plan = self._layout_plans.get(id(layout))
            copies = None if plan is None or plan.layout is not layout else \
                plan.copies(named_tensors.flat, self._dests, session)
            if copies is not None:
                self.last_route = "plan"
                t1 = time.perf_counter()
                self._run_batched(copies, plan.labels)
                # where the route's host time went: the table laid on this buffer, the launch
                # and its parts (colo.digest.COPY_LAUNCH_PARTS; a GPU's launch only)
                self.last_route_parts = {"table": t1 - t0, "launch": time.perf_counter() - t1, **COPY_LAUNCH_PARTS}
                return session.advance_whole(plan.names)
        # tensors lying strided in the sender's buffer (a one-copy sync out of a trainer's fused
        # QKV) are taken as they lie, each copied straight into its row block (in the launch, one
        # run per query group): the receiver's own pairs would be copies of them made first
        strided = self.loads_strided and layout is not None and getattr(named_tensors, "strided", False)
        items = named_tensors.sources() if strided else _named_items(named_tensors)
        session.check(items)
        self._check_slices(items, session)
        batched = self._batched(params, items)
        if batched is not None:
            self.last_route = "launch"
            self._run_batched(*batched)
            done = session.advance_whole([n for n, _ in items])
            if type(named_tensors) is list:
                self._batch_memo = _BatchMemo(items, self._dests, [], [], [], batched)
            if layout is not None and len(layout) == len(items):
                self._plan_layout(layout, named_tensors.flat, items, *batched)
            return done
        self.last_route = "tensors"
        done = 0
        # small whole tensors (norms, biases, k/v projections) are copied in one foreach
        # call: one host call instead of one per tensor, whose host cost (about 10 us
        # each) exceeds their device time, so the engine's load of a few hundred tensors
        # was host-bound (issue 18: 4.8 ms for 1.5 ms of copies on an H200)
        small_dst: list[torch.Tensor] = []
        small_src: list[torch.Tensor] = []
        small: list[int] = []  # their positions in the batch, and the others'
        other: list[int] = []
        with torch.no_grad():
            for i, (name, tensor) in enumerate(items):
                dest, src = self._direct(params, name, tensor) or (None, None)
                if (dest is not None and src.dtype == dest.dtype and src.device == dest.device
                        and src.numel() * src.element_size() < FOREACH_BYTES):
                    small_dst.append(dest)
                    small_src.append(src)
                    small.append(i)
                    advanced = session.advance(name, tensor)
                else:
                    self._write(params, name, tensor)
                    other.append(i)
                    if advanced := session.advance(name, tensor):
                        self._sum_one(params, name)
                done += advanced
            if small_dst:
                # distinct destinations: the order of the copies does not matter
                torch._foreach_copy_(small_dst, small_src)
            self._sum_written(params, [items[i][0] for i in small])
        if type(named_tensors) is list and done == len(items) and not any(piece_in(t) for _, t in items):
            self._batch_memo = _BatchMemo(items, self._dests, small, small_dst, other)
        return done

    def _check_slices(self, items: list, session: LoadSession) -> None:
        """Where the engine takes tensors cut for one rank (``takes_rank_slices``), refuse the
        batch if one is not this rank's block: a TP rank does (``colo.engine.reference.tp``).
        This engine holds every tensor whole, and its session refused any slice already."""

    def _batched(self, params: dict[str, torch.Tensor], items: list) -> tuple[Copies, Labels] | None:
        """A checked batch of whole tensors already on this engine's GPU in its dtype (a
        ``sync-first`` bucket, a trainer's flat weights read in place) as one launch
        (``colo.digest.Copies``), with the names its lanes will be of; None for anything
        else (host sources go by the copy engine, pieces and conversions one by one).

        One launch instead of one ``copy_`` per tensor: 338 of those were 3.7 ms of host time
        for 1.7 ms of copying on an H200 (issue 44), and a summed load computes its lanes in
        the same pass over the bytes (2.9 ms) rather than reading every block again after. A
        :class:`~colo.transports.wire.Strided` tensor is its contiguous runs in the same launch."""
        if not Copies.available():
            return None
        pairs, dests, firsts, owners = [], [], [], []
        for i, (name, tensor) in enumerate(items):
            if not isinstance(tensor, Strided):
                pair = self._direct(params, name, tensor)
                if pair is None:
                    return None
                dests.append(pair[0])
                pairs.append(pair)
                firsts.append(0)
                owners.append(i)
                continue
            dest = self._whole_dest(params, name)
            if dest is None:
                return None
            dests.append(dest)
            # its contiguous runs (one per query group of a fused QKV), each into its place in
            # the block, its lanes counted from its first word in the tensor (16-bit words)
            runs = list(itertools.islice(_runs(dest.view(tensor.data.shape), tensor.data), MAX_RUNS + 1))
            if len(runs) > MAX_RUNS:
                return None
            for d, src in runs:
                pairs.append((d, src))
                firsts.append((d.data_ptr() - dest.data_ptr()) // 2)
                owners.append(i)
        if not Copies.fits(pairs):
            return None
        split = len(pairs) != len(items)
        copies = Copies(pairs, firsts=firsts if split else None, owners=owners if split else None)
        return copies, Labels([(n, d) for (n, _), d in zip(items, dests)])

    def _plan_layout(self, layout: Any, flat: torch.Tensor, items: list, copies: Copies, labels: Labels) -> None:
        """Keep how a request of ``layout`` was just loaded in one launch (``_LayoutPlan``):
        each view's (or run's) offset in ``flat`` and where it went, for the next request of it."""
        if len(self._layout_plans) >= MAX_LAYOUT_PLANS:
            self._layout_plans.clear()  # a sender that changed its buckets: plan them again
        self._layout_plans[id(layout)] = _LayoutPlan(layout, self._dests, [n for n, _ in items], copies,
                                                     flat.data_ptr(), labels)

    def _run_batched(self, copies: Copies, labels: Labels) -> None:
        """Queue a batch's copies; a load being summed takes their lanes from the same launch."""
        lanes = copies.run(lanes=self._load_digest is not None)
        if lanes is not None:
            self._load_digest.received.add_lanes(labels, lanes)

    def _block(self, params: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        block = self._dests.get(name)  # made once per allocation of the weights
        return self._row_block(params, name) if block is None else block

    def _sum_one(self, params: dict[str, torch.Tensor], name: str) -> None:
        """A load being summed: ``name`` is complete (its writes queued), sum its block."""
        if self._load_digest is not None:
            self._load_digest.add(name, self._block(params, name))

    def _sum_written(self, params: dict[str, torch.Tensor], names: Sequence[str]) -> None:
        """The same for ``names``, then the group left over: the batch's writes are all queued now."""
        if self._load_digest is None:
            return
        for name in names:
            self._sum_one(params, name)
        self._load_digest.flush()

    def _direct(self, params: dict[str, torch.Tensor], name: str, tensor: Any
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(block, source)`` where ``tensor`` (checked) is copied into a block of the
        parameters as it is, so it can join a batched copy; None where it is written some
        other way (a piece; a strided tensor, copied as its runs; on a TP rank, a whole
        tensor it cuts its slice from)."""
        if isinstance(tensor, (Piece, Strided)):
            return None
        dest = self._whole_dest(params, name)
        return None if dest is None else (dest, tensor)

    def _whole_dest(self, params: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
        """The row block a whole HF tensor is copied into as it is (made once per
        allocation of the weights: a sync writes the same blocks every time), or None
        where a subclass writes it some other way (a TP rank's slice)."""
        dest = self._dests.get(name)
        if dest is None:
            dest = self._dests[name] = self._row_block(params, name)
        return dest

    def _row_block(self, params: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        """The rows of a fused parameter that hold HF tensor ``name``, as a view."""
        shard = self.map.shards[name]
        return params[shard.param][shard.row_offset:shard.row_offset + shard.shape[0]]

    def _write(self, params: dict[str, torch.Tensor], name: str, tensor: Any) -> None:
        """Copy one checked HF tensor (or a piece of it: its run of elements, in
        place) into its row block (a TP rank copies out its slice)."""
        dest = self._whole_dest(params, name)
        src = tensor.data if isinstance(tensor, (Piece, Strided)) else tensor
        # From host memory, queued, not one copy and one host wait per tensor: the copy
        # engine then streams a few hundred tensors out of a pinned backup back to back
        # (the server waits for the device before it acknowledges). A pageable source
        # is still read before the call returns (CUDA stages it), so it may go at once.
        queued = src.device.type == "cpu" and dest.device.type == "cuda"
        if isinstance(tensor, Strided):
            # into the block viewed in the source's shape: the same elements in the same
            # row-major order. From the host run by run, queued: torch copies a strided host
            # source to the device through a pageable temporary made first, synchronously
            # (which it still does for a view of more than MAX_RUNS runs)
            into = dest.view(src.shape)
            runs = list(itertools.islice(_runs(into, src), MAX_RUNS + 1)) if queued else []
            if not runs or len(runs) > MAX_RUNS:
                into.copy_(src)
                return
            for d, h in runs:
                d.copy_(h, non_blocking=True)
            return
        if isinstance(tensor, Piece):
            # a row block of a contiguous parameter is contiguous: the tensor's
            # row-major elements are the block's, one for one
            dest.view(-1)[tensor.offset:tensor.end].copy_(src, non_blocking=queued)
            return
        dest.copy_(src, non_blocking=queued)

    def end_load(self) -> int:
        """Close the load; raise one ``WeightMismatch`` unless every expected name came exactly once."""
        session = self._load
        if session is None:
            raise EngineStateError("end_load called without begin_load()")
        self._load = None
        summed, self._load_digest = self._load_digest, None
        n = session.finish()
        self._last_order = list(session.order)
        self._digested = summed  # complete: its sums are the weights' until they change
        return n

    @property
    def loading(self) -> bool:
        return self._load is not None

    def digest(self, order: Sequence[str] | None = None, *, arm: bool = True) -> str:
        """The contract digest (:mod:`colo.digest`) of the HF-named tensors this engine holds,
        each its row block of a fused parameter, in ``order`` (the spec list a preflight
        accepted), else in the order the last complete load delivered them. ``arm``: the next
        load sums what it writes, for the digest the next sync will be asked (not where the
        digests are taken beside the trainer's offload, from the live weights)."""
        params = self._require_weights("digest weights")
        names = list(order) if order is not None else (self._last_order or list(self.sync_map.shards))
        unknown = [n for n in names if n not in self.sync_map.shards]
        if unknown:
            raise WeightMismatch("digest asked for tensors the engine does not hold", unexpected=unknown)
        self._digest_asked = arm  # the next load sums as it writes
        summed = self._digested
        if summed is not None and summed.covers(names):
            return summed.digest(names)
        return weights_digest((n, self._row_block(params, n)) for n in names)

    def param_entries(self) -> dict[str, str]:
        """Each parameter this engine holds (its own names and layout: a TP rank's shards),
        its digest entry in hex: a diagnostic that names the parameters a digest mismatch
        is in (the benchmark's per-rank check reports them)."""
        params = self._require_weights("digest weights")
        return {n: e.hex() for n, e in weights_entries(params.items())}

    # -- forward -------------------------------------------------------------

    def _rope(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        # as HF: angles in float32, cos/sin then cast to the activation dtype
        pos = torch.arange(start, start + length, device=self.device, dtype=torch.float32)
        freqs = pos[:, None] * self._inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def _rmsnorm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.dims.rms_norm_eps)
        return weight * h.to(x.dtype)

    def _forward(self, tokens: torch.Tensor, start: int, kv: torch.Tensor | None) -> torch.Tensor:
        """Hidden states after the final norm, ``[B, T, H]``.

        ``kv`` (``[layers, 2, B, S, kv_heads, head_dim]``: these rows' slots of the pool,
        a view, see ``_rows_of_pool``) switches on the cache: the K/V of the T new tokens
        are written at positions ``start .. start + T - 1`` and attention reads all
        ``start + T`` of them back from the pool.
        """
        p = self._params
        d = self.dims
        b, t = tokens.shape
        h = self._embed(tokens)
        cos, sin = self._rope(start, t)
        mask = None
        if t > 1:
            # bottom-right aligned causal mask: query i sees keys 0 .. start + i
            keys = torch.arange(start + t, device=self.device)
            mask = keys[None, :] <= (start + torch.arange(t, device=self.device))[:, None]
        groups = d.num_heads // d.num_kv_heads
        for layer in range(d.num_layers):
            pre = f"model.layers.{layer}."
            x = self._rmsnorm(h, p[pre + "input_layernorm.weight"])
            q, k, v = self._qkv(pre, x)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            if kv is not None:
                k, v = self._store_and_gather(layer, k, v, kv, start)
            # kv head j serves query heads j*groups .. (j+1)*groups-1, as HF's repeat_kv; read
            # in place by the attention kernel (enable_gqa) rather than copied out per layer
            # and decode step (repeat_interleave)
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=d.head_dim ** -0.5,
                                                  enable_gqa=groups > 1)
            attn = attn.transpose(1, 2).reshape(b, t, d.q_rows)
            o = F.linear(attn, p[pre + "self_attn.o_proj.weight"])
            if self._lora is not None:
                self._add_delta(o, pre + "self_attn.o_proj", attn)
            h = h + self._reduce(o)
            x = self._rmsnorm(h, p[pre + "post_attention_layernorm.weight"])
            h = h + self._reduce(self._mlp(pre, x))
        return self._rmsnorm(h, p["model.norm.weight"])

    def _qkv(self, pre: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One layer's q, k, v as ``[B, heads, T, head_dim]``, before the rotary embedding: one
        fused projection, with a bias where the architecture has one (Qwen2), then an RMSNorm
        over each head's head_dim of q and of k where it has them (Qwen3, Qwen3-MoE), as
        transformers' attention of each does (:mod:`colo.models.arch` says which)."""
        p, d = self._params, self.dims
        b, t, _ = x.shape
        bias = p[pre + "self_attn.qkv_proj.bias"] if self._qkv_bias else None
        q, k, v = F.linear(x, p[pre + "self_attn.qkv_proj.weight"], bias).split((d.q_rows, d.kv_rows, d.kv_rows),
                                                                                 dim=-1)
        if self._lora is not None:  # each of the fused projection's parts, in place (split gives views)
            for part, name in ((q, "q_proj"), (k, "k_proj"), (v, "v_proj")):
                self._add_delta(part, pre + "self_attn." + name, x)
        q = q.view(b, t, d.num_heads, d.head_dim)
        k = k.view(b, t, d.num_kv_heads, d.head_dim)
        if self._qk_norm:
            q = self._rmsnorm(q, p[pre + "self_attn.q_norm.weight"])
            k = self._rmsnorm(k, p[pre + "self_attn.k_norm.weight"])
        return q.transpose(1, 2), k.transpose(1, 2), v.view(b, t, d.num_kv_heads, d.head_dim).transpose(1, 2)

    def _mlp(self, pre: str, x: torch.Tensor) -> torch.Tensor:
        """One layer's MLP on ``[B, T, H]``: this rank's partial sum (the whole at TP=1)."""
        p = self._params
        gate, up = F.linear(x, p[pre + "mlp.gate_up_proj.weight"]).chunk(2, dim=-1)
        if self._lora is None:
            return F.linear(F.silu(gate) * up, p[pre + "mlp.down_proj.weight"])
        self._add_delta(gate, pre + "mlp.gate_proj", x)
        self._add_delta(up, pre + "mlp.up_proj", x)
        act = F.silu(gate) * up
        out = F.linear(act, p[pre + "mlp.down_proj.weight"])
        self._add_delta(out, pre + "mlp.down_proj", act)
        return out

    def _add_delta(self, out: torch.Tensor, module: str, x: torch.Tensor) -> None:
        """``out += (alpha / r) B (A x)`` for the call's adapter on ``module`` (HF name), where it has one."""
        lora = self._lora.get(module)
        if lora is not None:
            a, b, scale = lora
            out.add_(F.linear(F.linear(x, a), b), alpha=scale)

    @contextlib.contextmanager
    def adapter(self, version: int | None) -> Iterator[None]:
        """The forwards inside apply adapter ``version`` (None: the base model alone)."""
        if version is not None and version not in self.adapters:
            raise EngineStateError(f"adapter v{version} is not loaded in this engine "
                                   f"(loaded: {sorted(self.adapters) or 'none'})")
        self._lora = None if version is None else self.adapters[version]
        try:
            yield
        finally:
            self._lora = None

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self._params["model.embed_tokens.weight"])

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The output of a row-parallel layer (o_proj, down_proj): whole here; a TP rank all-reduces."""
        return partial

    def _store_and_gather(self, layer: int, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor,
                          start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new tokens' K/V (``[B, kv_heads, T, head_dim]``) into the rows' slots and
        return the first ``start + T`` positions of each row, as views of the pool: the rows
        are one contiguous run of slots (``_rows_of_pool``), so no gather copies a row's whole
        history out of the pool at every layer of every decode step (an ``index`` by slot ids,
        a tenth of the demo's rollout on the CPU)."""
        end = start + k.shape[2]
        keys, values = kv[layer, 0], kv[layer, 1]  # [B, S, kv_heads, head_dim]
        keys[:, start:end] = k.transpose(1, 2)
        values[:, start:end] = v.transpose(1, 2)
        return keys[:, :end].transpose(1, 2), values[:, :end].transpose(1, 2)

    def _rows_of_pool(self, first: int, rows: int, seq_slots: int) -> torch.Tensor:
        """Slots ``first .. first + rows * seq_slots - 1`` of the pool as ``[layers, 2, rows,
        seq_slots, kv_heads, head_dim]``: row r holds its sequence at ``first + r * seq_slots``."""
        pool = self._pool
        return pool[:, :, first:first + rows * seq_slots].unflatten(2, (rows, seq_slots))

    def _lm_head(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self._params[self.map.lm_head()]).float()

    def _check_tokens(self, tokens: torch.Tensor, what: str) -> None:
        if not isinstance(tokens, torch.Tensor) or tokens.dtype != torch.long or tokens.dim() != 2 \
                or tokens.shape[0] == 0 or tokens.shape[1] == 0:
            raise ValueError(f"{what} must be a non-empty LongTensor [B, T], got "
                             f"{getattr(tokens, 'dtype', type(tokens))} {tuple(getattr(tokens, 'shape', ()))}")
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab_size):
            raise ValueError(f"{what} holds token ids outside [0, {self.vocab_size})")

    @torch.inference_mode()
    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Full forward without the cache: float32 logits ``[B, T, V]``."""
        self._require_weights("compute logits")
        self._check_tokens(tokens, "tokens")
        if tokens.shape[1] > self.dims.max_positions:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds max_position_embeddings "
                             f"{self.dims.max_positions}")
        return self._lm_head(self._forward(tokens.to(self.device), 0, None))

    @torch.inference_mode()
    def generate(self, prompts: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
                 generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample ``max_new_tokens`` per prompt through the KV pool.

        Each sequence gets ``P + N - 1`` contiguous pool slots (the last
        sampled token is never fed back, so it needs none). When the pool
        cannot hold the whole batch it is generated in chunks of as many rows
        as fit; the uniforms that drive sampling are drawn for the whole
        batch up front, so the result does not depend on the chunking.

        ``temperature > 0`` samples from softmax(logits / temperature) by
        inverse CDF and returns that distribution's log-prob of each token;
        ``temperature == 0`` is greedy and returns log_softmax(logits). Both
        returned on the prompts' device: completions ``[B, N]`` (long),
        log-probs ``[B, N]`` (float32).
        """
        self._require_weights("generate")
        self._require_pool("generate")
        self._check_tokens(prompts, "prompts")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
        if not isinstance(generator, torch.Generator):
            raise ValueError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        batch, plen = prompts.shape
        if plen + max_new_tokens > self.dims.max_positions:
            raise ValueError(f"prompt length {plen} + max_new_tokens {max_new_tokens} exceeds "
                             f"max_position_embeddings {self.dims.max_positions}")
        seq_slots = plen + max_new_tokens - 1
        rows = self.slots.num_slots // seq_slots  # >= 1: the plan guarantees max_positions slots
        uniforms = self._uniforms(batch, max_new_tokens, generator)
        tokens = prompts.to(self.device)
        outs, lps = [], []
        for lo in range(0, batch, rows):
            hi = min(batch, lo + rows)
            out, lp = self._generate_chunk(tokens[lo:hi], max_new_tokens, temperature, uniforms[lo:hi], seq_slots)
            outs.append(out)
            lps.append(lp)
        return torch.cat(outs).to(prompts.device), torch.cat(lps).to(prompts.device)

    def _uniforms(self, batch: int, steps: int, generator: torch.Generator) -> torch.Tensor:
        return torch.rand((batch, steps), generator=generator, device=generator.device,
                          dtype=torch.float32).to(self.device)

    def _generate_chunk(self, prompts: torch.Tensor, steps: int, temperature: float, uniforms: torch.Tensor,
                        seq_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        b, plen = prompts.shape
        # the chunk's rows take one contiguous run of slots, row after row, so that each
        # layer reads a row's history as a view of the pool (``_store_and_gather``)
        first = self.slots.alloc(b * seq_slots)
        try:
            kv = self._rows_of_pool(first, b, seq_slots)
            out = torch.empty((b, steps), dtype=torch.long, device=self.device)
            lps = torch.empty((b, steps), dtype=torch.float32, device=self.device)
            h = self._forward(prompts, 0, kv)
            for step in range(steps):
                tok, lp = self._sample(self._lm_head(h[:, -1]), temperature, uniforms[:, step])
                out[:, step] = tok
                lps[:, step] = lp
                if step + 1 < steps:
                    h = self._forward(tok[:, None], plen + step, kv)
            return out, lps
        finally:
            # slots are per call: nothing outlives a generate, so a failure frees them too
            self.slots.free(first, b * seq_slots)

    @staticmethod
    def _sample(logits: torch.Tensor, temperature: float,
                uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if temperature == 0:
            logp = torch.log_softmax(logits, dim=-1)
            tok = logits.argmax(dim=-1)
        else:
            logp = torch.log_softmax(logits / temperature, dim=-1)
            cdf = logp.exp().cumsum(dim=-1)
            # u * total < total, and right=True skips zero-probability tokens
            x = (uniforms * cdf[:, -1])[:, None]
            tok = torch.searchsorted(cdf, x, right=True).squeeze(-1).clamp_max(logits.shape[-1] - 1)
        return tok, logp.gather(-1, tok[:, None]).squeeze(-1)
