"""vLLM as a Ray actor: engine rank r of ``colo demo --launcher ray --gpus N --engine vllm``.

The registry's ``rank_start["ray"]`` of the ``vllm`` entry (the ``replicas`` layout). Engine
rank r is an actor on rank r's bundle, beside its trainer rank's actor, as colo's own engine
is (:mod:`colo.ranks.ray_launcher`): a whole vLLM in the actor's own process (its engine core
and worker with it: the actor holds no trainer group, so nothing there is vLLM's world but its
own, and killing the actor ends all of vLLM).

Beside colo's own engine actor (:mod:`colo.ranks.ray_launcher`), in the ranks' layer: it is a
rank's engine under Ray, not a part of vLLM's adapter. It speaks the frames colo's engine
speaks: :class:`VllmServer` answers the engine channel's ops (``hello``, the verbs, the
receiving half) from a :class:`~colo.engine.vllm.VllmEngine`,
and :class:`VllmEngineActor` is :class:`~colo.ranks.ray_launcher.EngineActor` with that
server. So the trainer rank's side is the same :class:`~colo.ranks.ray_launcher.ActorEngineClient`
(a dead actor is ``EngineDied``, a kill is ``ray.kill``), and every sync goes through the
same transports into vLLM's worker.

vLLM starts from a model directory, written by the actor on its own node from the trainer's
weights in the object store; a replacement starts from the same first weights (vLLM cannot
start empty), stale until the recovery sync. Importing this module imports Ray, not vLLM.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import anyio
import ray

from colo.engine.reference.server import EngineServer
from colo.ranks.ray_launcher import EngineActorBody, placement, spawn_engine_actor


class VllmServer(EngineServer):
    """The engine channel's ops answered by a :class:`~colo.engine.vllm.VllmEngine` in this
    process. Each op runs the engine's coroutine to its end (the actor serves one at a time)."""

    #: the ops a vLLM answers (the engine channel's, less colo's engine's diagnostics)
    OPS = frozenset({"hello", "release", "resume", "flush_cache", "set_weight_version", "generate", "logprobs",
                     "digest", "preflight", "begin_load", "transport_init", "transport_load", "transport_close",
                     "end_load", "drop_handles", "shutdown"})

    def __init__(self, engine: Any, *, workdir: str | None = None):
        self.engine = engine
        self.running = True
        #: the model directory vLLM started from (removed at shutdown)
        self.workdir = workdir
        #: key -> the spec list this engine last accepted (the client names it by key alone)
        self._accepted: tuple[str, list] | None = None

    def _run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return anyio.run(lambda: fn(*args, **kwargs))

    def handle(self, msg: dict) -> dict:
        op = msg.get("op")
        if op not in self.OPS:
            return {"id": msg.get("id"), "ok": False, "error_type": "UnknownOp",
                    "error": f"unknown op {op!r} for vLLM; expected one of {', '.join(sorted(self.OPS))}"}
        return super().handle(msg)

    # -- the engine's own verbs ---------------------------------------------------
    def op_hello(self) -> dict:
        e = self.engine
        return {"tag_bytes": e.tag_bytes(), "weight_version": self._run(e.reported_version),
                "capabilities": e.capabilities.to_json(),
                "param_specs": [[s.name, list(s.shape), s.dtype] for s in e.specs], "pid": os.getpid()}

    def op_release(self, tags: list[str]) -> dict:
        self._run(self.engine.release, list(tags))
        return {"tag_bytes": self.engine.tag_bytes()}

    def op_resume(self, tags: list[str]) -> dict:
        self._run(self.engine.resume, list(tags))
        return {"tag_bytes": self.engine.tag_bytes()}

    def op_flush_cache(self) -> dict:
        self._run(self.engine.flush_cache)
        return {}

    def op_set_weight_version(self, version: int | None) -> dict:
        self._run(self.engine.set_weight_version, version)
        return {}

    def op_generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float, seed: int) -> dict:
        return {"completions": self._run(self.engine.tokens, prompts, max_new_tokens=int(max_new_tokens),
                                         temperature=float(temperature), seed=int(seed))}

    def op_logprobs(self, tokens: list[list[int]]) -> dict:
        return {"logprobs": self._run(self.engine.logprobs, tokens)}

    def op_digest(self) -> dict:
        return {"digest": self._run(self.engine.digest)}

    # -- the receiving half ---------------------------------------------------------
    def op_preflight(self, specs: list[list] | None = None, key: str | None = None) -> dict:
        from colo.core.interfaces import TensorSpec
        from colo.transports.wire import PreflightNotCached, layout_key

        if specs is None:
            if self._accepted is None or key != self._accepted[0]:
                raise PreflightNotCached(f"vLLM holds no spec list of key {str(key)[:16]}: send it whole")
            specs = self._accepted[1]
        elif key is not None and key != layout_key(specs):
            raise ValueError("preflight: the key does not name the spec list sent with it")
        self._accepted = None
        self._run(self.engine.preflight, [TensorSpec(name=n, shape=tuple(s), dtype=d, nbytes=0) for n, s, d in specs])
        self._accepted = (layout_key(specs), specs)
        return {}

    def op_begin_load(self, preflight_key: str | None = None) -> dict:
        if preflight_key is not None:
            self.op_preflight(None, preflight_key)
        self._run(self.engine.begin_load)
        return {}

    def op_transport_init(self, transport: str, init_info: dict) -> dict:
        self._run(self.engine.transport_init, transport, init_info)
        return {}

    def op_transport_load(self, transport: str, request: dict, begin_load: bool = False,
                          preflight_key: str | None = None, end_load: bool = False,
                          flush_cache: bool = False) -> dict:
        if begin_load:
            self.op_begin_load(preflight_key)
        return dict(self._run(self.engine.transport_load, transport, request, end=bool(end_load),
                              flush_cache=bool(flush_cache)))

    def op_transport_close(self, transport: str) -> dict:
        self._run(self.engine.transport_close, transport)
        return {}

    def op_end_load(self, flush_cache: bool = False) -> dict:
        self._run(self.engine.end_load, flush_cache=bool(flush_cache))
        return {}

    def op_drop_handles(self) -> dict:
        self._run(self.engine.drop_handles)
        return {}

    def op_shutdown(self) -> dict:
        self.running = False
        try:
            self._run(self.engine.aclose)
        finally:
            if self.workdir:
                shutil.rmtree(self.workdir, ignore_errors=True)
        return {}


class VllmEngineActor(EngineActorBody):
    """An :class:`~colo.ranks.ray_launcher.EngineActor` whose engine is a whole vLLM."""

    def start(self, build: dict, state: bytes | None) -> dict:
        """A vLLM on a model directory written here (``build["workdir"]``) from ``state``
        (safetensors bytes of the trainer's weights), in the engine's dtype, in this process."""
        import torch
        from safetensors.torch import load

        from colo.engine.vllm.start import start
        from colo.models.save import save_start
        from colo.proc.lifecycle import open_log
        from colo.trainers.models import config_from_dict

        open_log(build.get("log_path"))  # else Ray's worker log
        if state is None:
            raise ValueError("vLLM cannot start without weights: a replacement starts from the first checkpoint")
        self.workdir = build["workdir"]
        os.makedirs(self.workdir, exist_ok=True)
        path = save_start("hf_dir", config_from_dict(build["config"]), load(state), self.workdir,
                          dtype=getattr(torch, build["dtype"]))
        engine = anyio.run(lambda: start({**build, "checkpoint": path}, options={"processes": False},
                                         seed=int(build["seed"]), batch=int(build["batch"])))
        self.server = VllmServer(engine, workdir=self.workdir)
        return {**self.server.op_hello(), **placement()}


VllmEngineActor = ray.remote(max_concurrency=1)(VllmEngineActor)


async def start_rank(host: Any, init_method: str, checkpoint: Any) -> Any:
    """vLLM's engine rank ``host.spec.rank`` as a :class:`VllmEngineActor` on the rank's bundle
    (the ``ray`` rank start of the registry's ``vllm`` entry, the ``replicas`` layout).
    ``checkpoint``: the trainer's first weights in this node's object store; None for a
    replacement, which starts from the same ref (kept here: vLLM cannot start empty)."""
    s, p = host.spec, host.ray_placement
    if checkpoint is None:
        checkpoint = p["vllm_start"]
    p["vllm_start"] = checkpoint
    p["engines"] = p.get("engines", 0) + 1
    # under the run's directory: removed with it on this node (the engine actor shares the
    # rank's bundle, hence its node), whatever ends the actor
    build = {**host.engine_build, "checkpoint": None, "seed": s.seed, "batch": int(s.task.get("batch", 8)),
             "workdir": os.path.join(s.workdir, f"vllm-engine{s.rank}-{p['engines']}")}
    if s.engine_log:
        build["log_path"] = s.engine_log
    return await spawn_engine_actor(build, state=checkpoint, pg=p["pg"], bundle=s.rank,
                                    name=f"colo-vllm{s.rank}-{p['token']}-{p['engines']}", gpu=p["gpu"],
                                    cpus=p["cpus"], task=host.task, actor_class=VllmEngineActor)


__all__ = ["VllmEngineActor", "VllmServer", "start_rank"]
