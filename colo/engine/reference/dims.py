"""The shapes of the engine's models, read once from a config, and its name tables.

:func:`dims_from_config` is the one place that chooses the class: a dense model
(Qwen2, Qwen3, Llama) is :class:`Dims`, a Qwen3-MoE is :class:`MoEDims`. Everything
else in ``colo.engine`` takes the ``Dims`` it is given, so no module of the engine
needs to know the subclasses of another. What differs between architectures (a q/k/v
bias, per-head q/k norms, the name tables) is read from :mod:`colo.models.arch` by
the ``model_type`` a ``Dims`` carries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from colo.core.buckets import itemsize
from colo.dtypes import DTypeLike, dtype_name
from colo.models.arch import ARCHS, HEAD_ROWS, TAIL_ROWS, TIED, Arch, arch_of  # noqa: F401 (TIED re-exported)


#: the sizes of a transformers config the engine reads, by their names there
HF_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "intermediate_size", "max_position_embeddings")


@dataclass(frozen=True, kw_only=True)
class Dims:
    """The numbers of a dense model's config the engine needs, validated once."""

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
    #: the architecture (:data:`colo.models.arch.ARCHS`): its bias, q/k norms and name tables
    model_type: str = "qwen2"

    def __post_init__(self) -> None:
        if self.model_type not in ARCHS:
            raise ValueError(f"model_type {self.model_type!r} is not an architecture colo supports; "
                             f"supported: {', '.join(ARCHS)}")
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
        """Read a dense config (Qwen2, Qwen3, Llama: a transformers config or its ``to_dict()``
        read as attributes), refusing an architecture colo's table does not have
        (``UnsupportedArchitecture``) and what this engine does not implement
        (:func:`dims_from_config` chooses the class for any config)."""
        arch = arch_of(config)
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
        # Qwen3's head_dim is its own field (128 by default), not hidden / heads
        head_dim = (getattr(config, "head_dim", None) or arch.default_head_dim
                    or config.hidden_size // config.num_attention_heads)
        return cls(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                   num_layers=config.num_hidden_layers, num_heads=config.num_attention_heads,
                   num_kv_heads=config.num_key_value_heads, head_dim=head_dim,
                   intermediate_size=config.intermediate_size,
                   max_positions=config.max_position_embeddings,
                   rms_norm_eps=float(config.rms_norm_eps), rope_theta=float(theta),
                   tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
                   model_type=arch.model_type)

    @property
    def arch(self) -> Arch:
        return ARCHS[self.model_type]

    @property
    def qkv_bias(self) -> bool:
        """q/k/v carry a bias (``qkv_proj.bias``): Qwen2."""
        return self.arch.qkv_bias

    @property
    def qk_norm(self) -> bool:
        """q and k are RMS-normalised per head before the rotary embedding: Qwen3."""
        return self.arch.qk_norm

    @property
    def q_rows(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_rows(self) -> int:
        return self.num_kv_heads * self.head_dim

    def tables(self) -> tuple[tuple, tuple, tuple]:
        """The name tables (head, per layer, tail) of this model's architecture."""
        return HEAD_ROWS, self.arch.layer_rows(getattr(self, "num_experts", None)), TAIL_ROWS

    def slot_bytes(self, dtype: DTypeLike) -> int:
        """Bytes one token occupies in the KV pool: K and V, every layer."""
        return self.num_layers * 2 * self.kv_rows * itemsize(dtype_name(dtype))


def is_moe_config(config: Any) -> bool:
    """A MoE config (Qwen3-MoE), or its ``to_dict()`` read as attributes (the engine's build);
    a config of an architecture colo does not have is refused here (``UnsupportedArchitecture``)."""
    return arch_of(config).moe


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

        arch_of(config)  # the architecture table refuses an attention bias (UnsupportedArchitecture)
        unsupported = []
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
            "model_type", "use_sliding_window", "hidden_act", "rope_parameters", "rope_theta", "head_dim", "vocab_size",
            "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings")})
        dense.hidden_act = dense.hidden_act or "silu"
        dense.intermediate_size = config.moe_intermediate_size
        base = Dims.from_config(dense)
        fields = {f: getattr(base, f) for f in Dims.__dataclass_fields__}
        return cls(**fields, num_experts=int(experts), top_k=int(config.num_experts_per_tok),
                   norm_topk_prob=bool(getattr(config, "norm_topk_prob", False)))


def dims_from_config(config: Any) -> Dims:
    """The ``Dims`` of ``config`` (a ``transformers`` config or its ``to_dict()`` read as
    attributes): :class:`MoEDims` for a Qwen3-MoE, else the dense :class:`Dims`; an
    architecture colo's table does not have is refused (``UnsupportedArchitecture``)."""
    if isinstance(config, Dims):
        return config
    return MoEDims.from_config(config) if is_moe_config(config) else Dims.from_config(config)
