"""What a LoRA adapter is, by name and shape (colo.models.lora), against the models' own
linear layers: transformers' modules of each architecture. PEFT's own names and shapes are
checked against these in tests/vllm/test_lora.py (PEFT is installed in vLLM's environment)."""

from __future__ import annotations

import pytest

from colo.models.lora import PEFT_PREFIX, TARGETS, AdapterConfig, adapter_bytes, adapter_shapes
from tests.archs import tiny_config


@pytest.mark.parametrize("case", ["qwen2", "qwen2-tied", "qwen3", "llama"])
def test_every_targeted_linear_has_an_A_of_r_rows_and_a_B_of_r_columns(case):
    from colo.trainers.models import build_trainer_model

    config = tiny_config(case)
    model = build_trainer_model(config, seed=0)
    linears = {n: tuple(m.weight.shape) for n, m in model.named_modules()
               if type(m).__name__ == "Linear" and n.split(".")[-1] in ("q_proj", "v_proj", "down_proj")}
    shapes = adapter_shapes(config, AdapterConfig(r=4, alpha=8, targets=("q_proj", "v_proj", "down_proj")))
    assert len(shapes) == 2 * len(linears) == 2 * 3 * config.num_hidden_layers
    for module, (rows, cols) in linears.items():
        assert shapes[f"{PEFT_PREFIX}{module}.lora_A.weight"] == (4, cols)
        assert shapes[f"{PEFT_PREFIX}{module}.lora_B.weight"] == (rows, 4)
    # layer by layer, A before B
    names = list(shapes)
    assert names[0].endswith("layers.0.self_attn.q_proj.lora_A.weight")
    assert names[1].endswith("layers.0.self_attn.q_proj.lora_B.weight")
    assert adapter_bytes(shapes.values(), 4) == 4 * sum(a * b for a, b in shapes.values())


def test_a_moe_model_is_refused():
    from transformers import Qwen3MoeConfig

    moe = Qwen3MoeConfig(vocab_size=128, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, num_experts=4,
                         num_experts_per_tok=2)
    with pytest.raises(ValueError, match="MoE"):
        adapter_shapes(moe, AdapterConfig(r=4, alpha=8, targets=("q_proj",)))


@pytest.mark.parametrize("bad, match", [
    (dict(r=0), "rank r must be an integer"), (dict(r=True), "rank r must be an integer"),
    (dict(r=1024), "rank r must be an integer in \\[1, 512\\]"), (dict(alpha=0), "alpha must be a finite positive"),
    (dict(alpha=float("inf")), "alpha must be a finite positive"), (dict(targets=()), "non-empty tuple"),
    (dict(targets="q_proj"), "non-empty tuple"), (dict(targets=("embed_tokens",)), "not layers"),
    (dict(targets=("q_proj", "q_proj")), "twice"),
])
def test_a_bad_config_is_refused_naming_the_setting(bad, match):
    with pytest.raises(ValueError, match=match):
        AdapterConfig(**{"r": 8, "alpha": 16.0, "targets": ("q_proj",), **bad})


def test_peft_settings_this_format_cannot_carry_are_refused_and_the_rest_read():
    base = {"r": 8, "lora_alpha": 16, "target_modules": ["v_proj", "q_proj"], "bias": "none",
            "use_dora": False, "use_rslora": False, "modules_to_save": None, "rank_pattern": {}}
    config = AdapterConfig.from_peft(base)
    assert config == AdapterConfig(r=8, alpha=16, targets=("q_proj", "v_proj"))  # in the models' order
    assert AdapterConfig.from_json(config.to_json()) == config
    for key, value in (("use_dora", True), ("use_rslora", True), ("bias", "all"), ("modules_to_save", ["lm_head"]),
                       ("rank_pattern", {"q_proj": 4})):
        with pytest.raises(ValueError, match=f"{key}="):
            AdapterConfig.from_peft({**base, key: value})
    with pytest.raises(ValueError, match="target_modules must list"):
        AdapterConfig.from_peft({**base, "target_modules": "all-linear"})
    with pytest.raises(ValueError, match="an adapter config is"):
        AdapterConfig.from_json({"r": 8})
    assert set(TARGETS) >= set(config.peft_dict()["target_modules"])
