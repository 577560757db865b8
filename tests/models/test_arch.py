"""The architecture table (colo.models.arch) against transformers' own models: the names and
shapes it gives are exactly each model's parameters, and what it does not describe is refused."""

from __future__ import annotations

import pytest

from colo.core.errors import BadInput, UnsupportedArchitecture
from colo.models.arch import ARCHS, arch_of, head_dim_of, hf_shapes
from tests.archs import CASES, tiny_config


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_tables_names_and_shapes_are_transformers_parameters(case):
    from colo.trainers.models import build_trainer_model

    config = tiny_config(case)
    model = build_trainer_model(config, 0)
    want = {n: tuple(p.shape) for n, p in model.named_parameters()}  # a tied lm_head listed once
    assert hf_shapes(config) == want
    # and from the config as config.json holds it (a dict, no transformers)
    assert hf_shapes(config.to_dict()) == want


def test_what_each_architecture_adds_is_in_its_row():
    shapes = {case: hf_shapes(tiny_config(case)) for case in CASES}
    layer = "model.layers.1.self_attn."
    assert shapes["qwen2"][layer + "q_proj.bias"] == (64,) and layer + "q_norm.weight" not in shapes["qwen2"]
    assert shapes["qwen3"][layer + "q_norm.weight"] == (32,) and layer + "q_proj.bias" not in shapes["qwen3"]
    # Qwen3's own head_dim: q has 4 x 32 rows against a hidden size of 64, o_proj the transpose
    assert shapes["qwen3"][layer + "q_proj.weight"] == (128, 64)
    assert shapes["qwen3"][layer + "o_proj.weight"] == (64, 128)
    assert not any("bias" in n or "q_norm" in n for n in shapes["llama"])
    assert "lm_head.weight" in shapes["qwen2"] and "lm_head.weight" not in shapes["qwen2-tied"]


def test_qwen3s_head_dim_defaults_to_128_as_transformers_does():
    d = tiny_config("qwen3").to_dict()
    del d["head_dim"]
    assert head_dim_of(d) == 128 and hf_shapes(d)["model.layers.0.self_attn.q_proj.weight"] == (512, 64)
    llama = tiny_config("llama").to_dict()
    llama["head_dim"] = None
    assert head_dim_of(llama) == 16  # hidden / heads


def test_the_moe_table_is_the_moe_checkpoints_names():
    from colo.trainers.models import moe_checkpoint_names, moe_model_config

    config = moe_model_config("qwen3-moe-tiny")
    assert hf_shapes(config) == dict(moe_checkpoint_names(config))


def test_an_architecture_not_in_the_table_is_refused_naming_it_and_the_supported_ones():
    from transformers import GPT2Config, MistralConfig

    for config in (GPT2Config(), MistralConfig(), {"model_type": "gemma3"}):
        with pytest.raises(UnsupportedArchitecture) as e:
            arch_of(config)
        kind = config["model_type"] if isinstance(config, dict) else config.model_type
        assert f"model_type {kind!r} is not an architecture colo supports; supported: qwen2, qwen3, llama, " \
               "qwen3_moe" in str(e.value)
        assert isinstance(e.value, BadInput) and isinstance(e.value, ValueError) and e.value.exit_code == 2


@pytest.mark.parametrize("case, field", [("llama", "attention_bias"), ("llama", "mlp_bias"), ("qwen3", "attention_bias")])
def test_values_that_add_tensors_the_table_lacks_are_refused(case, field):
    with pytest.raises(UnsupportedArchitecture, match=f"{field}=True .colo takes {CASES[case][0]} with {field}=False"):
        arch_of(tiny_config(case, **{field: True}))


def test_every_engine_sees_the_same_table():
    """colo's engine map, SGLang's preflight, the spec lists apps build and the checkpoint
    check read one table."""
    from colo.engine.sglang import SglangModel
    from colo.engine.reference.weights import expected_hf_specs
    from colo.models.specs import hf_specs

    for case in CASES:
        config = tiny_config(case)
        want = hf_shapes(config)
        assert {s.name: s.shape for s in expected_hf_specs(config)} == want
        assert hf_specs(config, "bfloat16") == expected_hf_specs(config)
        assert SglangModel(config).shapes == want
        assert ARCHS[config.model_type].sglang.endswith(f"/{config.model_type}.py")


def test_colos_engine_refuses_what_the_table_lacks():
    from transformers import GPT2Config

    from colo.engine.reference.core import EngineCore
    from colo.engine.sglang import SglangModel

    with pytest.raises(UnsupportedArchitecture, match="'gpt2'"):
        EngineCore(GPT2Config(), dtype="float32", device="cpu", total_bytes=8 << 20, mem_fraction_static=0.5)
    with pytest.raises(UnsupportedArchitecture, match="mlp_bias=True"):
        SglangModel(tiny_config("llama", mlp_bias=True))


def test_the_docs_table_is_the_architecture_table():
    """docs/trainers-and-formats.md lists every row of ARCHS with its values (and nothing else)."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "trainers-and-formats.md").read_text()
    rows = {}
    for line in doc.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 7 and cells[0].startswith("`") and cells[0].strip("`") in ARCHS:
            rows[cells[0].strip("`")] = cells
    assert sorted(rows) == sorted(ARCHS)
    for kind, (_, cls, bias, norm, head_dim, fixed, sglang) in rows.items():
        a = ARCHS[kind]
        assert cls == f"`{a.hf_class}`"
        assert (bias, norm) == ("yes" if a.qkv_bias else "no", "yes" if a.qk_norm else "no")
        assert head_dim == (str(a.default_head_dim) if a.default_head_dim else "hidden / heads")
        assert fixed == ", ".join(f"`{k}={v}`" for k, v in a.fixed.items())
        assert sglang == (f"`{a.sglang}`" if a.sglang else "none")
