"""Tiny random checkpoints of every dense architecture colo supports, made here (nothing is
downloaded): each case exercises what its architecture adds, and is saved by transformers'
own ``save_pretrained`` as a user's checkpoint would be.

- ``qwen2``: q/k/v bias, untied lm_head; ``qwen2-tied``: the embedding is the lm_head;
- ``qwen3``: per-head q/k RMSNorm, no bias, a head_dim of its own (32 x 4 heads = 128 rows
  of q against a hidden size of 64 or 256: a map that assumed hidden / heads would fail);
- ``llama``: no bias, no q/k norm.

Every tensor is perturbed after transformers' initialisation (which sets norms to 1 and
biases to 0): a norm or bias loaded into the wrong place then changes the logits.
"""

from __future__ import annotations

import torch

#: CPU-test size: 2 layers, GQA 4/2
TINY = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, max_position_embeddings=64)
#: vLLM's size (the demo's): vLLM's CPU attention takes head_dim 32, 64, 80, ... only
VLLM = dict(vocab_size=1024, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=512, max_position_embeddings=256)
#: name -> (model_type, the fields that make it that case)
CASES = {
    "qwen2": ("qwen2", {}),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3": ("qwen3", {"head_dim": 32}),
    "llama": ("llama", {}),
}


def tiny_config(case: str, **sizes):
    """The config of ``case`` at ``sizes`` (default :data:`TINY`)."""
    from colo.trainers.models import demo_config

    model_type, fields = CASES[case]
    return demo_config(model_type, **{**TINY, **sizes, **fields})


def perturbed_model(config, seed: int):
    """transformers' model of ``config`` (its own class), every tensor moved off its init."""
    from colo.trainers.models import build_trainer_model, trained_stand_in

    return trained_stand_in(build_trainer_model(config, seed).eval(), seed)


def save_checkpoint(path, config, seed: int):
    """A checkpoint directory of ``config`` (config.json + model.safetensors, float32); the model."""
    model = perturbed_model(config, seed)
    model.save_pretrained(path)
    return model
