"""MegatronExtractor: Megatron-layout shards built from an unsharded HF model, gathered back bit-exactly.

The shards are made here the way Megatron lays them out (column-parallel on
dim 0, row-parallel on dim 1, GLU ``linear_fc1`` shard = ``[gate_i; up_i]``,
fused QKV per query group, vocabulary padded), independently of the
extractor's code, which has to undo all of it.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from colo.core.buckets import plan_buckets
from colo.extractors import MegatronExtractor, NameRule, global_name
from tests.dist_helpers import TinyLlama, assert_bit_equal, run_workers

T = TinyLlama
PADDED_VOCAB = 40  # Megatron pads the vocabulary to a multiple of the TP size (and more)
SEED = 5


def hf_reference(experts: int = 0) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in TinyLlama(SEED, experts=experts).named_parameters()}


def _param(t: torch.Tensor, tp: bool = False, dim: int = -1, stride: int = 1) -> nn.Parameter:
    p = nn.Parameter(t.clone())
    p.tensor_model_parallel = tp
    p.partition_dim = dim
    p.partition_stride = stride
    return p


def _column(t: torch.Tensor, rank: int, size: int) -> nn.Parameter:
    return _param(t.chunk(size, dim=0)[rank], True, 0)


def _row(t: torch.Tensor, rank: int, size: int) -> nn.Parameter:
    return _param(t.chunk(size, dim=1)[rank], True, 1)


def _glu(gate: torch.Tensor, up: torch.Tensor, rank: int, size: int, stride: int = 2) -> nn.Parameter:
    # megatron-core >= 0.16 marks a gated linear_fc1 with partition_stride 2 (earlier: 1, same layout)
    return _param(torch.cat([gate.chunk(size)[rank], up.chunk(size)[rank]]), True, 0, stride)


def _fused_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    per = T.HEADS // T.GROUPS
    hd = T.HEAD_DIM
    blocks = []
    for g in range(T.GROUPS):
        blocks += [q[g * per * hd:(g + 1) * per * hd], k[g * hd:(g + 1) * hd], v[g * hd:(g + 1) * hd]]
    return torch.cat(blocks)


def _padded(t: torch.Tensor) -> torch.Tensor:
    pad = torch.full((PADDED_VOCAB - t.shape[0], *t.shape[1:]), 99.0)  # never sent: trimmed by vocab_size
    return torch.cat([t, pad])


def megatron_params(ref: dict, *, tp_rank: int = 0, tp: int = 1, layers=(0, 1), embed=True, head=True,
                    experts=(), expert_offset=0) -> list[tuple[str, nn.Parameter]]:
    """This rank's parameters, Megatron names. ``experts``: the global expert ids it owns
    (named locally from 0, as Megatron does, then made global with ``global_name``)."""
    out = []
    if embed:
        embed_rows = _padded(ref["model.embed_tokens.weight"])
        out.append(("embedding.word_embeddings.weight", _column(embed_rows, tp_rank, tp)))
    for i in layers:
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out.append((m + "self_attention.linear_qkv.layer_norm_weight", _param(ref[h + "input_layernorm.weight"])))
        for kind in ("weight", "bias"):
            fused = _fused_qkv(*(ref[h + f"self_attn.{x}_proj.{kind}"] for x in "qkv"))
            out.append((m + f"self_attention.linear_qkv.{kind}", _column(fused, tp_rank, tp)))
        out.append((m + "self_attention.linear_proj.weight", _row(ref[h + "self_attn.o_proj.weight"], tp_rank, tp)))
        if h + "mlp.gate.weight" in ref:
            out.append((m + "pre_mlp_layernorm.weight", _param(ref[h + "post_attention_layernorm.weight"])))
            out.append((m + "mlp.router.weight", _param(ref[h + "mlp.gate.weight"])))
            for local, e in enumerate(experts):  # expert tensor parallelism 1: whole experts
                x = f"{h}mlp.experts.{e}."
                pre = f"{m}mlp.experts.local_experts.{local}."
                out.append((global_name(pre + "linear_fc1.weight", expert_offset=expert_offset),
                            _glu(ref[x + "gate_proj.weight"], ref[x + "up_proj.weight"], 0, 1)))
                out.append((global_name(pre + "linear_fc2.weight", expert_offset=expert_offset),
                            _row(ref[x + "down_proj.weight"], 0, 1)))
        else:
            out.append((m + "mlp.linear_fc1.layer_norm_weight", _param(ref[h + "post_attention_layernorm.weight"])))
            out.append((m + "mlp.linear_fc1.weight",
                        _glu(ref[h + "mlp.gate_proj.weight"], ref[h + "mlp.up_proj.weight"], tp_rank, tp)))
            out.append((m + "mlp.linear_fc2.weight", _row(ref[h + "mlp.down_proj.weight"], tp_rank, tp)))
    if head:
        out.append(("decoder.final_layernorm.weight", _param(ref["model.norm.weight"])))
        out.append(("output_layer.weight", _column(_padded(ref["lm_head.weight"]), tp_rank, tp)))
    return out


ATTENTION = (T.HEADS, T.GROUPS)


def extract_in_buckets(ex, budget: int) -> dict[str, torch.Tensor]:
    got = {}
    for b in plan_buckets(list(ex.specs()), budget):
        names = [e.spec.name for e in b.entries]
        out = list(ex.extract(names))
        assert [n for n, _ in out] == names
        got.update(out)
    return got


def check_against(ref: dict, got: dict, dtype: torch.dtype, who: str) -> None:
    assert sorted(got) == sorted(ref), f"{who}: names differ: {sorted(set(got) ^ set(ref))}"
    for n, t in ref.items():
        assert_bit_equal(got[n], t.to(dtype), f"{who} {n}")


# -- one process: the name table and the conversions -----------------------------

def test_unsharded_megatron_params_become_the_hf_model_bit_exactly():
    ref = hf_reference()
    ex = MegatronExtractor(megatron_params(ref), dtype=torch.bfloat16, attention=ATTENTION, vocab_size=T.VOCAB)
    specs = ex.specs()
    assert [s.name for s in specs][:6] == [
        "model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
        "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.q_proj.bias"]
    assert {s.name: (s.shape, s.dtype) for s in specs} == {n: (tuple(t.shape), "bfloat16") for n, t in ref.items()}
    check_against(ref, extract_in_buckets(ex, 64), torch.bfloat16, "tp=1")


_REF = hf_reference()
_EX = MegatronExtractor(megatron_params(_REF), dtype=torch.bfloat16, attention=ATTENTION, vocab_size=T.VOCAB)


@settings(max_examples=60, deadline=None)
@given(st.permutations(sorted(_REF)), st.integers(0, len(_REF)))
def test_any_subset_in_any_order_yields_exactly_those_names(order, k):
    # siblings (gate/up, q/k/v) asked for apart, together, or not at all
    names = order[:k]
    out = list(_EX.extract(names))
    assert [n for n, _ in out] == names
    for n, t in out:
        assert_bit_equal(t, _REF[n].to(torch.bfloat16), n)


def test_without_vocab_size_the_padding_rows_are_sent():
    ref = hf_reference()
    ex = MegatronExtractor(megatron_params(ref, layers=()), attention=ATTENTION)
    got = dict(ex.extract(["model.embed_tokens.weight"]))["model.embed_tokens.weight"]
    assert got.shape == (PADDED_VOCAB, T.HIDDEN)
    assert_bit_equal(got[:T.VOCAB], ref["model.embed_tokens.weight"])


def test_gate_and_up_asked_for_in_separate_calls_each_come_out_right():
    ref = hf_reference()
    ex = MegatronExtractor(megatron_params(ref, embed=False, head=False), dtype=torch.float16, attention=ATTENTION)
    up, = ex.extract(["model.layers.1.mlp.up_proj.weight"])
    gate, = ex.extract(["model.layers.1.mlp.gate_proj.weight"])
    assert_bit_equal(up[1], ref["model.layers.1.mlp.up_proj.weight"].half())
    assert_bit_equal(gate[1], ref["model.layers.1.mlp.gate_proj.weight"].half())


def _shares_memory(out: torch.Tensor, source: torch.Tensor) -> bool:
    return out.untyped_storage().data_ptr() == source.untyped_storage().data_ptr()


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_with_upload_to_a_tensor_that_needs_no_work_is_a_view_of_the_host_copy(dtype):
    # the one-rank offload-first source (MegatronTrainer.extractor while paused): a host copy
    # the transport uploads into its buffer; only what needs work (a conversion, q/k/v of
    # several query groups) is made anew, on ``upload_to``
    ref = hf_reference()
    params = dict(megatron_params(ref))
    ex = MegatronExtractor(params, dtype=dtype, upload_to="cpu", attention=ATTENTION, vocab_size=T.VOCAB)
    assert ex.upload_to == ex.device == torch.device("cpu")
    got = extract_in_buckets(ex, 64)
    check_against(ref, got, dtype or torch.float32, "upload_to")
    source_of = {"model.embed_tokens.weight": "embedding.word_embeddings.weight",
                 "model.layers.0.mlp.gate_proj.weight": "decoder.layers.0.mlp.linear_fc1.weight",
                 "model.layers.0.mlp.up_proj.weight": "decoder.layers.0.mlp.linear_fc1.weight",
                 "model.layers.0.self_attn.o_proj.weight": "decoder.layers.0.self_attention.linear_proj.weight",
                 "model.layers.0.self_attn.q_proj.weight": "decoder.layers.0.self_attention.linear_qkv.weight",
                 "model.layers.0.self_attn.v_proj.bias": "decoder.layers.0.self_attention.linear_qkv.bias"}
    for name, src in source_of.items():
        viewed = dtype is None and "self_attn.q_proj" not in name and "v_proj" not in name  # 2 query groups
        assert _shares_memory(got[name], params[src]) == viewed, name


def test_with_upload_to_one_query_groups_q_k_and_v_are_views_of_the_fused_qkv():
    heads, hd, hidden = 4, 2, 8
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(n * hd, hidden, generator=g) for n in (heads, 1, 1))
    fused = torch.cat([q, k, v])  # one query group: [q heads; k; v]
    ex = MegatronExtractor({"decoder.layers.0.self_attention.linear_qkv.weight": fused}, upload_to="cpu",
                           attention=(heads, 1))
    got = dict(ex.extract([f"model.layers.0.self_attn.{x}_proj.weight" for x in "qkv"]))
    for x, want in zip("qkv", (q, k, v)):
        assert_bit_equal(got[f"model.layers.0.self_attn.{x}_proj.weight"], want, x)
        assert _shares_memory(got[f"model.layers.0.self_attn.{x}_proj.weight"], fused), x


def test_given_views_to_fill_a_fused_qkv_of_several_query_groups_is_split_straight_into_them():
    """At one rank, q, k and v of a fused QKV of several query groups (strided rows) are copied
    into the caller's views (a staging slot's) and yielded as those views, bit for bit what the
    extractor yields without views; a view of the wrong shape is left alone (a new tensor)."""
    ref = hf_reference()
    ex = MegatronExtractor(megatron_params(ref), dtype=torch.bfloat16, attention=ATTENTION, vocab_size=T.VOCAB)
    specs = {sp.name: sp for sp in ex.specs()}
    names = [f"model.layers.1.self_attn.{x}_proj.{w}" for w in ("weight", "bias") for x in "qkv"]
    into = {n: torch.full(specs[n].shape, 7.0, dtype=torch.bfloat16) for n in names}
    wrong = names[1]
    into[wrong] = torch.zeros(specs[wrong].shape[0] + 1, *specs[wrong].shape[1:], dtype=torch.bfloat16)
    assert T.HEADS // T.GROUPS > 1 and T.GROUPS > 1  # q, k and v interleave: strided rows
    got = dict(ex.extract(names, into))
    assert list(got) == names
    for n in names:
        assert_bit_equal(got[n], ref[n].to(torch.bfloat16), n)
        assert (got[n] is into[n]) == (n != wrong), n
    assert not into[wrong].any()  # untouched


def test_source_views_at_one_rank_are_views_of_the_sources_equal_to_what_extract_yields():
    """What a one-copy sync reads (``source_views``): at one rank, with nothing to convert, every
    output is a view of its own source's memory, in a shape whose row-major elements are the
    output's, bit for bit what ``extract`` yields; q, k and v of a fused QKV of several query
    groups are strided ``(groups, rows of a group, *rest)`` views, gate and up row ranges."""
    ref = hf_reference()
    params = megatron_params(ref)
    ex = MegatronExtractor(params, dtype=torch.float32, attention=ATTENTION, vocab_size=T.VOCAB)
    names = [sp.name for sp in ex.specs()]
    want = dict(ex.extract(names))
    got = list(ex.source_views(names))
    assert [n for n, _ in got] == names
    source_of = {n: ex._by_target[n] for n in names}
    by_name = dict(params)
    per, hd = T.HEADS // T.GROUPS, T.HEAD_DIM
    for name, view in got:
        src = by_name[source_of[name]]
        assert view is not None and _shares_memory(view, src), name
        assert torch.equal(view.reshape(want[name].shape), want[name]), name
        if ".self_attn." in name and "o_proj" not in name:
            rows = per * hd if "q_proj" in name else hd
            assert tuple(view.shape) == (T.GROUPS, rows, *want[name].shape[1:]), name
            assert not view.is_contiguous(), name  # the other parts' rows lie between the groups
            # the first group's rows start where Megatron put them: [q; k; v] per group
            first = {"q_proj": 0, "k_proj": per * hd, "v_proj": (per + 1) * hd}[name.split(".")[-2]]
            inner = 1 if view.dim() == 2 else view.shape[-1]
            assert view.storage_offset() - src.detach().storage_offset() == first * inner, name
        else:
            assert view.is_contiguous(), name
    # the views are the memory, not a copy: a change to a source shows in them
    qkv = by_name["decoder.layers.0.self_attention.linear_qkv.weight"]
    with torch.no_grad():
        qkv.mul_(2)
    again = dict(ex.source_views(["model.layers.0.self_attn.k_proj.weight"]))
    assert torch.equal(again["model.layers.0.self_attn.k_proj.weight"].reshape(-1, T.HIDDEN),
                       2 * want["model.layers.0.self_attn.k_proj.weight"])


def test_source_views_are_none_where_the_output_is_converted():
    ref = hf_reference()
    ex = MegatronExtractor(megatron_params(ref), dtype=torch.bfloat16, attention=ATTENTION, vocab_size=T.VOCAB)
    names = [sp.name for sp in ex.specs()]
    assert [v for _, v in ex.source_views(names)] == [None] * len(names)  # float32 sources, bf16 engine
    with pytest.raises(KeyError):
        list(ex.source_views(["model.layers.9.mlp.up_proj.weight"]))


def test_given_views_a_replicated_tensor_in_the_engines_dtype_is_copied_into_its_view():
    """A norm that needs no gather or conversion goes into the caller's view (a staging slot's)
    and is yielded as it, so the sender's bucket counts as gathered in place (nothing to pack);
    bit for bit the trainer's tensor. A view the norm does not fit (another dtype) is left
    alone, and one that needs a conversion goes the old way too (a new tensor)."""
    ref = {n: t.to(torch.bfloat16) for n, t in hf_reference().items()}
    params = megatron_params(ref)
    ex = MegatronExtractor(params, dtype=torch.bfloat16, attention=ATTENTION, vocab_size=T.VOCAB)
    specs = {sp.name: sp for sp in ex.specs()}
    names = ["model.layers.0.input_layernorm.weight", "model.layers.1.post_attention_layernorm.weight",
             "model.norm.weight"]
    into = {n: torch.full(specs[n].shape, 7.0, dtype=torch.bfloat16) for n in names}
    wrong = names[1]
    into[wrong] = torch.zeros(specs[wrong].shape, dtype=torch.float32)
    got = dict(ex.extract(names, into))
    assert list(got) == names
    for n in names:
        assert_bit_equal(got[n], ref[n], n)
        assert (got[n] is into[n]) == (n != wrong), n
    assert not into[wrong].any()  # untouched
    # a source in another dtype than the engine's is converted, not copied into the view
    conv = MegatronExtractor([(k, v.detach().float()) for k, v in params], dtype=torch.bfloat16,
                             attention=ATTENTION, vocab_size=T.VOCAB)
    view = torch.full(specs[names[0]].shape, 7.0, dtype=torch.bfloat16)
    (name, t), = conv.extract(names[:1], {names[0]: view})
    assert t is not view and (view == 7).all()
    assert_bit_equal(t, ref[names[0]], name)


def test_device_and_upload_to_together_are_refused():
    with pytest.raises(ValueError, match="device .*or upload_to"):
        MegatronExtractor({}, device="cpu", upload_to="cpu")


def test_a_mapping_is_read_again_at_every_extract():
    ref = hf_reference()
    params = dict(megatron_params(ref, layers=(), embed=False))
    ex = MegatronExtractor(params, attention=ATTENTION)
    params["decoder.final_layernorm.weight"] = _param(torch.arange(8.0))
    (_, t), = ex.extract(["model.norm.weight"])
    assert_bit_equal(t, torch.arange(8.0))


def test_global_name_renumbers_stage_layers_and_rank_experts():
    assert global_name("decoder.layers.0.mlp.linear_fc1.weight", layer_offset=12) == \
        "decoder.layers.12.mlp.linear_fc1.weight"
    assert global_name("decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight", layer_offset=4,
                       expert_offset=8) == "decoder.layers.5.mlp.experts.local_experts.11.linear_fc2.weight"
    assert global_name("decoder.layers.2.mlp.experts.linear_fc1.weight1", expert_offset=4) == \
        "decoder.layers.2.mlp.experts.linear_fc1.weight5"
    assert global_name("embedding.word_embeddings.weight", layer_offset=3) == "embedding.word_embeddings.weight"


def test_grouped_gemm_expert_names_map_like_sequential_ones():
    w = _param(torch.randn(6, 4))
    ex = MegatronExtractor([("decoder.layers.3.mlp.experts.linear_fc1.weight7", w)])
    assert [s.name for s in ex.specs()] == ["model.layers.3.mlp.experts.7.gate_proj.weight",
                                            "model.layers.3.mlp.experts.7.up_proj.weight"]
    got = dict(ex.extract([s.name for s in ex.specs()]))
    assert_bit_equal(got["model.layers.3.mlp.experts.7.up_proj.weight"], w.detach()[3:])


def test_a_parameter_no_rule_matches_is_refused_by_name():
    with pytest.raises(ValueError, match=r"no name rule matches parameter\(s\) "
                                         r"\['decoder\.layers\.0\.mystery\.weight'\]; add a NameRule for them"):
        MegatronExtractor([("decoder.final_layernorm.weight", _param(torch.ones(2))),
                           ("decoder.layers.0.mystery.weight", _param(torch.ones(2)))])


def test_a_custom_rule_table_can_pass_names_through():
    rules = (NameRule(r"(.*)", (r"\1",)),)
    ex = MegatronExtractor([("decoder.layers.0.mystery.weight", _param(torch.ones(2)))], rules=rules)
    assert [s.name for s in ex.specs()] == ["decoder.layers.0.mystery.weight"]


def test_fused_qkv_needs_the_head_counts():
    ref = hf_reference()
    with pytest.raises(ValueError, match=r"'decoder\.layers\.0\.self_attention\.linear_qkv\.weight' is a fused QKV; "
                                         r"pass attention=\(num_attention_heads, num_query_groups\) to split it"):
        MegatronExtractor(megatron_params(ref, layers=(0,)))


@pytest.mark.parametrize("attention, message", [
    ((4, 3), r"attention=\(4, 3\): expected positive head counts with num_attention_heads a multiple"),
    ((0, 1), r"attention=\(0, 1\): expected positive"),
    ("4,2", r"attention must be \(num_attention_heads, num_query_groups\), got '4,2'"),
])
def test_bad_head_counts_are_refused(attention, message):
    with pytest.raises(ValueError, match=message):
        MegatronExtractor([], attention=attention)


def test_qkv_rows_that_do_not_fit_the_head_counts_are_refused():
    with pytest.raises(ValueError, match=r"linear_qkv\.weight' has 16 rows, not a multiple of heads \+ 2 \* "
                                         r"query groups = 10"):
        MegatronExtractor([("decoder.layers.0.self_attention.linear_qkv.weight", _param(torch.ones(16, 8)))],
                          attention=(6, 2))


def test_two_parameters_that_become_the_same_hf_name_are_refused():
    with pytest.raises(ValueError, match=r"'decoder\.layers\.0\.pre_mlp_layernorm\.weight' and "
                                         r"'decoder\.layers\.0\.mlp\.linear_fc1\.layer_norm_weight' both become "
                                         r"'model\.layers\.0\.post_attention_layernorm\.weight'"):
        MegatronExtractor([("decoder.layers.0.mlp.linear_fc1.layer_norm_weight", _param(torch.ones(2))),
                           ("decoder.layers.0.pre_mlp_layernorm.weight", _param(torch.ones(2)))])


@pytest.mark.parametrize("stride", [1, 2])
def test_a_glu_weight_with_stride_one_or_two_is_split_into_gate_and_up(stride):
    # 2: megatron-core >= 0.16 (MLP.__init__ passes stride=2 for a gated linear_fc1); 1: before 0.16
    gate, up = torch.randn(6, 4), torch.randn(6, 4)
    ex = MegatronExtractor([("decoder.layers.0.mlp.linear_fc1.weight", _glu(gate, up, 0, 1, stride))])
    got = dict(ex.extract([s.name for s in ex.specs()]))
    assert sorted(got) == ["model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"]
    assert_bit_equal(got["model.layers.0.mlp.gate_proj.weight"], gate)
    assert_bit_equal(got["model.layers.0.mlp.up_proj.weight"], up)


def test_every_parameter_that_cannot_be_mapped_is_named_in_one_error():
    odd_glu = _glu(torch.ones(2, 2), torch.ones(2, 2), 0, 1, stride=3)
    strided_head = _param(torch.ones(4, 2), True, 0, stride=2)
    with pytest.raises(ValueError) as e:
        MegatronExtractor([("decoder.layers.0.mlp.linear_fc1.weight", odd_glu), ("output_layer.weight", strided_head),
                           ("decoder.layers.0.mystery.weight", _param(torch.ones(2))),
                           ("decoder.layers.1.other.bias", _param(torch.ones(2)))])
    assert str(e.value) == (
        "megatron extractor: no name rule matches parameter(s) ['decoder.layers.0.mystery.weight', "
        "'decoder.layers.1.other.bias']; add a NameRule for them; cannot reassemble parameter(s) with this "
        "tensor-parallel layout: ['decoder.layers.0.mlp.linear_fc1.weight (partition_stride 3, expected 1 or 2)', "
        "'output_layer.weight (partition_stride 2, expected 1)']")


def test_the_last_stages_copy_of_a_tied_embedding_is_left_out():
    # megatron-core marks both copies of an embedding tied across pipeline stages shared_embedding
    # (LanguageModule.setup_embeddings_and_output_layer); HF ties lm_head to embed_tokens
    embed, head = _param(torch.randn(40, 8), True, 0), _param(torch.randn(40, 8), True, 0)
    embed.shared_embedding = head.shared_embedding = True
    ex = MegatronExtractor([("embedding.word_embeddings.weight", embed), ("output_layer.weight", head)])
    assert [s.name for s in ex.specs()] == ["model.embed_tokens.weight"]
    del head.shared_embedding  # untied: the head is a weight of its own
    ex = MegatronExtractor([("embedding.word_embeddings.weight", embed), ("output_layer.weight", head)])
    assert [s.name for s in ex.specs()] == ["model.embed_tokens.weight", "lm_head.weight"]


def test_linear_biases_map_like_their_weights():
    gate_b, up_b = torch.randn(6), torch.randn(6)
    fc1_bias = _param(torch.cat([gate_b, up_b]), True, 0, stride=2)  # megatron-core marks the bias stride 2 too
    ex = MegatronExtractor([("decoder.layers.2.mlp.linear_fc1.bias", fc1_bias),
                            ("decoder.layers.2.mlp.linear_fc2.bias", _param(torch.ones(4))),
                            ("decoder.layers.2.self_attention.linear_proj.bias", _param(torch.ones(4)))])
    got = dict(ex.extract([s.name for s in ex.specs()]))
    assert sorted(got) == ["model.layers.2.mlp.down_proj.bias", "model.layers.2.mlp.gate_proj.bias",
                           "model.layers.2.mlp.up_proj.bias", "model.layers.2.self_attn.o_proj.bias"]
    assert_bit_equal(got["model.layers.2.mlp.gate_proj.bias"], gate_b)
    assert_bit_equal(got["model.layers.2.mlp.up_proj.bias"], up_b)


def test_an_odd_glu_weight_is_refused():
    with pytest.raises(ValueError, match=r"GLU weight 'decoder\.layers\.0\.mlp\.linear_fc1\.weight' has an odd "
                                         r"first dimension 5"):
        MegatronExtractor([("decoder.layers.0.mlp.linear_fc1.weight", _param(torch.ones(5, 2)))])


def test_a_vocab_size_larger_than_the_embedding_is_refused():
    with pytest.raises(ValueError, match=r"vocab_size 41 is larger than "
                                         r"'embedding\.word_embeddings\.weight''s 40 rows"):
        MegatronExtractor([("embedding.word_embeddings.weight", _param(torch.ones(40, 2)))], vocab_size=41)


def test_rules_with_the_wrong_number_of_targets_are_refused():
    with pytest.raises(ValueError, match=r"rule 'x': split 'glu' makes 2 tensor\(s\), got 1 target name\(s\)"):
        NameRule("x", ("a",), split="glu")
    with pytest.raises(ValueError, match=r"split must be one of none, glu, qkv, got 'swap'"):
        NameRule("x", ("a",), split="swap")


def test_groups_without_torch_distributed_are_refused():
    with pytest.raises(RuntimeError, match=r"process groups were given but torch\.distributed is not initialized"):
        MegatronExtractor([], tp_group=object())


def test_unknown_names_and_resized_parameters_are_refused():
    ref = hf_reference()
    params = megatron_params(ref, layers=(), embed=False)
    ex = MegatronExtractor(params, dtype=torch.bfloat16)
    with pytest.raises(KeyError, match=r"megatron extractor: unknown tensor name\(s\) \['model\.layers\.0\.mlp"
                                       r"\.gate_proj\.weight'\]"):
        ex.extract(["model.norm.weight", "model.layers.0.mlp.gate_proj.weight"])
    params[0][1].data = torch.ones(3)
    with pytest.raises(ValueError, match=r"'decoder\.final_layernorm\.weight' is now \(3,\) float32, but was "
                                         r"\(8,\) float32 when the ranks exchanged metadata"):
        list(ex.extract(["model.norm.weight"]))
    params[0][1].data = torch.ones(8, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"is now \(8,\) float16, but was \(8,\) float32"):
        list(ex.extract(["model.norm.weight"]))
    mapping = dict(megatron_params(ref, layers=(), embed=False))
    ex = MegatronExtractor(mapping)
    del mapping["output_layer.weight"]
    with pytest.raises(KeyError, match=r"'output_layer\.weight' is no longer in this rank's parameters"):
        list(ex.extract(["lm_head.weight"]))


def refusal(fn, *args, **kw) -> str:
    """``fn(*args, **kw)``'s ValueError message ("" when it is not refused): what each rank
    of a worker reports back."""
    try:
        fn(*args, **kw)
    except ValueError as e:
        return str(e)
    return ""


# -- two processes on gloo -----------------------------------------------------------

def tp_worker(rank: int, world: int, tmp_path) -> dict:
    import torch.distributed as dist

    ref = hf_reference()
    params = megatron_params(ref, tp_rank=rank, tp=world)
    local_shapes = {n: tuple(p.shape) for n, p in params}
    ex = MegatronExtractor(params, dtype=torch.bfloat16, tp_group=dist.group.WORLD, attention=ATTENTION,
                           vocab_size=T.VOCAB)
    specs = [(s.name, list(s.shape), s.dtype) for s in ex.specs()]
    in_buckets = extract_in_buckets(ex, 64)  # small: gate and up land in different calls
    names = [s[0] for s in specs]
    reversed_names = [n for n, _ in ex.extract(names[::-1])]
    fp8 = dict(MegatronExtractor(params, dtype=torch.float8_e4m3fn, tp_group=dist.group.WORLD,
                                 attention=ATTENTION, vocab_size=T.VOCAB).extract(names))
    # refused on every rank alike, before any collective: a GLU weight sharded on
    # the wrong dimension; head counts whose query groups cannot be split over 2 ranks
    qkv = [(n, p) for n, p in params if n == "decoder.layers.0.self_attention.linear_qkv.weight"]
    errors = [refusal(MegatronExtractor, bad, tp_group=dist.group.WORLD, **kw)
              for bad, kw in (([("decoder.layers.0.mlp.linear_fc1.weight", _param(torch.ones(4, 2), True, 1))], {}),
                              (qkv, {"attention": (2, 1)}))]
    return {"local_shapes": local_shapes, "specs": specs, "in_buckets": in_buckets,
            "reversed_names": reversed_names, "fp8": fp8, "errors": errors}


def test_tensor_parallel_shards_are_gathered_reinterleaved_and_split(tmp_path):
    ref = hf_reference()
    results = run_workers(tp_worker, tmp_path)
    for rank, res in enumerate(results):
        # really sharded: each rank held half of the GLU rows and half of o_proj's columns
        assert res["local_shapes"]["decoder.layers.0.mlp.linear_fc1.weight"] == (T.INTER, T.HIDDEN)
        assert res["local_shapes"]["decoder.layers.0.self_attention.linear_proj.weight"] == (T.HIDDEN, 4)
        assert res["local_shapes"]["embedding.word_embeddings.weight"] == (PADDED_VOCAB // 2, T.HIDDEN)
        assert {n: (tuple(s), d) for n, s, d in res["specs"]} == {n: (tuple(t.shape), "bfloat16")
                                                                  for n, t in ref.items()}
        check_against(ref, res["in_buckets"], torch.bfloat16, f"rank {rank}")
        check_against(ref, res["fp8"], torch.float8_e4m3fn, f"rank {rank} fp8")
        assert res["reversed_names"] == [n for n, _, _ in res["specs"]][::-1]
        assert res["errors"] == [
            "megatron extractor: 'decoder.layers.0.mlp.linear_fc1.weight' is a fused glu weight sharded on dim 1; "
            "expected column-parallel (partition_dim 0)",
            "megatron extractor: 'decoder.layers.0.self_attention.linear_qkv.weight' is split over 2 "
            "tensor-parallel ranks, which does not divide its 1 query groups; check attention="]


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def ranged_worker(rank: int, world: int, tmp_path) -> dict:
    import torch.distributed as dist

    import colo.extractors.megatron as megatron

    megatron.GATHER_CHUNK_BYTES = 40  # a row-parallel tensor gathered in blocks of a few rows
    ref = hf_reference()
    params = megatron_params(ref, tp_rank=rank, tp=world)
    # a fused QKV of 4 query groups, 2 on each rank: its q, k and v parts are strided runs
    g = torch.Generator().manual_seed(3)
    heads, groups, hd, hidden = 8, 4, 2, 6
    q, k, v = (torch.randn(n * hd, hidden, generator=g) for n in (heads, groups, groups))
    per = heads // groups
    fused = torch.cat([x for i in range(groups) for x in (q[i * per * hd:(i + 1) * per * hd],
                                                            k[i * hd:(i + 1) * hd], v[i * hd:(i + 1) * hd])])
    wide = [("decoder.layers.0.self_attention.linear_qkv.weight", _column(fused, rank, world))]
    out: dict = {}
    # "named": told its device as "cpu:0", which a view's .device ("cpu") is not equal to
    # (as "cuda" is not "cuda:0": offload-first on two H200s gathered beside staging)
    for label, ps, attention, vocab, device in (("tiny", params, ATTENTION, T.VOCAB, None),
                                                ("groups", wide, (heads, groups), None, None),
                                                ("named", params, ATTENTION, T.VOCAB, "cpu:0")):
        ex = MegatronExtractor(ps, dtype=torch.bfloat16, tp_group=dist.group.WORLD, attention=attention,
                               vocab_size=vocab, device=device)
        specs = list(ex.specs())
        ranged = {s.name: ex.ranged(s.name) for s in specs}
        # each ranged tensor in runs of 2, 6 and 16 bytes, and whole, gathered by range
        by_range = {}
        for s in specs:
            if ranged[s.name]:
                for step in (2, 6, 16, s.nbytes):
                    runs = [ex.extract_range(s.name, o, min(step, s.nbytes - o)) for o in range(0, s.nbytes, step)]
                    by_range[f"{s.name}@{step}"] = torch.cat(runs)
        # every tensor into the caller's views: the gathered ones are those views
        views = {s.name: torch.full(s.shape, 7.0, dtype=torch.bfloat16) for s in specs}
        got = dict(ex.extract([s.name for s in specs], views))
        into = {n: got[n].data_ptr() == views[n].data_ptr() for n in got}
        out[label] = {"ranged": ranged, "by_range": by_range, "into": into, "got": got}
    ex = MegatronExtractor(params, dtype=torch.bfloat16, tp_group=dist.group.WORLD, attention=ATTENTION,
                           vocab_size=T.VOCAB)
    emb = "model.embed_tokens.weight"
    out["errors"] = [refusal(ex.extract_range, *args) for args in (
        ("model.layers.0.input_layernorm.weight", 0, 2), (emb, 1, 2), (emb, 0, 3),
        (emb, T.VOCAB * T.HIDDEN * 2 - 2, 4), (emb, 0, 4, torch.empty(4, dtype=torch.int16)))]
    return out


def test_ranged_pieces_and_gathers_into_the_callers_views_are_bit_exact(tmp_path):
    """Issue 34: a tensor-parallel tensor cut on its rows is gathered piece by piece (any
    byte range: the ranks' parts back to back, vocabulary padding cut, q/k/v of several
    query groups per rank), and every gathered tensor straight into the caller's views
    (a staging slot's); a row-parallel one in blocks of a few rows, and piece by piece too
    (issue 46: a 130 MiB down_proj in 64 MiB buckets was gathered whole beside staging):
    runs of one element, of parts of a row across a rank's boundary, of whole rows. All
    of it bit-equal to the unsharded model, on both ranks."""
    ref = hf_reference()
    results = run_workers(ranged_worker, tmp_path)
    g = torch.Generator().manual_seed(3)
    heads, groups, hd, hidden = 8, 4, 2, 6
    wide_ref = dict(zip((f"model.layers.0.self_attn.{x}_proj.weight" for x in "qkv"),
                        (torch.randn(n * hd, hidden, generator=g) for n in (heads, groups, groups))))
    rows = {"model.embed_tokens.weight", "lm_head.weight"} | {
        f"model.layers.{i}.{n}" for i in (0, 1) for n in (
            "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
            "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias",
            "mlp.gate_proj.weight", "mlp.up_proj.weight")}
    for rank, res in enumerate(results):
        tiny, wide = res["tiny"], res["groups"]
        # row-parallel ones too (their rows gathered block by block, each piece's bytes taken from them)
        row_parallel = {f"model.layers.{i}.{n}" for i in (0, 1)
                        for n in ("self_attn.o_proj.weight", "mlp.down_proj.weight")}
        assert {n for n, r in tiny["ranged"].items() if r} == rows | row_parallel
        assert all(wide["ranged"].values()) and sorted(wide["ranged"]) == sorted(wide_ref)
        for case, want in ((tiny, ref), (wide, wide_ref)):
            check_against(want, case["got"], torch.bfloat16, f"rank {rank} into views")
            for key, t in case["by_range"].items():
                name = key.split("@")[0]
                assert torch.equal(t, _as_bytes(want[name].to(torch.bfloat16))), f"rank {rank} {key}"
        # gathered into the views: every tensor-parallel tensor, row-parallel ones included
        gathered = rows | row_parallel
        assert {n for n, inside in tiny["into"].items() if inside} == gathered
        assert {n for n, inside in res["named"]["into"].items() if inside} == gathered
        check_against(ref, res["named"]["got"], torch.bfloat16, f"rank {rank} into views, device named")
        assert all(wide["into"].values())
        assert res["errors"] == [
            "megatron extractor: 'model.layers.0.input_layernorm.weight' is not gathered from the ranks' own "
            "shards nor a contiguous slice of this rank's; extract it whole",
            "megatron extractor: bytes [1, 3) are not a run of whole elements of 'model.embed_tokens.weight' "
            f"({T.VOCAB * T.HIDDEN * 2} bytes of 2-byte elements)",
            "megatron extractor: bytes [0, 3) are not a run of whole elements of 'model.embed_tokens.weight' "
            f"({T.VOCAB * T.HIDDEN * 2} bytes of 2-byte elements)",
            f"megatron extractor: bytes [{T.VOCAB * T.HIDDEN * 2 - 2}, {T.VOCAB * T.HIDDEN * 2 + 2}) are not a run "
            f"of whole elements of 'model.embed_tokens.weight' ({T.VOCAB * T.HIDDEN * 2} bytes of 2-byte elements)",
            "megatron extractor: out for 'model.embed_tokens.weight' must be 4 contiguous uint8 bytes, got (4,) "
            "torch.int16"]


def pp_worker(rank: int, world: int, tmp_path) -> dict:
    import torch.distributed as dist

    ref = hf_reference()
    # two pipeline stages: embedding and layer 0 on rank 0; layer 1, final norm and head on rank 1
    params = megatron_params(ref, layers=(rank,), embed=rank == 0, head=rank == 1)
    ex = MegatronExtractor(params, dtype=torch.bfloat16, pp_group=dist.group.WORLD, attention=ATTENTION,
                           vocab_size=T.VOCAB)
    out = {"names": sorted(n for n, _ in params), "specs": [s.name for s in ex.specs()],
           "in_buckets": extract_in_buckets(ex, 200)}
    # both stages claim the final norm, with different shapes: every rank refuses alike
    clash = [("decoder.final_layernorm.weight", _param(torch.ones(8 + rank)))]
    # a parameter only rank 1 has, with no pipeline group to bring it to rank 0
    orphan = [("decoder.final_layernorm.weight", _param(torch.ones(8)))] if rank == 1 else []
    out["errors"] = [refusal(MegatronExtractor, bad, **kw)
                     for bad, kw in ((clash, {"pp_group": dist.group.WORLD}), (orphan, {}))]
    return out


def batch_worker(rank: int, world: int, tmp_path) -> dict:
    import torch.distributed as dist

    import colo.extractors.megatron as megatron

    calls: list[tuple[str, int]] = []
    coalesced, single = megatron._all_gather_coalesced, megatron._all_gather_single
    inside = [False]

    def counted_coalesced(outs, ins, group):
        calls.append(("coalesced", len(outs)))
        inside[0] = True  # (one output goes as a plain all-gather: one collective, counted here)
        try:
            coalesced(outs, ins, group)
        finally:
            inside[0] = False

    def counted_single(out, inp, group=None):
        if not inside[0]:
            calls.append(("single", 1))
        single(out, inp, group=group)

    megatron._all_gather_coalesced, megatron._all_gather_single = counted_coalesced, counted_single
    ref = hf_reference()
    params = megatron_params(ref, tp_rank=rank, tp=world)
    ex = MegatronExtractor(params, dtype=torch.bfloat16, tp_group=dist.group.WORLD, attention=ATTENTION,
                           vocab_size=T.VOCAB)
    layer = [s for s in ex.specs() if s.name.startswith("model.layers.0.")]
    views = {s.name: torch.full(s.shape, 7.0, dtype=torch.bfloat16) for s in layer}
    out = {}
    for label, into in (("views", views), ("new", None)):
        calls.clear()
        got = dict(ex.extract([s.name for s in layer], into))
        out[label] = {"got": got, "calls": list(calls),
                      "in_views": sorted(n for n in got if got[n].data_ptr() == views[n].data_ptr())}
    calls.clear()  # q alone of the fused QKV: its k and v are not gathered
    out["q_only"] = {"got": dict(ex.extract(["model.layers.0.self_attn.q_proj.weight"])), "calls": list(calls)}
    return out


def test_a_calls_row_gathered_outputs_go_in_one_collective_and_come_out_bit_exact(tmp_path):
    """Issue 46: a bucket's outputs gathered on their rows (q, k, v and their biases of
    the fused QKV, gate and up) go as ONE coalesced all-gather, this rank's parts put in
    place first; the row-parallel o_proj and down_proj by their blocks. One collective per
    output was most of a TP=2 sync's host time on two H200s. Into the caller's views or
    into new tensors, every output bit-equal to the unsharded model on both ranks; only
    the outputs asked for are gathered."""
    ref = hf_reference()
    results = run_workers(batch_worker, tmp_path)
    rows = {f"model.layers.0.{n}" for n in (
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
        "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias",
        "mlp.gate_proj.weight", "mlp.up_proj.weight")}
    layer0 = {n: t for n, t in ref.items() if n.startswith("model.layers.0.")}
    for rank, res in enumerate(results):
        for label in ("views", "new"):
            check_against(layer0, res[label]["got"], torch.bfloat16, f"rank {rank} {label}")
            calls = res[label]["calls"]
            # first the rows, together; then o_proj and down_proj, each in one block of its own here
            assert calls[0] == ("coalesced", len(rows)), (rank, label, calls)
            assert calls[1:] == [("single", 1), ("single", 1)], (rank, label, calls)
        assert set(res["views"]["in_views"]) == rows | {"model.layers.0.self_attn.o_proj.weight",
                                                        "model.layers.0.mlp.down_proj.weight"}
        assert res["new"]["in_views"] == []
        q = "model.layers.0.self_attn.q_proj.weight"
        assert list(res["q_only"]["got"]) == [q] and res["q_only"]["calls"] == [("coalesced", 1)]
        assert_bit_equal(res["q_only"]["got"][q], ref[q].to(torch.bfloat16), f"rank {rank} q alone")


def test_pipeline_stage_parameters_are_broadcast_from_their_stage(tmp_path):
    ref = hf_reference()
    results = run_workers(pp_worker, tmp_path)
    assert not set(results[0]["names"]) & set(results[1]["names"])  # nothing shared: every layer has one owner
    for rank, res in enumerate(results):
        check_against(ref, res["in_buckets"], torch.bfloat16, f"rank {rank}")
        # rank-major order of first appearance: stage 0's tensors, then stage 1's
        assert res["specs"].index("model.layers.0.mlp.down_proj.weight") < res["specs"].index("model.norm.weight")
        assert res["errors"] == [
            "megatron extractor: ranks disagree about 'decoder.final_layernorm.weight' (shape, dtype or parallel "
            "attributes differ): rank 0: (8,) float32 tensor_model_parallel=False partition_dim=-1 "
            "partition_stride=1; rank 1: (9,) float32 tensor_model_parallel=False partition_dim=-1 "
            "partition_stride=1",
            "megatron extractor: 'decoder.final_layernorm.weight' (held by ranks [1]) cannot reach rank(s) [0] "
            "through their pipeline groups"]


EXPERTS = 4


def ep_worker(rank: int, world: int, tmp_path) -> dict:
    import torch.distributed as dist

    ref = hf_reference(experts=EXPERTS)
    per = EXPERTS // world
    # dense layers tensor-parallel over both ranks; experts split between them (expert parallelism 2,
    # expert tensor parallelism 1), named locally from 0 like Megatron does
    params = megatron_params(ref, tp_rank=rank, tp=world, experts=range(rank * per, (rank + 1) * per),
                             expert_offset=rank * per)
    ex = MegatronExtractor(params, dtype=torch.bfloat16, tp_group=dist.group.WORLD, ep_group=dist.group.WORLD,
                           attention=ATTENTION, vocab_size=T.VOCAB)
    return {"names": [n for n, _ in params], "in_buckets": extract_in_buckets(ex, 100)}


def test_expert_parameters_are_broadcast_from_their_owner_and_dense_ones_gathered(tmp_path):
    ref = hf_reference(experts=EXPERTS)
    results = run_workers(ep_worker, tmp_path)
    assert "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight" in results[1]["names"]
    assert "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight" not in results[0]["names"]
    assert "model.layers.1.mlp.experts.3.gate_proj.weight" in ref
    for rank, res in enumerate(results):
        check_against(ref, res["in_buckets"], torch.bfloat16, f"rank {rank}")


def tp_pp_worker(rank: int, world: int, tmp_path) -> dict:
    import torch.distributed as dist

    ref = hf_reference()
    # 4 ranks: TP 2 x PP 2. Stage 0 = ranks 0, 1 (embedding, layer 0); stage 1 = ranks 2, 3 (layer 1, head).
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    stage, tp_rank = divmod(rank, 2)
    params = megatron_params(ref, tp_rank=tp_rank, tp=2, layers=(stage,), embed=stage == 0, head=stage == 1)
    ex = MegatronExtractor(params, dtype=torch.bfloat16, tp_group=tp_groups[stage], pp_group=pp_groups[tp_rank],
                           attention=ATTENTION, vocab_size=T.VOCAB)
    return {"in_buckets": extract_in_buckets(ex, 150)}


def test_tensor_and_pipeline_parallel_together_on_four_ranks(tmp_path):
    ref = hf_reference()
    results = run_workers(tp_pp_worker, tmp_path, world_size=4)
    for rank, res in enumerate(results):
        check_against(ref, res["in_buckets"], torch.bfloat16, f"rank {rank}")


def test_runs_cover_a_strided_view_in_contiguous_pieces_in_order():
    """q, k or v of several query groups is a strided view of the fused QKV: the upload
    goes run by run (``_runs``), each run contiguous, together exactly the view."""
    from colo.extractors.megatron import _runs

    fused = torch.arange(4 * 10 * 3, dtype=torch.float32).view(4, 10, 3)  # 4 groups of 10 rows
    part = fused[:, 2:7]  # rows 2..6 of every group: not contiguous
    dst = torch.zeros(part.shape)
    pieces = list(_runs(dst, part))
    assert len(pieces) == 4 and all(s.is_contiguous() and d.shape == s.shape for d, s in pieces)
    for d, s in pieces:
        d.copy_(s)
    assert torch.equal(dst, part)
    assert [s.data_ptr() for _, s in pieces] == [fused[g, 2].data_ptr() for g in range(4)]
    whole = torch.ones(3, 5)
    assert [(d.shape, s is whole) for d, s in _runs(torch.empty(3, 5), whole)] == [((3, 5), True)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_an_upload_from_pinned_host_runs_on_its_stream_and_the_callers_stream_waits_for_it():
    """``offload-first``: parts of the pinned host copy go up on the extractor's upload
    stream, run by run, several in one call; whatever the caller's stream queues next sees
    the bytes, even when the upload stream is held up behind a long kernel. The first
    upload of a call comes after what the default stream queued (the trainer's writes of
    its host copy: here a late copy into it); one into new memory after what the caller's
    stream queued (here a late write of the same memory, which must not land over it)."""
    from colo.extractors.megatron import _uploadable

    fused = torch.randn(4, 64, 1024, dtype=torch.bfloat16).pin_memory()
    ex = MegatronExtractor({"decoder.final_layernorm.weight": _param(torch.ones(8))}, dtype=torch.bfloat16)
    dst = torch.zeros(4 * 24 * 1024, dtype=torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()  # the caller's stream (a sender's), not the default one
    side.wait_stream(torch.cuda.current_stream())
    # the trainer writes its host copy on the default stream, late: the call's first upload waits
    written = torch.randn(4, 24, 1024, dtype=torch.bfloat16, device="cuda")
    host = torch.zeros(4, 24, 1024, dtype=torch.bfloat16).pin_memory()  # contiguous: a truly queued copy
    torch.cuda._sleep(200_000_000)
    host.copy_(written, non_blocking=True)
    with torch.cuda.stream(side):
        assert dst.device not in ex._call_streams
        ex._upload([(dst, host)])
        assert torch.equal(dst.view(4, 24, 1024).cpu(), written.cpu())
    torch.cuda.synchronize()
    # new memory: the caller's stream is busy, then writes it; the upload lands after that write
    with torch.cuda.stream(side):
        assert dst.device in ex._call_streams  # the call fenced already: only fresh waits now
        torch.cuda._sleep(200_000_000)
        dst.fill_(7.0)
        ex._upload([(dst, fused[:, 8:32])], fresh=True)
        assert torch.equal(dst.view(4, 24, 1024).cpu(), fused[:, 8:32])
    torch.cuda.synchronize()
    stream = ex._upload_streams[dst.device]
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)  # the upload stream is busy for a while
    fused.neg_()
    # two parts in one call (a bucket's row-gathered outputs; a new call, on the default
    # stream): the caller waits for both
    ex._call_streams.clear()
    other = torch.zeros(4 * 8 * 1024, dtype=torch.bfloat16, device="cuda")
    ex._upload([(dst, fused[:, 8:32]), (other, fused[:, 40:48])])
    seen = dst.view(4, 24, 1024).clone(), other.view(4, 8, 1024).clone()  # on the caller's stream, at once
    assert torch.equal(seen[0].cpu(), fused[:, 8:32]) and torch.equal(seen[1].cpu(), fused[:, 40:48])
    # not such a pair (a device source, a pageable one, another dtype): copied the ordinary way
    assert _uploadable(dst, fused[:, 8:32])
    assert not _uploadable(dst, dst.view(4, 24, 1024).clone())
    assert not _uploadable(dst, fused[:, 8:32].clone())
    assert not _uploadable(dst, fused[:, 8:32].float().pin_memory())
