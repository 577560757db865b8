"""A user's checkpoint of each architecture into a real vLLM (issue 41, item 2).

For a Qwen2 with tied embeddings, a Qwen3 (q/k norms, a head_dim of its own) and a Llama:
a tiny random checkpoint is saved here by transformers (nothing is downloaded), vLLM is
started from that directory, colo's hf trainer is loaded from the same directory, and
colo's scheduler runs whole cycles (rollout on vLLM, a REINFORCE step, offload, a packed
sync into vLLM's worker), every sync verified by the engine's digest and the logprob
probe (``make_verifier``). After each sync vLLM's greedy tokens must equal transformers'
on the trainer's weights, and its logprobs must be within ``LOGPROB_TOLERANCE`` (both
float32; ENGINES.md measured at most 9e-6). A checkpoint vLLM cannot be started from, or
a trainer whose shapes differ from the engine's, is refused with the engine untouched.
"""

from __future__ import annotations

import anyio
import pytest
import torch

from colo.apps.demo_setup import LOGPROB_TOLERANCE, make_verifier
from colo.core.config import SchedulerConfig
from colo.core.errors import BadInput, CheckpointError, EngineError, UnsupportedArchitecture
from colo.core.interfaces import SyncContext
from colo.core.memory import MemoryLedger, StagingBudget
from colo.models.arch import hf_shapes
from tests.archs import VLLM, save_checkpoint, tiny_config
from tests.vllm.parts import LLM_ARGS, greedy, hf_logprobs

PROMPTS = [[1, 2, 3, 4], [5, 17, 300, 9, 11], [900, 4, 33]]
PROBE = [[7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [300, 200, 100, 50, 25, 12]]
CYCLES = 3


def transformers_on(trainer):
    """transformers' own model of the trainer's architecture, loaded with the trainer's weights now."""
    from colo.trainers.models import model_class

    config = trainer.model.config
    model = model_class(config)(config).eval()
    missing, unexpected = model.load_state_dict(trainer.hf_state(), strict=False)
    assert set(missing) <= ({"lm_head.weight"} if config.tie_word_embeddings else set()) and not unexpected
    return model


async def check_vllm_equals_transformers(engine, model) -> None:
    tokens, logprobs = await engine.tokens(PROMPTS, max_new_tokens=8), await engine.logprobs(PROBE)
    assert tokens == greedy(model, PROMPTS, 8)
    want = hf_logprobs(model, PROBE)
    assert max(abs(a - b) for g, w in zip(logprobs, want) for a, b in zip(g, w)) <= LOGPROB_TOLERANCE


@pytest.mark.parametrize("case", ["qwen2-tied", "qwen3", "llama"])
def test_each_sync_of_a_trained_checkpoint_makes_vllm_equal_transformers(case, tmp_path):
    from colo import Scheduler, TraceWriter, make_transport
    from colo.engine.vllm import VllmEngine
    from colo.tasks import make_task
    from colo.trace.writer import read_trace
    from colo.trainers import build

    config = tiny_config(case, **VLLM)
    path = str(tmp_path / case)
    saved = save_checkpoint(path, config, seed=7)
    trainer, _ = build("hf", checkpoint=path, engine_dtype="float32", device="cpu")
    trace = tmp_path / "run.jsonl"

    async def main() -> list[str]:
        engine = await VllmEngine.start(path, **LLM_ARGS)
        try:
            engine.task = make_task("reinforce", vocab_size=config.vocab_size, batch=4, prompt_len=4,
                                    new_tokens=4, seed=0)
            # version 0: vLLM serves the checkpoint as it started from it
            await check_vllm_equals_transformers(engine, saved)
            verify, probe = make_verifier(trainer, engine, trainer.model.config, "float32", 0)
            digests = []
            async with Scheduler(trainer, engine, MemoryLedger(total_bytes=4 << 30), make_transport("packed"),
                                 trace=TraceWriter(trace), verify=verify, probe=probe,
                                 config=SchedulerConfig(bucket_bytes=1 << 20, verify="every")) as sched:
                for _ in range(CYCLES):
                    await sched.cycle()  # rollout, train, offload, sync (verified), wake
                    assert engine.weight_version == trainer.steps
                    digests.append(await engine.digest())
                    model = transformers_on(trainer)
                    await check_vllm_equals_transformers(engine, model)
            return digests
        finally:
            await engine.aclose()

    try:
        digests = anyio.run(main)
    finally:
        trainer.close()
    assert trainer.steps == CYCLES and len(set(digests)) == CYCLES  # the weights changed every step
    syncs = [e for e in read_trace(trace) if e["event"] == "sync.finished"]
    assert [s["weight_version"] for s in syncs] == list(range(1, CYCLES + 1))
    assert [s["digest"] for s in syncs] == digests and all(s["verify_s"] is not None for s in syncs)
    # every tensor of the architecture's table, once (a tied lm_head is not one); the hf trainer
    # on a CPU holds its float32 weights in one flat buffer: packed sends it in one request
    assert all(s["tensors"] == len(hf_shapes(config)) for s in syncs)


# -- bad input -----------------------------------------------------------------------------------

def test_a_directory_vllm_cannot_start_from_is_refused_before_vllm_starts(tmp_path):
    import json
    import shutil

    from colo.engine.vllm import VllmEngine

    path = tmp_path / "qwen3"
    save_checkpoint(path, tiny_config("qwen3", **VLLM), seed=1)
    gpt2 = tmp_path / "gpt2"
    shutil.copytree(path, gpt2)
    (gpt2 / "config.json").write_text(json.dumps({**json.loads((path / "config.json").read_text()),
                                                  "model_type": "gpt2"}))
    empty = tmp_path / "empty"
    empty.mkdir()
    for where, error, message in ((tmp_path / "nowhere", CheckpointError, "does not exist"),
                                  (empty, CheckpointError, "has no config.json"),
                                  (gpt2, UnsupportedArchitecture, "model_type 'gpt2' is not an architecture colo")):
        with pytest.raises(error, match=message) as e:
            anyio.run(lambda: VllmEngine.start(str(where), **LLM_ARGS))
        assert isinstance(e.value, BadInput) and str(where) in str(e.value)


def test_a_trainer_whose_shapes_differ_from_the_engines_is_refused_and_the_engine_serves_on(tmp_path):
    """vLLM started from one checkpoint, a trainer loaded from another of the same architecture
    and other shapes (a wider MLP): the first sync is refused at preflight, naming the
    tensors, before anything loads; vLLM's weights, version and answers are unchanged."""
    from colo.engine.vllm import VllmEngine
    from colo.testing.trainers import StateTrainer
    from colo.trainers import build
    from colo.transports import make_transport

    served = save_checkpoint(tmp_path / "a", tiny_config("llama", **VLLM), seed=2)
    save_checkpoint(tmp_path / "b", tiny_config("llama", **{**VLLM, "intermediate_size": 384}), seed=3)
    other, _ = build("hf", checkpoint=str(tmp_path / "b"), engine_dtype="float32", device="cpu")

    async def main() -> None:
        engine = await VllmEngine.start(str(tmp_path / "a"), **LLM_ARGS)
        try:
            before = await engine.tokens(PROMPTS, max_new_tokens=8)
            assert before == greedy(served, PROMPTS, 8)
            transport = make_transport("packed")
            ctx = SyncContext(step=1, weight_version=1, bucket_bytes=1 << 20, source="host",
                              staging=StagingBudget(None), flush_cache=True)
            try:
                with pytest.raises(EngineError, match="WeightMismatch") as e:
                    await transport.sync(StateTrainer(other.hf_state()), engine, ctx)
            finally:
                await transport.aclose()
            assert "wrong shape" in str(e.value) and "model.layers.0.mlp.up_proj.weight (384, 256) (expected " \
                                                    "(512, 256))" in str(e.value)
            assert engine.weight_version == 0
            assert await engine.tokens(PROMPTS, max_new_tokens=8) == before
        finally:
            await engine.aclose()

    try:
        anyio.run(main)
    finally:
        other.close()


def test_colo_demo_on_vllm_trains_a_qwen3_checkpoint_and_verifies_every_sync(tmp_path):
    """``colo demo --engine vllm --checkpoint DIR``: the user's Qwen3 trained, every sync's digest
    and vLLM's probe logprobs checked against the trainer, the trace replays clean."""
    from tests.vllm.test_demo import replay, run_demo

    path = tmp_path / "qwen3"
    save_checkpoint(path, tiny_config("qwen3", **VLLM), seed=4)
    proc, events = run_demo(tmp_path, "--steps", "2", "--checkpoint", str(path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    syncs = [e for e in events if e["event"] == "sync.finished"]
    probes = [e for e in events if e["event"] == "probe.finished"]
    assert len(syncs) == 2 and all(s["verify_s"] is not None and s["digest"] for s in syncs)
    assert [p["weight_version"] for p in probes] == [s["weight_version"] for s in syncs]
    assert events[0]["config"]["model"]["model_type"] == "qwen3"
    assert replay(tmp_path / "run.jsonl")["valid"] is True
