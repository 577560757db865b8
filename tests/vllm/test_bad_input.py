"""A vLLM colo cannot drive is refused naming why, before any weight moves."""

from __future__ import annotations

import anyio
import pytest

from colo.core.errors import BadInput, EngineError
from colo.core.buckets import spec
from tests.vllm.parts import LLM_ARGS


def test_a_vllm_started_without_colos_extension_is_refused(model_dir, monkeypatch):
    from vllm import LLM

    from colo.engine.vllm import VllmEngine

    # one process, as VllmEngine.start makes it (this LLM is built by hand, not by colo)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    llm = LLM(model=model_dir, distributed_executor_backend="uni", **LLM_ARGS)
    try:
        with pytest.raises(BadInput, match="without colo's worker extension.*worker_extension_cls="):
            anyio.run(lambda: VllmEngine.attach(llm))
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_names_the_checkpoint_does_not_have_are_refused_at_preflight(model_dir):
    """A trainer whose names vLLM's checkpoint does not have (another architecture's, a
    renamed layer): every unmapped name and every missing one in one refusal."""
    from colo.engine.vllm import VllmEngine

    async def main() -> None:
        engine = await VllmEngine.start(model_dir, **LLM_ARGS)
        try:
            specs = [spec("transformer.h.0.attn.c_attn.weight", (768, 256), "float32"),
                     spec("model.embed_tokens.weight", (1024, 256), "float32")]
            with pytest.raises(EngineError) as e:
                await engine.preflight(specs)
            text = str(e.value)
            assert "transformer.h.0.attn.c_attn.weight" in text and "lm_head.weight" in text  # unexpected, missing
            # a tensor in the wrong dtype (vLLM runs float32 here)
            with pytest.raises(EngineError, match="bfloat16 .expected float32"):
                await engine.preflight([spec(s.name, s.shape, "bfloat16") for s in engine.specs])
        finally:
            await engine.aclose()

    anyio.run(main)
