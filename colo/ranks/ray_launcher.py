"""Ranks as Ray actors: one placement-group bundle per GPU, two actors per bundle.

``colo demo --launcher ray --gpus N`` asks :func:`spawn_workers` for its N
workers instead of starting local processes (:class:`colo.ranks.proxy.Worker`).
What each process holds:

- the driver (where ``colo demo`` runs): the scheduler, one memory ledger per
  GPU and one trace per rank; it talks to each rank through a
  :class:`RayWorker`, whose surface is the process worker's (``rank``,
  ``closed``, ``call``, ``aclose``), so the proxies, the groups and the
  scheduler are unchanged;
- bundle r (``{"GPU": 1, "CPU": k}``, or ``{"CPU": k}`` on a CPU cluster),
  shared by two actors with half of it each (``num_gpus=0.5``): the
  :class:`RankActor` hosting a :class:`~colo.ranks.host.RankHost` — trainer
  rank r — and the :class:`EngineActor` holding engine rank r (an
  :class:`~colo.engine.reference.server.EngineServer`). Both are scheduled with
  ``PlacementGroupSchedulingStrategy(placement_group_bundle_index=r)``, so they
  share GPU r and its host.

The rank actor creates its engine actor, and so owns it: Ray kills an actor
whose owner died, so the engine rank goes with its trainer rank however that
actor ends, and a dead engine rank is replaced where the process launcher
replaces it (``RankHost.op_replace_engine``, every rank at once: a TP group
cannot take one new member), in the same bundle. The trainer actor asks its
engine actor directly, in the engine channel's own JSON frames (the requests,
the bucket handles); the handles name ``/dev/shm`` segments or CUDA IPC
memory of their shared host and never pass through the driver, which sees
only the verbs, the stage records and the digests. A transport whose buckets go
through Ray Direct Transport (``rdt``) gets :class:`TensorRankActor` and
:class:`TensorEngineActor` instead, declared with tensor transport: a request then
carries a ref beside its frame, and Ray moves the ref's tensors between the two
actors out of band.

The engine ranks start from the trainer's weights without a file: every
trainer rank already holds the full state after the start-up gather
(``hf_state`` is a collective), serializes it as safetensors bytes and puts it
in Ray's object store on its own node, where its engine actor reads it. A
checkpoint file in the driver's temporary directory would not exist on
another node; building the weights again from the seed would need the
trainer's own model code (Megatron's initialisation is not the engine's).

Rendezvous: the trainer's and the engine's process groups meet at rank 0's
node. Before ``start`` and before an engine TP group restarts, the launcher
asks the rank-0 actor for its node's IP (Ray's ``get_node_ip_address``) and
free ports there: the driver's ``127.0.0.1`` holds only on that node.

Ops run one at a time per actor, in the order the driver sent them
(``max_concurrency=1``; the driver also holds a lock per rank): every rank
then issues its collectives in the same order.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import anyio
import ray
from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from colo.proc.channel import _LEN, MAX_FRAME, ChannelError, decode, encode
from colo.engine.reference.client import DEATH_WAIT_S, EngineClient
from colo.proc.handles import SHM_DIR
from colo.proc.lifecycle import end_processes_in, make_short_dir, owner_alive, process_state, release_dir, sweep
from colo.core.errors import ClusterUnreachable, EngineDied, EngineError, EngineRefused, RankDied, UsageError
from colo.ranks.address import check_reachable, parse_address

#: building a rank (a model, two process groups, an engine) takes minutes on a busy host
START_TIMEOUT_S = 600.0
#: how long a cluster may take to find room for every bundle
PLACEMENT_TIMEOUT_S = 120.0
STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")
#: the actors on one bundle: the trainer rank's and the engine rank's, each half of it
ACTORS_PER_BUNDLE = 2
#: after ``ray.kill`` (asynchronous), how long to wait for the engine actor's process to end
KILL_WAIT_S = 10.0
#: how long the driver waits for a dead rank actor's process to end and its segments to be free
SWEEP_AFTER_DEATH_S = 5.0


def bundles_for(n: int, *, gpu: bool, cpus_per_rank: float = 1) -> list[dict[str, float]]:
    """One bundle per rank: the rank's GPU (if any) and its CPUs."""
    if n < 1:
        raise ValueError(f"a placement needs at least one rank, got {n}")
    return [{"GPU": 1, "CPU": cpus_per_rank} if gpu else {"CPU": cpus_per_rank} for _ in range(n)]


async def reserve(bundles: list[dict[str, float]], *, strategy: str = "PACK",
                  timeout_s: float = PLACEMENT_TIMEOUT_S) -> Any:
    """A placement group holding ``bundles``, ready; a clear error naming the bundles not placed.

    ``PACK`` puts the bundles on as few nodes as possible (one, when it holds
    them all) and spreads them over more when one cannot; ``STRICT_PACK``
    refuses to.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"placement strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    pg = placement_group(bundles, strategy=strategy, name=f"colo-{uuid.uuid4().hex[:8]}")
    try:
        with anyio.fail_after(timeout_s):
            await pg.ready()
    except TimeoutError:
        with anyio.CancelScope(shield=True):
            table = placement_group_table(pg)
            remove_placement_group(pg)
        placed = table.get("bundles_to_node_id") or {}  # an unplaced bundle maps to ""
        missing = [f"bundle {i} {b}" for i, b in enumerate(bundles) if not placed.get(i)]
        state = (table.get("stats") or {}).get("scheduling_state", table.get("state"))
        raise RankDied(f"Ray could not place {', '.join(missing)} ({strategy}, {state}) within "
                       f"{timeout_s:.0f} s; the cluster has {ray.cluster_resources()}") from None
    except BaseException:
        with anyio.CancelScope(shield=True):
            remove_placement_group(pg)
        raise
    return pg


def placement() -> dict:
    """Where Ray says the calling actor runs: its node, its placement group, the bundles it draws on.

    The bundle comes from the resources Ray charged the actor (``CPU_group_<i>_<pg id>``,
    the core worker's own record; ``get_assigned_resources`` strips the index), not from
    what the launcher asked for."""
    ctx = ray.get_runtime_context()
    pg = ctx.get_placement_group_id()
    bundles: set[int] = set()
    try:
        charged = ray._private.worker.global_worker.core_worker.resource_ids()
    except Exception:  # a private call: a Ray without it reports no bundle rather than failing
        charged = {}
    for key in charged:
        head, sep, tail = key.partition("_group_")
        index, sep2, pg_id = tail.partition("_")
        if sep and sep2 and head != "bundle" and index.isdigit() and pg_id == pg:
            bundles.add(int(index))
    return {"node_id": ctx.get_node_id(), "placement_group_id": pg, "bundles": sorted(bundles), "pid": os.getpid()}


# -- the engine rank's actor --------------------------------------------------------
class EngineActor:
    """Engine rank r on bundle r: an :class:`~colo.engine.reference.server.EngineServer` whose requests
    are the engine channel's JSON frames, sent by the trainer rank's actor on the same bundle.

    Frames, not Python objects: the engine validates them as it validates its socket's
    (strict JSON, bounded depth, no NaN), and a bucket's handle is rebuilt only by the
    allow-listed ``colo.proc.handles.open_handle``, whatever carried the frame."""

    def __init__(self) -> None:
        self.server: Any = None

    def start(self, build: dict, state: bytes | None) -> dict:
        """Build the engine rank (joining its TP group: every rank at once) from ``state``,
        safetensors bytes of the trainer's weights, or empty and stale when None."""
        from colo.engine.reference.server import EngineServer, build_core, check_build, use_engine_threads

        check_build(build)  # before the group is joined or the state read (EngineRefused: exit 2)
        use_engine_threads(build)  # on the CPU one: N trainer ranks and N engine ranks share the host's cores
        from colo.proc.lifecycle import open_log

        open_log(build.get("log_path"))  # else Ray's worker log
        init = None
        if state is not None:
            from safetensors.torch import load

            init = load(state)
        self.server = EngineServer(build_core(build, init_state=init))
        del init
        reply = self.server.handle({"id": 0, "op": "hello"})
        return {**reply, **placement()}

    def request(self, frame: bytes) -> bytes:
        from colo.proc.lifecycle import log

        try:
            msg = decode(_unframe(frame))
        except ChannelError as e:  # answered and logged, as on the socket: the engine serves on
            log("channel.rejected_frame", reason=str(e))
            return encode({"id": None, "ok": False, "error_type": "ChannelError", "error": str(e)})
        return self.server.reply_bytes(msg)

    def where(self) -> dict:
        return placement()


class TensorEngineActor(EngineActor):
    """An :class:`EngineActor` whose requests may carry tensors beside their frame, moved out
    of band by Ray Direct Transport (the ``rdt`` transport's buckets): the actor is declared
    with tensor transport, so Ray receives an object's tensors on its ``_ray_system``
    thread before the task that takes them runs."""

    def request_tensors(self, frame: bytes, tensors: list) -> bytes:
        """One request whose bucket is ``tensors`` (Ray resolved the ref the sender passed:
        the tensors themselves, received out of band), for the transport's receiver."""
        from colo.transports.rdt import arrived

        with arrived(tensors):
            return self.request(frame)

    def rdt_state(self) -> dict:
        """What this process holds of the rdt transport (pair groups): the tests' look inside."""
        from colo.transports.rdt import process_state

        return process_state()


# Ray's actor classes; the plain classes above are their bodies. Tensor transport is declared
# on the class (Ray reads ``enable_tensor_transport`` and the concurrency groups when it
# decorates, never from ``.options()``), and it runs every task of the actor off its main
# thread: only a run whose transport moves tensors through Ray gets the tensor classes.
#: the engine actor's plain class, for an engine whose actor is this one with another server
#: (:class:`colo.ranks.ray_vllm.VllmEngineActor`)
EngineActorBody = EngineActor
EngineActor = ray.remote(max_concurrency=1)(EngineActor)
TensorEngineActor = ray.remote(max_concurrency=1, enable_tensor_transport=True)(TensorEngineActor)


def _unframe(frame: bytes) -> bytes:
    """The body of one channel frame (``encode``'s length prefix checked and removed)."""
    if not isinstance(frame, bytes) or len(frame) < _LEN.size:
        raise ChannelError("frame must be bytes with a length prefix")
    (n,) = _LEN.unpack(frame[:_LEN.size])
    if n > MAX_FRAME or n != len(frame) - _LEN.size:
        raise ChannelError(f"frame length {n} does not match its {len(frame) - _LEN.size} B body")
    return frame[_LEN.size:]


class _ActorProcess:
    """The engine actor as ``EngineClient`` sees its process: a pid on this node (the
    engine actor shares this actor's bundle, hence its host), alive, killed."""

    def __init__(self, actor: Any, pid: int, name: str):
        self.actor, self.pid, self.name = actor, int(pid), name
        self.exitcode: int | None = None
        #: Ray said the actor died (a call failed with ActorDiedError)
        self.dead = False
        #: this side asked Ray to kill it
        self.killed = False

    def is_alive(self) -> bool:
        return not self.dead and process_state(self.pid) not in (None, "Z", "X")

    def kill(self) -> None:
        self.killed = True
        _kill(self.actor)


#: the request field that carries a ref beside the frame (:meth:`ActorEngineClient.transport_load`)
OUT_OF_BAND = "_tensors_ref"


class _ActorChannel:
    """``AsyncChannel.request`` over the engine actor: one ``request.remote`` per request."""

    def __init__(self, proc: _ActorProcess):
        self._proc = proc

    async def request(self, op: str, *, on_sent: Any = None, **fields: Any) -> dict:
        # a ref whose tensors Ray moves to the engine actor out of band (the rdt transport's
        # bucket): beside the frame, never in it (a frame is strict JSON)
        tensors = fields.pop(OUT_OF_BAND, None)
        frame = encode({"id": 0, "op": op, **fields})
        try:
            if tensors is None:
                ref = self._proc.actor.request.remote(frame)
            else:
                ref = self._proc.actor.request_tensors.remote(frame, tensors)
            if on_sent is not None:
                on_sent()
            reply = await ref
        except RayActorError as e:
            if isinstance(e, ActorDiedError):
                self._proc.dead = True
            raise ChannelError(f"engine actor {self._proc.name} is gone: {type(e).__name__}: "
                               f"{_first_line(e)}") from e
        return decode(_unframe(reply))

    async def aclose(self) -> None:
        """Nothing to close: the actor is killed by its client."""


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else ""


class ActorEngineClient(EngineClient):
    """An :class:`~colo.engine.reference.client.EngineClient` whose engine is an :class:`EngineActor`:
    the same verbs, heartbeat and errors (a dead actor is ``EngineDied``)."""

    @property
    def name(self) -> str:
        return self.process.name

    async def reconnect(self) -> None:
        """Each request is its own call: there is no connection to renew."""

    @property
    def ray_actor(self) -> Any:
        """The engine actor's handle: where a transport through Ray Direct Transport sends."""
        return self.process.actor

    async def transport_load(self, transport: str, request: dict, on_sent: Any = None, *, end: bool = False,
                             flush_cache: bool = False, tensors: Any = None) -> dict:
        """As the engine client's; ``tensors``: a ref whose tensors are the request's bucket, moved
        out of band by Ray (the engine actor must be a :class:`TensorEngineActor`)."""
        if tensors is None:
            return await super().transport_load(transport, request, on_sent, end=end, flush_cache=flush_cache)
        return self._ended(await self.call("transport_load", transport=transport, request=request, on_sent=on_sent,
                                           **({"end_load": True, **self._end_fields(flush_cache)} if end else {}),
                                           **{OUT_OF_BAND: tensors}))

    async def _call(self, op: str, *, on_sent: Any = None, **fields: Any) -> dict:
        # the wire-level request (EngineClient.call adds the deferred begin on top)
        if self.closed:
            raise EngineDied(f"engine actor {self.name} is closed: cannot {op}")
        if self.process.killed:
            # ray.kill is asynchronous: a request sent now could still be served;
            # a killed engine serves nothing more, as a SIGKILLed process would not
            await self._died(KILL_WAIT_S)
        try:
            reply = await self._request(op, on_sent, fields)
        except ChannelError as e:
            if not await self._died(DEATH_WAIT_S):
                raise
            cause = e.__cause__ if isinstance(e.__cause__, RayActorError) else e
            raise EngineDied(f"engine actor {self.name} (pid {self.process.pid}) died during {op}"
                             f"{', killed by ray.kill' if self.process.killed else ''}: "
                             f"{type(cause).__name__}: {_first_line(cause)}") from e
        if not reply.get("ok"):
            raise EngineError(op, reply.get("error_type", "?"), reply.get("error", ""))
        return reply

    async def _died(self, wait_s: float) -> bool:
        with anyio.CancelScope(shield=True), anyio.move_on_after(wait_s):
            while self.process.is_alive():
                await anyio.sleep(0.05)
        return not self.process.is_alive()

    async def aclose(self, timeout_s: float = 10.0) -> None:
        """Shielded: detach the engine's receivers (``shutdown``), then kill the actor
        and wait for its process to end."""
        if self.closed:
            return
        with anyio.CancelScope(shield=True):
            if self.process.is_alive() and process_state(self.process.pid) not in ("T", "t"):
                with anyio.move_on_after(timeout_s):
                    try:
                        await self._ch.request("shutdown")
                    except Exception:
                        pass
            self.process.kill()
            await self._died(timeout_s)
            self.closed = True


async def spawn_engine_actor(build: dict, *, state: Any, pg: Any, bundle: int, name: str, gpu: bool,
                             cpus: float, task: Any = None, tensors: bool = False,
                             start_timeout_s: float = START_TIMEOUT_S, actor_class: Any = None) -> Any:
    """Engine rank ``build["tp"]["rank"]`` as an :class:`EngineActor` on bundle ``bundle`` of ``pg``
    (half its CPUs and GPU), started from ``state`` (an object ref of safetensors bytes, or
    None: empty and stale); its client. ``tensors``: a :class:`TensorEngineActor`, for a
    transport through Ray Direct Transport; ``actor_class``: another engine's actor class
    (an ``EngineActorBody`` with its own ``start``). A failed start kills the actor."""
    options: dict[str, Any] = {
        "name": name, "num_cpus": cpus, "max_restarts": 0,
        "scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group=pg,
                                                                placement_group_bundle_index=bundle)}
    if gpu:
        options["num_gpus"] = 1 / ACTORS_PER_BUNDLE
    actor = (actor_class or (TensorEngineActor if tensors else EngineActor)).options(**options).remote()
    try:
        with anyio.fail_after(start_timeout_s):
            hello = await actor.start.remote(build, state)
    except BaseException as e:
        with anyio.CancelScope(shield=True):
            _kill(actor)
        if isinstance(e, TimeoutError):
            raise EngineDied(f"engine actor {name} did not start within {start_timeout_s:g} s (killed it)") from None
        if isinstance(e, RayActorError):
            raise EngineDied(f"engine actor {name} died while starting: {_first_line(e)}") from e
        if isinstance(e, ray.exceptions.RayTaskError):
            cause = e.cause if isinstance(getattr(e, "cause", None), Exception) else e
            if isinstance(cause, EngineRefused):  # the build's fault, as a process engine says it
                raise EngineRefused(str(cause)) from None
            raise EngineDied(f"engine actor {name} failed while starting: {type(cause).__name__}: "
                             f"{_first_line(cause)}") from e
        raise
    proc = _ActorProcess(actor, hello["pid"], name)
    return ActorEngineClient(_ActorChannel(proc), proc, None, None, hello, task)


async def start_engine_actor(host: Any, init_method: str, checkpoint: Any) -> Any:
    """colo's engine rank ``host.spec.rank`` as an :class:`EngineActor` on the rank's bundle:
    the ``ray`` rank start of the registry's ``colo`` entry (:data:`colo.engine.ENGINES`).
    ``checkpoint``: the trainer's weights in this node's object store, or None (empty)."""
    s, p = host.spec, host.ray_placement
    # the start-up state is not kept: once the engine has it, the object store may free it
    host.engine_build["checkpoint"] = None
    build = {**host.engine_build, "checkpoint": None,
             "tp": {"rank": s.rank, "size": s.world_size, "init_method": init_method, "backend": s.backend}}
    p["engines"] = p.get("engines", 0) + 1
    return await spawn_engine_actor(build, state=checkpoint, pg=p["pg"], bundle=s.rank,
                                    name=f"colo-engine{s.rank}-{p['token']}-{p['engines']}", gpu=p["gpu"],
                                    cpus=p["cpus"], task=host.task, tensors=p.get("tensors") is True)


class _EngineActors:
    """Mixed into the rank's host class: engine rank r is an :class:`EngineActor` on this
    actor's bundle, started from the trainer's weights through the object store."""

    ray_placement: dict

    def _initial_checkpoint(self) -> Any:
        from safetensors.torch import save

        state = self.trainer.hf_state()  # a collective: every rank calls it, every rank gets the whole
        data = save({k: v.detach().contiguous().cpu() for k, v in state.items()})
        del state
        # in this node's object store; read by this rank's engine actor, on the same node
        return ray.put(data)

    #: the rank start of the engine's registry entry this host uses (``rank_start["ray"]``)
    launcher = "ray"

    def hello(self) -> dict:
        return {**super().hello(), "engine_actor": self.engine.name}


# -- the trainer rank's actor -------------------------------------------------------
class RankActor:
    """One rank on its bundle: a :class:`~colo.ranks.host.RankHost` (its engine rank an
    :class:`EngineActor` on the same bundle), its ops as data."""

    def __init__(self) -> None:
        self.host: Any = None
        #: the groups' stores this actor serves (rank 0's), kept while it lives
        self.stores: list[Any] = []

    def rendezvous(self, n: int = 2) -> list[str]:
        """``n`` new groups' init methods, at stores this actor serves on its node (rank
        0's: where the groups meet; colo.proc.rendezvous) for as long as it lives."""
        from colo.proc.rendezvous import HostedStore

        ip = ray.util.get_node_ip_address()  # the address the other nodes' ranks are told
        stores = [HostedStore(None, host=ip) for _ in range(n)]
        self.stores.extend(stores)
        return [st.init_method for st in stores]

    def setup(self, spec: dict, where: dict) -> dict:
        """``where``: the placement group, this rank's share of a bundle, the run's token."""
        from colo.ranks.host import RankHost, RankSpec, load_object

        rank_spec = RankSpec(**spec)
        base = load_object(rank_spec.host_class) if rank_spec.host_class else RankHost
        host_class = type(f"Ray{base.__name__}", (_EngineActors, base), {})
        self.host = host_class(rank_spec)
        self.host.ray_placement = dict(where)
        return placement()

    async def handle(self, op: str, fields: dict) -> dict:
        # the process worker's answer: {"ok": True, ...} or the error as data
        from colo.ranks.worker import _answer

        return await _answer(self.host, {"id": None, "op": op, **fields})

    def where(self) -> dict:
        return placement()


#: the rank actor's concurrency group for the tasks that hand its staged buckets to Ray: its
#: main group runs one op at a time, and the sync that stages them is that op
TENSOR_GROUP = "colo_tensors"


class TensorRankActor(RankActor):
    """A :class:`RankActor` whose transport hands its buckets to its engine actor through Ray
    Direct Transport (``rdt``): declared with tensor transport, its engine actor a
    :class:`TensorEngineActor`."""

    def setup(self, spec: dict, where: dict) -> dict:
        from colo.transports.rdt import register_ray_transports

        # before the engine actor exists: Ray hands the registrations to the actors this
        # process creates afterwards (Ray's documented order)
        register_ray_transports()
        return super().setup(spec, where)

    @ray.method(concurrency_group=TENSOR_GROUP)
    def rdt_tensors(self, key: int) -> list:
        """The bucket the transport staged under ``key``; called by the transport on this very
        actor with ``.options(tensor_transport=...)``, so Ray keeps the returned tensor here
        and moves it out of band to the actor that gets the ref
        (:data:`colo.transports.rdt.SOURCE_METHOD`)."""
        from colo.transports.rdt import take_outgoing

        return take_outgoing(key)

    def rdt_state(self) -> dict:
        """What this process holds of the rdt transport (pair groups, pairs, staged buckets)."""
        from colo.transports.rdt import process_state

        return process_state()


RankActor = ray.remote(max_concurrency=1)(RankActor)
TensorRankActor = ray.remote(max_concurrency=1, enable_tensor_transport=True,
                             concurrency_groups={TENSOR_GROUP: 1})(TensorRankActor)


class _Launch:
    """What one :func:`spawn_workers` reserved: its placement group, and Ray itself if it
    started it (a local cluster of its own, or its connection to one at ``--address``)."""

    def __init__(self, pg: Any, ray_init: Any, n: int):
        self.pg, self.ray_init, self.open = pg, ray_init, n

    def release_one(self) -> None:
        self.open -= 1
        if self.open == 0:
            self.release()

    def release(self) -> None:
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None
        if self.ray_init is not None:
            self.ray_init.stop()
            self.ray_init = None


class RayWorker:
    """One rank's actor, from the driver (the surface of :class:`colo.ranks.proxy.Worker`)."""

    def __init__(self, rank: int, actor: Any, launch: _Launch, name: str, where: dict | None = None):
        self.rank, self.actor, self.name, self._launch = rank, actor, name, launch
        #: the actor's process and node (:func:`placement`)
        self.where = dict(where or {})
        self._lock = anyio.Lock()
        self.closed = False
        self._released = False
        #: Ray said the actor died (a call failed with RayActorError)
        self.died = False

    async def call(self, op: str, **fields: Any) -> dict:
        from colo.ranks.proxy import rebuild_error

        if self.closed:
            raise RankDied(f"rank {self.rank} actor {self.name} is closed: cannot {op}")
        async with self._lock:  # one request at a time per rank, in order
            try:
                reply = await self.actor.handle.remote(op, fields)
            except RayActorError as e:
                self.closed = self.died = True  # nothing more can be asked of it; aclose still releases it
                # unlike an engine rank, a trainer rank is not replaced: its weights and
                # optimizer exist nowhere else (that needs a trainer checkpoint)
                raise RankDied(f"rank {self.rank} actor {self.name} (trainer rank {self.rank}) is gone during "
                               f"{op}: {type(e).__name__}: {_first_line(e)}; a dead trainer rank is not "
                               "replaced (its weights and optimizer state exist nowhere else)") from e
        if not reply.get("ok"):
            raise rebuild_error(self.rank, op, reply)
        return reply

    async def rendezvous(self) -> str:
        """A new group's init method, at a store this rank's actor serves on its node."""
        async with self._lock:
            try:
                inits = await self.actor.rendezvous.remote(1)
            except RayActorError as e:
                self.closed = self.died = True
                raise RankDied(f"rank {self.rank} actor {self.name} is gone: {_first_line(e)}") from e
        return inits[0]

    async def aclose(self, timeout_s: float = 30.0) -> None:
        """Shielded: ask the rank to close its host (its engine actor too), then kill the
        actor; the last one out removes the placement group (and stops Ray if the
        launcher started it)."""
        if self._released:
            return
        with anyio.CancelScope(shield=True):
            if not self.closed:
                with anyio.move_on_after(timeout_s):
                    try:
                        await self.call("shutdown")
                    except Exception:
                        pass  # killed below either way; its engine actor dies with it
            _kill(self.actor)
            self.closed = self._released = True
            if self.died:
                await anyio.to_thread.run_sync(self._sweep_after_death)
            self._launch.release_one()

    def _sweep_after_death(self) -> None:
        """What a rank actor that died left in ``/dev/shm``: the staging segments it had made
        and not yet handed to its engine actor (or whose engine actor was killed with it).

        A rank worker's engine rank is its child and sweeps them as an orphan
        (:func:`colo.proc.lifecycle.remove_run_dir_if_orphaned`); an engine actor is not
        the rank actor's child, and Ray kills it as its owner's death is known, so
        the driver does: with :func:`colo.proc.lifecycle.sweep`, which removes only what
        nobody holds the lock of (the dead actor's went with it), as the next run's
        start-up would. Only on the driver's node, where its /dev/shm is this one: an
        actor on another node leaves its segments to the next run started there."""
        pid, node = self.where.get("pid"), self.where.get("node_id")
        if not pid or node is None or node != ray.get_runtime_context().get_node_id():
            return
        deadline = time.monotonic() + SWEEP_AFTER_DEATH_S
        while owner_alive(pid) and time.monotonic() < deadline:  # Ray's word can come first
            time.sleep(0.05)
        prefix = f"colo-{pid}-"
        sweep()
        # a lock can outlive its maker by a moment (a process it forked, still ending)
        while time.monotonic() < deadline and any(n.startswith(prefix) for n in _shm_names()):
            time.sleep(0.1)
            sweep()


def _shm_names() -> list[str]:
    try:
        return os.listdir(SHM_DIR)
    except OSError:
        return []


def _kill(actor: Any) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception:
        pass  # already gone


class _NoSigtermWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "SIGTERM handler is not set" not in record.getMessage()


_NO_SIGTERM_WARNING = _NoSigtermWarning()  # one instance: addFilter adds it once


#: how long ``ray.init`` may take to join a cluster at ``--address`` (Ray's own limit is 20
#: rounds of about 30 s): a cluster that accepts a TCP connection and then says nothing
RAY_INIT_TIMEOUT_S = 60.0
#: how long a stopped run waits for the ``ray.init`` of its own local cluster to end before it
#: ends that cluster's processes itself (it takes seconds; Ray bounds its own start-up)
LOCAL_INIT_WAIT_S = 120.0


async def _ensure_ray(address: str | None) -> _RayInit | None:
    """Ray initialised (an existing session is reused); what this call started, or None.

    Joining a cluster at ``address`` is bounded: its form is checked, then a TCP connect to
    it (:mod:`colo.ranks.address`), then ``ray.init`` for at most :data:`RAY_INIT_TIMEOUT_S`;
    each failure is one error naming the address. Without an address (nor ``RAY_ADDRESS``,
    which Ray would join), the run starts a local cluster of its own (:class:`_RayInit`)."""
    if ray.is_initialized():
        return None
    with _signals_kept():
        return await _init_ray(address)


@contextlib.contextmanager
def _signals_kept() -> Iterator[None]:
    """SIGTERM stays the driver's (:func:`colo.apps.demo.run_until_signalled`'s clean stop).

    ``ray.init`` on the main thread sets a SIGTERM handler of its own (``sys.exit(15)``,
    which raised out of the event loop), and its core worker, on any thread, installs a
    native one over it that prints a stack dump first: a ``--launcher ray`` run stopped
    by SIGTERM exited 15 (or aborted) with that dump, its traces in a bare ``failed``
    phase. ``ray.init`` now runs off the main thread (:class:`_RayInit`), which also puts
    the native one back; this puts the driver's back at the Python level too."""
    if threading.current_thread() is not threading.main_thread():
        yield  # no handler can be set off the main thread: there is none of ours to keep
        return
    before = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        if before is not None:  # None: a handler not set from Python, which cannot be put back
            signal.signal(signal.SIGTERM, before)


def _sigaction_of(signum: int) -> Any:
    """The process's whole ``struct sigaction`` for ``signum``, opaque (None without libc's
    ``sigaction``): put back as it was by :func:`_set_sigaction`, whatever was installed over it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        buf = ctypes.create_string_buffer(_SIGACTION_BYTES)
        return (libc, buf) if libc.sigaction(signum, None, buf) == 0 else None
    except (OSError, AttributeError):
        return None


#: larger than any libc's ``struct sigaction`` (152 bytes on glibc's x86-64 and aarch64)
_SIGACTION_BYTES = 1024


def _set_sigaction(signum: int, saved: Any) -> None:
    if saved is not None:
        libc, buf = saved
        libc.sigaction(signum, buf, None)


def _ray_socket_suffix() -> str:
    """What Ray puts after its temp dir in its longest AF_UNIX path:
    ``/session_<%Y-%m-%d_%H-%M-%S_%f>_<pid>/sockets/plasma_store`` (``ray._private.node``:
    the session is named for the process that starts the cluster, this one; the raylet's
    socket, ``sockets/raylet``, is shorter)."""
    return f"/session_0000-00-00_00-00-00_000000_{os.getpid()}/sockets/plasma_store"


class _RayInit:
    """``ray.init`` on a thread of its own (``colo-ray-init``), which lives until :meth:`stop`.

    Off the main thread because of SIGTERM: on the main thread ``ray.init`` sets a handler
    of its own first thing (``sys.exit(15)``), so a SIGTERM while it ran exited 15. Off it,
    Ray sets none; its core worker still installs a native one (a stack dump, then the
    handler that was there) at the end of ``ray.init``, and this thread puts the whole
    ``sigaction`` back the moment ``ray.init`` returns (a window of about 2 ms of the
    seconds ``ray.init`` takes, where a SIGTERM still prints Ray's dump before colo's clean
    stop). The thread lives on because the processes of a local cluster are started from
    it with Linux's parent-death signal (``PR_SET_PDEATHSIG``, SIGKILL), which fires when
    the *thread* that started them ends: the GCS and the raylet died with a thread that
    only ran ``ray.init``.

    ``own_dir``: the temp dir of a cluster this driver starts, ``ray.init(_temp_dir=...)``.
    Not Ray's default, ``$TMPDIR/ray/session_<date>_<pid>``, for what a user of Ray expects
    of a cluster that lives and dies with one run: that it starts in whatever TMPDIR the
    user has (Ray's sockets live under the session dir, and an AF_UNIX path is at most 107
    bytes: with Ray's default, a TMPDIR of 42 characters already failed ``ray.init``), and
    that nothing of it outlives the run (Ray's default dir is shared by every Ray on the
    machine and kept after each run: every run left a session dir). colo's
    ``colo-ray-<pid>-XXXXXXXX`` (:func:`colo.proc.lifecycle.make_short_dir`) is in
    ``$RAY_TMPDIR`` when the user set it (Ray's own choice of place, often a large disk for
    spilled objects), else ``$TMPDIR``, else the first short dir where Ray's sockets fit
    (``/tmp``, as for the engine's socket); the driver holds its lock while it lives and
    removes it with the cluster (:meth:`stop`), and after a SIGKILL the next run's
    start-up sweep ends the cluster's processes and removes it
    (:func:`colo.proc.lifecycle.sweep`). Refusing a long TMPDIR instead would ask the user
    to change an environment that works for everything else."""

    def __init__(self, kwargs: dict, own_dir: str | None = None):
        self.kwargs, self.dir = kwargs, own_dir
        self.error: BaseException | None = None
        self._up, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="colo-ray-init", daemon=True)

    @classmethod
    def local(cls, kwargs: dict) -> _RayInit:
        """A cluster of this driver's own, in a dir of its own (see the class)."""
        try:
            own = make_short_dir("ray", _ray_socket_suffix(), first=os.environ.get("RAY_TMPDIR"))
        except OSError as e:
            raise UsageError(f"no directory for a local Ray cluster: {e.strerror or e}") from None
        return cls({**kwargs, "_temp_dir": own}, own)

    def _run(self) -> None:
        saved = _sigaction_of(signal.SIGTERM)
        try:
            ray.init(**self.kwargs)
        except BaseException as e:  # handed to the waiting side
            self.error = e
        finally:
            _set_sigaction(signal.SIGTERM, saved)
            self._up.set()
        self._stop.wait()

    def begin(self) -> None:
        # Off the main thread Ray sets no SIGTERM handler of its own (colo's signal handling
        # stays) and says so in a warning per run, which is not the user's concern: dropped.
        logging.getLogger("ray._private.worker").addFilter(_NO_SIGTERM_WARNING)
        self._thread.start()

    async def wait(self) -> None:
        while not self._up.is_set():
            await anyio.sleep(0.05)

    async def start_local(self) -> None:
        """Start this driver's own cluster; a failure or a cancellation (SIGINT, SIGTERM)
        leaves nothing of it. ``ray.init`` cannot be stopped midway: a cancelled start waits
        for it (at most :data:`LOCAL_INIT_WAIT_S`), then ends the cluster."""
        self.begin()
        try:
            await self.wait()
        except BaseException:
            with anyio.CancelScope(shield=True):
                with anyio.move_on_after(LOCAL_INIT_WAIT_S):
                    await self.wait()
                self.stop()
            raise
        if self.error is not None:
            # Ray's own error says only which file it waited for ("Timed out waiting for file
            # .../gcs_server_port_..."); why its daemon did not write it is in the daemon's log,
            # which stop() removes with the cluster's dir: its last lines go with the error.
            tail = _ray_start_logs(self.dir)
            if tail:
                self.error.add_note(tail)
            self.stop()
            raise self.error

    def stop(self) -> None:
        """Shut Ray down in this driver; for a cluster of its own, end whatever of it is left
        (the raylet's workers and agents end on their own seconds after it) and remove its dir."""
        if ray.is_initialized():
            ray.shutdown()
        self._stop.set()
        if self.dir is not None:
            end_processes_in(self.dir)
            release_dir(self.dir)
            self.dir = None


def _ray_start_logs(own_dir: str | None, lines: int = 20) -> str:
    """The last ``lines`` lines of the start-up daemons' logs (GCS, raylet) of the cluster in
    ``own_dir``, each file named; '' where there are none."""
    if own_dir is None:
        return ""
    logs = os.path.join(own_dir, "session_latest", "logs")
    out = []
    for name in ("gcs_server.err", "gcs_server.out", "raylet.err", "raylet.out"):
        try:
            with open(os.path.join(logs, name), errors="replace") as f:
                text = f.read().splitlines()[-lines:]
        except OSError:
            continue
        if text:
            out.append(f"Ray's {name} ended:\n" + "\n".join(text))
    return "\n".join(out)


#: the niceness of the workers of a Ray cluster colo starts (Ray's default is 15: see _init_ray)
WORKER_NICENESS = 0


async def _init_ray(address: str | None) -> _RayInit:
    # the dashboard is not needed and costs a core at start-up
    kwargs = {"address": address, "include_dashboard": False, "log_to_driver": False}
    if address is None and not os.environ.get("RAY_ADDRESS"):
        # A cluster of our own: Ray's own start-up limits apply. Its workers run at the niceness
        # of Ray's default, 15, meant for background tasks; here they are the run itself (every
        # rank's trainer and engine), and beside two busy processes of nice 0 a rank actor got
        # about 5 % of a core: a run of seconds took minutes (the 2-core VM under CI's load).
        # A cluster the user runs keeps the niceness its raylet was started with.
        kwargs["_system_config"] = {"worker_niceness": WORKER_NICENESS}
        session = _RayInit.local(kwargs)
        await session.start_local()
        return session
    if address is not None:
        try:
            parse_address(address)
        except ValueError as e:
            raise UsageError(str(e)) from None
        await anyio.to_thread.run_sync(check_reachable, address)
    # the thread is a daemon: ray.init cannot be cancelled, and one given up on must not
    # keep the interpreter from exiting (anyio's worker threads are joined at exit)
    session = _RayInit(kwargs)
    session.begin()
    where = address if address is not None else os.environ.get("RAY_ADDRESS")
    named = f"--address {where!r}" if address is not None else f"RAY_ADDRESS {where!r}"
    try:
        with anyio.fail_after(RAY_INIT_TIMEOUT_S):
            await session.wait()
    except TimeoutError:
        raise ClusterUnreachable(f"no Ray cluster at {where}: ray.init did not connect within "
                                 f"{RAY_INIT_TIMEOUT_S:g} s (is it a Ray head node's GCS address? "
                                 "`ray start --head` prints it)") from None
    e = session.error
    if e is not None:
        session.stop()
        if isinstance(e, ValueError):  # Ray's reading of the address (or its other arguments)
            raise UsageError(f"{named}: {_first_line(e)}") from None
        if isinstance(e, ConnectionError):
            raise ClusterUnreachable(f"no Ray cluster at {where}: {_first_line(e)}") from None
        raise e
    return session


async def spawn_workers(specs: Sequence[Any], *, envs: Sequence[dict[str, str] | None] | None = None,
                        address: str | None = None, strategy: str = "PACK",
                        cpus_per_rank: float = 1) -> list[RayWorker]:
    """Rank r's actor on bundle r (its engine actor joins it there when the rank starts);
    all or none (a failure removes every actor and the group)."""
    started = await _ensure_ray(address)
    gpu = specs[0].device == "cuda"
    tensors = _moves_tensors_through_ray(specs[0].transport)
    launch = _Launch(None, started, len(specs))
    actors: list[Any] = []
    token = uuid.uuid4().hex[:8]
    try:
        launch.pg = await reserve(bundles_for(len(specs), gpu=gpu, cpus_per_rank=cpus_per_rank), strategy=strategy)
        share = {"pg": launch.pg, "token": token, "gpu": gpu, "cpus": cpus_per_rank / ACTORS_PER_BUNDLE,
                 "tensors": tensors}
        for spec in specs:
            env = _actor_env((envs or [None] * len(specs))[spec.rank], gpu)
            actors.append(_place(launch.pg, spec.rank, token, env, gpu=gpu, cpus=share["cpus"], tensors=tensors))
        specs = await _meet_at_rank0(actors[0], specs)
        with anyio.fail_after(START_TIMEOUT_S):
            # submitted together (each imports torch), awaited together
            refs = [actor.setup.remote(spec.to_json(), share) for actor, spec in zip(actors, specs)]
            wheres = [await ref for ref in refs]
    except BaseException:
        with anyio.CancelScope(shield=True):
            for actor in actors:
                _kill(actor)
            launch.release()
        raise
    return [RayWorker(s.rank, a, launch, f"colo-rank{s.rank}-{token}", w) for s, a, w in zip(specs, actors, wheres)]


def _actor_env(env: dict[str, str] | None, gpu: bool) -> dict[str, str]:
    env = dict(env or {})
    if gpu:
        # Ray gives each actor its GPU through CUDA_VISIBLE_DEVICES: the driver's choice
        # (a UUID of a GPU the driver sees) does not hold on another node
        env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def _moves_tensors_through_ray(transport: str) -> bool:
    """Whether ``transport`` hands its buckets between the actors through Ray Direct Transport
    (its strategy says so): then both actors of every rank are tensor actors."""
    from colo.transports import get_strategy

    return getattr(get_strategy(transport), "ray_tensor_transport", False) is True


def _place(pg: Any, rank: int, token: str, env: dict[str, str], *, gpu: bool, cpus: float,
           tensors: bool = False) -> Any:
    options: dict[str, Any] = {
        "name": f"colo-rank{rank}-{token}", "num_cpus": cpus, "max_restarts": 0,
        "scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group=pg,
                                                                placement_group_bundle_index=rank)}
    if gpu:
        options["num_gpus"] = 1 / ACTORS_PER_BUNDLE
    if env:
        options["runtime_env"] = {"env_vars": env}
    return (TensorRankActor if tensors else RankActor).options(**options).remote()


async def _meet_at_rank0(actor0: Any, specs: Sequence[Any]) -> list[Any]:
    """Every spec with the trainer's and the engine's rendezvous on rank 0's node."""
    try:
        with anyio.fail_after(START_TIMEOUT_S):
            trainer_init, engine_init = await actor0.rendezvous.remote(2)
    except (RayActorError, GetTimeoutError) as e:
        raise RankDied(f"rank 0 actor did not start: {type(e).__name__}: {e}") from e
    return [dataclasses.replace(s, trainer_init=trainer_init, engine_init=engine_init) for s in specs]


__all__ = ["PLACEMENT_TIMEOUT_S", "EngineActor", "EngineActorBody", "RankActor", "RayWorker", "TensorEngineActor",
           "TensorRankActor",
           "bundles_for", "placement", "reserve", "spawn_engine_actor", "spawn_workers"]
