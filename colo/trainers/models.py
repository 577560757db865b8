"""The trainer's model: a user's checkpoint, or a small one built in code (no downloads).

A checkpoint is a local Hugging Face directory (:func:`load_trainer_model`: transformers'
``from_pretrained`` of it, nothing downloaded); without one the demo's small Qwen2 is
built at random from a config (:func:`build_trainer_model`). Either way the model is
transformers' own class for the architecture (``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``,
``LlamaForCausalLM``, ... as :mod:`colo.models.arch` names it), so the name map and
shard offsets the engines' loaders apply are exercised against the real trainer layout
rather than a copy of it. The engine (``colo.engine.reference.model``) implements the same math
with fused parameters.
"""

from __future__ import annotations

from typing import Any

import torch

# transformers is imported where a config or model is built: the size tables here are read
# by the benchmark without it (a spawned peer process re-imports its parent's modules)

#: Sized so that one CPU forward + backward + AdamW step on a batch of
#: 32 sequences x 32 tokens takes about 0.15 s on 2 cores (torch 2.13, sdpa):
#: the demo loop stays interactive with a real optimizer step per RL step.
DEMO_DEFAULTS: dict[str, Any] = {
    "vocab_size": 1024,
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # GQA: the engine's qkv_proj has unequal q and kv row blocks
    "intermediate_size": 512,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,  # untied lm_head; the engine takes tied models too
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "attn_implementation": "sdpa",
}

#: Named demo sizes (``colo demo --model NAME``): overrides of ``DEMO_DEFAULTS``.
#: ``qwen2-1.5b`` is Qwen2-1.5B's shapes (random weights, no download): a trainer
#: of 1.54 B float32 parameters with AdamW holds ~18.5 GB resident and peaks
#: near 30 GB in its step, a real share of one H100 or H200 where the choice of
#: mem_fraction_static matters. Its context is cut to 4096 positions: the engine
#: must hold one sequence of maximum length, and the demo's are 32 tokens.
#: Qwen2-7B's shapes (untied lm_head), for the benchmarks: too large for the demo's fp32 trainer
QWEN2_7B: dict[str, Any] = dict(vocab_size=152064, hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                                num_key_value_heads=4, intermediate_size=18944, max_position_embeddings=4096)
DEMO_MODELS: dict[str, dict[str, Any]] = {
    "demo": {},
    "qwen2-1.5b": dict(vocab_size=151936, hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                       num_key_value_heads=2, intermediate_size=8960, max_position_embeddings=4096,
                       tie_word_embeddings=True, rope_theta=1000000.0),
}


def demo_model_config(name: str) -> Any:
    """The config of a named demo size (:data:`DEMO_MODELS`)."""
    if name not in DEMO_MODELS:
        raise ValueError(f"unknown demo model {name!r}; expected one of {', '.join(DEMO_MODELS)}")
    return demo_config(**DEMO_MODELS[name])


# Keys a config takes as constructor arguments without keeping an attribute of the
# same name (transformers 5 moves them into rope_parameters / a private slot).
_CONSTRUCTOR_ONLY = {"rope_theta", "attn_implementation"}


def demo_config(model_type: str = "qwen2", **overrides: Any) -> Any:
    """The demo's config, a Qwen2 by default; ``model_type`` another dense architecture of
    :mod:`colo.models.arch` of the same sizes (a Qwen3's head_dim is its own field, 128
    unless ``head_dim=`` says otherwise); ``overrides`` replace single fields (tests shrink it).

    Unknown keys are refused: a transformers config would silently keep them as
    attributes and a misspelt override would have no effect.
    """
    from transformers import CONFIG_MAPPING

    from colo.models.arch import arch_of

    if arch_of({"model_type": model_type}, what="demo_config").moe:
        raise ValueError(f"demo_config builds dense models; {model_type} is a MoE: use moe_model_config")
    cls = CONFIG_MAPPING[model_type]
    known = set(vars(cls()))
    unknown = sorted(k for k in overrides if k not in known and k not in _CONSTRUCTOR_ONLY)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} field(s) {', '.join(map(repr, unknown))}; "
                         f"expected fields of transformers.{cls.__name__} such as {', '.join(DEMO_DEFAULTS)}")
    return cls(**{**DEMO_DEFAULTS, **overrides})


def model_class(config: Any) -> type:
    """transformers' causal-LM class of ``config``'s architecture (the table's ``hf_class``);
    an architecture colo does not have is refused (``UnsupportedArchitecture``)."""
    import transformers

    from colo.models.arch import arch_of

    return getattr(transformers, arch_of(config).hf_class)


def build_trainer_model(config: Any, seed: int) -> Any:
    """A float32, randomly initialised model of ``config``'s architecture (transformers'
    own class for it), identical for equal seeds.

    The initialisation draws from a forked RNG so building a model neither
    depends on nor disturbs the caller's global random state.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    cls = model_class(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
    return model.to(torch.float32)


def trained_stand_in(model: Any, seed: int) -> Any:
    """``model`` with every weight moved off transformers' initialisation, in place: seeded
    normal noise of std 0.05 (0.1 on norms and biases), drawn from a forked RNG.

    A stand-in for a trained model where one is needed and none is given. At its
    initialisation (std 0.02, norms 1) a model's logits are all nearly equal, and the final
    norm bounds the hidden state: with its output layer frozen, no change to the layers below
    moves the demo task's reward much above chance (about 0.19 of 1, measured: a rank-8
    adapter reached 0.15 in 30 steps). A LoRA adapter adapts a trained model; moved off its
    init, the same model's adapter reached 1.0 in 20 steps."""
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        g = torch.Generator().manual_seed(seed + 1000)
        for name, p in model.named_parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * (0.1 if "norm" in name or "bias" in name
                                                                        else 0.05))
    return model


def checkpoint_config(path: Any) -> Any:
    """The transformers config of the local checkpoint at ``path``, once the directory is
    checked (:func:`colo.models.checkpoint.inspect`: it exists, has ``config.json``, is an
    architecture colo has, and its safetensors hold exactly that config's tensors)."""
    from transformers import AutoConfig

    from colo.models.checkpoint import inspect

    ckpt = inspect(path)
    return AutoConfig.from_pretrained(ckpt.path, local_files_only=True)


def load_trainer_model(path: Any) -> Any:
    """The model of the local checkpoint at ``path`` (transformers' ``from_pretrained``, local
    files only), in float32, checked first as :func:`checkpoint_config` checks it. A tensor
    transformers did not load from the files (it would initialise it at random and only log
    it), one it did not use, or one of another shape is refused (``CheckpointError``)."""
    from colo.core.errors import CheckpointError
    from colo.models.checkpoint import inspect

    ckpt = inspect(path)
    cls = model_class(ckpt.config)
    try:
        model, info = cls.from_pretrained(ckpt.path, local_files_only=True, dtype=torch.float32,
                                          attn_implementation="sdpa", output_loading_info=True)
    except (OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"checkpoint {ckpt.path!r}: transformers could not load it: "
                              + " ".join(str(e).split())) from None
    wrong = {k: list(v) for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys")
             and v}
    if wrong:
        raise CheckpointError(f"checkpoint {ckpt.path!r}: transformers' {cls.__name__} did not load it whole: "
                              + "; ".join(f"{k.replace('_', ' ')} {v[:4]}" for k, v in wrong.items()))
    return model.to(torch.float32)


def initial_model(model_config: Any, seed: int, checkpoint: Any) -> Any:
    """A trainer's starting model: the checkpoint's (``checkpoint``, a local directory), else
    one of ``model_config`` initialised at random from ``seed``."""
    if checkpoint is not None:
        return load_trainer_model(checkpoint)
    return build_trainer_model(model_config, seed)


# -- a Qwen3-MoE shape (issue 15) -----------------------------------------------------

#: Named Qwen3-MoE shapes, as ``transformers.Qwen3MoeConfig`` fields (random weights, no
#: download). ``qwen3-30b-a3b`` is Qwen3-30B-A3B's published config.json: 48 layers, hidden
#: 2048, 128 experts of intermediate 768, 8 routed per token with the top-k renormalised,
#: grouped-query attention 32/4 with head_dim 128 (not hidden / heads), q/k RMSNorm, no
#: attention bias, untied lm_head; every layer sparse. ``intermediate_size`` (6144) is the
#: dense MLP's, which no layer of it has. Its context is cut to 4096 positions (an engine
#: holds one sequence of maximum length; the benchmark never generates).
#: ``qwen3-moe-tiny`` has the same structure (head_dim over hidden / heads, GQA, 8 experts
#: top-2) at CPU-test size.
#: what both shapes share: Qwen3-MoE's sparse block in every layer, no bias, untied
_QWEN3_MOE = dict(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6,
                  tie_word_embeddings=False, hidden_act="silu", attention_bias=False)
MOE_MODELS: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b": dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768,
                          num_experts=128, num_experts_per_tok=8, max_position_embeddings=4096,
                          rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, **_QWEN3_MOE),
    "qwen3-moe-tiny": dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, intermediate_size=48, moe_intermediate_size=8,
                           num_experts=8, num_experts_per_tok=2, max_position_embeddings=64,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **_QWEN3_MOE),
}


def moe_model_config(name: str, **overrides: Any) -> Any:
    """A ``transformers.Qwen3MoeConfig`` of a named MoE shape (:data:`MOE_MODELS`);
    ``overrides`` replace fields (``num_hidden_layers=4``: the 2-GPU rehearsal)."""
    from transformers import Qwen3MoeConfig

    if name not in MOE_MODELS:
        raise ValueError(f"unknown MoE model {name!r}; expected one of {', '.join(MOE_MODELS)}")
    fields = {**MOE_MODELS[name], **overrides}
    unknown = sorted(set(fields) - set(MOE_MODELS[name]))
    if unknown:
        raise ValueError(f"unknown Qwen3MoeConfig field(s) {', '.join(map(repr, unknown))}; "
                         f"expected some of {', '.join(MOE_MODELS[name])}")
    return Qwen3MoeConfig(**fields)


def config_from_dict(d: dict[str, Any]) -> Any:
    """The transformers config a ``to_dict()`` came from, of the class its ``model_type`` names
    (an architecture of :mod:`colo.models.arch`; none named: Qwen2, colo's own configs)."""
    from transformers import CONFIG_MAPPING

    from colo.models.arch import arch_of

    return CONFIG_MAPPING[arch_of(d).model_type](**d)


def moe_checkpoint_names(config: Any) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor of a Qwen3-MoE Hugging Face checkpoint, experts one by one
    (``mlp.experts.<e>.gate_proj.weight``): what SGLang's loader and a Megatron
    extractor speak. transformers fuses the experts only when it loads such a checkpoint
    (its ``conversion_mapping``); ``tests/engine/test_moe.py`` loads exactly these names into
    ``Qwen3MoeForCausalLM`` with nothing missing or unexpected."""
    h, hd = config.hidden_size, config.head_dim
    q, kv, inter = config.num_attention_heads * hd, config.num_key_value_heads * hd, config.moe_intermediate_size
    out = [("model.embed_tokens.weight", (config.vocab_size, h))]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (q, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, q)),
                (p + "self_attn.q_norm.weight", (hd,)), (p + "self_attn.k_norm.weight", (hd,)),
                (p + "mlp.gate.weight", (config.num_experts, h))]
        for e in range(config.num_experts):
            out += [(p + f"mlp.experts.{e}.gate_proj.weight", (inter, h)),
                    (p + f"mlp.experts.{e}.up_proj.weight", (inter, h)),
                    (p + f"mlp.experts.{e}.down_proj.weight", (h, inter))]
        out += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
    out.append(("model.norm.weight", (h,)))
    if not config.tie_word_embeddings:
        out.append(("lm_head.weight", (config.vocab_size, h)))
    return out


def moe_checkpoint_state(config: Any, seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Random weights for every name of :func:`moe_checkpoint_names`, identical for equal seeds:
    matrices ~ N(0, 0.02) (transformers' initializer_range), norms 1 + N(0, 0.1) so that
    they carry information too. Drawn from a forked RNG (the caller's state is untouched)."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    out = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for name, shape in moe_checkpoint_names(config):
            if name.endswith("norm.weight"):
                t = 1.0 + 0.1 * torch.randn(shape)
            elif name.endswith("mlp.gate.weight"):
                # a router that prefers experts clearly: near-ties in the top-k would make
                # the expert choice depend on rounding, in a test comparing two implementations
                t = 0.5 * torch.randn(shape)
            else:
                t = 0.02 * torch.randn(shape)
            out[name] = t.to(dtype)
    return out
