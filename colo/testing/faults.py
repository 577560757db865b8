"""Fault injection: make one phase of a real run fail, once, on purpose.

``Fault.parse("kill-engine@sync")`` names what goes wrong and where; a
:class:`FaultInjector` wraps the real objects a run uses (the engine client,
the trainer, the memory ledger, the scheduler's cancel scope) so that the
named phase really fails the way it would in production:

- ``kill-engine`` — the engine process is killed (SIGKILL) when the phase
  first calls it; in ``sync`` after the first bucket was loaded, so the engine
  holds half-updated weights when it dies.
- ``raise`` — the phase's callee raises; in ``sync`` the receiver's load of the
  second bucket raises, after the first bucket was loaded into the engine.
- ``deadline`` — the phase's callee hangs; the phase's own deadline, set short
  (``Fault.deadline_s``) for the faulted occurrence of the phase only, cancels it.
- ``oom`` — something else takes every free byte of the device as the phase
  starts (the ledger's resident R grows, as a fragmented allocator cache or a
  neighbour process would make it), so the phase's first allocation raises
  :class:`~colo.core.memory.OutOfMemory`; the bytes come back once the failure is
  recorded.
- ``cancel`` — the scheduler's task scope is cancelled from inside the phase.

Every fault acts *before* the wrapped call reaches the trainer, so a failed
phase never writes to the trainer's weights: whatever the engine holds, the
trainer's copy is the truth recovery restores from. The injector fires once
(the first occurrence of the phase at step >= ``Fault.step``) and is inert
afterwards, so the run can recover and continue.

The injector is told the engine by its name in :data:`colo.engine.ENGINES` and asks of it
only the lifecycle verbs its entry declares: ``kill`` to kill it, ``alive`` to see it dead.
Whether an engine can be killed at all is its entry's limit, checked with the run's
configuration (:func:`kills_engine`, :meth:`colo.engine.EngineEntry.check`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.lowlevel

from colo.core.phases import EFFECTS, Phase
from colo.core.errors import InjectedFault

KINDS = ("kill-engine", "raise", "deadline", "oom", "cancel")

_ALL = tuple(p.value for p in Phase if p is not Phase.FAILED)
#: the call that does each phase's work (what a fault makes fail): the table's own
CALLEE: dict[str, tuple[str, str]] = {p.value: (EFFECTS[p].owner, EFFECTS[p].verb) for p in Phase
                                      if p is not Phase.FAILED}
#: where each kind can happen, read off the table: the engine can only be seen
#: dying where the phase calls it; memory can only run out where the phase
#: brings something onto the device.
POSSIBLE: dict[str, tuple[str, ...]] = {
    "kill-engine": tuple(p for p in _ALL if EFFECTS[Phase(p)].owner == "engine"),
    "raise": _ALL,
    "deadline": _ALL,
    "oom": tuple(p for p in _ALL if EFFECTS[Phase(p)].resume or EFFECTS[Phase(p)].allocates),
    "cancel": _ALL,
}

def kills_engine(fault: Fault | None) -> bool:
    """The fault kills the engine (its engine must have ``kill`` in its lifecycle)."""
    return fault is not None and fault.kind == "kill-engine"


#: in sync the fault waits for this many bucket loads first: the engine is
#: then really half-updated (``end_load`` is the fallback for one-bucket syncs)
SYNC_LOADS_FIRST = 1


@dataclass(frozen=True, kw_only=True)
class Fault:
    kind: str
    phase: str
    #: inject at the first occurrence of ``phase`` at this step or later
    step: int = 0
    #: the faulted phase's deadline (``deadline`` faults only), in force for the faulted
    #: occurrence of the phase alone (see :meth:`FaultInjector.entered`)
    deadline_s: float = 30.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; expected one of {', '.join(KINDS)}")
        if self.phase not in _ALL:
            raise ValueError(f"unknown fault phase {self.phase!r}; expected one of {', '.join(_ALL)}")
        if self.phase not in POSSIBLE[self.kind]:
            raise ValueError(f"fault {self.kind} cannot happen at {self.phase}; {self.kind} is possible at "
                             f"{', '.join(POSSIBLE[self.kind])}")
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0:
            raise ValueError(f"fault step must be an integer >= 0, got {self.step!r}")
        if not isinstance(self.deadline_s, (int, float)) or not self.deadline_s > 0:
            raise ValueError(f"fault deadline must be > 0 seconds, got {self.deadline_s!r}")

    @classmethod
    def parse(cls, text: str, **kw: Any) -> Fault:
        """``KIND@PHASE``, e.g. ``kill-engine@sync``."""
        if not isinstance(text, str) or text.count("@") != 1:
            raise ValueError(f"fault must be KIND@PHASE (e.g. kill-engine@sync), got {text!r}; "
                             f"KIND is one of {', '.join(KINDS)}")
        kind, phase = text.split("@")
        return cls(kind=kind.strip(), phase=phase.strip(), **kw)

    def __str__(self) -> str:
        return f"{self.kind}@{self.phase}"


class FaultInjector:
    """Wraps a run's trainer and engine; fires ``fault`` once, in its phase.

    ``attach(sched)`` after the scheduler exists (the injector reads its phase
    and step, and watches its trace); ``scope`` is the cancel scope around the
    scheduler's work, for ``cancel`` faults.
    """

    def __init__(self, fault: Fault, *, on_fire: Callable[[], None] | None = None, engine: str = "colo"):
        from colo.engine import engine_entry

        self.fault = fault
        #: the engine's registry entry: the lifecycle verbs it may be asked for
        self.entry = engine_entry(engine)
        if kills_engine(fault) and "kill" not in self.entry.lifecycle:
            raise ValueError(f"fault {fault}: --engine {engine} cannot be killed on its own")
        self.fired = False
        self.fired_step: int | None = None
        self.scope: anyio.CancelScope | None = None
        self._sched: Any = None
        self._on_fire = on_fire
        self._sync_loads = 0
        self._squat = 0
        self._squat_step: int | None = None
        #: why an ``oom`` fault failed nothing: its phase ran with every free byte taken and
        #: allocated none (an engine that takes no memory back there, as vLLM on a CPU)
        self.missed: str | None = None
        self._engine: Any = None
        #: the scheduler's config before a ``deadline`` fault shortened the faulted phase's
        self._config: Any = None

    # -- wiring ------------------------------------------------------------------
    def wrap_engine(self, engine: Any) -> Any:
        self._engine = engine
        return _Wrapped(engine, self, "engine")

    def wrap_trainer(self, trainer: Any) -> Any:
        return _Wrapped(trainer, self, "trainer")

    def attach(self, sched: Any) -> None:
        self._sched = sched
        sched.hooks.append(self)

    def _armed(self) -> bool:
        s = self._sched
        return (not self.fired and self.missed is None and s is not None and s.phase is not None
                and s.phase.value == self.fault.phase and s.step >= self.fault.step)

    # -- PhaseHooks: called by the scheduler, outside the trace writer -------------
    def entered(self, phase: Phase, step: int) -> None:
        if self._squat:
            # the phase an oom fault squatted ended without failing: it allocated nothing, so
            # no OOM can be injected there; said at the end of the run (check_fault_fired),
            # and the neighbour's bytes go back now, not at some later failure
            self._sched.memory.reserved_bytes -= self._squat
            self._squat = 0
            self.missed = f"{self.fault.phase} at step {self._squat_step} allocated nothing on the device"
        if phase.value != self.fault.phase:
            return
        self._sync_loads = 0
        if self.fault.kind == "deadline" and self._armed():
            # The short deadline is for this occurrence of the phase alone (the scheduler
            # reads it after this hook): set for the whole run, it failed the recovery's
            # and the next cycle's normal phases on a busy machine, where a real rollout
            # or sync takes longer than a deadline meant to fire at once.
            self._config = self._sched.config
            self._sched.config = dataclasses.replace(
                self._config, deadlines={**self._config.deadlines, phase.value: float(self.fault.deadline_s)})
        if self.fault.kind == "oom" and self._armed():
            mem = self._sched.memory
            # a neighbour takes every free byte: the phase's first allocation fails
            self._squat = mem.free_bytes
            self._squat_step = self._sched.step
            mem.reserved_bytes += self._squat
            # fired once the phase fails on it (failed); one that allocates nothing is missed

    def failed(self, phase: Phase, step: int) -> None:
        if self._config is not None:
            self._sched.config, self._config = self._config, None
        if self._squat:
            self._sched.memory.reserved_bytes -= self._squat
            self._squat = 0
            self._fire()

    def _fire(self) -> None:
        self.fired = True
        self.fired_step = self._sched.step
        if self._on_fire is not None:
            self._on_fire()

    # -- the faults --------------------------------------------------------------
    async def before(self, side: str, method: str) -> None:
        """Called before ``side.method`` runs; may act instead of letting it run."""
        if not self._armed() or CALLEE[self.fault.phase] != (side, method) and not (
                self.fault.phase == "sync" and method == "end_load"):
            return
        kind = self.fault.kind
        if kind == "oom":
            return  # acted at phase entry
        if self.fault.phase == "sync" and method == "transport_load":
            self._sync_loads += 1
            if self._sync_loads <= SYNC_LOADS_FIRST:
                return
        self._fire()
        if kind == "kill-engine":
            engine = self._engine
            engine.kill()
            # seen dead before the call goes out, so the caller sees a dead engine (alive()
            # reaps a killed process; a vLLM's monitor notices its worker's death)
            with anyio.move_on_after(10):
                while "alive" in self.entry.lifecycle and engine.alive():
                    await anyio.sleep(0.02)
        elif kind == "raise":
            where = "the receiver's load of a bucket after the first" if self.fault.phase == "sync" else \
                f"{side}.{method}"
            raise InjectedFault(f"injected fault in {self.fault.phase}: {where} raised")
        elif kind == "deadline":
            # hang; the phase's deadline cancels this
            await anyio.sleep(self.fault.deadline_s * 10 + 60)
            raise InjectedFault(f"injected deadline fault in {self.fault.phase}: the deadline did not fire")
        elif kind == "cancel":
            if self.scope is None:
                raise RuntimeError("cancel fault: no cancel scope attached to the injector")
            self.scope.cancel()
            await anyio.lowlevel.checkpoint()


class _Wrapped:
    """The real object, with its phase callees routed through the injector first."""

    _HOOKED = {"engine": {"generate", "release", "resume", "transport_load", "end_load"},
               "trainer": {"onload", "train_step", "offload"}}

    def __init__(self, target: Any, injector: FaultInjector, side: str):
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_injector", injector)
        object.__setattr__(self, "_side", side)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._target, name)
        if name not in self._HOOKED[self._side]:
            return attr
        injector, side = self._injector, self._side

        async def call(*args: Any, **kw: Any) -> Any:
            if name == "transport_load" and kw.get("end"):
                # a sync's last load carrying its end goes as the load and then the end,
                # so a fault in sync still fires after a bucket loaded (at the end of
                # a one-bucket sync) and leaves the engine really half-updated
                flush = kw.pop("flush_cache", False)
                kw.pop("end")
                reply = await call(*args, **kw)
                await self.end_load(flush_cache=flush)
                return {**reply, "ended": True}
            await injector.before(side, name)
            return await attr(*args, **kw)

        return call

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._target, name, value)

    @property
    def unwrapped(self) -> Any:
        return self._target


__all__ = ["CALLEE", "Fault", "FaultInjector", "InjectedFault", "KINDS", "POSSIBLE", "kills_engine"]
