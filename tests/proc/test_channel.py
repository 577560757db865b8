"""Issue 16, reliability round 2: the engine's channel against hostile frames,
silent peers and long temporary directories (items 3, 4, 6)."""

import multiprocessing as mp
import os
import socket
import stat
import struct
import tempfile

import anyio
import pytest

from colo.proc.channel import MAX_FRAME, AsyncChannel, ChannelError, new_key
from colo.engine.reference.client import EngineClient
from colo.core.errors import EngineDied
from colo.trainers.models import demo_config

from tests.conftest import SMALL_CFG
from tests.waits import CEILING_S


def _build(tmp_path, **extra):
    config = demo_config(**SMALL_CFG)
    return {"config": config.to_dict(), "dtype": "float32", "device": "cpu", "total_bytes": 64 << 20,
            "mem_fraction_static": 0.5, "checkpoint": None, "log_path": str(tmp_path / "engine.log"), **extra}


def _frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            break
        buf += chunk
    return buf


# -- item 3: one authenticated frame must not kill the engine ---------------------------

HOSTILE = [
    # int("9" * 5000) is a ValueError in Python's json ("Exceeds the limit (4300 digits)")
    (b'{"id":1,"op":"hello","n":' + b"9" * 5000 + b"}", "a number of 5000 digits"),
    # 100,000 levels: a RecursionError in json.loads
    (b'{"id":2,"op":"hello","x":' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested deeper than"),
    (b'{"id":3,"op":"hello","x":NaN}', "NaN"),
    (b'{"id":4,"op":"hello","x":1e400}', "1e400"),
    (b'{"id":5,"op":"hello","x":-Infinity}', "-Infinity"),
    (b'{"id":6,"op":"hello"', "not UTF-8 JSON"),
]


async def test_hostile_frames_are_answered_with_errors_and_the_engine_keeps_serving(small_engine, tmp_path):
    client, _ = small_engine
    stream = client._ch._stream
    with anyio.fail_after(60):
        for body, said in HOSTILE:
            await stream.send(_frame(body))
            reply = await client._ch._recv()
            assert (reply["id"], reply["ok"], reply["error_type"]) == (None, False, "ChannelError"), reply
            assert said in reply["error"], reply["error"]
        hello = await client.call("hello")  # the same connection goes on
        assert hello["ok"] is True
        # a length over the limit (or bytes sent without one): answered, then this
        # connection is closed, since nothing after it can be read in step
        await stream.send(struct.pack(">I", MAX_FRAME + 1) + b"x" * 100)
        reply = await client._ch._recv()
        assert reply["ok"] is False and f"exceeds the {MAX_FRAME} B limit" in reply["error"]
        with pytest.raises(ChannelError, match="closed"):
            await client._ch._recv()
        await client.reconnect()
        hello = await client.call("hello")
    assert hello["ok"] is True and hello["weight_version"] is None and client.process.is_alive()
    log = (tmp_path / "engine.log").read_text()
    assert log.count('"event": "channel.rejected_frame"') == len(HOSTILE) + 1


# -- item 4: a silent peer at start-up ------------------------------------------------

async def test_a_silent_peer_never_blocks_the_rightful_client_and_is_dropped_at_its_deadline(tmp_path):
    client = await EngineClient.spawn(_build(tmp_path, handshake_timeout_s=5.0))
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        await client._ch.aclose()
        silent.settimeout(CEILING_S)  # a hang guard: the engine drops it at its 5 s deadline
        silent.connect(client.socket_path)
        assert len(_recv_exact(silent, 32)) == 32  # challenged, and it never answers
        with anyio.fail_after(CEILING_S):  # before: the engine waited on the silent peer forever
            await client.reconnect()
            assert (await client.call("hello"))["ok"] is True
        # once the engine is free again, the silent peer's deadline runs out
        await client._ch.aclose()
        assert silent.recv(1) == b""  # closed by the engine, no "OK"
        with anyio.fail_after(CEILING_S):
            await client.reconnect()
            assert (await client.call("hello"))["ok"] is True
    finally:
        silent.close()
        await client.aclose()
    log = (tmp_path / "engine.log").read_text()
    assert '"event": "channel.refused"' in log and "did not authenticate within 5" in log


async def test_an_engine_that_does_not_start_in_time_is_a_colo_error(tmp_path, monkeypatch):
    own_tmp = tmp_path / "tmp"
    own_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(own_tmp))
    monkeypatch.setattr(tempfile, "tempdir", None)
    before = {p.pid for p in mp.active_children()}
    # an engine takes seconds to import torch and build: 0.2 s is too short
    with pytest.raises(EngineDied, match=r"engine did not answer within 0.2 s of starting"):
        await EngineClient.spawn(_build(tmp_path), start_timeout_s=0.2)
    assert [p for p in mp.active_children() if p.pid not in before] == []  # killed and reaped
    assert os.listdir(own_tmp) == []  # its socket directory removed


async def test_a_handshake_that_never_comes_is_a_channel_error(tmp_path):
    path = str(tmp_path / "s.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    try:
        with pytest.raises(ChannelError, match=r"no authentication challenge from .* within 0.3 s"):
            await AsyncChannel.connect(path, new_key(), timeout_s=0.3)
    finally:
        listener.close()


# -- item 6: a long TMPDIR ------------------------------------------------------------

async def test_a_long_tmpdir_still_gives_a_private_socket_that_works(tmp_path, monkeypatch):
    long_dir = tmp_path / ("t" * max(1, 110 - len(str(tmp_path))))
    long_dir.mkdir()
    assert len(str(long_dir)) >= 100  # with colo-engine-XXXX/engine.sock.tmp: far over 107 bytes
    monkeypatch.setenv("TMPDIR", str(long_dir))
    monkeypatch.setattr(tempfile, "tempdir", None)
    client = await EngineClient.spawn(_build(tmp_path))
    try:
        path = client.socket_path
        sockdir = os.path.dirname(path)
        assert len(os.fsencode(path + ".tmp")) <= 107
        st_dir, st_sock = os.stat(sockdir), os.stat(path)
        assert stat.S_IMODE(st_dir.st_mode) == 0o700 and st_dir.st_uid == os.getuid()
        assert stat.S_ISSOCK(st_sock.st_mode) and stat.S_IMODE(st_sock.st_mode) == 0o600
        assert (await client.call("hello"))["ok"] is True
    finally:
        await client.aclose()
    assert not os.path.exists(sockdir)
