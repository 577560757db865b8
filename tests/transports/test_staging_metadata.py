"""Bucket metadata cached across syncs (issue 18): names, shapes, dtypes and offsets
do not change between steps, so after the first sync a request names its bucket's
layout by key, and the spec list goes as its key with the sync's begin, which
rides on its first load. A changed layout is
sent whole and replaces the cached one; a key the engine does not hold is refused,
naming both keys, and never read through an old layout; a shape the engine cannot
take is refused naming the tensor and both shapes, before a byte is written.
"""

from __future__ import annotations

import json

import pytest
import torch

from colo.core.buckets import plan_buckets, spec
from colo.core.interfaces import SyncContext
from colo.core.memory import StagingBudget
from colo.engine.reference.client import EngineError
from colo.engine.reference.weights import expected_digest
from colo.proc.handles import ShmSegment
from colo.testing.trainers import StateTrainer
from colo.trainers.models import build_trainer_model, demo_config
from colo.transports import make_transport
from colo.transports.pack import pack_into
from colo.transports.packed import PackedReceiver
from colo.transports.wire import LayoutNotCached, RequestError, TensorMeta, layout_key
from tests.conftest import SMALL_CFG
from tests.leaks import new_segments

pytestmark = pytest.mark.usefixtures("no_leftover_segments")

BUCKET = 16 << 10


class Recording:
    """The real client; every request it puts on the wire is kept as it went (JSON)."""

    def __init__(self, client, monkeypatch):
        self.client, self.sent = client, []
        real = client._ch.request

        async def request(op, *, on_sent=None, **fields):
            self.sent.append((op, json.loads(json.dumps(fields))))
            return await real(op, on_sent=on_sent, **fields)

        monkeypatch.setattr(client._ch, "request", request)

    def __getattr__(self, name):
        return getattr(self.client, name)

    def take(self):
        out, self.sent = self.sent, []
        return out


def state_of(config, seed):
    return {n: p.detach().clone() for n, p in build_trainer_model(config, seed=seed).named_parameters()}


async def sync(transport, engine, state, version, flush_cache=False):
    ctx = SyncContext(step=version, weight_version=version, bucket_bytes=BUCKET, source="host",
                      staging=StagingBudget(None), flush_cache=flush_cache)
    return await transport.sync(StateTrainer(state), engine, ctx), ctx


async def test_metadata_goes_once_per_engine_and_a_shape_change_is_refused_by_name(small_engine, monkeypatch):
    """One engine process for all of it (a spawn is the cost here): packed and broadcast
    send layouts by key after the first sync; an engine that lost them gets them again;
    a shape it cannot take is refused by name."""
    client, config = small_engine
    engine = Recording(client, monkeypatch)
    for name in ("packed", "broadcast"):
        await later_requests_name_their_layout_by_key(engine, client, config, name)
    await an_engine_that_lost_the_layouts_gets_them_again(engine, client, config)
    await an_engine_holding_another_spec_list_gets_the_list_before_it_begins(engine, client, config)
    await a_shape_the_engine_cannot_take_is_refused_naming_the_tensor_and_both_shapes(engine, client, config)


async def later_requests_name_their_layout_by_key(engine, client, config, name):
    engine.take()
    transport = make_transport(name)
    try:
        for version in (1, 2, 3):
            state = state_of(config, version)  # new weights every sync, the same layout
            flush = version != 2  # the scheduler asks the engine to flush its prefix cache
            result, ctx = await sync(transport, engine, state, version, flush_cache=flush)
            assert await client.digest() == expected_digest(state, config, torch.float32), version
            sent = engine.take()
            # one end a sync, after the last load: packed's rides on that load (with the
            # flush, where asked), broadcast's is a request of its own
            ends = [(i, f) for i, (op, f) in enumerate(sent) if op == "end_load" or f.get("end_load")]
            last_load = max(i for i, (op, _) in enumerate(sent) if op == "transport_load")
            assert len(ends) == 1 and ends[0][0] >= last_load
            assert (sent[ends[0][0]][0] == "transport_load") is (name == "packed")
            assert ends[0][1]["flush_cache"] is flush and result.cache_flushed is flush
            assert not any(op == "flush_cache" for op, _ in sent)
            loads = [f["request"] for op, f in sent if op == "transport_load"]
            preflights = [f for op, f in sent if op == "preflight"]
            # one begin a sync, before the first load: it rides on that load, unless another
            # request goes first (the first broadcast sync's transport_init builds the group)
            begins = [f for op, f in sent if op == "begin_load" or (op == "transport_load" and f.get("begin_load"))]
            first_load = next(i for i, (op, _) in enumerate(sent) if op == "transport_load")
            assert len(begins) == 1 and sent.index(next(x for x in sent if x[1] is begins[0])) <= first_load
            begin = begins[0]
            if version > 1:
                assert sent[first_load][1] is begin  # on the first load, no request of its own
            assert len(loads) == result.buckets > 2
            assert [r["layout"]["bucket"] for r in loads] == list(range(result.buckets))
            if version == 1:  # everything in full, once (the spec list: once per engine)
                assert all("tensors" in r for r in loads)
                keys = [r["layout"]["key"] for r in loads]
                assert keys == [layout_key(r["tensors"]) for r in loads]
            else:  # only the keys: the same as the first sync's
                assert not any("tensors" in r for r in loads)
                assert [r["layout"]["key"] for r in loads] == keys
            if version == 1 and name == "packed":  # the spec list in full, in its own request
                (preflight,) = preflights
                assert "specs" in preflight and begin["preflight_key"] is None
            else:  # a list the engine holds: its key rides on the begin, no request of its own
                specs = StateTrainer(state).extractor().specs()
                assert preflights == [] and begin["preflight_key"] == layout_key(
                    [[s.name, list(s.shape), s.dtype] for s in specs])
            # one handoff and one load per bucket, as in any sync
            assert sorted((r.bucket, r.stage) for r in ctx.stages if r.stage in ("handoff", "load")) == \
                sorted((b, s) for b in range(result.buckets) for s in ("handoff", "load"))
    finally:
        await transport.aclose()
    assert new_segments() == []


async def an_engine_that_lost_the_layouts_gets_them_again(engine, client, config):
    """The packed receiver was rebuilt (its cache gone): the engine refuses the key
    before reading a byte and the sender sends that bucket again, in full."""
    transport = make_transport("packed")
    try:
        await sync(transport, engine, state_of(config, 1), 1)
        await client.transport_close("packed")
        engine.take()
        state = state_of(config, 2)
        result, ctx = await sync(transport, engine, state, 2)
        assert await client.digest() == expected_digest(state, config, torch.float32)
        loads = [f["request"] for op, f in engine.take() if op == "transport_load"]
        # every bucket: refused by key, then sent in full
        assert [("tensors" in r, r["layout"]["bucket"]) for r in loads] == \
            [(full, b) for b in range(result.buckets) for full in (False, True)]
        assert [r.stage for r in ctx.stages].count("handoff") == result.buckets
    finally:
        await transport.aclose()


async def an_engine_holding_another_spec_list_gets_the_list_before_it_begins(engine, client, config):
    """The key riding on begin_load names a list the engine no longer holds (here another
    client's valid list replaced it): the engine refuses before it begins, and the
    client sends the list in full, then begins; the sync loads exactly."""
    transport = make_transport("packed")
    try:
        await sync(transport, engine, state_of(config, 1), 1)
        specs = list(StateTrainer(state_of(config, 1)).extractor().specs())
        other = [[s.name, list(s.shape), s.dtype] for s in reversed(specs)]
        await client.call("preflight", specs=other, key=layout_key(other))
        engine.take()
        state = state_of(config, 2)
        await sync(transport, engine, state, 2)
        assert await client.digest() == expected_digest(state, config, torch.float32)
        ops = [(op, sorted(f)) for op, f in engine.take()]
        # the first load carried the begin and the key and was refused before anything
        # began; the list went whole, then the begin, then that load again
        assert [op for op, _ in ops[:4]] == ["transport_load", "preflight", "begin_load", "transport_load"]
        assert "preflight_key" in ops[0][1] and ops[1][1] == ["key", "specs"] and ops[2][1] == []
        assert "begin_load" not in ops[3][1]
    finally:
        await transport.aclose()


async def a_shape_the_engine_cannot_take_is_refused_naming_the_tensor_and_both_shapes(engine, client, config):
    transport = make_transport("packed")
    try:
        state = state_of(config, 1)
        await sync(transport, engine, state, 1)
        before = await client.digest()
        grown = state_of(config, 2)
        grown["lm_head.weight"] = torch.zeros(config.vocab_size + 1, config.hidden_size)
        engine.take()
        with pytest.raises(EngineError, match=r"wrong shape \(1\): lm_head.weight \(129, 64\) "
                                              r"\(expected \(128, 64\)\)"):
            await sync(transport, engine, grown, 2)
        await transport.abort()
        # the changed spec list went in full (its key is new) and nothing was loaded
        sent = engine.take()
        assert [op for op, _ in sent][:1] == ["preflight"] and "specs" in sent[0][1]
        assert not any(op == "transport_load" for op, _ in sent)
        assert await client.digest() == before
    finally:
        await transport.aclose()


def test_a_changed_layout_replaces_the_cached_one_and_an_old_key_is_refused():
    receiver = PackedReceiver()
    seg = ShmSegment.create(1024)
    try:
        def request(specs, values, *, full=True, key=None):
            (bucket,) = plan_buckets(specs, 1024)
            pack_into(seg.tensor, bucket, list(zip([s.name for s in specs], values)))
            entries = [m.to_json() for m in TensorMeta.of_bucket(bucket)]
            ref = {"bucket": 0, "key": key or layout_key(entries)}
            out = {"handle": seg.handle(), "layout": ref}
            return json.loads(json.dumps({**out, "tensors": entries} if full else out)), ref["key"]

        a = torch.arange(6, dtype=torch.float32).reshape(2, 3)
        req_a, key_a = request([spec("x", (2, 3), "float32")], [a])
        with receiver.receive(req_a) as got:
            assert [(n, tuple(t.shape)) for n, t in got] == [("x", (2, 3))] and torch.equal(got[0][1], a)
        # the same layout by key: the cached metadata, this request's bytes
        req_a2, _ = request([spec("x", (2, 3), "float32")], [a * 2], full=False)
        with receiver.receive(req_a2) as got:
            assert torch.equal(got[0][1], a * 2)
        # the shapes changed: the sender sends the new layout whole, which replaces bucket 0's
        b = torch.arange(6, dtype=torch.float32).reshape(3, 2) - 1
        req_b, key_b = request([spec("x", (3, 2), "float32")], [b])
        assert key_b != key_a
        with receiver.receive(req_b) as got:
            assert tuple(got[0][1].shape) == (3, 2) and torch.equal(got[0][1], b)
        # the old key is no longer bucket 0's layout: refused, naming both, never read as (2, 3)
        with pytest.raises(LayoutNotCached, match=f"bucket 0's layout {key_a} is not cached on the engine "
                                                  f"\\(it holds {key_b} for that bucket\\)"):
            with receiver.receive(req_a2):
                pass
        # a key that is not the hash of the tensors it came with is refused too
        bad, _ = request([spec("x", (2, 3), "float32")], [a], key="0" * 32)
        with pytest.raises(RequestError, match="is not the hash of its tensors"):
            with receiver.receive(bad):
                pass
        # an unknown bucket
        unknown = {**req_a2, "layout": {"bucket": 7, "key": key_a}}
        with pytest.raises(LayoutNotCached, match="it holds none for that bucket"):
            with receiver.receive(unknown):
                pass
    finally:
        receiver.close()
        seg.close()
    assert new_segments() == []


def test_a_layout_cache_miss_is_logged_as_a_miss_and_other_errors_as_failed_requests(monkeypatch):
    # a miss is the cache's normal path (the sender sends the layout whole): the engine's
    # log must not report it as a failed request, and must still report real failures
    from colo.engine.reference import server

    seen: list[str] = []
    monkeypatch.setattr(server, "log", lambda event, **fields: seen.append(event))

    class Server(server.EngineServer):
        def __init__(self):  # only the request loop is under test
            pass

        def op_miss(self):
            raise LayoutNotCached("bucket 0's layout k is not cached on the engine")

        def op_bad(self):
            raise ValueError("bad argument")

    s = Server()
    miss, bad = s.handle({"id": 1, "op": "miss"}), s.handle({"id": 2, "op": "bad"})
    assert (miss["ok"], miss["error_type"], bad["ok"], bad["error_type"]) == \
        (False, "LayoutNotCached", False, "ValueError")
    assert seen == ["engine.layout_not_cached", "engine.request_failed"]


# -- the receiver's views: one as_strided per tensor, checked against the bytes -----------------

@pytest.mark.parametrize("lead, tail", [(0, 0), (16, 0), (0, 3), (16, 1)])
def test_views_are_exactly_the_bytes_each_entry_names(lead, tail):
    """``views`` rebuilds each tensor (whole or a piece) from the buffer: its values are the
    entry's bytes reinterpreted, and it aliases the buffer (no copy). The buffer may start
    inside its storage (``lead``: an IPC handle's offset); one whose length is not a
    multiple of a dtype's size (``tail``) cannot be viewed as that dtype whole and takes
    the per-tensor slicing path; both paths must give the same tensors."""
    from colo.transports.wire import Piece, TensorMeta, views

    metas = [TensorMeta("a", (3, 5), "bfloat16", 0, 30),
             TensorMeta("b", (7,), "float32", 32, 60),
             TensorMeta("c", (4, 4), "float32", 64, 96, offset=16),  # a piece: elements 4..11 of c
             TensorMeta("d", (2, 3), "int8", 96, 102),
             TensorMeta("e", (), "float32", 104, 108)]
    g = torch.Generator().manual_seed(3)
    backing = torch.randint(0, 256, (lead + 112 + tail,), dtype=torch.uint8, generator=g)
    flat = backing[lead:lead + 112 + tail]
    got = views(flat, metas)
    assert [n for n, _ in got] == ["a", "b", "c", "d", "e"]
    for (name, t), m in zip(got, metas):
        raw = flat[m.start:m.end].clone()
        if m.whole:
            want = raw.view(getattr(torch, m.dtype)).view(m.shape)
            assert tuple(t.shape) == m.shape and t.dtype == want.dtype and t.is_contiguous(), name
            assert torch.equal(t.view(torch.uint8).reshape(-1) if t.dim() else t.reshape(1).view(torch.uint8),
                               raw), name
        else:
            assert isinstance(t, Piece) and t.shape == m.shape and t.offset == 4 and t.end == 12
            assert torch.equal(t.data.view(torch.uint8), raw)
            t = t.data
        # a view of the buffer, not a copy: a write through it lands in the buffer
        before = flat[m.start].item()
        t.view(-1).view(torch.uint8)[0] = (before + 1) % 256
        assert flat[m.start].item() == (before + 1) % 256, name


def test_views_refuse_an_entry_past_the_end_of_the_buffer():
    from colo.transports.wire import RequestError, TensorMeta, views

    with pytest.raises(RequestError, match=r"'w'.*bytes \[16, 48\).*32 B buffer"):
        views(torch.zeros(32, dtype=torch.uint8), [TensorMeta("w", (8,), "float32", 16, 48)])


def test_the_sender_plans_again_only_when_the_specs_or_the_bucket_size_change():
    """The bucket plan is kept across syncs of the same model; a changed shape or dtype, a
    new tensor or another bucket size gives the plan those specs need, never the old one."""
    from colo.transports.base import BucketSender

    sender = BucketSender()
    specs = [spec(f"w{i}", (64, 64), "float32") for i in range(6)]
    first = sender._buckets(list(specs), BUCKET)
    assert sender._buckets([spec(s.name, s.shape, s.dtype) for s in specs], BUCKET) is first  # equal, not same
    for changed, size in ((specs[:5] + [spec("w5", (64, 65), "float32")], BUCKET),
                          (specs[:5] + [spec("w5", (64, 64), "bfloat16")], BUCKET),
                          (specs + [spec("w6", (8,), "float32")], BUCKET),
                          (specs, BUCKET // 2)):
        got = sender._buckets(list(changed), size)
        assert got == plan_buckets(changed, size) and got != first


def test_the_sender_describes_a_bucket_once_and_a_changed_one_in_full():
    """The layout memo keeps each bucket's entries and key while the sender hands it the
    same Bucket; a different Bucket at the same index (the plan changed) is described
    again, and its request carries the tensors even though the index was acknowledged."""
    from colo.transports.wire import LayoutMemo

    engine = object()
    memo = LayoutMemo()
    first = plan_buckets([spec("a", (4, 4), "float32"), spec("b", (8,), "float32")], 1 << 20)[0]
    fields, key = memo.fields(engine, first)
    assert "tensors" in fields and key == layout_key(fields["tensors"])
    memo.acked(0, key)
    again, key2 = memo.fields(engine, first)
    assert again == {"layout": {"bucket": 0, "key": key}} and key2 == key
    grown = plan_buckets([spec("a", (4, 5), "float32"), spec("b", (8,), "float32")], 1 << 20)[0]
    changed, key3 = memo.fields(engine, grown)
    assert key3 != key and changed["tensors"][0]["shape"] == [4, 5] and key3 == layout_key(changed["tensors"])


class ServerSide:
    """The engine server's ops in this process, each request and answer through JSON as on
    the wire: the engine's own handling of a load that carries the sync's end."""

    def __init__(self, server):
        self.server, self.sent = server, []

    def _do(self, op, **fields):
        msg = json.loads(json.dumps({"id": len(self.sent), "op": op, **fields}))
        self.sent.append(msg)
        reply = self.server.handle(msg)
        if not reply["ok"]:
            raise EngineError(op, reply["error_type"], reply["error"])
        return reply

    async def preflight(self, specs):
        self._do("preflight", specs=[[s.name, list(s.shape), s.dtype] for s in specs])

    async def begin_load(self):
        self._do("begin_load")

    async def transport_load(self, transport, request, on_sent=None, *, end=False, flush_cache=False):
        if on_sent is not None:
            on_sent()
        ends = {"end_load": True, "flush_cache": flush_cache} if end else {}
        return self._do("transport_load", transport=transport, request=request, **ends)

    async def end_load(self, flush_cache=False):
        self._do("end_load", flush_cache=flush_cache)

    async def drop_handles(self):
        self._do("drop_handles")


@pytest.mark.parametrize("flush", [True, False], ids=["flush", "no-flush"])
async def test_the_last_load_ends_the_load_and_flushes_the_prefix_cache_in_the_engine(flush):
    from colo.engine.reference.core import EngineCore
    from colo.engine.reference.server import EngineServer

    config = demo_config(**SMALL_CFG)
    core = EngineCore(config, dtype=torch.float32, device="cpu", total_bytes=64 << 20, mem_fraction_static=0.5)
    engine = ServerSide(EngineServer(core))
    transport = make_transport("packed")
    try:
        for version in (1, 2):
            state = state_of(config, version)
            held = core.model.slots.alloc(9)  # K/V of a prompt computed under the old weights
            result, ctx = await sync(transport, engine, state, version, flush_cache=flush)
            assert core.digest() == expected_digest(state, config, torch.float32)
            assert not core.model.loading  # ended: a second end is refused
            with pytest.raises(EngineError, match="end_load called without begin_load"):
                await engine.end_load()
            ops = [m["op"] for m in engine.sent]
            assert ops.count("end_load") == 1 and ops[-2] == "transport_load" and engine.sent[-2]["end_load"]
            assert result.cache_flushed is flush
            # flushed: every slot free again; not asked: the old assignment stands
            assert core.model.slots.free_slots == core.model.num_slots - (0 if flush else 9 * version)
            engine.sent.clear()
            del held
    finally:
        await transport.aclose()
