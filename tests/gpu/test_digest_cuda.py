"""The device checksum (colo.digest/2) on CUDA: the same lanes as the host's for the same bytes,
every flipped bit caught, pieces equal to the whole, and no copy to the host."""

import numpy as np
import pytest
import torch

import colo.digest as D
from colo.digest import ReceivedDigest, expected_weights_digest, weights_digest
from colo.transports.wire import Piece

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytestmark = [pytest.mark.gpu, gpu]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16, torch.uint8, torch.float64])
@pytest.mark.parametrize("numel", [1, 8191, 8193, 3_000_001])
def test_cuda_lanes_equal_the_hosts_for_the_same_bytes(dtype, numel):
    g = torch.Generator().manual_seed(numel)
    host = (torch.randn(numel, generator=g) * 1000).to(dtype)
    dev = host.cuda()
    for offset in (0, 12345, 2**31 + 3):
        want = D.lanes(host, offset, "host")
        assert [int(x) for x in D.lanes(dev, offset, "cuda")] == want, (dtype, numel, offset)
        assert [int(x) for x in D.lanes(dev, offset, "torch")] == want, (dtype, numel, offset)


def test_cuda_lanes_past_one_launch_equal_the_hosts():
    # more words than one launch covers (8192 * 65536), so partial sums of launches add up
    host = torch.randint(-2**15, 2**15, (8192 * 65536 + 77,), dtype=torch.int16).view(torch.bfloat16)
    assert [int(x) for x in D.lanes(host.cuda(), 0, "cuda")] == D.lanes(host, 0, "host")


def test_a_flipped_bit_on_the_device_on_either_side_is_a_mismatch():
    g = torch.Generator().manual_seed(7)
    state = {"a.weight": torch.randn(512, 256, generator=g), "a.bias": torch.randn(512, generator=g),
             "b.weight": torch.randn(1024, 512, generator=g)}
    order = list(state)
    dev = {n: t.cuda() for n, t in state.items()}
    want = expected_weights_digest(state, order, torch.bfloat16)  # on the host
    assert expected_weights_digest(dev, order, torch.bfloat16) == want  # on the device: the same
    for name in order:
        for index, bit in ((0, 0), (dev[name].numel() // 2, 9), (dev[name].numel() - 1, 15)):
            received = ReceivedDigest()
            for n in order:
                t = dev[n].to(torch.bfloat16)
                if n == name:  # the engine side: what arrived has one bit flipped
                    t.view(-1).view(torch.int16)[index] ^= (1 << bit) if bit < 15 else -0x8000
                received.add(n, t)
            assert received.digest(order) != want, (name, index, bit)
            trainer = dict(dev)
            trainer[name] = dev[name].clone()  # the trainer side: one fp32 bit that survives bf16
            trainer[name].view(-1).view(torch.int32)[index] ^= 1 << (16 + bit)
            assert expected_weights_digest(trainer, order, torch.bfloat16) != want, (name, index, bit)


def test_device_pieces_in_any_order_equal_the_whole_and_nothing_is_copied_to_the_host(monkeypatch):
    t = torch.randn(10_000_000, device="cuda").to(torch.bfloat16)
    whole = weights_digest([("x", t)])

    def no_host_copy(*a, **k):
        raise AssertionError("a device tensor was checksummed on the host")
    monkeypatch.setattr(D, "_host_lanes", no_host_copy)
    got = ReceivedDigest()
    for start, end in ((7_000_001, 10_000_000), (0, 3), (3, 7_000_001)):
        got.add("x", Piece(data=t[start:end], offset=start, shape=(10_000_000,)))
    assert got.digest(["x"]) == whole == weights_digest([("x", t)])


def test_many_device_tensors_in_one_launch_equal_the_hosts_lanes():
    g = torch.Generator().manual_seed(11)
    shapes = [(0,), (1,), (2047,), (2048 * 128 + 5,), (3, 1_000_003), (64, 64)]
    host = [(torch.randn(s, generator=g) * 100).to(dt) for s in shapes
            for dt in (torch.bfloat16, torch.float32, torch.uint8)]
    offsets = [(k * 7919) % 5 * (1 << 21) for k in range(len(host))]  # some cross a multiplier block
    got = D.lanes_many([(t.cuda(), o) for t, o in zip(host, offsets)])
    for t, o, lane in zip(host, offsets, got):
        assert [int(x) for x in (lane if isinstance(lane, list) else lane.tolist())] == D.lanes(t, o, "host"), \
            (t.dtype, tuple(t.shape), o)
    named = [(f"t{i}", t) for i, t in enumerate(host)]
    assert weights_digest([(n, t.cuda()) for n, t in named]) == weights_digest(named)
    # a batch of pieces and whole tensors, as an engine's load hands them over
    big, small = host[9], host[13]  # (2048 * 128 + 5,) bf16 and (3, 1_000_003) fp32
    dev = big.cuda()
    received = ReceivedDigest()
    received.add_many([("big", Piece(data=dev[100:], offset=100, shape=tuple(big.shape))), ("small", small.cuda()),
                       ("big", Piece(data=dev[:100], offset=0, shape=tuple(big.shape)))])
    assert received.digest(["big", "small"]) == weights_digest([("big", big), ("small", small)])


def test_an_engine_load_summed_as_it_writes_from_pinned_memory_equals_the_trainers():
    """colo's engine sums a verified sync's blocks as it writes them, on a stream of its own
    that waits for each group's copies (queued from pinned host memory, the offload-first
    path): sums that did not wait would read the last sync's bytes. Large tensors (a
    32000 x 2048 embedding, 131 MB in bf16) keep the copies running while the sums queue."""
    import colo.engine.reference.model as model_mod
    from colo.engine.reference.core import EngineCore
    from colo.engine.reference.weights import expected_digest
    from colo.trainers.models import build_trainer_model, demo_config

    config = demo_config(vocab_size=32000, hidden_size=2048, num_hidden_layers=2, num_attention_heads=16,
                         num_key_value_heads=4, intermediate_size=8192, max_position_embeddings=64)
    core = EngineCore(config, dtype=torch.bfloat16, device="cuda", total_bytes=4 << 30, mem_fraction_static=0.5,
                      init_state=None)
    fresh, made = [], []
    real = model_mod.weights_digest
    model_mod.weights_digest = lambda named: fresh.append(1) or real(named)
    real_blocks = model_mod.Blocks.__init__
    model_mod.Blocks.__init__ = lambda self, named: made.append(len(named)) or real_blocks(self, named)
    try:
        for seed in range(4):
            model = build_trainer_model(config, seed=seed)
            state = {k: v.detach().to(torch.bfloat16).pin_memory() for k, v in model.state_dict().items()}
            core.begin_load()
            core.load_weights(list(state.items()))
            core.end_load()
            assert core.digest() == expected_digest(state, config, torch.bfloat16), seed
            if seed == 1:
                groups = len(made)
    finally:
        model_mod.weights_digest = real
        model_mod.Blocks.__init__ = real_blocks
    assert len(fresh) == 1  # the first sync's digest only: the others were summed as they loaded
    # each group of blocks one launch from a table made on the first summed load, then reused
    assert groups > 1 and sum(made) == len(state) and len(made) == groups


def test_spans_of_one_device_buffer_are_one_launch_per_word_size_and_equal_the_hosts(monkeypatch):
    """An adapter stage's copy: hundreds of small tensors and a few large ones, mixed word
    sizes, at fixed offsets of one buffer; its lanes on the device equal the host's."""
    from colo.digest import Spans

    g = torch.Generator().manual_seed(3)
    named, entries, at = [], [], 0
    for i, (shape, dt) in enumerate([((8, 1536), torch.bfloat16), ((1536, 8), torch.bfloat16), ((0,), torch.float32),
                                     ((2048 * 128 + 5,), torch.bfloat16), ((33,), torch.uint8),
                                     ((3, 1_000_003), torch.float32)] * 40):
        t = (torch.randn(shape, generator=g) * 100).to(dt)
        at = -(-at // 4) * 4 + (1 if dt == torch.uint8 else 0)
        named.append((f"t{i}", t))
        entries.append((f"t{i}", str(dt).removeprefix("torch."), shape, at, t.numel() * t.element_size()))
        at += t.numel() * t.element_size()
    buf = torch.zeros(at, dtype=torch.uint8)
    for (_, t), e in zip(named, entries):
        buf[e[3]:e[3] + e[4]] = t.view(-1).view(torch.uint8)
    spans = Spans(entries)
    launches = []
    real = D._launch_batch
    monkeypatch.setattr(D, "_launch_batch", lambda *a: launches.append(a[1]) or real(*a))
    dev = spans.lanes(buf.cuda())
    assert len(launches) == 2  # one per word size (the uint8 tensors, the rest)
    assert dev.cpu().tolist() == spans.lanes(buf)
    received = ReceivedDigest()
    received.add_spans(buf.cuda(), spans)
    order = [n for n, _ in named][::-1]
    assert received.digest(order) == weights_digest([(n, dict(named)[n]) for n in order])


@pytest.mark.parametrize("odd", [False, True], ids=["16-byte", "4-byte"])
def test_copies_on_the_device_move_exact_bytes_and_give_the_hosts_lanes(odd):
    """The copying kernel (``colo.digest.Copies``) on CUDA: a model-like set of tensors (a few
    large, many small; bf16, fp32, fp16; one larger than several programs' span) copied in one
    launch into separate destinations, byte for byte, with the lanes the host computes of the
    sources; run again without lanes, the same bytes. Every pair 16-byte aligned and sized, the
    kernel's 16-byte variant; one tensor of 6,000,012 bytes, its 4-byte one for all."""
    g = torch.Generator().manual_seed(11)
    shapes = [((151936, 64), torch.bfloat16), ((1536,), torch.bfloat16), ((256, 1536), torch.bfloat16),
              ((8960, 16), torch.float32), ((3, 1_000_002 if odd else 1_000_000), torch.float16)] + \
        [((1536,), torch.bfloat16)] * 100
    host = [(torch.randn(s, generator=g) * 100).to(dt) for s, dt in shapes]
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in host]).cuda()
    srcs, at = [], 0
    for t in host:
        n = t.numel() * t.element_size()
        srcs.append(flat[at:at + n].view(t.dtype).view(t.shape))
        at += n
    dsts = [torch.full_like(s, 7) for s in srcs]
    copies = D.Copies(list(zip(dsts, srcs)))
    assert D._unit(copies.meta, copies.count) == (4 if odd else 16)
    lanes = copies.run(lanes=True)
    assert all(torch.equal(d.cpu().view(torch.uint8), h.view(torch.uint8)) for d, h in zip(dsts, host))
    assert lanes.cpu().tolist() == [D.lanes(h, 0, "host") for h in host]
    for d in dsts:
        d.fill_(0)
    assert copies.run() is None
    assert all(torch.equal(d.cpu().view(torch.uint8), h.view(torch.uint8)) for d, h in zip(dsts, host))


def test_planned_copies_from_buffers_mapped_anew_move_exact_bytes_and_give_the_hosts_lanes():
    """``PlannedCopies`` on CUDA: a table made and uploaded once, run from a new buffer each time
    holding other bytes at the same offsets: every destination ends as that buffer's bytes with
    the host's lanes of them; a buffer off 16 bytes goes through a table laid on it, the same."""
    g = torch.Generator().manual_seed(12)
    shapes = [((151936, 64), torch.bfloat16), ((256, 1536), torch.bfloat16), ((8960, 16), torch.float32)] + \
        [((1536,), torch.bfloat16)] * 50
    nbytes = [torch.Size(s).numel() * torch.empty((), dtype=dt).element_size() for s, dt in shapes]
    starts = [sum(nbytes[:i]) for i in range(len(nbytes))]
    dsts = [torch.empty(s, dtype=dt, device="cuda") for s, dt in shapes]
    planned = D.PlannedCopies(np.array(starts), np.array([d.data_ptr() for d in dsts]), np.array(nbytes),
                              torch.device("cuda", torch.cuda.current_device()))
    assert planned.unit == 16
    kept = None
    for shift in (0, 512, 4):
        host = [(torch.randn(s, generator=g) * 100).to(dt) for s, dt in shapes]
        buf = torch.zeros(sum(nbytes) + 1024, dtype=torch.uint8, device="cuda")
        flat = buf[shift:shift + sum(nbytes)]
        flat.copy_(torch.cat([h.reshape(-1).view(torch.uint8) for h in host]).cuda())
        for d in dsts:
            d.fill_(7)
        lanes = planned.run_from(flat, lanes=True)
        assert all(torch.equal(d.cpu().view(torch.uint8), h.view(torch.uint8)) for d, h in zip(dsts, host)), shift
        assert lanes.cpu().tolist() == [D.lanes(h, 0, "host") for h in host], shift
        if kept is None:
            kept = planned._uploaded
        assert planned._uploaded is kept  # made once
        for d in dsts:
            d.fill_(0)
        assert planned.run_from(flat) is None
        assert all(torch.equal(d.cpu().view(torch.uint8), h.view(torch.uint8)) for d, h in zip(dsts, host)), shift


def test_copies_of_strided_tensors_runs_on_the_device_give_the_whole_tensors_lanes():
    """A one-copy sync's q, k and v of a fused QKV (Qwen2-7B's shapes: 4 query groups of 7 q heads,
    head_dim 128, hidden 3584; weight and bias) lie strided in the trainer's buffer: copied as
    one run per group, each from its first word in the tensor, in one launch beside a whole
    tensor, the destinations are the tensors and the lanes each tensor's, as the host has them."""
    g = torch.Generator().manual_seed(12)
    groups, per, hd, hidden = 4, 7, 128, 3584
    row = (per + 2) * hd
    host_w = (torch.randn(groups * row, hidden, generator=g) * 100).to(torch.bfloat16)
    host_b = (torch.randn(groups * row, generator=g) * 100).to(torch.bfloat16)
    other = (torch.randn(3584, generator=g) * 100).to(torch.bfloat16).cuda()
    items, want = [], []
    for fused in (host_w.cuda(), host_b.cuda()):
        rest = fused.shape[1:]
        grouped = fused.view(groups, row, *rest)
        for first, rows in ((0, per * hd), (per * hd, hd), ((per + 1) * hd, hd)):
            items.append(grouped[:, first:first + rows])
            want.append(grouped[:, first:first + rows].cpu().contiguous())
    pairs, firsts, owners, dests = [(torch.zeros_like(other), other)], [0], [0], []
    for i, src in enumerate(items, 1):
        dest = torch.full(src.shape, 7, dtype=src.dtype, device=src.device)
        dests.append(dest)
        for k in range(groups):
            pairs.append((dest[k], src[k]))
            firsts.append((dest[k].data_ptr() - dest.data_ptr()) // 2)
            owners.append(i)
    copies = D.Copies(pairs, firsts=firsts, owners=owners)
    lanes = copies.run(lanes=True).cpu().tolist()
    assert torch.equal(pairs[0][0], other) and lanes[0] == D.lanes(other.cpu(), 0, "host")
    for i, (dest, w) in enumerate(zip(dests, want), 1):
        assert torch.equal(dest.cpu(), w), i
        assert lanes[i] == D.lanes(w, 0, "host"), i


def test_an_engine_load_of_device_tensors_is_one_launch_that_sums_it_and_catches_a_flipped_bit():
    """A sync-first load on CUDA (whole tensors of the engine's dtype on its GPU, from one
    buffer as a trainer's flat weights or a packed bucket lie): one copying launch per batch,
    no per-block sums after it, and the digest is the trainer's; a bit flipped in the source
    between two loads is in the next digest."""
    import colo.engine.reference.model as model_mod
    from colo.engine.reference.core import EngineCore
    from colo.engine.reference.weights import expected_digest
    from colo.trainers.models import build_trainer_model, demo_config

    config = demo_config(vocab_size=32000, hidden_size=2048, num_hidden_layers=2, num_attention_heads=16,
                         num_key_value_heads=4, intermediate_size=8192, max_position_embeddings=64)
    core = EngineCore(config, dtype=torch.bfloat16, device="cuda", total_bytes=4 << 30, mem_fraction_static=0.5,
                      init_state=None)
    launches, made = [], []
    real_launch, real_blocks = D._launch_copy, model_mod.Blocks.__init__
    D._launch_copy = lambda meta, n, *a: launches.append(n) or real_launch(meta, n, *a)
    model_mod.Blocks.__init__ = lambda self, named: made.append(len(named)) or real_blocks(self, named)
    try:
        state = {k: v.detach().to(torch.bfloat16) for k, v in build_trainer_model(config, seed=0).state_dict().items()}
        flat = torch.cat([t.reshape(-1) for t in state.values()]).cuda()
        views, at = [], 0
        for name, t in state.items():
            views.append((name, flat[at:at + t.numel()].view(t.shape)))
            at += t.numel()
        for rep in range(3):
            if rep == 2:
                flat.view(torch.int16)[12345] ^= 1 << 3
            core.begin_load()
            core.load_weights(views)
            core.end_load()
            want = expected_digest({n: v.cpu() for n, v in views}, config, torch.bfloat16)
            assert core.digest() == want, rep
    finally:
        D._launch_copy = real_launch
        model_mod.Blocks.__init__ = real_blocks
    assert launches == [len(views)] * 3 and made == []


def test_a_bucket_packed_in_one_launch_on_the_device_has_the_bytes_of_the_per_tensor_pack(monkeypatch):
    from colo.core.buckets import plan_buckets
    from colo.extractors.plain import PlainExtractor
    from colo.transports.pack import pack_batched, pack_into

    g = torch.Generator().manual_seed(2)
    state = {f"t{i}": (torch.randn(shape, generator=g) * 10).to(dt) for i, (shape, dt) in
             enumerate([((151936, 32), torch.bfloat16), ((1536,), torch.float32), ((256, 1536), torch.bfloat16)] * 20)}
    for bucket in plan_buckets(PlainExtractor(state).specs(), 16 << 20):
        named = [(e.spec.name, state[e.spec.name]) for e in bucket.entries]
        want = torch.zeros(bucket.nbytes, dtype=torch.uint8)
        pack_into(want, bucket, named)
        got = torch.zeros(bucket.nbytes, dtype=torch.uint8, device="cuda")
        if all(e.whole for e in bucket.entries):
            assert pack_batched(got, bucket, [(n, t.cuda()) for n, t in named])
            assert torch.equal(got.cpu(), want), bucket.index
            # every other tensor already written at its entry (an extractor given the slot's
            # views): the launch copies only the rest, around them
            into = torch.zeros(bucket.nbytes, dtype=torch.uint8, device="cuda")
            mixed = []
            for i, (e, (n, t)) in enumerate(zip(bucket.entries, named)):
                if i % 2:
                    view = into[e.start:e.end].view(t.dtype).view(t.shape)
                    view.copy_(t)
                    mixed.append((n, view))
                else:
                    mixed.append((n, t.cuda()))
            copied, real_into = [], D.Copies.into.__func__
            monkeypatch.setattr(D.Copies, "into", classmethod(
                lambda cls, buf, starts, sources: copied.append(len(sources)) or real_into(cls, buf, starts, sources)))
            assert pack_batched(into, bucket, mixed)
            monkeypatch.undo()
            assert torch.equal(into.cpu(), want), bucket.index
            assert copied == [(len(named) + 1) // 2], bucket.index  # the even-numbered ones


def test_meta_tables_queued_faster_than_the_gpu_reads_them_go_through_the_ring_intact():
    """The kernels' tables reach the GPU through one pinned ring (D._UploadRing): queued behind
    a long kernel, sixteen launches whose tables together pass the ring's size twice each copy
    exactly their own tensors (a slice overwritten before the GPU read it would send a launch
    to another table's addresses)."""
    k, launches = 12_000, 16  # a table of 8 * (4k + 2k) bytes = 576 KB per launch, within a quarter of the ring
    srcs = torch.arange(launches * k * 2, dtype=torch.int32, device="cuda").view(torch.bfloat16).view(launches, k, 4)
    dsts = torch.zeros_like(srcs)
    tables = [D.Copies(list(zip(dsts[i].unbind(0), srcs[i].unbind(0)))) for i in range(launches)]
    assert all(8 * len(t.meta) <= D._UploadRing.NBYTES // 4 for t in tables)
    assert sum(8 * len(t.meta) for t in tables) > 2 * D._UploadRing.NBYTES
    torch.cuda._sleep(200_000_000)  # keeps the stream (and the ring's events) busy while the host queues
    for t in tables:
        t.run()
    torch.cuda.synchronize()
    assert torch.equal(dsts.view(torch.int32), srcs.view(torch.int32))
