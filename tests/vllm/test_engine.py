"""colo's vLLM engine against a real vLLM: every sync goes through colo's own packed
transport into vLLM's worker (the ``colo`` weight-transfer backend hosting colo's engine
kit), and what vLLM then generates and scores is compared with transformers on the same
weights."""

from __future__ import annotations

import pytest
import torch

from colo.core.errors import EngineError, EngineStateError
from colo.core.interfaces import SyncContext
from colo.core.memory import StagingBudget
from colo.digest import expected_weights_digest
from colo.testing.trainers import StateTrainer
from colo.trainers.models import build_trainer_model, demo_config
from colo.transports import make_transport

from tests.vllm.parts import greedy, hf_logprobs

PROMPTS = [[1, 2, 3, 4], [5, 17, 300, 9, 11], [900, 4, 33]]
PROBE = [[7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [300, 200, 100, 50, 25, 12]]


def new_weights(seed: int):
    """New random weights: transformers' model on them, and a trainer that sends them (fp32)."""
    model = build_trainer_model(demo_config(), seed=seed)
    return model, StateTrainer({n: p.detach() for n, p in model.named_parameters()}, trains=True)


def order(trainer) -> list[str]:
    return [s.name for s in trainer.param_specs()]


async def sync(engine, trainer, *, bucket_bytes: int, version: int, flush: bool = True):
    transport = make_transport("packed")
    ctx = SyncContext(step=version, weight_version=version, bucket_bytes=bucket_bytes, source="host",
                      staging=StagingBudget(None), flush_cache=flush)
    try:
        result = await transport.sync(trainer, engine, ctx)
    finally:
        await transport.aclose()
    return result


async def test_tokens_logprobs_digest_and_version_equal_the_trainers_after_each_sync(engine):
    for version, seed in enumerate((11, 12, 13), start=1):
        model, trainer = new_weights(seed)
        # 2 MiB buckets: the 11.5 MB model in several requests
        result = await sync(engine, trainer, bucket_bytes=2 << 20, version=version)
        assert result.buckets >= 5 and result.tensors == 51 and result.cache_flushed
        assert await engine.digest() == expected_weights_digest(trainer.source, order(trainer), torch.float32)
        await engine.set_weight_version(version)
        assert await engine.engine_version() == str(version)
        assert await engine.tokens(PROMPTS, max_new_tokens=8) == greedy(model, PROMPTS, 8)
        got, want = await engine.logprobs(PROBE), hf_logprobs(model, PROBE)
        assert max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g, w)) <= 1e-4


async def test_two_buckets_and_tensors_larger_than_the_bucket(engine):
    model, trainer = new_weights(21)
    # the embedding and lm_head are 1 MiB each: in 0.75 MiB buckets they arrive in pieces
    result = await sync(engine, trainer, bucket_bytes=768 << 10, version=7)
    assert result.buckets > 15
    assert await engine.digest() == expected_weights_digest(trainer.source, order(trainer), torch.float32)
    await engine.set_weight_version(7)
    assert await engine.tokens(PROMPTS, max_new_tokens=8) == greedy(model, PROMPTS, 8)
    # the whole model in two requests
    model, trainer = new_weights(22)
    result = await sync(engine, trainer, bucket_bytes=6 << 20, version=8)
    assert result.buckets == 2
    await engine.set_weight_version(8)
    assert await engine.tokens(PROMPTS, max_new_tokens=8) == greedy(model, PROMPTS, 8)


async def test_misuse_is_refused_and_the_engine_serves_on(engine):
    model, trainer = new_weights(31)
    await sync(engine, trainer, bucket_bytes=4 << 20, version=1)
    await engine.set_weight_version(1)
    # an update outside a session: vLLM's worker refuses it
    with pytest.raises(EngineError, match="start_weight_update must be called before update_weights"):
        await engine.transport_load("packed", {"handle": {"kind": "shm", "name": "colo-0-0", "nbytes": 8},
                                               "tensors": []})
    # a second begin
    await engine.begin_load()
    with pytest.raises(EngineError, match="already active"):
        await engine.begin_load()
    await engine.drop_handles()  # closes the session the failed sync left
    # a name the checkpoint does not have, refused at preflight naming it
    from colo.core.buckets import spec

    with pytest.raises(EngineError, match="model.layers.9.mlp.up_proj.weight"):
        await engine.preflight([spec("model.layers.9.mlp.up_proj.weight", (512, 256), "float32")])
    # the engine serves on, on the last synced weights
    await engine.set_weight_version(1)
    assert await engine.tokens(PROMPTS, max_new_tokens=8) == greedy(model, PROMPTS, 8)


async def test_a_refused_update_leaves_the_trainer_intact_and_the_engine_stale(engine):
    model, trainer = new_weights(41)
    await sync(engine, trainer, bucket_bytes=4 << 20, version=1)
    await engine.set_weight_version(1)
    before = {n: t.clone() for n, t in trainer.source.items()}
    # the trainer's copy changes shape under one name: vLLM's checkpoint refuses it
    bad = dict(trainer.source)
    bad["model.norm.weight"] = torch.ones(128)
    with pytest.raises(EngineError, match="model.norm.weight"):
        await sync(engine, StateTrainer(bad), bucket_bytes=4 << 20, version=2)
    await engine.drop_handles()
    await engine.set_weight_version(None)  # as the scheduler marks it after a failed sync
    assert all(torch.equal(before[n], t) for n, t in trainer.source.items())
    with pytest.raises(EngineError, match="stale"):
        await engine.tokens(PROMPTS, max_new_tokens=2)
    # a complete sync makes it current again
    await sync(engine, trainer, bucket_bytes=4 << 20, version=3)
    await engine.set_weight_version(3)
    assert await engine.tokens(PROMPTS, max_new_tokens=8) == greedy(model, PROMPTS, 8)


async def test_a_stale_prefix_cache_gives_wrong_tokens_without_the_flush(engine):
    """colo's invariant 1 on a real engine: after a weight change the prefix cache must go."""
    model, trainer = new_weights(51)
    await sync(engine, trainer, bucket_bytes=4 << 20, version=1)
    await engine.set_weight_version(1)
    prompt = [[(i * 37) % 1000 + 1 for i in range(72)]]  # two full 32-token blocks and more
    assert await engine.tokens(prompt, max_new_tokens=8) == greedy(model, prompt, 8)
    assert await engine.tokens(prompt, max_new_tokens=8) == greedy(model, prompt, 8)  # now from the cache
    new_model, new_trainer = new_weights(52)
    await sync(engine, new_trainer, bucket_bytes=4 << 20, version=2, flush=False)
    await engine.set_weight_version(2)
    assert await engine.tokens(prompt, max_new_tokens=8) != greedy(new_model, prompt, 8)  # the hazard is real
    await engine.flush_cache()
    assert await engine.tokens(prompt, max_new_tokens=8) == greedy(new_model, prompt, 8)


async def test_release_and_resume_keep_colos_tag_rules(engine):
    with pytest.raises(EngineStateError, match="cuda_graph"):
        await engine.release(["cuda_graph"])  # vLLM has no such tag
    await engine.release(["kv_cache", "weights"])
    with pytest.raises(EngineStateError, match="already released"):
        await engine.release(["weights"])
    with pytest.raises(EngineError, match="released"):
        await engine.tokens(PROMPTS, max_new_tokens=2)  # colo refuses: vLLM would wait forever
    await engine.resume(["weights"])
    with pytest.raises(EngineStateError, match="already resident"):
        await engine.resume(["weights"])  # vLLM itself would only warn
    await engine.resume(["kv_cache"])
    # on a CPU vLLM's sleep moves no memory, and the engine says so in vLLM's words
    assert not engine.capabilities.frees_memory and "is_sleep_mode_available" in engine.capabilities.note
    # resumed weights are stale until a complete sync
    assert engine.weight_version is None


def test_colo_bench_times_the_same_sync_into_vllm_and_colos_engine(tmp_path):
    """``colo bench --engine vllm``: the demo model's sync into a real vLLM beside colo's engine,
    same transport and bucket, every digest checked, the ratio and vLLM's worker-side parts."""
    import json
    import subprocess
    import sys

    out = tmp_path / "b.json"
    proc = subprocess.run([sys.executable, "-m", "colo.cli", "bench", "--engine", "vllm", "--transports", "packed",
                           "--reps", "2", "--out", str(out)], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [(m["model"], m["engine"]) for m in result["models"]] == [("demo", "colo"), ("demo", "vllm")]
    assert all(r["digest_ok"] and r["bytes"] == 11_551_744 for m in result["models"] for r in m["rows"])
    (c,) = result["comparison"]
    assert c["transport"] == "packed" and c["ratio"] == c["vllm_s"] / c["colo_s"] > 0
    assert {"begin_s", "hash_s", "copy_s", "load_weights_s", "finalize_s"} <= set(c["vllm_worker_s"])
    assert result["vllm"]["version"].startswith("0.32.")


async def test_a_flipped_bit_in_a_received_tensor_fails_verification(engine):
    from colo.apps.demo_setup import make_verifier
    from colo.core.errors import VerificationError

    model, trainer = new_weights(71)
    sent = {n: t.clone() for n, t in trainer.source.items()}
    raw = sent["model.layers.2.mlp.down_proj.weight"].view(-1).view(torch.uint8)
    raw[12345] ^= 1 << 3  # what a corrupted transfer would deliver: one bit of one element
    await sync(engine, StateTrainer(sent), bucket_bytes=4 << 20, version=1)
    verify, _ = make_verifier(trainer, engine, demo_config(), "float32", 0)
    with pytest.raises(VerificationError, match="digest"):
        await verify([await engine.digest()])
    # the same sync of the trainer's own bytes passes
    await sync(engine, trainer, bucket_bytes=4 << 20, version=2)
    await verify([await engine.digest()])


async def test_the_stale_prefix_cache_is_caught_by_colos_invariant(engine, tmp_path):
    """A real run's trace against vLLM replays clean; the same trace with the flush after the
    sync taken out is refused at the next rollout (invariant 1), which is what the scheduler
    refuses live: the hazard the test above shows on vLLM's tokens."""
    import json

    from colo import MemoryLedger, Scheduler, TraceWriter, make_transport
    from colo.offline.replay import replay
    from colo.tasks import make_task

    model, trainer = new_weights(81)
    await sync(engine, trainer, bucket_bytes=4 << 20, version=0)
    await engine.set_weight_version(0)
    engine.task = make_task("reinforce", vocab_size=1024, batch=2, prompt_len=4, new_tokens=4, seed=0)
    path = tmp_path / "run.jsonl"
    async with Scheduler(trainer, engine, MemoryLedger(total_bytes=4 << 30), make_transport("packed"),
                         trace=TraceWriter(path)) as sched:
        await sched.cycle()
        await sched.run_phase(sched.order[0])  # the next rollout
    assert replay([path]).valid
    events = [json.loads(line) for line in path.read_text().splitlines()]
    stale = tmp_path / "no-flush.jsonl"
    stale.write_text("".join(json.dumps({k: v for k, v in e.items() if k != "cache_flushed"}) + "\n" for e in events))
    report = replay([stale])
    assert not report.valid
    assert "prefix cache was not flushed after the last weight change" in report.as_dict()["violations"][0]["message"]
