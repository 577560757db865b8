"""Issue 44: a bucket of whole tensors already on the staging buffer's GPU is packed in one
launch (``colo.transports.pack.pack_batched`` through ``colo.digest.Copies``), not a copy per
tensor. The kernel's stand-in reads its table on the host (the kernel on a GPU:
tests/gpu/test_digest_cuda.py), so the table the pack builds is checked here against the
per-tensor pack: the same bytes at the same offsets, the same refusals."""

import pytest
import torch

import colo.digest as D
from colo.core.buckets import plan_buckets
from colo.extractors.plain import PlainExtractor
from colo.transports.pack import pack_batched, pack_into
from tests.test_digest import _copy_on_the_host


@pytest.fixture
def kernel_on_the_host(monkeypatch):
    run = _copy_on_the_host(D._COPY_BLOCK * D._COPY_ITERS)
    launches = []
    monkeypatch.setattr(D, "_copy_kernel", lambda: run)
    monkeypatch.setattr(D, "_batchable", lambda t: True)
    monkeypatch.setattr(D, "_launch_copy", lambda meta, n, *a: launches.append(n) or run(meta, n, *a))
    return launches


def _state(seed):
    g = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(300, 16, generator=g).bfloat16(), "norm.weight": torch.randn(16, generator=g),
            "a.bias": torch.randn(6, generator=g).half(), "b.weight": torch.randn(40, 24, generator=g).bfloat16()}


def test_a_bucket_of_whole_device_tensors_is_one_launch_with_the_bytes_of_the_per_tensor_pack(kernel_on_the_host):
    state = _state(0)
    buckets = plan_buckets(PlainExtractor(state).specs(), 1 << 20)
    (bucket,) = buckets
    named = [(e.spec.name, state[e.spec.name]) for e in bucket.entries]
    want = torch.zeros(bucket.nbytes, dtype=torch.uint8)
    pack_into(want, bucket, named)
    got = torch.full((bucket.nbytes,), 0, dtype=torch.uint8)
    assert pack_batched(got, bucket, named)
    assert kernel_on_the_host == [len(named)]
    for e in bucket.entries:
        assert torch.equal(got[e.start:e.end], want[e.start:e.end]), e.spec.name


def test_what_one_launch_cannot_take_is_left_to_the_per_tensor_pack_and_bad_tensors_are_refused(kernel_on_the_host):
    state = _state(1)
    # a 3-element fp16 tensor: 6 bytes, not a whole number of the kernel's 4-byte words
    odd = {**state, "a.bias": state["a.bias"][:3].clone()}
    (bucket,) = plan_buckets(PlainExtractor(odd).specs(), 1 << 20)
    flat = torch.zeros(bucket.nbytes, dtype=torch.uint8)
    assert not pack_batched(flat, bucket, [(e.spec.name, odd[e.spec.name]) for e in bucket.entries])
    # a bucket cut into pieces (a tensor larger than the bucket)
    pieces = plan_buckets(PlainExtractor(state).specs(), 4096)
    assert any(not e.whole for b in pieces for e in b.entries)
    b = next(b for b in pieces if any(not e.whole for e in b.entries))
    assert not pack_batched(torch.zeros(b.nbytes, dtype=torch.uint8), b, [(e.spec.name, state[e.spec.name])
                                                                           for e in b.entries])
    assert kernel_on_the_host == [] and flat.count_nonzero() == 0
    # a tensor that no longer matches the plan is refused by name before a byte moves
    (bucket,) = plan_buckets(PlainExtractor(state).specs(), 1 << 20)
    bad = [(e.spec.name, state[e.spec.name]) for e in bucket.entries]
    bad[1] = (bad[1][0], torch.zeros(17))
    with pytest.raises(ValueError, match=bad[1][0]):
        pack_batched(torch.zeros(bucket.nbytes, dtype=torch.uint8), bucket, bad)
    assert kernel_on_the_host == []
