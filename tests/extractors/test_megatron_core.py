"""MegatronExtractor against the real megatron-core (0.16), on two CPU processes joined by gloo.

The ground truth is external: megatron-core builds the models (local layer
spec, Qwen2 layout: RMSNorm, SwiGLU, grouped-query attention, QKV bias,
rotary), lays out their shards, sets their parallel attributes, runs their
forward pass and reshards their checkpoints; transformers loads what colo
extracts as a Qwen2 / Qwen2-MoE safetensors checkpoint. Nothing of Megatron is
imitated here (``tests/megatron_cpu.py`` lists what megatron-core needs to run
on CPU).

One pair of worker processes runs every case in turn (megatron-core and
transformers take seconds to import): TP=1 (with data parallelism 2); TP=2,
loaded from the TP=1 model's distributed checkpoint; PP=2 (4 layers, 2 per
stage); TP=2 with tied embeddings; MoE with shared experts at EP=2 and at
TP=2 (expert tensor parallelism 2).

Tolerance: the models are float32 and the HF model computes the same function,
so the logits differ only by rounding, in different orders of summation
(tensor-parallel partial sums, Megatron's baddbmm attention against HF's
matmul, the two RMSNorm and rotary implementations). Measured: at most
3.5e-6 on logits of magnitude up to ~4.5 (a few float32 ulps per layer).
``ATOL`` = 1e-4 is ~30x that; the negative control (gate and up swapped in one
layer) moves the logits by ~4.6, more than 1000x ``ATOL``.
"""

from __future__ import annotations

import pytest
import torch

from tests import megatron_cpu as mc
from tests.dist_helpers import assert_bit_equal

ATOL = 1e-4

CASES = [mc.Case("tp1"), mc.Case("tp2", tp=2), mc.Case("pp2", pp=2), mc.Case("tp2-tied", tp=2, tied=True),
         mc.Case("pp2-tied", pp=2, tied=True), mc.Case("moe-ep2", ep=2, moe=True),
         mc.Case("moe-tp2", tp=2, moe=True)]
RESHARDED = "tp2"  # loaded from the tp1 model's distributed checkpoint, not randomized
SWAPPED_LAYER = 1


def _extract(model) -> dict[str, torch.Tensor]:
    from megatron.core import parallel_state as ps

    from colo.extractors import MegatronExtractor

    ex = MegatronExtractor(mc.global_params(model), tp_group=ps.get_tensor_model_parallel_group(),
                           pp_group=ps.get_pipeline_model_parallel_group(),
                           ep_group=ps.get_expert_model_parallel_group(),
                           expert_tp_group=ps.get_expert_tensor_parallel_group(),
                           attention=(mc.HEADS, mc.GROUPS), vocab_size=mc.VOCAB)
    names = [s.name for s in ex.specs()]
    got = list(ex.extract(names))
    assert [n for n, _ in got] == names
    return dict(got)


def _swap_gate_and_up(tensors: dict[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    h = f"model.layers.{layer}.mlp."
    out = dict(tensors)
    out[h + "gate_proj.weight"] = tensors[h + "up_proj.weight"]
    out[h + "up_proj.weight"] = tensors[h + "gate_proj.weight"]
    return out


def _own_slices(model, dims, rank: int) -> dict:
    """The same model through ``tp_slices`` (issue 46): each rank's own slice of every tensor
    colo's TP=2 engine splits where megatron-core does, no gather. An engine rank loaded from
    them must hold what the engine loaded from the whole tensors holds, bit for bit."""
    from megatron.core import parallel_state as ps

    from colo.engine.reference.tp import TPEngineCore, split_dims
    from colo.extractors import MegatronExtractor
    from colo.transports.wire import RankSlice

    args = {"tp_group": ps.get_tensor_model_parallel_group(), "attention": (mc.HEADS, mc.GROUPS),
            "vocab_size": mc.VOCAB}
    whole = MegatronExtractor(mc.global_params(model), **args)
    ex = MegatronExtractor(mc.global_params(model), tp_slices=split_dims(dims, 2), **args)
    specs = list(ex.specs())
    got = dict(ex.extract([s.name for s in specs]))
    build = {"dtype": torch.float32, "device": "cpu", "total_bytes": 16 << 20, "mem_fraction_static": 0.9}
    digests = []
    for items in ([(s.name, RankSlice(got[s.name], s.rank_slice[0], s.rank_slice[1], s.whole_shape))
                   if s.rank_slice is not None else (s.name, got[s.name]) for s in specs],
                  list(whole.extract([s.name for s in whole.specs()]))):
        engine = TPEngineCore(dims, tp_rank=rank, tp_size=2, **build)
        engine.begin_load()
        engine.load_weights(items)
        engine.end_load()
        digests.append(engine.digest())
    return {"sliced": sorted(ex.sliced), "split": sorted(split_dims(dims, 2)), "digests": digests,
            "starts": {s.name: s.rank_slice[1] for s in specs if s.rank_slice is not None}}


def worker(rank: int, world: int, tmp_path, dims) -> dict:
    mc.cpu_workarounds()
    from megatron.core import dist_checkpointing

    ckpt = tmp_path / "tp1-dist-ckpt"
    out: dict = {}
    for case in CASES:
        mc.init_parallel(case)
        model = mc.build(case)
        if case.name == RESHARDED:
            # megatron-core's own TP=1 -> TP=2 resharding
            model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), str(ckpt)))
        out[case.name] = {
            "local": {n: (tuple(p.shape), bool(getattr(p, "tensor_model_parallel", False)),
                          int(getattr(p, "partition_stride", 1))) for n, p in mc.global_params(model)},
            "megatron_names": [n for n, _ in model.named_parameters()],
            "tensors": _extract(model), "megatron": mc.megatron_logits(model, case)}
        if case.name == RESHARDED:
            out[case.name]["own_slices"] = _own_slices(model, dims, rank)
        if case.name == "tp1":
            ckpt.mkdir(exist_ok=True)
            dist_checkpointing.save(model.sharded_state_dict(), str(ckpt))

    # LayerNorm has a bias that no Llama / Qwen2 HF name can hold: refused, all names in one error
    refused = mc.Case("layernorm", tp=2, layers=2, norm="LayerNorm")
    mc.init_parallel(refused)
    try:
        _extract(mc.build(refused))
        out["refused"] = ""
    except ValueError as e:
        out["refused"] = str(e)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """What each rank extracted and megatron-core computed; the HF side runs here, in the test
    process, which has transformers imported already (the workers only import megatron-core)."""
    from colo.engine.reference.dims import dims_from_config

    tmp = tmp_path_factory.mktemp("megatron-core")
    # the TP engine's dimensions, made here: the workers do not import transformers
    ranks = mc.run_workers(worker, tmp, dims_from_config(mc.hf_config(next(c for c in CASES if c.name == RESHARDED))))
    for case in CASES:
        ranks[0][case.name].update(mc.hf_logits(ranks[0][case.name]["tensors"], case, tmp / f"hf-{case.name}"))
    resharded = next(c for c in CASES if c.name == RESHARDED)
    swapped = _swap_gate_and_up(ranks[0][RESHARDED]["tensors"], SWAPPED_LAYER)
    ranks[0][RESHARDED]["hf_swapped"] = mc.hf_logits(swapped, resharded, tmp / "hf-swapped")["hf"]
    return ranks


def _case(results, name: str, key: str):
    """``key`` from whichever rank has it (the HF side ran on one rank, the logits on the last stage)."""
    found = [r[name][key] for r in results if r[name].get(key) is not None]
    assert found, f"{name}: no rank returned {key!r}"
    return found[0]


@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_hf_model_from_extracted_tensors_reproduces_megatron_core_logits(results, name):
    megatron, hf = _case(results, name, "megatron"), _case(results, name, "hf")
    assert megatron.shape == hf.shape == (mc.BATCH, mc.SEQ, mc.VOCAB)
    diff = (megatron - hf).abs().max().item()
    assert diff < ATOL, f"{name}: max abs logit difference {diff:.3g} (tolerance {ATOL})"
    # transformers loaded every weight it has from the extracted names, and nothing else
    assert _case(results, name, "missing") == []
    assert _case(results, name, "unexpected") == []


def test_negative_control_gate_and_up_swapped_in_one_layer_fails_the_check(results):
    megatron, swapped = _case(results, RESHARDED, "megatron"), _case(results, RESHARDED, "hf_swapped")
    assert (megatron - swapped).abs().max().item() > 1000 * ATOL


def test_every_rank_yields_the_same_full_tensors(results):
    for case in CASES:
        a, b = (r[case.name]["tensors"] for r in results)
        assert sorted(a) == sorted(b)
        for n in a:
            assert_bit_equal(b[n], a[n], f"{case.name} {n}")


def test_tp1_to_tp2_resharding_by_megatron_core_dist_checkpointing_extracts_bit_exactly(results):
    for r in results:
        tp1, tp2 = r["tp1"]["tensors"], r[RESHARDED]["tensors"]
        assert sorted(tp1) == sorted(tp2)
        for n in tp1:
            assert_bit_equal(tp2[n], tp1[n], n)
    # and the TP=2 model really was sharded: each rank held half of the gated fc1, [gate_i; up_i]
    assert results[0][RESHARDED]["local"]["decoder.layers.0.mlp.linear_fc1.weight"] == \
        ((mc.FFN, mc.HIDDEN), True, 2)


def test_each_ranks_own_slices_of_megatron_cores_tp2_model_load_the_engine_rank_bit_exactly(results):
    """``tp_slices`` on megatron-core's own TP=2 model: every tensor colo's TP engine splits
    went as the rank's block but the embedding and lm_head (megatron pads 37 tokens to 40
    rows, the engine to 38: rank 1's blocks differ), and the engine rank loaded from them
    holds the shard it holds from the gathered whole tensors."""
    for rank, r in enumerate(results):
        own = r[RESHARDED]["own_slices"]
        assert own["sliced"] == sorted(set(own["split"]) - {"model.embed_tokens.weight", "lm_head.weight"})
        assert len(own["sliced"]) == 4 * 10  # q, k, v and their biases, o, gate, up, down in 4 layers
        assert own["starts"]["model.layers.2.self_attn.k_proj.weight"] == rank * mc.GROUPS * mc.HEAD_DIM // 2
        assert own["starts"]["model.layers.2.mlp.down_proj.weight"] == rank * mc.FFN // 2
        sliced, whole = own["digests"]
        assert sliced == whole, rank
    assert results[0][RESHARDED]["own_slices"]["digests"] != results[1][RESHARDED]["own_slices"]["digests"]


def test_megatron_core_marks_every_gated_fc1_with_partition_stride_2_and_nothing_else(results):
    # the claim of issue 12, checked on the library itself, at TP=1 as well
    for case in CASES:
        for name, (shape, tp, stride) in results[0][case.name]["local"].items():
            assert stride == (2 if name.endswith("linear_fc1.weight") else 1), (case.name, name, stride)


def test_names_follow_the_hf_checkpoint_layout(results):
    moe = results[0]["moe-ep2"]["tensors"]
    h = "model.layers.3.mlp."
    for n in (h + "gate.weight", h + "experts.3.gate_proj.weight", h + "experts.3.up_proj.weight",
              h + "experts.3.down_proj.weight", h + "shared_expert.gate_proj.weight",
              h + "shared_expert.up_proj.weight", h + "shared_expert.down_proj.weight",
              h + "shared_expert_gate.weight"):
        assert n in moe, n
    assert moe[h + "shared_expert_gate.weight"].shape == (1, mc.HIDDEN)
    assert "lm_head.weight" in results[0]["tp1"]["tensors"]
    assert "lm_head.weight" not in results[0]["tp2-tied"]["tensors"]
    # tied across pipeline stages, the last stage holds a copy of the embedding (marked
    # shared_embedding by megatron-core): not sent, HF ties lm_head to embed_tokens
    assert "output_layer.weight" in results[1]["pp2-tied"]["local"]
    assert "lm_head.weight" not in results[1]["pp2-tied"]["tensors"]
    # vocabulary padding cut off
    assert results[0]["tp1"]["tensors"]["model.embed_tokens.weight"].shape == (mc.VOCAB, mc.HIDDEN)
    assert results[0]["tp1"]["local"]["embedding.word_embeddings.weight"][0] == (mc.PADDED_VOCAB, mc.HIDDEN)
    # megatron-core numbers layers per pipeline stage and experts per expert-parallel rank from 0;
    # global_name with megatron-core's offsets made them model-wide
    stage1 = results[1]["pp2"]
    assert "decoder.layers.1.mlp.linear_fc2.weight" in stage1["megatron_names"]
    assert "decoder.layers.2.mlp.linear_fc2.weight" not in stage1["megatron_names"]
    assert {f"decoder.layers.{i}.mlp.linear_fc2.weight" for i in (2, 3)} <= stage1["local"].keys()
    assert "decoder.layers.0.mlp.linear_fc2.weight" not in stage1["local"]
    expert = "decoder.layers.0.mlp.experts.local_experts.{}.linear_fc1.weight"
    assert expert.format(1) in results[1]["moe-ep2"]["megatron_names"]
    assert expert.format(3) not in results[1]["moe-ep2"]["megatron_names"]
    assert expert.format(3) in results[1]["moe-ep2"]["local"]
    assert expert.format(3) not in results[0]["moe-ep2"]["local"]


@pytest.mark.parametrize("name", ["moe-ep2", "moe-tp2"])
def test_the_moe_check_exercised_every_expert(results, name):
    picked = _case(results, name, "experts_picked")
    assert len(picked) == CASES[0].layers
    assert all(p == list(range(mc.EXPERTS)) for p in picked), picked


def test_a_model_with_names_hf_cannot_hold_is_refused_with_every_name_in_one_error(results):
    # LayerNorm's biases: no Llama / Qwen2 checkpoint has a norm bias
    for r in results:
        assert r["refused"] == (
            "megatron extractor: no name rule matches parameter(s) ['decoder.layers.0.input_layernorm.bias', "
            "'decoder.layers.0.pre_mlp_layernorm.bias', 'decoder.layers.1.input_layernorm.bias', "
            "'decoder.layers.1.pre_mlp_layernorm.bias', 'decoder.final_layernorm.bias']; add a NameRule for them")
