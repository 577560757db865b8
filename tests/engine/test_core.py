"""The engine model and EngineCore against the HF trainer model, on CPU."""

import copy
import gc
import weakref

import pytest
import torch
from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

from colo.core.buckets import spec
from colo.engine.reference.core import EngineCore
from colo.core.errors import EngineStateError, KVPoolTooSmall, WeightMismatch
from colo.engine.reference.dims import Dims
from colo.engine.reference.model import EngineModel
from colo.engine.reference.weights import expected_digest, expected_hf_specs
from colo.trainers.models import build_trainer_model, demo_config
from tests.syncparts import calls_of

SMALL = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64)
MiB = 1 << 20


@pytest.fixture(scope="module")
def config():
    return demo_config(**SMALL)


@pytest.fixture(scope="module")
def trainer(config):
    model = build_trainer_model(config, seed=0).eval()
    # HF initialises biases to 0 and norms to 1: perturb every tensor so a
    # misplaced bias or norm row would change the logits
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * (0.1 if "norm" in name else 0.05))
    return model


@pytest.fixture(scope="module")
def state(trainer):
    return {k: v.clone() for k, v in trainer.state_dict().items()}


@pytest.fixture(scope="module")
def probe(config):
    return torch.randint(0, config.vocab_size, (4, 24), generator=torch.Generator().manual_seed(3))


def make_core(config, *, dtype=torch.float32, total_bytes=8 * MiB, mfs=0.5, init_state=None):
    return EngineCore(config, dtype=dtype, device="cpu", total_bytes=total_bytes, mem_fraction_static=mfs,
                      init_state=init_state)


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(input_ids=tokens).logits.float()


def full_forward_logprobs(core, prompts, completions):
    logits = core.logits(torch.cat([prompts, completions], dim=1))
    plen = prompts.shape[1]
    lp = torch.log_softmax(logits[:, plen - 1:-1], dim=-1)
    return lp.gather(-1, completions[..., None]).squeeze(-1)


# -- agreement with the trainer ------------------------------------------------

def test_float32_engine_logits_match_the_trainer_and_digest_matches(config, trainer, state, probe):
    core = make_core(config, init_state=state)
    assert core.weight_version == 0
    # Same math in the same precision: measured bit-identical on torch 2.13 CPU;
    # the bound leaves room for other kernels' summation order.
    torch.testing.assert_close(core.logits(probe), hf_logits(trainer, probe), rtol=1e-4, atol=1e-5)
    assert core.digest() == expected_digest(state, config, torch.float32)


def test_bfloat16_engine_logits_are_within_bfloat16_error_of_the_trainer(config, trainer, state, probe):
    core = make_core(config, dtype=torch.bfloat16, init_state=state)
    got = core.logits(probe)
    assert got.dtype == torch.float32
    ref = hf_logits(trainer, probe)
    ref_bf16 = hf_logits(copy.deepcopy(trainer).to(torch.bfloat16), probe)
    scale = ref.abs().max().item()
    # bfloat16 keeps 8 significant bits; measured max error 1.0-1.2% of the
    # largest logit here (2.2% on the 4-layer demo config), the same size as
    # HF's own bfloat16 model's error against float32. Bound: 3%.
    assert (got - ref).abs().max().item() <= 0.03 * scale
    assert (ref_bf16 - ref).abs().max().item() > 0.001 * scale  # the error is bf16's, not zero
    assert (got - ref_bf16).abs().max().item() <= 0.03 * scale
    assert core.digest() == expected_digest(state, config, torch.bfloat16)
    assert core.digest() != expected_digest(state, config, torch.float32)


def test_digest_changes_with_one_element(config, state):
    core = make_core(config, init_state=state)
    before = core.digest()
    changed = dict(state)
    changed["model.layers.1.mlp.up_proj.weight"] = state["model.layers.1.mlp.up_proj.weight"].clone()
    changed["model.layers.1.mlp.up_proj.weight"][3, 5] += 1.0
    assert expected_digest(changed, config, torch.float32) != before
    core.begin_load()
    core.load_weights(changed)
    core.end_load()
    assert core.digest() == expected_digest(changed, config, torch.float32) != before


# -- the name map --------------------------------------------------------------

def test_param_specs_are_the_trainer_state_dict_in_the_engine_dtype(config, state):
    specs = make_core(config, dtype=torch.bfloat16).param_specs()
    assert {s.name: s.shape for s in specs} == {k: tuple(v.shape) for k, v in state.items()}
    assert len(specs) == len(state) and {s.dtype for s in specs} == {"bfloat16"}
    assert specs == expected_hf_specs(config, torch.bfloat16)


def test_every_engine_element_is_written_by_exactly_one_hf_tensor(config):
    core = make_core(config)
    specs = core.param_specs()
    for _, p in core.model.named_parameters():
        p.fill_(-1.0)
    # HF tensor i is filled with i + 1: the value of an engine element names its source
    core.begin_load()
    core.load_weights((s.name, torch.full(s.shape, float(i + 1))) for i, s in enumerate(specs))
    core.end_load()
    values = torch.cat([p.reshape(-1) for _, p in core.model.named_parameters()])
    assert (values > 0).all(), "some engine element was written by no HF tensor"
    counts = torch.bincount(values.long(), minlength=len(specs) + 1)
    expected = torch.tensor([0] + [t.nbytes // 4 for t in specs])
    assert torch.equal(counts, expected)
    # and the row blocks are where SGLang puts them: qkv = [q; k; v], gate_up = [gate; up]
    params = dict(core.model.named_parameters())
    value = {s.name: i + 1 for i, s in enumerate(specs)}
    pre = "model.layers.1."
    qkv, qkv_b = params[pre + "self_attn.qkv_proj.weight"], params[pre + "self_attn.qkv_proj.bias"]
    assert qkv.shape == (64 + 32 + 32, 64)
    for rows, part in ((slice(0, 64), "q"), (slice(64, 96), "k"), (slice(96, 128), "v")):
        assert (qkv[rows] == value[f"{pre}self_attn.{part}_proj.weight"]).all()
        assert (qkv_b[rows] == value[f"{pre}self_attn.{part}_proj.bias"]).all()
    gate_up = params[pre + "mlp.gate_up_proj.weight"]
    assert (gate_up[:128] == value[pre + "mlp.gate_proj.weight"]).all()
    assert (gate_up[128:] == value[pre + "mlp.up_proj.weight"]).all()


def test_end_load_lists_every_missing_name_at_once(config, state):
    core = make_core(config, init_state=state)
    left_out = ["model.layers.0.self_attn.k_proj.bias", "model.layers.1.mlp.up_proj.weight", "lm_head.weight"]
    core.begin_load()
    assert core.weight_version is None  # from the first byte on, the old version is gone
    core.load_weights((k, v) for k, v in state.items() if k not in left_out)
    with pytest.raises(WeightMismatch) as err:
        core.end_load()
    assert sorted(err.value.missing) == sorted(left_out)
    assert err.value.duplicate == err.value.unexpected == ()
    assert all(name in str(err.value) for name in left_out)
    with pytest.raises(EngineStateError, match="not been completely loaded"):
        core.set_weight_version(1)
    assert core.weight_version is None


def test_duplicate_and_unknown_names_refuse_the_whole_batch_and_are_listed_again_at_end(config, state):
    core = make_core(config, init_state=state)
    names = list(state)
    core.begin_load()
    core.load_weights((n, state[n]) for n in names[:5])
    before = core.digest()
    batch = [(names[0], state[names[0]] + 1),            # already loaded
             ("model.layers.9.mlp.up_proj.weight", state[names[0]]),
             ("bogus", torch.zeros(3)),
             (names[5], state[names[5]] + 1),            # fine, but the batch is refused
             (names[6], state[names[6]]), (names[6], state[names[6]])]  # twice in one batch
    with pytest.raises(WeightMismatch) as err:
        core.load_weights(batch)
    assert err.value.duplicate == (names[0], names[6])
    assert err.value.unexpected == ("model.layers.9.mlp.up_proj.weight", "bogus")
    assert core.digest() == before  # nothing from the batch was written
    core.load_weights((n, state[n]) for n in names[5:])
    with pytest.raises(WeightMismatch) as err:
        core.end_load()
    assert err.value.missing == ()
    assert err.value.duplicate == (names[0], names[6])
    assert err.value.unexpected == ("model.layers.9.mlp.up_proj.weight", "bogus")


def test_wrong_shape_in_a_batch_is_refused(config, state):
    core = make_core(config, init_state=state)
    core.begin_load()
    with pytest.raises(WeightMismatch) as err:
        core.load_weights([("model.norm.weight", torch.ones(63))])
    assert err.value.wrong_shape == ("model.norm.weight (63,) (expected (64,))",)


def test_preflight_lists_every_mismatch_and_leaves_weights_untouched(config, state):
    core = make_core(config, init_state=state)
    before = core.digest()
    good = core.param_specs()
    assert core.preflight(good) is None
    assert core.preflight([(s.name, s.shape, s.dtype) for s in good]) is None
    by_name = {s.name: s for s in good}
    bad = [s for s in good if s.name != "model.layers.0.mlp.down_proj.weight"]   # missing
    bad.append(spec("model.layers.2.mlp.gate_proj.weight", (128, 64), "float32"))  # extra
    bad.append(spec("extra.bias", (4,), "float32"))                                # extra
    bad = [spec(s.name, (32, 64), s.dtype) if s.name == "lm_head.weight" else s for s in bad]  # shape
    bad = [spec(s.name, s.shape, "bfloat16") if s.name == "model.norm.weight" else s for s in bad]  # dtype
    bad.append(by_name["model.embed_tokens.weight"])                               # duplicate
    with pytest.raises(WeightMismatch) as err:
        core.preflight(bad)
    e = err.value
    assert e.missing == ("model.layers.0.mlp.down_proj.weight",)
    assert e.unexpected == ("model.layers.2.mlp.gate_proj.weight", "extra.bias")
    assert e.wrong_shape == ("lm_head.weight (32, 64) (expected (128, 64))",)
    assert e.wrong_dtype == ("model.norm.weight bfloat16 (expected float32)",)
    assert e.duplicate == ("model.embed_tokens.weight",)
    assert isinstance(e, ValueError)
    for text in ("missing (1)", "unexpected (2)", "wrong shape (1)", "wrong dtype (1)", "duplicate (1)"):
        assert text in str(e)
    assert core.digest() == before and core.weight_version == 0


def test_expected_digest_refuses_an_incomplete_state(config, state):
    partial = {k: v for k, v in state.items() if k != "model.norm.weight"}
    with pytest.raises(WeightMismatch, match="model.norm.weight"):
        expected_digest(partial, config, torch.float32)


def test_unsupported_configs_are_refused_by_name():
    # tied word embeddings are supported: tests/engine/test_tied.py
    with pytest.raises(ValueError, match="use_sliding_window=True"):
        Dims.from_config(demo_config(**SMALL, use_sliding_window=True))
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        Dims.from_config(demo_config(**SMALL, hidden_act="gelu"))
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        Dims.from_config(demo_config(**{**SMALL, "num_key_value_heads": 3}))


# -- the KV pool ---------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mfs", [0.3, 0.5, 0.9])
def test_kv_pool_is_total_times_mem_fraction_static_minus_weights(config, dtype, mfs):
    total = 8 * MiB
    core = make_core(config, dtype=dtype, total_bytes=total, mfs=mfs)
    size = 4 if dtype == torch.float32 else 2
    weight_bytes = sum(s.nbytes for s in core.param_specs())
    slot_bytes = 2 * 2 * 32 * size  # layers x (K, V) x kv_heads * head_dim x itemsize
    budget = int(total * mfs) - weight_bytes
    # the pool is a whole number of token slots: short of the budget by less than one
    assert core.kv_bytes == budget // slot_bytes * slot_bytes
    assert 0 <= budget - core.kv_bytes < slot_bytes
    assert core.tag_bytes() == {"weights": weight_bytes, "kv_cache": core.kv_bytes, "cuda_graph": 0}
    pool = core.model.kv_pool
    assert pool.shape == (2, 2, core.kv_bytes // slot_bytes, 2, 16) and pool.dtype == dtype
    assert core.resident_bytes() == core.tag_bytes()


def test_kv_pool_refuses_a_fraction_that_leaves_no_room(config):
    weight_bytes = sum(s.nbytes for s in expected_hf_specs(config, torch.float32))
    with pytest.raises(KVPoolTooSmall, match="no room for a KV pool"):
        make_core(config, total_bytes=4 * MiB, mfs=weight_bytes / (4 * MiB) * 0.99)
    slot_bytes = 512
    # one slot short of a max-length (64-token) sequence
    with pytest.raises(KVPoolTooSmall, match="one sequence of max length needs 64"):
        make_core(config, total_bytes=weight_bytes + 63 * slot_bytes, mfs=1.0)
    assert make_core(config, total_bytes=weight_bytes + 64 * slot_bytes, mfs=1.0).model.num_slots == 64
    with pytest.raises(ValueError, match="mem_fraction_static must be in"):
        make_core(config, mfs=1.5)


# -- release / resume ----------------------------------------------------------

def test_release_frees_the_tensors_and_resume_makes_the_engine_stale(config, state, probe):
    core = make_core(config, init_state=state)
    g = torch.Generator().manual_seed(0)
    core.generate(probe[:, :4], 4, generator=g)
    weight_ref = weakref.ref(dict(core.model.named_parameters())["lm_head.weight"])
    pool_ref = weakref.ref(core.model.kv_pool)
    core.flush_cache()
    core.release(["kv_cache", "cuda_graph", "weights"])
    gc.collect()
    assert weight_ref() is None and pool_ref() is None
    assert core.resident_bytes() == {"weights": 0, "kv_cache": 0, "cuda_graph": 0}
    assert core.paused_tags == {"weights", "kv_cache", "cuda_graph"}
    assert core.weight_version is None
    with pytest.raises(EngineStateError, match="KV cache is released"):
        core.generate(probe, 4, generator=g)
    for call in (lambda: core.logits(probe), core.digest, core.begin_load,
                 lambda: core.load_weights(state), lambda: core.set_weight_version(0)):
        with pytest.raises(EngineStateError, match="weights are released"):
            call()
    with pytest.raises(EngineStateError, match="already released"):
        core.release(["weights"])

    core.resume(["weights"])
    assert core.resident_bytes()["weights"] == core.tag_bytes()["weights"]
    assert core.resident_bytes()["kv_cache"] == 0
    with pytest.raises(EngineStateError, match="not been completely loaded"):
        core.set_weight_version(1)  # the storage is fresh and uninitialised
    core.begin_load()
    core.load_weights(state)
    core.end_load()
    assert core.digest() == expected_digest(state, config, torch.float32)
    core.set_weight_version(1)
    with pytest.raises(EngineStateError, match="KV cache is released"):
        core.generate(probe, 4, generator=g)
    core.resume(["kv_cache", "cuda_graph"])
    assert core.resident_bytes() == core.tag_bytes() and core.paused_tags == frozenset()
    with pytest.raises(EngineStateError, match="already resident"):
        core.resume(["kv_cache"])
    completions, _ = core.generate(probe[:, :4], 4, generator=g)
    assert completions.shape == (4, 4)


def test_tag_calls_are_checked_whole_before_acting(config, state):
    core = make_core(config, init_state=state)
    core.release(["weights"])
    with pytest.raises(EngineStateError, match="weights: already released"):
        core.release(["kv_cache", "weights"])
    assert core.paused_tags == {"weights"} and core.resident_bytes()["kv_cache"] == core.kv_bytes
    with pytest.raises(ValueError, match="unknown tag"):
        core.release(["optimizer"])
    with pytest.raises(ValueError, match="twice in one call"):
        core.release(["kv_cache", "kv_cache"])
    assert core.paused_tags == {"weights"}


def test_generation_is_refused_while_stale(config, state, probe):
    core = make_core(config)  # no init_state: nothing loaded
    g = torch.Generator().manual_seed(0)
    with pytest.raises(EngineStateError, match="stale"):
        core.generate(probe, 4, generator=g)
    core.begin_load()
    core.load_weights(state)
    core.end_load()
    with pytest.raises(EngineStateError, match="stale"):
        core.generate(probe, 4, generator=g)  # loaded, but no version recorded yet
    core.set_weight_version(3)
    assert core.weight_version == 3
    core.begin_load()  # a new sync starts: stale again
    with pytest.raises(EngineStateError, match="stale"):
        core.generate(probe, 4, generator=g)
    with pytest.raises(ValueError, match="non-negative int"):
        core.set_weight_version(-1)


# -- generation through the pool -----------------------------------------------

def test_sampled_logprobs_through_the_pool_equal_a_full_forward(config, state, probe):
    core = make_core(config, init_state=state)
    prompts = probe[:3, :5]
    completions, logprobs = core.generate(prompts, 12, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert completions.shape == logprobs.shape == (3, 12)
    assert completions.dtype == torch.long and logprobs.dtype == torch.float32
    torch.testing.assert_close(logprobs, full_forward_logprobs(core, prompts, completions), rtol=0, atol=1e-5)
    assert core.model.slots.free_slots == core.model.num_slots  # every slot handed back


def test_greedy_generation_through_the_pool_equals_argmax_of_full_forwards(config, state, probe):
    core = make_core(config, init_state=state)
    prompts = probe[:, :6]
    completions, logprobs = core.generate(prompts, 10, temperature=0.0, generator=torch.Generator())
    seq = prompts
    for _ in range(10):
        seq = torch.cat([seq, core.logits(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(completions, seq[:, 6:])
    torch.testing.assert_close(logprobs, full_forward_logprobs(core, prompts, completions), rtol=0, atol=1e-5)


def test_sampled_tokens_are_inverse_cdf_draws_from_full_forwards(config, state, probe):
    """The tokens themselves, not only their logprobs: each is the draw the same uniform makes
    from softmax(logits) of a full forward over the sequence so far (no cache), row by row."""
    core = make_core(config, init_state=state)
    prompts, steps = probe[:, :6], 10
    completions, _ = core.generate(prompts, steps, temperature=1.0, generator=torch.Generator().manual_seed(7))
    uniforms = torch.rand((4, steps), generator=torch.Generator().manual_seed(7))  # as generate draws them
    seq = prompts
    for step in range(steps):
        cdf = torch.log_softmax(core.logits(seq)[:, -1], dim=-1).exp().cumsum(dim=-1)
        tok = torch.searchsorted(cdf, (uniforms[:, step] * cdf[:, -1])[:, None], right=True)
        seq = torch.cat([seq, tok.clamp_max(config.vocab_size - 1)], dim=1)
    assert torch.equal(completions, seq[:, 6:])
    assert len(set(completions.flatten().tolist())) > 10  # sampled, not one token over and over


def test_the_pool_holds_each_sequences_post_rope_keys_and_values(config, trainer, state, probe):
    core = make_core(config, init_state=state)
    prompts = probe[:2, :5]
    completions, _ = core.generate(prompts, 6, temperature=0.0, generator=torch.Generator())
    fed = torch.cat([prompts, completions[:, :-1]], dim=1)  # the last token is never fed back
    # layer 0 through HF's own modules
    with torch.no_grad():
        attn = trainer.model.layers[0].self_attn
        x = trainer.model.layers[0].input_layernorm(trainer.model.embed_tokens(fed))
        k = attn.k_proj(x).view(2, 10, 2, 16).transpose(1, 2)
        v = attn.v_proj(x).view(2, 10, 2, 16)
        cos, sin = trainer.model.rotary_emb(x, torch.arange(10)[None])
        _, k = apply_rotary_pos_emb(k, k, cos, sin)
    pool = core.model.kv_pool
    # first fit over an empty pool: row 0 took slots 0..9, row 1 slots 10..19
    for row in range(2):
        slots = slice(10 * row, 10 * row + 10)
        torch.testing.assert_close(pool[0, 0, slots], k[row].transpose(0, 1), rtol=0, atol=1e-5)
        torch.testing.assert_close(pool[0, 1, slots], v[row], rtol=0, atol=1e-5)


def test_decode_steps_read_keys_and_values_from_the_pool(config, state, probe, monkeypatch):
    core = make_core(config, init_state=state)
    prompts = probe[:2, :5]
    g = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    clean, clean_lp = core.generate(prompts, 6, temperature=0.0, generator=g())
    model = core.model
    original = model._store_and_gather

    def scribble(layer, k, v, kv, start):
        # overwrite what earlier calls wrote (kv: the rows' slots, a view of the pool): only a
        # reader of the pool notices
        if start > 0:
            assert kv.untyped_storage().data_ptr() == model.kv_pool.untyped_storage().data_ptr()
            kv[layer, :, :, :start] = 0
        return original(layer, k, v, kv, start)

    monkeypatch.setattr(model, "_store_and_gather", scribble)
    _, lp = core.generate(prompts, 6, temperature=0.0, generator=g())
    assert torch.equal(lp[:, 0], clean_lp[:, 0])  # the first token comes from the prefill alone
    assert (lp[:, 1:] - clean_lp[:, 1:]).abs().max() > 1e-3


def test_a_small_pool_generates_in_chunks_with_the_same_result(config, state, probe):
    big = make_core(config, init_state=state)
    weight_bytes = big.tag_bytes()["weights"]
    small = make_core(config, init_state=state, total_bytes=weight_bytes + 64 * 512, mfs=1.0)
    assert small.model.num_slots == 64  # 15 slots per sequence: 4 rows per chunk, so 2 chunks
    prompts = torch.cat([probe, probe[:2]])[:, :8]
    a = big.generate(prompts, 8, generator=torch.Generator().manual_seed(5))
    b = small.generate(prompts, 8, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a[0], b[0])
    torch.testing.assert_close(a[1], b[1], rtol=0, atol=1e-5)


def test_generation_is_reproducible_with_a_seeded_generator(config, state, probe):
    core = make_core(config, init_state=state)
    prompts = probe[:, :4]
    a = core.generate(prompts, 10, temperature=1.0, generator=torch.Generator().manual_seed(11))
    b = core.generate(prompts, 10, temperature=1.0, generator=torch.Generator().manual_seed(11))
    c = core.generate(prompts, 10, temperature=1.0, generator=torch.Generator().manual_seed(12))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
    g = torch.Generator().manual_seed(11)
    first, second = core.generate(prompts, 10, generator=g), core.generate(prompts, 10, generator=g)
    assert torch.equal(first[0], a[0]) and not torch.equal(second[0], a[0])  # the generator advances


def test_generate_refuses_sequences_longer_than_the_model(config, state, probe):
    core = make_core(config, init_state=state)
    with pytest.raises(ValueError, match="exceeds max_position_embeddings 64"):
        core.generate(probe[:, :20], 45, generator=torch.Generator())
    with pytest.raises(ValueError, match="LongTensor"):
        core.generate(probe.float(), 4, generator=torch.Generator())


def test_flush_cache_drops_every_slot_assignment(config):
    model = EngineModel(config, dtype=torch.float32, total_bytes=8 * MiB, mem_fraction_static=0.5)
    model.slots.alloc(10)
    model.slots.alloc(20)
    assert model.slots.free_slots == model.num_slots - 30
    model.flush_cache()
    assert model.slots.free_slots == model.num_slots and model.slots.alloc(5) == 0



# -- the same views, sync after sync (a kept staging buffer) ---------------------------

def _one_buffer(state):
    """Every tensor as a view of one flat buffer, as a kept staging buffer's views are."""
    flat = torch.empty(sum(t.numel() for t in state.values()))
    views, off = [], 0
    for name, t in state.items():
        views.append((name, flat[off:off + t.numel()].view(t.shape)))
        off += t.numel()
    return flat, views


def _sync(core, batch, state, views, scale):
    for name, v in views:  # the sender writes new weights into the same buffer
        v.copy_(state[name] * scale)
    core.begin_load()
    n = core.load_weights(batch)
    core.end_load()
    return n


def _scaled(state, scale):
    return {n: t * scale for n, t in state.items()}


def test_the_same_views_load_new_values_every_sync_and_are_checked_and_placed_once(config, state, monkeypatch):
    core = make_core(config)
    flat, views = _one_buffer(state)
    placed = calls_of(monkeypatch, core.model, "_whole_dest", 1)
    for k, scale in enumerate((1.0, -2.0, 0.5)):
        assert _sync(core, views, state, views, scale) == len(state)
        assert core.digest() == expected_digest(_scaled(state, scale), config, torch.float32)
        # the first sync placed every tensor; the later ones reused what it found
        assert len(placed) == len(state), k


def test_a_refilled_list_a_repeat_in_one_load_and_a_new_allocation_are_checked_again(config, state):
    core = make_core(config)
    flat, views = _one_buffer(state)
    _sync(core, views, state, views, 1.0)
    # the same list object with one entry swapped for a tensor of the wrong shape
    name = "model.norm.weight"
    i = next(k for k, (n, _) in enumerate(views) if n == name)
    kept = views[i]
    views[i] = (name, torch.ones(63))
    core.begin_load()
    with pytest.raises(WeightMismatch) as err:
        core.load_weights(views)
    assert err.value.wrong_shape == ("model.norm.weight (63,) (expected (64,))",)
    with pytest.raises(WeightMismatch):  # the refused load ends incomplete
        core.end_load()
    views[i] = kept
    # the same list twice in one load: the second is refused as duplicates, nothing written
    _sync(core, views, state, views, 2.0)
    part = views[:3]
    core.begin_load()
    core.load_weights(part)
    before = core.digest()
    for _, v in part:
        v.mul_(3)
    with pytest.raises(WeightMismatch) as err:
        core.load_weights(part)
    assert err.value.duplicate == tuple(n for n, _ in part)
    assert core.digest() == before
    with pytest.raises(WeightMismatch):
        core.end_load()
    # weights released and allocated again: the new blocks are written, not the old ones
    core.release(["weights"])
    core.resume(["weights"])
    assert _sync(core, views, state, views, -1.0) == len(state)
    assert core.digest() == expected_digest(_scaled(state, -1.0), config, torch.float32)
    assert before != core.digest()


def test_the_engine_does_not_keep_a_loaded_buffer_alive(config, state):
    core = make_core(config)
    flat, views = _one_buffer(state)
    _sync(core, views, state, views, 1.0)
    gone = weakref.ref(flat)
    del flat, views
    gc.collect()
    assert gone() is None  # a receiver that lets go of a mapping frees it
