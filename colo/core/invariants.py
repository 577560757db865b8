"""Invariants 1-6 as one pure checker over the ``colo.trace/1`` event stream.

The scheduler feeds it every event it writes and asks it, before each phase
change, whether the change would break an invariant (and refuses it if so);
``colo replay`` feeds it recorded traces. Same code, same messages.

``check(event)`` looks without changing anything; ``apply(event)`` updates the
state; ``feed`` does both. The state is per rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from colo.core.phases import EFFECTS, SUBSTATES, Need, Phase, is_legal, parse_phase
from colo.core.schema import BUCKET_STAGES
from colo.core.errors import InvariantViolation  # noqa: F401 (re-exported)

_STAGE_INDEX = {s: i for i, s in enumerate(BUCKET_STAGES)}


@dataclass(frozen=True)
class Violation:
    message: str
    invariant: int | None = None  # 1-6, or None for a structural error (order, table)
    line: int | None = None

    def __str__(self) -> str:
        where = f"line {self.line}: " if self.line is not None else ""
        tag = f"invariant {self.invariant}: " if self.invariant else ""
        return f"{where}{tag}{self.message}"


@dataclass
class _Sync:
    buckets: dict[int, int] = field(default_factory=dict)  # bucket -> index of last stage seen
    loaded: dict[int, int] = field(default_factory=dict)  # bucket -> tensors loaded


@dataclass
class RankState:
    phase: Phase | None = None  # the current phase (the last one entered)
    open: bool = False  # entered and not yet finished/failed
    ts: float = 0.0
    resident: dict[str, bool] = field(default_factory=dict)
    host_copy: dict[str, bool] = field(default_factory=dict)
    trainer_version: int = 0
    engine_version: int | None = None  # None: stale, a sync is owed
    flushed: bool = True
    sync: _Sync | None = None
    total: int | None = None
    #: (phase, where) of every phase entered, for the cross-rank lockstep check
    entered: list[tuple[str, str | None]] = field(default_factory=list)
    diverged: bool = False
    #: the engine's own sub-states (``SUBSTATES``) its capabilities declare: name -> open
    substates: dict[str, bool] = field(default_factory=dict)


def _mem_violation(ev: dict) -> Violation | None:
    mem = ev.get("mem")
    if isinstance(mem, dict) and isinstance(mem.get("used"), int) and isinstance(mem.get("total"), int):
        if mem["used"] > mem["total"]:
            return Violation(
                f"device memory in use {mem['used']} B exceeds the budget {mem['total']} B "
                f"at {ev.get('event')}", 5)
    return None


def _unmet(st: RankState, dst: Phase, need: Need) -> Violation | None:
    res, n = st.resident, need.invariant
    if need.kind == "resident" and not res.get(need.key):
        return Violation(f"{dst} refused: {need.key} is not resident", n)
    if need.kind == "source" and not (res.get(need.key) or st.host_copy.get(need.key)):
        return Violation(f"{dst} refused: no trainer source ({need.key} is neither resident nor kept on "
                         "the host)", n)
    if need.kind == "current" and st.engine_version is None:
        return Violation(f"{dst} refused: the engine's weights are stale (expected a complete sync since "
                         "the last failure)", n)
    if need.kind == "current" and st.engine_version != st.trainer_version:
        return Violation(f"{dst} refused: engine weight version {st.engine_version} != trainer version "
                         f"{st.trainer_version} (expected a complete sync since the last train)", n)
    if need.kind == "flushed" and not st.flushed:
        return Violation(f"{dst} refused: the prefix cache was not flushed after the last weight change", n)
    return None


class InvariantChecker:
    def __init__(self) -> None:
        self.ranks: dict[int, RankState] = {}
        #: where the event being applied came from ("file line N"), for messages
        #: that point at another rank's event
        self.where: str | None = None

    def state(self, rank: int = 0) -> RankState:
        return self.ranks.setdefault(rank, RankState())

    # -- public ----------------------------------------------------------------
    def feed(self, ev: dict, line: int | None = None, where: str | None = None) -> list[Violation]:
        found = [Violation(v.message, v.invariant, line) for v in self.check(ev)]
        self.where = where
        self.apply(ev)
        self.where = None
        return found

    def check(self, ev: dict) -> list[Violation]:
        st = self.ranks.get(ev.get("rank", 0)) or RankState()
        name = ev.get("event")
        out: list[Violation] = []
        ts = ev.get("ts")
        if isinstance(ts, (int, float)) and ts < st.ts:
            out.append(Violation(f"ts {ts} goes back in time (previous {st.ts})"))
        if (v := _mem_violation(ev)) is not None:
            out.append(v)
        handler = getattr(self, "_check_" + str(name).replace(".", "_"), None)
        if handler is not None:
            out.extend(handler(st, ev))
        out.extend(self._check_substates(st, ev))
        return out

    def apply(self, ev: dict) -> None:
        st = self.state(ev.get("rank", 0))
        if isinstance(ev.get("ts"), (int, float)):
            st.ts = max(st.ts, ev["ts"])
        handler = getattr(self, "_apply_" + str(ev.get("event")).replace(".", "_"), None)
        if handler is not None:
            handler(st, ev)
        self._apply_substates(st, ev)

    # -- trace.started ---------------------------------------------------------
    def _apply_trace_started(self, st: RankState, ev: dict) -> None:
        dev = ev.get("device") or {}
        st.total = dev.get("total_bytes")
        for key, info in (ev.get("tags") or {}).items():
            st.resident[key] = bool(info.get("resident"))
            st.host_copy[key] = bool(info.get("host_copy"))
        if ev.get("engine_weight_version") is not None:
            st.engine_version = int(ev["engine_weight_version"])
        st.trainer_version = int(ev.get("trainer_weight_version", 0))
        caps = (ev.get("config") or {}).get("engine_capabilities") or {}
        st.substates = {name: False for name, sub in SUBSTATES.items() if caps.get(sub.capability) is True}

    # -- the engine's sub-states (SUBSTATES) ------------------------------------
    def _check_substates(self, st: RankState, ev: dict) -> list[Violation]:
        name = ev.get("event")
        detail = ev.get("stage") or ev.get("owner") or ev.get("phase")
        keys = {name, f"{name}:{detail}"}
        out = []
        for sub_name, is_open in st.substates.items():
            sub = SUBSTATES[sub_name]
            if name in (sub.opened, sub.closed):
                opening = name == sub.opened
                if is_open == opening:
                    out.append(Violation(f"{name} while the engine's {sub_name} is already "
                                         f"{'open' if is_open else 'closed'} (expected "
                                         f"{sub.closed if opening else sub.opened} first)"))
                where = sub.opens_in if opening else sub.closes_in
                if not st.open or st.phase not in where:
                    out.append(Violation(f"{name} in {st.phase if st.open else 'no open phase'}; expected it in "
                                         f"{' or '.join(p.value for p in where)}"))
            elif is_open and keys & set(sub.outside):
                out.append(Violation(f"{name}{' ' + str(detail) if detail else ''} while the engine's {sub_name} "
                                     f"is open (expected {sub.closed} first)"))
            elif not is_open and keys & set(sub.inside):
                out.append(Violation(f"{name}{' ' + str(detail) if detail else ''} outside the engine's {sub_name} "
                                     f"(expected {sub.opened} first: the engine refuses it there)"))
        return out

    def _apply_substates(self, st: RankState, ev: dict) -> None:
        name = ev.get("event")
        for sub_name in st.substates:
            sub = SUBSTATES[sub_name]
            if name == sub.opened:
                st.substates[sub_name] = True
            elif name == sub.closed or (name == "phase.failed" and sub.ends_on_failure):
                st.substates[sub_name] = False

    # -- phases ----------------------------------------------------------------
    def _check_phase_entered(self, st: RankState, ev: dict) -> list[Violation]:
        out = []
        try:
            src = None if ev.get("from_phase") is None else parse_phase(ev["from_phase"])
            dst = parse_phase(ev.get("to_phase"))
        except ValueError as e:
            return [Violation(str(e))]
        if st.open:
            out.append(Violation(f"entered {dst} while phase {st.phase} is still open "
                                 f"(expected phase.finished or phase.failed for {st.phase} first)"))
        if src != st.phase:
            out.append(Violation(f"from_phase is {src or 'start'} but the current phase is {st.phase or 'start'}"))
        if not is_legal(st.phase, dst):
            out.append(Violation(f"transition {st.phase or 'start'} -> {dst} is not in the phase table"))
        out.extend(self.preconditions(st, dst))
        out.extend(self._lockstep(ev.get("rank", 0), st, dst, None))
        return out

    def preconditions(self, st: RankState, dst: Phase) -> list[Violation]:
        """Invariants 1-3: the ``needs`` that ``EFFECTS`` declares for ``dst``."""
        return [v for need in EFFECTS[dst].needs if (v := _unmet(st, dst, need)) is not None]

    def _lockstep(self, rank: int, st: RankState, dst: Phase, where: str | None) -> list[Violation]:
        """Ranks of one job move through the same phases in the same order."""
        k = len(st.entered)
        for other, ost in sorted(self.ranks.items()):
            if other == rank or st.diverged or len(ost.entered) <= k:
                continue
            theirs, their_where = ost.entered[k]
            if theirs != dst.value:
                at = f" ({their_where})" if their_where else ""
                return [Violation(f"rank {rank} entered {dst} as its phase #{k + 1} but rank {other} entered "
                                  f"{theirs}{at}; expected the same phases in the same order")]
        return []

    def _apply_phase_entered(self, st: RankState, ev: dict) -> None:
        try:
            st.phase = parse_phase(ev.get("to_phase"))
        except ValueError:
            return
        if self._lockstep(ev.get("rank", 0), st, st.phase, None):
            st.diverged = True  # said once: every later phase of this rank differs too
        st.entered.append((st.phase.value, self.where))
        st.open = True
        if st.phase is Phase.SYNC:
            st.sync = _Sync()

    def _check_phase_end(self, st: RankState, ev: dict) -> list[Violation]:
        name = ev.get("phase")
        if not st.open or st.phase is None or name != st.phase.value:
            cur = f"open phase is {st.phase}" if st.open else "no phase is open"
            return [Violation(f"{ev.get('event')} for {name} but {cur}")]
        return []

    _check_phase_finished = _check_phase_end
    _check_phase_failed = _check_phase_end

    def _apply_phase_finished(self, st: RankState, ev: dict) -> None:
        st.open = False
        if st.phase is Phase.TRAIN:
            st.trainer_version += 1
        if st.phase is Phase.SYNC and st.sync is not None:
            # A sync phase that ends without sync.finished changed nothing trusted.
            st.sync = None

    def _apply_phase_failed(self, st: RankState, ev: dict) -> None:
        st.open = False
        st.sync = None
        # Whatever failed, the engine is no longer trusted until a complete sync.
        st.engine_version = None

    # -- memory ----------------------------------------------------------------
    @staticmethod
    def _key(ev: dict) -> str:
        return f"{ev.get('owner')}.{ev.get('tag')}"

    def _check_memory_paused(self, st: RankState, ev: dict) -> list[Violation]:
        key = self._key(ev)
        if st.resident.get(key) is False:
            return [Violation(f"{key} paused twice (it is already paused)", 4)]
        return []

    def _check_memory_resumed(self, st: RankState, ev: dict) -> list[Violation]:
        key = self._key(ev)
        if st.resident.get(key) is True:
            return [Violation(f"{key} resumed twice (it is already resident)", 4)]
        return []

    def _apply_memory_paused(self, st: RankState, ev: dict) -> None:
        key = self._key(ev)
        st.resident[key] = False
        st.host_copy[key] = bool(ev.get("host_copy"))

    def _apply_memory_resumed(self, st: RankState, ev: dict) -> None:
        st.resident[self._key(ev)] = True

    # -- sync ------------------------------------------------------------------
    def _check_bucket_finished(self, st: RankState, ev: dict) -> list[Violation]:
        if st.phase is not Phase.SYNC or not st.open or st.sync is None:
            return [Violation(f"bucket.finished outside a sync phase (current phase {st.phase})", 6)]
        stage, bucket = ev.get("stage"), ev.get("bucket")
        if stage not in _STAGE_INDEX:
            return [Violation(f"unknown bucket stage {stage!r}; expected one of {', '.join(BUCKET_STAGES)}", 6)]
        last = st.sync.buckets.get(bucket, -1)
        if _STAGE_INDEX[stage] <= last:
            return [Violation(f"bucket {bucket}: stage {stage} after {BUCKET_STAGES[last]} "
                              f"(expected the order {' < '.join(BUCKET_STAGES)}, each once)", 6)]
        return []

    def _apply_bucket_finished(self, st: RankState, ev: dict) -> None:
        if st.sync is None or ev.get("stage") not in _STAGE_INDEX:
            return
        st.sync.buckets[ev.get("bucket")] = _STAGE_INDEX[ev["stage"]]
        if ev["stage"] == "load":
            st.sync.loaded[ev.get("bucket")] = int(ev.get("tensors", 0))
            # The engine's weights just changed: its prefix cache is now invalid
            # and its version is not trustworthy until sync.finished.
            st.flushed = False
            st.engine_version = None

    def _check_sync_finished(self, st: RankState, ev: dict) -> list[Violation]:
        if st.phase is not Phase.SYNC or not st.open or st.sync is None:
            return [Violation(f"sync.finished outside a sync phase (current phase {st.phase})", 6)]
        out = []
        n = ev.get("buckets")
        loaded = st.sync.loaded
        if isinstance(n, int) and sorted(loaded) != list(range(n)):
            missing = sorted(set(range(n)) - set(loaded))
            out.append(Violation(f"sync.finished with {n} buckets but buckets loaded are "
                                 f"{sorted(loaded)} (missing {missing})", 6))
        unfinished = [b for b, s in st.sync.buckets.items() if b not in loaded]
        if unfinished:
            out.append(Violation(f"buckets {unfinished} never reached stage load", 6))
        expected = ev.get("params")
        if isinstance(expected, int) and sum(loaded.values()) != expected:
            out.append(Violation(f"sync covered {sum(loaded.values())} tensors but the model has "
                                 f"{expected} (expected every parameter exactly once)", 6))
        if ev.get("weight_version") != st.trainer_version:
            out.append(Violation(f"sync.finished weight_version {ev.get('weight_version')} != "
                                 f"trainer version {st.trainer_version}", 1))
        return out

    def _apply_sync_finished(self, st: RankState, ev: dict) -> None:
        st.engine_version = ev.get("weight_version")
        if ev.get("cache_flushed"):
            st.flushed = True
        st.sync = _Sync()  # a second sync.finished in the same phase would see no loads

    def _check_rollout_finished(self, st: RankState, ev: dict) -> list[Violation]:
        if st.phase is not Phase.ROLLOUT or not st.open:
            return [Violation(f"rollout.finished outside a rollout phase (current phase {st.phase})")]
        return []
