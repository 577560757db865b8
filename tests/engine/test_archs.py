"""colo's own engine on every dense architecture of the table (Qwen2 tied and untied, Qwen3,
Llama) against transformers' own ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` /
``LlamaForCausalLM`` on the same weights, on the CPU (tests/engine/test_core.py goes deeper
on a Qwen2; tests/engine/test_tp.py runs these architectures at TP=2)."""

from __future__ import annotations

import copy

import pytest
import torch

from colo.engine.reference.core import EngineCore
from colo.engine.reference.dims import Dims
from colo.engine.reference.server import model_config
from colo.engine.reference.weights import expected_digest, expected_hf_specs
from tests.archs import CASES, perturbed_model, tiny_config

MiB = 1 << 20


@pytest.fixture(scope="module")
def models():
    return {case: perturbed_model(tiny_config(case), seed=i) for i, case in enumerate(sorted(CASES))}


def probe(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (3, 20), generator=torch.Generator().manual_seed(5))


def core_of(model, dtype=torch.float32):
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    return EngineCore(model.config, dtype=dtype, device="cpu", total_bytes=8 * MiB, mem_fraction_static=0.5,
                      init_state=state), state


def hf_greedy(model, prompts: torch.Tensor, n: int) -> torch.Tensor:
    ids = prompts
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return ids[:, prompts.shape[1]:]


@pytest.mark.parametrize("case", sorted(CASES))
def test_float32_logits_and_greedy_tokens_equal_transformers(models, case):
    model = models[case]
    core, state = core_of(model)
    tokens = probe(model.config.vocab_size)
    with torch.no_grad():
        want = model(tokens).logits.float()
    # the same math in the same precision (measured bit-identical on torch 2.13's CPU kernels)
    torch.testing.assert_close(core.logits(tokens), want, rtol=1e-4, atol=1e-5)
    assert float(want.abs().max()) > 0.1
    got, _ = core.generate(tokens[:, :6], 10, temperature=0.0, generator=torch.Generator())
    assert torch.equal(got, hf_greedy(model, tokens[:, :6], 10))
    assert core.digest() == expected_digest(state, model.config, torch.float32)
    assert [s.name for s in core.param_specs()] == [s.name for s in expected_hf_specs(model.config, torch.float32)]


@pytest.mark.parametrize("case", ["qwen3", "llama"])
def test_bfloat16_logits_are_within_bfloat16_error_of_transformers(models, case):
    model = models[case]
    core, state = core_of(model, torch.bfloat16)
    tokens = probe(model.config.vocab_size)
    with torch.no_grad():
        ref = model(tokens).logits.float()
        ref_bf16 = copy.deepcopy(model).to(torch.bfloat16)(tokens).logits.float()
    scale = float(ref.abs().max())
    # test_core.py's bound: 3% of the largest logit, the size of transformers' own bf16 error
    assert float((core.logits(tokens) - ref).abs().max()) <= 0.03 * scale
    assert float((ref_bf16 - ref).abs().max()) > 0.001 * scale
    assert core.digest() == expected_digest(state, model.config, torch.bfloat16)


def test_a_misplaced_q_norm_changes_the_logits(models):
    """The q/k norms are read: swapping them (both [head_dim]) moves Qwen3's logits."""
    model = models["qwen3"]
    core, state = core_of(model)
    tokens = probe(model.config.vocab_size)
    before = core.logits(tokens)
    swapped = dict(state)
    layer = "model.layers.0.self_attn."
    swapped[layer + "q_norm.weight"], swapped[layer + "k_norm.weight"] = state[layer + "k_norm.weight"], \
        state[layer + "q_norm.weight"]
    core.begin_load()
    core.load_weights(swapped)
    core.end_load()
    assert float((core.logits(tokens) - before).abs().max()) > 1e-3


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_engine_process_reads_the_same_model_from_the_sent_dict(case):
    config = tiny_config(case)
    dims = Dims.from_config(model_config(config.to_dict()))
    assert dims == Dims.from_config(config) and dims.model_type == config.model_type
    assert dims.head_dim == (32 if case == "qwen3" else 16)
    assert (dims.qkv_bias, dims.qk_norm) == {"qwen2": (True, False), "qwen3": (False, True),
                                             "llama": (False, False)}[config.model_type]


def test_a_sync_of_another_architectures_names_is_refused_naming_them(models):
    """A trainer of one architecture syncing into an engine of another (shapes and names differ):
    preflight lists every name, and the engine keeps its weights."""
    from colo.core.errors import WeightMismatch

    core, _ = core_of(models["qwen3"])
    tokens = probe(128)
    before = core.logits(tokens)
    llama = expected_hf_specs(models["llama"].config, torch.float32)
    with pytest.raises(WeightMismatch) as e:
        core.preflight(llama)
    text = str(e.value)
    assert "model.layers.0.self_attn.q_norm.weight" in text  # missing
    assert "model.layers.0.self_attn.q_proj.weight (64, 64) (expected (128, 64))" in text  # wrong shape
    assert torch.equal(core.logits(tokens), before) and core.weight_version == 0
