"""LoRA adapters into colo's own engine (issue 43), in its own process through the packed
transport: each version staged, then served once activated. The ground truth is PEFT and
transformers: with each adapter the engine's logits equal transformers' on the PEFT-merged
model (float32) and its greedy tokens are the merged model's; the base model beside it is
untouched. A stage that fails mid-transfer leaves the active version serving; versions kept
stay loaded and older ones go; a version is staged once; what the engine cannot take is refused
before a byte moves. (vLLM's: tests/vllm/test_lora.py, the same cases.)"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")

from colo.core.errors import EngineError, EngineStateError  # noqa: E402
from colo.digest import expected_weights_digest  # noqa: E402
from colo.engine.reference.client import EngineClient  # noqa: E402
from colo.models.lora import adapter_shapes  # noqa: E402
from colo.tasks import make_task  # noqa: E402
from tests.archs import VLLM, perturbed_model, tiny_config  # noqa: E402
from tests.lora_parts import PROMPTS, adapter, engine_build, stage  # noqa: E402
from tests.vllm.parts import greedy  # noqa: E402


@pytest.fixture(params=["qwen2", "llama", "qwen3"])
async def served(request, tmp_path):
    config = tiny_config(request.param, **VLLM)
    base = perturbed_model(config, seed=5)
    engine = await EngineClient.spawn(engine_build(config, base, tmp_path))
    try:
        yield engine, base
    finally:
        await engine.aclose()


def hf_logits(model, tokens) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model(torch.tensor([t])).logits for t in tokens]).float()


def assert_close(got, want) -> None:
    """Within the demo's float32 probe bound (FP32_LOGIT_TOLERANCE, 1e-3 of the largest logit):
    ``W x + B (A x)`` and the merged ``(W + B A) x`` round in another order."""
    got, want = torch.as_tensor(got).float(), torch.as_tensor(want).float()
    assert got.shape == want.shape
    err, bound = float((got - want).abs().max()), 1e-3 * float(want.abs().max())
    assert err <= bound, (err, bound)


async def test_each_adapter_serves_what_transformers_serves_on_the_merged_model(served):
    engine, base = served
    probe = [PROMPTS[0] * 2]
    base_logits = torch.tensor(await engine.logits(probe, adapter=None))
    assert_close(base_logits, hf_logits(base, probe))
    for version in (1, 2, 3):
        state, config, merged = adapter(base, seed=10 + version)
        got = await stage(engine, state, version, config)
        assert got == expected_weights_digest(state, list(adapter_shapes(base.config, config)), torch.float32)
        assert engine.active_adapter == (version - 1 or None)  # staged, not active
        await engine.activate_adapter(version, digest=got)
        assert_close(await engine.logits(probe, adapter=engine.active_adapter), hf_logits(merged, probe))
        assert not torch.allclose(torch.tensor(await engine.logits(probe, adapter=engine.active_adapter)), base_logits, atol=1e-2)
        assert sorted(await engine.adapters()) == list(range(max(1, version - 1), version + 1))
    # the rollout runs with the active adapter: greedy, the merged model's tokens
    engine.task = make_task("reinforce", vocab_size=base.config.vocab_size, batch=2, prompt_len=4, new_tokens=6,
                            seed=0)
    engine.task.temperature = 0.0
    await engine.set_weight_version(0)
    rollout = await engine.generate(0)
    assert rollout.data.completions == greedy(merged, rollout.data.prompts, 6)
    # the base model beside it is untouched
    torch.testing.assert_close(torch.tensor(await engine.logits(probe, adapter=None)), base_logits, rtol=0, atol=0)


async def test_a_failed_stage_leaves_the_active_adapter_serving_and_a_version_is_staged_once(served):
    engine, base = served
    state, config, merged = adapter(base, seed=41)
    digest = await stage(engine, state, 1, config)
    await engine.activate_adapter(1, digest=digest)
    probe = [PROMPTS[1]]
    serving = await engine.logits(probe, adapter=engine.active_adapter)
    bad, _, bad_merged = adapter(base, seed=42)
    with pytest.raises(RuntimeError, match="simulated trainer crash"):
        await stage(engine, bad, 2, config, fail_at=2)  # after two buckets arrived
    assert engine.active_adapter == 1 and sorted(await engine.adapters()) == [1]
    assert await engine.logits(probe, adapter=engine.active_adapter) == serving
    with pytest.raises(EngineStateError, match="adapter v1 was staged already.*a version is staged once"):
        await stage(engine, bad, 1, config)
    again = await stage(engine, bad, 2, config)  # the failed version registered nothing: it may be staged
    with pytest.raises(EngineError, match="stays active"):
        await engine.activate_adapter(2, digest=digest)  # not what the engine received
    assert engine.active_adapter == 1 and await engine.logits(probe, adapter=engine.active_adapter) == serving
    await engine.activate_adapter(2, digest=again)
    assert_close(await engine.logits(probe, adapter=engine.active_adapter), hf_logits(bad_merged, probe))
    # the version before the active one stays for requests in flight, and can be asked by name
    torch.testing.assert_close(torch.tensor(await engine.logits(probe, adapter=1)), torch.tensor(serving),
                               rtol=0, atol=0)
    with pytest.raises(EngineStateError, match="is active"):
        await engine.drop_adapter(2)


async def test_what_the_engine_cannot_take_is_refused_before_a_byte_moves(served):
    engine, base = served
    state, config, _ = adapter(base, seed=91)
    # tensors that are not the config's: every name at fault
    partial, partial_config, _ = adapter(base, seed=93, targets=["q_proj"])
    with pytest.raises(EngineError, match="unexpected"):
        await stage(engine, state, 1, partial_config)
    # another dtype: refused naming both (the sender converts on purpose, or not at all)
    wide = {n: t.double() for n, t in state.items()}
    with pytest.raises(EngineError, match="float64 \\(expected float32\\)"):
        await stage(engine, wide, 1, config, dtype=None)
    # a version no stage made
    with pytest.raises(EngineStateError, match="not loaded"):
        await engine.activate_adapter(7)
    with pytest.raises(EngineError, match="adapter v7 is not loaded in this engine"):
        await engine.logits([PROMPTS[0]], adapter=7)
    assert await engine.adapters() == {} and engine.active_adapter is None


def test_a_requests_tensors_are_copied_in_one_copy_per_buffer_they_lie_in():
    from colo.engine.adapter_host import copy_in

    buf = torch.arange(64, dtype=torch.float32)
    other = torch.arange(100, 112, dtype=torch.float32)
    items = [("a", buf[4:12].view(2, 4)), ("b", buf[20:26].view(3, 2)), ("c", other[2:8].view(6)),
             ("t", buf[32:48].view(4, 4).t())]  # not contiguous: copied on its own
    out = copy_in(items, torch.device("cpu"))
    assert set(out) == {"a", "b", "c", "t"}
    for name, t in items:
        assert torch.equal(out[name], t) and out[name].shape == t.shape
    # a and b share one copy (of bytes 16..104 of buf), c another; none of them is the sender's buffer
    assert out["a"].untyped_storage().data_ptr() == out["b"].untyped_storage().data_ptr()
    assert out["a"].untyped_storage().nbytes() == (26 - 4) * 4
    assert out["c"].untyped_storage().data_ptr() != out["a"].untyped_storage().data_ptr()
    buf.zero_()
    other.zero_()
    assert out["a"][0, 0] == 4 and out["c"][0] == 102 and out["t"][0, 1] == 36
