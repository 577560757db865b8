"""The megatron-core trainer (``colo demo --trainer megatron``), on the CPU.

transformers is the ground truth: a stock ``Qwen2ForCausalLM`` loaded from the
trainer's ``hf_state()`` must compute the trainer's logits, and the reference
(HF) trainer, started from the same weights, must take the same step.
"""

import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import Qwen2ForCausalLM  # noqa: E402

from colo.trainers.models import build_trainer_model, demo_config  # noqa: E402
from colo.trainers import BUILDERS, build  # noqa: E402
from colo.trainers.hf import ReferenceTrainer  # noqa: E402
from tests.conftest import fixed_batch  # noqa: E402

#: A float32 megatron forward against a float32 transformers forward of the same
#: weights: the same math in a different order (fused QKV, [gate; up]), so they
#: differ by rounding only. Measured 9e-7 on the demo model (|logit| <= 1.4).
FP32_LOGIT_ATOL = 1e-5
#: AdamW's first step moves each weight by lr * g / (|g| + eps): where |g| is far
#: above eps (1e-8) that is lr * sign(g), the same in both trainers up to the
#: rounding of the weight itself (measured <= 1.2e-7); where |g| is near eps the
#: rounding in g shows (measured up to 2e-4, against a bound of 2 * lr).
BIG_GRAD = 1e-6
STEP_ATOL_BIG_GRAD = 1e-6

SMALL = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64)


@pytest.fixture
def trainers():
    """build(config, seed) -> a CPU megatron trainer; every one is closed after the test."""
    made = []

    def make(config, seed=0):
        trainer, saver = build("megatron", model_config=config, seed=seed, engine_dtype="bfloat16", device="cpu")
        assert saver is None
        made.append(trainer)
        return trainer

    yield make
    for t in made:
        t.close()
    assert not dist.is_initialized()


def test_registered():
    assert BUILDERS["megatron"] == "colo.trainers.megatron:build"


def test_starts_from_the_reference_initialisation(trainers):
    config = demo_config()
    trainer = trainers(config, seed=3)
    ref = build_trainer_model(config, 3)
    want = dict(ref.named_parameters())
    got = trainer.hf_state()
    assert sorted(got) == sorted(want)
    for name, t in got.items():
        assert t.dtype == torch.float32 and torch.equal(t, want[name].detach()), name
    assert trainer.num_params() == sum(p.numel() for p in ref.parameters())
    specs = {s.name: s for s in trainer.param_specs()}
    assert sorted(specs) == sorted(want)
    assert all(s.dtype == "bfloat16" and s.shape == tuple(want[n].shape) for n, s in specs.items())
    assert trainer.tag_bytes() == {"weights": 4 * trainer.num_params(), "optimizer": 8 * trainer.num_params()}
    # a real megatron-core GPTModel, in the local spec's layout (fused QKV with bias, [gate; up] fc1)
    from megatron.core.models.gpt import GPTModel

    assert isinstance(trainer.model, GPTModel)
    params = dict(trainer.model.named_parameters())
    assert params["decoder.layers.0.self_attention.linear_qkv.bias"].shape == (256 + 2 * 2 * 64,)
    assert params["decoder.layers.0.mlp.linear_fc1.weight"].shape == (2 * 512, 256)
    assert params["decoder.layers.0.mlp.linear_fc1.weight"].partition_stride == 2


def test_logits_equal_transformers_loaded_from_hf_state(trainers):
    config = demo_config()
    trainer = trainers(config)
    tokens = torch.randint(0, config.vocab_size, (3, 24), generator=torch.Generator().manual_seed(7))
    for _ in range(2):  # at the initial weights, then after a step (weights no longer the init)
        hf = Qwen2ForCausalLM(config).eval()
        hf.load_state_dict(trainer.hf_state(), strict=True)
        with torch.no_grad():
            want = hf(tokens).logits.float()
        got = trainer.logits(tokens.tolist())
        assert got.shape == (3, 24, config.vocab_size) and got.dtype == torch.float32
        assert float((got - want).abs().max()) <= FP32_LOGIT_ATOL
        assert float(want.abs().max()) > 0.1  # not a vacuous comparison
        trainer._reinforce(fixed_batch(config))


def test_steps_like_the_reference_trainer_and_lowers_the_loss(trainers):
    config = demo_config(**SMALL)
    trainer = trainers(config)
    ref = ReferenceTrainer(build_trainer_model(config, 0))
    data = fixed_batch(config)
    before = {n: t.clone() for n, t in trainer.hf_state().items()}
    losses, ref_losses = [], []
    for step in range(3):
        out, ref_out = trainer._reinforce(data), ref._reinforce(data)
        losses.append(out["loss"])
        ref_losses.append(ref_out["loss"])
        assert out["reward"] == pytest.approx(sum(data.rewards) / len(data.rewards))
        if step == 0:
            after = trainer.hf_state()
            lr, beta1 = ref.config.lr, ref.opt.defaults["betas"][0]
            for name, p in ref.model.named_parameters():
                grad = ref.opt.state[p]["exp_avg"] / (1 - beta1)  # the HF trainer's (clipped) gradient
                diff = (after[name] - p.detach()).abs()
                big = grad.abs() > BIG_GRAD
                assert big.float().mean() > 0.5, name  # most of every tensor is compared tightly
                assert float(diff[big].max()) <= STEP_ATOL_BIG_GRAD, name
                assert float(diff.max()) <= lr, name
                # and the step did move the weights: by lr * |g| / (|g| + eps), >= 0.99 lr there
                moved = (after[name] - before[name]).abs()
                assert float(moved[big].min()) == pytest.approx(lr, rel=0.02), name
    assert trainer.steps == 3
    # the same REINFORCE objective, evaluated by each trainer before each step
    assert losses == pytest.approx(ref_losses, abs=1e-6)
    # a loss reported at step k is the objective after k updates on this batch: it falls
    assert losses[0] > losses[1] > losses[2]
    assert losses[0] - losses[2] > 0.2


class PausedBackup:
    """Stands in for the GPU's TrainerMemory with the weights paused: ``host_view``
    gives a fresh tensor holding the parameter's values (as the pinned backup's
    view would), without megatron's tensor-parallel attributes."""

    #: each host_view a new tensor, as a saver that does not keep its backups gives
    retains_backups = False

    def __init__(self):
        self.saver = self

    def resident(self, tag):
        return False

    def host_view(self, p):
        return p.detach().clone()


def test_while_paused_everything_is_read_from_the_host_backup(trainers):
    """The GPU's offload-first path, on the CPU: hf_state, the sync's extractor and
    the probe logits come from the host backup (and an HF twin), not the model."""
    config = demo_config(**SMALL)
    trainer = trainers(config)
    trainer._reinforce(fixed_batch(config))
    tokens = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3)).tolist()
    resident_state, resident_logits = trainer.hf_state(), trainer.logits(tokens)
    live = trainer.extractor()
    resident_sync = dict(live.extract([s.name for s in live.specs()]))

    trainer._memory_backend = PausedBackup()
    state = trainer.hf_state()
    assert sorted(state) == sorted(resident_state)
    assert all(torch.equal(state[n], resident_state[n]) for n in state)
    paused = trainer.extractor()
    assert paused is not live and [s for s in paused.specs()] == [s for s in live.specs()]
    synced = dict(paused.extract([s.name for s in paused.specs()]))
    assert all(t.dtype == torch.bfloat16 and torch.equal(t, resident_sync[n]) for n, t in synced.items())
    # the HF twin computes what the megatron model computes
    assert float((trainer.logits(tokens) - resident_logits).abs().max()) <= FP32_LOGIT_ATOL
    assert trainer._cpu_twin is not None


def test_same_seed_same_weights_after_a_step(trainers):
    config = demo_config(**SMALL)
    data = fixed_batch(config)
    states = []
    for seed in (5, 5, 6):
        t = trainers(config, seed=seed)
        t._reinforce(data)
        states.append(t.hf_state())
        t.close()  # the next build sets up its own process group again
        assert not dist.is_initialized()
    first, again, other = states
    assert all(torch.equal(first[n], again[n]) for n in first)
    assert not all(torch.equal(first[n], other[n]) for n in first)


def test_close_tears_down_only_what_it_set_up(trainers, tmp_path):
    from megatron.core import parallel_state as ps

    config = demo_config(**SMALL)
    t = trainers(config)
    assert dist.is_initialized() and ps.model_parallel_is_initialized()
    t.close()
    t.close()  # idempotent
    assert not dist.is_initialized() and not ps.model_parallel_is_initialized()

    # a caller's own process group is used, and left alone
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        t = trainers(config)
        t._reinforce(fixed_batch(config))
        t.close()
        assert dist.is_initialized() and not ps.model_parallel_is_initialized()
    finally:
        dist.destroy_process_group()


async def test_demo_runs_with_the_megatron_trainer_and_every_sync_verifies(tmp_path, monkeypatch):
    import colo.apps.demo as demo
    from colo.core.invariants import InvariantChecker
    from colo.engine.reference.weights import expected_digest
    from tests.leaks import new_segments
    from colo.trace.writer import read_trace

    built = []
    real_build_trainer = demo.build_trainer

    def build_trainer(cfg, model_config):  # keep hold of the trainer to check it, and close it
        trainer, saver = real_build_trainer(cfg, model_config)
        built.append(trainer)
        return trainer, saver

    monkeypatch.setattr(demo, "build_trainer", build_trainer)
    try:
        # a bfloat16 engine (the CPU demo's default is float32): every sync converts through buckets
        out = await demo.run(demo.DemoConfig(trainer="megatron", steps=2, batch=8, new_tokens=8, bucket_mib=0.5,
                                             engine_dtype="bfloat16", trace=str(tmp_path / "t.jsonl")),
                             progress=False)
        # the demo raises (and reports here) on a digest or probe-logit mismatch after any sync
        assert out.error is None, out.error
        [trainer] = built
        assert trainer.steps == 2
        events = read_trace(out.trace_path)
        checker = InvariantChecker()
        assert [str(v) for i, e in enumerate(events, 1) for v in checker.feed(e, i)] == []
        syncs = [e for e in events if e["event"] == "sync.finished"]
        assert [s["weight_version"] for s in syncs] == [1, 2]
        assert all(s["tensors"] == s["params"] == 4 * 12 + 3 and s["buckets"] > 1 for s in syncs)
        assert len({s["digest"] for s in syncs}) == 2
        # the engine's last digest is the trainer's final weights
        assert syncs[-1]["digest"] == expected_digest(trainer.hf_state(), demo_config(), torch.bfloat16)
        assert len(out.rewards) == 2 and all(0.0 <= r <= 1.0 for r in out.rewards)
        assert new_segments() == []
    finally:
        for t in built:
            t.close()
    assert not dist.is_initialized()
