"""The phase scheduler on anyio.

One call per phase, or one per cycle; the cycle reads like the phase list::

    async with Scheduler(trainer, engine, memory, transport, plan="offload-first",
                         trace=TraceWriter("traces/run.jsonl")) as s:
        for _ in range(steps):
            await s.cycle()

Each phase is checked against the table and invariants 1-3 before it is
entered (a refused step changes nothing and writes nothing), runs under its
deadline, and ends in exactly one ``phase.finished`` or ``phase.failed``. Any
error or cancellation runs shielded cleanup (staging freed, transport aborted,
engine marked stale) and moves to ``failed``; :meth:`Scheduler.recover` walks
the recovery path back to a synced engine.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from colo.core.config import SchedulerConfig
from colo.core.interfaces import EngineSide, RolloutResult, SyncContext, TrainerSide, Transport
from colo.core.invariants import InvariantChecker, InvariantViolation, Violation
from colo.core.memory import LedgerStaging, MemoryLedger, OutOfMemory
from colo.core.phases import RECOVERY, IllegalTransition, Phase, PhaseMachine, is_legal, trigger_for, validate_plan
from colo.trace.writer import TraceWriter

ENGINE_RELEASE_ORDER = ("kv_cache", "cuda_graph", "weights")
TRAINER_TAGS = ("weights", "optimizer")


def describe(exc: BaseException) -> str:
    if isinstance(exc, anyio.get_cancelled_exc_class()):
        return "cancelled"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class Scheduler:
    def __init__(self, trainer: TrainerSide, engine: EngineSide, memory: MemoryLedger,
                 transport: Transport, *, plan: str | None = None, trace: TraceWriter | None = None,
                 config: SchedulerConfig | None = None, engine_synced: bool = True,
                 verify: Callable[[str], Awaitable[None]] | None = None,
                 run_config: dict | None = None, clock: Callable[[], float] = time.monotonic):
        if config is None:
            config = SchedulerConfig(plan=plan or "offload-first")
        elif plan is not None and plan != config.plan:
            raise ValueError(f"plan {plan!r} conflicts with config.plan {config.plan!r}")
        self.config = config
        self.order = validate_plan(config.plan)
        self.trainer, self.engine, self.memory, self.transport = trainer, engine, memory, transport
        self.trace = trace if trace is not None else TraceWriter(None)
        self.checker = InvariantChecker()
        self.trace.add_listener(self._watch)
        self.machine = PhaseMachine()
        self.step = 0
        self.trainer_version = 0
        # The engine starts from the trainer's checkpoint (version 0) unless told otherwise.
        self.engine_version: int | None = 0 if engine_synced else None
        self.last_error: BaseException | None = None
        self.last_rollout: RolloutResult | None = None
        self.last_train: Any = None
        self.last_sync: dict | None = None
        self._verify = verify
        self._run_config = run_config or {}
        self._clock = clock
        self._entered_rollout = False

    # -- context ---------------------------------------------------------------
    async def __aenter__(self) -> Scheduler:
        for tag, nbytes in self.engine.tag_bytes().items():
            if f"engine.{tag}" not in self.memory.regions:
                self.memory.register("engine", tag, int(nbytes), resident=True)
        for tag, nbytes in self.trainer.tag_bytes().items():
            if f"trainer.{tag}" not in self.memory.regions:
                # Colocated start: the trainer built its state, then offloaded it
                # so that the engine could start; the host copy is the source.
                self.memory.register("trainer", tag, int(nbytes), resident=False, host_copy=True)
        self.trace.start(
            device={"kind": self.memory.device_kind, "name": self.memory.device_name,
                    "total_bytes": self.memory.total_bytes},
            config={**self.config.as_dict(), "transport": self.transport.name, **self._run_config},
            tags=self.memory.describe_tags(), mem=self.memory.snapshot(),
            engine_weight_version=self.engine_version, trainer_weight_version=self.trainer_version,
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        with anyio.CancelScope(shield=True):
            self.trace.finish()

    # -- state -----------------------------------------------------------------
    @property
    def phase(self) -> Phase | None:
        return self.machine.phase

    @property
    def stale(self) -> bool:
        return self.engine_version != self.trainer_version

    def _watch(self, ev: dict) -> None:
        bad = self.checker.feed(ev)
        # A violation in an event the scheduler already wrote is a bug in a
        # component (a fake that lies, a backend that miscounts): stop loudly,
        # except while recording a failure, which must always get written.
        if bad and ev["event"] not in ("phase.failed",):
            raise InvariantViolation(bad)

    def _emit(self, event: str, **fields: Any) -> dict:
        return self.trace.emit(event, **fields)

    # -- the cycle -------------------------------------------------------------
    async def cycle(self) -> None:
        """Run one cycle of the plan, starting at rollout."""
        for phase in self.order:
            await self.run_phase(phase)

    async def recover(self) -> None:
        """From ``failed`` (or a fresh start with a stale engine) back to a synced engine."""
        path = RECOVERY[1:-1]  # engine_release .. engine_wake_kv; the next cycle rolls out
        if self.phase not in (Phase.FAILED, None):
            raise IllegalTransition(self.phase, "recover", Phase.ENGINE_RELEASE)
        for phase in path:
            await self.run_phase(phase)

    async def replace_engine(self, engine: EngineSide) -> None:
        """Swap in a new engine process for one that died; only from ``failed``.

        The ledger keeps describing the same engine regions, so the new
        process is brought to what the ledger says (it starts with every tag
        resident: the tags the ledger has paused are released on it) and the
        table, the invariants and the trace need no new state. It is stale
        until :meth:`recover` syncs it.
        """
        if self.phase is not Phase.FAILED:
            raise IllegalTransition(self.phase, "replace_engine", Phase.FAILED)
        old, new = self.engine.tag_bytes(), engine.tag_bytes()
        if old != new:
            raise ValueError(f"the new engine's memory tags {new} differ from the old engine's {old}")
        paused = self._paused("engine", ENGINE_RELEASE_ORDER)
        await engine.set_weight_version(None)
        if paused:
            await engine.flush_cache()
            await engine.release(paused)
        self.engine = engine
        self.engine_version = None

    async def run_phase(self, target: Phase) -> Any:
        src = self.machine.phase
        trigger = trigger_for(src, target)
        if not is_legal(src, target):
            raise IllegalTransition(src, trigger, target)
        if target is Phase.ROLLOUT and self._entered_rollout:
            self.step += 1
        entered = {"event": "phase.entered", "ts": self.trace.now(), "rank": self.trace.rank,
                   "step": self.step, "from_phase": src.value if src else None,
                   "to_phase": target.value, "mem": self.memory.snapshot()}
        refused = [v for v in self.checker.check(entered) if v.invariant is not None]
        if refused:
            if target is Phase.ROLLOUT and self._entered_rollout:
                self.step -= 1
            raise InvariantViolation(refused)
        self.machine.fire(trigger, target)
        self._emit("phase.entered", **{k: v for k, v in entered.items() if k not in ("event", "ts", "rank")})
        if target is Phase.ROLLOUT:
            self._entered_rollout = True
        body = getattr(self, "_" + target.value)
        t0 = self._clock()
        try:
            with anyio.fail_after(self.config.deadline(target)):
                result = await body()
        except BaseException as exc:
            await self._fail(target, exc, t0)
            raise
        self.memory.observe()
        self._emit("phase.finished", step=self.step, phase=target.value,
                   duration_s=round(self._clock() - t0, 6), mem=self.memory.snapshot())
        return result

    async def _fail(self, phase: Phase, exc: BaseException, t0: float) -> None:
        # Shielded: a cancelled scheduler must still free staging, mark the
        # engine stale and write phase.failed, or the next run trusts a
        # half-loaded engine and the trace never closes the phase.
        self.last_error = exc
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(self.config.cleanup_deadline_s):
                try:
                    await self.transport.abort()
                except Exception:  # the transport may be what failed; cleanup goes on
                    pass
            self.memory.free_all_staging()
            self.engine_version = None
            with anyio.move_on_after(self.config.cleanup_deadline_s):
                try:
                    await self.engine.set_weight_version(None)
                except Exception:  # a dead engine is stale by definition
                    pass
            error = describe(exc)
            if isinstance(exc, TimeoutError):
                error = f"deadline of {self.config.deadline(phase)} s exceeded in {phase}"
            fields: dict[str, Any] = {"error_type": "cancelled" if error == "cancelled" else type(exc).__name__}
            if isinstance(exc, OutOfMemory):
                fields.update(oom_tag=exc.tag, oom_requested=exc.requested, oom_free=exc.free)
            self._emit("phase.failed", step=self.step, phase=phase.value, error=error,
                       duration_s=round(self._clock() - t0, 6), mem=self.memory.snapshot(), **fields)
            self.machine.fire("fail", Phase.FAILED)
            # failed has no work: it is entered and closed at once; the machine
            # stays there until recover().
            self._emit("phase.entered", step=self.step, from_phase=phase.value,
                       to_phase=Phase.FAILED.value, mem=self.memory.snapshot())
            self._emit("phase.finished", step=self.step, phase=Phase.FAILED.value, duration_s=0.0,
                       mem=self.memory.snapshot())

    # -- memory helpers --------------------------------------------------------
    def _resident(self, owner: str, tags: tuple[str, ...]) -> list[str]:
        return [t for t in tags if self.memory.is_resident(f"{owner}.{t}")]

    def _paused(self, owner: str, tags: tuple[str, ...]) -> list[str]:
        return [t for t in tags if f"{owner}.{t}" in self.memory.regions
                and not self.memory.is_resident(f"{owner}.{t}")]

    def _check_fits(self, owner: str, tags: list[str], phase: Phase) -> None:
        # All tags of one resume must fit together, before any side effect.
        need = 0
        for tag in tags:
            key = f"{owner}.{tag}"
            nbytes = self.memory.check_resume(key, phase=phase.value)
            if need + nbytes > self.memory.free_bytes:
                raise OutOfMemory(phase=phase.value, tag=key, requested=nbytes,
                                  free=self.memory.free_bytes - need, total=self.memory.total_bytes,
                                  in_use=self.memory.by_tag())
            need += nbytes

    def _mark(self, owner: str, tags: list[str], *, resume: bool, host_copy: bool = False) -> None:
        for tag in tags:
            key = f"{owner}.{tag}"
            if resume:
                nbytes = self.memory.resume(key)
                self._emit("memory.resumed", owner=owner, tag=tag, bytes=nbytes, mem=self.memory.snapshot())
            else:
                nbytes = self.memory.pause(key, host_copy=host_copy)
                self._emit("memory.paused", owner=owner, tag=tag, bytes=nbytes, host_copy=host_copy,
                           mem=self.memory.snapshot())

    async def _wake(self, owner: str, tags: tuple[str, ...], phase: Phase) -> None:
        todo = self._paused(owner, tags)
        self._check_fits(owner, todo, phase)
        side = self.engine if owner == "engine" else self.trainer
        if todo:
            await (side.resume(todo) if owner == "engine" else side.onload(todo))
        self._mark(owner, todo, resume=True)

    # -- phase bodies ------------------------------------------------------------
    async def _rollout(self) -> RolloutResult:
        result = await self.engine.generate(self.step)
        self.last_rollout = result
        self._emit("rollout.finished", step=self.step, reward=result.reward, tokens=result.tokens)
        return result

    async def _engine_release(self) -> None:
        todo = self._resident("engine", ENGINE_RELEASE_ORDER)
        if todo:
            # Flush before the pages go: a flush afterwards would walk freed memory.
            await self.engine.flush_cache()
            await self.engine.release(todo)
        self._mark("engine", todo, resume=False)

    async def _trainer_onload(self) -> None:
        await self._wake("trainer", TRAINER_TAGS, Phase.TRAINER_ONLOAD)

    async def _train(self) -> Any:
        if self.last_rollout is None:
            raise RuntimeError("train needs a rollout first: no rollout result is held")
        self.last_train = await self.trainer.train_step(self.last_rollout)
        self.trainer_version += 1
        return self.last_train

    async def _trainer_offload(self) -> None:
        todo = self._resident("trainer", TRAINER_TAGS)
        if todo:
            await self.trainer.offload(todo)
        self._mark("trainer", todo, resume=False, host_copy=True)

    async def _engine_wake_weights(self) -> None:
        await self._wake("engine", ("weights",), Phase.ENGINE_WAKE_WEIGHTS)

    async def _sync(self) -> dict:
        version = self.trainer_version
        # Stale before the first byte moves: if anything below fails the engine
        # must not be trusted, whatever it already loaded.
        self.engine_version = None
        await self.engine.set_weight_version(None)
        source = "device" if self.memory.is_resident("trainer.weights") else "host"
        step = self.step

        def record(bucket: int, stage: str, nbytes: int, tensors: int, duration_s: float) -> None:
            self._emit("bucket.finished", step=step, bucket=bucket, stage=stage, bytes=int(nbytes),
                       tensors=int(tensors), duration_s=round(duration_s, 6), mem=self.memory.snapshot())

        ctx = SyncContext(step=step, weight_version=version, bucket_bytes=self.config.bucket_bytes,
                          source=source, staging=LedgerStaging(self.memory), record=record)
        t0 = self._clock()
        result = await self.transport.sync(self.trainer, self.engine, ctx)
        if self.memory.staging_bytes:
            raise RuntimeError(f"transport {self.transport.name} left {self.memory.staging_bytes} "
                               "staging bytes allocated after sync")
        # The prefix cache holds KV computed with the old weights: flush after the
        # last load, so nothing computed before the change survives into rollout.
        await self.engine.flush_cache()
        digest = await self.engine.digest()
        if self._verify is not None:
            await self._verify(digest)
        await self.engine.set_weight_version(version)
        self.engine_version = version
        self.last_sync = self._emit(
            "sync.finished", step=step, bytes=result.bytes, buckets=result.buckets,
            tensors=result.tensors, params=len(self.trainer.param_specs()),
            duration_s=round(self._clock() - t0, 6), weight_version=version, digest=digest,
            cache_flushed=True, source=source, mem=self.memory.snapshot())
        return self.last_sync

    async def _engine_wake_kv(self) -> None:
        await self._wake("engine", ("kv_cache", "cuda_graph"), Phase.ENGINE_WAKE_KV)

    async def _failed(self) -> None:  # pragma: no cover - failed is entered only by _fail
        raise IllegalTransition(self.phase, "fail", Phase.FAILED)


__all__ = ["Scheduler", "InvariantViolation", "Violation", "describe"]
