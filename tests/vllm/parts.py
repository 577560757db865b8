"""What the real-vLLM tests compare against: transformers on the same weights."""

from __future__ import annotations

import torch

#: what vLLM needs on these CPUs (see the README's vLLM section); a test may add to them
LLM_ARGS = dict(skip_tokenizer_init=True, enforce_eager=True, dtype="float32", max_model_len=256, max_num_seqs=8,
                seed=0, gpu_memory_utilization=0.2, block_size=32)


def save_model(path, *, seed: int, **overrides):
    """A tiny Qwen2 (the demo's shape) saved as vLLM loads it: config.json and safetensors, fp32."""
    from colo.trainers.models import build_trainer_model, demo_config

    model = build_trainer_model(demo_config(**overrides), seed=seed)
    model.save_pretrained(path, safe_serialization=True)
    return model


def greedy(model, prompts, n: int) -> list[list[int]]:
    """transformers' greedy tokens, step by step (no end-of-sequence stop, as colo asks vLLM)."""
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            for _ in range(n):
                ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
            out.append(ids[0, len(p):].tolist())
    return out


def hf_logprobs(model, tokens) -> list[list[float]]:
    with torch.no_grad():
        out = []
        for seq in tokens:
            ls = torch.log_softmax(model(torch.tensor([seq])).logits[0], -1)
            out.append([float(ls[i - 1, t]) for i, t in enumerate(seq) if i >= 1])
        return out
