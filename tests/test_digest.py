"""colo.digest: the verification contract every engine meets."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from colo.digest import ReceivedDigest, expected_weights_digest, weights_digest
from colo.transports.wire import Piece


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(64, 32, generator=g), "a.bias": torch.randn(64, generator=g),
            "b.weight": torch.randn(16, 64, generator=g).to(torch.bfloat16)}


def test_one_flipped_bit_in_any_tensor_changes_the_digest():
    state = _state()
    want = weights_digest(state.items())
    for name, t in state.items():
        for index in (0, t.numel() // 2, t.numel() - 1):
            for bit in (0, 7):
                flipped = t.clone()
                raw = flipped.view(-1).view(torch.uint8)
                raw[index * t.element_size()] ^= 1 << bit
                assert weights_digest({**state, name: flipped}.items()) != want, (name, index, bit)


def test_order_names_shapes_and_dtypes_are_part_of_it():
    state = _state()
    want = weights_digest(state.items())
    assert weights_digest(reversed(list(state.items()))) != want
    assert weights_digest([("other", state["a.weight"]), *list(state.items())[1:]]) != want
    assert weights_digest([("a.weight", state["a.weight"].reshape(32, 64)), *list(state.items())[1:]]) != want
    # the same bytes read as another dtype
    assert weights_digest([("a.weight", state["a.weight"].view(torch.int32)), *list(state.items())[1:]]) != want


def test_pieces_hash_to_the_same_entry_and_missing_names_are_named():
    state = _state()
    order = list(state)
    got = ReceivedDigest()
    flat = state["a.weight"].reshape(-1)
    for start, end in ((0, 1000), (1000, 2047), (2047, flat.numel())):  # runs of elements, in order
        got.add("a.weight", Piece(data=flat[start:end], offset=start, shape=tuple(state["a.weight"].shape)))
    got.add("a.bias", state["a.bias"])
    with pytest.raises(ValueError, match="b.weight"):
        got.digest(order)
    got.add("b.weight", state["b.weight"])
    assert got.digest(order) == weights_digest(state.items())
    # the trainer's side converts each tensor to the engine's dtype on its own
    fp32 = {n: t.float() for n, t in state.items()}
    assert expected_weights_digest(fp32, order, torch.bfloat16) == weights_digest(
        (n, t.to(torch.bfloat16)) for n, t in fp32.items())
    with pytest.raises(KeyError, match="not.here"):
        expected_weights_digest(state, ["not.here"], torch.float32)


# -- the checksum itself (colo.digest/2) ---------------------------------------------

import colo.digest as D  # noqa: E402


def _reference_lanes(t: torch.Tensor, offset: int = 0) -> list[int]:
    """The definition, in Python integers: sum of w_j * (2j+1) * A mod 2**32 per lane."""
    words = D._words(t)
    bits = words.element_size() * 8
    first = offset * (t.element_size() // words.element_size())
    vals = [int(x) & ((1 << bits) - 1) for x in words.tolist()]
    return [sum(v * D.multiplier(lane, first + j) for j, v in enumerate(vals)) % 2**32 for lane in range(2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.int8,
                                   torch.int64, torch.float64, torch.bool])
def test_host_and_torch_paths_equal_the_definition_across_blocks_and_offsets(dtype, monkeypatch):
    g = torch.Generator().manual_seed(3)
    t = (torch.randn(29, 13, generator=g) * 300).to(dtype)
    for chunk in (D.TORCH_CHUNK, 7):  # one step of the torch path, and steps inside the tensor
        monkeypatch.setattr(D, "TORCH_CHUNK", chunk)
        # a multiplier block's edge inside the tensor, and word indices past 2**32
        for offset in (0, 5, (1 << D.BLOCK_BITS) - 100, 2**31 + 7, 2**33 + 1):
            want = _reference_lanes(t, offset)
            assert D.lanes(t, offset, "host") == want, (dtype, chunk, offset)
            assert [int(x) for x in D.lanes(t, offset, "torch")] == want, (dtype, chunk, offset)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8, torch.float64])
def test_every_bit_of_a_word_flipped_changes_both_lanes(dtype):
    t = (torch.randn(257) * 50).to(dtype)
    base = D.lanes(t)
    raw = t.view(torch.uint8)
    for index in (0, 128, 256):
        for byte in range(t.element_size()):
            for bit in range(8):
                flipped = raw.clone()
                flipped[index * t.element_size() + byte] ^= 1 << bit
                got = D.lanes(flipped.view(dtype))
                assert got[0] != base[0] and got[1] != base[1], (dtype, index, byte, bit)


def test_changes_to_many_words_change_the_lanes():
    # the cases a weighted sum mod 2**32 misses with structured multipliers or 32-bit words
    t = torch.randn(64, 32)
    base = D.lanes(t)
    assert D.lanes(t * 2) != base and D.lanes(-t) != base
    two_signs = t.clone()
    two_signs.view(-1)[[3, 10]] *= -1
    assert D.lanes(two_signs) != base


def test_a_flipped_bit_on_the_trainer_side_or_the_engine_side_is_a_mismatch():
    state = _state(1)
    order = list(state)
    trainer = expected_weights_digest(state, order, torch.bfloat16)
    engine = ReceivedDigest()
    for n in order:
        engine.add(n, state[n].to(torch.bfloat16))
    assert engine.digest(order) == trainer
    # the engine received one element with one bit flipped (the last bit of the middle element)
    bad = ReceivedDigest()
    for n in order:
        t = state[n].to(torch.bfloat16)
        if n == "a.bias":
            t = t.clone()
            t.view(torch.int16)[32] ^= 1
        bad.add(n, t)
    assert bad.digest(order) != trainer
    # the trainer's tensor has a flipped bit (the sign of one element)
    flipped = dict(state)
    flipped["b.weight"] = state["b.weight"].clone()
    flipped["b.weight"].view(-1).view(torch.int16)[100] ^= -0x8000
    assert expected_weights_digest(flipped, order, torch.bfloat16) != trainer


def test_pieces_in_any_order_sum_to_the_whole():
    t = torch.randn(1000).to(torch.bfloat16)
    got = ReceivedDigest()
    for start, end in ((700, 1000), (0, 333), (333, 700)):
        got.add("x", Piece(data=t[start:end], offset=start, shape=(1000,)))
    assert got.digest(["x"]) == weights_digest([("x", t)])


def test_a_batch_of_pieces_and_whole_tensors_records_what_one_by_one_does():
    t = torch.randn(1000).to(torch.bfloat16)
    w = torch.randn(7, 3)
    got = ReceivedDigest()
    got.add_many([("x", Piece(data=t[400:], offset=400, shape=(1000,))), ("w", w),
                  ("x", Piece(data=t[:400], offset=0, shape=(1000,)))])
    assert got.names == ["w", "x"]
    assert got.digest(["x", "w"]) == weights_digest([("x", t), ("w", w)])


def _packed(named):
    """``named`` laid one after another in one uint8 buffer at their dtype's alignment, with
    each tensor's ``(name, dtype, shape, start, nbytes)``."""
    entries, at = [], 0
    for name, t in named:
        size = t.element_size()
        at = -(-at // 8) * 8 + (3 if size == 1 else 0)  # an odd start for the 1-byte dtype
        entries.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), at, t.numel() * size))
        at += t.numel() * size
    buf = torch.zeros(at + 5, dtype=torch.uint8)
    for (_, t), (_, _, _, start, n) in zip(named, entries):
        buf[start:start + n] = t.contiguous().view(-1).view(torch.uint8)
    return buf, entries


def test_spans_of_one_buffer_digest_as_the_tensors_one_by_one():
    from colo.digest import Spans

    state = _state()
    named = [*state.items(), ("c.int8", torch.arange(-50, 49, dtype=torch.int8)), ("empty", torch.empty(0, 4)),
             ("d.weight", torch.randn(3, 5).to(torch.float16))]
    buf, entries = _packed(named)
    spans = Spans(entries)
    got = ReceivedDigest()
    got.add_spans(buf, spans)
    assert got.names == [n for n, _ in named]
    order = [n for n, _ in reversed(named)]  # the digest takes the spec list's order, not the buffer's
    assert got.digest(order) == weights_digest([(n, dict(named)[n]) for n in order])
    # beside whole tensors and pieces recorded one by one
    more = torch.randn(40)
    got.add_many([("more", Piece(data=more[:10], offset=0, shape=(40,))),
                   ("more", Piece(data=more[10:], offset=10, shape=(40,)))])
    assert got.digest(["more", *order]) == weights_digest([("more", more)] + [(n, dict(named)[n]) for n in order])
    # one flipped bit in the buffer: that tensor's entry changes
    buf[entries[1][3] + 1] ^= 0x10
    again = ReceivedDigest()
    again.add_spans(buf, spans)
    assert again.digest(order) != weights_digest([(n, dict(named)[n]) for n in order])
    # a name received twice, a buffer too short, a start off its word: refused
    with pytest.raises(ValueError, match="received twice: a.weight"):
        again.add_spans(buf, spans)
    with pytest.raises(ValueError, match="at least"):
        ReceivedDigest().add_spans(buf[:10], spans)
    with pytest.raises(ValueError, match="multiple of its word"):
        Spans([("x", "bfloat16", (2,), 1, 4)])


def _lanes_on_the_host(meta, n, programs, word_bytes, device):
    """A stand-in for the batched checksum kernel (colo.digest._launch_batch) that reads its
    table on the host: each tensor's words at its address, its programs covering them once
    (starting at 0, span, 2 span ...), its lanes the host's of those words."""
    import ctypes

    import numpy as np

    import colo.digest as D

    span = D._BATCH_BLOCK * D._BATCH_ITERS
    addrs, ns, firsts = meta[:n], meta[n:2 * n], meta[2 * n:3 * n]
    item, starts = meta[3 * n:3 * n + programs], meta[3 * n + programs:]
    assert len(starts) == programs
    out = []
    for i, (a, count, first) in enumerate(zip(addrs.tolist(), ns.tolist(), firsts.tolist())):
        assert sorted(starts[item == i].tolist()) == list(range(0, max(count, 1), span)), i
        words = (ctypes.c_uint8 if word_bytes == 1 else ctypes.c_uint16) * count
        out.append(D._host_lanes_np(np.ctypeslib.as_array(words.from_address(a)), first))
    return torch.tensor(out, dtype=torch.int64)


def test_many_tables_of_lanes_read_back_together_digest_as_the_tensors_one_by_one():
    """A load records its lanes a table at a time (a 7B model's in about 12 groups), tensors
    or rows; the digest reads every tensor table back in one copy and cuts it up again, so
    each name must still get its own table's row: tables of different lengths, a table of
    rows among them, names asked in an order that crosses the tables, and whole tensors."""
    import colo.digest as D

    g = torch.Generator().manual_seed(5)
    named = [(f"t{i}", torch.randn(3 + 5 * i, generator=g).to(torch.bfloat16 if i % 2 else torch.float32))
             for i in range(9)]
    received = ReceivedDigest()
    tables = [named[0:1], named[1:4], named[4:6], named[6:8]]
    for k, table in enumerate(tables):
        rows = [D.lanes(t, 0, "host") for _, t in table]
        # the third table as rows of ints (lanes summed on the host), the others as tensors
        received.add_lanes(D.Labels(table), rows if k == 2 else torch.tensor(rows, dtype=torch.int64))
    received.add(*named[8])  # a whole tensor, recorded on its own
    order = ["t5", "t8", "t0", "t3", "t7", "t1", "t4", "t6", "t2"]
    by_name = dict(named)
    assert received.digest(order) == weights_digest([(n, by_name[n]) for n in order])
    # a flipped bit in one table's row is that digest's change alone, not its neighbours'
    swapped = ReceivedDigest()
    for k, table in enumerate(tables):
        rows = torch.tensor([D.lanes(t, 0, "host") for _, t in table], dtype=torch.int64)
        if k == 1:
            rows[2, 0] ^= 1
        swapped.add_lanes(D.Labels(table), rows)
    swapped.add(*named[8])
    assert swapped.digest(["t0", "t1", "t2", "t4", "t6"]) == received.digest(["t0", "t1", "t2", "t4", "t6"])
    assert swapped.digest(["t3"]) != received.digest(["t3"])


def test_the_batched_kernels_tables_read_every_tensor_where_it_lies(monkeypatch):
    """The tables the CUDA kernel is given (each tensor's address, words and first word; each
    program's tensor and start), checked on the host: a stand-in for the kernel reads exactly
    those words at those addresses. Its lanes must be the host's of the same tensors: whole,
    pieces (a first word past 0), not contiguous (copied first), every word size, and spans of
    one buffer. (The kernel itself against the host: tests/gpu/test_digest_cuda.py.)"""
    import colo.digest as D

    span = D._BATCH_BLOCK * D._BATCH_ITERS
    kernel_on_the_host = _lanes_on_the_host
    monkeypatch.setattr(D, "_batch_kernel", lambda: kernel_on_the_host)
    monkeypatch.setattr(D, "_batchable", lambda t: True)
    monkeypatch.setattr(D, "_launch_batch", kernel_on_the_host)
    g = torch.Generator().manual_seed(4)
    big = torch.randn(span + 77, generator=g).to(torch.bfloat16)  # two programs
    items = [(big, 0), (torch.randn(5, 3, generator=g), 0), (torch.randn(6, 4, generator=g).t(), 0),
             (torch.arange(-9, 30, dtype=torch.int8), 0), (big[100:300], 100), (torch.randn(7, generator=g).double(), 3),
             (torch.empty(0), 0), (torch.randint(0, 255, (64,), dtype=torch.uint8, generator=g)[1:], 11)]
    got = D._read(D.lanes_many(items))
    assert got == [D.lanes(t, o, "host") for t, o in items]
    assert any(isinstance(p, D.LaneRow) for p in D.lanes_many(items))
    named = [(f"t{i}", t) for i, (t, _) in enumerate(items)]
    monkeypatch.undo()
    want = weights_digest(named)
    monkeypatch.setattr(D, "_batch_kernel", lambda: kernel_on_the_host)
    monkeypatch.setattr(D, "_batchable", lambda t: True)
    monkeypatch.setattr(D, "_launch_batch", kernel_on_the_host)
    assert weights_digest(named) == want
    buf, entries = _packed(named)
    spans = D.Spans(entries)
    assert spans.lanes(buf).tolist() == [D.lanes(t, 0, "host") for _, t in named]


def test_blocks_where_they_lie_digest_as_the_tensors_one_by_one_through_the_kernels_table(monkeypatch):
    """``Blocks``: whole tensors at their own addresses (an engine's row blocks), the kernel's
    table made once. Through the table (its stand-in reads the words at the table's addresses
    on the host) and without it, the digest is the tensors' one by one, every word size and an
    empty tensor among them; the table reads the bytes as they are when launched, not as they
    were when it was made; a name twice or a strided tensor is refused."""
    import colo.digest as D

    kernel_on_the_host = _lanes_on_the_host
    g = torch.Generator().manual_seed(9)
    span = D._BATCH_BLOCK * D._BATCH_ITERS
    base = torch.randn(3, span // 2 + 11, generator=g).to(torch.bfloat16)  # row blocks of one parameter
    named = [("q", base[0:1]), ("kv", base[1:3]), ("n", torch.randn(7, generator=g)),
             ("e", torch.empty(0)), ("b", torch.randint(0, 255, (33,), dtype=torch.uint8, generator=g))]
    want = weights_digest(named)
    plain = D.Blocks(named)
    got = ReceivedDigest()
    got.add_blocks(plain)
    assert got.digest([n for n, _ in named]) == want
    monkeypatch.setattr(D, "_batch_kernel", lambda: kernel_on_the_host)
    monkeypatch.setattr(D, "_batchable", lambda t: True)
    monkeypatch.setattr(D, "_launch_batch", kernel_on_the_host)
    blocks = D.Blocks(named)
    assert [len(t[1]) for t in blocks.tables] == [1, 3]  # uint8 alone, then the 2-byte words (e left out)
    assert blocks.lanes().tolist() == [D.lanes(t, 0, "host") for _, t in named]
    base[1, 5] = 7.0  # the same addresses, new bytes: summed anew
    got = ReceivedDigest()
    got.add_blocks(blocks)
    assert got.digest([n for n, _ in named]) == weights_digest(named) != want
    one = D.Blocks(named[:2])  # one word size: the kernel's rows are the lanes as they are
    assert one.lanes().tolist() == [D.lanes(t, 0, "host") for _, t in named[:2]]
    with pytest.raises(ValueError, match="twice"):
        D.Blocks([("q", base[0]), ("q", base[1])])
    with pytest.raises(ValueError, match="contiguous"):
        D.Blocks([("t", base.t())])
    with pytest.raises(ValueError, match="received twice"):
        got.add_blocks(one)


def _copy_on_the_host(span):
    """A stand-in for the copying kernel (colo.digest._launch_copy) that reads its table on the
    host: each tensor's 4-byte words moved from its source address to its destination, its
    programs covering them once, its lanes those of the 16-bit words it moved."""
    import ctypes

    import numpy as np

    import colo.digest as D

    def run(table, n, programs, lanes, device, sbase, dbase, unit):
        # the kernel's table (colo.digest._relative_table): offsets from the two bases in units,
        # sizes in units, starts in blocks; a plan's is a tensor kept on its device
        meta = table.cpu().numpy() if isinstance(table, torch.Tensor) else table
        assert unit in (4, 16) and sbase.data_ptr() % unit == 0 == dbase.data_ptr() % unit
        srcs = (sbase.data_ptr() + meta[:n] * unit).tolist()
        dsts = (dbase.data_ptr() + meta[n:2 * n] * unit).tolist()
        words, firsts = (meta[2 * n:3 * n] * unit // 4).tolist(), meta[3 * n:4 * n].tolist()
        item, starts = meta[4 * n:4 * n + programs], meta[4 * n + programs:] * D._COPY_BLOCK
        assert len(starts) == programs
        run.units.append(unit)
        out = []
        for i, (s, d, w, f) in enumerate(zip(srcs, dsts, words, firsts)):
            assert sorted(starts[item == i].tolist()) == list(range(0, max(w, 1), span)), i
            ctypes.memmove(d, s, 4 * w)
            out.append(D._host_lanes_np(np.ctypeslib.as_array((ctypes.c_uint16 * (2 * w)).from_address(d)), f))
        return torch.tensor(out, dtype=torch.int64) if lanes else None

    run.units = []  # each launch's unit, in order
    return run


def test_copies_move_every_tensor_through_one_table_and_give_the_lanes_of_what_they_moved(monkeypatch):
    """``Copies``: whole tensors into destinations of the same bytes, one launch from a table of
    their addresses, the lanes of each tensor's bytes computed as they pass. The kernel's
    stand-in reads the table on the host (the kernel itself against this: tests/gpu): every
    destination ends as its source byte for byte, the lanes equal the host's of the source, a
    tensor larger than one program's span is covered by several; what the kernel cannot take
    (a dtype change, an odd size, 1-byte elements, a strided view, an address off 4 bytes)
    does not fit."""
    import colo.digest as D

    assert not D.Copies.fits([(torch.zeros(4), torch.ones(4))])  # no kernel here (or not on a GPU)
    span = D._COPY_BLOCK * D._COPY_ITERS
    run = _copy_on_the_host(span)
    monkeypatch.setattr(D, "_copy_kernel", lambda: run)
    monkeypatch.setattr(D, "_batchable", lambda t: True)
    monkeypatch.setattr(D, "_launch_copy", run)
    g = torch.Generator().manual_seed(5)
    srcs = [torch.randn(2 * span + 3, 2, generator=g).to(torch.bfloat16), torch.randn(7, 6, generator=g),
            torch.randn(10, generator=g).half()]
    dsts = [torch.zeros_like(t) for t in srcs]
    pairs = list(zip(dsts, srcs))
    assert D.Copies.fits(pairs)
    copies = D.Copies(pairs)
    assert copies.programs == 3 + 1 + 1
    got = copies.run(lanes=True)
    assert all(torch.equal(d.view(torch.uint8), s.view(torch.uint8)) for d, s in pairs)
    assert got.tolist() == [D.lanes(s, 0, "host") for s in srcs]
    for d in dsts:
        d.zero_()
    assert copies.run() is None and all(torch.equal(d, s) for d, s in pairs)
    received = ReceivedDigest()
    received.add_lanes(D.Labels([(f"t{i}", d) for i, d in enumerate(dsts)]), got)
    assert received.digest(["t2", "t0", "t1"]) == weights_digest([("t2", srcs[2]), ("t0", srcs[0]), ("t1", srcs[1])])
    a, b = torch.randn(6, generator=g), torch.randn(12, generator=g)
    for bad in ([(a.half(), a)], [(torch.zeros(3, dtype=torch.bfloat16), a[:3].bfloat16())],
                [(torch.zeros(4, dtype=torch.uint8), torch.ones(4, dtype=torch.uint8))],
                [(torch.zeros(6), b[::2])], [(torch.zeros(6), a), (torch.zeros(9, dtype=torch.bfloat16)[1:5], a[:4].bfloat16())]):
        assert not D.Copies.fits(bad), bad
    with pytest.raises(ValueError, match="same bytes"):
        D.Copies([(a.half(), a)])


def test_the_copying_kernels_table_names_the_same_bytes_in_units_from_its_bases():
    """``_relative_table``: the kernel's table holds each pair's addresses as offsets from the
    launch's two bases (below or above them) in units of 16 bytes where every address, size and
    base allows it (``_unit``) and of 4 otherwise, its size in units and each program's start in
    blocks, the checksum words and items as they were."""
    import colo.digest as D

    span = D._COPY_BLOCK * D._COPY_ITERS
    g = torch.Generator().manual_seed(6)
    srcs = [torch.randn(2 * span + 8, generator=g), torch.randn(8, 6, generator=g).bfloat16(),
            torch.randn(4, generator=g)]
    dsts = [torch.zeros_like(t) for t in srcs]
    nbytes = [t.numel() * t.element_size() for t in srcs]
    sources, dests = [t.data_ptr() for t in srcs], [t.data_ptr() for t in dsts]
    copies = D.Copies.at(np.array(sources), np.array(dests), np.array(nbytes), torch.device("cpu"),
                         firsts=[0, 5, 9], owners=[0, 1, 2])
    n, p = copies.count, copies.programs
    assert (n, p) == (3, 3 + 1 + 1)
    sbase, dbase = (sorted(sources + dests)[2] // 16) * 16, (max(dests) // 16 + 3) * 16  # pairs below and above
    assert D._unit(copies.meta, n, sbase, dbase) == 16
    for unit in (16, 4):
        table = D._relative_table(copies.meta, n, p, sbase, dbase, unit)
        assert (table[:n] * unit + sbase).tolist() == sources and (table[n:2 * n] * unit + dbase).tolist() == dests
        assert (table[2 * n:3 * n] * unit).tolist() == nbytes
        assert table[3 * n:4 * n + p].tolist() == copies.meta[3 * n:4 * n + p].tolist() == [0, 5, 9, 0, 0, 0, 1, 2]
        assert (table[4 * n + p:] * D._COPY_BLOCK).tolist() == copies.meta[4 * n + p:].tolist() == \
            [0, span, 2 * span, 0, 0]
    # a base, a source, a destination off 16 bytes, or a size of 3 words: 4-byte units
    assert D._unit(copies.meta, n, sbase + 4, dbase) == D._unit(copies.meta, n, sbase, dbase + 8) == 4
    for i, bad in ((0, 4), (n, 8), (2 * n, -1)):
        meta = copies.meta.copy()
        meta[i] += bad
        assert D._unit(meta, n, sbase, dbase) == 4, i


def test_copies_of_a_tensors_runs_give_that_tensors_lanes(monkeypatch):
    """A tensor lying strided in the source (q of a fused QKV: one run per query group) goes as
    its contiguous runs, each into its place in the destination (``owners``: whose run it is;
    ``firsts``: the run's first checksum word in that tensor): the destination ends as the
    tensor, and the lanes are the whole tensor's, the runs' summed, beside a whole tensor's."""
    import colo.digest as D

    span = D._COPY_BLOCK * D._COPY_ITERS
    run = _copy_on_the_host(span)
    monkeypatch.setattr(D, "_copy_kernel", lambda: run)
    monkeypatch.setattr(D, "_batchable", lambda t: True)
    monkeypatch.setattr(D, "_launch_copy", run)
    g = torch.Generator().manual_seed(6)
    fused = torch.randn(3, 2 * span + 5, 2, generator=g).to(torch.bfloat16)  # 3 groups: [q rows; other rows]
    q = fused[:, :span + 1]  # strided: one run per group, the other rows between
    other = torch.randn(9, 4, generator=g)
    want_q = q.contiguous()
    dest_q, dest_other = torch.zeros_like(want_q), torch.zeros_like(other)
    pairs = [(dest_other, other)] + [(dest_q[i], q[i]) for i in range(3)]
    firsts = [0] + [(dest_q[i].data_ptr() - dest_q.data_ptr()) // 2 for i in range(3)]
    copies = D.Copies(pairs, firsts=firsts, owners=[0, 1, 1, 1])
    got = copies.run(lanes=True)
    assert torch.equal(dest_q, want_q) and torch.equal(dest_other, other)
    assert got.tolist() == [D.lanes(other, 0, "host"), D.lanes(want_q, 0, "host")]
    with pytest.raises(ValueError, match="4 pairs, 3 owners"):
        D.Copies(pairs, firsts=firsts, owners=[0, 1, 1])


class _Event:
    """A stand-in for a CUDA event: done when the test says; what waited on it, in order."""

    def __init__(self, log: list):
        self.log, self.done = log, False

    def record(self, stream=None) -> None:
        assert stream is None  # (a CUDA stream on a GPU: the ring's device's current one)

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.log.append(self)
        self.done = True


def test_the_upload_ring_writes_a_slice_again_only_after_the_upload_that_read_it_passed():
    """The kernels' meta tables go to the GPU through one pinned buffer used as a ring
    (D._UploadRing): here a 1 KiB host buffer and stand-in events. Each table lands in its
    own 64-byte-aligned slice with its values; a slice is overwritten only after the event
    recorded behind the upload that read it: a passed one is dropped unasked, a pending one
    the new slice overlaps is waited for (oldest first), others are left pending."""
    waited, events = [], []

    def new_event():
        events.append(_Event(waited))
        return events[-1]

    ring = D._UploadRing(torch.device("cpu"), buffer=torch.zeros(960, dtype=torch.uint8), new_event=new_event)
    tables = [np.arange(k * 100, k * 100 + 30, dtype=np.int64) for k in range(7)]  # 240 bytes: slices of 256
    got = [ring.upload(t) for t in tables[:3]]
    assert [[int(v) for v in g] for g in got] == [t.tolist() for t in tables[:3]]
    assert [(a, b) for a, b, _ in ring.pending] == [(0, 256), (256, 512), (512, 768)] and waited == []
    events[1].done = True  # the second upload passed; the first has not
    ring.upload(tables[3])  # no room at the end: wraps to [0, 256), waits for the first upload
    assert waited == [events[0]] and ring.buf[:240].view(torch.int64).tolist() == tables[3].tolist()
    ring.upload(tables[4])  # [256, 512): the passed second one dropped unasked, nothing waited for
    assert waited == [events[0]] and [(a, b) for a, b, _ in ring.pending] == [(512, 768), (0, 256), (256, 512)]
    ring.upload(tables[5])  # [512, 768): the third, still pending, waited for
    assert waited == [events[0], events[2]]
    assert [ring.buf[a:a + 240].view(torch.int64).tolist() for a in (0, 256, 512)] == [t.tolist() for t in tables[3:6]]
    big = np.arange(31, dtype=np.int64)  # 248 bytes, over a quarter of the ring: pinned on its own
    with pytest.raises(RuntimeError):  # (which needs CUDA: the ring's slices are not used for it)
        ring.upload(big)
    assert ring.head == 768 and len(ring.pending) == 3 and len(events) == 6
