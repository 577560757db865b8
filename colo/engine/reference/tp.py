"""A tensor-parallel engine: one rank of an engine TP group, holding its shard.

The layout is Megatron's and SGLang's for a dense Qwen2:

- ``qkv_proj`` and ``gate_up_proj`` are column-parallel: rank r holds the q rows
  of its query heads, the k and v rows of its KV heads, and its block of
  gate rows and of up rows, fused as ``[q_r; k_r; v_r]`` and ``[gate_r; up_r]``;
  the qkv bias is split with its rows.
- ``o_proj`` and ``down_proj`` are row-parallel (their input columns split the
  same way): each rank's product is a partial sum, all-reduced over the group.
- ``embed_tokens`` and ``lm_head`` are vocabulary-parallel: rank r holds a
  contiguous block of vocabulary rows. The embedding looks up the ids in its
  block, writes zeros for the others and all-reduces; the logits of every
  block are all-gathered, so every rank samples from the same full row.
  With tied embeddings the one block serves both.
- The norms are replicated; every rank keeps its own KV pool for its KV heads,
  sized from its shard's bytes the way ``EngineModel`` sizes the whole model's.

Decisions:

- Query heads, KV heads and ``intermediate_size`` must split evenly; a TP size
  that does not divide them is refused by :class:`TPLayout`, naming the
  numbers, before anything is allocated or loaded.
- Fewer KV heads than ranks: **replicated**, as SGLang and vLLM do, when the
  TP size is a multiple of ``num_key_value_heads``: each rank holds the one KV
  head its query heads read (rank r holds head ``r // (tp / kv_heads)``).
  A TP size that is neither a divisor nor a multiple is refused.
- The vocabulary is padded up to a multiple of the TP size (SGLang pads to a
  multiple of 64 as well; colo pads the least that splits evenly). The padding
  rows live on the last rank(s), are written as zeros at every load (so the
  shard and its digest are deterministic) and their logits are cut off after
  the all-gather: callers see exactly ``vocab_size`` logits.

The loader takes the *full* HF-named tensor, as a trainer's transport
delivers it, and copies out this rank's slice (what SGLang's weight loaders
do); preflight, ``load_weights`` and ``end_load`` check full names and shapes.
A tensor may also arrive already cut for this rank (a
:class:`~colo.transports.wire.RankSlice`: a TP-MoE expert that its owner sent
each rank as that rank's slice instead of broadcasting it whole): it is taken
only if it is exactly the block this rank holds (:func:`slice_mismatch`), and
copied in as it is.
The rank's digest covers the shard it holds;
:func:`expected_shard_digest` computes, from the trainer's full state, what
rank r must report.

Generation runs in lockstep: every rank is called with the same prompts and
arguments (every step does collectives). Rank 0's uniforms drive sampling and
are broadcast (every rank's generator still advances), and the logits after
the all-gather are the same bytes everywhere, so every rank picks the same
tokens.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from colo.engine.reference.core import EngineCore
from colo.dtypes import DTypeLike, as_dtype, dtype_name
from colo.engine.reference.dims import TIED, Dims, dims_from_config
from colo.engine.reference.model import EngineModel
from colo.engine.reference.weights import WeightMap, _check_specs, digest_tensors, _named_items
from colo.core.buckets import spec
from colo.core.interfaces import TensorSpec
from colo.core.errors import BadInput, WeightMismatch
from colo.transports.wire import Piece, RankSlice

#: The ``Dims`` axes that tensor parallelism splits; every other axis (hidden_size) is whole on each rank.
SPLIT_AXES = ("q_rows", "kv_rows", "intermediate_size", "vocab_size")


class TPLayoutError(BadInput, ValueError):
    """A TP size the model's heads, KV heads or MLP width cannot be split into evenly."""


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


@dataclass(frozen=True, kw_only=True)
class TPLayout:
    """What rank ``tp_rank`` of ``tp_size`` holds of a model with dimensions ``full``."""

    full: Dims
    tp_rank: int
    tp_size: int

    def __post_init__(self) -> None:
        if not _positive_int(self.tp_size):
            raise TPLayoutError(f"tp_size must be a positive integer, got {self.tp_size!r}")
        if isinstance(self.tp_rank, bool) or not isinstance(self.tp_rank, int) \
                or not 0 <= self.tp_rank < self.tp_size:
            raise TPLayoutError(f"tp_rank must be an integer in [0, {self.tp_size}), got {self.tp_rank!r}")
        d, tp = self.full, self.tp_size
        problems = []
        if d.num_heads % tp:
            problems.append(f"tensor-parallel size {tp} does not divide num_attention_heads {d.num_heads} "
                            f"(every rank holds the same number of query heads)")
        if d.num_kv_heads % tp and tp % d.num_kv_heads:
            problems.append(f"tensor-parallel size {tp} does not divide num_key_value_heads {d.num_kv_heads} "
                            f"and is not a multiple of it (KV heads are split evenly, or replicated "
                            f"when there are fewer than ranks)")
        if d.intermediate_size % tp:
            problems.append(f"tensor-parallel size {tp} does not divide intermediate_size "
                            f"{d.intermediate_size} (gate/up rows and down_proj columns are split evenly)")
        if problems:
            raise TPLayoutError("cannot shard the model: " + "; ".join(problems))

    @classmethod
    def from_config(cls, config: Any, *, tp_rank: int, tp_size: int) -> TPLayout:
        full = dims_from_config(config)
        return cls(full=full, tp_rank=tp_rank, tp_size=tp_size)

    @property
    def kv_replicas(self) -> int:
        """How many ranks hold the same KV head: 1 when the KV heads are split."""
        return max(1, self.tp_size // self.full.num_kv_heads)

    @property
    def padded_vocab(self) -> int:
        return -(-self.full.vocab_size // self.tp_size) * self.tp_size

    @cached_property
    def local(self) -> Dims:
        """The rank's own model: its heads, its MLP block, its vocabulary block (padding included)."""
        d, tp = self.full, self.tp_size
        # replace(), not Dims(): a MoE's dims (colo.engine.reference.moe.MoEDims) keep their expert fields
        return dataclasses.replace(d, vocab_size=self.padded_vocab // tp, num_heads=d.num_heads // tp,
                                   num_kv_heads=max(1, d.num_kv_heads // tp),
                                   intermediate_size=d.intermediate_size // tp)

    def start(self, axis: str) -> int:
        """First index of this rank's block along a split axis of the full model."""
        length = getattr(self.local, axis)
        if axis == "kv_rows":
            # replicated KV heads: the query heads of rank r read KV head r // replicas
            return (self.tp_rank // self.kv_replicas) * length
        return self.tp_rank * length

    @property
    def vocab_start(self) -> int:
        return self.start("vocab_size")

    @property
    def vocab_real(self) -> int:
        """Rows of the rank's vocabulary block that are real tokens; the rest is padding."""
        return max(0, min(self.local.vocab_size, self.full.vocab_size - self.vocab_start))

    def describe(self) -> dict[str, Any]:
        loc = self.local
        return {"tp_rank": self.tp_rank, "tp_size": self.tp_size, "heads": loc.num_heads,
                "kv_heads": loc.num_kv_heads, "kv_replicas": self.kv_replicas,
                "intermediate_size": loc.intermediate_size, "vocab_start": self.vocab_start,
                "vocab_rows": loc.vocab_size, "vocab_real": self.vocab_real, "padded_vocab": self.padded_vocab}


# ---------------------------------------------------------------------------
# Which slice of each full HF tensor a rank holds


@dataclass(frozen=True)
class ShardSlice:
    """Rank-local rows ``[row_offset, row_offset + local_shape[0])`` of ``param`` hold
    ``full.narrow(dim, start, real)`` followed by ``length - real`` zero (padding) entries."""

    hf_name: str
    param: str
    row_offset: int
    full_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    dim: int | None  # the split dimension; None: replicated whole
    start: int
    length: int
    real: int


def _axes(dims: Dims) -> dict[str, tuple[str, ...]]:
    """HF name -> the ``Dims`` attribute naming each of its dimensions (from the name tables)."""
    tied = TIED if dims.tie_word_embeddings else {}
    out: dict[str, tuple[str, ...]] = {}

    def add(table, prefix: str) -> None:
        for suffix, parts, trailing in table:
            if prefix + suffix in tied:
                continue
            for hf_suffix, rows_attr in parts:
                out[prefix + hf_suffix] = (rows_attr, *trailing)

    head, layer_table, tail = dims.tables()
    add(head, "")
    for layer in range(dims.num_layers):
        add(layer_table, f"model.layers.{layer}.")
    add(tail, "")
    return out


@dataclass(frozen=True)
class ShardPlan:
    layout: TPLayout
    #: what a sync delivers: HF names, full shapes
    full_map: WeightMap
    #: what this rank holds: engine parameter names, shard shapes
    local_map: WeightMap
    slices: Mapping[str, ShardSlice]

    @classmethod
    def build(cls, layout: TPLayout) -> ShardPlan:
        full_map, local_map = WeightMap.build(layout.full), WeightMap.build(layout.local)
        slices: dict[str, ShardSlice] = {}
        for name, axes in _axes(layout.full).items():
            full, local = full_map.shards[name], local_map.shards[name]
            split = [i for i, axis in enumerate(axes) if axis in SPLIT_AXES]
            assert len(split) <= 1, (name, axes)  # each tensor is split along one axis at most
            if not split:
                slices[name] = ShardSlice(name, local.param, local.row_offset, full.shape, local.shape,
                                          None, 0, 0, 0)
                continue
            dim = split[0]
            axis = axes[dim]
            length = local.shape[dim]
            real = layout.vocab_real if axis == "vocab_size" else length
            slices[name] = ShardSlice(name, local.param, local.row_offset, full.shape, local.shape,
                                      dim, layout.start(axis), length, real)
        return cls(layout, full_map, local_map, slices)


def slice_mismatch(s: ShardSlice, t: RankSlice) -> str | None:
    """Why ``t`` (a tensor cut for one rank) is not the block this rank holds of its tensor
    (``s``), naming both; None when it is. A rank holds the block ``[s.start, s.start +
    s.length)`` of dimension ``s.dim`` with no padding in it (a padded vocabulary block is
    never sent cut) and the whole of a tensor it does not split."""
    got = f"{s.hf_name}: arrived as the {t.describe()}"
    if s.dim is None:
        return f"{got}, expected the whole tensor (every rank holds all of it)"
    want = (f"block [{s.start}, {s.start + s.length}) of dimension {s.dim} of {tuple(s.full_shape)}, "
            f"this rank's")
    if (t.dim != s.dim or t.start != s.start or t.length != s.length or s.real != s.length
            or tuple(t.shape) != tuple(s.full_shape) or tuple(t.data.shape) != tuple(s.local_shape)):
        return f"{got}, expected the {want}"
    return None


def split_dims(config: Any, tp_size: int) -> dict[str, int]:
    """HF name -> the dimension the ranks of a TP-``tp_size`` engine split it on, for every
    tensor a rank holds a block of (the others are whole on every rank). A sender that cuts
    tensors for the ranks (``MegatronExtractor(expert_scatter=...)``) cuts them there."""
    plan = ShardPlan.build(TPLayout.from_config(config, tp_rank=0, tp_size=tp_size))
    return {n: s.dim for n, s in plan.slices.items() if s.dim is not None}


def write_slice(params: Mapping[str, torch.Tensor], s: ShardSlice, full: Any) -> None:
    """Copy the rank's slice of one full HF tensor into its row block (dtype and device convert
    element by element in ``copy_``); padding rows are zeroed. ``full`` may be a
    :class:`~colo.transports.wire.Piece` of the tensor: its part of the slice is written; or
    a :class:`~colo.transports.wire.RankSlice`, the rank's slice itself (:func:`slice_mismatch`
    refuses any other block): copied in whole."""
    dest = params[s.param][s.row_offset:s.row_offset + s.local_shape[0]]
    if isinstance(full, RankSlice):
        problem = slice_mismatch(s, full)
        if problem is not None:
            raise ValueError(problem)
        if isinstance(full.data, Piece):
            # a run of the slice's row-major elements: the block's, one for one (contiguous)
            dest.view(-1)[full.data.offset:full.data.end].copy_(full.data.data)
            return
        dest.copy_(full.data)
        return
    if isinstance(full, Piece):
        _write_piece(dest, s, full)
        return
    if s.dim is None:
        dest.copy_(full)
        return
    if s.real:
        dest.narrow(s.dim, 0, s.real).copy_(full.narrow(s.dim, s.start, s.real))
    if s.real < s.length:
        dest.narrow(s.dim, s.real, s.length - s.real).zero_()


def _write_piece(dest: torch.Tensor, s: ShardSlice, piece: Piece) -> None:
    """Write the part of the rank's slice that a run of the full tensor's row-major elements
    holds, so a tensor cut into pieces loads piece by piece, each in place.

    Viewed as ``[outer, D * inner]`` (``D`` the split dimension's length), every
    outer row of the full tensor keeps the columns ``[start * inner, (start + real)
    * inner)``; the run covers a partial outer row, whole outer rows, a partial
    one. The rank's block, viewed as ``[outer, length * inner]``, takes each
    intersection at the same row."""
    data, e0, e1 = piece.data, piece.offset, piece.end
    if s.dim is None:
        dest.view(-1)[e0:e1].copy_(data)
        return
    full = s.full_shape
    inner = math.prod(full[s.dim + 1:])
    outer = math.prod(full[:s.dim])
    row_len = full[s.dim] * inner
    lo, hi = s.start * inner, (s.start + s.real) * inner
    block = dest.view(outer, s.length * inner)
    if e0 == 0 and s.real < s.length:  # padding rows, once per load: zeros, as write_slice writes
        dest.narrow(s.dim, s.real, s.length - s.real).zero_()
    at = e0
    while at < e1:
        row, col = divmod(at, row_len)
        if col == 0 and e1 - at >= row_len:  # whole outer rows: one strided copy
            k = (e1 - at) // row_len
            if hi > lo:
                src = data[at - e0:at - e0 + k * row_len].view(k, row_len)
                block[row:row + k, :hi - lo].copy_(src[:, lo:hi])
            at += k * row_len
            continue
        end = min(row_len, col + e1 - at)  # this outer row's columns the run holds: [col, end)
        a, b = max(col, lo), min(end, hi)
        if a < b:
            block[row, a - lo:b - lo].copy_(data[at - e0 + a - col:at - e0 + b - col])
        at += end - col


def shard_state_from_hf(full_state: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                        config: Any, dtype: DTypeLike, tp_rank: int, tp_size: int) -> dict[str, torch.Tensor]:
    """The parameters rank ``tp_rank`` of ``tp_size`` holds after loading the trainer's full
    state, on CPU, in the rank's parameter order. Refuses an incomplete or misshapen state."""
    plan = ShardPlan.build(TPLayout.from_config(config, tp_rank=tp_rank, tp_size=tp_size))
    items = _named_items(full_state)
    _check_specs(plan.full_map, ((n, t.shape, None) for n, t in items), None,
                 "trainer state does not match the engine")
    target = as_dtype(dtype)
    out = {name: torch.empty(shape, dtype=target) for name, shape in plan.local_map.params.items()}
    with torch.no_grad():
        for name, tensor in items:
            write_slice(out, plan.slices[name], tensor.detach().to("cpu"))
    return out


def expected_shard_digest(full_state: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                          config: Any, dtype: DTypeLike, tp_rank: int, tp_size: int) -> str:
    """The digest rank ``tp_rank`` of a TP-``tp_size`` engine reports after loading ``full_state``.

    At ``tp_size=1`` it is :func:`colo.engine.reference.model.expected_digest`.
    """
    return digest_tensors(shard_state_from_hf(full_state, config, dtype, tp_rank, tp_size).items())


# ---------------------------------------------------------------------------
# One rank


class TPEngineModel(EngineModel):
    """``EngineModel`` on the rank's shard, with the TP group's collectives in its forward."""

    #: a strided tensor (a one-copy sync's q, k, v) arrives in its own shape: ``write_slice``
    #: cuts the rank's slice out of that
    loads_strided = False
    #: a tensor cut for this rank (a TP-MoE expert's slice from its owner) is written as it is
    takes_rank_slices = True

    def __init__(self, config: Any, *, tp_rank: int, tp_size: int, group: Any = None,
                 dtype: DTypeLike = torch.bfloat16, device: str | torch.device = "cpu",
                 total_bytes: int, mem_fraction_static: float, saver: Any = None) -> None:
        # the layout is checked first: a model that cannot be split is refused before
        # any memory is allocated, any collective is entered or any weight is loaded
        self.layout = TPLayout.from_config(config, tp_rank=tp_rank, tp_size=tp_size)
        self.plan = ShardPlan.build(self.layout)
        self.group = group
        self._check_group()
        super().__init__(self.layout.local, dtype=dtype, device=device, total_bytes=total_bytes,
                         mem_fraction_static=mem_fraction_static, saver=saver)
        self.full_dims = self.layout.full
        self.sync_map = self.plan.full_map
        self.vocab_size = self.full_dims.vocab_size
        self._agree_across_ranks()

    @property
    def tp_size(self) -> int:
        return self.layout.tp_size

    @property
    def tp_rank(self) -> int:
        return self.layout.tp_rank

    def _check_group(self) -> None:
        if self.tp_size == 1:
            if self.group is not None and dist.get_world_size(self.group) != 1:
                raise ValueError(f"tp_size 1 was given a process group of {dist.get_world_size(self.group)} ranks")
            return
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(f"tp_size {self.tp_size} needs an initialised torch.distributed process group "
                             f"(one process per rank); none is initialised")
        size, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        if size != self.tp_size or rank != self.tp_rank:
            raise ValueError(f"the process group has rank {rank} of {size}, but this engine was built as "
                             f"tp_rank {self.tp_rank} of tp_size {self.tp_size}")

    def _agree_across_ranks(self) -> None:
        # Generation runs the same number of steps and chunks on every rank; ranks built
        # with different configs, dtypes or pool sizes would deadlock or mix garbage.
        if self.tp_size == 1:
            return
        fingerprint = hashlib.sha256(repr((self.full_dims, dtype_name(self.dtype))).encode()).digest()
        mine = torch.tensor([self.num_slots, int.from_bytes(fingerprint[:7], "little")], dtype=torch.int64,
                            device=self.device)
        every = [torch.empty_like(mine) for _ in range(self.tp_size)]
        dist.all_gather(every, mine, group=self.group)
        slots = [int(t[0]) for t in every]
        if len({int(t[1]) for t in every}) > 1:
            raise ValueError("the TP ranks were built with different model configs or dtypes")
        if len(set(slots)) > 1:
            raise ValueError(f"the TP ranks' KV pools hold different numbers of token slots {slots} "
                             f"(by rank): build every rank with the same total_bytes and mem_fraction_static")

    # -- loading: a full HF tensor in, this rank's slice kept ------------------

    def _write(self, params: dict[str, torch.Tensor], name: str, tensor: torch.Tensor) -> None:
        write_slice(params, self.plan.slices[name], tensor)

    def digest(self, order: Any = None, *, arm: bool = True) -> str:
        """This rank's shard digest (:func:`expected_shard_digest`): a rank holds slices, not
        the HF tensors it received, so the multi-rank check compares each rank's shard. Always
        read from the weights (no load sums for it: ``arm`` changes nothing)."""
        return digest_tensors(self._require_weights("digest weights").items())

    def _whole_dest(self, params: dict[str, torch.Tensor], name: str) -> None:
        return None  # every tensor is cut to this rank's slice by _write

    def _direct(self, params: dict[str, torch.Tensor], name: str, tensor: Any
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A slice cut for this rank (checked: ``_check_slices``) is its row block's bytes as
        they are, so a bucket of expert slices is copied in one batched call (one launch on
        a GPU) rather than one ``copy_`` each (Qwen3-30B-A3B: 18,432 a sync); a whole
        tensor is cut by ``_write``."""
        if not isinstance(tensor, RankSlice) or isinstance(tensor.data, Piece):
            return None  # a piece of the slice: written in place by _write
        dest = self._dests.get(name)  # made once per allocation of the weights, dropped with them
        if dest is None:
            s = self.plan.slices[name]
            dest = self._dests[name] = params[s.param][s.row_offset:s.row_offset + s.local_shape[0]]
        return dest, tensor.data

    def _check_slices(self, items: list, session: Any) -> None:
        """A tensor cut for one rank must be this rank's block of it (:func:`slice_mismatch`):
        otherwise the batch is refused before anything of it is written, every such tensor
        named with the block it is and the block this rank holds."""
        wrong = [p for name, t in items if isinstance(t, RankSlice)
                 and (p := slice_mismatch(self.plan.slices[name], t)) is not None]
        if wrong:
            session.wrong_shape += wrong
            raise WeightMismatch(f"load_weights refused the batch (nothing from it was written): tp_rank "
                                 f"{self.tp_rank} of {self.tp_size}", wrong_shape=wrong)

    def shard_specs(self) -> list[TensorSpec]:
        """The parameters this rank holds: engine names, shard shapes, the engine dtype."""
        return [spec(name, shape, dtype_name(self.dtype)) for name, shape in self.map.params.items()]

    # -- collectives in the forward ---------------------------------------------

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        weight = self._params["model.embed_tokens.weight"]
        if self.tp_size == 1:
            return F.embedding(tokens, weight)
        local = tokens - self.layout.vocab_start
        outside = (local < 0) | (local >= weight.shape[0])
        h = F.embedding(local.masked_fill(outside, 0), weight).masked_fill(outside[..., None], 0)
        # exactly one rank contributes each row, the others add zeros: the sum is exact
        return self._all_reduce(h)

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return self._all_reduce(partial)

    def _lm_head(self, h: torch.Tensor) -> torch.Tensor:
        local = F.linear(h, self._params[self.map.lm_head()]).contiguous()
        if self.tp_size > 1:
            blocks = [torch.empty_like(local) for _ in range(self.tp_size)]
            dist.all_gather(blocks, local, group=self.group)
            local = torch.cat(blocks, dim=-1)
        return local[..., :self.vocab_size].float()

    def _uniforms(self, batch: int, steps: int, generator: torch.Generator) -> torch.Tensor:
        uniforms = super()._uniforms(batch, steps, generator)
        if self.tp_size > 1:
            dist.broadcast(uniforms, group_src=0, group=self.group)
        return uniforms


class TPEngineCore(EngineCore):
    """``EngineCore`` for one rank of an engine TP group.

    The same surface, with these meanings: ``tag_bytes`` and the KV pool are
    this rank's; ``param_specs``, ``preflight`` and ``load_weights`` take the
    full HF tensors a sync delivers; ``digest`` hashes this rank's shard
    (compare with :func:`expected_shard_digest`); ``generate`` and ``logits``
    must be called on every rank with the same arguments and return the full
    result on every rank. Memory tags and the weight version are per rank.
    """

    def __init__(self, config: Any, *, tp_rank: int, tp_size: int, group: Any = None,
                 dtype: DTypeLike = torch.bfloat16, device: str | torch.device = "cpu", total_bytes: int,
                 mem_fraction_static: float, init_state: Mapping[str, torch.Tensor] | None = None,
                 saver: Any = None) -> None:
        # EngineCore's state around one rank's model (EngineCore.__init__ builds the whole model)
        self._start(TPEngineModel(config, tp_rank=tp_rank, tp_size=tp_size, group=group, dtype=dtype,
                                  device=device, total_bytes=total_bytes,
                                  mem_fraction_static=mem_fraction_static, saver=saver), init_state)

    @property
    def layout(self) -> TPLayout:
        return self.model.layout

    @property
    def tp_rank(self) -> int:
        return self.model.tp_rank

    @property
    def tp_size(self) -> int:
        return self.model.tp_size

    def shard_specs(self) -> list[TensorSpec]:
        return self.model.shard_specs()

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        out["vocab_size"] = self.model.vocab_size
        out["tp"] = self.layout.describe()
        return out
