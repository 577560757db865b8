"""The engine process and its channel: authenticated, never unpickling, really shared memory."""

import os
import pickle
import socket
import struct

import pytest
import torch

from colo.core.buckets import plan_buckets
from colo.proc.channel import ChannelError, answer, recv_frame, send_frame
from colo.engine.reference.client import EngineError
from colo.engine.reference.weights import expected_digest
from colo.proc.handles import HandleError, ShmSegment, open_handle
from colo.trainers.models import build_trainer_model
from colo.transports.base import TensorMeta
from colo.transports.pack import pack_into
from colo.transports.packed import PackedRequest
from tests.leaks import new_segments

@pytest.fixture
def engine(small_engine):
    return small_engine


def raw_connect(path, key):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(20)
    s.connect(path)
    challenge = s.recv(32)
    s.sendall(answer(key, challenge) if key else os.urandom(32))
    return s


async def test_a_peer_without_the_key_is_refused_and_the_engine_keeps_serving(engine):
    client, _ = engine
    # The client is connected; the engine serves one connection at a time, so
    # close ours first and prove a keyless peer gets nothing.
    await client._ch.aclose()
    s = raw_connect(client.socket_path, None)
    assert s.recv(2) == b""  # refused: the engine closed without an "OK"
    s.close()
    await client.reconnect()  # with the key, the same engine answers
    assert "tag_bytes" in await client.call("hello")


async def test_pickle_payload_is_rejected_logged_and_serving_continues(engine, tmp_path):
    client, _ = engine
    evil = pickle.dumps(os.system)  # a classic: a pickle that would call os.system when loaded
    sock_stream = client._ch._stream
    await sock_stream.send(struct.pack(">I", len(evil)) + evil)
    reply = await client._ch._recv()
    assert reply["ok"] is False and reply["error_type"] == "ChannelError"
    assert "not UTF-8 JSON" in reply["error"]
    # and the engine still answers real requests
    assert (await client.call("hello"))["weight_version"] is None
    log = (tmp_path / "engine.log").read_text()
    assert '"event": "channel.rejected_frame"' in log and "not UTF-8 JSON" in log


async def test_unknown_ops_and_disallowed_handles_are_errors(engine):
    client, _ = engine
    with pytest.raises(EngineError, match="unknown op '__class__'"):
        await client.call("__class__")
    await client.call("begin_load")
    with pytest.raises(EngineError, match="handle kind 'pickle' is not allowed"):
        await client.transport_load("packed", {"handle": {"kind": "pickle", "data": "x"}, "tensors": []})


async def test_the_engines_profile_verbs_record_what_it_did_and_refuse_out_of_order(engine, tmp_path):
    """A diagnostic (bench.multi_gpu --profile): the engine records its own work between
    profile_start and profile_stop and writes the Chrome trace; a stop without a start
    and a second start are refused, naming the verb, and the engine keeps serving."""
    import json

    client, _ = engine
    with pytest.raises(EngineError, match="profile_stop: this engine is not recording; profile_start first"):
        await client.profile_stop(str(tmp_path / "none.json"))
    await client.profile_start()
    with pytest.raises(EngineError, match="profile_start: this engine is already recording"):
        await client.profile_start()
    digest = await client.digest()
    out = await client.profile_stop(str(tmp_path / "engine.json"))
    assert out["trace"] == str(tmp_path / "engine.json") and out["wall_s"] > 0
    assert set(out["device_s_by_kind"]) == {"nccl", "memcpy", "other"}
    # the host's own time by op, most first: the digest's ops among them
    host = out["host_top"]
    assert host and any(h["name"].startswith("aten::") for h in host)
    assert [h["self_host_s"] for h in host] == sorted((h["self_host_s"] for h in host), reverse=True)
    events = json.loads((tmp_path / "engine.json").read_text())["traceEvents"]
    assert any(str(e.get("name", "")).startswith("aten::") for e in events)  # the digest's own ops
    assert await client.digest() == digest  # still serving, the weights untouched


def test_handle_rebuild_is_allow_listed_and_names_are_checked():
    with pytest.raises(HandleError, match="not allowed"):
        open_handle({"kind": "torch_pickle"})
    with pytest.raises(HandleError, match="not a colo segment name"):
        open_handle({"kind": "shm", "name": "../../etc/passwd", "nbytes": 8})


async def test_packed_buckets_through_shared_memory_load_the_trainers_weights(engine):
    client, config = engine
    model = build_trainer_model(config, seed=3)
    state = {n: p.detach() for n, p in model.named_parameters()}
    specs = client.specs
    from colo.core.buckets import spec as mkspec
    full = [mkspec(s.name, s.shape, s.dtype) for s in specs]
    await client.preflight(full)
    await client.begin_load()
    buckets = plan_buckets(full, 64 << 10)
    seg = ShmSegment.create(max(b.nbytes for b in buckets))
    try:
        for b in buckets:
            pack_into(seg.tensor, b, [(e.spec.name, state[e.spec.name]) for e in b.entries])
            request = PackedRequest(seg.handle(), tuple(TensorMeta.of_bucket(b)))
            reply = await client.transport_load("packed", request.to_json())
            assert reply["tensors"] == len(b.entries)
            # the engine names its route with the load's seconds: host tensors go one by one
            assert [k for k in reply if k.startswith("route_")] == ["route_tensors_s"], reply
            assert 0 <= reply["route_tensors_s"] == reply["queue_s"]
        await client.end_load()
    finally:
        seg.close()
    assert new_segments() == []
    # the contract digest is in the order of the spec list the engine accepted
    assert await client.digest() == expected_digest({s.name: state[s.name] for s in full}, config, torch.float32)
    # the diagnostic beside it: each of the engine's own parameters' entries, over the socket
    from colo.engine.reference.core import EngineCore

    local = EngineCore(config, dtype=torch.float32, total_bytes=32 << 20, mem_fraction_static=0.5,
                       init_state=state)
    assert await client.param_entries() == local.param_entries()
    await client.set_weight_version(1)
    probe = [[1, 2, 3, 4, 5, 6, 7, 8]]
    got = torch.tensor(await client.logits(probe))
    want = model(torch.tensor(probe)).logits.detach()
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)


async def test_preflight_lists_every_mismatch_before_any_byte(engine):
    client, config = engine
    from colo.core.buckets import spec as mkspec
    good = [mkspec(s.name, s.shape, s.dtype) for s in client.specs]
    bad = good[1:] + [mkspec("model.layers.9.mlp.up_proj.weight", (2, 2), "float32")]
    bad[0] = mkspec(bad[0].name, (1,) + tuple(bad[0].shape), bad[0].dtype)
    with pytest.raises(EngineError) as ei:
        await client.preflight(bad)
    msg = str(ei.value)
    assert good[0].name in msg and "model.layers.9.mlp.up_proj.weight" in msg and bad[0].name in msg


def test_channel_refuses_oversized_and_non_object_frames():
    a, b = socket.socketpair()
    try:
        a.sendall(struct.pack(">I", 5) + b"[1,2]")
        with pytest.raises(ChannelError, match="must be a JSON object"):
            recv_frame(b)
        send_frame(a, {"id": 1, "op": "x"})
        assert recv_frame(b) == {"id": 1, "op": "x"}
        a.sendall(struct.pack(">I", 1 << 30))
        with pytest.raises(ChannelError, match="exceeds"):
            recv_frame(b)
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("build,want", [({"device": "cpu"}, 1), ({"device": "cpu", "threads": 2}, 2),
                                        ({"device": "cuda"}, None)])
def test_an_engine_on_the_cpu_computes_on_one_thread_unless_its_build_names_more(build, want):
    from colo.engine.reference.server import use_engine_threads

    before = torch.get_num_threads()
    try:
        # None: on a GPU the count is left as torch set it
        assert use_engine_threads(build) == torch.get_num_threads() == (before if want is None else want)
    finally:
        torch.set_num_threads(before)


def _one_bucket(client):
    """The engine's spec list, its one bucket, a segment of that size and a packed request over it
    (the same segment every sync)."""
    from colo.core.buckets import spec as mkspec

    full = [mkspec(s.name, s.shape, s.dtype) for s in client.specs]
    (bucket,) = plan_buckets(full, 1 << 30)
    seg = ShmSegment.create(bucket.nbytes)
    return full, bucket, seg, PackedRequest(seg.handle(), tuple(TensorMeta.of_bucket(bucket))).to_json()


async def _load_seed(client, config, full, bucket, seg, request, seed, before_load):
    """The weights of ``seed``'s model packed into ``seg`` and loaded in one request that ends the
    load (``before_load()`` called right before it); ``(state, reply)``."""
    state = {n: p.detach() for n, p in build_trainer_model(config, seed=seed).named_parameters()}
    pack_into(seg.tensor, bucket, [(e.spec.name, state[e.spec.name]) for e in bucket.entries])
    await client.preflight(full)
    await client.begin_load()
    before_load()
    return state, await client.transport_load("packed", request, end=True)


async def test_a_digest_asked_after_every_sync_rides_on_the_loads_end_and_stands_only_until_the_next_request(engine):
    """Issue 44: verification asks for the engine's digest right after every sync, and as a
    request of its own that was most of what verifying cost. Once a digest was asked, the next
    load's end answers it too; the digest right after costs no request and is the one a request
    would answer (the trainer's, of what the engine wrote). Any request in between (here a
    version set) makes the next digest a request again, and a digest in another order is
    always asked."""
    client, config = engine
    full, bucket, seg, request = _one_bucket(client)
    ops = []
    real = client._call

    async def spy(op, **fields):
        ops.append((op, fields.get("digest", False)))
        return await real(op, **fields)

    client._call = spy
    try:
        for seed in (3, 4, 5):
            state, reply = await _load_seed(client, config, full, bucket, seg, request, seed, ops.clear)
            want = expected_digest({s.name: state[s.name] for s in full}, config, torch.float32)
            got = await client.digest()
            if seed == 3:  # no digest asked before: the end carries none, the digest is a request
                assert ops == [("transport_load", False), ("digest", False)] and "digest" not in reply
            else:
                assert ops == [("transport_load", True)] and reply["digest"] == want, ops
                assert reply["digest_s"] >= 0
            assert got == want
        # asked twice, the second goes to the engine (only the first follows the end directly)
        ops.clear()
        assert await client.digest() == want and ops == [("digest", False)]
        await client.preflight(full)
        await client.begin_load()
        await client.transport_load("packed", request, end=True)
        ops.clear()
        await client.set_weight_version(7)
        assert await client.digest() == want and ops == [("set_weight_version", False), ("digest", False)]
        # a digest in an order of its own is always the engine's answer to that order
        ops.clear()
        await client.preflight(full)
        await client.begin_load()
        await client.transport_load("packed", request, end=True)
        order = [s.name for s in reversed(full)]
        assert await client.digest(order=order) != want and ops[-1] == ("digest", False)
    finally:
        client._call = real
        seg.close()


async def test_a_live_digest_is_a_request_of_its_own_that_asks_the_next_load_for_nothing(engine):
    """``EngineClient.live_digest``, taken beside a trainer's offload (Scheduler._digests_beside_offload):
    the engine's digest of what it holds, asked by a request of its own even right after a load
    whose end could have answered it, and it arms nothing: the next load's end carries no digest
    request. A digest asked with ``arm`` not a bool is refused, naming it."""
    client, config = engine
    full, bucket, seg, request = _one_bucket(client)
    ops = []
    real = client._call

    async def spy(op, **fields):
        ops.append((op, fields.get("digest", False), fields.get("arm")))
        return await real(op, **fields)

    client._call = spy
    try:
        await client.digest()  # an earlier verify armed the next end, as colo bench's plans leave it
        for seed in (6, 7):
            state, reply = await _load_seed(client, config, full, bucket, seg, request, seed, ops.clear)
            got = await client.live_digest()
            assert got == expected_digest({s.name: state[s.name] for s in full}, config, torch.float32)
            if seed == 6:  # the end the earlier digest armed answered one; live_digest asks anew anyway
                assert "digest" in reply and ops == [("transport_load", True, None), ("digest", False, False)]
            else:  # nothing armed the end since
                assert "digest" not in reply and ops == [("transport_load", False, None), ("digest", False, False)]
        with pytest.raises(EngineError, match="arm must be true or false"):
            await client.call("digest", arm="yes")
    finally:
        client._call = real
        seg.close()
