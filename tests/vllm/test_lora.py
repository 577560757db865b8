"""LoRA adapters into a real vLLM, in memory (issue 43): each adapter version travels through
colo's packed transport into vLLM's worker, is built there into vLLM's own ``LoRAModel`` and
registered with its LoRA manager (no file is written), and is served once activated.

The ground truth is PEFT and transformers: after each adapter sync vLLM's greedy tokens with
the adapter must equal transformers' on the PEFT-merged model (``merge_and_unload``), and
without it the base model's. Also: a stage that fails mid-transfer leaves the active version
serving with its digest; the versions kept stay loaded for requests still in flight and older
ones are dropped; what vLLM cannot take is refused before a byte moves.
"""

from __future__ import annotations

import anyio
import pytest
import torch
from peft import LoraConfig

from colo.core.errors import EngineError, EngineStateError
from colo.digest import expected_weights_digest
from colo.models.lora import AdapterConfig, adapter_shapes
from tests.archs import VLLM, save_checkpoint, tiny_config
from tests.lora_parts import BUCKET, PROMPTS, adapter, stage
from tests.vllm.parts import LLM_ARGS, greedy

LORA = dict(enable_lora=True, max_lora_rank=8, max_loras=1, max_cpu_loras=3)


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def served(request, tmp_path_factory):
    """A vLLM with LoRA on a tiny checkpoint of each architecture, and transformers' model of it."""
    from colo.engine.vllm import VllmEngine

    path = tmp_path_factory.mktemp(f"lora-{request.param}")
    base = save_checkpoint(path, tiny_config(request.param, **VLLM), seed=5).eval()
    engine = anyio.run(lambda: VllmEngine.start(str(path), **LLM_ARGS, **LORA))
    yield engine, base
    anyio.run(engine.aclose)


async def test_each_adapter_sync_serves_what_transformers_serves_on_the_merged_model(served):
    engine, base = served
    engine.keep_adapters = 2
    base_tokens = greedy(base, PROMPTS, 8)
    for version in (1, 2, 3):
        state, config, merged = adapter(base, seed=10 + version)
        assert set(state) == set(adapter_shapes(base.config, config))
        got = await stage(engine, state, version, config)
        want = expected_weights_digest(state, list(state), torch.float32)
        assert got == want
        # staged, not active: requests still run with the version before it
        assert engine.active_adapter == (version - 1 or None)
        await engine.activate_adapter(version, digest=want)
        assert await engine.tokens(PROMPTS, max_new_tokens=8) == greedy(merged, PROMPTS, 8)
        # the base model, beside it, is untouched
        assert await engine.tokens(PROMPTS, max_new_tokens=8, adapter=None) == base_tokens
        loaded = await engine.adapters()
        assert sorted(loaded) == list(range(max(1, version - 1), version + 1))  # the newest two
        assert loaded[version] == want
    assert greedy(merged, PROMPTS, 8) != base_tokens  # the adapters change what is generated


async def test_a_stage_that_fails_mid_transfer_leaves_the_active_adapter_serving(served):
    engine, base = served
    before = sorted(await engine.adapters())
    state, config, merged = adapter(base, seed=41)
    version = max(before, default=0) + 1
    digest = await stage(engine, state, version, config)
    await engine.activate_adapter(version, digest=digest)
    serving = await engine.tokens(PROMPTS, max_new_tokens=8)
    assert serving == greedy(merged, PROMPTS, 8)

    bad_state, _, bad_merged = adapter(base, seed=42)
    with pytest.raises(RuntimeError, match="simulated trainer crash"):
        await stage(engine, bad_state, version + 1, config, fail_at=2)  # after two buckets arrived
    assert engine.active_adapter == version
    loaded = await engine.adapters()
    assert version + 1 not in loaded and loaded[version] == digest
    assert await engine.tokens(PROMPTS, max_new_tokens=8) == serving
    # and the next stage of that version goes through
    again = await stage(engine, bad_state, version + 1, config)
    await engine.activate_adapter(version + 1, digest=again)
    assert await engine.tokens(PROMPTS, max_new_tokens=8) == greedy(bad_merged, PROMPTS, 8)


async def test_a_kept_version_serves_requests_and_an_older_one_is_dropped(served):
    engine, base = served
    engine.keep_adapters = 2
    start = max(await engine.adapters(), default=0) + 1
    made = {}
    for version in range(start, start + 3):
        state, config, merged = adapter(base, seed=70 + version)
        digest = await stage(engine, state, version, config)
        await engine.activate_adapter(version, digest=digest)
        made[version] = merged
    newest = start + 2
    assert sorted(await engine.adapters()) == [newest - 1, newest]
    # a request that still names the version before the active one is served with it
    assert await engine.tokens(PROMPTS, max_new_tokens=8, adapter=newest - 1) == greedy(made[newest - 1], PROMPTS, 8)
    with pytest.raises(EngineStateError, match=f"adapter v{start} is not loaded"):
        await engine.tokens(PROMPTS, max_new_tokens=8, adapter=start)
    with pytest.raises(EngineStateError, match="is active"):
        await engine.drop_adapter(newest)


async def test_what_vllm_cannot_take_is_refused_and_the_active_adapter_serves_on(served):
    engine, base = served
    state, config, merged = adapter(base, seed=91)
    version = max(await engine.adapters(), default=0) + 1
    digest = await stage(engine, state, version, config)
    await engine.activate_adapter(version, digest=digest)
    serving = await engine.tokens(PROMPTS, max_new_tokens=8)

    # a rank above the engine's max_lora_rank: refused at preflight, naming both
    big, big_config, _ = adapter(base, seed=92, r=16)
    with pytest.raises(EngineError, match="rank 16 is above this vLLM's max_lora_rank 8"):
        await stage(engine, big, version + 1, big_config)
    # tensors that are not the config's (a layer the config does not name): every name at fault
    partial, partial_config, _ = adapter(base, seed=93, targets=["q_proj"])
    with pytest.raises(EngineError, match="unexpected"):
        await stage(engine, state, version + 1, partial_config)
    # a digest that is not what the worker received: not activated
    other = await stage(engine, partial, version + 1, partial_config)
    with pytest.raises(EngineError, match="stays active"):
        await engine.activate_adapter(version + 1, digest="0" * len(other))
    assert engine.active_adapter == version
    assert await engine.tokens(PROMPTS, max_new_tokens=8) == serving
    # a version no stage made
    with pytest.raises(EngineStateError, match="not loaded"):
        await engine.activate_adapter(version + 50)
    # a version staged before, staged again (the active one, or an older one): refused before a
    # byte moves, the active version serving on
    for reused in (version, version - 1 if version > 1 else version):
        with pytest.raises(EngineStateError, match=f"adapter v{reused} was staged already.*a version is staged once"):
            await stage(engine, partial, reused, partial_config)
    assert engine.active_adapter == version and (await engine.adapters())[version] == digest
    assert await engine.tokens(PROMPTS, max_new_tokens=8) == serving


async def test_an_adapter_in_another_dtype_is_refused_or_converted_once_on_purpose(served):
    """vLLM keeps adapters in its lora_dtype (the model's, float32 here): a float64 adapter
    sent as it is is refused at preflight naming both dtypes (OpenRLHF#1349's fp32 adapter
    into a bf16 engine, in the CPU's terms); the sender's extractor converting it to the
    engine's dtype is the one conversion, and what arrives is its converted bytes."""
    engine, base = served
    state, config, merged = adapter(base, seed=95)
    wide = {n: t.double() for n, t in state.items()}
    version = max(await engine.adapters(), default=0) + 1
    with pytest.raises(EngineError, match="float64 \\(expected float32\\)"):
        await stage(engine, wide, version, config, dtype=None)  # sent as it is
    digest = await stage(engine, wide, version, config)  # StateTrainer's extractor converts to float32
    assert digest == expected_weights_digest(wide, list(wide), torch.float32)
    await engine.activate_adapter(version, digest=digest)
    assert await engine.tokens(PROMPTS, max_new_tokens=8) == greedy(merged, PROMPTS, 8)


def test_an_adapter_config_colo_cannot_sync_is_refused_naming_the_setting():
    with pytest.raises(ValueError, match="use_dora=True"):
        AdapterConfig.from_peft(LoraConfig(r=8, target_modules=["q_proj"], use_dora=True))
    with pytest.raises(ValueError, match="not layers colo's adapters sit beside"):
        AdapterConfig(r=8, alpha=16, targets=("lm_head",))
    with pytest.raises(ValueError, match="rank r must be an integer"):
        AdapterConfig(r=0, alpha=16, targets=("q_proj",))
