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
def test_every_byte_of_every_tensor_lands_exactly_once_in_order(specs, budget, align):
    plan = plan_buckets(specs, budget, align=align)
    entries = [e for b in plan for e in b.entries]
    # consecutive entries of one tensor are its pieces, in order, covering its bytes once
    runs: list[list] = []
    for e in entries:
        if runs and runs[-1][0].spec == e.spec and not runs[-1][-1].last:
            runs[-1].append(e)
        else:
            runs.append([e])
    assert [r[0].spec for r in runs] == specs
    for r in runs:
        assert r[0].offset == 0 and r[-1].last
        assert all(a.offset + a.nbytes == b.offset for a, b in zip(r, r[1:]))
        assert all(not e.last for e in r[:-1])
    assert [b.index for b in plan] == list(range(len(plan)))
    assert all(b.entries for b in plan)
    # each tensor is extracted once, in the bucket of its first bytes, and completed once
    assert [n for b in plan for n in b.extract_names] == [s.name for s in specs]
    assert sum(b.completed for b in plan) == len(specs)


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
            assert e.end - e.start == e.nbytes <= e.spec.nbytes
            assert e.whole == (e.nbytes == e.spec.nbytes)
            # a piece is a run of whole elements: it can be viewed as the dtype in place
            assert e.offset % ITEMSIZE[e.spec.dtype] == 0 and e.nbytes % ITEMSIZE[e.spec.dtype] == 0
            assert e.start >= prev_end
            prev_end = e.end
        assert b.nbytes == b.entries[-1].end
        assert b.payload_bytes == sum(e.nbytes for e in b.entries) <= b.nbytes


@settings(max_examples=150, deadline=None)
@given(specs=spec_lists, budget=budgets, align=aligns)
def test_no_bucket_exceeds_the_budget_unless_the_budget_is_below_one_aligned_element(specs, budget, align):
    for b in plan_buckets(specs, budget, align=align):
        if b.nbytes > budget:
            # only one aligned unit (a piece, or a tensor that small), alone, where the budget
            # is smaller than that unit
            assert len(b.entries) == 1, b
            (e,) = b.entries
            assert e.start == 0 and e.nbytes <= max(align, ITEMSIZE[e.spec.dtype]) > budget


@settings(max_examples=100, deadline=None)
@given(specs=spec_lists, budget=budgets, align=aligns)
def test_only_a_tensor_larger_than_the_budget_is_cut(specs, budget, align):
    for b in plan_buckets(specs, budget, align=align):
        for e in b.entries:
            assert e.whole or e.spec.nbytes > budget
            if not e.last:  # a piece that is not the tensor's last fills its bucket to an aligned unit
                unit = max(align, ITEMSIZE[e.spec.dtype])
                assert e is b.entries[-1] and (budget - b.nbytes < unit or b.nbytes > budget)


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


def test_an_oversized_tensor_between_small_ones_is_cut_into_pieces_that_fill_the_buckets():
    specs = [spec("a", (4,), "float32"), spec("big", (100,), "float32"), spec("b", (4,), "float32")]
    plan = plan_buckets(specs, 64)
    # 400 bytes of "big": 48 after "a", five buckets of 64, the last 32 beside "b"
    assert [[(e.spec.name, e.offset, e.nbytes) for e in b.entries] for b in plan] == [
        [("a", 0, 16), ("big", 0, 48)], *[[("big", o, 64)] for o in range(48, 368, 64)],
        [("big", 368, 32), ("b", 0, 16)]]
    assert [b.nbytes for b in plan] == [64] * 6 + [48]
    assert [b.extract_names for b in plan] == [["a", "big"]] + [[]] * 5 + [["b"]]
    assert [b.completed for b in plan] == [1, 0, 0, 0, 0, 0, 2]


def test_a_piece_is_described_on_the_wire_by_one_extra_field():
    from colo.transports.base import TensorMeta

    plan = plan_buckets([spec("big", (40,), "bfloat16")], 64)
    metas = [m for b in plan for m in TensorMeta.of_bucket(b)]
    assert [m.to_json() for m in metas] == [
        {"name": "big", "shape": [40], "dtype": "bfloat16", "start_idx": 0, "end_idx": 64, "numel": 64,
         "piece_offset": 0},
        {"name": "big", "shape": [40], "dtype": "bfloat16", "start_idx": 0, "end_idx": 16, "numel": 16,
         "piece_offset": 64}]
    assert [TensorMeta.from_json(m.to_json(), buffer_nbytes=64) for m in metas] == metas


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
