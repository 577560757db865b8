"""The phase scheduler on anyio.

Inside your own loop, two calls hand the GPU over; your rollout and your training step
stay yours, and colo runs, checks and traces every phase between them::

    async with Scheduler(trainer, engine, memory, transport, plan="offload-first",
                         trace=TraceWriter("traces/run.jsonl")) as s:
        await s.to_rollout()              # a stale engine is synced (and verified) first
        for _ in range(steps):
            batch = my_rollout()          # the engine's KV cache is back, its weights current
            await s.to_train()            # engine_release, trainer_onload
            my_train_step(batch)          # the trainer's state is resident
            await s.to_rollout()          # trainer_offload, engine_wake_weights, sync, engine_wake_kv

Or colo's own loop, one call per cycle, the engine's ``generate`` and the trainer's
``train_step`` doing the work in between (:meth:`Scheduler.cycle`).

The trainer and the engine are groups of ranks (one GPU is the group of one,
see :mod:`colo.groups`); each rank has its memory ledger, its transport and its
trace. Each phase is looked up in the table and its preconditions checked on
every rank before it is entered (a refused step changes nothing and writes
nothing); its effects — the tags it pauses or resumes, from
:data:`colo.core.phases.EFFECTS` — are applied generically, after the memory of
every GPU was checked; it runs under its deadline and ends in exactly one
``phase.finished`` or ``phase.failed`` per rank. Any error or cancellation runs
shielded cleanup (transports aborted, staging dropped, engine marked stale) and
moves to ``failed``; :meth:`Scheduler.recover` walks back to a synced engine.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio

from colo.core.config import SchedulerConfig
from colo.core.interfaces import PhaseHooks, RolloutResult, SyncContext, SyncResult
from colo.core.invariants import InvariantChecker, Violation  # noqa: F401 (re-exported)
from colo.core.memory import MemoryLedger
from colo.core.phases import (CALLER_PHASES, RECOVERY, UNDO, Effect, Phase, PhaseMachine, allowed_triggers,
                              effects_for, handoff_path, next_phase, offload_follows_sync, trigger_for,
                              validate_plan)
from colo.core.schema import RUN_ID_MAX
from colo.core.errors import IllegalTransition, InvariantViolation, OutOfMemory, PhaseDeadline, RankFailed
from colo.groups import EngineGroup, TrainerGroup, side_by_side, together
from colo.proc.collector import collector_paused
from colo.trace.writer import TraceWriter, new_run_id

#: events whose violations are written but never raised: a failure must always be recorded
_NEVER_RAISE = frozenset({"phase.failed"})


def describe(exc: BaseException) -> str:
    if isinstance(exc, anyio.get_cancelled_exc_class()):
        return "cancelled"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _per_rank(value: Any, n: int, what: str) -> list:
    """One object per rank: a sequence of n, or a single object for one rank."""
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{what}: {len(value)} given for {n} ranks; expected one per rank")
        return list(value)
    if isinstance(value, dict):
        if sorted(value) != list(range(n)):
            raise ValueError(f"{what}: ranks {sorted(value)} given; expected ranks 0..{n - 1}")
        return [value[r] for r in range(n)]
    if n != 1:
        raise ValueError(f"{what}: one given for {n} ranks; expected one per rank")
    return [value]


class Scheduler:
    def __init__(self, trainer: Any, engine: Any, memory: MemoryLedger | Sequence[MemoryLedger] | dict,
                 transport: Any, *, plan: str | None = None, trace: TraceWriter | Sequence[TraceWriter] | None = None,
                 config: SchedulerConfig | None = None, engine_synced: bool = True,
                 verify: Callable[[list[str]], Awaitable[None]] | None = None,
                 probe: Callable[[], Awaitable[Any]] | None = None,
                 run_config: dict | None = None, clock: Callable[[], float] = time.monotonic,
                 hooks: Sequence[PhaseHooks] = (), run_id: str | None = None):
        if config is None:
            config = SchedulerConfig(plan=plan or "offload-first")
        elif plan is not None and plan != config.plan:
            raise ValueError(f"plan {plan!r} conflicts with config.plan {config.plan!r}")
        self.config = config
        self.order = validate_plan(config.plan)
        self.trainers, self.engines = TrainerGroup.of(trainer), EngineGroup.of(engine)
        n = self.world_size = self.trainers.size
        if self.engines.size != n:
            raise ValueError(f"the trainer has {n} ranks but the engine has {self.engines.size}; "
                             "expected one engine rank per trainer rank (one of each per GPU)")
        #: what each phase does to memory, for what this run's syncs move (the phase table's)
        self.effects = effects_for(config.sync_target)
        adapters = (config.sync_target == "adapter")
        if self.engines.capabilities.adapters != adapters:
            raise ValueError(f"sync_target {config.sync_target!r} needs an engine that "
                             f"{'stages adapters (colo.engine.adapters.AdapterEngine)' if adapters else 'loads weights'}"
                             f"; this engine {'stages adapters' if not adapters else 'loads weights'}")
        self.memories: list[MemoryLedger] = _per_rank(memory, n, "memory ledgers")
        self.transports = _per_rank(transport, n, "transports")
        traces = trace if trace is not None else [TraceWriter(None, rank=r, world_size=n) for r in range(n)]
        self.traces: list[TraceWriter] = _per_rank(traces, n, "traces")
        #: in every rank's trace.started: replay and tune take the ranks of one run only together
        self.run_id = run_id if run_id is not None else new_run_id()
        if not (isinstance(self.run_id, str) and 0 < len(self.run_id) <= RUN_ID_MAX
                and self.run_id.isascii() and self.run_id.isprintable()):
            raise ValueError(f"run_id must be 1 to {RUN_ID_MAX} printable ASCII characters, got {self.run_id!r}")
        self.checker = InvariantChecker()
        self.hooks: list[PhaseHooks] = list(hooks)
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
        #: the engine's answer to a fixed probe batch, checked against the trainer's (raises on a
        #: mismatch); run with a verified sync's digests, or where the KV cache is back
        self._probe = probe
        self._probe_due = False
        #: the engines' digests of a sync-first sync, checked once the trainer's offload took
        #: its own digest (see _sync); None: nothing waits
        self._digests_due: list[str] | None = None
        #: a sync-first sync left the engines' digests to be taken beside the trainer's offload,
        #: from their live weights (see _digests_beside_offload), and how long that took
        self._digests_beside = False
        self._digests_beside_s: float | None = None
        #: a probe passed on these engines since they started or the run last failed (an engine
        #: is replaced only from ``failed``): one whose digest is of its live weights is then
        #: not probed again
        self._probed = False
        #: the engine paused its generation in engine_release (capabilities.pauses_generation)
        self._generation_paused = False
        #: syncs verified so far (``SchedulerConfig.verify == "first"`` verifies only the first)
        self._verified = 0
        self._run_config = run_config or {}
        self._clock = clock
        self._entered_rollout = False
        #: the caller's phase now open (to_train/to_rollout entered it; the next call closes
        #: it), and when it was entered
        self._open: tuple[Phase, float] | None = None
        #: what a phase settles before its memory effects, and what runs beside them, written out
        self._before: dict[Phase, Callable[[], None]] = {Phase.TRAINER_OFFLOAD: self._want_probe_reference}
        self._beside: dict[Phase, Callable[[], Awaitable[None]]] = {Phase.TRAINER_OFFLOAD: self._digests_if_due}
        #: the work each phase does beyond its memory effects, written out
        self._work: dict[Phase, Callable[[], Awaitable[Any]]] = {
            Phase.ROLLOUT: self._rollout, Phase.TRAIN: self._train, Phase.SYNC: self._sync,
            Phase.TRAINER_OFFLOAD: self._check_if_due, Phase.ENGINE_WAKE_KV: self._probe_if_due}

    # -- one-rank views ----------------------------------------------------------
    @property
    def trainer(self) -> Any:
        return self.trainers[0]

    @property
    def engine(self) -> Any:
        return self.engines[0]

    @property
    def memory(self) -> MemoryLedger:
        return self.memories[0]

    @property
    def trace(self) -> TraceWriter:
        return self.traces[0]

    @property
    def transport(self) -> Any:
        return self.transports[0]

    # -- context ---------------------------------------------------------------
    async def __aenter__(self) -> Scheduler:
        engine_tags = self.engines.first("tag_bytes")
        trainer_tags = self.trainers.first("tag_bytes")
        # an engine whose release is control-plane only (vLLM's sleep on a CPU) keeps its
        # bytes while released: the ledger does not pretend they moved
        frees = self.engines.capabilities.frees_memory
        for r, ledger in enumerate(self.memories):
            for tag, nbytes in engine_tags.items():
                if f"engine.{tag}" not in ledger.regions:
                    ledger.register("engine", tag, int(nbytes), resident=True, frees=frees)
            for tag, nbytes in trainer_tags.items():
                if f"trainer.{tag}" not in ledger.regions:
                    # Colocated start: the trainer built its state, then offloaded it
                    # so that the engine could start; the host copy is the source.
                    ledger.register("trainer", tag, int(nbytes), resident=False, host_copy=True)
            started = self.traces[r].start(
                device={"kind": ledger.device_kind, "name": ledger.device_name, "total_bytes": ledger.total_bytes},
                config={**self.config.as_dict(), "transport": self.transports[r].name,
                        "engine_capabilities": self.engines.capabilities.to_json(), **self._run_config},
                run_id=self.run_id, tags=ledger.describe_tags(), mem=ledger.snapshot(),
                engine_weight_version=self.engine_version, trainer_weight_version=self.trainer_version)
            self.checker.feed(started)
        return self

    async def __aexit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        with anyio.CancelScope(shield=True):
            if self._open is not None:
                # the caller's phase ends with the block: finished, or failed with what left
                # it (the caller's rollout or step raised, was cancelled, was interrupted)
                await self._close_open(exc)
            for trace in self.traces:
                trace.finish()
        if exc_type is None:
            self._check_traces()  # a trace.finished the disk refused: the run did not end as recorded

    def _check_traces(self) -> None:
        """A trace its disk stopped taking (ENOSPC) ends the run here, between phases, with
        the file, the step and the phase of the first line it refused (TraceUnwritable)."""
        for trace in self.traces:
            trace.check()

    # -- state -----------------------------------------------------------------
    @property
    def phase(self) -> Phase | None:
        return self.machine.phase

    @property
    def stale(self) -> bool:
        return self.engine_version != self.trainer_version

    def _emit(self, rank: int, event: str, *, at: float | None = None, mem: Any = True, **fields: Any) -> dict:
        """Check one event against the invariants, write it, then refuse it if it broke one.

        A violation in an event the scheduler is writing is a bug in a component
        (a fake that lies, a backend that miscounts): it is written, so replay
        shows it, and raised, except while recording a failure.
        """
        if mem is True:
            mem = self.memories[rank].snapshot()
        if mem is not None:
            fields["mem"] = mem
        ev = self.traces[rank].record(event, at=at, **fields)
        bad = self.checker.feed(ev)
        self.traces[rank].write(ev)
        if bad and event not in _NEVER_RAISE:
            raise InvariantViolation(bad)
        return ev

    def _emit_all(self, event: str, **fields: Any) -> list[dict]:
        return [self._emit(r, event, **fields) for r in range(self.world_size)]

    # -- the cycle -------------------------------------------------------------
    async def cycle(self) -> None:
        """One cycle of the plan, from rollout to the KV cache's return, the engine's
        ``generate`` and the trainer's ``train_step`` doing the work of rollout and train:
        the walk :meth:`to_train` and :meth:`to_rollout` make, with colo's own work where
        an embedded loop does its own."""
        await self.run_phase(Phase.ROLLOUT)
        await self._walk(self._handoff(Phase.TRAIN)[:-1])
        await self.run_phase(Phase.TRAIN)
        await self._walk(self._handoff(Phase.ROLLOUT)[:-1])

    # -- the handoff inside the caller's loop ------------------------------------------
    async def to_train(self, *, reward: float | None = None, tokens: int | None = None) -> None:
        """Hand the GPU to the trainer: close the caller's rollout (with its mean ``reward``
        and generated ``tokens``, where given: the trace's ``rollout.finished``), release the
        engine's memory, onload the trainer, and enter ``train``, left open for the caller's
        step until :meth:`to_rollout`. From ``failed`` it starts with the release (the engine
        stays stale until the next sync); a rollout entered without one in between is left at
        once. Each phase is checked and traced as in :meth:`cycle`."""
        if (reward is None) != (tokens is None):
            raise ValueError(f"to_train: give reward and tokens together or neither, got reward={reward!r}, "
                             f"tokens={tokens!r}")
        if reward is not None:
            if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
                raise ValueError(f"to_train: reward must be a finite number, got {reward!r}")
            if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
                raise ValueError(f"to_train: tokens must be an integer >= 0, got {tokens!r}")
            if self._open is None or self._open[0] is not Phase.ROLLOUT:
                raise ValueError(f"to_train: reward and tokens are those of the caller's rollout, which "
                                 f"to_rollout() opens; the phase is {self.phase or 'not started'}")
        if self.phase is Phase.TRAIN:
            raise IllegalTransition(self.phase, "to_train", Phase.TRAIN, allowed_triggers(self.phase))
        if reward is not None:
            self.last_rollout = RolloutResult(float(reward), tokens)
            for r in range(self.world_size):
                self._emit(r, "rollout.finished", mem=None, step=self.step, reward=float(reward), tokens=tokens)
        await self._hand_over(Phase.TRAIN)

    async def to_rollout(self) -> None:
        """Hand the GPU back to the engine: close the caller's train step (a new weight
        version), then the plan's phases up to ``rollout``: offload, wake the engine's
        weights, sync and verify, bring the KV cache back; ``rollout`` is entered and left
        open for the caller's generation until :meth:`to_train`. From a fresh start with a
        stale engine, or from ``failed``, the engine is synced from the trainer's copy first."""
        if self.phase is Phase.ROLLOUT:
            raise IllegalTransition(self.phase, "to_rollout", Phase.ROLLOUT, allowed_triggers(self.phase))
        await self._hand_over(Phase.ROLLOUT)

    def _handoff(self, target: Phase) -> tuple[Phase, ...]:
        return handoff_path(self.order, self.phase, target, engine_current=not self.stale)

    async def _hand_over(self, target: Phase) -> None:
        if self._open is not None:
            await self._close_open(None)
        path = self._handoff(target)
        await self._walk(path[:-1])
        await self._open_phase(path[-1])

    async def _walk(self, phases: Sequence[Phase]) -> None:
        """Run ``phases`` in order; a caller's phase met on the way (a rollout between a
        recovery and the release) is entered and left at once, with no work in it."""
        for phase in phases:
            if phase in CALLER_PHASES:
                await self._open_phase(phase)
                await self._close_open(None)
            else:
                await self.run_phase(phase)

    async def recover(self) -> None:
        """From ``failed`` (or a fresh start with a stale engine) back to a synced engine."""
        if self.phase not in (Phase.FAILED, None):
            raise IllegalTransition(self.phase, "recover", Phase.ENGINE_RELEASE, allowed_triggers(self.phase))
        for phase in RECOVERY[1:-1]:  # engine_release .. engine_wake_kv; the next cycle rolls out
            await self.run_phase(phase)

    async def replace_engine(self, engine: Any, rank: int = 0) -> None:
        """Swap in a new engine process for one that died; only from ``failed``.

        The ledger keeps describing the same engine regions, so the new process
        is brought to what the ledger says (it starts with every tag resident:
        the tags the ledger has paused are released on it). It is stale until
        :meth:`recover` syncs it.
        """
        if self.phase is not Phase.FAILED:
            raise IllegalTransition(self.phase, "replace_engine", Phase.FAILED, allowed_triggers(self.phase))
        old, new = self.engines[rank].tag_bytes(), engine.tag_bytes()
        if old != new:
            raise ValueError(f"the new engine's memory tags {new} differ from the old engine's {old}")
        release = self.effects[Phase.ENGINE_RELEASE]
        paused = [t for t in release.pause if not self.memories[rank].is_resident(f"engine.{t}")
                  and f"engine.{t}" in self.memories[rank].regions]
        await engine.set_weight_version(None)
        if paused:
            await engine.flush_cache()
            await engine.release(paused)
        self.engines.replace(rank, engine)
        self.engine_version = None

    async def run_phase(self, target: Phase) -> Any:
        """Enter ``target``, do its work (rollout and train: the engine's ``generate``, the
        trainer's ``train_step``) under its deadline, and finish it. A caller's phase still
        open is closed first."""
        if self._open is not None:
            await self._close_open(None)
        t0 = self._enter(target)
        deadline = anyio.CancelScope()  # only for the question below: was it the deadline?
        try:
            with anyio.fail_after(self.config.deadline(target)) as deadline:
                before = self._before.get(target)
                if before is not None:
                    before()
                beside = self._beside.get(target)
                if beside is None:
                    await self._memory_effects(target)
                else:
                    await side_by_side(self._memory_effects(target), beside())
                work = self._work.get(target)
                result = await work() if work is not None else None
        except BaseException as exc:
            if isinstance(exc, TimeoutError) and deadline.cancel_called:
                # anyio's TimeoutError says nothing: what the caller catches (and prints, and
                # finds in last_error) says which deadline of which phase, as phase.failed does
                late = PhaseDeadline(f"deadline of {self.config.deadline(target)} s exceeded in {target}")
                late.__cause__ = exc
                await self._fail(target, late, t0)
                raise late from exc
            await self._fail(target, exc, t0)
            raise
        self._finish(target, t0)
        return result

    def _enter(self, target: Phase) -> float:
        """Check ``target`` against the table and the invariants on every rank (a refused
        step changes nothing and writes nothing), then move and write ``phase.entered``;
        when it was entered."""
        self._check_traces()  # a write refused while the last phase failed: no further phase
        src = self.machine.phase
        trigger = trigger_for(src, target)
        if next_phase(src, trigger) is not target:
            raise IllegalTransition(src, trigger, target, allowed_triggers(src))
        step = self.step + (1 if target is Phase.ROLLOUT and self._entered_rollout else 0)
        entered = [self.traces[r].record("phase.entered", step=step, from_phase=src.value if src else None,
                                         to_phase=target.value, mem=self.memories[r].snapshot())
                   for r in range(self.world_size)]
        refused = [v for ev in entered for v in self.checker.check(ev) if v.invariant is not None]
        if refused:
            raise InvariantViolation(refused)
        self.machine.fire(trigger, target)
        self.step = step
        for r in range(self.world_size):
            self._emit(r, "phase.entered", mem=entered[r]["mem"], step=step, from_phase=entered[r]["from_phase"],
                       to_phase=target.value)
        self._entered_rollout |= target is Phase.ROLLOUT
        for hook in self.hooks:
            hook.entered(target, step)
        return self._clock()

    def _finish(self, target: Phase, t0: float) -> None:
        if self.effects[target].new_version:
            self.trainer_version += 1  # a train that completed: the weights changed
        for ledger in self.memories:
            ledger.observe()
        self._emit_all("phase.finished", step=self.step, phase=target.value,
                       duration_s=round(self._clock() - t0, 6))
        # a line the disk refused during the phase stops the run now, with every phase it
        # began closed: its work is complete and the checker saw each event (not the file)
        self._check_traces()

    async def _open_phase(self, target: Phase) -> None:
        """Enter a caller's phase and leave it open: the caller does its work (no deadline
        of colo's: the work and its time are the caller's)."""
        t0 = self._enter(target)
        try:
            await self._memory_effects(target)
        except BaseException as exc:
            await self._fail(target, exc, t0)
            raise
        self._open = (target, t0)

    async def _close_open(self, exc: BaseException | None) -> None:
        """Finish the caller's open phase, or, ``exc`` given, record that it failed with it."""
        assert self._open is not None
        phase, t0 = self._open
        self._open = None
        if exc is None:
            self._finish(phase, t0)
        else:
            await self._fail(phase, exc, t0)

    async def _memory_effects(self, phase: Phase) -> None:
        effect = self.effects[phase]
        if effect.pause:
            await self._pause(phase, effect)
        if effect.resume:
            await self._resume(phase, effect)

    async def _fail(self, phase: Phase, exc: BaseException, t0: float) -> None:
        # Shielded: a cancelled scheduler must still drop staging, mark the engine
        # stale and write phase.failed, or the next run trusts a half-loaded engine
        # and the trace never closes the phase.
        self.last_error = exc
        with anyio.CancelScope(shield=True):
            await self._cleanup_after_failure()
            error = describe(exc)
            if isinstance(exc, TimeoutError):
                error = f"deadline of {self.config.deadline(phase)} s exceeded in {phase}"
            fields: dict[str, Any] = {"error_type": "cancelled" if error == "cancelled" else type(exc).__name__}
            if isinstance(exc, OutOfMemory):
                fields.update(oom_tag=exc.tag, oom_requested=exc.requested, oom_free=exc.free)
            rank = getattr(exc, "rank", None)
            if isinstance(rank, int):
                fields["failed_rank"] = rank
            self._emit_all("phase.failed", step=self.step, phase=phase.value, error=error,
                           duration_s=round(self._clock() - t0, 6), **fields)
            for hook in self.hooks:
                hook.failed(phase, self.step)
            self.machine.fire("fail", Phase.FAILED)
            # failed has no work: it is entered and closed at once; the machine
            # stays there until recover().
            self._emit_all("phase.entered", step=self.step, from_phase=phase.value, to_phase=Phase.FAILED.value)
            self._emit_all("phase.finished", step=self.step, phase=Phase.FAILED.value, duration_s=0.0)

    async def _cleanup_after_failure(self) -> None:
        for transport in self.transports:
            with anyio.move_on_after(self.config.cleanup_deadline_s):
                try:
                    await transport.abort()
                except Exception:  # the transport may be what failed; cleanup goes on
                    pass
        for ledger in self.memories:
            ledger.staging = None
        self.engine_version = None
        self._probe_due = False  # a recovery syncs, and probes, again
        self._digests_due = None  # ... and checks its own digests
        self._digests_beside, self._digests_beside_s = False, None
        self._probed = False  # even an engine of live digests: the recovery may bring a replaced one
        for engine in self.engines.ranks:
            with anyio.move_on_after(self.config.cleanup_deadline_s):
                try:
                    await engine.set_weight_version(None)
                except Exception:  # a dead engine is stale by definition
                    pass

    # -- memory effects ----------------------------------------------------------
    def _side(self, owner: str) -> Any:
        return self.engines if owner == "engine" else self.trainers

    def _tags(self, effect: Effect, tags: tuple[str, ...], *, resident: bool) -> list[str]:
        """The tags of ``tags`` that are (resident=True) or are not yet on the device, on every GPU."""
        per_rank = [[t for t in tags if f"{effect.owner}.{t}" in m.regions
                     and m.is_resident(f"{effect.owner}.{t}") == resident] for m in self.memories]
        if any(p != per_rank[0] for p in per_rank):
            raise RuntimeError(f"ranks disagree on which {effect.owner} tags are resident: {per_rank}")
        return per_rank[0]

    async def _pause(self, phase: Phase, effect: Effect) -> None:
        todo = self._tags(effect, effect.pause, resident=True)
        side = self._side(effect.owner)
        if todo:
            if effect.flush_first:
                # Flush before the pages go: a flush afterwards would walk freed memory.
                await side.each("flush_cache")
            await self._each_or_undo(side, effect.verb, todo)
            if effect.owner == "engine" and self.engines.capabilities.pauses_generation \
                    and not self._generation_paused:
                # the engine paused its generation before it released (SGLang's server)
                self._generation_paused = True
                self._emit_all("generation.paused", mem=None, step=self.step)
        for r, ledger in enumerate(self.memories):
            for tag in todo:
                nbytes = ledger.pause(f"{effect.owner}.{tag}", host_copy=effect.host_copy)
                self._emit(r, "memory.paused", owner=effect.owner, tag=tag, bytes=nbytes,
                           host_copy=effect.host_copy, **self._not_freed(effect.owner))

    async def _resume(self, phase: Phase, effect: Effect) -> None:
        todo = self._tags(effect, effect.resume, resident=False)
        for r in range(self.world_size):  # every GPU, before any side effect
            self._check_fits(r, effect.keys(todo), phase)
        if todo:
            await self._each_or_undo(self._side(effect.owner), effect.verb, todo)
        for r, ledger in enumerate(self.memories):
            for tag in todo:
                nbytes = ledger.resume(f"{effect.owner}.{tag}")
                self._emit(r, "memory.resumed", owner=effect.owner, tag=tag, bytes=nbytes,
                           **self._not_freed(effect.owner))

    async def _each_or_undo(self, side: Any, verb: str, tags: list[str]) -> None:
        """``verb(tags)`` on every rank of ``side``. Where some ranks failed it, the ranks that
        did it are brought back (:data:`~colo.core.phases.UNDO`; shielded, each bounded by the
        cleanup deadline, a rank that cannot be is left to the recovery's replacement): the
        ledgers change only when every rank did it, so each live rank is what its ledger says."""
        try:
            await side.each(verb, tags)
        except RankFailed as exc:
            done = [r for r, outcome in exc.outcomes.items() if outcome == "ok"]
            with anyio.CancelScope(shield=True):
                for r in done:
                    with anyio.move_on_after(self.config.cleanup_deadline_s):
                        try:
                            await getattr(side[r], UNDO[verb])(tags)
                        except Exception:  # that rank's engine or trainer failed too: the recovery sees it
                            pass
            raise

    def _not_freed(self, owner: str) -> dict:
        """For an engine whose release frees nothing: say so on the event, in its own words."""
        caps = self.engines.capabilities
        if owner != "engine" or caps.frees_memory:
            return {}
        return {"freed": False, "engine_note": caps.note}

    def _check_fits(self, rank: int, keys: Sequence[str], phase: Phase) -> None:
        # All tags of one resume must fit together.
        ledger, need = self.memories[rank], 0
        for key in keys:
            nbytes = ledger.check_resume(key, phase=phase.value)
            if need + nbytes > ledger.free_bytes:
                raise OutOfMemory(phase=phase.value, tag=key, requested=nbytes, free=ledger.free_bytes - need,
                                  total=ledger.total_bytes, in_use=ledger.by_tag(),
                                  rank=rank if self.world_size > 1 else None)
            need += nbytes

    # -- the work of rollout, train and sync ---------------------------------------
    async def _rollout(self) -> RolloutResult:
        results = await self.engines.each("generate", self.step)
        self.last_rollout = results[0]
        if self._generation_paused:
            # the engine continued its paused generation before it generated
            self._generation_paused = False
            self._emit_all("generation.continued", mem=None, step=self.step)
        for r, res in enumerate(results):
            self._emit(r, "rollout.finished", mem=None, step=self.step, reward=res.reward, tokens=res.tokens)
        return results[0]

    async def _train(self) -> Any:
        if self.last_rollout is None:
            raise RuntimeError("train needs a rollout first: no rollout result is held")
        results = await self.trainers.each("train_step", self.last_rollout)
        self.last_train = results[0]
        return self.last_train

    async def _sync(self) -> dict:
        version, step = self.trainer_version, self.step
        # Stale before the first byte moves: if anything below fails the engine
        # must not be trusted, whatever it already loaded.
        self.engine_version = None
        await self.engines.each("set_weight_version", None)
        source = "device" if self.memory.is_resident("trainer.weights") else "host"
        ctxs = [SyncContext(step=step, weight_version=version, bucket_bytes=self.config.bucket_bytes,
                            source=source, staging=m.staging_budget(rank=r if self.world_size > 1 else None),
                            clock=self._clock, flush_cache=True) for r, m in enumerate(self.memories)]
        self._stages_written = [0] * self.world_size
        for r, ctx in enumerate(ctxs):
            # a sender in this process: its records are written as they happen
            ctx.on_stage = lambda rec, r=r: self._write_stage(r, rec, live=True)
            # the engine's own sub-state inside the sync (its weight-update session)
            ctx.on_mark = lambda event, r=r: self._emit(r, event, step=step)
        adapters = self.engines.capabilities.adapters
        if adapters:
            # the new version is staged beside the one serving, which serves on if this fails
            self._emit_all("adapter.staging", mem=None, step=step, weight_version=version)
        t0 = self._clock()
        with collector_paused():
            results = await self._transfer(ctxs)
            # The prefix cache holds KV computed with the old weights: flush after the
            # last load, so nothing computed before the change survives into rollout. A
            # transport whose engine flushed as it ended the load saves the round trip; a
            # second flush is harmless, so one rank that did not means every rank again.
            if not all(res.cache_flushed for res in results):
                await self.engines.each("flush_cache")
        transfer_s = self._clock() - t0
        # Verification is its own span (verify_s): a digest reads every engine weight,
        # which for a small model costs more than moving it; --verify first|none skips it.
        digests: list[str | None] = [None] * self.world_size
        verify_s: float | None = None
        verify_parts: dict | None = None
        if self._verifies_next():
            t1 = self._clock()
            deferred = self._verify is not None and self._check_at_offload(source)
            digest_s: float | None = None
            if deferred and self._digests_beside_offload():
                self._digests_beside = True  # taken and checked in trainer_offload
            else:
                digests = list(await self.engines.each("digest"))
                digest_s = self._clock() - t1
                if deferred:
                    self._digests_due = list(digests)
                elif self._verify is not None:
                    await self._verify(list(digests))
            t2 = self._clock()
            caps = self.engines.capabilities
            probing = self._probe is not None and not (caps.digest_live and self._probed)
            if probing:
                # an engine whose probe runs through its KV cache (vLLM) answers it once the
                # cache is back: engine_wake_kv, before any rollout can happen
                self._probe_due = caps.probe_needs_kv and not self.memory.is_resident("engine.kv_cache")
                if not self._probe_due:
                    await self._probe()
                    self._probed = True
            verify_s = round(self._clock() - t1, 6)
            # where verification's time goes: the engines' digests (a read of every weight on
            # the device, and the round trip), the trainer's side and the probe (None: not
            # probed, the digest of live weights vouching for them; see _probed)
            # (trainer_check_s None: the check waits for the trainer's offload, digest.checked)
            # (engine_digest_s None: taken beside the trainer's offload, digest.checked)
            verify_parts = {"engine_digest_s": None if digest_s is None else round(digest_s, 6),
                            "trainer_check_s": None if deferred else round(t2 - t1 - digest_s, 6),
                            "probe_s": round(self._clock() - t2, 6) if probing else None}
            self._verified += 1
        # an adapter engine activates the staged version here: every rank has it, verified
        await self.engines.each("set_weight_version", version)
        self.engine_version = version
        if adapters:
            self._emit_all("adapter.activated", mem=None, step=step, weight_version=version)
        params = len(self.trainers.first("param_specs"))
        events = [self._emit(r, "sync.finished", step=step, bytes=res.bytes, buckets=res.buckets,
                             tensors=res.tensors, params=params, duration_s=round(self._clock() - t0, 6),
                             transfer_s=round(transfer_s, 6), verify_s=verify_s, verify_parts=verify_parts,
                             weight_version=version, digest=digests[r], cache_flushed=True, source=source,
                             **({"target": "adapter"} if adapters else {}))
                  for r, res in enumerate(results)]
        self.last_sync = events[0]
        return self.last_sync

    def _verifies_next(self) -> bool:
        """Whether the next sync is verified (``SchedulerConfig.verify``: every one, the first only, none)."""
        return self.config.verify == "every" or (self.config.verify == "first" and not self._verified)

    def _want_probe_reference(self) -> None:
        """Before the trainer offloads: whether it takes the probe's reference logits as it goes
        (the verifier's ``want_reference``, :func:`colo.verification.make_verifier`), which only a
        probe while its weights are paused reads: one left for the KV cache's return, or that of
        a verified sync before the trainer's next onload (``offload-first``, a recovery). Not at
        a ``sync-first`` offload, after the sync probed the resident weights: a forward of the
        probe batch and its logits to the host, with the weights' digest it made every verified
        offload 30-110 ms longer than a plain pause at Qwen2-1.5B on an H200 (issue 44)."""
        want = getattr(self._probe, "want_reference", None)
        if want is None:
            return
        verifies = self._verifies_next()
        # Not only where the next sync probes: one that fails sends the run through a recovery
        # that probes (the trainer paused all the while), and without its reference the probe
        # would rebuild the model on the host to get it (seconds at 1.5B, the twin then held).
        want(self._probe_due or (verifies and self._sync_before_onload()))

    def _sync_before_onload(self) -> bool:
        """From the trainer's offload: whether a sync comes before its next onload. In the plan's
        order (``offload-first``: yes, ``sync-first``: no), or a recovery's, which syncs a stale
        engine (``engine_version`` None) before anything else."""
        if self.engine_version is None:
            return True
        i = self.order.index(Phase.TRAINER_OFFLOAD)
        for phase in self.order[i + 1:] + self.order[:i]:
            if phase is Phase.SYNC:
                return True
            if phase is Phase.TRAINER_ONLOAD:
                return False
        return False

    def _digests_beside_offload(self) -> bool:
        """Whether a sync whose check waits for the trainer's offload (:meth:`_check_at_offload`)
        leaves the engines' digests to that offload too, taken beside it: engines whose digest
        reads their live weights (``digest_live``) can give it any time until they serve again,
        and the engine is idle while the trainer offloads (0.4 s at Qwen2-1.5B on an H200, 2 s
        at 7B). Inside the sync, the load summed every byte it wrote and its end read the sums
        back: 0.16-0.52 of a sync-first sync at 1.5B (issue 44). One rank, whose engine asks
        for it without arming its next load (``live_digest``: colo's engine client)."""
        if not self.engines.capabilities.digest_live or self.world_size != 1:
            return False
        return callable(getattr(self.engine, "live_digest", None))

    async def _digests_if_due(self) -> None:
        """The engines' digests a sync-first sync left for this offload (_digests_beside_offload),
        taken while the trainer offloads; checked once it has (_check_if_due)."""
        if not self._digests_beside:
            return
        self._digests_beside = False
        t0 = self._clock()
        self._digests_due = list(await self.engines.each("live_digest"))
        self._digests_beside_s = round(self._clock() - t0, 6)

    def _check_at_offload(self, source: str) -> bool:
        """Whether a verified sync's digests wait for the trainer's offload: a sync from the
        resident weights (``sync-first``) whose plan offloads them next, by trainers that take
        the digest of their weights as they offload them (:meth:`BaseTrainer.digest_at_offload
        <colo.trainers.base.BaseTrainer.digest_at_offload>`). The trainer would otherwise read
        every weight twice per cycle, once for the check inside the sync and once more as it
        offloads (4.8 to 22 ms at 1.5B on an H200, most of what verification added to a
        ``sync-first`` sync: issue 44). The engines' digests are taken inside the sync, as
        always (each engine's record of what it received); the comparison runs in
        ``trainer_offload``, before the KV cache returns and any rollout, and a mismatch
        fails that phase, which marks every engine rank stale."""
        if source != "device" or self.engines.capabilities.adapters:
            # (an adapter sync activates the new version only once its digests are checked)
            return False
        if not offload_follows_sync(self.order, self.effects):
            return False
        for trainer in self.trainers.ranks:
            # looked up on the class: a rank's proxy answers any attribute with a remote call
            ask = getattr(type(trainer), "digest_at_offload", None)
            if not callable(ask) or ask(trainer) is not True:
                return False
        return True

    async def _check_if_due(self) -> None:
        """The digests a ``sync-first`` sync left for the trainer's offload (:meth:`_check_at_offload`),
        checked now that the trainer took its own; ``digest.checked`` says so and how long."""
        digests, self._digests_due = self._digests_due, None
        beside_s, self._digests_beside_s = self._digests_beside_s, None
        if digests is None or self._verify is None:
            return
        t0 = self._clock()
        await self._verify(list(digests))
        took = round(self._clock() - t0, 6)
        for r in range(self.world_size):
            # the engines' digests where they were taken beside this offload (sync.finished has none)
            extra = {} if beside_s is None else {"digest": digests[r], "engine_digest_s": beside_s}
            self._emit(r, "digest.checked", step=self.step, weight_version=self.engine_version,
                       duration_s=took, **extra)

    async def _probe_if_due(self) -> None:
        """The probe a verified sync left for the KV cache's return. A mismatch fails this
        phase, which marks the engine stale: no rollout runs on weights it did not pass."""
        if not self._probe_due:
            return
        self._probe_due = False
        t0 = self._clock()
        await self._probe()
        self._probed = True
        self._emit_all("probe.finished", step=self.step, weight_version=self.engine_version,
                       duration_s=round(self._clock() - t0, 6))

    async def _transfer(self, ctxs: list[SyncContext]) -> list[SyncResult]:
        """Every rank's transport moves its sync at once; their stage records come
        back as data and are written here, also those of a sync that failed."""
        for ledger, ctx in zip(self.memories, ctxs):
            ledger.staging = ctx.staging  # live view for snapshots taken meanwhile
        calls = [(lambda r=r: self.transports[r].sync(self.trainers[r], self.engines[r], ctxs[r]))
                 for r in range(self.world_size)]
        failed = True
        try:
            results, _ = await together(calls, "sync", "transport.sync")
            failed = False
            for r, (ctx, res) in enumerate(zip(ctxs, results)):
                if res.stages and not ctx.stages:  # a sender elsewhere (an actor): its stages came back as data
                    ctx.stages[:] = res.stages
        finally:
            with anyio.CancelScope(shield=True):
                self._write_stages(ctxs, raise_violations=not failed)
        for r, (ledger, ctx) in enumerate(zip(self.memories, ctxs)):
            ledger.staging = None
            if ctx.staging.held_bytes:
                raise RuntimeError(f"transport {self.transports[r].name} left {ctx.staging.held_bytes} "
                                   "staging bytes allocated after sync")
        return results

    def _write_stage(self, rank: int, rec: Any, *, live: bool) -> None:
        # live: the ledger's staging is the budget the record was taken from, so
        # the snapshot is what the device holds now; else the record's own count
        mem = self.memories[rank].snapshot() if live else self.memories[rank].snapshot(staging=rec.staging_bytes)
        self._stages_written[rank] += 1
        self._emit(rank, "bucket.finished", at=None if live else rec.at, mem=mem, step=self.step,
                   bucket=rec.bucket, stage=rec.stage, bytes=rec.bytes, tensors=rec.tensors,
                   duration_s=round(rec.duration_s, 6))

    def _write_stages(self, ctxs: list[SyncContext], *, raise_violations: bool) -> None:
        """The records no one wrote as they happened (a remote sender's)."""
        for r, (ledger, ctx) in enumerate(zip(self.memories, ctxs)):
            ctx.on_stage = None
            for rec in ctx.stages[self._stages_written[r]:]:
                try:
                    self._write_stage(r, rec, live=False)
                except InvariantViolation:
                    if raise_violations:
                        raise
            ledger.note_staging_peak(getattr(ctx.staging, "peak_bytes", 0))
