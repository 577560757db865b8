"""Extractor for a Megatron-layout trainer: TP shards gathered, PP/EP parameters broadcast, names made HF.

Megatron marks each parameter with ``tensor_model_parallel``, ``partition_dim``
and ``partition_stride``. A tensor-parallel parameter is rebuilt by an
all-gather over its tensor-parallel group and a ``cat`` on ``partition_dim``
(slime's ``all_gather_param``); a parameter that lives on one pipeline stage
or one expert-parallel rank only is first broadcast from that rank along its
pipeline (then expert) group. Only then is the name converted: a GLU
``linear_fc1`` shard holds ``[gate_i; up_i]`` (megatron-core >= 0.16 says so
with ``partition_stride = 2``), so the gathered halves are re-interleaved into
``gate_proj`` and ``up_proj``; a fused ``linear_qkv`` holds ``[q; k; v]`` per
query group and is split into ``q_proj``, ``k_proj`` and ``v_proj``;
vocabulary padding is cut off. A parameter the rules cannot map, or whose
layout (``partition_stride``) they cannot undo, is refused at construction, all
of them named in one error.

``tests/extractors/test_megatron_core.py`` checks all of it against the real megatron-core
(TP, PP, EP, its own checkpoint resharding): transformers' Qwen2 / Qwen2-MoE
loaded from the extracted tensors reproduces megatron-core's logits.

Who holds what is exchanged once, at construction, with ``all_gather_object``
of plain metadata (names, shapes, dtypes, attributes, group ranks), so every
rank derives the same plan of collectives; tensors only ever travel through
``broadcast`` and ``all_gather``.

A tensor-parallel tensor is gathered into its output in place (``extract(names,
into)``: a transport's staging view), and one cut on its rows can be gathered by
byte range (``extract_range``: a piece of a tensor larger than the bucket); see
``docs/multi-gpu.md``.

Experts scattered, not broadcast (``expert_scatter``, issue 46): when the engine is
TP-MoE over the ranks of the expert-parallel group (engine rank r = rank r of that
group; every engine rank holds its 1/N of each expert's intermediate axis), a rank
needs only its slice of each expert, so the owner cuts each expert it holds into the
N slices and one ``all_to_all_single`` per call (in blocks of at most
:data:`SCATTER_CHUNK_BYTES`, each owner's share in every block) delivers slice r to
rank r. Each rank receives 1/N of the expert bytes a broadcast brought it, in a few
collectives a bucket rather than one broadcast per expert tensor, every rank sending
at once; the slices are yielded under their HF names with ``TensorSpec.rank_slice``
saying which block each is, and the transport marks them on the wire.

Each rank's own slice, no gather (``tp_slices``, issue 46): when the engine's tensor-parallel
ranks are the trainer's (engine rank r = rank r of ``tp_group``) and split a tensor where
Megatron does, the engine rank needs exactly the shard its trainer rank holds, cut as the
name rules cut it: q, k and v of its query groups, gate and up of its ``linear_fc1``, its
columns of ``linear_proj`` and ``linear_fc2``, its vocabulary rows. Those go as that slice,
copied from the rank's own shard with no collective at all; an all-gather would bring every
rank the whole tensor for its engine rank to keep 1/N of it.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions

from colo.core.buckets import ALIGN, rank_slice_spec, spec
from colo.device import canonical_device
from colo.extractors.plain import (DTypeLike, UnknownTensor, check_against_spec, check_request, dtype_name,
                                   engine_dtype_of, resolve_dtype, to_engine)
from colo.core.interfaces import TensorSpec


@dataclass(frozen=True)
class NameRule:
    """How one Megatron parameter becomes one or more HF tensors.

    ``pattern`` must match the whole (global) Megatron name; ``targets`` are
    the HF names it becomes, with ``\\1``-style references to the pattern's
    groups. ``split``: ``"none"`` (one target), ``"glu"`` (``[gate; up]`` on dim
    0 -> gate, up), ``"qkv"`` (per query group ``[q; k; v]`` on dim 0 -> q, k,
    v; needs ``attention=``). ``vocab``: rows past ``vocab_size`` are padding.
    ``expert``: an expert's parameter, broadcast along the expert-parallel
    group and gathered over the expert tensor-parallel group. ``tied_copy``:
    left out when Megatron marks the parameter ``shared_embedding`` (the last
    pipeline stage's copy of a tied word embedding: HF ties ``lm_head`` to
    ``embed_tokens`` and its checkpoint has no ``lm_head.weight``).
    """

    pattern: str
    targets: tuple[str, ...]
    split: str = "none"
    vocab: bool = False
    expert: bool = False
    tied_copy: bool = False

    def __post_init__(self) -> None:
        want = {"none": 1, "glu": 2, "qkv": 3}
        if self.split not in want:
            raise ValueError(f"rule {self.pattern!r}: split must be one of {', '.join(want)}, got {self.split!r}")
        if len(self.targets) != want[self.split]:
            raise ValueError(f"rule {self.pattern!r}: split {self.split!r} makes {want[self.split]} tensor(s), "
                             f"got {len(self.targets)} target name(s)")
        re.compile(self.pattern)


_L = r"decoder\.layers\.(\d+)\."
_HL = r"model.layers.\1."

#: Megatron-core GPT -> HF Llama / Qwen2 / Qwen3 / Qwen2-MoE checkpoint names.
#: First full match wins. Extend or replace it for other architectures; a
#: parameter no rule matches is refused by name.
#:
#: Both of megatron-core's layer specs (``models/gpt/gpt_layer_specs.py``,
#: 0.16) are covered. The local spec (``get_gpt_layer_local_spec``) has
#: separate norms, ``input_layernorm`` and ``pre_mlp_layernorm``. The
#: Transformer-Engine spec fuses them into the next linear, TE's
#: ``LayerNormLinear`` (``TELayerNormColumnParallelLinear``), as its
#: ``layer_norm_weight``: the local spec's ``sharded_state_dict_keys_map``
#: (``"input_layernorm." -> "self_attention.linear_qkv.layer_norm_"``,
#: ``"pre_mlp_layernorm." -> "mlp.linear_fc1.layer_norm_"``) says these are the
#: same tensors, and so do megatron-core's own name maps between the specs
#: (``post_training/modelopt/gpt/state_dict_hooks.py``: ``linear_qkv.layer_norm_weight``
#: -> ``input_layernorm.weight``, ``mlp.linear_fc1.layer_norm_weight`` ->
#: ``pre_mlp_layernorm.weight``; ``export/trtllm/model_to_trllm_mapping/
#: default_conversion_dict.py`` maps both names of each norm to one TensorRT-LLM
#: weight). With MoE the TE spec keeps a separate ``pre_mlp_layernorm``
#: (``backend.layer_norm() if num_experts``). Experts are ``SequentialMLP``
#: (``local_experts.<i>.linear_fc<n>``) or ``TEGroupedMLP`` (``linear_fc<n>.weight<i>``);
#: shared experts are ``SharedExpertMLP``, an ``MLP`` on the dense
#: tensor-parallel group, with its sigmoid gate in ``gate_weight``
#: (``transformer/moe/shared_experts.py``). The HF side is the checkpoint's
#: per-expert naming (transformers fuses experts only when loading, see its
#: ``conversion_mapping.py``). Not mapped, so refused: norm biases (LayerNorm),
#: the legacy ``GroupedMLP`` (``experts.weight1``/``weight2``, all experts in one
#: tensor), the TE op-fuser MLP (``mlp.<i>.basic_ops...``), multi-latent attention,
#: the router's ``expert_bias``.
LLAMA_RULES: tuple[NameRule, ...] = (
    NameRule(r"embedding\.word_embeddings\.weight", ("model.embed_tokens.weight",), vocab=True),
    NameRule(r"output_layer\.weight", ("lm_head.weight",), vocab=True, tied_copy=True),
    NameRule(r"decoder\.final_layernorm\.weight", ("model.norm.weight",)),
    # attention; the input norm is separate (local spec) or fused into linear_qkv (TE spec)
    NameRule(_L + r"input_layernorm\.weight", (_HL + "input_layernorm.weight",)),
    NameRule(_L + r"self_attention\.linear_qkv\.layer_norm_weight", (_HL + "input_layernorm.weight",)),
    NameRule(_L + r"self_attention\.linear_qkv\.(weight|bias)",
             (_HL + r"self_attn.q_proj.\2", _HL + r"self_attn.k_proj.\2", _HL + r"self_attn.v_proj.\2"),
             split="qkv"),
    NameRule(_L + r"self_attention\.linear_proj\.(weight|bias)", (_HL + r"self_attn.o_proj.\2",)),
    NameRule(_L + r"self_attention\.(q|k)_layernorm\.weight", (_HL + r"self_attn.\2_norm.weight",)),
    # the norm before the MLP; separate (local spec, and TE spec with MoE) or fused into linear_fc1
    NameRule(_L + r"pre_mlp_layernorm\.weight", (_HL + "post_attention_layernorm.weight",)),
    NameRule(_L + r"mlp\.linear_fc1\.layer_norm_weight", (_HL + "post_attention_layernorm.weight",)),
    # dense SwiGLU MLP
    NameRule(_L + r"mlp\.linear_fc1\.(weight|bias)", (_HL + r"mlp.gate_proj.\2", _HL + r"mlp.up_proj.\2"),
             split="glu"),
    NameRule(_L + r"mlp\.linear_fc2\.(weight|bias)", (_HL + r"mlp.down_proj.\2",)),
    # MoE: router, routed experts (expert-parallel), shared expert (dense tensor-parallel) and its gate
    NameRule(_L + r"mlp\.router\.weight", (_HL + "mlp.gate.weight",)),
    NameRule(_L + r"mlp\.experts\.local_experts\.(\d+)\.linear_fc1\.(weight|bias)",
             (_HL + r"mlp.experts.\2.gate_proj.\3", _HL + r"mlp.experts.\2.up_proj.\3"),
             split="glu", expert=True),
    NameRule(_L + r"mlp\.experts\.local_experts\.(\d+)\.linear_fc2\.(weight|bias)",
             (_HL + r"mlp.experts.\2.down_proj.\3",), expert=True),
    # grouped-GEMM experts (TEGroupedMLP) name the expert as a suffix
    NameRule(_L + r"mlp\.experts\.linear_fc1\.(weight|bias)(\d+)",
             (_HL + r"mlp.experts.\3.gate_proj.\2", _HL + r"mlp.experts.\3.up_proj.\2"),
             split="glu", expert=True),
    NameRule(_L + r"mlp\.experts\.linear_fc2\.(weight|bias)(\d+)", (_HL + r"mlp.experts.\3.down_proj.\2",),
             expert=True),
    NameRule(_L + r"mlp\.shared_experts\.linear_fc1\.weight",
             (_HL + "mlp.shared_expert.gate_proj.weight", _HL + "mlp.shared_expert.up_proj.weight"), split="glu"),
    NameRule(_L + r"mlp\.shared_experts\.linear_fc2\.weight", (_HL + "mlp.shared_expert.down_proj.weight",)),
    NameRule(_L + r"mlp\.shared_experts\.gate_weight", (_HL + "mlp.shared_expert_gate.weight",)),
)


def global_name(name: str, *, layer_offset: int = 0, expert_offset: int = 0) -> str:
    """Megatron numbers layers per pipeline stage and experts per expert-parallel
    rank; the extractor needs model-wide numbers (as slime renames before its
    update). ``layer_offset``: this stage's first layer; ``expert_offset``:
    this rank's first expert."""
    name = re.sub(r"(^|\.)(decoder\.layers\.)(\d+)(?=\.)",
                  lambda m: f"{m[1]}{m[2]}{int(m[3]) + layer_offset}", name, count=1)
    name = re.sub(r"(\.local_experts\.)(\d+)(?=\.)", lambda m: f"{m[1]}{int(m[2]) + expert_offset}", name)
    return re.sub(r"(\.experts\.linear_fc[12]\.(?:weight|bias))(\d+)$",
                  lambda m: f"{m[1]}{int(m[2]) + expert_offset}", name)


@dataclass(frozen=True)
class _Meta:
    """What one rank says about one of its parameters: plain data, safe to exchange."""

    shape: tuple[int, ...]
    dtype: str
    tp: bool
    partition_dim: int
    partition_stride: int
    shared_embedding: bool = False

    @classmethod
    def of(cls, t: torch.Tensor) -> _Meta:
        # Megatron's set_defaults_if_not_set_tensor_model_parallel_attributes
        # treats a parameter without the attributes as replicated: so do we.
        # shared_embedding: LanguageModule.setup_embeddings_and_output_layer sets
        # it on both copies of a word embedding tied across pipeline stages.
        return cls(tuple(t.shape), dtype_name(t.dtype), bool(getattr(t, "tensor_model_parallel", False)),
                   int(getattr(t, "partition_dim", -1)), int(getattr(t, "partition_stride", 1)),
                   bool(getattr(t, "shared_embedding", False)))

    def __str__(self) -> str:
        return (f"{self.shape} {self.dtype} tensor_model_parallel={self.tp} partition_dim={self.partition_dim} "
                f"partition_stride={self.partition_stride}")


@dataclass
class _Source:
    name: str
    rule: NameRule
    targets: tuple[str, ...]
    meta: _Meta
    local: bool
    broadcasts: list[tuple[int, Any]] = field(default_factory=list)  # (global src rank, group) for this rank
    gather: Any = None  # the group to all-gather over, or None
    gather_size: int = 1
    #: this rank's place in ``gather`` and the group's global ranks, looked up once at
    #: construction (torch.distributed's lookups ran for every gather, a few hundred a sync)
    gather_rank: int = 0
    gather_ranks: tuple[int, ...] = ()
    #: scattered (``expert_scatter``): the owner's rank in the expert-parallel group, and
    #: per target the dimension the engine's ranks split it on
    owner: int = -1
    scatter: dict[str, int] = field(default_factory=dict)
    #: sent as this rank's own slice (``tp_slices``): the targets that go so
    sliced: set[str] = field(default_factory=set)


_AXES = ("tp", "pp", "ep", "etp")

#: the most one scatter collective's send and receive buffers hold together (the staging
#: bound's 64 MiB beside two buckets, as GATHER_CHUNK_BYTES). Each owner's share of a block
#: is at most 1/(2N) of it, so every block has every owner sending: one block holding only
#: consecutive experts (one owner's, in a layer) would be a scatter from one rank, the
#: other ranks' links idle
SCATTER_CHUNK_BYTES = 48 << 20

#: one all-gather into one output tensor (torch 2.13 renamed ``all_gather_into_tensor``)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

#: the most a row-parallel tensor's gather holds at once beside its output (the issue's
#: staging bound leaves 64 MiB beside the two buckets; 48 of them here: each block is one
#: collective from Python, and Qwen2-7B's 130 MiB down_proj took 5 at 32 MiB, 9 from a
#: pinned host copy, whose blocks alternate between two buffers of half the size)
GATHER_CHUNK_BYTES = 48 << 20


class MegatronExtractor:
    """Full HF tensors from this rank's Megatron parameters.

    ``params``: this rank's parameters as ``(name, tensor)`` pairs or a
    mapping, with model-wide (global) layer and expert numbers (see
    ``global_name``) and Megatron's ``tensor_model_parallel`` /
    ``partition_dim`` / ``partition_stride`` attributes. A mapping is read
    again on every ``extract`` (so it may hold a host copy that the trainer
    refreshes); pairs are kept as given (a ``Parameter`` follows ``.data`` swaps).

    Groups (``None``: that parallelism is 1): ``tp_group`` tensor-parallel,
    ``pp_group`` this rank's pipeline group (one rank per stage), ``ep_group``
    expert-parallel, ``expert_tp_group`` expert tensor-parallel (pass
    ``tp_group`` when experts are sharded like dense layers). ``group``: every
    rank that extracts (default: the world); all of them must build the
    extractor together, since construction exchanges the metadata.

    ``dtype``: the engine's dtype; shards are converted before they travel.
    ``device``: where shards go before converting and gathering (the
    communicator's device when the source is a host copy). ``upload_to``, for a
    pinned host copy instead of ``device``: where a transport stages this source
    (as :class:`~colo.extractors.plain.PlainExtractor`'s): a parameter that needs
    nothing done to it but a cut (not gathered, broadcast, converted or re-ordered:
    a whole tensor, ``linear_fc1``'s two halves, a fused QKV of one query group,
    the embedding's rows without the padding) comes out as a view of the host copy,
    which the transport uploads once, straight into its buffer; the others are
    uploaded to ``upload_to`` and worked on there. ``attention``:
    ``(num_attention_heads, num_query_groups)``, needed to split a fused
    ``linear_qkv``. ``vocab_size``: the tokenizer's vocabulary, to cut
    Megatron's padding off the embedding and output layer. ``rules``: the
    name table (``LLAMA_RULES``).

    ``expert_scatter``: HF name -> the dimension the engine's tensor-parallel ranks
    split it on (``colo.engine.reference.tp.split_dims``: 0 for an expert's gate and up
    rows, 1 for its down columns), for experts that should reach each rank as that
    rank's slice only (module docstring). The engine spans the ranks of ``ep_group``
    in its order (engine rank r = rank r of ``ep_group``); each such expert must be
    held whole by one rank of the group (expert TP 1, one pipeline stage). Its spec is
    then the slice (``TensorSpec.rank_slice``): this extractor no longer yields the whole
    tensor, so a caller that needs whole tensors (a digest of the model) builds one
    without it. Every rank must pass the same mapping.

    ``tp_slices``: HF name -> the dimension the engine's tensor-parallel ranks split it on
    (``colo.engine.reference.tp.split_dims``), where the engine spans the ranks of
    ``tp_group`` in its order (engine rank r = rank r of ``tp_group``). A tensor whose shard
    here is exactly engine rank r's block of it (tensor-parallel on that dimension over
    ``tp_group``, held on this rank, no vocabulary padding to cut: ``rows * N ==
    vocab_size``) is then sent as that slice, copied from the shard with no collective
    (module docstring); its spec is the slice (``TensorSpec.rank_slice``). Any other tensor
    goes whole as before (the embedding of a padded vocabulary; a norm), and ``sliced``
    names the ones that do not. A name no parameter becomes, an expert (those go by
    ``expert_scatter``) or a mapping without a tensor-parallel group of 2 or more is
    refused. Every rank must pass the same mapping.

    ``specs()`` lists every HF tensor of the whole model (every rank gets the
    same list), in rank-major order of first appearance (the scattered experts
    round-robin over their owners, in the places they held: see
    ``_interleave_owners``). Every rank must
    call ``extract`` with the same names in the same order; every rank then
    yields the full tensors.
    """

    kind = "megatron"

    def __init__(self, params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], *,
                 dtype: DTypeLike = None, device: torch.device | str | None = None,
                 tp_group: Any = None, pp_group: Any = None, ep_group: Any = None, expert_tp_group: Any = None,
                 group: Any = None, attention: tuple[int, int] | None = None, vocab_size: int | None = None,
                 rules: Sequence[NameRule] = LLAMA_RULES, upload_to: torch.device | str | None = None,
                 expert_scatter: Mapping[str, int] | None = None, tp_slices: Mapping[str, int] | None = None):
        self.dtype = resolve_dtype(dtype)
        self._expert_scatter = dict(expert_scatter or {})
        self._tp_slices = dict(tp_slices or {})
        #: the names sent as this rank's own slice (``tp_slices``), found at construction
        self.sliced: frozenset[str] = frozenset()
        #: HF name -> its source, for the scattered ones (a dict: each name looked up once a call)
        self._scattered: dict[str, _Source] = {}
        #: bytes and collectives of the scatter so far (``received``: slices that arrived here,
        #: this rank's own included; ``from_others``: of those, from other ranks; ``sent``: to
        #: other ranks; ``calls``): counted, so a test or a benchmark can say what moved
        self.scatter_stats = {"received": 0, "from_others": 0, "sent": 0, "calls": 0}
        if upload_to is not None and device is not None:
            raise ValueError("megatron extractor: give device (upload here) or upload_to (the transport "
                             "uploads into its own buffer), not both")
        #: where a transport should stage this source's tensors (the views of the host copy)
        # canonical: compared with the devices of the caller's views (a staging slot's)
        self.upload_to = None if upload_to is None else canonical_device(upload_to)
        #: where shards that need work (a gather, a conversion, a QKV re-order) are moved first
        self.device = self.upload_to if device is None else canonical_device(device)
        self.attention = _check_attention(attention)
        if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, int)
                                       or vocab_size <= 0):
            raise ValueError(f"megatron extractor: vocab_size must be a positive int, got {vocab_size!r}")
        self.vocab_size = vocab_size
        self.rules = tuple(rules)
        if isinstance(params, Mapping):
            self._mapping: Mapping[str, torch.Tensor] | None = params
            local = dict(params)
        else:
            self._mapping = None
            local = {}
            for name, t in params:
                if name in local:
                    raise ValueError(f"megatron extractor: parameter {name!r} given twice")
                local[name] = t
        self._local = local
        for name, t in local.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"megatron extractor: {name!r} is a {type(t).__name__}, not a tensor")
        self._groups = {"tp": tp_group, "pp": pp_group, "ep": ep_group, "etp": expert_tp_group}
        #: per GPU, the stream that uploads a pinned host source's parts (:meth:`_upload`)
        self._upload_streams: dict[torch.device, Any] = {}
        #: per GPU, this call's (caller's stream, upload stream), once the upload stream
        #: waited for the trainer's writes (:meth:`_upload`); emptied at every call
        self._call_streams: dict[torch.device, tuple[Any, Any]] = {}

        metas = {name: _Meta.of(t) for name, t in local.items()}
        everyone = self._exchange(metas, group)
        self._plan(everyone)

    # -- construction ----------------------------------------------------------
    def _exchange(self, metas: dict[str, _Meta], group: Any) -> list[dict]:
        distributed = dist.is_available() and dist.is_initialized()
        if not distributed:
            if any(g is not None for g in self._groups.values()) or group is not None:
                raise RuntimeError("megatron extractor: process groups were given but torch.distributed "
                                   "is not initialized")
            self.rank = 0
            axes = {a: [0] for a in _AXES}
            return [{"rank": 0, "axes": axes, "scatter": self._scatter_key(),
                     "params": [(n, m) for n, m in metas.items()]}]
        self.rank = dist.get_rank()
        axes = {a: (dist.get_process_group_ranks(g) if g is not None else [self.rank])
                for a, g in self._groups.items()}
        mine = {"rank": self.rank, "axes": axes, "scatter": self._scatter_key(),
                "params": [(n, (m.shape, m.dtype, m.tp, m.partition_dim, m.partition_stride, m.shared_embedding))
                           for n, m in metas.items()]}
        out: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, mine, group=group)
        for r in out:
            r["params"] = [(n, _Meta(tuple(m[0]), *m[1:])) for n, m in r["params"]]
        return out

    def _plan(self, everyone: list[dict]) -> None:
        who = "megatron extractor"
        ranks = [r["rank"] for r in everyone]
        axes_of = {r["rank"]: r["axes"] for r in everyone}
        _check_groups(axes_of, ranks)
        held: dict[str, dict[int, _Meta]] = {}
        for r in everyone:  # rank-major, first appearance: the extraction order
            for name, m in r["params"]:
                held.setdefault(name, {})[r["rank"]] = m

        self._sources: dict[str, _Source] = {}
        self._by_target: dict[str, str] = {}
        self._specs: dict[str, TensorSpec] = {}
        unmatched: list[str] = []
        strided: list[str] = []
        for name, by_rank in held.items():
            rule, match = _match(self.rules, name)
            if rule is None:
                unmatched.append(name)
                continue
            metas = set(by_rank.values())
            if len(metas) > 1:
                detail = "; ".join(f"rank {r}: {m}" for r, m in sorted(by_rank.items()))
                raise ValueError(f"{who}: ranks disagree about {name!r} (shape, dtype or parallel attributes "
                                 f"differ): {detail}")
            meta = metas.pop()
            if rule.tied_copy and meta.shared_embedding:
                continue  # the embedding itself is sent; HF ties the head to it
            if meta.partition_stride not in _strides(rule):
                want = " or ".join(map(str, _strides(rule)))
                strided.append(f"{name} (partition_stride {meta.partition_stride}, expected {want})")
                continue
            src = _Source(name, rule, tuple(match.expand(t) for t in rule.targets), meta,
                          local=self.rank in by_rank)
            self._route(src, set(by_rank), ranks, axes_of)
            for target, shape in zip(src.targets, self._shapes(src)):
                if target in self._by_target:
                    raise ValueError(f"{who}: {name!r} and {self._by_target[target]!r} both become {target!r}")
                self._by_target[target] = name
                self._specs[target] = spec(target, shape, dtype_name(self._engine_dtype(meta)))
            self._sources[name] = src
        problems = self._plan_scatter(everyone)
        if unmatched:
            problems.append(f"no name rule matches parameter(s) {unmatched}; add a NameRule for them")
        if strided:
            problems.append(f"cannot reassemble parameter(s) with this tensor-parallel layout: {strided}")
        if problems:
            # one error naming every parameter that cannot be mapped, not the first
            raise ValueError(f"{who}: " + "; ".join(problems))

    def _scatter_key(self) -> str:
        """``expert_scatter`` and ``tp_slices`` as a short string every rank can compare
        (Qwen3-30B-A3B's scatter has 18,432 names)."""
        import hashlib

        both = (sorted(self._expert_scatter.items()), sorted(self._tp_slices.items()))
        return hashlib.sha256(repr(both).encode()).hexdigest()

    def _plan_scatter(self, everyone: list[dict]) -> list[str]:
        """Mark the experts of ``expert_scatter`` as scattered and make their specs the slices
        this rank receives; what cannot be scattered, named (one error with the others)."""
        differ = sorted(r["rank"] for r in everyone if r["scatter"] != self._scatter_key())
        if differ:
            # each rank's collectives follow its own mapping: different ones would hang or mix bytes
            return [f"expert_scatter or tp_slices differs between rank {self.rank} and rank(s) {differ}; every "
                    f"rank must pass the same mapping"]
        problems = self._plan_slices(everyone)
        if not self._expert_scatter:
            return problems
        group = self._groups["ep"]
        size = len(everyone[[r["rank"] for r in everyone].index(self.rank)]["axes"]["ep"])
        if group is None or size < 2:
            return problems + [f"expert_scatter needs an expert-parallel group of 2 or more ranks (the engine's "
                               f"ranks); got {'none' if group is None else 'one of 1'}"]
        members = list(dist.get_process_group_ranks(group))
        me = members.index(self.rank)
        bad: list[str] = []
        for name, dim in self._expert_scatter.items():
            source = self._by_target.get(name)
            if source is None:
                bad.append(f"{name} (no parameter becomes it)")
                continue
            src = self._sources[source]
            ep = [(o, g) for o, g in src.broadcasts if g is group]
            why = ("not an expert's" if not src.rule.expert else
                   "sharded over expert tensor parallelism" if src.gather is not None else
                   "not held whole by exactly one rank of its expert-parallel group (or held on another "
                   "pipeline stage)" if len(src.broadcasts) != 1 or len(ep) != 1 else None)
            if why is not None:
                bad.append(f"{name} ({why})")
                continue
            whole = self._specs[name].shape
            if isinstance(dim, bool) or not isinstance(dim, int) or not 0 <= dim < len(whole) or whole[dim] % size:
                bad.append(f"{name} (dimension {dim!r} of {whole} does not split into {size} equal blocks)")
                continue
            length = whole[dim] // size
            self._specs[name] = rank_slice_spec(name, whole, self._specs[name].dtype, dim, me * length, length)
            src.owner = members.index(ep[0][0])
            src.scatter[name] = dim
            self._scattered[name] = src
        if bad:
            return problems + [f"cannot scatter expert tensor(s) {bad}"]
        self._scatter_group, self._scatter_size, self._scatter_me = group, size, me
        self._interleave_owners(size)
        return problems

    def _plan_slices(self, everyone: list[dict]) -> list[str]:
        """Mark the tensors of ``tp_slices`` whose shard here is the engine rank's block and make
        their specs that slice; what the mapping names wrongly, named (one error with the others).

        A target is sliced where its source is tensor-parallel over ``tp_group`` (not an
        expert's, held here, not broadcast from a pipeline stage), the engine splits it where
        Megatron does (a fused QKV or GLU and its parts on rows; another tensor on its
        ``partition_dim``) into equal blocks, and no vocabulary padding is cut off (the
        engine's block r would then start elsewhere than the shard's rows). Which they are
        follows from metadata every rank shares: every rank slices the same ones."""
        if not self._tp_slices:
            return []
        size = len(everyone[[r["rank"] for r in everyone].index(self.rank)]["axes"]["tp"])
        if self._groups["tp"] is None or size < 2:
            return [f"tp_slices needs a tensor-parallel group of 2 or more ranks (the engine's ranks); got "
                    f"{'none' if self._groups['tp'] is None else 'one of 1'}"]
        bad: list[str] = []
        sliced: list[str] = []
        for name, dim in self._tp_slices.items():
            source = self._by_target.get(name)
            if source is None:
                bad.append(f"{name} (no parameter becomes it)")
                continue
            src = self._sources[source]
            if src.rule.expert:
                bad.append(f"{name} (an expert's: experts go by expert_scatter)")
                continue
            whole = self._specs[name].shape
            if isinstance(dim, bool) or not isinstance(dim, int) or not 0 <= dim < len(whole):
                bad.append(f"{name} (dimension {dim!r} is not one of {whole})")
                continue
            split_at = 0 if src.rule.split in ("glu", "qkv") else src.meta.partition_dim
            own = (src.gather is not None and src.gather is self._groups["tp"] and src.local and not src.broadcasts
                   and dim == split_at and whole[dim] % size == 0
                   and not (src.rule.vocab and self.vocab_size is not None
                            and src.meta.shape[0] * size != self.vocab_size))
            if not own:
                continue  # goes whole, as before; the engine cuts it
            length = whole[dim] // size
            self._specs[name] = rank_slice_spec(name, whole, self._specs[name].dtype, dim,
                                                src.gather_rank * length, length)
            src.sliced.add(name)
            sliced.append(name)
        if bad:
            return [f"cannot send as each rank's own slice: {bad}"]
        self.sliced = frozenset(sliced)
        return []

    def _interleave_owners(self, size: int) -> None:
        """List the scattered tensors round-robin over their owners, in the places of the spec
        list they held (the same order on every rank: it follows from shared metadata).

        Why: the list is rank-major, so each owner's experts came one after the other (rank
        0's among its dense tensors, then all of rank 1's, ...), and a bucket held one
        owner's: its all_to_all was that one rank sending to all the others while they sent
        nothing, a scatter from one root at a time (with N = 4, a quarter of the links'
        bandwidth). Round-robin (layer, expert within its owner, owner), every bucket's
        collectives have every rank sending its share at once."""
        names = list(self._specs)
        spots = [i for i, n in enumerate(names) if n in self._scattered]
        queues: list[list[str]] = [[] for _ in range(size)]
        for i in spots:
            queues[self._scattered[names[i]].owner].append(names[i])
        robin = [n for turn in itertools.zip_longest(*queues) for n in turn if n is not None]
        for i, n in zip(spots, robin):
            names[i] = n
        self._specs = {n: self._specs[n] for n in names}

    def _route(self, src: _Source, holders: set[int], ranks: list[int], axes_of: dict) -> None:
        """Decide this rank's broadcasts and gather for ``src``, from metadata every rank shares."""
        who, name, meta = "megatron extractor", src.name, src.meta
        for axis in ("pp", "ep") if src.rule.expert else ("pp",):
            reached = set(holders)
            for r in ranks:
                members = axes_of[r][axis]
                inside = holders.intersection(members)
                if len(members) == 1 or len(inside) in (0, len(members)):
                    continue
                if len(inside) > 1:
                    raise ValueError(f"{who}: {name!r} is held by ranks {sorted(inside)} of the {axis} group "
                                     f"{members} but not by all of it; expected one owner or every member")
                reached.add(r)
                if r == self.rank:
                    src.broadcasts.append((next(iter(inside)), self._groups[axis]))
            holders = reached
        missing = sorted(set(ranks) - holders)
        if missing:
            raise ValueError(f"{who}: {name!r} (held by ranks {sorted(holders)}) cannot reach rank(s) {missing} "
                             f"through their pipeline{'/expert' if src.rule.expert else ''} groups")
        tp_axis = "etp" if src.rule.expert else "tp"
        size = len(axes_of[self.rank][tp_axis])
        if meta.tp and size > 1:
            if not 0 <= meta.partition_dim < len(meta.shape):
                raise ValueError(f"{who}: {name!r} is tensor-parallel but its partition_dim {meta.partition_dim} "
                                 f"is not a dimension of its shard {meta.shape}")
            if src.rule.split in ("glu", "qkv") and meta.partition_dim != 0:
                raise ValueError(f"{who}: {name!r} is a fused {src.rule.split} weight sharded on dim "
                                 f"{meta.partition_dim}; expected column-parallel (partition_dim 0)")
            src.gather, src.gather_size = self._groups[tp_axis], size
            src.gather_rank = dist.get_rank(src.gather)
            src.gather_ranks = tuple(dist.get_process_group_ranks(src.gather))

    def _engine_dtype(self, meta: _Meta) -> torch.dtype:
        return engine_dtype_of(getattr(torch, meta.dtype), self.dtype)

    def _shapes(self, src: _Source) -> list[tuple[int, ...]]:
        """What ``_convert`` will produce, from the metadata alone (and every check on it).

        Plain arithmetic, not a dry run on meta tensors: ``torch.cat`` on the
        meta device imports dynamo, seconds of start-up. ``extract`` still
        checks each tensor against these shapes before it leaves."""
        who, name, meta = "megatron extractor", src.name, src.meta
        full = list(meta.shape)
        if src.gather is not None:
            full[meta.partition_dim] *= src.gather_size
        if src.rule.split == "glu":
            if not full or meta.shape[0] % 2:
                raise ValueError(f"{who}: GLU weight {name!r} has an odd first dimension "
                                 f"{meta.shape[0] if full else 'in a 0-d tensor'}; a shard must hold [gate_i; up_i]")
            outs = [[full[0] // 2, *full[1:]] for _ in range(2)]
        elif src.rule.split == "qkv":
            head_dim, _ = self._qkv_layout(name, full)
            heads, groups = self.attention
            if groups % src.gather_size:
                raise ValueError(f"{who}: {name!r} is split over {src.gather_size} tensor-parallel ranks, which "
                                 f"does not divide its {groups} query groups; check attention=")
            outs = [[n * head_dim, *full[1:]] for n in (heads, groups, groups)]
        else:
            outs = [full]
        if src.rule.vocab and self.vocab_size is not None:
            if not full or self.vocab_size > full[0]:
                raise ValueError(f"{who}: vocab_size {self.vocab_size} is larger than {name!r}'s "
                                 f"{full[0] if full else 0} rows")
            for o in outs:
                o[0] = self.vocab_size
        return [tuple(o) for o in outs]

    # -- conversion ------------------------------------------------------------
    def _convert(self, src: _Source, shards: list[torch.Tensor]) -> list[torch.Tensor]:
        rule = src.rule
        if rule.split == "glu":
            # each shard is [gate_i; up_i]: gate = [gate_0; gate_1; ...], up likewise; one
            # shard's halves are row ranges of it, taken as they lie (a cat would copy them)
            halves = [s.chunk(2, dim=0) for s in shards]
            outs = list(halves[0]) if len(halves) == 1 else \
                [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
        else:
            full = shards[0] if len(shards) == 1 else torch.cat(shards, dim=src.meta.partition_dim)
            outs = self._split_qkv(src.name, full) if rule.split == "qkv" else [full]
        if rule.vocab and self.vocab_size is not None:
            outs = [o[:self.vocab_size] for o in outs]
        return [o.contiguous() for o in outs]

    def _qkv_layout(self, name: str, shape: Sequence[int]) -> tuple[int, int]:
        """(head_dim, query heads per group) of a fused QKV with ``shape``."""
        if self.attention is None:
            raise ValueError(f"megatron extractor: {name!r} is a fused QKV; pass "
                             f"attention=(num_attention_heads, num_query_groups) to split it")
        heads, groups = self.attention
        rows = shape[0] if len(shape) else 0
        if not len(shape) or rows % (heads + 2 * groups):
            raise ValueError(f"megatron extractor: {name!r} has {rows} rows, not a multiple of "
                             f"heads + 2 * query groups = {heads + 2 * groups}")
        return rows // (heads + 2 * groups), heads // groups

    def _qkv_parts(self, name: str, t: torch.Tensor, groups: int) -> list[torch.Tensor]:
        """q, k and v of ``t``, the fused QKV rows of ``groups`` whole query groups (the
        model's or one tensor-parallel rank's share): views shaped ``(groups, rows of one
        group's part, ...)``, strided where ``groups > 1`` (flattening one copies it).
        Megatron lays the fused projection out per query group: ``[its q heads; k; v]``."""
        rest = tuple(t.shape[1:])
        head_dim, per = self._qkv_layout(name, [t.shape[0] * self.attention[1] // groups, *rest])
        g = t.reshape(groups, (per + 2) * head_dim, *rest)
        return [g[:, :per * head_dim], g[:, per * head_dim:(per + 1) * head_dim], g[:, (per + 1) * head_dim:]]

    def _split_qkv(self, name: str, full: torch.Tensor) -> list[torch.Tensor]:
        rest = full.shape[1:]
        return [p.reshape(-1, *rest) for p in self._qkv_parts(name, full, self.attention[1])]

    def _split_qkv_into(self, src: _Source, full: torch.Tensor, into: Mapping[Any, torch.Tensor]
                        ) -> dict[str, torch.Tensor]:
        """q, k and v of this rank's whole fused QKV (no tensor-parallel gather), each copied
        from its strided rows straight into the caller's view of it (a staging slot's), else
        into a new tensor. Why: the split's ``reshape`` of strided rows made a new tensor of
        each (an allocation and a copy kernel) that the pack then copied again, which with
        the views and checks around them was most of Megatron's ``sync-first`` host work at
        one rank (84 fused projections of Qwen2-1.5B: 168 clones, 7.8 ms of host time and
        1.6 ms of cudaMalloc per sync on an H200; issue 44)."""
        outs = {}
        for name, part in zip(src.targets, self._qkv_parts(src.name, full, self.attention[1])):
            out = self._out(name, into)
            out.view(part.shape).copy_(part)
            outs[name] = out
        return outs

    # -- extraction ------------------------------------------------------------
    def specs(self) -> Sequence[TensorSpec]:
        return list(self._specs.values())

    #: ``extract(names, into)``: a tensor-parallel tensor is gathered straight into the
    #: caller's views of it (a staging slot's), with no buffer of its own
    extracts_into = True

    @property
    def source_device(self) -> torch.device:
        """Where gathered tensors are made: a transport's staging views must lie there."""
        return self._comm_device()

    def extract(self, names: Sequence[str], into: Mapping[Any, torch.Tensor] | None = None
                ) -> Iterator[tuple[str, torch.Tensor]]:
        """``(HF name, full tensor)`` for each name, in order. ``into``: the caller's views
        by name (a staging slot's, typed and shaped as the specs): a gathered tensor is
        gathered there and yielded as that view. From a pinned host copy the bytes go up on
        a stream of the extractor's own that does not wait for the caller's stream: no work
        the caller queued may still use the views (a slot whose last bucket the engine
        acknowledged; see :meth:`_upload`). The collectives are the same with and
        without ``into``, so ranks whose transports differ in that still line up."""
        names = check_request(names, self._specs, "megatron extractor")
        return self._extract(names, into or {})

    def ranged(self, name: str) -> bool:
        """Whether :meth:`extract_range` gathers only the bytes asked for of ``name``: a
        tensor-parallel tensor gathered from every rank's own shard, cut on its rows
        (embedding, ``lm_head``, column-parallel linears and their q/k/v and gate/up
        outputs: every rank's part back to back) or on a later dimension (row-parallel
        ``o_proj`` and ``down_proj``: the rows that hold the bytes, block by block). A
        piece of it (a tensor larger than the bucket) is then gathered into its own place
        in staging, bucket by bucket, never the whole tensor beside both staging buffers
        (the 1.09 GB embedding of Qwen2-7B; its 130 MiB ``down_proj`` in 64 MiB buckets).
        The same answer on every rank: it depends on the metadata every rank shares."""
        src = self._sources[self._by_target[name]]
        if name in self.sliced:
            # this rank's own slice, cut on the bytes asked for: where its part lies contiguous
            # (a vocabulary block, a GLU half, a row-parallel shard, one query group's q, k, v)
            return self._parts(src)[src.targets.index(name)].is_contiguous()
        return self._in_place(src)

    def extract_range(self, name: str, offset: int, nbytes: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Bytes ``[offset, offset + nbytes)`` of full tensor ``name`` (a :meth:`ranged` one)
        as a flat uint8 tensor: ``out`` (that many bytes, where the caller wants them) or a
        new one. Every rank calls it with the same arguments, in the same order."""
        check_request([name], self._specs, "megatron extractor")
        src = self._sources[self._by_target[name]]
        size = self._specs[name].nbytes
        item = self._engine_dtype(src.meta).itemsize
        if not self.ranged(name):
            raise ValueError(f"megatron extractor: {name!r} is not gathered from the ranks' own shards nor a "
                             f"contiguous slice of this rank's; extract it whole")
        if not (0 <= offset and 0 < nbytes and offset + nbytes <= size and offset % item == 0 and nbytes % item == 0):
            raise ValueError(f"megatron extractor: bytes [{offset}, {offset + nbytes}) are not a run of whole "
                             f"elements of {name!r} ({size} bytes of {item}-byte elements)")
        fresh = out is None  # new memory: the caller's stream may still read it (_upload)
        if out is None:
            out = torch.empty(nbytes, dtype=torch.uint8, device=self._comm_device())
        elif out.dtype != torch.uint8 or out.dim() != 1 or out.numel() != nbytes or not out.is_contiguous():
            raise ValueError(f"megatron extractor: out for {name!r} must be {nbytes} contiguous uint8 bytes, got "
                             f"{tuple(out.shape)} {out.dtype}")
        self._call_streams.clear()
        if name in self.sliced:
            # this rank's own slice: the elements asked for, no collective
            part = self._parts(src)[src.targets.index(name)].reshape(-1)
            dst = out.view(self._engine_dtype(src.meta))
            piece = part[offset // item:(offset + nbytes) // item]
            if _uploadable(dst, piece):
                self._upload([(dst, piece)], fresh=fresh)
            else:
                dst.copy_(piece)
        elif src.meta.partition_dim == 0:
            self._gather_rows(src, src.targets.index(name), out, offset, fresh=fresh)
        else:
            self._gather_columns(src, out, offset)
        return out

    def _extract(self, names: list[str], into: Mapping[Any, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        self._call_streams.clear()  # a new call: its first upload waits for the trainer's writes (_upload)
        last_use = {self._by_target[n]: i for i, n in enumerate(names)}
        # every rank reaches these lines with the same names: the same collectives, in the same order
        ready = self._scatter_together(names, into) if self._scattered else {}
        ready.update(self._gather_together(names, into))
        for i, name in enumerate(names):
            source = self._by_target[name]
            if source not in ready:
                # every rank reaches this line for the same source in the same order
                ready[source] = self._materialize(self._sources[source], into)
            t = ready[source].pop(name)
            if last_use[source] == i:  # the sibling outputs nobody asked for in this call go now
                del ready[source]
            if t is into.get(name):
                # the caller's own view, taken by _out only where it is the spec's dtype and shape
                yield name, t
            else:
                yield name, check_against_spec("megatron extractor", name, t, self._specs[name])

    def source_views(self, names: Sequence[str]) -> Iterator[tuple[str, torch.Tensor | None]]:
        """``(HF name, view)`` for each name, in order: the output as a view of this rank's own
        tensor as it lies (nothing copied, gathered or converted), in a shape whose row-major
        elements are the output's; ``None`` for an output that is not one (a tensor-parallel
        gather, a broadcast, a conversion to the engine's dtype, a tensor this rank does not
        hold). What a one-copy sync reads (:func:`colo.transports.packed.one_copy_bucket`):
        a whole tensor, a GLU half (a row range), the embedding without its padding rows (a
        row range) are in their own shapes; q, k and v of a fused QKV of several query groups
        are ``(groups, rows of a group, *rest)``, one run per group with the other parts'
        rows between, since no view of them has the output's shape (``extract`` copies them).
        Plain views, made anew at each call: the parameters' storage is read as it is now."""
        names = check_request(names, self._specs, "megatron extractor")
        cut: dict[str, tuple[torch.Tensor, ...] | None] = {}
        for name in names:
            src = self._sources[self._by_target[name]]
            if src.name not in cut:
                cut[src.name] = self._views_of(src)
            parts = cut[src.name]
            yield name, None if parts is None else parts[src.targets.index(name)]

    def _views_of(self, src: _Source) -> tuple[torch.Tensor, ...] | None:
        """Every output of ``src`` as a view of this rank's tensor (see :meth:`source_views`),
        or None where they are not views of it."""
        if not src.local or src.gather is not None or src.broadcasts \
                or self._engine_dtype(src.meta) != getattr(torch, src.meta.dtype):
            return None
        t = self._local_tensor(src).detach()
        if src.rule.split == "glu":
            outs: tuple[torch.Tensor, ...] = tuple(t.chunk(2, dim=0))
        elif src.rule.split == "qkv":
            outs = tuple(self._qkv_parts(src.name, t, self.attention[1]))
        else:
            outs = (t,)
        if src.rule.vocab and self.vocab_size is not None:
            outs = tuple(o[:self.vocab_size] for o in outs)
        return outs

    def _as_it_lies(self, src: _Source) -> bool:
        """Whether ``src``'s outputs are cuts of this rank's own tensor as it lies (views; no
        copy): nothing to gather, broadcast or convert, and for a fused QKV a single query
        group, whose q, k and v are row ranges (more groups interleave them)."""
        return (src.local and src.gather is None and not src.broadcasts
                and self._engine_dtype(src.meta) == getattr(torch, src.meta.dtype)
                and (src.rule.split != "qkv" or (self.attention is not None and self.attention[1] == 1)))

    def _local_tensor(self, src: _Source) -> torch.Tensor:
        """This rank's own tensor of ``src``, as it lies now (the mapping is read again)."""
        source = self._mapping if self._mapping is not None else self._local
        t = source.get(src.name)
        # Only this rank can see these two mistakes; the others will wait in
        # the collective below until their timeout. Still better than sending
        # bytes of the wrong size.
        if t is None:
            raise UnknownTensor(f"megatron extractor: {src.name!r} is no longer in this rank's parameters "
                                f"(it was there when the ranks exchanged metadata)")
        if tuple(t.shape) != src.meta.shape or dtype_name(t.dtype) != src.meta.dtype:
            raise ValueError(f"megatron extractor: {src.name!r} is now {tuple(t.shape)} {dtype_name(t.dtype)}, "
                             f"but was {src.meta.shape} {src.meta.dtype} when the ranks exchanged metadata")
        return t

    def _materialize(self, src: _Source, into: Mapping[Any, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        target = self._engine_dtype(src.meta)
        if self._in_place(src):
            # gathered into the outputs (the caller's staging views, else new tensors):
            # this rank's part goes there straight from its source, the others' arrive
            # around it; no list of shards, no cat, no split copy
            outs = {}
            for k, name in enumerate(src.targets):
                out = self._out(name, into)
                if src.meta.partition_dim == 0:
                    # a new tensor's memory may be some the caller's stream still reads
                    fresh = out is not (into or {}).get(name)
                    self._gather_rows(src, k, out.view(-1).view(torch.uint8), 0, fresh=fresh)
                else:
                    self._gather_columns(src, out)
                outs[name] = out
            return outs
        if src.local:
            t = self._local_tensor(src)
            if self.upload_to is None or not self._as_it_lies(src):
                t = to_engine(t, self.dtype, self.device)
            if into and src.gather is None and not src.broadcasts and src.rule.split == "qkv" \
                    and not src.rule.vocab and t.device == self._comm_device():
                # (a source left on the host goes as before: split there, uploaded by the pack)
                return self._split_qkv_into(src, t, into)
        else:
            t = torch.empty(src.meta.shape, dtype=target, device=self._comm_device())
        for owner, group in src.broadcasts:
            dist.broadcast(_wire(t), src=owner, group=group)
        shards = [t]
        if src.gather is not None:
            parts = [torch.empty_like(_wire(t)) for _ in range(src.gather_size)]
            dist.all_gather(parts, _wire(t), group=src.gather)
            shards = [p.view(target) for p in parts]
        return dict(zip(src.targets, self._convert(src, shards)))

    # -- gathering into place ----------------------------------------------------
    def _in_place(self, src: _Source) -> bool:
        """Gathered from every rank's own shard (on its rows or, a row-parallel linear, on a
        later dimension) straight into the output, any byte range of it on its own."""
        return src.gather is not None and src.local and not src.broadcasts

    def _out(self, name: str, into: Mapping[Any, torch.Tensor] | None) -> torch.Tensor:
        s = self._specs[name]
        dtype, device = getattr(torch, s.dtype), self._comm_device()
        view = (into or {}).get(name)
        if view is not None and view.dtype == dtype and tuple(view.shape) == s.shape and view.is_contiguous() \
                and view.device == device:  # both canonical: see __init__
            return view
        return torch.empty(s.shape, dtype=dtype, device=device)

    def _parts(self, src: _Source) -> tuple[torch.Tensor, ...]:
        """:meth:`_part` of every output of ``src``, cut from its tensor once."""
        t = self._local_tensor(src).detach()
        if src.rule.split == "glu":
            return t.chunk(2, dim=0)
        if src.rule.split == "qkv":
            return tuple(self._qkv_parts(src.name, t, self.attention[1] // src.gather_size))
        return (t,)

    def _part(self, src: _Source, k: int) -> torch.Tensor:
        """This rank's part of output ``k`` of a source gathered on its rows, as it lies in
        its tensor (a view: a GLU half is a row range; a q, k or v of several query groups
        is strided, one run per group, shaped ``(groups, rows of a group, ...)``: not
        flattened, which would copy it). Output k is the ranks' parts back to back, and
        the vocabulary padding is the last rows of the last parts."""
        return self._parts(src)[k]

    def _upload_stream(self, device: torch.device) -> Any:
        """This GPU's upload stream (made once)."""
        stream = self._upload_streams.get(device)
        if stream is None:
            stream = self._upload_streams[device] = torch.cuda.Stream(device)
        return stream

    def _upload(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], after: Any = None, fresh: bool = False) -> None:
        """Each ``(dst, part)`` of ``pairs`` (:func:`_uploadable`: pinned host memory into a
        contiguous tensor of one GPU, shaped and typed alike) on this GPU's upload stream,
        run by run; the caller's stream waits for all of them, once.

        The upload stream lets the next part's upload run while the caller's stream
        gathers this one (every part went up and was gathered in turn: an
        ``offload-first`` sync's link idle during each gather). Run by run: ``copy_``
        of a strided host view (q, k or v of several query groups) first copies it into
        new pageable memory on the CPU, then transfers that synchronously.

        The upload stream does not follow the other streams on its own. Its first upload
        of a call (:meth:`_extract`, :meth:`extract_range`) waits for what the default
        stream has queued: the trainer's writes of its host copy. One into ``fresh``
        memory (allocated in this call from the caller's stream) waits for all the
        caller's stream has queued: the allocator hands out blocks that stream may still
        read (without it an ``offload-first`` baseline's new tensors took wrong bytes on
        two H200s). The caller's own views (``into``: a staging slot whose last bucket
        the engine acknowledged) are nothing the caller's stream still uses, so an upload
        into them does not wait for the previous bucket's gathers: waiting for all of
        the caller's stream at every call left the link idle at every bucket's end (the
        next bucket's first upload behind this one's last gathers). ``after``: an event
        the upload also waits for (the last reader of a buffer this call reuses)."""
        device = pairs[0][0].device
        streams = self._call_streams.get(device)
        if streams is None:  # the call's first upload here: after the trainer's writes
            caller, stream = torch.cuda.current_stream(device), self._upload_stream(device)
            stream.wait_stream(torch.cuda.default_stream(device))
            self._call_streams[device] = caller, stream
        else:
            caller, stream = streams
        if fresh:
            stream.wait_stream(caller)
        if after is not None:
            stream.wait_event(after)
        with torch.cuda.stream(stream):
            for dst, part in pairs:
                for d, h in _runs(dst.view(part.shape), part):
                    d.copy_(h, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
        caller.wait_event(done)

    def _gather_together(self, names: list[str], into: Mapping[Any, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
        """The outputs among ``names`` gathered on their rows from every rank's own shard,
        whole (no vocabulary padding cut), all at once: every part this rank holds goes
        into its place in its output (in one upload or one batched copy), then one
        coalesced all-gather per group fills in the other ranks' parts around them.
        ``{source: {target: output}}``; the others are left to :meth:`_materialize`.

        Why: one all-gather and one copy per output, each through torch.distributed's
        Python, was most of a TP=2 sync's host time (395 all-gathers and 567 copies a
        ``sync-first`` sync of Qwen2-7B on two H200s, the GPUs waiting for the host;
        issue 46). Only the outputs asked for are gathered (a source's sibling in
        another bucket is gathered there), and which they are follows from the names
        and the metadata every rank shares."""
        jobs = []
        copies, gathers, fresh = [], {}, False
        ready: dict[str, dict[str, torch.Tensor]] = {}
        # a source's parts, cut once for all its outputs asked for (q, k and v; gate and up)
        parts: dict[str, tuple[torch.Tensor, ...]] = {}
        for name in names:
            src = self._sources[self._by_target[name]]
            if name in src.sliced:
                # this rank's own part is the engine rank's slice: into its output, in the
                # call's one upload or batched copy below, and no collective
                cut = parts.get(src.name)
                if cut is None:
                    cut = parts[src.name] = self._parts(src)
                part = cut[src.targets.index(name)]
                out = self._out(name, into)
                fresh = fresh or out is not into.get(name)
                copies.append((out.view(part.shape), part))
                ready.setdefault(src.name, {})[name] = out
                continue
            if not self._in_place(src) or src.meta.partition_dim != 0:
                self._copy_whole(src, name, into, copies, ready)
                continue
            cut = parts.get(src.name)
            if cut is None:
                cut = parts[src.name] = self._parts(src)
            part = cut[src.targets.index(name)]
            step = part.numel() * self._engine_dtype(src.meta).itemsize  # one rank's part, in bytes
            if self._specs[name].nbytes == src.gather_size * step:  # else padding is cut: by broadcasts
                jobs.append((src, name, part, step))
        for src, name, part, step in jobs:
            out = self._out(name, into)
            fresh = fresh or out is not into.get(name)  # new memory: the caller's stream may still read it
            flat = out.view(-1).view(torch.uint8)
            mine = flat[src.gather_rank * step:(src.gather_rank + 1) * step]
            copies.append((mine.view(out.dtype).view(part.shape), part))
            gathers.setdefault(src.gather, []).append((flat, mine))
            ready.setdefault(src.name, {})[name] = out
        up: list = []
        rest: list = []
        for c in copies:
            (up if _uploadable(*c) else rest).append(c)
        if up:
            self._upload(up, fresh=fresh)
        if rest:
            torch._foreach_copy_([d for d, _ in rest], [p for _, p in rest])
        for group, pairs in gathers.items():
            _all_gather_coalesced([o for o, _ in pairs], [i for _, i in pairs], group)
        return ready

    def _scatter_together(self, names: list[str], into: Mapping[Any, torch.Tensor]
                          ) -> dict[str, dict[str, torch.Tensor]]:
        """The scattered outputs among ``names`` (``expert_scatter``): this rank's slice of each,
        ``{source: {target: slice}}``, in a few ``all_to_all_single`` collectives.

        The blocks follow from the names and the metadata alone, the same on every rank:
        each owner's outputs in order, cut where its share of a block would pass
        1/(2N) of :data:`SCATTER_CHUNK_BYTES`, so every block has every owner sending."""
        size = self._scatter_size
        share = max(1, SCATTER_CHUNK_BYTES // (2 * size))
        by_owner: list[list[str]] = [[] for _ in range(size)]
        for name in names:
            src = self._scattered.get(name)
            if src is not None:
                by_owner[src.owner].append(name)
        blocks: list[list[list[str]]] = []
        for q, mine in enumerate(by_owner):
            k, held = 0, 0
            for name in mine:
                n = self._specs[name].nbytes
                if held and held + n > share:
                    k, held = k + 1, 0
                while len(blocks) <= k:
                    blocks.append([[] for _ in range(size)])
                blocks[k][q].append(name)
                held += n
        ready: dict[str, dict[str, torch.Tensor]] = {}
        for block in blocks:
            self._scatter_block(block, into, ready)
        return ready

    def _scatter_block(self, block: list[list[str]], into: Mapping[Any, torch.Tensor],
                       ready: dict[str, dict[str, torch.Tensor]]) -> None:
        """One ``all_to_all_single``: rank q's outputs ``block[q]`` go from q to every rank as
        that rank's slice. Rank q sends rank r its slice r of each, back to back (each at a
        16-byte offset); rank r receives them from every owner and copies each into its
        output (the caller's view of it, else it is yielded as the received bytes)."""
        size, me, group = self._scatter_size, self._scatter_me, self._scatter_group
        device = self._comm_device()
        places: list[list[tuple[str, int]]] = []  # per owner: (name, byte offset in its region)
        region = []  # per owner: the bytes it sends each rank
        for names in block:
            at, laid = 0, []
            for name in names:
                at = -(-at // ALIGN) * ALIGN
                laid.append((name, at))
                at += self._specs[name].nbytes
            places.append(laid)
            region.append(-(-at // ALIGN) * ALIGN)
        send = torch.empty(size * region[me], dtype=torch.uint8, device=device)
        dsts, srcs = [], []
        parts: dict[str, tuple[torch.Tensor, ...]] = {}
        for name, at in places[me]:
            src = self._scattered[name]
            spec_ = self._specs[name]
            cut = parts.get(src.name)
            if cut is None:
                cut = parts[src.name] = self._scatter_parts(src)
            whole = cut[src.targets.index(name)]
            dim, n = src.scatter[name], spec_.nbytes
            # (size, slice) views of both: slice r of the whole tensor, rank r's bytes of the region
            blocks_ = whole.reshape(*whole.shape[:dim], size, whole.shape[dim] // size, *whole.shape[dim + 1:])
            dsts.append(send.view(size, region[me])[:, at:at + n].view(whole.dtype).view(size, *spec_.shape))
            srcs.append(blocks_.movedim(dim, 0))
        if dsts:
            torch._foreach_copy_(dsts, srcs)
        recv = torch.empty(sum(region), dtype=torch.uint8, device=device)
        dist.all_to_all_single(recv, send, output_split_sizes=region, input_split_sizes=[region[me]] * size,
                               group=group)
        out_dst, out_src = [], []
        base = 0
        for q in range(size):
            for name, at in places[q]:
                s = self._specs[name]
                got = recv[base + at:base + at + s.nbytes].view(getattr(torch, s.dtype)).view(s.shape)
                out = self._out(name, into) if into.get(name) is not None else got
                if out is not got:
                    out_dst.append(out)
                    out_src.append(got)
                ready.setdefault(self._scattered[name].name, {})[name] = out
            base += region[q]
        if out_dst:
            torch._foreach_copy_(out_dst, out_src)
        st = self.scatter_stats
        st["received"] += sum(self._specs[n].nbytes for names in block for n in names)
        st["from_others"] += sum(self._specs[n].nbytes for q, names in enumerate(block) if q != me for n in names)
        st["sent"] += (size - 1) * sum(self._specs[n].nbytes for n in block[me])
        st["calls"] += 1

    def _scatter_parts(self, src: _Source) -> tuple[torch.Tensor, ...]:
        """The owner's whole outputs of a scattered source in the engine's dtype on the
        communicator's device (uploaded from a pinned host copy, as the broadcast did):
        gate and up of a GLU weight (row ranges of it), else the tensor."""
        t = to_engine(self._local_tensor(src), self.dtype, self._comm_device())
        return t.chunk(2, dim=0) if src.rule.split == "glu" else (t,)

    def _copy_whole(self, src: _Source, name: str, into: Mapping[Any, torch.Tensor], copies: list,
                    ready: dict[str, dict[str, torch.Tensor]]) -> None:
        """A replicated tensor (a norm) that lies on the caller's device in the engine's
        dtype goes into the caller's view of it (a staging slot's) by the call's one
        batched copy; anything else is left to :meth:`_materialize`.

        Why: yielded as the trainer's own tensor, it made its bucket not "gathered in
        place", so the sender packed the whole bucket (a check and a byte view of every
        tensor, a hop to a worker thread) for two norms of a few KB (issue 46: 57 of
        Qwen2-7B's 339 tensors, in every bucket of a TP=2 ``sync-first`` sync)."""
        view = into.get(name)
        if view is None or src.gather is not None or src.broadcasts or not src.local \
                or src.rule.split != "none" or src.rule.vocab:
            return
        t = self._local_tensor(src).detach()
        if t.dtype != self._engine_dtype(src.meta) or self._out(name, into) is not view \
                or t.device != view.device:
            return
        copies.append((view, t))
        ready[src.name] = {name: view}

    def _gather_rows(self, src: _Source, k: int, out: torch.Tensor, start: int, fresh: bool = False) -> None:
        """Bytes ``[start, start + out.numel())`` of output ``k`` into ``out`` (flat uint8).

        This rank copies its own part's bytes into place from its source (an upload when
        that is the pinned host copy, converted on the way); the other ranks' arrive
        around them: by one all-gather in place when ``out`` is the whole output with no
        padding cut, else by a broadcast from each rank whose part the range touches (a
        piece of the embedding, a vocabulary with padding). Which of the two follows
        from the arguments alone, the same on every rank."""
        target = self._engine_dtype(src.meta)
        part = self._part(src, k)
        item, size = target.itemsize, src.gather_size
        step = part.numel() * item  # one rank's part, in bytes
        end = start + out.numel()
        me = src.gather_rank
        lo, hi = max(start, me * step), min(end, (me + 1) * step)
        if lo < hi:
            mine = out[lo - start:hi - start].view(target)
            first, last = (lo - me * step) // item, (hi - me * step) // item
            if first == 0 and last == part.numel():
                dst, piece = mine.view(part.shape), part
            else:
                # a piece of a tensor larger than a bucket (an embedding: contiguous)
                dst, piece = mine, part.reshape(-1)[first:last]
            if _uploadable(dst, piece):
                self._upload([(dst, piece)], fresh=fresh)
            else:
                dst.copy_(piece)
        if start == 0 and end == size * step:
            _all_gather_single(out, out[me * step:(me + 1) * step], group=src.gather)
            return
        ranks = src.gather_ranks
        for r in range(size):
            lo, hi = max(start, r * step), min(end, (r + 1) * step)
            if lo < hi:
                dist.broadcast(out[lo - start:hi - start], src=ranks[r], group=src.gather)

    def _gather_columns(self, src: _Source, out: torch.Tensor, start: int = 0) -> None:
        """A tensor cut on a later dimension (a row-parallel linear: ``o_proj``, ``down_proj``)
        into ``out``, the whole tensor or (flat uint8) its bytes ``[start, start +
        out.numel())``: its rows interleave the ranks' shards, so the rows that hold those
        bytes are gathered block by block into a buffer of at most
        :data:`GATHER_CHUNK_BYTES` and their bytes copied into place; never the whole
        gathered tensor beside it. The blocks follow from the arguments alone, the same
        on every rank."""
        target = self._engine_dtype(src.meta)
        t = self._local_tensor(src).detach()
        d, size, me = src.meta.partition_dim, src.gather_size, src.gather_rank
        rows = 1
        for n in t.shape[:d]:
            rows *= n
        width = t.numel() // max(rows, 1)  # one rank's elements per row
        row = size * width  # the whole tensor's elements per row
        local = t.reshape(rows, width)
        flat = out.reshape(-1) if out.dtype == target else out.view(target)  # the elements asked for
        first = start // target.itemsize
        last = first + flat.numel()
        lo_row, hi_row = first // row, -(-last // row)
        # From pinned host memory, two buffers of half the size: the next block's upload
        # runs while this one is gathered and put in place, in the same memory.
        uploads = out.device.type == "cuda" and t.device.type == "cpu" and t.is_pinned() and t.dtype == target
        nbuf = 2 if uploads else 1
        step = max(1, GATHER_CHUNK_BYTES // nbuf // max(1, row * target.itemsize))
        held = min(step, hi_row - lo_row)
        # the event after the last put-in-place that read each buffer (none before its first use)
        read: list[Any] = [None] * nbuf
        if uploads:
            caller = torch.cuda.current_stream(out.device)  # (one lookup: tens of us each)
            # From the upload stream's pool, which only work the upload stream queued used
            # before: the first block's upload need not wait for the caller's stream (a block
            # of its pool may be memory that stream still reads: the upload waited for all of
            # it, leaving the link idle during the bucket's gathers). The caller's stream
            # gathers and reads the buffers: the allocator keeps them until it is done.
            with torch.cuda.stream(self._upload_stream(out.device)):
                bufs = [torch.empty(size * held * width, dtype=target, device=out.device) for _ in range(nbuf)]
            for buf in bufs:
                buf.record_stream(caller)
        else:
            bufs = [torch.empty(size * held * width, dtype=target, device=out.device) for _ in range(nbuf)]
        # each buffer's bytes viewed once: a block's collective takes slices of them
        raw = [buf.view(torch.uint8) for buf in bufs]
        for j, a in enumerate(range(lo_row, hi_row, step)):
            n, b = min(step, hi_row - a), j % nbuf
            block = bufs[b][:size * n * width].view(size, n, width)
            mine = block[me]
            if uploads:
                self._upload([(mine, local[a:a + n])], after=read[b])
            else:
                mine.copy_(local[a:a + n])
            part = n * width * target.itemsize  # one rank's bytes of the block
            _all_gather_single(raw[b][:size * part], raw[b][me * part:(me + 1) * part], group=src.gather)
            lo, hi = max(first, a * row), min(last, (a + n) * row)
            _put_rows(flat[lo - first:hi - first], block, lo - a * row, hi - a * row)
            if uploads:
                read[b] = torch.cuda.Event()
                read[b].record(caller)

    def _comm_device(self) -> torch.device:
        if self.device is not None:
            return self.device
        # a rank that holds nothing (unusual) receives on the CPU
        first = next(iter(self._local.values()), None)
        return first.device if first is not None else torch.device("cpu")


def _put_rows(dst: torch.Tensor, block: torch.Tensor, lo: int, hi: int) -> None:
    """Elements ``[lo, hi)`` of ``block``'s rows, laid out whole (``block`` is the ranks'
    shards of ``n`` rows, ``(ranks, n, width)``; a whole row is every rank's part of it
    in rank order), into ``dst``: the whole rows in one copy, a row's part run by run."""
    size, _, width = block.shape
    row, pos = size * width, lo
    while pos < hi:
        r = pos // row
        if pos == r * row and hi >= (r + 1) * row:  # whole rows from r on
            k = hi // row - r
            dst[pos - lo:pos - lo + k * row].view(k, size, width).copy_(block[:, r:r + k].transpose(0, 1))
            pos += k * row
            continue
        rank, x0 = divmod(pos - r * row, width)  # part of row r: up to the end of one rank's run
        x1 = min(width, x0 + hi - pos)
        dst[pos - lo:pos - lo + x1 - x0].copy_(block[rank, r, x0:x1])
        pos += x1 - x0


def _uploadable(dst: torch.Tensor, part: torch.Tensor) -> bool:
    """Whether :meth:`MegatronExtractor._upload` takes the pair: pinned host memory into a
    contiguous GPU tensor of the same dtype (a conversion is copied the ordinary way)."""
    return (dst.device.type == "cuda" and part.device.type == "cpu" and part.is_pinned()
            and part.dtype == dst.dtype and dst.is_contiguous())


def _all_gather_coalesced(outs: list[torch.Tensor], ins: list[torch.Tensor], group: Any) -> None:
    """``all_gather_into_tensor(outs[i], ins[i])`` for every i as one collective of the
    process group (NCCL: one group call): one call from Python for a bucket's outputs,
    not one each through torch.distributed's checks and logging. Synchronous as those
    are (on a GPU: the caller's stream waits for it)."""
    coalesced = getattr(group, "allgather_into_tensor_coalesced", None)
    if len(outs) == 1 or coalesced is None:
        for o, i in zip(outs, ins):
            _all_gather_single(o, i, group=group)
        return
    coalesced(outs, ins, AllgatherOptions()).wait()


def _runs(dst: torch.Tensor, src: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(dst piece, src piece)`` pairs that cover ``src``, each piece of ``src``
    contiguous (split along leading dimensions until it is); ``dst`` shaped as ``src``."""
    if src.is_contiguous() or src.dim() <= 1:
        yield dst, src
        return
    for i in range(src.shape[0]):
        yield from _runs(dst[i], src[i])


def _wire(t: torch.Tensor) -> torch.Tensor:
    """Broadcast and all-gather only move bytes; gloo refuses float8 ("Invalid
    scalar type"), so 1-byte types travel as uint8 views of the same memory."""
    if t.dtype.itemsize == 1 and t.dtype != torch.uint8:
        return t.view(torch.uint8)
    return t


def _strides(rule: NameRule) -> tuple[int, ...]:
    """The ``partition_stride`` values whose shards ``_convert`` reassembles correctly.

    A stride s means the full tensor is s blocks along ``partition_dim``, each
    split over the tensor-parallel ranks; rank r holds ``[block_0[r]; ...;
    block_{s-1}[r]]`` (megatron-core's ``_initialize_affine_weight_cpu`` and its
    ``resharding/planner.py``). megatron-core >= 0.16 gives a gated
    ``linear_fc1`` (weight and bias) stride 2 (``transformer/mlp.py``,
    ``MLP.__init__``): exactly the ``[gate_i; up_i]`` shard the GLU split
    re-interleaves. Before 0.16 (and with ``use_kitchen``) the same shard carried
    stride 1: Megatron's forward chunks the local output into gate and up either
    way, so the layout is the same. Nothing else in megatron-core 0.16 sets a
    stride other than 1.
    """
    return (1, 2) if rule.split == "glu" else (1,)


def _match(rules: Sequence[NameRule], name: str) -> tuple[NameRule | None, re.Match | None]:
    for rule in rules:
        m = re.fullmatch(rule.pattern, name)
        if m:
            return rule, m
    return None, None


def _check_attention(attention: tuple[int, int] | None) -> tuple[int, int] | None:
    if attention is None:
        return None
    try:
        heads, groups = (int(x) for x in attention)
    except (TypeError, ValueError):
        raise ValueError(f"megatron extractor: attention must be (num_attention_heads, num_query_groups), "
                         f"got {attention!r}") from None
    if heads <= 0 or groups <= 0 or heads % groups:
        raise ValueError(f"megatron extractor: attention=({heads}, {groups}): expected positive head counts "
                         f"with num_attention_heads a multiple of num_query_groups")
    return heads, groups


def _check_groups(axes_of: dict[int, dict[str, list[int]]], ranks: list[int]) -> None:
    """Each rank's group on an axis must contain it, and its members must name the same group."""
    for r in ranks:
        for axis, members in axes_of[r].items():
            if r not in members:
                raise ValueError(f"megatron extractor: rank {r}'s {axis} group {members} does not contain it")
            for m in members:
                if m not in axes_of:
                    raise ValueError(f"megatron extractor: rank {r}'s {axis} group {members} has rank {m}, "
                                     f"which does not take part in extraction")
                if axes_of[m][axis] != members:
                    raise ValueError(f"megatron extractor: ranks {r} and {m} disagree about their {axis} group: "
                                     f"{members} vs {axes_of[m][axis]}")
