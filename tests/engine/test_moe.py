"""Qwen3-MoE (issue 15) on the CPU: megatron-core's own MoE with expert parallelism -> colo's
extractor -> colo's TP-MoE engine, each checked against an external ground truth.

- Names: the per-expert checkpoint names colo syncs (``colo.trainers.models.moe_checkpoint_names``)
  load into transformers' ``Qwen3MoeForCausalLM`` with nothing missing or unexpected.
- Trainer side: megatron-core 0.16 builds the tiny Qwen3-MoE (its local layer spec with
  ``num_experts``, ``qk_layernorm``, SequentialMLP experts) at TP=2 for attention and EP=2
  for the experts (expert TP 1: each rank holds half the experts whole), on two gloo ranks;
  its own forward gives the logits. What ``MegatronExtractor`` yields on every rank (experts
  broadcast from their owner over the EP group, attention all-gathered over TP) is loaded
  into transformers' ``Qwen3MoeForCausalLM``, whose logits must equal megatron-core's.
  The benchmark's synthetic trainer layout (``bench.multi_gpu.megatron_shards``) must be
  megatron-core's: same names, shapes and parallel attributes on each rank.
- Engine side: in the same two processes, colo's TP=2 MoE engine (TP-MoE: every expert's
  intermediate split over the ranks) loads its shard from the extracted full tensors; each
  rank's digest must equal ``expected_shard_digest`` of the tensors, its logits
  transformers', its greedy tokens the TP=1 engine's.

Tolerance: float32 throughout; the implementations sum in different orders (TP partial
sums, megatron's baddbmm attention). ``ATOL`` 1e-4 against logits of magnitude ~0.4.
"""

from __future__ import annotations

import os
import types

import pytest
import torch

from tests import megatron_cpu as mc

ATOL = 1e-4
NAME = "qwen3-moe-tiny"
BATCH, SEQ, NEW = 2, 10, 4


def _config():
    from colo.trainers.models import moe_model_config

    return moe_model_config(NAME)


def _tokens(cfg) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def _hf_model(tensors: dict[str, torch.Tensor], cfg, where) -> tuple:
    """transformers' Qwen3MoeForCausalLM loaded, as an engine or a user would, from a safetensors
    checkpoint holding exactly ``tensors`` (transformers fuses the experts itself)."""
    from safetensors.torch import save_file
    from transformers import Qwen3MoeForCausalLM

    os.makedirs(where, exist_ok=True)
    cfg.save_pretrained(where)
    save_file({n: t.contiguous() for n, t in tensors.items()}, os.path.join(where, "model.safetensors"))
    model, info = Qwen3MoeForCausalLM.from_pretrained(where, output_loading_info=True, dtype=torch.float32,
                                                      attn_implementation="eager")
    return model.eval(), info


def _engine_build() -> dict:
    return {"dtype": torch.float32, "device": "cpu", "total_bytes": 64 << 20, "mem_fraction_static": 0.9}


def _megatron_config(cfg, tp: int, ep: int):
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnBackend

    return TransformerConfig(
        num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_key_value_heads, kv_channels=cfg.head_dim, ffn_hidden_size=cfg.intermediate_size,
        normalization="RMSNorm", layernorm_epsilon=cfg.rms_norm_eps, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=False, qk_layernorm=True,  # Qwen3: no bias, q/k RMSNorm
        num_moe_experts=cfg.num_experts, moe_router_topk=cfg.num_experts_per_tok,
        moe_ffn_hidden_size=cfg.moe_intermediate_size,
        # top-k of the logits, then softmax over those k: Qwen3's softmax over all experts,
        # top-k, renormalised (norm_topk_prob=True) is the same distribution
        moe_router_pre_softmax=False, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="allgather", moe_grouped_gemm=False,
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=1,
        pipeline_dtype=torch.float32, params_dtype=torch.float32, use_cpu_initialization=True,
        perform_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        attention_backend=AttnBackend.local, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False)


def worker(rank: int, world: int, tmp_path, fields: dict) -> dict:
    mc.cpu_workarounds()
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from colo.engine.reference.moe import MoETPEngineCore
    from colo.extractors import MegatronExtractor

    # the config's fields as attributes, as the engine's build reads them: the workers do
    # not import transformers (seconds apiece on a loaded 2-core box)
    cfg = types.SimpleNamespace(**fields)
    from bench.multi_gpu import trainer_tp

    # the benchmark's layout: TP as large as the query groups allow, EP over every rank
    tp, ep = trainer_tp(cfg, world), world
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=1)
    spec = get_gpt_layer_local_spec(num_experts=cfg.num_experts, moe_grouped_gemm=False, qk_layernorm=True,
                                    normalization="RMSNorm")
    torch.manual_seed(0)
    model = GPTModel(config=_megatron_config(cfg, tp, ep), transformer_layer_spec=spec, vocab_size=cfg.vocab_size,
                     max_sequence_length=cfg.max_position_embeddings, pre_process=True, post_process=True,
                     parallel_output=False, share_embeddings_and_output_weights=False,
                     position_embedding_type="rope", rotary_base=int(cfg.rope_parameters["rope_theta"]))
    mc.randomize(model)
    model.eval()
    tok = _tokens(cfg)
    with torch.no_grad():
        mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
        logits = model(tok, torch.arange(SEQ).expand(BATCH, SEQ), attention_mask=mask)[..., :cfg.vocab_size]
    params = mc.global_params(model)
    ex = MegatronExtractor(params, tp_group=ps.get_tensor_model_parallel_group(),
                           ep_group=ps.get_expert_model_parallel_group(),
                           expert_tp_group=ps.get_expert_tensor_parallel_group(),
                           attention=(cfg.num_attention_heads, cfg.num_key_value_heads), vocab_size=cfg.vocab_size)
    tensors = dict(ex.extract([s.name for s in ex.specs()]))

    # the engine rank on the same process group: its shard from the full tensors
    engine = MoETPEngineCore(cfg, tp_rank=rank, tp_size=world, group=dist.group.WORLD, init_state=tensors,
                             **_engine_build())
    g = torch.Generator().manual_seed(3)
    greedy, _ = engine.model.generate(tok[:, :4], NEW, temperature=0.0, generator=g)

    # the same experts, each sent to every engine rank as that rank's slice only (issue 46): an
    # engine rank loaded from them holds the same shard, bit for bit
    from colo.engine.reference.moe import expert_split_dims
    from colo.transports.wire import RankSlice

    scatter = MegatronExtractor(params, tp_group=ps.get_tensor_model_parallel_group(),
                                ep_group=ps.get_expert_model_parallel_group(),
                                expert_tp_group=ps.get_expert_tensor_parallel_group(),
                                attention=(cfg.num_attention_heads, cfg.num_key_value_heads),
                                vocab_size=cfg.vocab_size, expert_scatter=expert_split_dims(cfg, world))
    specs = list(scatter.specs())
    got = dict(scatter.extract([s.name for s in specs]))
    sliced = MoETPEngineCore(cfg, tp_rank=rank, tp_size=world, group=dist.group.WORLD, **_engine_build())
    sliced.begin_load()
    sliced.load_weights([(s.name, RankSlice(got[s.name], s.rank_slice[0], s.rank_slice[1], s.whole_shape)
                          if s.rank_slice is not None else got[s.name]) for s in specs])
    sliced.end_load()
    experts = sum(t.numel() * t.element_size() for n, t in tensors.items() if ".mlp.experts." in n)
    return {"megatron": logits.clone(), "tensors": tensors if rank == 0 else {},
            "scatter_digest": sliced.digest(), "scatter_received": scatter.scatter_stats["received"],
            "expert_bytes": experts, "sliced_specs": sum(s.rank_slice is not None for s in specs),
            "local": {n: (tuple(p.shape), dict((k, getattr(p, k)) for k in
                                              ("tensor_model_parallel", "partition_dim", "partition_stride")
                                              if getattr(p, "tensor_model_parallel", False)))
                      for n, p in params},
            "engine_digest": engine.digest(), "engine_logits": engine.model.logits(tok), "greedy": greedy}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from colo.trainers.models import MOE_MODELS

    return mc.run_workers(worker, tmp_path_factory.mktemp("moe"), {**MOE_MODELS[NAME], "model_type": "qwen3_moe"})


@pytest.fixture(scope="module")
def hf(ranks, tmp_path_factory):
    cfg = _config()
    model, info = _hf_model(ranks[0]["tensors"], cfg, str(tmp_path_factory.mktemp("hf-moe")))
    with torch.no_grad():
        logits = model(_tokens(cfg)).logits
    return {"model": model, "info": info, "logits": logits}


def test_checkpoint_names_load_into_transformers_qwen3_moe_with_nothing_missing(tmp_path):
    from colo.trainers.models import moe_checkpoint_names, moe_checkpoint_state

    cfg = _config()
    state = moe_checkpoint_state(cfg, 0)
    assert [(n, tuple(t.shape)) for n, t in state.items()] == moe_checkpoint_names(cfg)
    model, info = _hf_model(state, cfg, str(tmp_path))
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    # transformers fused the experts as it loaded: expert 3's up_proj is rows I..2I of its gate_up_proj
    inter = cfg.moe_intermediate_size
    fused = model.model.layers[1].mlp.experts.gate_up_proj[3]
    assert torch.equal(fused[inter:], state["model.layers.1.mlp.experts.3.up_proj.weight"])


def test_the_30b_shape_is_qwen3_30b_a3b():
    from colo.engine.reference.weights import WeightMap
    from colo.engine.reference.dims import MoEDims
    from colo.trainers.models import moe_checkpoint_names, moe_model_config

    cfg = moe_model_config("qwen3-30b-a3b")
    dims = MoEDims.from_config(cfg)
    assert (dims.num_layers, dims.hidden_size, dims.num_experts, dims.intermediate_size, dims.top_k) == \
        (48, 2048, 128, 768, 8)
    assert (dims.num_heads, dims.num_kv_heads, dims.head_dim, dims.vocab_size) == (32, 4, 128, 151936)
    params = sum(torch.Size(s).numel() for _, s in moe_checkpoint_names(cfg))
    assert 30.4e9 < params < 30.6e9  # "30B": 30.53 B parameters, 61.1 GB in bf16
    assert WeightMap.build(dims).nbytes(torch.bfloat16) == 2 * params


def test_engine_tp1_equals_transformers_and_tp_layout_refuses_what_does_not_split(tmp_path):
    from colo.engine.reference.moe import MoEEngineCore
    from colo.engine.reference.tp import TPLayout, TPLayoutError
    from colo.trainers.models import moe_checkpoint_state, moe_model_config

    cfg = _config()
    state = moe_checkpoint_state(cfg, 0)
    model, _ = _hf_model(state, cfg, str(tmp_path))
    tok = _tokens(cfg)
    with torch.no_grad():
        ref = model(tok).logits
    engine = MoEEngineCore(cfg, init_state=state, **_engine_build())
    assert (engine.model.logits(tok) - ref).abs().max() < ATOL
    # 30B at TP=8: 4 query heads, the 4 KV heads replicated in pairs, 96 of each expert's 768
    local = TPLayout.from_config(moe_model_config("qwen3-30b-a3b"), tp_rank=7, tp_size=8).local
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size, local.num_experts) == (4, 1, 96, 128)
    with pytest.raises(TPLayoutError, match="intermediate_size 8"):
        TPLayout.from_config(moe_model_config(NAME, num_attention_heads=12, num_key_value_heads=3), tp_rank=0,
                             tp_size=3)


def test_extracted_tensors_in_transformers_reproduce_megatron_core_ep2_logits(ranks, hf):
    assert not hf["info"]["missing_keys"] and not hf["info"]["unexpected_keys"]
    for r in ranks:
        assert (r["megatron"] - hf["logits"]).abs().max() < ATOL


def test_every_engine_rank_holds_its_tp_moe_shard_and_computes_transformers_logits(ranks, hf):
    from colo.engine.reference.tp import expected_shard_digest

    cfg = _config()
    tensors = ranks[0]["tensors"]
    digests = [expected_shard_digest(tensors, cfg, torch.float32, r, len(ranks)) for r in range(len(ranks))]
    assert [r["engine_digest"] for r in ranks] == digests and len(set(digests)) == len(ranks)
    for r in ranks:
        assert (r["engine_logits"] - hf["logits"]).abs().max() < ATOL


def test_tp2_greedy_tokens_equal_tp1_engine_and_transformers(ranks, hf):
    from colo.engine.reference.moe import MoEEngineCore

    cfg = _config()
    engine = MoEEngineCore(cfg, init_state=ranks[0]["tensors"], **_engine_build())
    prompts = _tokens(cfg)[:, :4]
    tp1, _ = engine.model.generate(prompts, NEW, temperature=0.0, generator=torch.Generator().manual_seed(3))
    assert all(torch.equal(r["greedy"], tp1) for r in ranks)
    with torch.no_grad():
        ref = hf["model"].generate(prompts, max_new_tokens=NEW, do_sample=False, pad_token_id=0)[:, 4:]
    assert torch.equal(tp1, ref)


def test_megatron_cores_experts_scattered_to_each_engine_rank_load_the_same_shard(ranks):
    """``expert_scatter`` on megatron-core's own EP=2 model: each rank receives half of every
    expert's bytes, and the engine rank loaded from those slices holds the shard the engine
    loaded from the whole tensors (its digest, bit for bit)."""
    for rank, r in enumerate(ranks):
        assert r["sliced_specs"] == 2 * 8 * 3  # qwen3-moe-tiny: 2 layers, 8 experts, gate/up/down
        assert r["scatter_received"] * 2 == r["expert_bytes"] > 0
        assert r["scatter_digest"] == r["engine_digest"], rank


def test_bench_synthetic_layout_is_megatron_cores_own(ranks):
    from bench.multi_gpu import megatron_shards

    cfg = _config()
    for rank, r in enumerate(ranks):
        mine = {n: (tuple(s), a) for n, s, a in megatron_shards(cfg, rank, len(ranks))}
        assert mine == r["local"], rank


def test_moe_configs_the_engine_cannot_run_are_refused_naming_the_field():
    from colo.engine.reference.dims import MoEDims
    from colo.trainers.models import moe_model_config

    with pytest.raises(ValueError, match=r"mlp_only_layers=\[1\]"):
        MoEDims.from_config(moe_model_config(NAME, mlp_only_layers=[1]))
    with pytest.raises(ValueError, match="attention_bias=True"):
        MoEDims.from_config(moe_model_config(NAME, attention_bias=True))
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(9\) exceeds num_experts \(8\)"):
        MoEDims.from_config(moe_model_config(NAME, num_experts_per_tok=9))
    with pytest.raises(ValueError, match="unknown Qwen3MoeConfig field"):
        moe_model_config(NAME, num_expert=4)


def test_the_engine_build_from_the_sent_config_dict_is_the_moe_engine():
    """An engine process builds from ``config.to_dict()`` without transformers: a Qwen3-MoE's
    dict must give the MoE core with the same specs as from the config, and the dense one a dense core."""
    from colo.engine.reference.core import EngineCore
    from colo.engine.reference.weights import expected_hf_specs
    from colo.engine.reference.moe import MoEEngineCore
    from colo.engine.reference.server import build_core
    from colo.trainers.models import demo_config

    cfg = _config()
    build = {"dtype": "float32", "device": "cpu", "total_bytes": 64 << 20, "mem_fraction_static": 0.9}
    core = build_core({**build, "config": cfg.to_dict()})
    assert type(core) is MoEEngineCore
    assert core.model.expected_specs() == expected_hf_specs(cfg, torch.float32)
    assert type(build_core({**build, "config": demo_config().to_dict()})) is EngineCore
