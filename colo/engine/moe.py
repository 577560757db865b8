"""The engine's Qwen3-MoE: a sparse MoE block in place of the MLP, q/k RMSNorm, no attention bias.

The same math as transformers' ``Qwen3MoeForCausalLM`` (checked against it in
``tests/test_moe.py``): per token the router's softmax over all experts, the
top-k kept (renormalised when ``norm_topk_prob``), each chosen expert's SwiGLU
weighted and summed; q and k are RMS-normalised per head before the rotary
embedding.

Layout, as SGLang's ``FusedMoE``: the experts of a layer live in two fused
parameters, ``mlp.experts.w13_weight`` (expert e's ``[gate_e; up_e]``, rows
``e * 2I .. (e + 1) * 2I``) and ``mlp.experts.w2_weight`` (expert e's down
projection, rows ``e * H .. (e + 1) * H``), so the engine's name table
(:meth:`MoEDims.tables`) maps each per-expert checkpoint tensor
(``mlp.experts.<e>.gate_proj.weight`` ...) to its row block the way the dense
table maps q/k/v into ``qkv_proj``. A sync delivers the checkpoint's names.

Tensor parallelism: **TP-MoE** (SGLang's default for Qwen3-MoE when no
``--ep-size`` is given): every rank holds every expert, each expert's
intermediate dimension split over the ranks exactly like the dense MLP's
(``gate``/``up`` rows and ``down`` columns: the ``intermediate_size`` axis of
:mod:`colo.engine.tp`, which for a MoE is ``moe_intermediate_size``). Each rank
computes a partial sum over its slice of every chosen expert and the block's
output is all-reduced once, as the dense MLP's is. Chosen over EP-MoE (whole
experts per rank) because it needs no token dispatch (all-to-all) in the
engine, its load is balanced whatever the router picks, and it is the dense
TP engine with one more split tensor: the loader, the shard digests and the
sync's verification are the same code. The router (``mlp.gate.weight``) and the
q/k norms are replicated, so every rank routes every token identically.

Nothing here is tuned for speed: the experts run one by one over their tokens
(transformers' own loop), enough for the CPU tests and the probe; the
benchmarks never generate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from colo.engine.core import EngineCore
from colo.engine.model import HEAD_TABLE, TAIL_TABLE, DTypeLike, Dims, EngineModel
from colo.engine.tp import TPEngineCore, TPEngineModel


def is_moe_config(config: Any) -> bool:
    """A Qwen3-MoE config, or its ``to_dict()`` read as attributes (the engine's build)."""
    return getattr(config, "model_type", None) == "qwen3_moe"


@dataclass(frozen=True, kw_only=True)
class MoEDims(Dims):
    """``Dims`` of a Qwen3-MoE. ``intermediate_size`` is each expert's (``moe_intermediate_size``):
    it is the axis tensor parallelism splits, as the dense MLP's is."""

    num_experts: int
    top_k: int
    norm_topk_prob: bool

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("num_experts", "top_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.top_k}) exceeds num_experts ({self.num_experts})")
        if not isinstance(self.norm_topk_prob, bool):
            raise ValueError(f"norm_topk_prob must be a bool, got {self.norm_topk_prob!r}")

    @classmethod
    def from_config(cls, config: Any) -> MoEDims:
        """Read a ``transformers.Qwen3MoeConfig``, refusing what this engine does not implement."""
        import types

        unsupported = []
        if getattr(config, "attention_bias", False):
            unsupported.append("attention_bias=True")
        if getattr(config, "mlp_only_layers", None):
            unsupported.append(f"mlp_only_layers={list(config.mlp_only_layers)} (every layer must be sparse)")
        if getattr(config, "decoder_sparse_step", 1) != 1:
            unsupported.append(f"decoder_sparse_step={config.decoder_sparse_step} (every layer must be sparse)")
        experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
        missing = [k for k, v in (("num_experts", experts),
                                  ("num_experts_per_tok", getattr(config, "num_experts_per_tok", None)),
                                  ("moe_intermediate_size", getattr(config, "moe_intermediate_size", None)),
                                  ("head_dim", getattr(config, "head_dim", None))) if v is None]
        if missing:
            unsupported.append(f"a config without {', '.join(missing)}")
        if unsupported:
            raise ValueError("engine MoE model does not support " + "; ".join(unsupported))
        # the attention and the rest read as a dense model's, whose MLP width is an expert's
        dense = types.SimpleNamespace(**{k: getattr(config, k, None) for k in (
            "use_sliding_window", "hidden_act", "rope_parameters", "rope_theta", "head_dim", "vocab_size",
            "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings")})
        dense.hidden_act = dense.hidden_act or "silu"
        dense.intermediate_size = config.moe_intermediate_size
        base = Dims.from_config(dense)
        fields = {f: getattr(base, f) for f in Dims.__dataclass_fields__}
        return cls(**fields, num_experts=int(experts), top_k=int(config.num_experts_per_tok),
                   norm_topk_prob=bool(getattr(config, "norm_topk_prob", False)))

    def tables(self) -> tuple[tuple, tuple, tuple]:
        e = range(self.num_experts)
        layer = (
            ("self_attn.qkv_proj.weight", (("self_attn.q_proj.weight", "q_rows"),
                                           ("self_attn.k_proj.weight", "kv_rows"),
                                           ("self_attn.v_proj.weight", "kv_rows")), ("hidden_size",)),
            ("self_attn.o_proj.weight", (("self_attn.o_proj.weight", "hidden_size"),), ("q_rows",)),
            ("self_attn.q_norm.weight", (("self_attn.q_norm.weight", "head_dim"),), ()),
            ("self_attn.k_norm.weight", (("self_attn.k_norm.weight", "head_dim"),), ()),
            ("mlp.gate.weight", (("mlp.gate.weight", "num_experts"),), ("hidden_size",)),
            ("mlp.experts.w13_weight", tuple(p for i in e for p in (
                (f"mlp.experts.{i}.gate_proj.weight", "intermediate_size"),
                (f"mlp.experts.{i}.up_proj.weight", "intermediate_size"))), ("hidden_size",)),
            ("mlp.experts.w2_weight", tuple((f"mlp.experts.{i}.down_proj.weight", "hidden_size") for i in e),
             ("intermediate_size",)),
            ("input_layernorm.weight", (("input_layernorm.weight", "hidden_size"),), ()),
            ("post_attention_layernorm.weight", (("post_attention_layernorm.weight", "hidden_size"),), ()),
        )
        return HEAD_TABLE, layer, TAIL_TABLE


class _MoEForward:
    """What Qwen3-MoE changes in ``EngineModel``'s forward: the attention projection (no bias,
    per-head q/k norms) and the sparse block in place of the MLP. The rest (embedding, rotary,
    KV pool, reduce, lm_head) is the dense model's, whole or one TP rank's shard when mixed
    into ``TPEngineModel``."""

    dims: MoEDims

    def _qkv(self, pre: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """No projection bias; Qwen3's RMSNorm over each head's head_dim, before the rotary embedding."""
        p, d = self._params, self.dims
        b, t, _ = x.shape
        q, k, v = F.linear(x, p[pre + "self_attn.qkv_proj.weight"]).split((d.q_rows, d.kv_rows, d.kv_rows), dim=-1)
        q = self._rmsnorm(q.view(b, t, d.num_heads, d.head_dim), p[pre + "self_attn.q_norm.weight"])
        k = self._rmsnorm(k.view(b, t, d.num_kv_heads, d.head_dim), p[pre + "self_attn.k_norm.weight"])
        return q.transpose(1, 2), k.transpose(1, 2), v.view(b, t, d.num_kv_heads, d.head_dim).transpose(1, 2)

    def _mlp(self, pre: str, x: torch.Tensor) -> torch.Tensor:
        """The sparse block in place of the dense MLP, on the tokens flattened."""
        b, t, _ = x.shape
        return self._moe(pre, x.reshape(b * t, -1)).view(b, t, -1)

    def _moe(self, pre: str, x: torch.Tensor) -> torch.Tensor:
        """The sparse block on ``[N, H]`` tokens: this rank's partial sum (the whole sum at TP=1)."""
        p, d = self._params, self.dims
        inter = d.intermediate_size  # this rank's slice of each expert
        # as transformers' Qwen3MoeTopKRouter: softmax in float32 over every expert, top-k,
        # optionally renormalised, then back to the activations' dtype
        probs = torch.softmax(F.linear(x, p[pre + "mlp.gate.weight"]), dim=-1, dtype=torch.float)
        weights, chosen = torch.topk(probs, d.top_k, dim=-1)
        if d.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        w13 = p[pre + "mlp.experts.w13_weight"].view(d.num_experts, 2 * inter, d.hidden_size)
        w2 = p[pre + "mlp.experts.w2_weight"].view(d.num_experts, d.hidden_size, inter)
        out = torch.zeros_like(x)
        for e in torch.unique(chosen).tolist():
            token, slot = torch.where(chosen == e)
            gate, up = F.linear(x[token], w13[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, w2[e]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out


class MoEEngineModel(_MoEForward, EngineModel):
    """The whole Qwen3-MoE on one device."""


class MoETPEngineModel(_MoEForward, TPEngineModel):
    """One rank of a TP-MoE engine: its heads, its slice of every expert, its vocabulary block."""


class MoEEngineCore(EngineCore):
    """``EngineCore`` around :class:`MoEEngineModel`."""

    def __init__(self, config: Any, *, dtype: DTypeLike = torch.bfloat16, device: str | torch.device = "cpu",
                 total_bytes: int, mem_fraction_static: float, init_state: Any = None, saver: Any = None) -> None:
        self._start(MoEEngineModel(config, dtype=dtype, device=device, total_bytes=total_bytes,
                                   mem_fraction_static=mem_fraction_static, saver=saver), init_state)


class MoETPEngineCore(TPEngineCore):
    """``TPEngineCore`` around :class:`MoETPEngineModel`."""

    def __init__(self, config: Any, *, tp_rank: int, tp_size: int, group: Any = None,
                 dtype: DTypeLike = torch.bfloat16, device: str | torch.device = "cpu", total_bytes: int,
                 mem_fraction_static: float, init_state: Any = None, saver: Any = None) -> None:
        self._start(MoETPEngineModel(config, tp_rank=tp_rank, tp_size=tp_size, group=group, dtype=dtype,
                                     device=device, total_bytes=total_bytes,
                                     mem_fraction_static=mem_fraction_static, saver=saver), init_state)


def core_class(config: Any, *, tp: bool) -> type:
    """The engine core for ``config``: the MoE one for a Qwen3-MoE, else the dense one."""
    if is_moe_config(config):
        return MoETPEngineCore if tp else MoEEngineCore
    return TPEngineCore if tp else EngineCore
