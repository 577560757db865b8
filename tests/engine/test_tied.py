"""Tied word embeddings (Qwen2/Qwen2.5 0.5B-3B): one parameter is the embedding and lm_head.

The trainer is the stock HF ``Qwen2ForCausalLM`` with ``tie_word_embeddings=True``:
its ``named_parameters()`` lists ``model.embed_tokens.weight`` once and
``lm_head.weight`` is that same tensor. The engine takes the embedding once,
holds it once, hashes it once, and refuses a separate ``lm_head.weight``.
"""

import copy

import pytest
import torch

from colo.core.buckets import spec
from colo.core.interfaces import SyncContext
from colo.core.memory import StagingBudget
from colo.engine.reference.client import EngineClient, EngineError
from colo.engine.reference.core import EngineCore
from colo.core.errors import WeightMismatch
from colo.engine.reference.dims import Dims
from colo.engine.reference.weights import expected_digest, expected_hf_specs
from colo.extractors.plain import PlainExtractor
from colo.testing.trainers import StateTrainer
from colo.trainers.models import build_trainer_model, demo_config
from colo.trainers.hf import ReferenceTrainer
from colo.transports import make_transport
from tests.conftest import SMALL_CFG
from tests.leaks import new_segments

MiB = 1 << 20
EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


@pytest.fixture(scope="module")
def config():
    return demo_config(**SMALL_CFG, tie_word_embeddings=True)


def perturbed(config, scale):
    model = build_trainer_model(config, seed=0).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * (0.1 if "norm" in name else scale))
    return model


@pytest.fixture(scope="module")
def trainer(config):
    # Every tensor perturbed (a misplaced norm or bias would show), and strongly enough
    # that greedy decoding does not just repeat the last token (a tied head at HF's
    # small init scores the input token's own embedding highest).
    return perturbed(config, 0.2)


@pytest.fixture(scope="module")
def state(trainer):
    """What colo's trainer side sends: the named parameters (``hf_state()``)."""
    return {n: p.detach().clone() for n, p in trainer.named_parameters()}


@pytest.fixture(scope="module")
def probe(config):
    return torch.randint(0, config.vocab_size, (4, 24), generator=torch.Generator().manual_seed(3))


def make_core(config, *, dtype=torch.float32, init_state=None):
    return EngineCore(config, dtype=dtype, device="cpu", total_bytes=8 * MiB, mem_fraction_static=0.5,
                      init_state=init_state)


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(input_ids=tokens).logits.float()


# -- the math ----------------------------------------------------------------------

def test_float32_logits_match_the_tied_trainer_and_the_digest_matches(config, trainer, state, probe):
    assert LM_HEAD not in state and EMBED in state
    core = make_core(config, init_state=state)
    # the untied case's bound (tests/engine/test_core.py)
    torch.testing.assert_close(core.logits(probe), hf_logits(trainer, probe), rtol=1e-4, atol=1e-5)
    assert core.digest() == expected_digest(state, config, torch.float32)


def test_greedy_tokens_equal_transformers_generate(config, trainer, state, probe):
    core = make_core(config, init_state=state)
    prompts = probe[:, :8]
    got, _ = core.generate(prompts, 16, temperature=0.0, generator=torch.Generator())
    with torch.no_grad():
        ref = trainer.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=16,
                               do_sample=False)
    assert torch.equal(got, ref[:, 8:])
    assert len(set(got.reshape(-1).tolist())) > 16  # not one repeated token per row


def test_bfloat16_logits_are_within_the_untied_bound(config, probe):
    # the untied case's weights scale (0.05) and bound: bfloat16's error grows with the activations
    trainer = perturbed(config, 0.05)
    state = {n: p.detach() for n, p in trainer.named_parameters()}
    core = make_core(config, dtype=torch.bfloat16, init_state=state)
    got, ref = core.logits(probe), hf_logits(trainer, probe)
    ref_bf16 = hf_logits(copy.deepcopy(trainer).to(torch.bfloat16), probe)
    scale = ref.abs().max().item()
    assert (got - ref).abs().max().item() <= 0.03 * scale
    assert (got - ref_bf16).abs().max().item() <= 0.03 * scale
    assert core.digest() == expected_digest(state, config, torch.bfloat16)


def test_one_parameter_serves_both_ends(config, state, probe):
    core = make_core(config, init_state=state)
    params = dict(core.model.named_parameters())
    assert LM_HEAD not in params and list(params)[0] == EMBED
    # the embedding is held once: the weights are the trainer's parameters, 4 bytes each
    assert core.tag_bytes()["weights"] == sum(t.numel() for t in state.values()) * 4
    untied = make_core(demo_config(**SMALL_CFG))
    assert untied.tag_bytes()["weights"] - core.tag_bytes()["weights"] == 128 * 64 * 4
    # a change to the one tensor moves the logits through the head as well: token 5's
    # own row is not read by the embedding when 5 is not in the input
    tokens = torch.tensor([[1, 2, 3]])
    before = core.logits(tokens)
    changed = dict(state)
    changed[EMBED] = state[EMBED].clone()
    changed[EMBED][5] += 1.0
    core.begin_load()
    core.load_weights(changed)
    core.end_load()
    after = core.logits(tokens)
    moved = (after - before).abs()[0, -1]
    assert moved[5] > 0.1 and torch.equal(moved[torch.arange(128) != 5], torch.zeros(127))
    assert core.digest() == expected_digest(changed, config, torch.float32) != expected_digest(state, config,
                                                                                               torch.float32)


# -- the name map and preflight ----------------------------------------------------------

def test_param_specs_are_the_trainers_named_parameters(config, trainer, state):
    specs = make_core(config).param_specs()
    assert {s.name: s.shape for s in specs} == {n: tuple(t.shape) for n, t in state.items()}
    assert len(specs) == len(state) and specs[0].name == EMBED
    assert specs == expected_hf_specs(config, torch.float32)
    assert Dims.from_config(config).tie_word_embeddings is True
    # the trainer's extractor sends the embedding once, though state_dict() lists lm_head too
    assert LM_HEAD in trainer.state_dict()
    assert [s.name for s in PlainExtractor(trainer, dtype=torch.float32).specs()] == list(state)


def test_preflight_refuses_a_missing_embedding_by_name(config, state):
    core = make_core(config, init_state=state)
    good = core.param_specs()
    assert core.preflight(good) is None
    with pytest.raises(WeightMismatch) as err:
        core.preflight([s for s in good if s.name != EMBED])
    assert err.value.missing == (EMBED,) and EMBED in str(err.value)
    assert err.value.unexpected == err.value.wrong_shape == ()


def test_preflight_refuses_a_mismatched_embedding_shape_by_name(config, state):
    core = make_core(config, init_state=state)
    bad = [spec(s.name, (128, 65), s.dtype) if s.name == EMBED else s for s in core.param_specs()]
    with pytest.raises(WeightMismatch) as err:
        core.preflight(bad)
    assert err.value.wrong_shape == (f"{EMBED} (128, 65) (expected (128, 64))",)
    assert err.value.missing == ()


def test_a_separate_lm_head_is_refused_by_name_in_preflight_and_in_a_load(config, state):
    core = make_core(config, init_state=state)
    why = f"{LM_HEAD} (the config ties word embeddings: {EMBED} is also the lm_head; send it once, without {LM_HEAD})"
    with pytest.raises(WeightMismatch) as err:
        core.preflight(core.param_specs() + [spec(LM_HEAD, (128, 64), "float32")])
    assert err.value.unexpected == (why,) and err.value.missing == ()
    assert "unexpected (1): " + why in str(err.value)
    # equal bytes or not, the second name is refused, and nothing of the batch is written
    before = core.digest()
    core.begin_load()
    with pytest.raises(WeightMismatch) as err:
        core.load_weights([(EMBED, state[EMBED] + 1), (LM_HEAD, state[EMBED] + 1)])
    assert err.value.unexpected == (why,)
    assert core.model.digest() == before
    core.load_weights(state)
    with pytest.raises(WeightMismatch, match="the config ties word embeddings"):
        core.end_load()
    assert core.digest() == before
    # the digest of a state_dict (which lists lm_head too) is refused the same way
    with pytest.raises(WeightMismatch, match="lm_head.weight \\(the config ties word embeddings"):
        expected_digest({**state, LM_HEAD: state[EMBED]}, config, torch.float32)


def test_an_untied_config_still_wants_its_own_lm_head():
    specs = expected_hf_specs(demo_config(**SMALL_CFG), torch.float32)
    assert specs[-1].name == LM_HEAD and specs[0].name == EMBED


# -- the trainer side ---------------------------------------------------------------------

class _PausedBackend:
    """A memory backend whose weights are paused: hf_state reads its host copies."""

    def __init__(self, model):
        self.saver = self
        self._host = {id(p): p.detach().clone() for p in model.parameters()}

    def resident(self, tag):
        return False

    def host_view(self, p):
        return self._host[id(p)]


def test_the_trainers_paused_logits_rebuild_the_tie(trainer, probe):
    ref = ReferenceTrainer(copy.deepcopy(trainer), engine_dtype="float32")
    paused = ReferenceTrainer(copy.deepcopy(trainer), engine_dtype="float32")
    paused._memory_backend = _PausedBackend(paused.model)
    assert list(paused.hf_state()) == list(ref.hf_state()) and LM_HEAD not in paused.hf_state()
    torch.testing.assert_close(paused.logits(probe[:2].tolist()), ref.logits(probe[:2].tolist()),
                               rtol=0, atol=0)


# -- end to end through the engine process ------------------------------------------------

async def test_a_packed_sync_into_a_spawned_engine_loads_the_tied_model(config, trainer, state, tmp_path,
                                                                        no_leftover_segments):
    build = {"config": config.to_dict(), "dtype": "float32", "device": "cpu", "total_bytes": 64 << 20,
             "mem_fraction_static": 0.5, "checkpoint": None, "log_path": str(tmp_path / "engine.log")}
    client = await EngineClient.spawn(build)
    transport = make_transport("packed")
    try:
        assert sorted(s.name for s in client.specs) == sorted(state)
        # the module itself, whose state_dict() holds lm_head.weight as well
        ctx = SyncContext(step=0, weight_version=1, bucket_bytes=16 << 10, source="host", staging=StagingBudget(None))
        result = await transport.sync(StateTrainer(trainer), client, ctx)
        assert result.tensors == len(state) and result.bytes == sum(t.numel() * 4 for t in state.values())
        assert await client.digest() == expected_digest(state, config, torch.float32)
        await client.set_weight_version(1)
        probe = [[1, 2, 3, 4, 5, 6, 7, 8]]
        got = torch.tensor(await client.logits(probe))
        torch.testing.assert_close(got, hf_logits(trainer, torch.tensor(probe)), rtol=1e-4, atol=1e-5)
        with pytest.raises(EngineError, match="lm_head.weight \\(the config ties word embeddings"):
            await client.preflight(list(client.specs) + [spec(LM_HEAD, (128, 64), "float32")])
    finally:
        await transport.aclose()
        await client.aclose()
    assert new_segments() == []
