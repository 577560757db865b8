"""The trainer side's handle on the engine process (an ``EngineSide``).

Spawns the engine, connects over the authenticated channel, and turns each
call into one request: the engine's verbs through the one forwarding every
engine in another process has (:class:`colo.engine.forward.ForwardedEngine`),
the receiving half (preflight, begin, loads, end) with this engine's own
economies of round trips. Every engine error comes back as
:class:`EngineError` with the engine's own message; a dead engine as
:class:`EngineDied`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Sequence
from typing import Any

import anyio

from colo.engine.adapters import AdapterVersions
from colo.engine.forward import ForwardedEngine, decode_f32  # noqa: F401 (decode_f32 re-exported)
from colo.proc.channel import AsyncChannel, ChannelError, new_key
from colo.core.interfaces import EngineCapabilities, RolloutResult, TensorSpec
from colo.tasks import RolloutData, RolloutTask
from colo.core.errors import EXIT_BAD_INPUT, EngineDied, EngineError, EngineRefused
from colo.proc.lifecycle import (SOCKET_NAME, process_state, release_dir, socket_dir, start_with_env,
                                 unless_stopped)
from colo.proc.rendezvous import HostedStore

#: after a broken channel, how long to wait for the engine process to be seen dead
DEATH_WAIT_S = 1.0


class Begun:
    """An engine process started before its build is known, waiting for it on a pipe.

    Starting the process is most of an engine's start-up on the CPU: a new interpreter
    importing torch and the engine (3 to 6 s on the 2-core VM, more under load), while the
    driver spends as long building the trainer whose weights the engine starts from. Begun
    first (:meth:`EngineClient.begin`), the two overlap; :meth:`EngineClient.spawn` then
    hands it the build. One never handed a build is ended by :meth:`abandon` (a run that
    failed before its engine was built); a process whose parent died reads the pipe's end
    and exits."""

    def __init__(self, proc: Any, conn: Any, sockdir: str, key: bytes):
        self.proc, self.conn, self.sockdir, self.key = proc, conn, sockdir, key
        self.path = os.path.join(sockdir, SOCKET_NAME)

    def send(self, build: dict) -> None:
        """Hand the process its build; the pipe is closed after, whatever happened."""
        try:
            self.conn.send(build)
        finally:
            self.conn.close()

    def abandon(self) -> None:
        """End the process (never built, or its start failed) and remove its socket dir."""
        self.conn.close()
        if self.proc.pid is not None:
            self.proc.kill()
            self.proc.join(5)
        release_dir(self.sockdir)


async def _await_hello(proc: Any, path: str, key: bytes, start_timeout_s: float, build: dict) -> tuple:
    """The engine's socket, the authenticated channel, its hello; a process that
    dies or stays silent is :class:`EngineDied` (the caller kills and cleans up)."""
    try:
        with anyio.fail_after(start_timeout_s):
            while not os.path.exists(path):
                if not proc.is_alive():
                    raise EngineDied(f"engine process exited with code {proc.exitcode} while starting")
                await anyio.sleep(0.05)
            ch = await AsyncChannel.connect(path, key)
            try:
                return ch, await ch.request("hello")
            except BaseException:
                with anyio.CancelScope(shield=True):  # the caller never sees this channel
                    try:
                        await ch.aclose()
                    except Exception:
                        pass
                raise
    except TimeoutError:
        log = build.get("log_path")
        raise EngineDied(f"engine did not answer within {start_timeout_s:g} s of starting "
                         f"(process {proc.pid}, {'alive' if proc.is_alive() else 'exited'}; killed it)"
                         + (f"; its log: {log}" if log else "")) from None
    except ChannelError as e:
        if proc.is_alive():
            raise
        raise EngineDied(f"engine process exited with code {proc.exitcode} while starting") from e


def start_error(reply: dict) -> Exception:
    """The error an engine's answer to its first request stands for: a build it refused
    (:class:`EngineRefused`, exit 2), a start that failed at run time (:class:`EngineDied`
    naming the cause, exit 1), or an engine that started and refused the hello."""
    kind, message = str(reply.get("error_type", "?")), str(reply.get("error", ""))
    if reply.get("start_failed") is not True:
        return EngineError("hello", kind, message)
    if reply.get("exit_code") == EXIT_BAD_INPUT:
        # the engine's check words it "engine refused its build: ..."; a refusal from deeper
        # in the build (a KV pool that does not fit) is worded by its own class
        return EngineRefused(message if message.startswith("engine refused its build: ")
                             else f"engine refused its build: {message}")
    return EngineDied(f"engine failed while starting: {kind}: {message}")


#: the engine process's op for a forwarded verb, where the names differ
_OPS = {"reported_version": "hello"}


class EngineClient(ForwardedEngine, AdapterVersions):
    def __init__(self, channel: AsyncChannel, process: Any, sockdir: str, key: bytes, hello: dict,
                 task: RolloutTask | None):
        self._ch, self.process, self._sockdir, self._key, self.task = channel, process, sockdir, key, task
        self._tag_bytes = {k: int(v) for k, v in hello["tag_bytes"].items()}
        self.capabilities = EngineCapabilities.from_json(hello.get("capabilities"))
        self.weight_version = hello.get("weight_version")
        self.specs = [TensorSpec(name=n, shape=tuple(s), dtype=d, nbytes=0) for n, s, d in hello["param_specs"]]
        self.closed = False
        #: (specs, their wire form, its key) of the spec list this engine last accepted:
        #: the same list again goes as its key, known without serialising and hashing it
        self._preflight: tuple[list, list, str] | None = None
        #: a cached spec list's key that preflight() left for begin_load() to carry: the
        #: engine checks it before it begins, in the same request (one round trip a sync)
        self._preflight_due: str | None = None
        #: begin_load() was asked for and not yet sent: the sync's first transport_load
        #: carries it (another round trip saved); any other request sends it first
        self._begin_due = False
        #: the engine answers a load's end with its digest where asked (colo's engine server says
        #: so in its hello): verification then costs no request of its own (see :meth:`digest`)
        self._ends_with_digest = hello.get("ends_with_digest") is True
        #: a digest was asked since the last end: the next end asks for one
        self._digest_wanted = False
        #: the digest the last request (a load's end) answered, until any other request
        self._end_digest: str | None = None
        #: the TP group's store when spawn_tp served it (colo.proc.rendezvous): kept while
        #: any rank's client lives, since NCCL meets there again to make its communicators
        self._rendezvous: Any = None
        self.init_adapters()

    @staticmethod
    def begin(env: dict[str, str] | None = None) -> Begun:
        """Start an engine process that waits for its build (:class:`Begun`); ``env`` is
        added to its environment only (e.g. its own ``CUDA_VISIBLE_DEVICES``, as an engine
        launched elsewhere would have)."""
        from colo.engine.reference.server import serve_when_built

        ctx = mp.get_context("spawn")
        key = new_key()
        sockdir = socket_dir()
        # Everything after mkdtemp is inside the try: a failed start (a bad environment)
        # must not leave the socket directory or a pipe behind.
        try:
            os.chmod(sockdir, 0o700)  # the socket is only reachable by this user
            theirs, ours = ctx.Pipe(duplex=False)
            try:
                proc = start_with_env(ctx.Process(target=serve_when_built, args=(os.path.join(sockdir, SOCKET_NAME),
                                                                                key, theirs),
                                                  daemon=True, name="colo-engine"), env)
            except BaseException:
                ours.close()
                raise
            finally:
                theirs.close()  # the child has its own copy since start(): only it reads
        except BaseException:
            release_dir(sockdir)
            raise
        return Begun(proc, ours, sockdir, key)

    @classmethod
    async def spawn(cls, build: dict, *, task: RolloutTask | None = None,
                    start_timeout_s: float = 180.0, env: dict[str, str] | None = None,
                    begun: Begun | None = None) -> EngineClient:
        """Start the engine process (or build the one ``begun`` started, whose ``env`` was
        given then); ``env`` is added to its environment only."""
        if begun is None:
            begun = cls.begin(env)
        ch: AsyncChannel | None = None
        try:
            try:
                # the engine watches this pid and ends itself when it changes (we died)
                begun.send({**build, "parent_pid": os.getpid()})
            except OSError:  # the process died before it read its build
                await anyio.to_thread.run_sync(begun.proc.join, DEATH_WAIT_S)
                raise EngineDied(f"engine process exited with code {begun.proc.exitcode} while starting") from None
            ch, reply = await _await_hello(begun.proc, begun.path, begun.key, start_timeout_s, build)
            if not reply.get("ok"):
                raise start_error(reply)
        except BaseException:
            with anyio.CancelScope(shield=True):
                if ch is not None:
                    try:
                        await ch.aclose()
                    except Exception:
                        pass
                await anyio.to_thread.run_sync(begun.abandon)
            raise
        return cls(ch, begun.proc, begun.sockdir, begun.key, reply, task)

    @classmethod
    async def spawn_tp(cls, build: dict, n: int, *, backend: str = "gloo", init_method: str | None = None,
                       task: RolloutTask | None = None, start_timeout_s: float = 180.0,
                       envs: Sequence[dict[str, str] | None] | None = None) -> list[EngineClient]:
        """Start a tensor-parallel engine as ``n`` processes, one per rank; the clients in rank order.

        Each rank gets ``build`` plus ``"tp": {"rank", "size", "init_method", "backend"}``
        and joins the engine's TP group inside its own process (at a store this
        process serves, unless ``init_method`` is given); ``envs[r]`` is added
        to rank r's environment only (its ``CUDA_VISIBLE_DEVICES``, say). The ranks
        start together (building a rank waits for every other in a collective); if
        any fails to start, every rank is killed and cleaned up and the first
        failure is raised.
        """
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"n must be a positive number of TP ranks, got {n!r}")
        if envs is not None and len(envs) != n:
            raise ValueError(f"envs names {len(envs)} environments for {n} ranks")
        hosted = None
        if init_method is None:
            hosted = HostedStore(n)
            init_method = hosted.init_method
        clients: list[EngineClient | None] = [None] * n
        errors: list[BaseException] = []

        def rank_build(r: int) -> dict:
            out = {**build, "tp": {**build.get("tp", {}), "rank": r, "size": n, "init_method": init_method,
                                   "backend": backend}}
            if build.get("log_path"):
                out["log_path"] = f"{build['log_path']}.rank{r}"
            return out

        async def one(r: int, scope: anyio.CancelScope) -> None:
            try:
                clients[r] = await cls.spawn(rank_build(r), task=task, start_timeout_s=start_timeout_s,
                                             env=envs[r] if envs is not None else None)
            except Exception as e:  # the others are waiting on this rank in a collective: stop them
                errors.append(e)
                scope.cancel()

        try:
            async with anyio.create_task_group() as tg:
                for r in range(n):
                    tg.start_soon(one, r, tg.cancel_scope)
            if errors:
                raise errors[0]
        except BaseException:
            # spawn() cleaned up every rank it did not finish starting; close the ones it did
            with anyio.CancelScope(shield=True):
                for c in clients:
                    if c is not None:
                        await c.aclose()
            raise
        out = [c for c in clients if c is not None]
        for c in out:
            c._rendezvous = hosted
        return out

    @property
    def socket_path(self) -> str:
        return os.path.join(self._sockdir, SOCKET_NAME)

    def address(self) -> tuple[str, bytes]:
        """Where the engine listens and the key that authenticates to it, for another
        process of the same run to connect (the key is the run's own secret: hand it
        only to the run's own processes)."""
        return self.socket_path, self._key

    async def disconnect(self) -> None:
        """Close this client's connection and keep the engine: it serves one connection
        at a time, so another client can take over; :meth:`reconnect` takes it back."""
        await self._ch.aclose()

    async def reconnect(self) -> None:
        """A fresh authenticated connection to the same engine (after a broken channel)."""
        try:
            await self._ch.aclose()
        except Exception:
            pass
        self._ch = await AsyncChannel.connect(self.socket_path, self._key)

    async def call(self, op: str, *, on_sent: Any = None, **fields: Any) -> dict:
        # a digest answered with a load's end stands for the weights until the next request:
        # whatever it is, the next digest asks the engine
        self._end_digest = None
        if self._begin_due and op != "begin_load":
            if op == "transport_load":  # the sync's first load carries its begin
                return await self._with_begin(op, on_sent, fields)
            await self._with_begin("begin_load", None, {})  # the begin on its own, first
        return await self._call(op, on_sent=on_sent, **fields)

    async def _call(self, op: str, *, on_sent: Any = None, **fields: Any) -> dict:
        """One request and its answer, as it goes on the wire."""
        if self.closed:
            raise EngineDied(f"engine client is closed: cannot {op}")
        try:
            reply = await self._request(op, on_sent, fields)
        except ChannelError as e:
            if not await self._died(DEATH_WAIT_S):
                raise
            raise EngineDied(f"engine process died (exit code {self.process.exitcode}) during {op} "
                             f"(process {self.process.pid}; {e})") from e
        if not reply.get("ok"):
            raise EngineError(op, reply.get("error_type", "?"), reply.get("error", ""))
        return reply

    async def _request(self, op: str, on_sent: Any, fields: dict) -> dict:
        """One request, watched by a heartbeat: an engine stopped for ``STOPPED_LIMIT_S``
        is killed and :class:`EngineDied`.

        The heartbeat asks the kernel, not the engine: the engine serves one request
        at a time, so a ping would wait behind a legitimately long ``generate`` or
        ``transport_load``, and a busy engine (running, sleeping, in I/O) is not a
        stopped one (``T``). A stopped engine keeps its end of the channel open, so
        without this a request would wait out the phase deadline (600 s)."""
        reply, stopped = await unless_stopped(self.process.pid,
                                              lambda: self._ch.request(op, on_sent=on_sent, **fields))
        if stopped is None:
            return reply
        pid = self.process.pid
        self.process.kill()  # SIGKILL ends a stopped process too
        await self._died(5.0)
        raise EngineDied(f"engine process {pid} was stopped (state T) for {stopped:.1f} s during {op}; "
                         "killed it")

    async def _died(self, wait_s: float) -> bool:
        """Whether the engine process has ended, waiting up to ``wait_s`` for it.

        A killed process closes its end of the channel a moment before the
        kernel lets its parent reap it: ``is_alive()`` right after the broken
        channel can still say True for a process that is already gone."""
        if not self.process.is_alive():
            return True
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self.process.join, wait_s)
        return not self.process.is_alive()

    # -- EngineSide: the verbs are forwarded (ForwardedEngine), one request each ----------
    async def _forward(self, verb: str, **args: Any) -> dict:
        return await self.call(_OPS.get(verb, verb), **args)

    def tag_bytes(self) -> dict[str, int]:
        return dict(self._tag_bytes)

    async def profile_start(self) -> None:
        """A diagnostic: the engine records its own work under torch.profiler until
        :meth:`profile_stop` (:mod:`colo.device.profile`)."""
        await self.call("profile_start")

    async def profile_stop(self, path: str) -> dict:
        """End the engine's recording: its Chrome trace written at ``path`` (on the engine's
        machine), the summary of its device time returned."""
        reply = await self.call("profile_stop", path=str(path))
        return {k: v for k, v in reply.items() if k not in ("id", "ok")}

    async def param_entries(self) -> dict[str, str]:
        """Each parameter's digest entry, in hex (``EngineCore.param_entries``): a diagnostic."""
        return dict((await self.call("param_entries"))["entries"])

    async def generate(self, step: int) -> RolloutResult:
        """The rollout of ``step``: the task's prompts, generated by the engine, rewarded here
        (the task lives on this side)."""
        if self.task is None:
            raise RuntimeError("engine client has no rollout task: pass task= to spawn()")
        t = self.task
        prompts = t.prompts(step)
        adapter = {} if self.active_adapter is None else {"adapter": self.active_adapter}
        reply = await self.call("generate", prompts=prompts, max_new_tokens=t.max_new_tokens,
                                temperature=t.temperature, seed=t.seed(step), **adapter)
        completions = reply["completions"]
        rewards = t.rewards(prompts, completions)
        tokens = sum(len(c) for c in completions)
        return RolloutResult(reward=sum(rewards) / len(rewards), tokens=tokens,
                             data=RolloutData(prompts, completions, rewards))

    # -- LoRA adapters (colo.engine.adapters.AdapterVersions; the engine's half:
    # colo.engine.reference.adapters) --------------------------------------------------------
    async def _adapter_op(self, op: str, *args: Any) -> dict:
        return await self._call("adapter", verb=op, args=list(args))

    # -- sync ------------------------------------------------------------------
    async def preflight(self, specs: Sequence[TensorSpec]) -> None:
        """The engine checks every name, shape and dtype; a list it accepted before (the
        same model, sync after sync) goes as its key alone, and that key rides on the
        next :meth:`begin_load` instead of a request of its own. Either way nothing is
        loaded before the engine has checked the list."""
        from colo.transports.wire import layout_key

        specs = list(specs)
        held = self._preflight
        self._preflight_due = None
        if held is not None and specs == held[0]:
            # the same specs as the last accepted list (the same objects, sync after
            # sync, compare at once): its key, without serialising and hashing them again.
            # Equal specs that are other objects (another route's list, the first sync of a
            # plan) are kept in its place, so the next sync's compare is by identity again
            # (a profile of sync-first syncs at Qwen2-1.5B: 338 dataclass compares each)
            self._preflight = (specs, held[1], held[2])
            self._preflight_due = held[2]
            return
        wire = [[s.name, list(s.shape), s.dtype] for s in specs]
        key = layout_key(wire)
        if held is not None and key == held[2]:
            self._preflight = (specs, wire, key)
            self._preflight_due = key
            return
        await self._preflight_whole(specs, wire, key)

    async def _preflight_whole(self, specs: list, wire: list, key: str) -> None:
        self._preflight = None
        await self._call("preflight", specs=wire, key=key)
        self._preflight = (specs, wire, key)

    async def begin_load(self) -> None:
        """Begin a load: sent with the sync's first ``transport_load`` (or before any other
        request), carrying the preflight key that :meth:`preflight` left due. Nothing is
        loaded before the engine has begun and checked the spec list."""
        self._begin_due = True

    async def _with_begin(self, op: str, on_sent: Any, fields: dict) -> dict:
        """``op`` (``begin_load``, or a ``transport_load`` that begins first) with the due
        begin and the spec list's key. An engine that no longer holds that list began
        nothing and loaded nothing: the list goes whole, then the begin, then the load
        again."""
        from colo.transports.wire import is_preflight_not_cached

        self._begin_due = False
        key, self._preflight_due = self._preflight_due, None
        begin = {"preflight_key": key} if op == "begin_load" else {"begin_load": True, "preflight_key": key}
        try:
            return await self._call(op, on_sent=on_sent, **begin, **fields)
        except EngineError as e:
            if key is None or not is_preflight_not_cached(e):
                raise
        await self._resend_preflight()
        await self._call("begin_load")
        return {} if op == "begin_load" else await self._call(op, on_sent=on_sent, **fields)

    async def _resend_preflight(self) -> None:
        # the engine no longer holds the list it was named by key (it was restarted, or
        # another list replaced it): send it whole
        held = self._preflight
        if held is None:
            raise RuntimeError("begin_load: a preflight key was due with no spec list behind it")
        await self._preflight_whole(*held)

    async def transport_init(self, transport: str, init_info: dict) -> None:
        """Build the engine's receiver for ``transport`` (a broadcast receiver joins the group here)."""
        await self.call("transport_init", transport=transport, init_info=init_info)

    async def transport_load(self, transport: str, request: dict, on_sent: Any = None, *, end: bool = False,
                             flush_cache: bool = False) -> dict:
        """One request through the transport's receiver into the engine's parameters;
        ``end``: the sync's last, which ends the load too (and flushes the prefix cache
        with ``flush_cache``): its reply says ``ended``."""
        reply = await self.call("transport_load", transport=transport, request=request, on_sent=on_sent,
                                **({"end_load": True, **self._end_fields(flush_cache)} if end else {}))
        return self._ended(reply)

    async def transport_close(self, transport: str) -> None:
        await self.call("transport_close", transport=transport)

    async def end_load(self, flush_cache: bool = False) -> None:
        self._ended(await self.call("end_load", **self._end_fields(flush_cache)))

    def _end_fields(self, flush_cache: bool) -> dict:
        """What a load's end carries: the flush where asked, and the digest where one was asked
        since the last end (the scheduler verifies every sync, or the first)."""
        fields = {"flush_cache": bool(flush_cache)}
        if self._ends_with_digest and self._digest_wanted:
            self._digest_wanted = False
            fields["digest"] = True
        return fields

    def _ended(self, reply: dict) -> dict:
        if "digest" in reply:
            self._end_digest = str(reply["digest"])
        return reply

    async def digest(self, order: Sequence[str] | None = None) -> str:
        """The engine's digest (``ForwardedEngine.digest``); right after a load's end that
        answered it, that answer, with no request: nothing reached the engine in between, so it
        is what the engine would answer now, its sums of the weights it wrote (the load's end
        answering it took the engine 0.5-1.1 ms where a request of its own took 1.3-2.4 ms at
        Qwen2-1.5B on an H200, issue 44). The next load's end is asked for it again."""
        self._digest_wanted = True
        held, self._end_digest = self._end_digest, None
        if order is None and held is not None:
            return held
        return await super().digest(order)

    async def live_digest(self) -> str:
        """The digest of the weights the engine holds now, read from them by a request of its own
        that asks nothing of the next load: neither that it sum what it writes nor that its end
        answer a digest. The scheduler takes it beside the trainer's offload, where the engine is
        idle (:meth:`colo.scheduler.Scheduler._digests_beside_offload`): a sync-first load that
        summed its bytes and an end that read them back were what verifying added to the sync
        (0.16-0.52 of it at Qwen2-1.5B on an H200, issue 44)."""
        self._digest_wanted = False
        self._end_digest = None
        return str((await self.call("digest", arm=False))["digest"])

    # -- lifetime --------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.is_alive()

    def kill(self) -> None:
        """Kill the engine process outright (fault injection; a crashed engine)."""
        self.process.kill()

    async def aclose(self, timeout_s: float = 10.0) -> None:
        if self.closed:
            return
        # Shielded: an engine left running after a cancelled run holds memory
        # and a socket nobody will ever answer.
        with anyio.CancelScope(shield=True):
            if process_state(self.process.pid) in ("T", "t"):
                self.process.kill()  # a stopped engine answers no shutdown
            if self.process.is_alive():
                with anyio.move_on_after(timeout_s):
                    try:
                        await self._ch.request("shutdown")
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
            self._rendezvous = None
            self.closed = True
