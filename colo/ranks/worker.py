"""One rank's process: a :class:`~colo.ranks.host.RankHost` served over the authenticated channel.

The driver starts the process, connects (the channel and its challenge are
the engine's: :mod:`colo.proc.channel`), and sends ``start`` — every rank at once,
since building a rank takes part in collectives — then one request per verb.
The process serves that one connection; when it closes (the driver ended) or
on ``shutdown`` the host is closed, shielded: its engine rank, its staging
and its process groups go with it. Like the engine, the worker dies with the
driver however the driver dies (:func:`colo.proc.lifecycle.die_with_parent`).

The worker is not a daemonic process: it starts its engine rank as a child.
"""

from __future__ import annotations

import os
import socket
import traceback
from typing import Any

import anyio
import anyio.to_thread

from colo.proc.channel import FrameRefused, Gate, recv_frame, send_frame
from colo.core.errors import ChannelError


def serve(sock_path: str, key: bytes, spec: dict) -> None:
    """Process entry point."""
    from colo.proc.lifecycle import die_with_parent, serve_then_end

    die_with_parent(spec.pop("parent_pid", None), sock_path, spec.get("workdir"))
    serve_then_end(lambda: anyio.run(_serve, sock_path, key, spec), sock_path)


def _listen(sock_path: str) -> socket.socket:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock_path + ".tmp")
    os.chmod(sock_path + ".tmp", 0o600)
    listener.listen(4)
    # renamed once listening: the driver never connects to a socket that is not ready
    os.replace(sock_path + ".tmp", sock_path)
    return listener


async def _serve(sock_path: str, key: bytes, spec: dict) -> None:
    from colo.ranks.host import RankHost, RankSpec, load_object

    rank_spec = RankSpec(**spec)
    host = (load_object(rank_spec.host_class) if rank_spec.host_class else RankHost)(rank_spec)
    listener = _listen(sock_path)
    gate = Gate(listener, key)
    try:
        conn = await anyio.to_thread.run_sync(gate.accept)
        with conn:
            await _loop(host, conn)
    finally:
        await host.aclose()
        gate.close()
        listener.close()


async def _loop(host: Any, conn: socket.socket) -> None:
    """One request at a time, in the order the driver sent them: every rank
    then issues its collectives in the same order."""
    while True:
        try:
            msg = await anyio.to_thread.run_sync(recv_frame, conn)
        except FrameRefused as e:
            send_frame(conn, {"id": None, "ok": False, "error_type": "ChannelError", "error": str(e)})
            continue
        except (ChannelError, OSError):
            return  # the driver is gone: the host closes in _serve's finally
        reply = await _answer(host, msg)
        await anyio.to_thread.run_sync(send_frame, conn, reply)
        if msg.get("op") == "shutdown":
            return


async def _answer(host: Any, msg: dict) -> dict:
    from colo.ranks.host import describe_error

    rid, op = msg.get("id"), msg.get("op")
    args = {k: v for k, v in msg.items() if k not in ("id", "op")}
    try:
        out = await (host.start() if op == "start" else host.handle(str(op), args))
        return {"id": rid, "ok": True, **out}
    except Exception as e:  # answered, never fatal: the driver decides
        return {"id": rid, "ok": False, **describe_error(e), "trace": traceback.format_exc(limit=4)}


__all__ = ["serve"]
