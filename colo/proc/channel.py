"""The engine's control channel: local, authenticated, and never unpickling.

Frames are a 4-byte big-endian length and a UTF-8 JSON object. A client
proves it holds the per-run key by answering the server's random challenge
with HMAC-SHA256; a peer without the key is refused before any request is
read. Tensor handles travel as plain JSON (a kind and a few fields) and are
rebuilt on the engine side only by the allow-listed functions in
``colo.proc.handles`` — there is no path from the channel to ``pickle``.

The engine side is a plain blocking socket (the engine is a loop that does one
thing at a time, like SGLang's scheduler); the trainer side is an anyio
stream so the scheduler's deadlines and cancellation reach it.

JSON that colo did not write itself (a frame, a line of a trace) is read with
:func:`strict_loads`: bounded depth and number size, no NaN or Infinity. Python's
own ``json.loads`` raises ``RecursionError`` on deep nesting and ``ValueError``
on a 5,000-digit integer — one such frame must not end a process.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import re
import selectors
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from colo.core.errors import ChannelError

MAX_FRAME = 64 << 20  # metadata only; 64 MiB is far beyond any real bucket's table
#: nesting that no frame or trace event colo writes comes near (a request is ~5 deep)
MAX_DEPTH = 64
#: digits of an integer: byte counts and versions fit in 20 (2**64 has 20 digits)
MAX_INT_DIGITS = 20
#: seconds a connecting peer has to answer the challenge
HANDSHAKE_S = 5.0
_LEN = struct.Struct(">I")


# -- bounded JSON ---------------------------------------------------------------------

class JSONLimitError(ValueError):
    """Well-formed JSON beyond what colo reads: too deep, a number too long, NaN or Infinity.

    Internal: the channel turns it into :class:`ChannelError`, the trace reader
    into :class:`~colo.core.errors.BadTrace`."""


_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_BRACKET = re.compile(r"[\[\]{}]")
_LONG_DIGITS = re.compile(r"\d{%d}" % (MAX_INT_DIGITS + 1))


def _too_deep(text: str, limit: int) -> bool:
    # Cheap first: fewer opening brackets than the limit cannot nest deeper.
    if text.count("[") + text.count("{") <= limit:
        return False
    depth = 0
    for m in _BRACKET.finditer(_STRING.sub("", text)):  # brackets inside strings do not nest
        if m.group() in "[{":
            depth += 1
            if depth > limit:
                return True
        else:
            depth -= 1
    return False


def _int(s: str) -> int:
    digits = len(s) - s.startswith("-")
    if digits > MAX_INT_DIGITS:
        raise JSONLimitError(f"a number of {digits} digits; expected at most {MAX_INT_DIGITS}")
    return int(s)


def _float(s: str) -> float:
    v = float(s)
    if not math.isfinite(v):
        raise JSONLimitError(f"the number {s[:40]} is out of range (it reads as {v})")
    return v


def _constant(s: str) -> Any:
    raise JSONLimitError(f"{s} is not a JSON number")


_DECODE = json.JSONDecoder(parse_float=_float, parse_constant=_constant).decode
# the int hook costs a Python call per integer: only for text that has a long digit run
_DECODE_CHECKED = json.JSONDecoder(parse_int=_int, parse_float=_float, parse_constant=_constant).decode


def strict_loads(text: str, *, max_depth: int = MAX_DEPTH) -> Any:
    """``json.loads`` for JSON from outside: raise ``json.JSONDecodeError`` for text
    that is not JSON, :class:`JSONLimitError` for JSON beyond the limits."""
    if _too_deep(text, max_depth):
        raise JSONLimitError(f"nested deeper than {max_depth} levels")
    decode = _DECODE_CHECKED if _LONG_DIGITS.search(text) else _DECODE
    try:
        return decode(text)
    except RecursionError:  # unreachable after the scan; kept so that no input can end a process
        raise JSONLimitError(f"nested deeper than {max_depth} levels") from None


def encode(msg: dict) -> bytes:
    try:
        body = json.dumps(msg, separators=(",", ":"), allow_nan=False).encode("utf-8")
    except ValueError as e:  # NaN or Infinity: not JSON, and the peer would refuse it
        raise ChannelError(f"message is not valid JSON: {e}") from None
    if len(body) > MAX_FRAME:
        raise ChannelError(f"frame of {len(body)} B exceeds the {MAX_FRAME} B limit")
    return _LEN.pack(len(body)) + body


def decode(body: bytes) -> dict:
    try:
        msg = strict_loads(body.decode("utf-8"))
    except JSONLimitError as e:
        raise ChannelError(f"frame refused: {e}") from None
    except ValueError as e:  # UnicodeDecodeError, JSONDecodeError, and anything json adds later
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


class FrameRefused(ChannelError):
    """A whole frame was read and refused: the stream is still in step, answer and go on."""


def recv_frame(sock: socket.socket) -> dict:
    """One frame; :class:`FrameRefused` for one that was read in full but is not
    acceptable (the next frame can be read), :class:`ChannelError` for a stream
    that is closed or out of step."""
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > MAX_FRAME:
        # Not read: a length this large is as often bytes written without a
        # length prefix as a real frame, and nothing after it can be trusted.
        raise ChannelError(f"frame of {n} B exceeds the {MAX_FRAME} B limit")
    body = _recv_exact(sock, n)
    try:
        return decode(body)
    except ChannelError as e:
        raise FrameRefused(str(e)) from None


def send_frame(sock: socket.socket, msg: dict) -> None:
    sock.sendall(encode(msg))


@dataclass
class _Pending:
    challenge: bytes
    got: bytearray
    deadline: float


class Gate:
    """Accepts connections on ``listener`` and hands out only authenticated ones.

    Every peer is challenged at once and all are waited on together, so a peer
    that connects and says nothing costs the rightful client nothing; it is
    closed at its deadline. Peers still pending when one authenticates wait
    (with a fresh deadline) until the engine accepts again: the engine serves
    one connection at a time.
    """

    def __init__(self, listener: socket.socket, key: bytes, *, timeout_s: float = HANDSHAKE_S,
                 max_pending: int = 16, on_refused: Callable[[str], None] | None = None):
        self._listener, self._key, self.timeout_s = listener, key, timeout_s
        self._max_pending = max_pending
        self._refused = on_refused or (lambda reason: None)
        self._pending: dict[socket.socket, _Pending] = {}
        self._sel = selectors.DefaultSelector()
        self._sel.register(listener, selectors.EVENT_READ)

    def _drop(self, conn: socket.socket, reason: str) -> None:
        self._pending.pop(conn, None)
        try:
            self._sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()
        self._refused(reason)

    def _admit(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except OSError as e:  # out of descriptors, say: the peers already here go on
            self._refused(f"accept failed: {e}")
            time.sleep(0.05)
            return
        conn.setblocking(False)
        challenge = os.urandom(32)
        try:
            sent = conn.send(challenge)  # 32 B into an empty socket buffer
        except OSError as e:
            sent, why = 0, str(e)
        else:
            why = "short write"
        if sent != len(challenge):
            conn.close()
            self._refused(f"could not send the challenge: {why}")
            return
        if len(self._pending) >= self._max_pending:
            oldest = min(self._pending, key=lambda c: self._pending[c].deadline)
            self._drop(oldest, f"more than {self._max_pending} peers waiting to authenticate")
        self._pending[conn] = _Pending(challenge, bytearray(), time.monotonic() + self.timeout_s)
        self._sel.register(conn, selectors.EVENT_READ)

    def _read(self, conn: socket.socket) -> socket.socket | None:
        p = self._pending[conn]
        try:
            chunk = conn.recv(32 - len(p.got))
        except BlockingIOError:
            return None
        except OSError as e:
            self._drop(conn, f"peer failed before authenticating: {e}")
            return None
        if not chunk:
            self._drop(conn, "peer closed the channel before authenticating")
            return None
        p.got += chunk
        if len(p.got) < 32:
            return None
        if not hmac.compare_digest(bytes(p.got), answer(self._key, p.challenge)):
            self._drop(conn, "peer failed authentication")
            return None
        self._pending.pop(conn)
        self._sel.unregister(conn)
        conn.setblocking(True)
        try:
            conn.sendall(b"OK")
        except OSError as e:
            conn.close()
            self._refused(f"peer failed after authenticating: {e}")
            return None
        return conn

    def accept(self, wait_s: float | None = None) -> socket.socket:
        """Block until a peer authenticates; return its connection (blocking mode).
        ``wait_s``: raise ``TimeoutError`` if none has within that many seconds."""
        now = time.monotonic()
        until = None if wait_s is None else now + wait_s
        for p in self._pending.values():  # they waited while another was served
            p.deadline = now + self.timeout_s
        while True:
            now = time.monotonic()
            if until is not None and now >= until:
                raise TimeoutError(f"no peer authenticated within {wait_s:g} s")
            for conn in [c for c, p in self._pending.items() if p.deadline <= now]:
                self._drop(conn, f"peer did not authenticate within {self.timeout_s:g} s")
            wait = min([p.deadline for p in self._pending.values()] + ([until] if until is not None else []),
                       default=None)
            for key, _ in self._sel.select(None if wait is None else max(0.0, wait - now)):
                conn = key.fileobj
                if conn is self._listener:
                    self._admit()
                elif conn in self._pending:
                    done = self._read(conn)  # type: ignore[arg-type]
                    if done is not None:
                        return done

    def close(self) -> None:
        for conn in list(self._pending):
            self._pending.pop(conn)
            conn.close()
        self._sel.close()


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
    async def connect(cls, path: str, key: bytes, *, timeout_s: float = 60.0) -> AsyncChannel:
        """Connect and authenticate; :class:`ChannelError` if the engine does not
        challenge or accept us within ``timeout_s`` (it serves one connection at a
        time: another client holding it looks the same from here)."""
        import anyio

        try:
            stream = await anyio.connect_unix(path)
        except OSError as e:
            raise ChannelError(f"cannot connect to the engine at {path}: {e.strerror or e}") from None
        ch = cls(stream)
        try:
            with anyio.fail_after(timeout_s):
                challenge = await ch._read_exact(32)
                try:
                    await stream.send(answer(key, challenge))
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    raise ChannelError("engine closed the channel") from None
                ok = await ch._read_exact(2)
        except TimeoutError:
            await stream.aclose()
            raise ChannelError(f"no authentication challenge from {path}, or no answer to ours, within "
                               f"{timeout_s:g} s (the engine serves one client at a time: is another "
                               "one connected?)") from None
        except BaseException:
            with anyio.CancelScope(shield=True):
                await stream.aclose()
            raise
        if ok != b"OK":
            await stream.aclose()
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
