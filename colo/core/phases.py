"""The phase table: the one file that decides everything about phases.

Three things are written out here as data, side by side, and nothing else in
colo restates them:

- ``TRANSITIONS``: phase x trigger -> phase (h11's ``_state.py`` is the model);
- ``EFFECTS``: what each phase does to memory (tags paused and resumed, per
  owner, in order), which side's verb does its work, and what must hold before
  it is entered (invariants 1-3);
- ``PLANS`` and ``RECOVERY``: the accepted orders, which must walk only edges of
  the table (checked at import);
- ``SUBSTATES``: an engine's own states inside colo's phases (SGLang's weight-update
  session, its paused generation), where each may open and close and which events
  each allows, for engines that declare it.

The scheduler applies ``EFFECTS`` generically, the invariant checker evaluates
their ``needs``, ``colo tune``'s what-if replays them, and the fault injector
reads where each kind of fault can happen from them. Nothing here does I/O or
imports torch, anyio or the memory saver.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from colo.core.errors import IllegalTransition


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

#: phase -> {trigger: next phase}. The single source of truth; every phase but
#: ``failed`` can ``fail``, and ``failed`` leaves only by ``recover``.
TRANSITIONS: dict[Phase, dict[str, Phase]] = {
    P.ROLLOUT: {"release_engine": P.ENGINE_RELEASE, "fail": P.FAILED},
    P.ENGINE_RELEASE: {"onload_trainer": P.TRAINER_ONLOAD, "offload_trainer": P.TRAINER_OFFLOAD,
                       "fail": P.FAILED},
    P.TRAINER_ONLOAD: {"train": P.TRAIN, "fail": P.FAILED},
    P.TRAIN: {"offload_trainer": P.TRAINER_OFFLOAD, "wake_weights": P.ENGINE_WAKE_WEIGHTS, "fail": P.FAILED},
    P.TRAINER_OFFLOAD: {"wake_weights": P.ENGINE_WAKE_WEIGHTS, "wake_kv": P.ENGINE_WAKE_KV, "fail": P.FAILED},
    P.ENGINE_WAKE_WEIGHTS: {"sync": P.SYNC, "wake_kv": P.ENGINE_WAKE_KV, "fail": P.FAILED},
    P.SYNC: {"wake_kv": P.ENGINE_WAKE_KV, "offload_trainer": P.TRAINER_OFFLOAD, "rollout": P.ROLLOUT,
             "fail": P.FAILED},
    P.ENGINE_WAKE_KV: {"rollout": P.ROLLOUT, "sync": P.SYNC, "fail": P.FAILED},
    P.FAILED: {"recover": P.ENGINE_RELEASE},
}

#: The triggers a fresh scheduler may start with: rollout when the engine was
#: started from the trainer's checkpoint, or the recovery path's release.
START: dict[str, Phase] = {"rollout": P.ROLLOUT, "release_engine": P.ENGINE_RELEASE}
INITIAL: frozenset[Phase] = frozenset(START.values())


@dataclass(frozen=True)
class Need:
    """One precondition of entering a phase (invariants 1-3).

    ``kind``: ``resident`` (tag ``key`` is on the device), ``source`` (tag
    ``key`` is on the device or kept on the host), ``current`` (the engine's
    weight version equals the trainer's), ``flushed`` (the prefix cache was
    flushed after the last weight change).
    """

    invariant: int
    kind: str
    key: str = ""


@dataclass(frozen=True)
class Effect:
    """What one phase does. ``owner.verb`` does its work; ``pause``/``resume``
    are that owner's tags, in the order they change."""

    owner: str | None = None
    verb: str | None = None
    pause: tuple[str, ...] = ()
    resume: tuple[str, ...] = ()
    #: paused tags keep their contents on the host (the sync's source)
    host_copy: bool = False
    #: flush the prefix cache before pausing: a flush afterwards would walk freed pages
    flush_first: bool = False
    #: the phase allocates device memory of its own (sync's staging buffers)
    allocates: bool = False
    #: the phase produces a new trainer weight version
    new_version: bool = False
    needs: tuple[Need, ...] = ()

    def keys(self, tags: Iterable[str]) -> tuple[str, ...]:
        return tuple(f"{self.owner}.{t}" for t in tags)


#: a memory verb and the verb that undoes it. A verb that some ranks of a group did and others
#: failed is undone on the ranks that did it: the ledger changes only when every rank did, so
#: every live rank is again what its ledger says (a recovery would otherwise resume a tag one
#: rank already holds, or release one it already gave back)
UNDO: dict[str, str] = {"release": "resume", "resume": "release", "offload": "onload", "onload": "offload"}

#: phase -> its effect. The only place a phase's memory behaviour is written.
EFFECTS: dict[Phase, Effect] = {
    P.ROLLOUT: Effect(owner="engine", verb="generate", needs=(
        Need(1, "current"), Need(1, "resident", "engine.kv_cache"), Need(1, "flushed"))),
    P.ENGINE_RELEASE: Effect(owner="engine", verb="release", pause=("kv_cache", "cuda_graph", "weights"),
                             flush_first=True),
    P.TRAINER_ONLOAD: Effect(owner="trainer", verb="onload", resume=("weights", "optimizer")),
    P.TRAIN: Effect(owner="trainer", verb="train_step", new_version=True, needs=(
        Need(2, "resident", "trainer.weights"), Need(2, "resident", "trainer.optimizer"))),
    # The optimizer state first: the driver clears device memory a process releases, and while
    # it does host<->device copies run at half the link's rate (25 of 54 GB/s for the first
    # 2 GB copied after 18 GiB were released, one H200). Released last, the optimizer state's
    # clearing fell on the offload-first sync right after it (hf at Qwen2-1.5B: 66.5 ms, 1.19
    # of its floor); released first, it falls on the weights' pause, which it did not slow
    # (0.954 of the link against 0.946), and the sync ran at 1.08 (60.0 ms; issue 44)
    P.TRAINER_OFFLOAD: Effect(owner="trainer", verb="offload", pause=("optimizer", "weights"), host_copy=True),
    P.ENGINE_WAKE_WEIGHTS: Effect(owner="engine", verb="resume", resume=("weights",)),
    # the engine's receiving half does the work: one transport_load per bucket
    P.SYNC: Effect(owner="engine", verb="transport_load", allocates=True, needs=(
        Need(3, "resident", "engine.weights"), Need(3, "source", "trainer.weights"))),
    P.ENGINE_WAKE_KV: Effect(owner="engine", verb="resume", resume=("kv_cache", "cuda_graph")),
    P.FAILED: Effect(),
}

#: What a sync moves: the model's ``weights``, or a LoRA ``adapter`` beside base weights the
#: engine keeps (:mod:`colo.models.lora`). The order of the phases is the plan's either way;
#: what differs is written here, as overrides of ``EFFECTS``.
SYNC_TARGETS: dict[str, dict[Phase, Effect]] = {
    "weights": {},
    # The base weights are frozen and the engine already holds them: releasing them would
    # throw away what no sync brings back (vLLM's sleep level 2 discards them), and an
    # adapter's sync loads only the adapter. The engine releases its KV cache and graphs
    # only, so engine_wake_weights finds its weights resident and resumes nothing.
    "adapter": {P.ENGINE_RELEASE: Effect(owner="engine", verb="release", pause=("kv_cache", "cuda_graph"),
                                         flush_first=True)},
}


def effects_for(target: str) -> dict[Phase, Effect]:
    """``EFFECTS`` for a sync of ``target`` (one of :data:`SYNC_TARGETS`)."""
    try:
        return {**EFFECTS, **SYNC_TARGETS[target]}
    except (KeyError, TypeError):
        raise ValueError(f"unknown sync target {target!r}; expected one of {', '.join(SYNC_TARGETS)}") from None


def offload_follows_sync(order: Sequence[Phase], effects: Mapping[Phase, Effect]) -> bool:
    """Whether the phase right after the sync in ``order`` is the trainer's offload of its
    weights (``sync-first``): a trainer that takes its weights' digest as it offloads them
    can have a verified sync checked against that digest, after the sync, instead of reading
    every weight a second time inside it. The scheduler's rule
    (:meth:`colo.scheduler.Scheduler._check_at_offload`) and ``colo bench --trainers``'s
    rows both ask this."""
    i = order.index(P.SYNC)
    return order[(i + 1) % len(order)] is P.TRAINER_OFFLOAD and "weights" in effects[P.TRAINER_OFFLOAD].pause


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


#: The phases whose work may be the caller's own: a loop that keeps its rollout (vLLM's
#: generate, its tokenizer, its reward models) and its training step calls
#: ``Scheduler.to_train()`` and ``Scheduler.to_rollout()``, and colo runs every phase between
#: them. Each of these two is entered by colo (checked, traced) and left open while the caller
#: works, then closed by the next call; ``run_phase`` runs them with the engine's and the
#: trainer's own verbs instead (colo's own loop, ``Scheduler.cycle``).
CALLER_PHASES: tuple[Phase, ...] = (P.ROLLOUT, P.TRAIN)


def handoff_path(order: Sequence[Phase], current: Phase | None, target: Phase, *,
                 engine_current: bool) -> tuple[Phase, ...]:
    """The phases a handoff walks from ``current`` to ``target`` (one of ``CALLER_PHASES``),
    ``target`` last: the plan's own order, from the phase after ``current`` around to
    ``target``; from ``failed`` (or a fresh start with a stale engine) the recovery order
    first, as far as it leads towards ``target``. Empty when ``current`` is ``target``.

    From ``failed`` towards ``train`` the engine is released and the trainer onloaded
    straight away (``failed`` leaves by ``recover`` to ``engine_release``): nothing rolls
    out stale, and the next ``to_rollout`` syncs. Towards ``rollout`` the recovery re-syncs
    from the trainer's copy first."""
    if target not in CALLER_PHASES:
        raise ValueError(f"a handoff ends in {' or '.join(p.value for p in CALLER_PHASES)}, got {target}")
    if current is target:
        return ()
    if current is P.FAILED or (current is None and not engine_current):
        if target is P.ROLLOUT:
            return RECOVERY[1:]
        current = P.ENGINE_RELEASE  # recover (or start by release_engine): the plan from there
        walk: tuple[Phase, ...] = (P.ENGINE_RELEASE,)
    elif current is None or current is P.ENGINE_WAKE_KV and engine_current:
        # a synced engine with its KV cache back (a fresh start from the trainer's checkpoint,
        # a recovery): rollout is next, also where the plan syncs after the KV cache (single-stage)
        if target is P.ROLLOUT:
            return (P.ROLLOUT,)
        current, walk = P.ROLLOUT, (P.ROLLOUT,)
    else:
        walk = ()
    i = order.index(current)
    for step in range(1, len(order) + 1):
        phase = order[(i + step) % len(order)]
        walk += (phase,)
        if phase is target:
            return walk
    raise AssertionError(f"{target} is not in the plan {[p.value for p in order]}")  # every plan has both


@dataclass(frozen=True)
class SubState:
    """An engine's own state inside colo's phases, opened by one event and closed by another.

    ``opens_in`` / ``closes_in``: the phases in which each event may come. ``inside``:
    events allowed only while it is open, ``outside``: only while it is closed; an
    event is named ``event`` or ``event:detail`` (a bucket's stage, a memory event's
    owner). ``capability``: the ``EngineCapabilities`` flag of the engines that have it
    (the trace's ``engine_capabilities``); for others it is never checked, so traces of
    engines without it replay as before. ``ends_on_failure``: a failed phase closes it
    (the sender's abort ends an engine's session)."""

    opened: str
    closed: str
    opens_in: tuple[Phase, ...]
    closes_in: tuple[Phase, ...]
    capability: str
    inside: tuple[str, ...] = ()
    outside: tuple[str, ...] = ()
    ends_on_failure: bool = False


#: name -> the engine sub-state. The only place they are written.
SUBSTATES: dict[str, SubState] = {
    # SGLang refuses update_weights_from_tensor outside begin_weight_update .. end_weight_update
    "session": SubState(opened="session.opened", closed="session.closed", opens_in=(P.SYNC,),
                        closes_in=(P.SYNC,), capability="sessions", inside=("bucket.finished:load",),
                        outside=("sync.finished", "phase.finished:sync"), ends_on_failure=True),
    # SGLang's server releases memory only when idle: it pauses generation first and continues
    # at the next rollout
    # an adapter sync stages a new version beside the one serving, and activates it only once
    # every rank holds it and its digest checked: a load outside the stage, or a sync that ends
    # with its stage still open (neither activated nor failed), is refused
    "adapter_stage": SubState(opened="adapter.staging", closed="adapter.activated", opens_in=(P.SYNC,),
                              closes_in=(P.SYNC,), capability="adapters", inside=("bucket.finished:load",),
                              outside=("sync.finished", "phase.finished:sync"), ends_on_failure=True),
    "generation_paused": SubState(opened="generation.paused", closed="generation.continued",
                                  opens_in=(P.ENGINE_RELEASE,), closes_in=(P.ROLLOUT,),
                                  capability="pauses_generation", inside=("memory.paused:engine",),
                                  outside=("rollout.finished",)),
}


def allowed_triggers(current: Phase | None) -> tuple[str, ...]:
    return tuple(sorted(START if current is None else TRANSITIONS[current]))


def next_phase(current: Phase | None, trigger: str) -> Phase | None:
    """The table lookup: the phase ``trigger`` leads to from ``current``, or None."""
    return (START if current is None else TRANSITIONS[current]).get(trigger)


def parse_phase(name: str) -> Phase:
    try:
        return Phase(name)
    except ValueError:
        raise ValueError(
            f"unknown phase {name!r}; expected one of {', '.join(p.value for p in Phase)}"
        ) from None


def is_legal(current: Phase | None, target: Phase) -> bool:
    return target in (START if current is None else TRANSITIONS[current]).values()


#: the trigger that enters each phase, for messages about an edge the table lacks
_NAMED = {dst: trig for row in (START, *TRANSITIONS.values()) for trig, dst in row.items()
          if trig not in ("fail", "recover")}


def trigger_for(current: Phase | None, target: Phase) -> str:
    """The trigger that moves ``current`` to ``target`` (for messages and the machine)."""
    for trig, dst in (START if current is None else TRANSITIONS[current]).items():
        if dst is target:
            return trig
    return "fail" if target is P.FAILED else _NAMED.get(target, "recover")


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
        dst = next_phase(self.phase, trigger)
        if dst is None or (target is not None and dst is not target):
            raise IllegalTransition(self.phase, trigger, target or dst, allowed_triggers(self.phase))
        self.phase = dst
        return dst

    def go(self, target: Phase) -> Phase:
        return self.fire(trigger_for(self.phase, target), target)


def _check_orders() -> None:
    # The plans and recovery are data too; a typo there must not wait for a run.
    for name, order in {**PLANS, "recovery": RECOVERY}.items():
        walk = order + order[:1] if name != "recovery" else order
        for a, b in zip(walk, walk[1:]):
            if not is_legal(a, b):
                raise AssertionError(f"{name}: {a} -> {b} is not an edge of TRANSITIONS")


_check_orders()


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
    for name, sub in SUBSTATES.items():
        where = sub.opens_in[0].value
        lines.append(f"    note left of {where}: engine sub-state {name} (engines with {sub.capability}), "
                     f"{sub.opened} in {'/'.join(p.value for p in sub.opens_in)}, "
                     f"{sub.closed} in {'/'.join(p.value for p in sub.closes_in)}")
    return "\n".join(lines) + "\n"
