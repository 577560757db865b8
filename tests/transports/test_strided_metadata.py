"""Strided bucket entries on the wire (issue 44, build item 3): a whole tensor that lies strided
in the sender's buffer carries ``strides`` (and ``view_shape`` where that is not its shape); an
entry without them is row-major, exactly as before. Checked on parse: never a view outside the
buffer, and a clear error naming the tensor and what was expected."""

import pytest
import torch

from colo.core.buckets import Bucket, Entry, spec
from colo.core.errors import RequestError
from colo.transports.packed import PackedRequest
from colo.transports.wire import Strided, TensorMeta, parse_tensors, strided_span, views

GROUPS, PER, HD, HIDDEN = 2, 2, 3, 4
ROW = (PER + 2) * HD  # one query group's rows of a fused QKV: [q heads; k; v]


def fused_buffer():
    """A fused QKV weight (2 query groups, 2 q heads each) at byte 16 of a float32 buffer, and
    the q, k and v it holds, cut out independently of the code under test."""
    g = torch.Generator().manual_seed(0)
    fused = torch.randn(GROUPS * ROW, HIDDEN, generator=g)
    flat = torch.zeros(16 + fused.numel() * 4 + 32, dtype=torch.uint8)
    flat[16:16 + fused.numel() * 4].view(torch.float32).copy_(fused.reshape(-1))
    parts = {"q": [], "k": [], "v": []}
    for i in range(GROUPS):
        rows = fused[i * ROW:(i + 1) * ROW]
        parts["q"].append(rows[:PER * HD])
        parts["k"].append(rows[PER * HD:(PER + 1) * HD])
        parts["v"].append(rows[(PER + 1) * HD:])
    return flat, {x: torch.cat(p) for x, p in parts.items()}


def strided_json(x: str) -> dict:
    first, rows = {"q": (0, PER * HD), "k": (PER * HD, HD), "v": ((PER + 1) * HD, HD)}[x]
    start = 16 + first * HIDDEN * 4
    view = [GROUPS, rows, HIDDEN]
    strides = [ROW * HIDDEN, HIDDEN, 1]
    end = start + strided_span(view, strides) * 4
    return {"name": f"{x}_proj.weight", "shape": [GROUPS * rows, HIDDEN], "dtype": "float32",
            "start_idx": start, "end_idx": end, "numel": end - start, "view_shape": view, "strides": strides}


def test_strided_entries_view_the_tensors_exactly_and_contiguous_ones_parse_as_before():
    flat, want = fused_buffer()
    metas = [strided_json(x) for x in "qkv"]
    contiguous = {"name": "norm.weight", "shape": [4], "dtype": "float32", "start_idx": 0, "end_idx": 16,
                  "numel": 16}
    parsed = parse_tensors({"tensors": [contiguous, *metas]}, "tensors", "test", buffer_nbytes=flat.numel())
    assert parsed[0] == TensorMeta("norm.weight", (4,), "float32", 0, 16) and parsed[0].view is None
    assert parsed[0].to_json() == contiguous  # SGLang's six fields, nothing added
    assert [m.to_json() for m in parsed[1:]] == metas
    assert all(m.whole and m.view is not None for m in parsed[1:])
    got = dict(views(flat, parsed))
    for x in "qkv":
        assert torch.equal(got[f"{x}_proj.weight"], want[x]), x
    sources = dict(views(flat, parsed).sources())
    for x in "qkv":
        s = sources[f"{x}_proj.weight"]
        assert isinstance(s, Strided) and s.data.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        dest = torch.zeros_like(want[x])
        s.copy_into(dest)
        assert torch.equal(dest, want[x]), x
    assert torch.equal(sources["norm.weight"], flat[:16].view(torch.float32))
    # a view of the tensor's own shape needs strides alone (here a transposed 2-D tensor)
    t = {"name": "t", "shape": [HIDDEN, 3], "dtype": "float32", "start_idx": 16, "strides": [1, HIDDEN],
         "end_idx": 16 + strided_span([HIDDEN, 3], [1, HIDDEN]) * 4}
    (m,) = parse_tensors({"tensors": [t]}, "tensors", "test", buffer_nbytes=flat.numel())
    rows = flat[16:].view(torch.float32)[:3 * HIDDEN].view(3, HIDDEN)
    assert m.view == ((HIDDEN, 3), (1, HIDDEN)) and torch.equal(dict(views(flat, [m]))["t"], rows.t())
    assert "view_shape" not in m.to_json()


def test_a_bucket_entry_with_a_view_travels_as_one_and_counts_its_tensors_bytes():
    s = spec("q_proj.weight", (GROUPS * PER * HD, HIDDEN), "float32")
    e = Entry(s, 16, 16 + strided_span((GROUPS, PER * HD, HIDDEN), (ROW * HIDDEN, HIDDEN, 1)) * 4, 0,
              ((GROUPS, PER * HD, HIDDEN), (ROW * HIDDEN, HIDDEN, 1)))
    assert e.whole and e.first and e.last and e.nbytes == s.nbytes < e.end - e.start
    bucket = Bucket(0, (e,), 1024)
    assert bucket.payload_bytes == s.nbytes and bucket.completed == 1
    (m,) = TensorMeta.of_bucket(bucket)
    assert m.view == e.view and m.to_json() == strided_json("q")


@pytest.mark.parametrize("change, message", [
    (lambda m: m.update(end_idx=m["end_idx"] - 4, numel=m["numel"] - 4), r"expected end_idx \d+ \(got \d+\)"),
    (lambda m: m.update(strides=[10 ** 6, HIDDEN, 1]), r"reads bytes \[\d+, \d+\); expected end_idx .* inside the \d+ B buffer"),
    (lambda m: m.update(strides=[HIDDEN, 1]), r"2 strides \[4, 1\] for the 3 dimensions of view_shape"),
    (lambda m: m.update(view_shape=[GROUPS, 1, HIDDEN]), r"view_shape \[2, 1, 4\] holds 8 elements; expected the 24"),
    (lambda m: m.update(strides=[ROW * HIDDEN, -HIDDEN, 1]), r"strides must be a list of non-negative integers"),
    (lambda m: m.update(strides=[ROW * HIDDEN, True, 1]), r"strides must be a list of non-negative integers"),
    (lambda m: m.pop("strides"), r"view_shape without strides"),
    (lambda m: m.update(piece_offset=0), r"a strided entry is a whole tensor; it cannot be a piece"),
    (lambda m: m.update(start_idx=m["start_idx"] + 2, end_idx=m["end_idx"] + 2), r"not a multiple of float32's"),
])
def test_a_bad_strided_entry_is_refused_naming_the_tensor(change, message):
    flat, _ = fused_buffer()
    meta = strided_json("k")
    change(meta)
    with pytest.raises(RequestError, match=message) as err:
        PackedRequest.from_json({"handle": {"kind": "shm", "name": "x", "nbytes": flat.numel()}, "tensors": [meta]})
    assert "'k_proj.weight'" in str(err.value)


def test_no_strided_view_reaches_past_the_buffer():
    flat, _ = fused_buffer()
    meta = strided_json("v")
    short = meta["end_idx"] - 4
    with pytest.raises(RequestError, match=rf"inside the {short} B buffer"):
        parse_tensors({"tensors": [meta]}, "tensors", "test", buffer_nbytes=short)
    (m,) = parse_tensors({"tensors": [meta]}, "tensors", "test")
    with pytest.raises(RequestError, match=rf"'v_proj.weight': bytes \[\d+, {meta['end_idx']}\) do not fit"):
        views(flat[:short], [m])
    # built by hand with an end_idx short of its view: the view's own extent is checked
    lying = TensorMeta(m.name, m.shape, m.dtype, m.start, m.start + 4, 0, m.view)
    with pytest.raises(RequestError, match=rf"bytes \[\d+, {meta['end_idx']}\) do not fit"):
        views(flat[:short], [lying])


def test_sglangs_flattened_bucket_refuses_a_strided_entry_by_name():
    """SGLang reads ``[start_idx, end_idx)`` as a tensor's row-major bytes: a strided entry
    would be read wrong, so it is refused before a payload is made (only a one-copy bucket
    has them, and the SGLang transport plans its own buckets)."""
    from colo.engine.sglang.payload import bucket_metadata

    s = spec("q_proj.weight", (GROUPS * PER * HD, HIDDEN), "float32")
    view = ((GROUPS, PER * HD, HIDDEN), (ROW * HIDDEN, HIDDEN, 1))
    e = Entry(s, 16, 16 + strided_span(*view) * 4, 0, view)
    with pytest.raises(ValueError, match=r"no strided tensors: q_proj\.weight must be packed"):
        bucket_metadata(Bucket(0, (e,), 1024))
    whole = Entry(spec("norm.weight", (4,), "float32"), 0, 16)
    assert bucket_metadata(Bucket(0, (whole,), 16)) == [TensorMeta.of_bucket(Bucket(0, (whole,), 16))[0].to_json()]
