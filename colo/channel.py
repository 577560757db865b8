"""The engine's control channel: local, authenticated, and never unpickling.

Frames are a 4-byte big-endian length and a UTF-8 JSON object. A client
proves it holds the per-run key by answering the server's random challenge
with HMAC-SHA256; a peer without the key is refused before any request is
read. Tensor handles travel as plain JSON (a kind and a few fields) and are
rebuilt on the engine side only by the allow-listed functions in
``colo.handles`` — there is no path from the channel to ``pickle``.

The engine side is a plain blocking socket (the engine is a loop that does one
thing at a time, like SGLang's scheduler); the trainer side is an anyio
stream so the scheduler's deadlines and cancellation reach it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import struct
from typing import Any
from colo.errors import ChannelError

MAX_FRAME = 64 << 20  # metadata only; 64 MiB is far beyond any real bucket's table
_LEN = struct.Struct(">I")


def encode(msg: dict) -> bytes:
    body = json.dumps(msg, separators=(",", ":"), allow_nan=False).encode("utf-8")
    if len(body) > MAX_FRAME:
        raise ChannelError(f"frame of {len(body)} B exceeds the {MAX_FRAME} B limit")
    return _LEN.pack(len(body)) + body


def decode(body: bytes) -> dict:
    try:
        msg = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ChannelError(f"frame is not UTF-8 JSON ({e.__class__.__name__}); refusing it") from None
    if not isinstance(msg, dict):
        raise ChannelError(f"frame must be a JSON object, got {type(msg).__name__}")
    return msg


def new_key() -> bytes:
    return os.urandom(32)


def answer(key: bytes, challenge: bytes) -> bytes:
    return hmac.new(key, b"colo-channel/1" + challenge, hashlib.sha256).digest()


# -- blocking side (the engine) -------------------------------------------------
def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ChannelError("peer closed the channel")
        buf += chunk
    return bytes(buf)


def recv_frame(sock: socket.socket) -> dict:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > MAX_FRAME:
        raise ChannelError(f"frame of {n} B exceeds the {MAX_FRAME} B limit")
    return decode(_recv_exact(sock, n))


def send_frame(sock: socket.socket, msg: dict) -> None:
    sock.sendall(encode(msg))


def server_handshake(sock: socket.socket, key: bytes) -> None:
    """Challenge the peer; raise ChannelError (and send nothing more) if it lacks the key."""
    challenge = os.urandom(32)
    sock.sendall(challenge)
    got = _recv_exact(sock, 32)
    if not hmac.compare_digest(got, answer(key, challenge)):
        raise ChannelError("peer failed authentication")
    sock.sendall(b"OK")


# -- async side (the trainer / scheduler) ---------------------------------------
class AsyncChannel:
    """Request/response over an anyio stream with request ids.

    A request cancelled mid-flight (deadline, cancel) leaves its response in
    the pipe; ids let the next request skip it instead of reading it as its own.
    """

    def __init__(self, stream: Any):
        self._stream = stream
        self._buf = bytearray()
        self._next_id = 0

    @classmethod
    async def connect(cls, path: str, key: bytes) -> AsyncChannel:
        import anyio

        stream = await anyio.connect_unix(path)
        ch = cls(stream)
        challenge = await ch._read_exact(32)
        await stream.send(answer(key, challenge))
        if await ch._read_exact(2) != b"OK":
            raise ChannelError("engine refused authentication")
        return ch

    async def _read_exact(self, n: int) -> bytes:
        import anyio

        while len(self._buf) < n:
            try:
                chunk = await self._stream.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                raise ChannelError("engine closed the channel") from None
            self._buf += chunk
        out, self._buf = bytes(self._buf[:n]), self._buf[n:]
        return out

    async def _recv(self) -> dict:
        (n,) = _LEN.unpack(await self._read_exact(_LEN.size))
        if n > MAX_FRAME:
            raise ChannelError(f"frame of {n} B exceeds the {MAX_FRAME} B limit")
        return decode(await self._read_exact(n))

    async def request(self, op: str, *, on_sent: Any = None, **fields: Any) -> dict:
        """Send one request and wait for its reply; ``on_sent()`` runs between the two."""
        import anyio

        self._next_id += 1
        rid = self._next_id
        try:
            await self._stream.send(encode({"id": rid, "op": op, **fields}))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            raise ChannelError("engine closed the channel") from None
        if on_sent is not None:
            on_sent()
        while True:
            reply = await self._recv()
            if reply.get("id") == rid:
                return reply
            # an answer to an abandoned request: drop it

    async def aclose(self) -> None:
        await self._stream.aclose()
