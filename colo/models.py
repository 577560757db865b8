"""The reference trainer model: a small Qwen2 built in code, no downloads.

The engine (``colo.engine.model``) implements the same math with fused
parameters; the trainer side is the stock Hugging Face ``Qwen2ForCausalLM``, so
the name map and shard offsets the engine's loader applies are exercised
against the real trainer layout rather than a copy of it.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

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
DEMO_MODELS: dict[str, dict[str, Any]] = {
    "demo": {},
    "qwen2-1.5b": dict(vocab_size=151936, hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                       num_key_value_heads=2, intermediate_size=8960, max_position_embeddings=4096,
                       tie_word_embeddings=True, rope_theta=1000000.0),
}


def demo_model_config(name: str) -> Qwen2Config:
    """The config of a named demo size (:data:`DEMO_MODELS`)."""
    if name not in DEMO_MODELS:
        raise ValueError(f"unknown demo model {name!r}; expected one of {', '.join(DEMO_MODELS)}")
    return demo_config(**DEMO_MODELS[name])


# Keys Qwen2Config takes as constructor arguments without keeping an attribute
# of the same name (transformers 5 moves them into rope_parameters / a private slot).
_CONSTRUCTOR_ONLY = {"rope_theta", "attn_implementation"}


def demo_config(**overrides: Any) -> Qwen2Config:
    """The demo's Qwen2 config; ``overrides`` replace single fields (tests shrink it).

    Unknown keys are refused: ``Qwen2Config`` would silently keep them as
    attributes and a misspelt override would have no effect.
    """
    known = set(vars(Qwen2Config()))
    unknown = sorted(k for k in overrides if k not in known and k not in _CONSTRUCTOR_ONLY)
    if unknown:
        raise ValueError(f"unknown Qwen2Config field(s) {', '.join(map(repr, unknown))}; "
                         f"expected fields of transformers.Qwen2Config such as {', '.join(DEMO_DEFAULTS)}")
    return Qwen2Config(**{**DEMO_DEFAULTS, **overrides})


def build_trainer_model(config: Qwen2Config, seed: int) -> Qwen2ForCausalLM:
    """A float32, randomly initialised ``Qwen2ForCausalLM``, identical for equal seeds.

    The initialisation draws from a forked RNG so building a model neither
    depends on nor disturbs the caller's global random state.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    return model.to(torch.float32)
