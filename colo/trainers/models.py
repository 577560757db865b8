"""The reference trainer model: a small Qwen2 built in code, no downloads.

The engine (``colo.engine.model``) implements the same math with fused
parameters; the trainer side is the stock Hugging Face ``Qwen2ForCausalLM``, so
the name map and shard offsets the engine's loader applies are exercised
against the real trainer layout rather than a copy of it.
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


# Keys Qwen2Config takes as constructor arguments without keeping an attribute
# of the same name (transformers 5 moves them into rope_parameters / a private slot).
_CONSTRUCTOR_ONLY = {"rope_theta", "attn_implementation"}


def demo_config(**overrides: Any) -> Any:
    """The demo's Qwen2 config; ``overrides`` replace single fields (tests shrink it).

    Unknown keys are refused: ``Qwen2Config`` would silently keep them as
    attributes and a misspelt override would have no effect.
    """
    from transformers import Qwen2Config

    known = set(vars(Qwen2Config()))
    unknown = sorted(k for k in overrides if k not in known and k not in _CONSTRUCTOR_ONLY)
    if unknown:
        raise ValueError(f"unknown Qwen2Config field(s) {', '.join(map(repr, unknown))}; "
                         f"expected fields of transformers.Qwen2Config such as {', '.join(DEMO_DEFAULTS)}")
    return Qwen2Config(**{**DEMO_DEFAULTS, **overrides})


def build_trainer_model(config: Any, seed: int) -> Any:
    """A float32, randomly initialised ``Qwen2ForCausalLM``, identical for equal seeds.

    The initialisation draws from a forked RNG so building a model neither
    depends on nor disturbs the caller's global random state.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    from transformers import Qwen2ForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    return model.to(torch.float32)


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
    """The transformers config a ``to_dict()`` came from: Qwen3-MoE by its ``model_type``, else Qwen2."""
    if d.get("model_type") == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(**d)
    from transformers import Qwen2Config

    return Qwen2Config(**d)


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
