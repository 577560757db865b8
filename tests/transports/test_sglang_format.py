"""colo's bucket wire format against SGLang's own ``FlattenedTensorBucket``.

SGLang's ``srt/weight_sync/tensor_bucket.py`` is taken from its published
wheel (``tests/sglang_wheel.py``: downloaded once into the gitignored
``.cache/sglang/``), not from a copy kept here: the test checks colo against the
code SGLang ships. A failed download fails the tests; it never skips them.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from colo.core.buckets import plan_buckets, spec
from colo.core.interfaces import SyncContext
from colo.core.memory import StagingBudget
from colo.engine.reference.core import EngineCore
from colo.engine.reference.weights import expected_digest
from colo.proc.handles import ShmSegment
from colo.testing.engines import ReceiverOnCore
from colo.testing.trainers import StateTrainer
from colo.trainers.models import build_trainer_model, demo_config
from colo.transports.pack import pack_into
from colo.transports.packed import PackedReceiver, PackedTransport
from colo.transports.wire import PADDED, UNPADDED, RequestError, TensorMeta, relayout
from tests.sglang_wheel import load_file
from tests.leaks import new_segments

#: SGLang's tensor_bucket.py (its FlattenedTensorMetadata: name, shape: torch.Size, dtype:
#: torch.dtype, start_idx, end_idx, numel) imports only dataclasses, typing and torch
MEMBER = "sglang/srt/weight_sync/tensor_bucket.py"
ALLOWED_IMPORTS = {"dataclasses", "typing", "torch"}


@pytest.fixture(scope="session")
def sglang():
    """SGLang's tensor_bucket module, loaded from the file its wheel ships."""
    return load_file(MEMBER, ALLOWED_IMPORTS, "_sglang_tensor_bucket")


# -- the tensors --------------------------------------------------------------------

def named_tensors() -> list[tuple[str, torch.Tensor]]:
    """Mixed dtypes and shapes, a 0-d and 1-element tensors among them, ordered so that
    SGLang's back-to-back layout puts every tensor at a multiple of its itemsize."""
    g = torch.Generator().manual_seed(0)
    return [
        ("counts", torch.randint(-2**62, 2**62, (2, 3), generator=g, dtype=torch.int64)),
        ("step", torch.tensor([7], dtype=torch.int64)),
        ("w", torch.randn(4, 5, generator=g)),
        ("scale", torch.tensor(0.375)),  # 0-d
        ("bias", torch.randn(6, generator=g).to(torch.bfloat16)),
        ("emb", torch.randn(3, 7, generator=g).to(torch.bfloat16)),
        ("tail", torch.randn(1, generator=g).to(torch.bfloat16)),  # 1 element
    ]


def specs_of(named):
    return [spec(n, t.shape, str(t.dtype)) for n, t in named]


def one_bucket(named, align):
    (bucket,) = plan_buckets(specs_of(named), 1 << 20, align=align)
    return bucket


def colo_pack(named, align):
    """colo's sender side: plan, pack into a flat uint8 buffer, metadata as it travels (JSON)."""
    bucket = one_bucket(named, align)
    flat = torch.zeros(bucket.nbytes, dtype=torch.uint8)
    pack_into(flat, bucket, named)
    return flat, json.loads(json.dumps([m.to_json() for m in TensorMeta.of_bucket(bucket)]))


def field_names(sglang):
    return [f.name for f in dataclasses.fields(sglang.FlattenedTensorMetadata)]


def sglang_meta_from_json(sglang, entry: dict):
    """colo's JSON entry as SGLang's dataclass: the same fields, shape as torch.Size and
    dtype as the torch.dtype the name resolves to (SGLang's own getattr(torch, name))."""
    assert list(entry) == field_names(sglang)
    return sglang.FlattenedTensorMetadata(**{**entry, "shape": torch.Size(entry["shape"]),
                                             "dtype": getattr(torch, entry["dtype"])})


def json_from_sglang_meta(m) -> dict:
    return {"name": m.name, "shape": list(m.shape), "dtype": str(m.dtype).removeprefix("torch."),
            "start_idx": m.start_idx, "end_idx": m.end_idx, "numel": m.numel}


def assert_bit_exact(got, want):
    assert [n for n, _ in got] == [n for n, _ in want]
    for (name, a), (_, b) in zip(got, want):
        assert a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape), name
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), name


# -- SGLang reads colo ------------------------------------------------------------------

@pytest.mark.parametrize("align", [UNPADDED, PADDED], ids=["unpadded", "padded"])
def test_sglang_reconstructs_a_colo_packed_bucket_bit_exactly(sglang, align):
    named = named_tensors()
    flat, entries = colo_pack(named, align)
    bucket = sglang.FlattenedTensorBucket(flattened_tensor=flat,
                                          metadata=[sglang_meta_from_json(sglang, e) for e in entries])
    assert_bit_exact(bucket.reconstruct_tensors(), named)


def test_unpadded_metadata_is_field_for_field_what_sglang_writes(sglang):
    named = named_tensors()
    flat, entries = colo_pack(named, UNPADDED)
    ref = sglang.FlattenedTensorBucket(named_tensors=named)
    theirs = ref.get_metadata()
    assert [list(e) for e in entries] == [field_names(sglang)] * len(named)
    assert len(entries) == len(theirs)
    for ours, m in zip(entries, theirs):
        assert ours["name"] == m.name
        assert tuple(ours["shape"]) == tuple(m.shape) and isinstance(ours["shape"], list)
        assert getattr(torch, ours["dtype"]) == m.dtype and "torch." + ours["dtype"] == str(m.dtype)
        assert (ours["start_idx"], ours["end_idx"], ours["numel"]) == (m.start_idx, m.end_idx, m.numel)
        assert all(type(ours[k]) is int for k in ("start_idx", "end_idx", "numel"))
    # numel is bytes, not elements: the 0-d float32 holds 1 element in 4 bytes
    scale = next(e for e in entries if e["name"] == "scale")
    assert scale["shape"] == [] and scale["numel"] == 4 == scale["end_idx"] - scale["start_idx"]
    assert entries[-1]["end_idx"] == flat.numel() == ref.get_flattened_tensor().numel() == 196
    # ... and the buffers are byte for byte the same
    assert torch.equal(flat, ref.get_flattened_tensor())


def test_sglang_broadcast_receiver_recomputes_colos_unpadded_offsets(sglang):
    """SGLang's broadcast receive path sends no offsets: it lays the tensors out back
    to back from names, dtypes (colo's strings) and shapes, and must land on colo's."""
    _, entries = colo_pack(named_tensors(), UNPADDED)
    empty = sglang.FlattenedTensorBucket.empty([e["name"] for e in entries], [e["dtype"] for e in entries],
                                               [e["shape"] for e in entries], "cpu")
    assert [json_from_sglang_meta(m) for m in empty.get_metadata()] == entries
    # the padded layout is not what that path would compute
    _, padded = colo_pack(named_tensors(), PADDED)
    assert [e["start_idx"] for e in padded] != [e["start_idx"] for e in entries]


def test_where_sglang_cannot_pack_back_to_back_colo_pads_only_to_the_itemsize(sglang):
    # 6 bytes of bfloat16, then a float32: back to back it would start at byte 6
    named = [("h", torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16)), ("f", torch.tensor([0.1]))]
    with pytest.raises(ValueError, match="Unaligned received tensor f"):
        sglang.FlattenedTensorBucket.empty(["h", "f"], ["bfloat16", "float32"], [[3], [1]], "cpu")
    with pytest.raises(RuntimeError, match="storage_offset"):
        sglang.FlattenedTensorBucket(named_tensors=named).reconstruct_tensors()
    flat, entries = colo_pack(named, UNPADDED)
    assert [(e["start_idx"], e["end_idx"], e["numel"]) for e in entries] == [(0, 6, 6), (8, 12, 4)]
    bucket = sglang.FlattenedTensorBucket(flattened_tensor=flat,
                                          metadata=[sglang_meta_from_json(sglang, e) for e in entries])
    assert_bit_exact(bucket.reconstruct_tensors(), named)


# -- colo reads SGLang ------------------------------------------------------------------

def test_colos_packed_receiver_rebuilds_a_bucket_sglang_built(sglang, no_leftover_segments):
    named = named_tensors()
    ref = sglang.FlattenedTensorBucket(named_tensors=named)
    flat = ref.get_flattened_tensor()
    seg = ShmSegment.create(flat.numel())
    receiver = PackedReceiver()
    try:
        seg.tensor.copy_(flat)
        request = json.loads(json.dumps({"handle": seg.handle(),
                                         "tensors": [json_from_sglang_meta(m) for m in ref.get_metadata()]}))
        with receiver.receive(request) as got:
            assert_bit_exact([(n, t.clone()) for n, t in got], named)
    finally:
        receiver.close()
        seg.close()


def test_an_element_count_in_numel_is_refused_by_name(sglang):
    _, entries = colo_pack(named_tensors(), UNPADDED)
    w = next(e for e in entries if e["name"] == "w")
    assert w["numel"] == 80  # 20 float32 elements
    with pytest.raises(RequestError, match=r"bucket entry 'w': numel 20 is not the entry's byte count "
                                           r"end_idx - start_idx = 80"):
        TensorMeta.from_json({**w, "numel": 20})
    with pytest.raises(RequestError, match=r"bucket entry 'w': start_idx 54 is not a multiple of float32's 4"):
        TensorMeta.from_json({**w, "start_idx": 54, "end_idx": 134}, buffer_nbytes=196)


# -- the sender's unpadded mode --------------------------------------------------------

def test_relayout_keeps_the_tensors_and_never_grows_a_bucket():
    specs = specs_of(named_tensors())
    for padded in plan_buckets(specs, 128):
        laid = relayout(padded, align=UNPADDED)
        assert laid.index == padded.index and [e.spec for e in laid.entries] == [e.spec for e in padded.entries]
        assert laid.nbytes <= padded.nbytes and laid.payload_bytes == padded.payload_bytes
        assert laid.entries[0].start == 0
        assert all(a.end == b.start for a, b in zip(laid.entries, laid.entries[1:]))  # back to back
        assert relayout(laid, align=PADDED) == padded


@pytest.mark.parametrize("align", [UNPADDED, PADDED], ids=["unpadded", "padded"])
async def test_a_packed_sync_in_either_layout_loads_the_trainers_weights(sglang, align, no_leftover_segments):
    # hidden 36 in bfloat16: 72-byte norms, so the padded layout has gaps
    config = demo_config(vocab_size=96, hidden_size=36, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=40, max_position_embeddings=32)
    state = {n: p.detach() for n, p in build_trainer_model(config, seed=4).named_parameters()}
    core = EngineCore(config, dtype=torch.bfloat16, device="cpu", total_bytes=8 << 20, mem_fraction_static=0.5)
    engine = ReceiverOnCore(core, PackedReceiver(), "packed")  # the real receiver and EngineCore
    pool = StagingBudget(None)
    ctx = SyncContext(step=0, weight_version=1, bucket_bytes=4 << 10, source="host", staging=pool)
    transport = PackedTransport(align=align)
    try:
        result = await transport.sync(StateTrainer(state, dtype=torch.bfloat16), engine, ctx)
    finally:
        engine.receiver.close()
        await transport.aclose()
    assert core.digest() == expected_digest(state, config, torch.bfloat16)
    assert result.buckets == len(engine.requests) > 2 and result.tensors == len(state) and pool.held_bytes == 0
    entries = [e for r in engine.requests for e in r["tensors"]]
    # the 6912-byte embedding and lm_head exceed the 4 KiB bucket: they travel in pieces, the only
    # entries with a seventh field, piece_offset; the pieces of each cover it once, in order
    whole = [e for e in entries if "piece_offset" not in e]
    pieces = [e for e in entries if "piece_offset" in e]
    assert sorted({e["name"] for e in pieces}) == ["lm_head.weight", "model.embed_tokens.weight"]
    assert sorted([e["name"] for e in whole] + sorted({e["name"] for e in pieces})) == sorted(state)
    assert all(list(e) == field_names(sglang) for e in whole)
    assert all(e["numel"] == e["end_idx"] - e["start_idx"] == state[e["name"]].numel() * 2 for e in whole)
    for name in {e["name"] for e in pieces}:
        mine = [e for e in pieces if e["name"] == name]
        assert [e["piece_offset"] for e in mine] == [sum(p["numel"] for p in mine[:k]) for k in range(len(mine))]
        assert sum(e["numel"] for e in mine) == state[name].numel() * 2 and len(mine) >= 2
        assert all(e["shape"] == list(state[name].shape) for e in mine)
        # SGLang's metadata has no such field: it refuses a piece rather than read it as a whole tensor
        with pytest.raises(TypeError, match="piece_offset"):
            sglang.FlattenedTensorMetadata(**mine[0])
    assert max(r["tensors"][-1]["end_idx"] for r in engine.requests) <= 4 << 10  # no bucket beyond the budget
    gaps = [b["start_idx"] - a["end_idx"] for r in engine.requests for a, b in zip(r["tensors"], r["tensors"][1:])]
    if align == UNPADDED:
        assert set(gaps) == {0}
        # each request of whole tensors is exactly what SGLang's broadcast receiver would lay out
        for r in engine.requests:
            t = r["tensors"]
            if any("piece_offset" in e for e in t):
                continue
            empty = sglang.FlattenedTensorBucket.empty([e["name"] for e in t], [e["dtype"] for e in t],
                                                       [e["shape"] for e in t], "cpu")
            assert [json_from_sglang_meta(m) for m in empty.get_metadata()] == t
    else:
        assert max(gaps) > 0 and all(e["start_idx"] % 16 == 0 for e in entries)
    assert new_segments() == []


def test_the_packed_sender_refuses_an_alignment_that_is_not_a_power_of_two():
    with pytest.raises(ValueError, match="align must be a positive power of two, got 3"):
        PackedTransport(align=3)
