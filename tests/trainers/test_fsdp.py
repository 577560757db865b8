"""The FSDP2 trainer (``colo demo --trainer fsdp``): real ``fully_shard`` against unsharded transformers.

The ground truth is the external library: a plain ``Qwen2ForCausalLM`` (and
the reference trainer's unsharded step) built from the same seed.
"""

from __future__ import annotations

import math

import anyio
import pytest
import torch
import torch.distributed as dist

from colo.core.interfaces import RolloutResult
from colo.tasks import RolloutData
from colo.trainers.models import build_trainer_model, demo_config
from colo.trainers import BUILDERS
from colo.trainers import build as build_trainer
from colo.trainers.hf import ReferenceTrainer, ReinforceConfig
from tests.dist_helpers import assert_bit_equal, run_workers

SEED = 5
#: vocab 97 over 2 ranks: rank 0 holds 49 rows, rank 1 48 (FSDP2's uneven split)
SMALL = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=64, max_position_embeddings=64)
PROBE = [[3, 14, 15, 92, 65, 35, 89, 79], [32, 38, 46, 26, 43, 38, 32, 79]]
#: after one AdamW step of lr 2e-3 from the same weights, sharded and unsharded
#: differ only by fp32 rounding (the gradient norm is summed shard by shard, and
#: the unsharded reference runs in another process with its own thread count)
STEP_ATOL = 1e-6


def rollout_data() -> RolloutData:
    g = torch.Generator().manual_seed(7)
    prompts = torch.randint(0, SMALL["vocab_size"], (8, 6), generator=g).tolist()
    completions = torch.randint(0, SMALL["vocab_size"], (8, 10), generator=g).tolist()
    # the demo's reward: share of completion tokens in a fixed eighth of the vocabulary
    rewards = [sum(t % 8 == 0 for t in c) / len(c) for c in completions]
    return RolloutData(prompts, completions, rewards)


class HostBackup:
    """A CPU stand-in for ``TrainerMemory``: pausing copies each local shard to a
    'host backup' and poisons the live shard with NaN, as unmapped device pages
    would be unreadable; resuming puts the shards back."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.saver, self._backup = model, self, {}

    def resident(self, tag: str) -> bool:
        return not self._backup

    def host_view(self, t: torch.Tensor) -> torch.Tensor:
        return self._backup[t.data_ptr()]

    async def pause(self, owner: str, tags) -> None:
        with torch.no_grad():
            for p in self.model.parameters():
                local = p.to_local()
                self._backup[local.data_ptr()] = local.clone()
                local.fill_(float("nan"))

    async def resume(self, owner: str, tags) -> None:
        with torch.no_grad():
            for p in self.model.parameters():
                p.to_local().copy_(self._backup[p.to_local().data_ptr()])
        self._backup.clear()


def fsdp_worker(rank: int, world: int, tmp_path, data: RolloutData) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import Qwen2ForCausalLM

    from colo.extractors import FSDPExtractor
    from colo.trainers.fsdp import FSDPTrainer, shard

    cfg = demo_config(**SMALL)
    model = shard(build_trainer_model(cfg, SEED), init_device_mesh("cpu", (world,)))
    backup = HostBackup(model)
    # float32 on the wire, so the gather can be compared bit for bit with the unsharded model
    trainer = FSDPTrainer(model, engine_dtype="float32", memory_backend=backup)
    names = [s.name for s in trainer.param_specs()]
    local_rows = {n: tuple(p.to_local().shape) for n, p in model.named_parameters()}

    gathered = dict(trainer.extractor().extract(names))
    bf16 = dict(FSDPExtractor(model, dtype=torch.bfloat16).extract(names))
    sharded_logits = trainer.logits(PROBE)
    unsharded = Qwen2ForCausalLM(cfg).eval()
    unsharded.load_state_dict(gathered, strict=True)
    with torch.no_grad():
        unsharded_logits = unsharded(torch.tensor(PROBE)).logits.float()

    metrics = anyio.run(trainer.train_step, RolloutResult(reward=0.0, tokens=0, data=data))
    trained = dict(trainer.extractor().extract(names))
    hf_state = trainer.hf_state()
    trained_logits = trainer.logits(PROBE)

    # offload-first on a GPU: the shards are paused, the sync reads their host backup
    anyio.run(trainer.offload, ["weights", "optimizer"])
    paused_extracted = dict(trainer.extractor().extract(names))
    paused_hf_state = trainer.hf_state()
    paused_logits = trainer.logits(PROBE)
    anyio.run(trainer.onload, ["weights", "optimizer"])
    resumed = dict(trainer.extractor().extract(names))
    return {"local_rows": local_rows, "gathered": gathered, "bf16": bf16, "sharded_logits": sharded_logits,
            "unsharded_logits": unsharded_logits, "metrics": metrics, "trained": trained, "hf_state": hf_state,
            "trained_logits": trained_logits, "paused_extracted": paused_extracted,
            "paused_hf_state": paused_hf_state, "paused_logits": paused_logits, "resumed": resumed,
            "steps": trainer.steps, "num_params": trainer.num_params(), "tag_bytes": trainer.tag_bytes()}


def test_fsdp2_on_two_ranks_matches_unsharded_transformers_before_and_after_a_step(tmp_path):
    data = rollout_data()
    results = run_workers(fsdp_worker, tmp_path, data)

    cfg = demo_config(**SMALL)
    init = build_trainer_model(cfg, SEED).state_dict()
    ref = ReferenceTrainer(build_trainer_model(cfg, SEED), engine_dtype="float32")
    ref_metrics = anyio.run(ref.train_step, RolloutResult(reward=0.0, tokens=0, data=data))
    ref_state = ref.hf_state()
    hidden, numel = SMALL["hidden_size"], sum(t.numel() for t in init.values())

    for rank, res in enumerate(results):
        # the model really was sharded, unevenly: 49 + 48 vocabulary rows
        assert res["local_rows"]["model.embed_tokens.weight"] == ((49 if rank == 0 else 48), hidden)
        assert res["local_rows"]["lm_head.weight"] == ((49 if rank == 0 else 48), hidden)
        assert res["num_params"] == numel
        # each rank keeps its shard, padded to an even split, for weights and both AdamW moments
        shard_bytes = sum(math.ceil(t.shape[0] / 2) * t[0].numel() * 4 for t in init.values())
        assert res["tag_bytes"] == {"weights": shard_bytes, "optimizer": 2 * shard_bytes}

        # gathered from the shards: the unsharded model of the same seed, bit for bit
        assert list(res["gathered"]) == list(init)
        for n, t in init.items():
            assert_bit_equal(res["gathered"][n], t, f"rank {rank} {n}")
            assert_bit_equal(res["bf16"][n], t.to(torch.bfloat16), f"rank {rank} {n} bf16")
        # and loaded into an unsharded Qwen2ForCausalLM they give the sharded model's own logits
        assert res["sharded_logits"].shape == (2, 8, SMALL["vocab_size"])
        torch.testing.assert_close(res["sharded_logits"], res["unsharded_logits"], rtol=0, atol=1e-5)

        # one identical REINFORCE step on both ranks = the unsharded reference trainer's step
        assert res["steps"] == 1
        assert res["metrics"]["reward"] == pytest.approx(ref_metrics["reward"], abs=1e-7)
        assert res["metrics"]["loss"] == pytest.approx(ref_metrics["loss"], abs=1e-6)
        lr = ReinforceConfig().lr
        moved = max(float((res["trained"][n] - init[n]).abs().max()) for n in init)
        assert lr / 2 < moved <= lr * 1.01  # AdamW's first step moves a weight by at most ~lr
        for n in init:
            torch.testing.assert_close(res["trained"][n], ref_state[n], rtol=0, atol=STEP_ATOL,
                                       msg=lambda m, n=n: f"rank {rank} {n}: {m}")
            assert_bit_equal(res["hf_state"][n], res["trained"][n], f"rank {rank} {n} hf_state")
            # paused: the same tensors, uploaded from the host backup and gathered
            assert_bit_equal(res["paused_extracted"][n], res["trained"][n], f"rank {rank} {n} paused")
            assert_bit_equal(res["paused_hf_state"][n], res["trained"][n], f"rank {rank} {n} paused hf_state")
            assert_bit_equal(res["resumed"][n], res["trained"][n], f"rank {rank} {n} resumed")
        assert torch.isfinite(res["paused_logits"]).all()
        torch.testing.assert_close(res["paused_logits"], res["trained_logits"], rtol=0, atol=1e-5)

    for n in init:  # every rank gathered the same full tensors
        assert_bit_equal(results[0]["trained"][n], results[1]["trained"][n], n)


def test_build_starts_a_one_rank_group_and_close_ends_it(tmp_path):
    from torch.distributed.tensor import DTensor

    from colo.trainers.fsdp import FSDPTrainer

    assert BUILDERS["fsdp"] == "colo.trainers.fsdp:build"
    assert not dist.is_initialized()
    cfg = demo_config(**SMALL)
    trainer, saver = build_trainer("fsdp", model_config=cfg, seed=SEED, engine_dtype="bfloat16", device="cpu")
    try:
        assert saver is None and dist.is_initialized() and dist.get_world_size() == 1
        assert isinstance(trainer, FSDPTrainer) and trainer.world_size == 1
        assert all(isinstance(p, DTensor) for p in trainer.model.parameters())
        want = build_trainer_model(cfg, SEED).state_dict()
        got = trainer.hf_state()
        assert list(got) == list(want)
        for n, t in want.items():
            assert_bit_equal(got[n], t, n)
        assert [(s.name, s.shape, s.dtype) for s in trainer.param_specs()] == [
            (n, tuple(t.shape), "bfloat16") for n, t in want.items()]
        weights = sum(t.numel() * 4 for t in want.values())
        assert trainer.tag_bytes() == {"weights": weights, "optimizer": 2 * weights}
    finally:
        trainer.close()
    assert not dist.is_initialized()
    trainer.close()  # a second close is harmless

    # a process group that exists already is used, and left to its owner
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        trainer, _ = build_trainer("fsdp", model_config=cfg, seed=SEED, engine_dtype="bfloat16", device="cpu")
        trainer.close()
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()

    with pytest.raises(TypeError, match="no sharded parameters"):
        FSDPTrainer(build_trainer_model(cfg, SEED))


async def test_demo_with_the_fsdp_trainer_verifies_every_sync(tmp_path, monkeypatch):
    from colo.apps.demo import DemoConfig, run
    from colo.core.invariants import InvariantChecker
    from colo.trace.writer import read_trace
    from colo.trainers import fsdp

    # The demo owns the trainer; close whatever it built even if the run fails
    # (close is idempotent, so this is harmless once the demo closes it too).
    built = []
    real_build = fsdp.build

    def recording_build(**kwargs):
        trainer, saver = real_build(**kwargs)
        built.append(trainer)
        return trainer, saver

    monkeypatch.setattr(fsdp, "build", recording_build)
    try:
        # a bfloat16 engine (the CPU demo's default is float32): every sync converts through buckets
        out = await run(DemoConfig(trainer="fsdp", steps=2, batch=8, new_tokens=8, bucket_mib=0.5,
                                   engine_dtype="bfloat16", trace=str(tmp_path / "t.jsonl")), progress=False)
    finally:
        for trainer in built:
            trainer.close()
    assert len(built) == 1 and not dist.is_initialized()
    # the demo raises on a digest or probe-logit mismatch after any sync
    assert out.error is None, out.error
    events = read_trace(out.trace_path)
    checker = InvariantChecker()
    assert [str(v) for i, e in enumerate(events, 1) for v in checker.feed(e, i)] == []
    syncs = [e for e in events if e["event"] == "sync.finished"]
    assert [s["weight_version"] for s in syncs] == [1, 2]
    assert all(s["tensors"] == s["params"] and s["buckets"] > 1 for s in syncs)
    assert len({s["digest"] for s in syncs}) == 2  # the FSDP step changed the weights
    assert built[0].steps == 2


def test_tied_embeddings_are_sent_once_and_train_like_the_reference():
    """Qwen2 0.5B-3B tie lm_head to the embedding: one FSDP parameter, one engine tensor."""
    cfg = demo_config(**SMALL, tie_word_embeddings=True)
    trainer, _ = build_trainer("fsdp", model_config=cfg, seed=SEED, engine_dtype="float32", device="cpu")
    try:
        ref = ReferenceTrainer(build_trainer_model(cfg, SEED), engine_dtype="float32")
        names = [s.name for s in trainer.param_specs()]
        assert "lm_head.weight" not in names and names == [s.name for s in ref.param_specs()]
        for t in (trainer, ref):
            anyio.run(t.train_step, RolloutResult(reward=0.0, tokens=0, data=rollout_data()))
        got, want = dict(trainer.extractor().extract(names)), ref.hf_state()
        assert list(got) == list(want)
        for n in want:  # one rank: the same arithmetic as the unsharded trainer
            torch.testing.assert_close(got[n], want[n], rtol=0, atol=STEP_ATOL)
        torch.testing.assert_close(trainer.logits(PROBE), ref.logits(PROBE), rtol=0, atol=1e-5)
    finally:
        trainer.close()
    assert not dist.is_initialized()


@pytest.mark.parametrize("engine_dtype", ["float32", "bfloat16"])
def test_one_rank_keeps_its_resident_extractor_while_the_shards_stay_and_reads_their_new_bytes(engine_dtype):
    """Issue 44: a one-rank FSDP2 trainer's sync-first extractor (each local shard as a plain
    tensor) is built once and kept while every shard is the same storage, instead of 338
    shards' addresses and a new extractor every sync: after a train step the same extractor
    yields the trained bytes. A shard rebound to new storage (what FSDP2's lazy init may do):
    with the shards in the flat buffer (float32 here, the engine's dtype) the buffer no longer
    holds the weights, and the extractor refuses by name; without one (bfloat16 for the engine:
    converted, no flat buffer) a new extractor reads the new storage."""
    cfg = demo_config(**SMALL)
    trainer, _ = build_trainer("fsdp", model_config=cfg, seed=SEED, engine_dtype=engine_dtype, device="cpu")
    try:
        assert (trainer.flat_weights is not None) == (engine_dtype == "float32")
        dtype = getattr(torch, engine_dtype)
        names = [s.name for s in trainer.param_specs()]
        first = trainer.extractor()
        assert trainer.extractor() is first
        anyio.run(trainer.train_step, RolloutResult(reward=0.0, tokens=0, data=rollout_data()))
        assert trainer.extractor() is first
        got, want = dict(first.extract(names)), trainer.hf_state()
        assert list(got) == list(want) and all(torch.equal(got[n], want[n].to(dtype)) for n in want)
        p = dict(trainer.model.named_parameters())["model.norm.weight"]
        local = p.to_local()
        moved = local.detach().clone().fill_(2.5)
        with torch.no_grad():
            p._local_tensor = moved  # the shard rebound to other storage
        if trainer.flat_weights is not None:
            with pytest.raises(ValueError, match="'model.norm.weight' is no longer its view of the flat buffer"):
                trainer.extractor()
            return
        again = trainer.extractor()
        assert again is not first and torch.equal(dict(again.extract(names))["model.norm.weight"], moved.to(dtype))
    finally:
        trainer.close()


def test_one_rank_shards_are_one_flat_buffer_that_fsdp_reads_and_the_optimizer_writes():
    """Issue 44: a one-rank FSDP2 trainer's local shards are adopted into one flat buffer
    (``adopt_shards``), so the engine reads the weights straight from it (the one-copy sync)
    and the memory backend pauses one buffer. FSDP2 must then read the buffer in its forward
    (its all-gather input re-pointed) and the optimizer write into it: a step trains as the
    unsharded reference does, and bytes written into the buffer change the logits."""
    from colo.device.flat_weights import FlatWeights
    from colo.trainers.fsdp import adopt_shards

    cfg = demo_config(**SMALL)
    trainer, _ = build_trainer("fsdp", model_config=cfg, seed=SEED, engine_dtype="float32", device="cpu")
    try:
        flat = trainer.flat_weights
        assert isinstance(flat, FlatWeights)
        params = dict(trainer.model.named_parameters())
        assert list(flat.slots) == list(params) and trainer.tag_bytes()["weights"] == flat.nbytes
        assert all(flat.locate(p.to_local()) == flat.slots[n] for n, p in params.items())
        ref = ReferenceTrainer(build_trainer_model(cfg, SEED), engine_dtype="float32")
        for _ in range(2):
            for t in (trainer, ref):
                anyio.run(t.train_step, RolloutResult(reward=0.0, tokens=0, data=rollout_data()))
        flat.check()  # the step wrote into the shards where they lie
        want = ref.hf_state()
        got = flat.host_tensors()  # on the CPU: the buffer itself
        assert list(got) == list(want)
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=0, atol=STEP_ATOL)
        # the forward reads the buffer: a norm's weight zeroed there is what both models see
        with torch.no_grad():
            flat.tensors["model.norm.weight"].zero_()
            dict(ref.model.named_parameters())["model.norm.weight"].zero_()
        logits = trainer.logits(PROBE)
        assert float(logits.abs().max()) == 0.0  # a zero final norm: every logit 0 (no lm_head bias)
        torch.testing.assert_close(logits, ref.logits(PROBE), rtol=0, atol=0)
    finally:
        trainer.close()
    assert not dist.is_initialized()

    # shards in another dtype than the engine's: converted at every sync, so no buffer to read
    trainer, _ = build_trainer("fsdp", model_config=cfg, seed=SEED, engine_dtype="bfloat16", device="cpu")
    try:
        assert trainer.flat_weights is None
    finally:
        trainer.close()
    with pytest.raises(ValueError, match="one-rank mesh"):
        adopt_shards(build_trainer_model(cfg, SEED), "cpu")


def test_shards_adopted_after_fsdp2s_lazy_init_are_still_what_its_forward_reads(tmp_path):
    """After the first forward FSDP2 no longer re-points its all-gather inputs by itself
    (its lazy init ran): ``adopt_shards`` must do it (through FSDP2's ``_apply``), or the
    forward would go on reading the old shards while the buffer is synced."""
    from torch.distributed.device_mesh import init_device_mesh

    from colo.trainers.fsdp import _reshard, adopt_shards, shard

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    flat = None
    try:
        model = shard(build_trainer_model(demo_config(**SMALL), SEED), init_device_mesh("cpu", (1,)))
        tokens = torch.tensor(PROBE)

        def forward() -> torch.Tensor:
            try:
                return model(tokens).logits
            finally:
                _reshard(model)  # the root keeps its gathered weights after a forward, as the trainer's logits do

        with torch.no_grad():
            before = forward()  # lazy init
            flat = adopt_shards(model, "cpu")
            assert torch.equal(forward(), before)  # the same bytes, now in the buffer
            flat.tensors["model.norm.weight"].zero_()
            assert float(forward().abs().max()) == 0.0
    finally:
        if flat is not None:
            flat.close()
        dist.destroy_process_group()
