"""What the LoRA adapter tests of every engine share (tests/vllm/test_lora.py against vLLM,
tests/engine/test_adapters.py against colo's engine): PEFT adapters with random A and B on a
copy of a base model, their tensors as PEFT saves them and transformers' merged model, and one
stage of an adapter through colo's packed transport."""

from __future__ import annotations

import copy

import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

from colo.models.lora import AdapterConfig
from colo.testing.trainers import StateTrainer

PROMPTS = [[1, 2, 3, 4], [5, 17, 300, 9, 11], [900, 4, 33]]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
#: small buckets: an adapter (the tiny model's, r=8 on every linear: 0.6 MB) in several requests
BUCKET = 64 << 10


def engine_build(config, base, tmp_path, *, device: str = "cpu", total_bytes: int = 64 << 20,
                 mem_fraction_static: float = 0.5) -> dict:
    """colo's engine of ``config`` started from ``base``'s weights (a checkpoint in ``tmp_path``), float32."""
    from colo.models.save import save_start

    ckpt = save_start("state", config, dict(base.named_parameters()), str(tmp_path))
    return {"config": config.to_dict(), "dtype": "float32", "device": device, "total_bytes": total_bytes,
            "mem_fraction_static": mem_fraction_static, "checkpoint": ckpt, "log_path": str(tmp_path / "engine.log")}


def adapter(base, *, seed: int, r: int = 8, targets=TARGETS):
    """A PEFT adapter on a copy of ``base`` with random A and B (B is zero when PEFT makes it:
    the adapter would change nothing); its tensors as PEFT saves them, and the merged model."""
    peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(targets),
                                                                  lora_dropout=0.0))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    state = {n: t.detach().clone().contiguous() for n, t in get_peft_model_state_dict(peft_model).items()}
    config = AdapterConfig.from_peft(peft_model.peft_config["default"])
    merged = copy.deepcopy(peft_model).merge_and_unload().eval()
    return state, config, merged




async def stage(engine, state, version, config, **kw):
    # the order the trainer sends in: the adapter's own (PEFT's state dict order)
    return await engine.stage_adapter(StateTrainer(state, **kw), version, config, bucket_bytes=BUCKET)
