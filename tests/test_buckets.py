"""Bucket planning: properties over arbitrary metadata, plus the errors bad input gets."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from colo.core.buckets import ALIGN, ITEMSIZE, plan_buckets, spec
from colo.core.interfaces import TensorSpec

DTYPES = sorted(ITEMSIZE)


def _named(pairs):
    return [spec(f"t{i}", shape, dtype) for i, (shape, dtype) in enumerate(pairs)]


# Small dims and budgets so that oversized tensors, exact fits and padding-only
# overflows all occur often.
spec_lists = st.lists(st.tuples(st.lists(st.integers(0, 9), max_size=3), st.sampled_from(DTYPES)),
                      max_size=24).map(_named)


budgets = st.integers(1, 600)
aligns = st.sampled_from([1, 2, 4, 8, 16, 64])


@settings(max_examples=150, deadline=None)
@given(specs=spec_lists, budget=budgets, align=aligns)
def test_every_tensor_lands_exactly_once_in_order(specs, budget, align):
    plan = plan_buckets(specs, budget, align=align)
    assert [e.spec for b in plan for e in b.entries] == specs
    assert [b.index for b in plan] == list(range(len(plan)))
    assert all(b.entries for b in plan)


@settings(max_examples=150, deadline=None)
@given(specs=spec_lists, budget=budgets, align=aligns)
def test_offsets_are_aligned_for_the_dtype_and_the_requested_alignment(specs, budget, align):
    for b in plan_buckets(specs, budget, align=align):
        for e in b.entries:
            assert e.start % ITEMSIZE[e.spec.dtype] == 0, (b.index, e)
            assert e.start % align == 0, (b.index, e)


@settings(max_examples=150, deadline=None)
@given(specs=spec_lists, budget=budgets, align=aligns)
def test_entries_are_consistent_and_do_not_overlap(specs, budget, align):
    for b in plan_buckets(specs, budget, align=align):
        prev_end = 0
        for e in b.entries:
            assert e.end - e.start == e.spec.nbytes
            assert e.start >= prev_end
            prev_end = e.end
        assert b.nbytes == b.entries[-1].end
        assert b.payload_bytes == sum(e.spec.nbytes for e in b.entries) <= b.nbytes


@settings(max_examples=150, deadline=None)
@given(specs=spec_lists, budget=budgets, align=aligns)
def test_no_bucket_exceeds_the_budget_unless_it_holds_one_oversized_tensor(specs, budget, align):
    for b in plan_buckets(specs, budget, align=align):
        if b.nbytes > budget:
            assert len(b.entries) == 1, b
            assert b.entries[0].spec.nbytes > budget
            assert b.entries[0].start == 0


@settings(max_examples=100, deadline=None)
@given(specs=spec_lists, budget=budgets, align=aligns)
def test_a_tensor_larger_than_the_budget_is_alone_in_its_bucket(specs, budget, align):
    for b in plan_buckets(specs, budget, align=align):
        if any(e.spec.nbytes > budget for e in b.entries):
            assert len(b.entries) == 1


@settings(max_examples=100, deadline=None)
@given(specs=spec_lists, budget=budgets, align=aligns)
def test_the_plan_is_deterministic(specs, budget, align):
    copy = [TensorSpec(s.name, tuple(s.shape), s.dtype, s.nbytes) for s in specs]
    assert plan_buckets(specs, budget, align=align) == plan_buckets(copy, budget, align=align)


@settings(max_examples=100, deadline=None)
@given(specs=spec_lists, budget=budgets)
def test_greedy_packing_closes_a_bucket_only_when_the_next_tensor_would_not_fit(specs, budget):
    plan = plan_buckets(specs, budget)
    for b, nxt in zip(plan, plan[1:]):
        first = nxt.entries[0].spec
        start = -(-b.nbytes // ALIGN) * ALIGN
        assert b.nbytes >= budget or start + first.nbytes > budget


def test_default_alignment_packs_three_ten_byte_tensors_per_fifty_byte_bucket():
    specs = [spec(f"w{i}", (10,), "uint8") for i in range(7)]
    plan = plan_buckets(specs, 50)
    assert [[e.spec.name for e in b.entries] for b in plan] == [["w0", "w1", "w2"], ["w3", "w4", "w5"], ["w6"]]
    assert [(e.start, e.end) for e in plan[0].entries] == [(0, 10), (16, 26), (32, 42)]
    assert plan[0].nbytes == 42 and plan[0].payload_bytes == 30


def test_an_oversized_tensor_between_small_ones_gets_its_own_bucket():
    specs = [spec("a", (4,), "float32"), spec("big", (100,), "float32"), spec("b", (4,), "float32")]
    plan = plan_buckets(specs, 64)
    assert [[e.spec.name for e in b.entries] for b in plan] == [["a"], ["big"], ["b"]]
    assert plan[1].nbytes == 400


def test_alignment_below_the_itemsize_still_aligns_to_the_dtype():
    plan = plan_buckets([spec("flag", (1,), "bool"), spec("w", (2,), "float64")], 1024, align=1)
    assert [(e.start, e.end) for e in plan[0].entries] == [(0, 1), (8, 24)]


def test_meta_is_the_flattened_bucket_wire_format():
    from colo.transports.base import TensorMeta

    (m,) = TensorMeta.of_bucket(plan_buckets([spec("x", (2, 3), "torch.bfloat16")], 100)[0])
    assert m.to_json() == {"name": "x", "shape": [2, 3], "dtype": "bfloat16",
                           "start_idx": 0, "end_idx": 12, "numel": 12}


def test_no_tensors_means_no_buckets():
    assert plan_buckets([], 10) == []


@pytest.mark.parametrize("budget", [0, -5, True, 2.5, "64"])
def test_budget_must_be_a_positive_integer_number_of_bytes(budget):
    with pytest.raises(ValueError, match=r"bucket budget must be a positive number of bytes, got"):
        plan_buckets([spec("a", (1,), "uint8")], budget)


@pytest.mark.parametrize("align", [0, -16, 3, 24, True, 16.0])
def test_align_must_be_a_power_of_two(align):
    with pytest.raises(ValueError, match=r"align must be a positive power of two, got"):
        plan_buckets([spec("a", (1,), "uint8")], 64, align=align)


def test_duplicate_names_are_refused_by_name():
    with pytest.raises(ValueError, match=r"tensor 'a' appears twice; every tensor must be sent once"):
        plan_buckets([spec("a", (1,), "uint8"), spec("b", (1,), "uint8"), spec("a", (2,), "uint8")], 64)


def test_unknown_dtype_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown dtype 'complex64'; expected one of float64, float32"):
        plan_buckets([TensorSpec("z", (2,), "complex64", 16)], 64)
    with pytest.raises(ValueError, match=r"unknown dtype 'complex64'"):
        spec("z", (2,), "complex64")


def test_nbytes_that_disagree_with_shape_and_dtype_are_refused():
    with pytest.raises(ValueError, match=r"tensor 'w': nbytes 7 does not match shape \(2, 2\) and dtype float16 "
                                         r"\(expected 8\)"):
        plan_buckets([TensorSpec("w", (2, 2), "float16", 7)], 64)


def test_negative_dimensions_are_refused():
    with pytest.raises(ValueError, match=r"tensor 'w': shape \(2, -1\) has a negative dimension"):
        plan_buckets([TensorSpec("w", (2, -1), "float32", -8)], 64)
    with pytest.raises(ValueError, match=r"tensor 'w': shape \(-3,\) has a negative dimension"):
        spec("w", (-3,), "float32")
