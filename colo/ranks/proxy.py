"""The driver's side of many ranks: one worker process per GPU, and the three
objects per rank the :class:`~colo.scheduler.Scheduler` drives unchanged.

- :class:`Worker` — starts one rank's process (:mod:`colo.ranks.worker`) with
  that GPU's ``CUDA_VISIBLE_DEVICES``, connects, and makes requests.
- :class:`RemoteTrainer` (a ``TrainerSide``), :class:`RemoteEngine` (an
  ``EngineSide``), :class:`RemoteTransport` (a ``Transport``): each verb is one
  request to the rank's worker. A sync runs inside the worker; its stage
  records come back as data, re-stamped on the driver's clock, and the
  scheduler writes them into that rank's trace.

An error a worker answers with is rebuilt as the colo error it was
(``EngineDied``, ``OutOfMemory`` with its numbers, ...) or a
:class:`~colo.core.errors.RankError` naming the rank; a worker that is gone is
:class:`~colo.core.errors.RankDied`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Sequence
from typing import Any

import anyio

from colo.proc.channel import AsyncChannel, new_key
from colo.proc.lifecycle import release_dir
from colo.core.interfaces import EngineCapabilities, RolloutResult, StageRecord, SyncContext, SyncResult, TensorSpec
from colo.core.errors import (ChannelError, EngineDied, EngineError, EngineRefused, OutOfMemory, RankDied,
                              RankError, VerificationError)
from colo.proc.lifecycle import unless_stopped
from colo.engine.forward import ForwardedEngine, rollout_to_json
from colo.ranks.host import RankSpec

#: a rank builds a model, joins two process groups and starts an engine: minutes on a busy host
START_TIMEOUT_S = 600.0
#: errors a worker reports that are rebuilt as themselves (from their message)
_BY_NAME = {"EngineDied": EngineDied, "EngineRefused": EngineRefused, "VerificationError": VerificationError}


def _start(spec: dict, path: str, key: bytes, env: dict[str, str] | None) -> Any:
    from colo.proc.lifecycle import start_with_env
    from colo.ranks.worker import serve

    # not daemonic: the worker starts its engine rank as a child of its own
    proc = mp.get_context("spawn").Process(target=serve, args=(path, key, spec), daemon=False,
                                           name=f"colo-rank-{spec['rank']}")
    return start_with_env(proc, env)


class Worker:
    """One rank's process, from the driver."""

    def __init__(self, rank: int, proc: Any, channel: AsyncChannel, sockdir: str):
        self.rank, self.process, self._ch, self._sockdir = rank, proc, channel, sockdir
        self._lock = anyio.Lock()
        self.closed = False

    @classmethod
    async def spawn(cls, spec: RankSpec, *, env: dict[str, str] | None = None,
                    connect_timeout_s: float = 120.0) -> Worker:
        from colo.proc.lifecycle import SOCKET_NAME, socket_dir

        key, sockdir = new_key(), socket_dir()
        proc = None
        try:
            path = os.path.join(sockdir, SOCKET_NAME)
            proc = _start({**spec.to_json(), "parent_pid": os.getpid()}, path, key, env)
            with anyio.fail_after(connect_timeout_s):
                while not os.path.exists(path):
                    if not proc.is_alive():
                        raise RankDied(f"rank {spec.rank} process exited with code {proc.exitcode} while starting")
                    await anyio.sleep(0.05)
            ch = await AsyncChannel.connect(path, key)
        except BaseException:
            with anyio.CancelScope(shield=True):
                if proc is not None and proc.pid is not None:
                    proc.kill()
                    await anyio.to_thread.run_sync(proc.join, 5)
                release_dir(sockdir)
            raise
        return cls(spec.rank, proc, ch, sockdir)

    async def call(self, op: str, **fields: Any) -> dict:
        if self.closed:
            raise RankDied(f"rank {self.rank} worker is closed: cannot {op}")
        async with self._lock:  # one request at a time per rank, in order
            try:
                # watched as the engine's requests are: a stopped worker keeps its socket open
                # and answers nothing, and the other ranks wait on it in their collectives
                reply, stopped = await unless_stopped(self.process.pid, lambda: self._ch.request(op, **fields))
            except ChannelError as e:
                raise RankDied(f"rank {self.rank} worker process is gone during {op} "
                               f"(pid {self.process.pid}, exit code {self.process.exitcode}; {e})") from e
            if stopped is not None:
                pid = self.process.pid
                # SIGKILL ends a stopped process too; its engine rank follows it (parent-death
                # signal), which breaks the other ranks' collectives with them. Raised at once,
                # before any await: the stop is the cause, and the other ranks' broken
                # collectives, reported a moment later, must not be taken for it (aclose reaps)
                self.process.kill()
                raise RankDied(f"rank {self.rank} worker process {pid} was stopped (state T) for {stopped:.1f} s "
                               f"during {op}; killed it")
        if not reply.get("ok"):
            raise rebuild_error(self.rank, op, reply)
        return reply

    async def aclose(self, timeout_s: float = 30.0) -> None:
        """Shielded: ask the worker to close its rank, then make sure the process is gone."""
        if self.closed:
            return
        with anyio.CancelScope(shield=True):
            if self.process.is_alive():
                with anyio.move_on_after(timeout_s):
                    try:
                        await self.call("shutdown")
                    except Exception:
                        pass
            try:
                await self._ch.aclose()
            except Exception:
                pass
            await anyio.to_thread.run_sync(self.process.join, timeout_s)
            if self.process.is_alive():
                self.process.kill()
                await anyio.to_thread.run_sync(self.process.join, timeout_s)
            release_dir(self._sockdir)
            self.closed = True


def rebuild_error(rank: int, op: str, reply: dict) -> Exception:
    """The colo error a worker's error answer describes."""
    kind, message = str(reply.get("error_type", "?")), str(reply.get("error", ""))
    oom = reply.get("oom")
    if kind == "OutOfMemory" and isinstance(oom, dict):
        return OutOfMemory(**oom)
    if kind in _BY_NAME:
        return _BY_NAME[kind](f"rank {rank}: {message}")
    if kind == "EngineError" or op == "engine":
        return EngineError(f"rank {rank} {op}", kind, message)
    return RankError(rank, op, kind, message)


class RemoteTrainer:
    """A trainer rank in its worker (a ``TrainerSide``)."""

    def __init__(self, worker: Worker, hello: dict):
        self.worker = worker
        self._tags = {k: int(v) for k, v in hello["trainer_tag_bytes"].items()}
        self._specs = [TensorSpec(name=n, shape=tuple(s), dtype=d, nbytes=int(b))
                       for n, s, d, b in hello["param_specs"]]
        self._num_params = int(hello["num_params"])
        self.steps = 0

    def tag_bytes(self) -> dict[str, int]:
        return dict(self._tags)

    def param_specs(self) -> Sequence[TensorSpec]:
        return list(self._specs)

    def num_params(self) -> int:
        return self._num_params

    def extractor(self) -> Any:
        raise RuntimeError("a remote trainer rank is extracted from inside its worker: "
                           "sync it with the RemoteTransport of the same worker")

    async def onload(self, tags: Sequence[str]) -> None:
        await self.worker.call("onload", tags=list(tags))

    async def offload(self, tags: Sequence[str]) -> None:
        await self.worker.call("offload", tags=list(tags))

    async def train_step(self, rollout: RolloutResult) -> dict[str, float]:
        reply = await self.worker.call("train_step", rollout=rollout_to_json(rollout))
        self.steps = int(reply["steps"])
        return reply["result"]


class RemoteEngine(ForwardedEngine):
    """An engine rank behind its worker (an ``EngineSide``): every verb is one request to the
    worker, forwarded as any engine in another process is (:mod:`colo.engine.forward`)."""

    def __init__(self, worker: Worker, hello: dict):
        self.worker = worker
        self._tags = {k: int(v) for k, v in hello["engine_tag_bytes"].items()}
        self.capabilities = EngineCapabilities.from_json(hello.get("engine_capabilities"))
        self.pid = int(hello["engine_pid"])
        self.weight_version: int | None = 0

    def tag_bytes(self) -> dict[str, int]:
        return dict(self._tags)

    async def _forward(self, verb: str, **args: Any) -> dict:
        return await self.worker.call("engine", verb=verb, args=args)


class RemoteTransport:
    """The transport of one rank, run inside its worker (a ``Transport``)."""

    def __init__(self, worker: Worker, name: str):
        self.worker, self.name = worker, name
        #: fault injection (``--fault kill-engine@sync``): the next sync kills this
        #: rank's engine process after that many bucket loads, once
        self.kill_engine_after: int | None = None
        self.kills_sent = 0

    async def sync(self, trainer: Any, engine: Any, ctx: SyncContext) -> SyncResult:
        b = ctx.staging
        staging = {"limit": b.limit, "total": b.total, "in_use": b.in_use, "rank": b.rank}
        t0 = ctx.clock()
        kill, self.kill_engine_after = self.kill_engine_after, None
        self.kills_sent += kill is not None
        reply = await self.worker.call("sync", step=ctx.step, weight_version=ctx.weight_version,
                                       bucket_bytes=ctx.bucket_bytes, source=ctx.source, staging=staging,
                                       kill_engine_after=kill, flush_cache=ctx.flush_cache)
        failed = reply.get("failed")
        ctx.stages[:] = [StageRecord(int(bk), str(st), int(n), int(k), float(d), t0 + float(at), int(held))
                         for bk, st, n, k, d, at, held in (failed or reply)["stages"]]
        if failed is not None:
            raise rebuild_error(self.worker.rank, "sync", failed)
        b.peak_bytes = max(b.peak_bytes, int(reply["staging_peak"]))
        return SyncResult(bytes=int(reply["bytes"]), buckets=int(reply["buckets"]), tensors=int(reply["tensors"]),
                          stages=tuple(ctx.stages), staging_peak=int(reply["staging_peak"]),
                          cache_flushed=reply.get("cache_flushed") is True)

    async def abort(self) -> None:
        try:
            await self.worker.call("abort")
        except Exception:
            pass  # a dead worker holds nothing

    async def aclose(self) -> None:
        """The worker closes its transport when it closes."""


__all__ = ["RemoteEngine", "RemoteTrainer", "RemoteTransport", "Worker", "rebuild_error"]
