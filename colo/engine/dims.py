"""The shapes of the engine's models, read once from a config, and its name tables.

:func:`dims_from_config` is the one place that chooses the class: a dense Qwen2
is :class:`Dims`, a Qwen3-MoE is :class:`MoEDims`. Everything else in
``colo.engine`` takes the ``Dims`` it is given, so no module of the engine needs
to know the subclasses of another.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from colo.core.buckets import itemsize
from colo.dtypes import DTypeLike, dtype_name


#: the sizes of a transformers config the engine reads, by their names there
HF_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "intermediate_size", "max_position_embeddings")


@dataclass(frozen=True, kw_only=True)
class Dims:
    """The numbers of a Qwen2 config the engine needs, validated once."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_positions: int
    rms_norm_eps: float
    rope_theta: float
    #: one parameter, ``model.embed_tokens.weight``, is both the embedding and lm_head
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "intermediate_size", "max_positions"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not self.rms_norm_eps > 0 or not self.rope_theta > 0:
            raise ValueError(f"rms_norm_eps and rope_theta must be > 0, got {self.rms_norm_eps}, {self.rope_theta}")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ValueError(f"tie_word_embeddings must be a bool, got {self.tie_word_embeddings!r}")

    @classmethod
    def from_config(cls, config: Any) -> Dims:
        """Read a dense ``transformers.Qwen2Config``, refusing what this engine does not
        implement (:func:`dims_from_config` chooses the class for any config)."""
        unsupported = []
        if getattr(config, "use_sliding_window", False):
            unsupported.append("use_sliding_window=True")
        if getattr(config, "hidden_act", "silu") != "silu":
            unsupported.append(f"hidden_act={config.hidden_act!r} (only 'silu')")
        rope = getattr(config, "rope_parameters", None) or {}
        if rope.get("rope_type", "default") != "default":
            unsupported.append(f"rope_type={rope.get('rope_type')!r} (only 'default')")
        if unsupported:
            raise ValueError("engine model does not support " + "; ".join(unsupported))
        theta = rope.get("rope_theta", getattr(config, "rope_theta", None))
        if theta is None:
            raise ValueError("config has no rope_theta (neither rope_parameters['rope_theta'] nor rope_theta)")
        # checked under the config's own names, before any arithmetic: a zero head count
        # would otherwise end in a ZeroDivisionError below, a string in a TypeError
        for name in HF_SIZES:
            value = getattr(config, name, None)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("rms_norm_eps", "rope_theta"):
            value = theta if name == "rope_theta" else config.rms_norm_eps
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number, got {value!r}")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                   num_layers=config.num_hidden_layers, num_heads=config.num_attention_heads,
                   num_kv_heads=config.num_key_value_heads, head_dim=head_dim,
                   intermediate_size=config.intermediate_size,
                   max_positions=config.max_position_embeddings,
                   rms_norm_eps=float(config.rms_norm_eps), rope_theta=float(theta),
                   tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)))

    @property
    def q_rows(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_rows(self) -> int:
        return self.num_kv_heads * self.head_dim

    def tables(self) -> tuple[tuple, tuple, tuple]:
        """The name tables (head, per layer, tail) of this model; a MoE's are its own."""
        return HEAD_TABLE, LAYER_TABLE, TAIL_TABLE

    def slot_bytes(self, dtype: DTypeLike) -> int:
        """Bytes one token occupies in the KV pool: K and V, every layer."""
        return self.num_layers * 2 * self.kv_rows * itemsize(dtype_name(dtype))


# ---------------------------------------------------------------------------
# The name map

#: Per decoder layer: engine parameter suffix, its HF parts in row order as
#: (HF suffix, the ``Dims`` attribute giving that part's rows), and the
#: ``Dims`` attributes of the trailing dimensions every part shares. A 1:1
#: parameter is a fusion of one part. Row blocks follow SGLang's layout:
#: qkv_proj = [q; k; v], gate_up_proj = [gate; up].
LAYER_TABLE: tuple[tuple[str, tuple[tuple[str, str], ...], tuple[str, ...]], ...] = (
    ("self_attn.qkv_proj.weight", (("self_attn.q_proj.weight", "q_rows"),
                                   ("self_attn.k_proj.weight", "kv_rows"),
                                   ("self_attn.v_proj.weight", "kv_rows")), ("hidden_size",)),
    ("self_attn.qkv_proj.bias", (("self_attn.q_proj.bias", "q_rows"),
                                 ("self_attn.k_proj.bias", "kv_rows"),
                                 ("self_attn.v_proj.bias", "kv_rows")), ()),
    ("self_attn.o_proj.weight", (("self_attn.o_proj.weight", "hidden_size"),), ("q_rows",)),
    ("mlp.gate_up_proj.weight", (("mlp.gate_proj.weight", "intermediate_size"),
                                 ("mlp.up_proj.weight", "intermediate_size")), ("hidden_size",)),
    ("mlp.down_proj.weight", (("mlp.down_proj.weight", "hidden_size"),), ("intermediate_size",)),
    ("input_layernorm.weight", (("input_layernorm.weight", "hidden_size"),), ()),
    ("post_attention_layernorm.weight", (("post_attention_layernorm.weight", "hidden_size"),), ()),
)
#: Outside the layers, in the order the engine's parameters are kept (and hashed).
HEAD_TABLE = (("model.embed_tokens.weight", (("model.embed_tokens.weight", "vocab_size"),), ("hidden_size",)),)
TAIL_TABLE = (
    ("model.norm.weight", (("model.norm.weight", "hidden_size"),), ()),
    ("lm_head.weight", (("lm_head.weight", "vocab_size"),), ("hidden_size",)),
)
#: With tied word embeddings: HF name -> the engine parameter that already holds
#: its tensor. Such a name has no parameter of its own and is not accepted in a sync.
TIED = {"lm_head.weight": "model.embed_tokens.weight"}


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


def dims_from_config(config: Any) -> Dims:
    """The ``Dims`` of ``config`` (a ``transformers`` config or its ``to_dict()`` read as
    attributes): :class:`MoEDims` for a Qwen3-MoE, else the dense :class:`Dims`."""
    if isinstance(config, Dims):
        return config
    return MoEDims.from_config(config) if is_moe_config(config) else Dims.from_config(config)
