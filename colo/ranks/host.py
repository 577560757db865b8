"""What one rank does: its trainer rank, its engine rank on the same GPU, and the sync between them.

A :class:`RankHost` lives in one process per GPU (a worker of
:mod:`colo.ranks.worker`, or a Ray actor). At start it joins the trainer's
process group and builds its trainer rank (``colo.trainers.build`` sees an
N-rank world: Megatron TP=N, FSDP2 over N, or data parallel), writes the
initial checkpoint once (rank 0), and starts its engine rank as the engine's
registry entry says (``colo.engine.ENGINES``: ``rank_start`` per launcher; colo's engine
is a child process on the same GPU, in the engine's TP group). A sync runs here, from this
trainer rank straight to this engine rank: every rank takes part in the
extractor's collectives; the bucket is packed on this GPU and its handle goes
only to the engine rank on this GPU (keyed by the GPU's UUID). Nothing of the
tensors, and no handle, passes through the driver or through rank 0.

Every verb is plain data in and out (:meth:`handle`), so the same host serves
a channel or a Ray actor.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import anyio
import torch

from colo.core.buckets import plan_buckets
from colo.transports.base import extract_bucket
from colo.core.interfaces import SyncContext
from colo.engine.forward import rollout_from_json, rollout_to_json  # noqa: F401 (re-exported)
from colo.core.memory import StagingBudget
from colo.tasks import make_task
from colo.core.errors import OutOfMemory

#: how long a trainer collective may wait for a rank that stopped issuing them
#: (the last resort: a failing rank keeps issuing its collectives, see _Drain)
TRAINER_PG_TIMEOUT_S = 300.0


@dataclass(frozen=True, kw_only=True)
class RankSpec:
    """Everything one rank needs, as plain data (it crosses a process boundary)."""

    rank: int
    world_size: int
    device: str
    trainer: str
    model_config: dict
    seed: int
    engine_dtype: str
    transport: str
    #: rendezvous of the trainer's process group (``colo-store://``, ``tcp://host:port`` or ``file://``)
    trainer_init: str
    #: rendezvous of the engine's TP group
    engine_init: str
    #: the engine build every rank shares (total_bytes, mem_fraction_static, memory)
    engine_build: dict
    #: the rollout task by name and its arguments (``colo.tasks.make_task``): name, vocab_size, batch, ...
    task: dict
    #: where rank 0 writes the initial checkpoint the engine ranks start from
    workdir: str
    engine_log: str | None = None
    #: the trainer's parameters' dtype (``colo.trainers.build``'s ``param_dtype``); None: its default
    param_dtype: str | None = None
    #: ``"module:function"`` building the trainer rank instead of ``colo.trainers.build(trainer)``
    #: (same keywords; the benchmark's synthetic Megatron-layout trainer is one)
    trainer_builder: str | None = None
    #: ``"module:Class"``, a RankHost subclass the worker serves (with more ``op_`` verbs)
    host_class: str | None = None
    extra: dict = field(default_factory=dict)
    #: the engine, by its name in :data:`colo.engine.ENGINES`: its entry starts engine rank r
    #: (``rank_start``) and says what a rank's digest is (``shard_digest``)
    engine: str = "colo"
    #: how the engine spans the ranks (:data:`colo.engine.LAYOUTS`): ``tp``, one engine of TP=N
    #: whose rank r holds its shard, or ``replicas``, a whole engine per rank
    layout: str = "tp"
    #: train and sync a LoRA adapter (``{"rank": R, "keep": K}``): the trainer is the trainer's
    #: entry of :data:`colo.trainers.LORA_BUILDERS`, the engine rank stages each sync as a new
    #: adapter version (:class:`colo.engine.adapters.AdapterEngine`), K of them kept loaded
    lora: dict | None = None

    def __post_init__(self) -> None:
        for name in ("rank", "world_size", "seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"rank spec {name} must be an integer, got {v!r}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in [0, {self.world_size})")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"rank spec device must be cpu or cuda, got {self.device!r}")
        if self.lora is not None:
            ok = isinstance(self.lora, dict) and set(self.lora) == {"rank", "keep"} and all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in self.lora.values())
            if not ok:
                raise ValueError(f"rank spec lora must be {{'rank': R, 'keep': K}} of positive integers, got "
                                 f"{self.lora!r}")
        from colo.engine import engine_entry

        entry = engine_entry(self.engine)
        if self.world_size > 1 and self.layout not in entry.layouts:
            raise ValueError(f"engine {self.engine} takes the layout(s) {', '.join(entry.layouts) or 'none'} "
                             f"of N ranks, got {self.layout!r}")

    def to_json(self) -> dict:
        return asdict(self)

    @property
    def backend(self) -> str:
        return "nccl" if self.device == "cuda" else "gloo"


class _Drain:
    """The trainer as the transport sees it, counting the extractor's calls.

    Every rank must issue the same collectives in the same order. A rank whose
    sync fails on its own side (its engine rank died, its staging ran out)
    stops handing off, but the other ranks are still gathering: it must go on
    gathering with them to the last bucket, or they wait in an ``all_gather``
    that never completes. :meth:`finish` extracts (and drops) the buckets this
    rank did not reach.
    """

    def __init__(self, trainer: Any):
        self._trainer = trainer
        self.extracted = 0
        self._extractor: Any = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._trainer, name)

    def extractor(self) -> Any:
        inner = self._trainer.extractor()
        self._extractor = inner
        drain = self

        class Counting:
            def __getattr__(self, name: str) -> Any:
                return getattr(inner, name)

            def specs(self) -> Any:
                return inner.specs()

            def extract(self, names: Sequence[str], into: Any = None) -> Any:
                # ``into`` (a staging buffer's views, for an extractor that writes there:
                # ``extracts_into``) goes through as the transport gave it
                out = list(inner.extract(names) if into is None else inner.extract(names, into))
                drain.extracted += 1
                return iter(out)

        return Counting()

    def finish(self, bucket_bytes: int) -> int:
        """Extract the buckets not reached; how many that was."""
        ex = self._extractor or self._trainer.extractor()
        buckets = plan_buckets(list(ex.specs()), bucket_bytes)
        todo = buckets[self.extracted:]
        for b in todo:
            # what the sender gathers for each bucket (a piece gathered by range, the
            # tensors whose first bytes are there): the same collectives in the same order
            extract_bucket(ex, b)
        return len(todo)


class _KillAfter:
    """Fault injection (``colo demo --gpus N --fault kill-engine@sync``): the engine
    rank's process is killed (SIGKILL) after ``n`` bucket loads, so it dies holding
    half-updated weights, as a crashed engine would."""

    def __init__(self, engine: Any, n: int):
        self._engine, self._left = engine, int(n)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def transport_load(self, *args: Any, **kwargs: Any) -> dict:
        reply = await self._engine.transport_load(*args, **kwargs)
        self._left -= 1
        if self._left == 0:
            self._engine.kill()
        return reply


class RankHost:
    """One rank: a trainer rank, an engine rank (a child process on the same GPU), a transport."""

    def __init__(self, spec: RankSpec):
        self.spec = spec
        self.trainer: Any = None
        self.saver: Any = None
        self.engine: Any = None
        self.transport: Any = None
        self.task: Any = None
        self.model_config: Any = None
        self._owns_pg = False
        self._build: dict = {}
        #: engine rank r's process begun before the trainer rank is built (the engine entry's
        #: ``begin``), until the rank start hands it its build
        self.begun: Any = None
        #: the trainer sends each tensor-parallel tensor as this rank's own slice (:meth:`_send_own_slices`)
        self.own_slices = False

    # -- start ---------------------------------------------------------------------
    async def start(self) -> dict:
        from colo.trainers.models import config_from_dict
        from colo.transports import make_transport

        s = self.spec
        self._begin_engine()
        self.model_config = config_from_dict(s.model_config)  # the class its model_type names
        self._join_trainer_group()
        self.trainer, self.saver = self._build_trainer()
        self.task = make_task(**s.task)
        ckpt = await anyio.to_thread.run_sync(self._initial_checkpoint)
        if self.saver is not None:
            # colocated start: the trainer offloads so the engine can size its pool
            await self.trainer.offload(["weights", "optimizer"])
        self._build = {**s.engine_build, "config": s.model_config, "dtype": s.engine_dtype,
                       "device": s.device, "checkpoint": ckpt}
        self.engine = self._adapters(await self._spawn_engine(s.engine_init, ckpt))
        self.transport = make_transport(s.transport)
        self.own_slices = self._send_own_slices()
        return self.hello()

    def _send_own_slices(self) -> bool:
        """Where engine rank r holds exactly trainer rank r's shard of what both split (the
        engine's entry takes a rank's slice, one engine of TP=N over the N ranks, a trainer
        that can send it, a transport that marks it, no LoRA adapter), the trainer sends each
        such tensor as this rank's own slice from now on: no all-gather of the whole model
        for each rank to keep 1/N of it (issue 46). A collective: every rank decides the
        same from the same spec."""
        from colo.engine import engine_entry
        from colo.trainers import OWN_SLICES

        s = self.spec
        if not (s.world_size > 1 and s.layout == "tp" and engine_entry(s.engine).rank_slices
                and s.trainer in OWN_SLICES and not s.trainer_builder and s.lora is None
                and self.transport.carries_rank_slices):
            return False
        from colo.engine.reference.tp import split_dims

        self.trainer.send_own_slices(split_dims(self.model_config, s.world_size))
        return True

    def _adapters(self, engine: Any) -> Any:
        """A LoRA run's engine rank: its syncs stage adapter versions (activated when the driver
        sets the version, after every rank's digest checked: on every rank at once). Its base
        weights are what the trainer's base is: checked once per engine where the engine's digest
        reads its live weights, else answered for by the probe with the adapter
        (:class:`colo.engine.adapters.AdapterEngine`)."""
        if self.spec.lora is None:
            return engine
        from colo.engine.adapters import AdapterEngine

        engine.keep_adapters = int(self.spec.lora["keep"])
        return AdapterEngine.for_trainer(engine, self.trainer, self.spec.engine_dtype)

    def _begin_engine(self) -> None:
        """Engine rank r's process, started before the trainer rank is built where the
        engine's entry says how (``begin``): its interpreter and imports overlap the trainer's
        build, as in ``colo demo`` (:class:`colo.apps.demo.DemoRun`). On the process
        launcher only: a Ray host starts its engine rank as an actor of its own."""
        from colo.engine import engine_entry, load

        entry = engine_entry(self.spec.engine)
        if self.launcher == "process" and entry.begin is not None:
            self.begun = load(entry.begin)(None)

    def _join_trainer_group(self) -> None:
        from colo.proc.rendezvous import init_default_group

        s = self.spec
        if s.device == "cuda":
            torch.cuda.set_device(0)  # this process sees one GPU: its own (CUDA_VISIBLE_DEVICES)
        else:
            torch.set_num_threads(1)  # N ranks and N engine ranks share the host's cores
        kwargs: dict[str, Any] = {}
        if s.device == "cuda":
            kwargs["device_id"] = torch.device("cuda", 0)
        init_default_group(s.backend, s.trainer_init, rank=s.rank, world_size=s.world_size,
                           timeout=datetime.timedelta(seconds=TRAINER_PG_TIMEOUT_S), **kwargs)
        self._owns_pg = True

    def _build_trainer(self) -> tuple[Any, Any]:
        from colo.trainers import build

        s = self.spec
        torch.manual_seed(s.seed)
        kw = dict(model_config=self.model_config, seed=s.seed, engine_dtype=s.engine_dtype, device=s.device)
        if s.param_dtype is not None:
            kw["param_dtype"] = s.param_dtype
        if s.trainer_builder:
            return load_object(s.trainer_builder)(**kw)
        if s.lora is not None:  # the base frozen, an adapter trained and synced
            from colo.trainers import LORA_BUILDERS

            return load_object(LORA_BUILDERS[s.trainer])(**kw, rank=int(s.lora["rank"]))
        return build(s.trainer, **kw)

    def _initial_checkpoint(self) -> str:
        """Rank 0 writes the trainer's weights once, in the form the engine's entry starts from
        (``starts_from``); every engine rank loads its shard, or a replica the whole, from it
        (as SGLang's TP ranks each load their shard from one model path)."""
        import torch.distributed as dist

        from colo.engine import engine_entry
        from colo.models.save import save_start, start_path

        s = self.spec
        starts_from = engine_entry(s.engine).starts_from
        # a collective: every rank calls it (a LoRA trainer's engine starts from its base model)
        state = self.trainer.start_state() if s.lora is not None else self.trainer.hf_state()
        # a model directory in the engine's dtype (vLLM), or the trainer's tensors as they are
        dtype = getattr(torch, s.engine_dtype) if starts_from == "hf_dir" else None
        if s.rank == 0:
            save_start(starts_from, self.model_config, state, s.workdir, dtype=dtype)
        dist.barrier()
        return start_path(starts_from, s.workdir)

    @property
    def engine_build(self) -> dict:
        """What every engine rank is built from (the spec's engine build, the model, its dtype
        and device, the initial checkpoint)."""
        return self._build

    #: the launcher whose rank start of the engine's entry this host uses
    launcher = "process"

    async def _spawn_engine(self, init_method: str, checkpoint: Any) -> Any:
        """Engine rank r, as the engine's registry entry starts it on a rank of this launcher."""
        from colo.engine import engine_entry, load

        return await load(engine_entry(self.spec.engine).rank_start[self.launcher])(self, init_method, checkpoint)

    def hello(self) -> dict:
        t, e = self.trainer, self.engine
        return {"rank": self.spec.rank, "pid": os.getpid(), "engine_pid": e.pid,
                "trainer_tag_bytes": dict(t.tag_bytes()), "engine_tag_bytes": e.tag_bytes(),
                "engine_capabilities": e.capabilities.to_json(),
                "param_specs": [[p.name, list(p.shape), p.dtype, p.nbytes] for p in t.param_specs()],
                "num_params": int(t.num_params()), "gpu_uuid": self._gpu_uuid(),
                "own_slices": self.own_slices}

    def _gpu_uuid(self) -> str | None:
        if self.spec.device != "cuda":
            return None
        from colo.device.cuda_ipc import gpu_uuid

        return gpu_uuid(0)

    # -- the verbs ---------------------------------------------------------------------
    async def handle(self, op: str, args: dict) -> dict:
        fn = getattr(self, f"op_{op}", None) if op.isidentifier() else None
        if fn is None:
            ops = sorted(n.removeprefix("op_") for n in dir(self) if n.startswith("op_"))
            raise ValueError(f"unknown rank op {op!r}; expected one of {', '.join(ops)}")
        return await fn(**args)

    async def op_onload(self, tags: list[str]) -> dict:
        await self.trainer.onload(tags)
        return {}

    async def op_offload(self, tags: list[str]) -> dict:
        await self.trainer.offload(tags)
        return {}

    async def op_train_step(self, rollout: dict) -> dict:
        out = await self.trainer.train_step(rollout_from_json(rollout))
        return {"result": {k: float(v) for k, v in out.items()}, "steps": int(self.trainer.steps)}

    async def op_engine(self, verb: str, args: dict) -> dict:
        """One declared engine verb (``ENGINE_VERBS``) on this rank's engine rank, answered as
        :class:`colo.ranks.proxy.RemoteEngine` decodes it (:mod:`colo.engine.forward`)."""
        from colo.engine.forward import answer

        return await answer(self.engine, verb, args)

    async def op_sync(self, step: int, weight_version: int, bucket_bytes: int, source: str,
                      staging: dict, kill_engine_after: int | None = None, flush_cache: bool = False) -> dict:
        """One sync from this trainer rank to this engine rank; the stage records come back as data
        (their ``at`` as seconds since the sync began here, for the driver's clock)."""
        budget = StagingBudget(staging["limit"], phase="sync", total=staging["total"], in_use=staging["in_use"],
                               rank=staging["rank"])
        ctx = SyncContext(step=step, weight_version=weight_version, bucket_bytes=bucket_bytes, source=source,
                          staging=budget, flush_cache=flush_cache is True)
        t0 = ctx.clock()
        trainer = _Drain(self.trainer)
        engine = self.engine if kill_engine_after is None else _KillAfter(self.engine, kill_engine_after)
        try:
            res = await self.transport.sync(trainer, engine, ctx)
        except Exception as exc:
            with anyio.CancelScope(shield=True):
                drained = await anyio.to_thread.run_sync(trainer.finish, bucket_bytes)
            err = describe_error(exc)
            err["drained_buckets"] = drained
            err["stages"] = _stages_json(ctx.stages, t0)
            return {"failed": err}
        return {"bytes": res.bytes, "buckets": res.buckets, "tensors": res.tensors,
                "staging_peak": res.staging_peak, "stages": _stages_json(res.stages, t0),
                "cache_flushed": res.cache_flushed}

    async def op_abort(self) -> dict:
        await self.transport.abort()
        return {}

    async def op_expected_digest(self) -> dict:
        """The digest this rank's engine must report after a sync of the trainer's weights (a
        collective): in the ``tp`` layout its shard's (the engine entry's ``shard_digest``), a
        replica's, or a TP rank's that receives the whole tensors (no ``shard_digest``), the whole
        model's."""
        from colo.engine import engine_entry, load

        s = self.spec
        entry = engine_entry(s.engine)
        if s.layout != "tp" or s.world_size == 1 or entry.shard_digest is None:
            return await self.op_full_digest()
        shard_digest = load(entry.shard_digest)

        def compute() -> str:
            return shard_digest(self.trainer.hf_state(), self.model_config, getattr(torch, s.engine_dtype),
                                s.rank, s.world_size)

        return {"digest": await anyio.to_thread.run_sync(compute)}

    async def op_full_digest(self) -> dict:
        """The digest of the trainer's full weights (a collective): equal on every rank, what a
        whole engine of them reports (:mod:`colo.digest`)."""
        from colo.digest import expected_weights_digest

        def compute() -> str:
            state = self.trainer.hf_state()
            return expected_weights_digest(state, list(state), getattr(torch, self.spec.engine_dtype))

        return {"digest": await anyio.to_thread.run_sync(compute)}

    async def op_trainer_logits(self, tokens: list[list[int]]) -> dict:
        logits = await self.trainer.compute(self.trainer.logits, tokens)
        return {"logits": logits.float().tolist()}

    async def op_replace_engine(self, init_method: str) -> dict:
        """A new engine rank in a new TP group (a TP group cannot take one new member:
        every rank restarts together), empty and stale until the recovery sync."""
        old, self.engine = self.engine, None
        await old.aclose()
        self.engine = self._adapters(await self._spawn_engine(init_method, None))
        return {"engine_pid": self.engine.pid, "old_engine_pid": old.pid}

    async def op_kill_engine(self) -> dict:
        """Kill the engine rank outright (a crash, from outside the run's code)."""
        pid = self.engine.pid
        self.engine.kill()
        return {"engine_pid": pid}

    async def op_engine_alive(self) -> dict:
        """Whether the engine rank lives. A stopped one (SIGSTOP from outside: it answers
        nothing and closes nothing) is killed here and counts as dead: a TP peer's collective
        may have failed on it before this rank's own call saw it stopped."""
        from colo.proc.lifecycle import process_state

        engine = self.engine
        if engine is None:
            return {"alive": False}
        pid = getattr(engine, "pid", None)
        if engine.alive() and pid is not None and process_state(pid) in ("T", "t"):
            engine.kill()
        return {"alive": bool(engine.alive())}

    async def op_shutdown(self) -> dict:
        await self.aclose()
        return {}

    async def aclose(self) -> None:
        """Shielded: the engine rank, the transport, the trainer's regions and groups."""
        with anyio.CancelScope(shield=True):
            if self.begun is not None:  # never built: the rank failed before its engine
                begun, self.begun = self.begun, None
                await anyio.to_thread.run_sync(begun.abandon)
            if self.transport is not None:
                await self.transport.aclose()
                self.transport = None
            if self.engine is not None:
                await self.engine.aclose()
                self.engine = None
            if self.saver is not None:
                # the memory saver must not meet paused regions at teardown
                for key in sorted(self.saver.paused):
                    self.saver.resume(key)
            if self.trainer is not None and hasattr(self.trainer, "close"):
                self.trainer.close()
                self.trainer = None
            self._leave_group()

    def _leave_group(self) -> None:
        import torch.distributed as dist

        if self._owns_pg and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_pg = False


def load_object(target: str) -> Any:
    """``"module:name"`` -> the object (a builder, a host class)."""
    import importlib

    module, sep, name = str(target).partition(":")
    if not sep or not module or not name:
        raise ValueError(f"expected 'module:name', got {target!r}")
    return getattr(importlib.import_module(module), name)


def _stages_json(stages: Sequence[Any], t0: float) -> list[list]:
    return [[s.bucket, s.stage, s.bytes, s.tensors, s.duration_s, s.at - t0, s.staging_bytes] for s in stages]


def describe_error(exc: BaseException) -> dict:
    """An error as data: its class name, message, and the fields the driver rebuilds it from."""
    from colo.core.errors import RankFailed

    cause = exc.cause if isinstance(exc, RankFailed) else exc
    out: dict[str, Any] = {"error_type": type(cause).__name__, "error": str(cause) or type(cause).__name__}
    if isinstance(cause, anyio.get_cancelled_exc_class()):
        out["error_type"] = "cancelled"
    if isinstance(cause, OutOfMemory):
        out["oom"] = {"phase": cause.phase, "tag": cause.tag, "requested": cause.requested, "free": cause.free,
                      "total": cause.total, "in_use": cause.in_use, "rank": cause.rank}
    return out


__all__ = ["RankHost", "RankSpec", "describe_error", "rollout_from_json", "rollout_to_json"]
