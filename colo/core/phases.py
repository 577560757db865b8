"""The phase table: the one file that decides everything about phases.

Transitions are data. ``TRANSITIONS`` maps a phase and a trigger to the next
phase; the three named plans of the design card and the recovery path are
sequences of phases that must walk only edges of that table. Nothing here does
I/O or imports torch, anyio or the memory saver: replay and tuning reuse it
offline.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


class Phase(str, enum.Enum):
    ROLLOUT = "rollout"
    ENGINE_RELEASE = "engine_release"
    TRAINER_ONLOAD = "trainer_onload"
    TRAIN = "train"
    TRAINER_OFFLOAD = "trainer_offload"
    ENGINE_WAKE_WEIGHTS = "engine_wake_weights"
    SYNC = "sync"
    ENGINE_WAKE_KV = "engine_wake_kv"
    FAILED = "failed"

    def __str__(self) -> str:  # so f-strings and error messages show the bare name
        return self.value


P = Phase

# The trigger that enters each phase in normal operation. ``fail`` and
# ``recover`` are the two triggers that do not simply name their target.
_ENTER = {
    P.ROLLOUT: "rollout",
    P.ENGINE_RELEASE: "release_engine",
    P.TRAINER_ONLOAD: "onload_trainer",
    P.TRAIN: "train",
    P.TRAINER_OFFLOAD: "offload_trainer",
    P.ENGINE_WAKE_WEIGHTS: "wake_weights",
    P.SYNC: "sync",
    P.ENGINE_WAKE_KV: "wake_kv",
}

# Plans: the order of one cycle, starting at rollout. Each must walk only
# edges of TRANSITIONS and close back onto its first phase.
PLANS: dict[str, tuple[Phase, ...]] = {
    # slime's order: the trainer is on the CPU during sync; each bucket is
    # uploaded from the pinned copy, so the sync peak is engine weights + 2 buckets.
    "offload-first": (
        P.ROLLOUT, P.ENGINE_RELEASE, P.TRAINER_ONLOAD, P.TRAIN,
        P.TRAINER_OFFLOAD, P.ENGINE_WAKE_WEIGHTS, P.SYNC, P.ENGINE_WAKE_KV,
    ),
    # verl's order: sync from GPU-resident trainer weights, then offload.
    "sync-first": (
        P.ROLLOUT, P.ENGINE_RELEASE, P.TRAINER_ONLOAD, P.TRAIN,
        P.ENGINE_WAKE_WEIGHTS, P.SYNC, P.TRAINER_OFFLOAD, P.ENGINE_WAKE_KV,
    ),
    # Legal, but the KV cache is resident while the buckets are staged, so its
    # peak is the highest: this is why the multi-stage wake-up exists.
    "single-stage": (
        P.ROLLOUT, P.ENGINE_RELEASE, P.TRAINER_ONLOAD, P.TRAIN,
        P.TRAINER_OFFLOAD, P.ENGINE_WAKE_WEIGHTS, P.ENGINE_WAKE_KV, P.SYNC,
    ),
}

# After a failure: release whatever the engine still holds, make sure the
# trainer's copy is on the host (the source that survives), then the
# offload-first tail re-syncs and brings the KV cache back.
RECOVERY: tuple[Phase, ...] = (
    P.FAILED, P.ENGINE_RELEASE, P.TRAINER_OFFLOAD, P.ENGINE_WAKE_WEIGHTS,
    P.SYNC, P.ENGINE_WAKE_KV, P.ROLLOUT,
)


def _build_table() -> dict[Phase, dict[str, Phase]]:
    table: dict[Phase, dict[str, Phase]] = {p: {} for p in Phase}
    for order in PLANS.values():
        cycle = order + order[:1]
        for a, b in zip(cycle, cycle[1:]):
            table[a][_ENTER[b]] = b
    for a, b in zip(RECOVERY, RECOVERY[1:]):
        table[a]["recover" if a is P.FAILED else _ENTER[b]] = b
    for p in Phase:
        if p is not P.FAILED:
            table[p]["fail"] = P.FAILED
    return table


#: phase -> {trigger: next phase}. The single source of truth.
TRANSITIONS: dict[Phase, dict[str, Phase]] = _build_table()

#: Phases a fresh scheduler may enter first: rollout when the engine was
#: started from the trainer's checkpoint, or the recovery path's release.
INITIAL: frozenset[Phase] = frozenset({P.ROLLOUT, P.ENGINE_RELEASE})


class IllegalTransition(ValueError):
    """A transition the table does not allow; the machine did not move."""

    def __init__(self, current: Phase | None, trigger: str, target: Phase | None):
        self.current, self.trigger, self.target = current, trigger, target
        allowed = sorted(TRANSITIONS[current]) if current is not None else sorted(_ENTER[p] for p in INITIAL)
        super().__init__(
            f"illegal transition from phase {current or 'start'!s} on trigger {trigger!r} "
            f"to {target or '?'!s}; allowed triggers from {current or 'start'!s}: {', '.join(allowed)}"
        )


def parse_phase(name: str) -> Phase:
    try:
        return Phase(name)
    except ValueError:
        raise ValueError(
            f"unknown phase {name!r}; expected one of {', '.join(p.value for p in Phase)}"
        ) from None


def is_legal(current: Phase | None, target: Phase) -> bool:
    if current is None:
        return target in INITIAL
    return target in TRANSITIONS[current].values()


def trigger_for(current: Phase | None, target: Phase) -> str:
    """The trigger that moves ``current`` to ``target`` (for messages and the machine)."""
    if current is not None:
        for trig, dst in TRANSITIONS[current].items():
            if dst is target:
                return trig
    return "fail" if target is P.FAILED else _ENTER.get(target, "recover")


def validate_plan(plan: str | Sequence[Phase | str]) -> tuple[Phase, ...]:
    """Resolve a plan name or an explicit order; raise ValueError naming what is wrong.

    An explicit order is accepted only if it is one of the named plans: the
    table allows some walks (recovery edges) that are not a sound cycle.
    """
    if isinstance(plan, str):
        if plan not in PLANS:
            raise ValueError(f"unknown plan {plan!r}; expected one of {', '.join(PLANS)}")
        return PLANS[plan]
    order = tuple(parse_phase(p) if isinstance(p, str) else p for p in plan)
    cycle = order + order[:1]
    for a, b in zip(cycle, cycle[1:]):
        if not is_legal(a, b):
            raise ValueError(f"plan step {a} -> {b} is not in the phase table")
    for name, known in PLANS.items():
        if order == known:
            return known
    raise ValueError(
        "plan " + " -> ".join(p.value for p in order)
        + f" is not one of the accepted plans ({', '.join(PLANS)})"
    )


def plan_name(order: Sequence[Phase]) -> str:
    for name, known in PLANS.items():
        if tuple(order) == known:
            return name
    raise ValueError("not a named plan: " + " -> ".join(p.value for p in order))


@dataclass
class PhaseMachine:
    """The current phase and nothing else; moves only along the table."""

    phase: Phase | None = None

    def fire(self, trigger: str, target: Phase | None = None) -> Phase:
        if self.phase is None:
            dst = next((p for p in INITIAL if _ENTER[p] == trigger), None)
        else:
            dst = TRANSITIONS[self.phase].get(trigger)
        if dst is None or (target is not None and dst is not target):
            raise IllegalTransition(self.phase, trigger, target or dst)
        self.phase = dst
        return dst

    def go(self, target: Phase) -> Phase:
        return self.fire(trigger_for(self.phase, target), target)


def edges() -> Iterable[tuple[Phase, str, Phase]]:
    for src, row in TRANSITIONS.items():
        for trig, dst in row.items():
            yield src, trig, dst


def mermaid() -> str:
    """The README's diagram, generated from the table so it cannot drift."""
    lines = ["stateDiagram-v2"]
    lines += [f"    [*] --> {p.value}" for p in sorted(INITIAL, key=list(Phase).index)]
    for src, trig, dst in edges():
        if dst is P.FAILED:
            continue  # every phase can fail: one note instead of eight arrows
        lines.append(f"    {src.value} --> {dst.value}: {trig}")
    lines.append("    note right of failed: every phase --> failed on error, deadline or cancel")
    return "\n".join(lines) + "\n"
