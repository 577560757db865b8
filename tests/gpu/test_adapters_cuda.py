"""LoRA adapters into colo's engine on a GPU (issue 43): the adapter's tensors travel from the
trainer's pinned host copy through the packed transport's CUDA IPC buffer into the engine
process's adapter table; with each version the engine's logits are transformers' on PEFT's
merged model (float32), a stage that fails mid-transfer leaves the active version serving, and a
version is staged once. tests/engine/test_adapters.py is the same on the CPU."""

import pytest
import torch

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytestmark = [pytest.mark.gpu, gpu]

peft = pytest.importorskip("peft")

from colo.core.errors import EngineStateError  # noqa: E402
from colo.digest import expected_weights_digest  # noqa: E402
from colo.engine.reference.client import EngineClient  # noqa: E402
from colo.testing.trainers import StateTrainer  # noqa: E402
from tests.archs import VLLM, perturbed_model, tiny_config  # noqa: E402
from tests.engine.test_adapters import assert_close, hf_logits  # noqa: E402
from tests.lora_parts import BUCKET, PROMPTS, adapter, engine_build  # noqa: E402


async def stage(engine, state, version, config, **kw):
    pinned = {n: t.pin_memory() for n, t in state.items()}
    return await engine.stage_adapter(StateTrainer(pinned, upload_to="cuda", **kw), version, config,
                                      bucket_bytes=BUCKET)


async def test_adapters_through_cuda_ipc_serve_what_transformers_serves_on_the_merged_model(tmp_path):
    config = tiny_config("qwen2", **VLLM)
    base = perturbed_model(config, seed=5)
    engine = await EngineClient.spawn(engine_build(config, base, tmp_path, device="cuda", total_bytes=1 << 30,
                                                   mem_fraction_static=0.3))
    try:
        probe = [PROMPTS[0] * 2, PROMPTS[1] + PROMPTS[0][:3]]
        for version in (1, 2):
            state, cfg, merged = adapter(base, seed=10 + version)
            got = await stage(engine, state, version, cfg)
            assert got == expected_weights_digest(state, list(state), torch.float32)
            await engine.activate_adapter(version, digest=got)
            assert_close(await engine.logits(probe, adapter=engine.active_adapter), hf_logits(merged, probe))
        serving = await engine.logits(probe, adapter=engine.active_adapter)
        bad, cfg, _ = adapter(base, seed=42)
        with pytest.raises(RuntimeError, match="simulated trainer crash"):
            await stage(engine, bad, 3, cfg, fail_at=2)
        assert engine.active_adapter == 2 and await engine.logits(probe, adapter=engine.active_adapter) == serving
        with pytest.raises(EngineStateError, match="a version is staged once"):
            await stage(engine, bad, 2, cfg)
    finally:
        await engine.aclose()
