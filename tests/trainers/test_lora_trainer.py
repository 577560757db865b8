"""The LoRA trainer (colo.trainers.lora) against PEFT itself: what it syncs is exactly PEFT's
saved adapter (names, shapes, order, bytes), what an engine starts from is exactly the base
model's Hugging Face tensors, its optimizer holds the adapter alone, and a step that fails puts
the adapter and its moments back."""

from __future__ import annotations

import copy

import pytest
import torch

peft = pytest.importorskip("peft")

from colo.core.interfaces import RolloutResult  # noqa: E402
from colo.digest import expected_weights_digest  # noqa: E402
from colo.models.arch import hf_shapes  # noqa: E402
from colo.models.lora import adapter_shapes  # noqa: E402
from colo.tasks import RolloutData  # noqa: E402
from colo.trainers.lora import build  # noqa: E402
from colo.trainers.models import build_trainer_model, demo_model_config, trained_stand_in  # noqa: E402
from tests.archs import tiny_config  # noqa: E402


@pytest.fixture(scope="module", params=["qwen2", "qwen2-tied", "llama", "qwen3"])
def trainer(request):
    return build(model_config=tiny_config(request.param), seed=4, engine_dtype="float32", device="cpu", rank=4)[0]


def test_what_it_syncs_is_peft_s_saved_adapter_and_what_an_engine_starts_from_is_the_base(trainer):
    saved = peft.get_peft_model_state_dict(trainer.model)
    state = trainer.hf_state()
    assert list(state) == list(saved) == list(adapter_shapes(trainer.model.config, trainer.adapter))
    assert all(torch.equal(state[n], saved[n]) for n in saved)
    assert [s.name for s in trainer.param_specs()] == list(saved)
    assert trainer.sent_digest() == expected_weights_digest(saved, list(saved), torch.float32)
    base = trainer.start_state()
    assert sorted(base) == sorted(hf_shapes(trainer.model.config))
    # the base is the model the adapter sits on: PEFT's own unwrapping of it (B is still 0, so
    # merging changes no weight), name for name
    merged = dict(copy.deepcopy(trainer.model).merge_and_unload().named_parameters())
    assert set(merged) == set(base) and all(torch.equal(base[n], merged[n]) for n in base)
    assert trainer.num_params() + trainer.base_params() == sum(p.numel() for p in trainer.model.parameters())
    assert {id(p) for g in trainer.opt.param_groups for p in g["params"]} == \
        {id(p) for p in trainer.adapter_params.values()}
    assert trainer.tag_bytes()["optimizer"] == 2 * 4 * trainer.num_params()


def test_a_step_trains_the_adapter_only_and_a_failed_step_puts_it_back():
    config = demo_model_config("demo")
    trainer, _ = build(model_config=config, seed=0, engine_dtype="float32", device="cpu", rank=8)
    base = {n: t.clone() for n, t in trainer.start_state().items()}
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, config.vocab_size, (8, 4), generator=g).tolist()
    completions = torch.randint(0, config.vocab_size, (8, 6), generator=g).tolist()
    data = RolloutData(prompts, completions, [float(i % 3) for i in range(8)])
    before = trainer.sent_digest()
    import anyio

    anyio.run(trainer.train_step, RolloutResult(reward=1.0, tokens=48, data=data))
    after = {n: t.clone() for n, t in trainer.hf_state().items()}
    assert trainer.sent_digest() != before
    assert all(torch.equal(base[n], t) for n, t in trainer.start_state().items())  # the base is frozen
    moments = {id(p): s["exp_avg"].clone() for p, s in trainer.opt.state.items()}
    bad = RolloutData(prompts, [c[:-1] + [config.vocab_size + 5] for c in completions], data.rewards)  # out of range
    with pytest.raises((IndexError, RuntimeError)):
        anyio.run(trainer.train_step, RolloutResult(reward=1.0, tokens=48, data=bad))
    assert all(torch.equal(after[n], t) for n, t in trainer.hf_state().items())
    assert all(torch.equal(moments[id(p)], s["exp_avg"]) for p, s in trainer.opt.state.items())


def test_the_built_in_base_is_moved_off_its_init_seeded_and_a_checkpoint_s_is_taken_as_it_is(tmp_path):
    config = demo_model_config("demo")
    a = build(model_config=config, seed=2, engine_dtype="float32", device="cpu", rank=8)[0].start_state()
    b = build(model_config=config, seed=2, engine_dtype="float32", device="cpu", rank=8)[0].start_state()
    init = dict(build_trainer_model(config, 2).named_parameters())
    assert all(torch.equal(a[n], b[n]) for n in a)
    moved = trained_stand_in(build_trainer_model(config, 2), 2)
    assert all(torch.equal(a[n], t) for n, t in moved.named_parameters())
    assert not any(torch.equal(a[n], init[n]) for n in a)
    build_trainer_model(config, 5).save_pretrained(tmp_path)
    c = build(model_config=None, checkpoint=str(tmp_path), seed=2, engine_dtype="float32", device="cpu",
              rank=8)[0].start_state()
    assert all(torch.equal(c[n], t) for n, t in build_trainer_model(config, 5).named_parameters())


def test_what_the_lora_trainer_does_not_take_is_refused_naming_it():
    config = demo_model_config("demo")
    with pytest.raises(ValueError, match="runs on the CPU only so far"):
        build(model_config=config, seed=0, engine_dtype="bfloat16", device="cuda", rank=8)
    with pytest.raises(ValueError, match="adapter rank r must be an integer in"):
        build(model_config=config, seed=0, engine_dtype="float32", device="cpu", rank=0)
