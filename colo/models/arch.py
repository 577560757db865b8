"""Every architecture colo syncs, as data: what its Hugging Face checkpoint holds, and how
engines fuse it.

One row of :data:`ARCHS` per ``model_type`` (the field of a checkpoint's ``config.json``)
says what differs between the decoder-only models colo takes: whether q/k/v carry a bias
(Qwen2), whether q and k are RMS-normalised per head before the rotary embedding (Qwen3),
which ``head_dim`` a config that gives none has (Qwen3: 128, not hidden / heads), whether
the MLP is a sparse MoE block (Qwen3-MoE), the config values this table assumes, and
which of SGLang's model files loads it. Everything else (embedding, norms, SwiGLU MLP,
lm_head or tied embeddings) they share, and the name tables below say it once.

Who reads it: colo's engine (``colo.engine.reference.dims`` picks its tables, ``colo.engine.reference.model``
its bias and q/k norms), the weight map every engine-side check uses
(``colo.engine.reference.weights``), the trainers (``colo.trainers.models``: a config or checkpoint
of another architecture is refused before a model is built), the Megatron trainer
(``colo.trainers.megatron``: ``add_qkv_bias``, ``qk_layernorm``), the checkpoint checks
(:mod:`colo.models.checkpoint`: a directory vLLM starts from holds exactly these names),
the vLLM adapter (``colo.engine.vllm``: refuses what is not here) and SGLang's preflight
(``colo.engine.sglang``).

Pure: no torch, no anyio.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from colo.core.errors import UnsupportedArchitecture

#: A name table's row: the engine parameter's suffix, its HF parts in row order as
#: (HF suffix, the size giving that part's rows), and the sizes of the trailing dimensions
#: every part shares. A 1:1 parameter is a fusion of one part. Row blocks follow SGLang's
#: and vLLM's layout: ``qkv_proj = [q; k; v]``, ``gate_up_proj = [gate; up]``. Sizes are
#: attribute names of the engine's ``Dims`` (``q_rows`` = heads x head_dim, ``kv_rows`` =
#: KV heads x head_dim), so a tensor-parallel rank's shard reads the same rows.
Row = tuple[str, tuple[tuple[str, str], ...], tuple[str, ...]]


@dataclass(frozen=True, kw_only=True)
class Arch:
    """What one architecture's checkpoint holds beyond the shared decoder layout."""

    #: ``config.json``'s ``model_type``
    model_type: str
    #: transformers' class for it (``config.json``'s ``architectures``)
    hf_class: str
    #: q_proj, k_proj and v_proj carry a bias (fused into ``qkv_proj.bias``); o_proj never does
    qkv_bias: bool
    #: ``self_attn.q_norm`` / ``k_norm``: an RMSNorm over each head's head_dim, before the rotary embedding
    qk_norm: bool
    #: the head_dim of a config that gives none; None: hidden_size // num_attention_heads
    default_head_dim: int | None = None
    #: the MLP is a sparse MoE block (router + experts) in every layer
    moe: bool = False
    #: config fields whose other values add tensors this table does not list (a bias on
    #: o_proj and the MLP), each with the one value colo takes; an absent field is its default
    fixed: Mapping[str, Any] = field(default_factory=dict)
    #: SGLang 0.5.23's model file for it (colo's SGLang preflight checks names against it);
    #: None: colo's SGLang adapter does not take this architecture
    sglang: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model_type, str) or not self.model_type:
            raise ValueError(f"model_type must be a non-empty string, got {self.model_type!r}")
        for name in ("qkv_bias", "qk_norm", "moe"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{self.model_type}: {name} must be a bool, got {getattr(self, name)!r}")
        d = self.default_head_dim
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d <= 0):
            raise ValueError(f"{self.model_type}: default_head_dim must be a positive integer or None, got {d!r}")
        object.__setattr__(self, "fixed", MappingProxyType(dict(self.fixed)))

    def layer_rows(self, num_experts: int | None = None) -> tuple[Row, ...]:
        """One decoder layer's name table (a MoE's with ``num_experts`` experts)."""
        rows = [row for feature, *row in ATTENTION_ROWS if feature is None or getattr(self, feature)]
        if self.moe:
            if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts <= 0:
                raise ValueError(f"{self.model_type}: the layer table of a MoE needs num_experts, got {num_experts!r}")
            rows += moe_rows(num_experts)
        else:
            rows += DENSE_MLP_ROWS
        return tuple(tuple(r) for r in rows + list(NORM_ROWS))

    def layout_problems(self, config: Any) -> list[str]:
        """The config values this table cannot describe (``fixed``), as ``field=value`` phrases."""
        out = []
        for name, want in self.fixed.items():
            got = config_field(config, name, want)
            if got != want:
                out.append(f"{name}={got!r} (colo takes {self.model_type} with {name}={want!r} only)")
        return out


#: (feature of :class:`Arch` that switches the row on, or None: always), then the row
ATTENTION_ROWS: tuple[tuple[str | None, str, tuple[tuple[str, str], ...], tuple[str, ...]], ...] = (
    (None, "self_attn.qkv_proj.weight", (("self_attn.q_proj.weight", "q_rows"),
                                         ("self_attn.k_proj.weight", "kv_rows"),
                                         ("self_attn.v_proj.weight", "kv_rows")), ("hidden_size",)),
    ("qkv_bias", "self_attn.qkv_proj.bias", (("self_attn.q_proj.bias", "q_rows"),
                                             ("self_attn.k_proj.bias", "kv_rows"),
                                             ("self_attn.v_proj.bias", "kv_rows")), ()),
    (None, "self_attn.o_proj.weight", (("self_attn.o_proj.weight", "hidden_size"),), ("q_rows",)),
    ("qk_norm", "self_attn.q_norm.weight", (("self_attn.q_norm.weight", "head_dim"),), ()),
    ("qk_norm", "self_attn.k_norm.weight", (("self_attn.k_norm.weight", "head_dim"),), ()),
)
DENSE_MLP_ROWS: tuple[Row, ...] = (
    ("mlp.gate_up_proj.weight", (("mlp.gate_proj.weight", "intermediate_size"),
                                 ("mlp.up_proj.weight", "intermediate_size")), ("hidden_size",)),
    ("mlp.down_proj.weight", (("mlp.down_proj.weight", "hidden_size"),), ("intermediate_size",)),
)
NORM_ROWS: tuple[Row, ...] = (
    ("input_layernorm.weight", (("input_layernorm.weight", "hidden_size"),), ()),
    ("post_attention_layernorm.weight", (("post_attention_layernorm.weight", "hidden_size"),), ()),
)


def moe_rows(num_experts: int) -> tuple[Row, ...]:
    """A Qwen3-MoE layer's sparse block, as SGLang's ``FusedMoE`` lays it out: expert e's
    ``[gate_e; up_e]`` are rows ``e * 2I .. (e + 1) * 2I`` of ``w13_weight``, its down
    projection rows ``e * H .. (e + 1) * H`` of ``w2_weight``; the checkpoint names each
    expert's tensors on their own (``mlp.experts.<e>.gate_proj.weight``)."""
    e = range(num_experts)
    return (
        ("mlp.gate.weight", (("mlp.gate.weight", "num_experts"),), ("hidden_size",)),
        ("mlp.experts.w13_weight", tuple(p for i in e for p in (
            (f"mlp.experts.{i}.gate_proj.weight", "intermediate_size"),
            (f"mlp.experts.{i}.up_proj.weight", "intermediate_size"))), ("hidden_size",)),
        ("mlp.experts.w2_weight", tuple((f"mlp.experts.{i}.down_proj.weight", "hidden_size") for i in e),
         ("intermediate_size",)),
    )


#: Outside the layers, in the order the engine's parameters are kept (and hashed).
HEAD_ROWS: tuple[Row, ...] = (
    ("model.embed_tokens.weight", (("model.embed_tokens.weight", "vocab_size"),), ("hidden_size",)),
)
TAIL_ROWS: tuple[Row, ...] = (
    ("model.norm.weight", (("model.norm.weight", "hidden_size"),), ()),
    ("lm_head.weight", (("lm_head.weight", "vocab_size"),), ("hidden_size",)),
)
#: With tied word embeddings: HF name -> the tensor that already holds it. Such a name is no
#: tensor of its own: a checkpoint leaves it out, and a sync must not send it.
TIED: Mapping[str, str] = MappingProxyType({"lm_head.weight": "model.embed_tokens.weight"})


#: The table. transformers 5 defaults: Qwen3Config's head_dim is 128 whatever the hidden
#: size; Qwen3-MoE's and Llama's follow hidden / heads. Qwen2 has no attention_bias field
#: (its q/k/v bias is always there).
ARCHS: Mapping[str, Arch] = MappingProxyType({a.model_type: a for a in (
    Arch(model_type="qwen2", hf_class="Qwen2ForCausalLM", qkv_bias=True, qk_norm=False,
         sglang="sglang/srt/models/qwen2.py"),
    Arch(model_type="qwen3", hf_class="Qwen3ForCausalLM", qkv_bias=False, qk_norm=True, default_head_dim=128,
         fixed={"attention_bias": False}, sglang="sglang/srt/models/qwen3.py"),
    Arch(model_type="llama", hf_class="LlamaForCausalLM", qkv_bias=False, qk_norm=False,
         fixed={"attention_bias": False, "mlp_bias": False}, sglang="sglang/srt/models/llama.py"),
    Arch(model_type="qwen3_moe", hf_class="Qwen3MoeForCausalLM", qkv_bias=False, qk_norm=True, moe=True,
         fixed={"attention_bias": False}),
)})

#: a config without a model_type is read as this: colo's own attribute configs (the
#: benchmark's, built without transformers) are Qwen2s that never named theirs
DEFAULT_MODEL_TYPE = "qwen2"


def supported() -> tuple[str, ...]:
    return tuple(ARCHS)


def config_field(config: Any, name: str, default: Any = None) -> Any:
    """A field of a transformers config, of its ``to_dict()``, or of a ``config.json`` read as a dict."""
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


def arch_of(config: Any, *, what: str = "config") -> Arch:
    """The architecture of ``config`` (an object with attributes or a mapping). Refused, as one
    :class:`~colo.core.errors.UnsupportedArchitecture` naming the model_type and what colo
    supports: a model_type not in :data:`ARCHS`, or values that add tensors the table lacks."""
    kind = config_field(config, "model_type", None) or DEFAULT_MODEL_TYPE
    arch = ARCHS.get(kind) if isinstance(kind, str) else None
    if arch is None:
        raise UnsupportedArchitecture(f"{what}: model_type {kind!r} is not an architecture colo supports; "
                                      f"supported: {', '.join(ARCHS)}")
    problems = arch.layout_problems(config)
    if problems:
        raise UnsupportedArchitecture(f"{what}: {kind} with " + "; ".join(problems))
    return arch


def head_dim_of(config: Any, arch: Arch | None = None) -> int:
    """The config's head_dim, else the architecture's default, else hidden_size // heads
    (what transformers' attention of each architecture computes)."""
    arch = arch or arch_of(config)
    given = config_field(config, "head_dim", None)
    if given:
        return given
    if arch.default_head_dim is not None:
        return arch.default_head_dim
    return config_field(config, "hidden_size") // config_field(config, "num_attention_heads")


def expand(tables: tuple[tuple[Row, ...], tuple[Row, ...], tuple[Row, ...]], sizes: Any, num_layers: int,
           *, tied: bool) -> Iterator[tuple[str, tuple[int, ...], tuple[tuple[str, int, tuple[int, ...]], ...]]]:
    """Every engine parameter of a model, in order: ``(name, shape, parts)``, each part
    ``(HF name, first row, HF shape)``. ``sizes`` answers the tables' size names as attributes
    (the engine's ``Dims``, a TP rank's own included); ``tied``: ``lm_head.weight`` is left out."""
    head, layer, tail = tables

    def rows(table: tuple[Row, ...], prefix: str):
        for suffix, parts, trailing in table:
            name = prefix + suffix
            if tied and name in TIED:
                continue
            tail_shape = tuple(getattr(sizes, a) for a in trailing)
            offset, out = 0, []
            for hf_suffix, rows_attr in parts:
                n = getattr(sizes, rows_attr)
                out.append((prefix + hf_suffix, offset, (n, *tail_shape)))
                offset += n
            yield name, (offset, *tail_shape), tuple(out)

    yield from rows(head, "")
    for i in range(num_layers):
        yield from rows(layer, f"model.layers.{i}.")
    yield from rows(tail, "")


@dataclass(frozen=True)
class Sizes:
    """The sizes the name tables read, from a config alone (no engine): a whole model's."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    head_dim: int
    q_rows: int
    kv_rows: int
    intermediate_size: int
    num_experts: int | None
    tied: bool


def sizes_of(config: Any, *, what: str = "config") -> Sizes:
    """The sizes of ``config`` the name tables read; a size that is not a positive integer is
    refused (``ValueError``) under the config's own name."""
    arch = arch_of(config, what=what)
    names = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "moe_intermediate_size" if arch.moe else "intermediate_size"]
    if arch.moe:
        names.append("num_experts")
    got = {n: config_field(config, n) for n in names}
    if arch.moe and got["num_experts"] is None:
        got["num_experts"] = config_field(config, "num_local_experts")
    for n, v in got.items():
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{what}: {n} must be a positive integer, got {v!r}")
    hd = head_dim_of(config, arch)
    if isinstance(hd, bool) or not isinstance(hd, int) or hd <= 0:
        raise ValueError(f"{what}: head_dim must be a positive integer, got {hd!r}")
    return Sizes(vocab_size=got["vocab_size"], hidden_size=got["hidden_size"], num_layers=got["num_hidden_layers"],
                 head_dim=hd, q_rows=got["num_attention_heads"] * hd, kv_rows=got["num_key_value_heads"] * hd,
                 intermediate_size=got["moe_intermediate_size" if arch.moe else "intermediate_size"],
                 num_experts=got.get("num_experts"), tied=bool(config_field(config, "tie_word_embeddings", False)))


def hf_shapes(config: Any, *, what: str = "config") -> dict[str, tuple[int, ...]]:
    """Every tensor of a Hugging Face checkpoint of ``config``: name -> shape, in the engine's
    order (a tied model has no ``lm_head.weight``)."""
    arch = arch_of(config, what=what)
    s = sizes_of(config, what=what)
    tables = (HEAD_ROWS, arch.layer_rows(s.num_experts), TAIL_ROWS)
    return {hf: shape for _, _, parts in expand(tables, s, s.num_layers, tied=s.tied) for hf, _, shape in parts}


__all__ = ["ARCHS", "Arch", "DEFAULT_MODEL_TYPE", "HEAD_ROWS", "Row", "Sizes", "TAIL_ROWS", "TIED", "arch_of",
           "config_field", "expand", "head_dim_of", "hf_shapes", "sizes_of", "supported"]
