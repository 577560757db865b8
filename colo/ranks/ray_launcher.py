"""Ranks as Ray actors: one placement-group bundle per GPU, one actor per bundle.

``colo demo --launcher ray --gpus N`` asks :func:`spawn_workers` for its N
workers instead of starting local processes (:class:`colo.ranks.proxy.Worker`).
What each process holds:

- the driver (where ``colo demo`` runs): the scheduler, one memory ledger per
  GPU and one trace per rank; it talks to each rank through a
  :class:`RayWorker`, whose surface is the process worker's (``rank``,
  ``closed``, ``call``, ``aclose``), so the proxies, the groups and the
  scheduler are unchanged;
- bundle r (``{"GPU": 1, "CPU": k}``, or ``{"CPU": k}`` on a CPU cluster):
  one :class:`RankActor` hosting a :class:`~colo.ranks.host.RankHost` —
  trainer rank r — and, as a child process of that actor, engine rank r.

The engine rank is the actor's child rather than an actor of its own: the
host already starts it as a child process (the same code serves the process
launcher), so it sits in the actor's bundle and sees the actor's GPU without
any scheduling of its own, it dies with its trainer rank however the actor
dies (the engine dies with its parent), and its IPC handles never leave the
GPU's host. A second actor on the same bundle would need fractional
``num_gpus`` and a handle channel between two actors for the same result.

Rendezvous: the trainer's and the engine's process groups meet at rank 0's
node. The driver's addresses (``tcp://127.0.0.1:port``) hold only when the
driver shares rank 0's node, so before ``start`` the launcher asks the rank-0
actor for its node's IP and two free ports there and rebuilds every rank's
spec with them.

Ops run one at a time per actor, in the order the driver sent them
(``max_concurrency=1``; the driver also holds a lock per rank): every rank
then issues its collectives in the same order.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import uuid
from collections.abc import Sequence
from typing import Any

import anyio
import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from colo.errors import RankDied

#: building a rank (a model, two process groups, an engine) takes minutes on a busy host
START_TIMEOUT_S = 600.0
#: how long a cluster may take to find room for every bundle
PLACEMENT_TIMEOUT_S = 120.0
STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")


def bundles_for(n: int, *, gpu: bool, cpus_per_rank: float = 1) -> list[dict[str, float]]:
    """One bundle per rank: the rank's GPU (if any) and its CPUs."""
    if n < 1:
        raise ValueError(f"a placement needs at least one rank, got {n}")
    return [{"GPU": 1, "CPU": cpus_per_rank} if gpu else {"CPU": cpus_per_rank} for _ in range(n)]


async def reserve(bundles: list[dict[str, float]], *, strategy: str = "STRICT_PACK",
                  timeout_s: float = PLACEMENT_TIMEOUT_S) -> Any:
    """A placement group holding ``bundles``, ready; a clear error naming the bundles not placed.

    ``STRICT_PACK`` keeps every rank on one node; ``PACK`` lets them spread over
    nodes when one cannot hold them all.
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


@ray.remote(max_concurrency=1)
class RankActor:
    """One rank on its bundle: a :class:`~colo.ranks.host.RankHost`, its ops as data."""

    def __init__(self) -> None:
        self.host: Any = None

    def rendezvous(self) -> dict:
        """This node's IP and two ports free on it a moment ago (rank 0's: where the groups meet)."""
        ip = ray.util.get_node_ip_address()
        ports = []
        for _ in range(2):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("", 0))
                ports.append(s.getsockname()[1])
        return {"ip": ip, "ports": ports, "pid": os.getpid()}

    def setup(self, spec: dict) -> int:
        from colo.ranks.host import RankHost, RankSpec, load_object

        rank_spec = RankSpec(**spec)
        self.host = (load_object(rank_spec.host_class) if rank_spec.host_class else RankHost)(rank_spec)
        return os.getpid()

    async def handle(self, op: str, fields: dict) -> dict:
        # the process worker's answer: {"ok": True, ...} or the error as data
        from colo.ranks.worker import _answer

        return await _answer(self.host, {"id": None, "op": op, **fields})


class _Launch:
    """What one :func:`spawn_workers` reserved: its placement group, and Ray itself if it started it."""

    def __init__(self, pg: Any, started_ray: bool, n: int):
        self.pg, self.started_ray, self.open = pg, started_ray, n

    def release_one(self) -> None:
        self.open -= 1
        if self.open == 0:
            self.release()

    def release(self) -> None:
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None
        if self.started_ray and ray.is_initialized():
            ray.shutdown()
            self.started_ray = False


class RayWorker:
    """One rank's actor, from the driver (the surface of :class:`colo.ranks.proxy.Worker`)."""

    def __init__(self, rank: int, actor: Any, launch: _Launch, name: str):
        self.rank, self.actor, self.name, self._launch = rank, actor, name, launch
        self._lock = anyio.Lock()
        self.closed = False
        self._released = False

    async def call(self, op: str, **fields: Any) -> dict:
        from colo.ranks.proxy import rebuild_error

        if self.closed:
            raise RankDied(f"rank {self.rank} actor {self.name} is closed: cannot {op}")
        async with self._lock:  # one request at a time per rank, in order
            try:
                reply = await self.actor.handle.remote(op, fields)
            except RayActorError as e:
                self.closed = True  # nothing more can be asked of it; aclose still releases it
                raise RankDied(f"rank {self.rank} actor {self.name} is gone during {op}: "
                               f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
        if not reply.get("ok"):
            raise rebuild_error(self.rank, op, reply)
        return reply

    async def aclose(self, timeout_s: float = 30.0) -> None:
        """Shielded: ask the rank to close its host, then kill the actor; the last one out
        removes the placement group (and stops Ray if the launcher started it)."""
        if self._released:
            return
        with anyio.CancelScope(shield=True):
            if not self.closed:
                with anyio.move_on_after(timeout_s):
                    try:
                        await self.call("shutdown")
                    except Exception:
                        pass  # killed below either way
            _kill(self.actor)
            self.closed = self._released = True
            self._launch.release_one()


def _kill(actor: Any) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception:
        pass  # already gone


def _ensure_ray(address: str | None) -> bool:
    """Ray initialised (an existing session is reused); whether this call started it."""
    if ray.is_initialized():
        return False
    # a local cluster by default; the dashboard is not needed and costs a core at start-up
    ray.init(address=address, include_dashboard=False, log_to_driver=False)
    return True


async def spawn_workers(specs: Sequence[Any], *, envs: Sequence[dict[str, str] | None] | None = None,
                        address: str | None = None, strategy: str = "STRICT_PACK",
                        cpus_per_rank: float = 1) -> list[RayWorker]:
    """One actor per rank on its own bundle; all or none (a failure removes every actor and the group)."""
    started = _ensure_ray(address)
    gpu = specs[0].device == "cuda"
    launch = _Launch(None, started, len(specs))
    actors: list[Any] = []
    try:
        launch.pg = await reserve(bundles_for(len(specs), gpu=gpu, cpus_per_rank=cpus_per_rank), strategy=strategy)
        token = uuid.uuid4().hex[:8]
        for spec in specs:
            env = _actor_env((envs or [None] * len(specs))[spec.rank], gpu)
            actors.append(_place(launch.pg, spec.rank, token, env, gpu=gpu, cpus=cpus_per_rank))
        specs = await _meet_at_rank0(actors[0], specs)
        with anyio.fail_after(START_TIMEOUT_S):
            # submitted together (each imports torch), awaited together
            for ref in [actor.setup.remote(spec.to_json()) for actor, spec in zip(actors, specs)]:
                await ref
    except BaseException:
        with anyio.CancelScope(shield=True):
            for actor in actors:
                _kill(actor)
            launch.release()
        raise
    return [RayWorker(s.rank, a, launch, f"colo-rank{s.rank}-{token}") for s, a in zip(specs, actors)]


def _actor_env(env: dict[str, str] | None, gpu: bool) -> dict[str, str]:
    env = dict(env or {})
    if gpu:
        # Ray gives each actor its GPU through CUDA_VISIBLE_DEVICES: the driver's choice
        # (a UUID of a GPU the driver sees) does not hold on another node
        env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def _place(pg: Any, rank: int, token: str, env: dict[str, str], *, gpu: bool, cpus: float) -> Any:
    options: dict[str, Any] = {
        "name": f"colo-rank{rank}-{token}", "num_cpus": cpus, "max_restarts": 0,
        "scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group=pg,
                                                                placement_group_bundle_index=rank)}
    if gpu:
        options["num_gpus"] = 1
    if env:
        options["runtime_env"] = {"env_vars": env}
    return RankActor.options(**options).remote()


async def _meet_at_rank0(actor0: Any, specs: Sequence[Any]) -> list[Any]:
    """Every spec with the trainer's and the engine's rendezvous on rank 0's node."""
    try:
        with anyio.fail_after(START_TIMEOUT_S):
            where = await actor0.rendezvous.remote()
    except (RayActorError, GetTimeoutError) as e:
        raise RankDied(f"rank 0 actor did not start: {type(e).__name__}: {e}") from e
    ip, (p1, p2) = where["ip"], where["ports"]
    return [dataclasses.replace(s, trainer_init=f"tcp://{ip}:{p1}", engine_init=f"tcp://{ip}:{p2}")
            for s in specs]


__all__ = ["PLACEMENT_TIMEOUT_S", "RankActor", "RayWorker", "bundles_for", "reserve", "spawn_workers"]
