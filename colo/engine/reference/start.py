"""How a run starts colo's own engine: the registry's ``colo`` entry (:data:`colo.engine.ENGINES`).

- :func:`start`: one engine in a process of its own (``colo demo``, ``colo bench``), in the
  process :func:`begin` started before the trainer was built where a run did;
- :func:`start_rank`: engine rank r of a TP engine spanning the ranks, a child process of
  rank r's worker, begun before the worker built its trainer rank (``colo demo --gpus N``;
  the Ray launcher's form is its own: :func:`colo.ranks.ray_launcher.start_engine_actor`);
- :func:`check_tp` and :func:`check_fits`: its limits that depend on the model (a TP size
  the heads cannot be split into, a KV pool the device cannot hold), refused before
  anything starts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def begin(env: Mapping[str, str] | None = None) -> Any:
    """The engine's process, started now and waiting for its build (``start(..., begun=)``)."""
    from colo.engine.reference.client import EngineClient

    return EngineClient.begin(dict(env) if env else None)


async def start(build: dict, *, task: Any = None, env: Mapping[str, str] | None = None,
                options: Mapping[str, Any] | None = None, seed: int = 0, batch: int = 8, begun: Any = None) -> Any:
    """colo's engine in a process of its own, from ``build`` (``build["checkpoint"]``: a
    safetensors file of the trainer's tensors, or None: empty and stale until a sync); in
    the process :func:`begin` started, where given."""
    from colo.engine.reference.client import EngineClient

    return await EngineClient.spawn(build, task=task, env=dict(env) if env else None, begun=begun)


async def start_rank(host: Any, init_method: str, checkpoint: str | None) -> Any:
    """Engine rank ``host.spec.rank`` of a TP engine over ``host.spec.world_size`` ranks, a
    child process of the rank's worker on the same GPU, joining the engine's TP group at
    ``init_method``; from ``checkpoint`` (every rank reads its shard of it) or empty."""
    from colo.engine.reference.client import EngineClient

    s = host.spec
    build = {**host.engine_build, "checkpoint": checkpoint,
             "tp": {"rank": s.rank, "size": s.world_size, "init_method": init_method, "backend": s.backend}}
    if s.engine_log:
        build["log_path"] = s.engine_log
    # the process the host began for it before building its trainer rank (begin), if any
    begun, host.begun = getattr(host, "begun", None), None
    return await EngineClient.spawn(build, task=host.task, begun=begun)


def check_tp(model_config: Any, n: int) -> None:
    """A TP=n engine must split the heads, KV heads and MLP rows evenly (``TPLayoutError``)."""
    from colo.engine.reference.tp import TPLayout

    TPLayout.from_config(model_config, tp_rank=0, tp_size=n)


def check_fits(model_config: Any, *, dtype: str, total_bytes: int, mem_fraction_static: float) -> None:
    """The engine sizes its KV pool as SGLang does (``KVPoolPlan``: total x mem_fraction_static -
    weights, at least one sequence of maximum length): a pool that cannot exist is refused
    here (``KVPoolTooSmall``), not by an engine that dies while starting."""
    from colo.dtypes import as_dtype
    from colo.engine.reference.dims import dims_from_config
    from colo.engine.reference.kvpool import KVPoolPlan
    from colo.engine.reference.weights import WeightMap

    dims = dims_from_config(model_config)
    torch_dtype = as_dtype(dtype)
    KVPoolPlan(total_bytes=total_bytes, mem_fraction_static=mem_fraction_static,
               weight_bytes=WeightMap.build(dims).nbytes(torch_dtype), slot_bytes=dims.slot_bytes(torch_dtype),
               min_slots=dims.max_positions)


__all__ = ["begin", "check_fits", "check_tp", "start", "start_rank"]
