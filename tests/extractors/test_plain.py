"""PlainExtractor: an unsharded module (or a name -> tensor mapping), converted to the engine dtype."""

from __future__ import annotations

import pytest
import torch

from colo.core.buckets import plan_buckets
from colo.extractors import PlainExtractor
from colo.core.interfaces import WeightExtractor
from tests.dist_helpers import TinyLlama, assert_bit_equal
from tests.syncparts import calls_of


def reference(seed=0, **kw) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in TinyLlama(seed, **kw).state_dict().items()}


def model_with_counter() -> TinyLlama:
    m = TinyLlama(0)
    m.register_buffer("steps", torch.tensor([7, 8], dtype=torch.int64))  # persistent, not floating
    return m


def test_specs_list_the_state_dict_in_order_in_the_engine_dtype():
    m = model_with_counter()
    specs = PlainExtractor(m, dtype=torch.bfloat16).specs()
    sd = m.state_dict()
    assert [s.name for s in specs] == list(sd)
    assert "model.inv_freq" not in {s.name for s in specs}  # non-persistent buffers are not weights
    for s in specs:
        assert s.shape == tuple(sd[s.name].shape)
        assert s.dtype == ("int64" if s.name == "steps" else "bfloat16")
        assert s.nbytes == sd[s.name].numel() * (8 if s.name == "steps" else 2)


def test_bucket_by_bucket_extraction_is_bit_exact_against_the_unsharded_model():
    m = model_with_counter()
    ref = m.state_dict()
    ex = PlainExtractor(m, dtype="bfloat16")
    assert isinstance(ex, WeightExtractor)
    got = {}
    plan = plan_buckets(list(ex.specs()), 100)
    assert len(plan) > 5  # small buckets: many calls, each a subset
    for b in plan:
        names = [e.spec.name for e in b.entries]
        out = list(ex.extract(names))
        assert [n for n, _ in out] == names
        got.update(out)
    assert list(got) == list(ref)
    for n, t in got.items():
        want = ref[n] if n == "steps" else ref[n].to(torch.bfloat16)
        assert_bit_equal(t, want, n)
        assert t.is_contiguous()


def test_any_subset_in_any_order():
    m = TinyLlama(1)
    ex = PlainExtractor(m, dtype=torch.float16)
    names = ["lm_head.weight", "model.layers.1.mlp.up_proj.weight", "model.embed_tokens.weight"]
    out = list(ex.extract(names))
    assert [n for n, _ in out] == names
    for n, t in out:
        assert_bit_equal(t, m.state_dict()[n].to(torch.float16), n)
    assert list(ex.extract([])) == []


def test_float8_engine_dtype_converts_inside_the_extractor():
    m = TinyLlama(2)
    ex = PlainExtractor(m, dtype=torch.float8_e4m3fn)
    spec = {s.name: s for s in ex.specs()}["model.layers.0.self_attn.q_proj.weight"]
    assert (spec.dtype, spec.nbytes) == ("float8_e4m3fn", 8 * 8)
    (name, t), = ex.extract([spec.name])
    assert_bit_equal(t, m.model.layers[0].self_attn.q_proj.weight.detach().to(torch.float8_e4m3fn), name)


def test_without_an_engine_dtype_tensors_keep_theirs():
    m = TinyLlama(3)
    ex = PlainExtractor(m)
    assert {s.dtype for s in ex.specs()} == {"float32"}
    (_, t), = ex.extract(["model.norm.weight"])
    assert_bit_equal(t, m.model.norm.weight.detach(), "model.norm.weight")


def test_extraction_reads_the_parameters_as_they_are_now():
    m = TinyLlama(4)
    ex = PlainExtractor(m, dtype=torch.bfloat16)
    with torch.no_grad():
        m.model.norm.weight.add_(1.0)  # an optimizer step
    m.lm_head.weight.data = torch.full((37, 8), 0.5)  # an offload/onload that swaps .data
    got = dict(ex.extract(["model.norm.weight", "lm_head.weight"]))
    assert_bit_equal(got["model.norm.weight"], m.model.norm.weight.detach().to(torch.bfloat16))
    assert_bit_equal(got["lm_head.weight"], torch.full((37, 8), 0.5, dtype=torch.bfloat16))


def test_a_mapping_source_such_as_a_host_copy_moved_to_a_device():
    host = reference(5)
    ex = PlainExtractor(host, dtype=torch.bfloat16, device="cpu")
    host["model.norm.weight"] = torch.arange(8.0)  # the trainer refreshes its host copy after a step
    got = dict(ex.extract(["model.norm.weight", "lm_head.weight"]))
    assert_bit_equal(got["model.norm.weight"], torch.arange(8.0).to(torch.bfloat16))
    assert_bit_equal(got["lm_head.weight"], host["lm_head.weight"].to(torch.bfloat16))
    assert got["lm_head.weight"].device == torch.device("cpu")


def test_rename_maps_names_and_drops_tensors():
    m = TinyLlama(6)
    ex = PlainExtractor(m, dtype=torch.bfloat16,
                        rename=lambda n: None if n == "lm_head.weight" else n.removeprefix("model."))
    names = [s.name for s in ex.specs()]
    assert "lm_head.weight" not in names and names[0] == "embed_tokens.weight"
    (_, t), = ex.extract(["layers.0.mlp.down_proj.weight"])
    assert_bit_equal(t, m.model.layers[0].mlp.down_proj.weight.detach().to(torch.bfloat16))


def test_rename_that_merges_two_tensors_is_refused():
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' and 'model\.embed_tokens\.weight' both map to "
                                         r"engine name 'w'"):
        PlainExtractor(TinyLlama(), rename=lambda n: "w" if n in ("model.embed_tokens.weight",
                                                                  "model.norm.weight") else n)


def test_unknown_names_are_listed():
    ex = PlainExtractor(TinyLlama(), dtype=torch.bfloat16)
    with pytest.raises(KeyError, match=r"plain extractor: unknown tensor name\(s\) \['model\.layers\.9\.x', "
                                       r"'nope'\]; the extractor knows 27 names \(see specs\(\)\)$"):
        ex.extract(["model.norm.weight", "model.layers.9.x", "nope"])


def test_a_name_twice_in_one_call_is_refused():
    ex = PlainExtractor(TinyLlama())
    with pytest.raises(ValueError, match=r"tensor name\(s\) \['model\.norm\.weight'\] requested more than once"):
        ex.extract(["model.norm.weight", "lm_head.weight", "model.norm.weight"])


def test_a_single_string_is_not_a_list_of_names():
    with pytest.raises(TypeError, match=r"takes a sequence of names, got the single string 'lm_head\.weight'"):
        PlainExtractor(TinyLlama()).extract("lm_head.weight")


@pytest.mark.parametrize("dtype", ["bfloat17", "Tensor", 3])
def test_an_engine_dtype_that_is_not_a_dtype_is_refused(dtype):
    with pytest.raises(ValueError, match=r"engine dtype .* is not a torch dtype \(expected e\.g\. torch\.bfloat16"):
        PlainExtractor(TinyLlama(), dtype=dtype)


def test_a_source_that_is_neither_module_nor_mapping_is_refused():
    with pytest.raises(TypeError, match=r"source must be an nn\.Module or a mapping of name to tensor, got list"):
        PlainExtractor([("w", torch.zeros(2))])
    with pytest.raises(TypeError, match=r"plain extractor: 'w' is a list, not a tensor"):
        PlainExtractor({"w": [1.0, 2.0]})


def test_a_parameter_resized_after_construction_is_refused_not_sent():
    m = TinyLlama()
    ex = PlainExtractor(m, dtype=torch.bfloat16)
    m.model.norm.weight.data = torch.ones(9)
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' is now \(9,\) bfloat16, but specs\(\) promised "
                                         r"\(8,\) bfloat16"):
        list(ex.extract(["model.norm.weight"]))


def test_a_tensor_removed_from_a_mapping_source_is_named():
    host = reference()
    ex = PlainExtractor(host)
    del host["lm_head.weight"]
    with pytest.raises(KeyError, match=r"'lm_head\.weight' is no longer in the source"):
        list(ex.extract(["lm_head.weight"]))


def test_upload_to_and_device_are_exclusive_and_upload_to_keeps_tensors_on_the_host():
    import torch

    from colo.extractors.plain import PlainExtractor

    src = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    with pytest.raises(ValueError, match="give device .* or upload_to"):
        PlainExtractor(src, device="cpu", upload_to="cpu")
    ex = PlainExtractor(src, upload_to="cpu")
    assert ex.upload_to == torch.device("cpu")
    (name, t), = ex.extract(["w"])
    assert name == "w" and t.device.type == "cpu" and torch.equal(t, src["w"])


# -- the same request again (sync after sync) ------------------------------------------

def test_the_same_request_of_the_same_source_is_not_looked_up_again_and_reads_the_new_values(monkeypatch):
    host = reference(6)  # a paused trainer's host backup: the same tensors every sync
    ex = PlainExtractor(host, dtype=torch.float32)
    names = ["model.norm.weight", "lm_head.weight"]
    full = calls_of(monkeypatch, ex, "_full", 0)
    first = dict(ex.extract(names))
    assert full == names
    host["model.norm.weight"].add_(1.0)  # the next step's weights, written in place
    again = dict(ex.extract(names))
    assert full == names  # nothing looked up, converted or checked again
    assert_bit_equal(again["model.norm.weight"], host["model.norm.weight"])
    assert again["lm_head.weight"].data_ptr() == host["lm_head.weight"].data_ptr()
    assert_bit_equal(first["model.norm.weight"], again["model.norm.weight"])  # both are the source itself


def test_a_swapped_moved_or_resized_source_and_another_request_are_extracted_afresh(monkeypatch):
    host = reference(7)
    ex = PlainExtractor(host, dtype=torch.float32)
    names = ["model.norm.weight", "lm_head.weight"]
    full = calls_of(monkeypatch, ex, "_full", 0)
    list(ex.extract(names))
    host["model.norm.weight"] = torch.arange(8.0)  # another tensor under the name
    got = dict(ex.extract(names))
    assert_bit_equal(got["model.norm.weight"], torch.arange(8.0)) and len(full) == 4
    host["lm_head.weight"].set_(torch.zeros(37, 8))  # the same object over other memory
    got = dict(ex.extract(names))
    assert_bit_equal(got["lm_head.weight"], torch.zeros(37, 8)) and len(full) == 6
    host["lm_head.weight"].set_(torch.zeros(38, 8))  # resized in place: refused by name, not sent
    with pytest.raises(ValueError, match="lm_head.weight"):
        list(ex.extract(names))
    host["lm_head.weight"].set_(torch.ones(37, 8))
    assert dict(ex.extract(names[::-1])).keys() == {*names}  # another request: looked up


def test_a_request_whose_results_are_new_tensors_is_converted_every_time(monkeypatch):
    host = reference(8)
    ex = PlainExtractor(host, dtype=torch.bfloat16)  # a conversion on the host: a new tensor each time
    names = ["model.norm.weight"]
    full = calls_of(monkeypatch, ex, "_full", 0)
    a = dict(ex.extract(names))["model.norm.weight"]
    host["model.norm.weight"].mul_(2)
    b = dict(ex.extract(names))["model.norm.weight"]
    assert full == names * 2 and a.data_ptr() != b.data_ptr()
    assert_bit_equal(b, host["model.norm.weight"].to(torch.bfloat16))


def test_the_extractor_does_not_keep_a_source_alive():
    import gc
    import weakref

    host = reference(9)
    ex = PlainExtractor(host, dtype=torch.float32)
    list(ex.extract(["lm_head.weight"]))
    gone = weakref.ref(host["lm_head.weight"])
    host["lm_head.weight"] = torch.zeros(37, 8)  # the trainer drops its old backup
    gc.collect()
    assert gone() is None


def test_a_rank_s_counting_view_of_the_extractor_hands_the_staging_views_through():
    # the two-GPU demo's ranks wrap the trainer's extractor to count its calls; the
    # wrapper once dropped ``into`` and every hf and fsdp sync on two H200s failed
    from colo.ranks.host import _Drain

    class Trainer:
        def __init__(self, ex):
            self.ex = ex

        def extractor(self):
            return self.ex

    host = reference(10)
    seen = []
    ex = PlainExtractor(host, dtype=torch.float32)
    real = ex.extract
    ex.extract = lambda names, into=None: seen.append(into) or real(names, into)
    drain = _Drain(Trainer(ex))
    counting = drain.extractor()
    assert counting.extracts_into is True
    into = {"model.norm.weight": torch.empty(8)}
    got = dict(counting.extract(["model.norm.weight"], into))
    dict(counting.extract(["lm_head.weight"]))
    assert seen == [into, None] and drain.extracted == 2
    assert_bit_equal(got["model.norm.weight"], host["model.norm.weight"])
