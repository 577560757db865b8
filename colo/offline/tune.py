"""``colo tune``: recommend ``mem_fraction_static`` and a bucket size from recorded memory.

The model (one per device, i.e. per trace file):

- The engine sizes its KV pool as ``KV = T × mfs − Wr`` (T the device's total
  bytes, Wr the engine's weights). So wherever the KV pool is resident, the
  device holds ``T × mfs`` for the engine's weights and KV, plus everything
  else: CUDA graphs, activations, the reserved remainder R (context,
  communicator buffers, allocator cache), whatever the trainer leaves
  resident, staging buffers. Call that ``other = used − KV − Wr``, read at
  every recorded event where the KV pool is resident. It is read at every such
  event, not at the engine's start, because what the trainer leaves behind
  grows after the engine has sized its pool, and the largest value binds:
  ``T × mfs + other + margin ≤ T``, so ``mfs ≤ (T − margin − other) / T``.
- Events where the KV pool is not resident do not depend on mfs; they must
  fit on their own (an OOM there is not fixed by any fraction).
- Staging scales with the bucket size. The sync peak without staging
  (engine weights, plus the trainer's state in ``sync-first``, plus the KV
  pool at the recommended fraction in ``single-stage``) leaves room for the
  buckets in flight; the recorded peak tells how many bucket budgets were live
  at once (≤ 2 for a pipelined transport).
- A ``phase.failed`` for an OOM is read as the event that would have been:
  ``used = T − oom_free + oom_requested``. So a trace of a run that ran out of
  memory tunes to a fraction at which it would not have.

The what-if mode writes a one-cycle trace from sizes alone (the same events the
scheduler writes) and runs the same analysis on it.

Pure: no torch, no anyio, no structlog.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass, field, replace

from colo.core.config import MIN_BUCKET_MIB, MIN_MODEL_GIB
from colo.core.memory import GiB, MiB, fmt_bytes
from colo.core.phases import PLANS, Effect, Phase, effects_for
from colo.offline.replay import BadTrace, LoadedTrace, check_one_run, load_trace, require_valid
from colo.core.schema import BUCKET_STAGES, SCHEMA
from colo.offline.summary import START
from colo.core.errors import TuneError, UsageError

KV = "engine.kv_cache"
WEIGHTS = "engine.weights"
STAGING = "staging"
#: Default margin: 2% of the device, at most 1 GiB. Room for allocator
#: fragmentation and growth the trace did not see. It must stay well under
#: 0.05 × T so that a fraction 0.05 above the recommendation really fails.
MARGIN_SHARE, MARGIN_CAP = 0.02, 1 * GiB
#: A bigger bucket only costs memory beyond this: at the measured 55 GB/s
#: pinned upload a 512 MiB bucket takes ~10 ms against ~0.2 ms to open its IPC
#: handle, so the per-bucket overhead is already ~2%.
BUCKET_CAP = 512 * MiB
#: The least bucket recommended: the least power of two that ``--bucket-mib`` takes
#: (:data:`~colo.core.config.MIN_BUCKET_MIB`, 0.01 MiB: 16 KiB). Below it the what-if once
#: recommended a 1-byte bucket for a 1.8 GiB device, which every colo command refuses.
MIN_BUCKET_BYTES = 1 << max(0, (math.ceil(MIN_BUCKET_MIB * MiB) - 1).bit_length())
#: Bucket budgets in flight when a trace shows no staging: a pipelined sender
#: keeps one bucket in flight while it fills the next.
DEFAULT_LIVE_BUCKETS = 2.0


@dataclass(frozen=True)
class Point:
    """One moment of device memory, located in a trace."""

    file: str
    line: int
    event: str
    phase: str  # the phase in progress, or "start" before the first one
    step: int | None
    used: int
    by_tag: dict
    kv_resident: bool
    virtual: bool = False  # an allocation that was refused (phase.failed with oom_*)
    #: where the KV pool this point holds became resident (the engine's start or the
    #: KV wake-up before it); None: this point is that admission, or holds no pool
    admission: "Point | None" = field(default=None, compare=False, repr=False)
    #: between a sync's start and the next trainer_offload: what the sync's staging
    #: left in the sender's allocator cache is still on the device here
    after_sync: bool = False

    @property
    def kv(self) -> int:
        return self.by_tag.get(KV, 0) if self.kv_resident else 0

    @property
    def staging(self) -> int:
        return self.by_tag.get(STAGING, 0)

    @property
    def reserved(self) -> int:
        return self.used - sum(self.by_tag.values())

    def where(self) -> str:
        step = f", step {self.step}" if self.step is not None else ""
        what = "refused allocation at " if self.virtual else ""
        return f"{self.phase}{step} ({os.path.basename(self.file)} line {self.line}: {what}{self.event})"


@dataclass
class Device:
    """What one trace says about its device."""

    file: str
    total: int
    engine_weights: int
    bucket_bytes: int | None
    plan: str | None
    points: list[Point]
    mfs_recorded: float | None = None
    max_bucket: int = 0  # largest bucket.finished bytes
    #: per sync: (growth of R from its phase.entered to its phase.finished, its staging peak)
    sync_growth: list = field(default_factory=list)
    #: which rank of a multi-GPU run this trace is, and its GPU (name, and UUID when recorded)
    rank: int = 0
    world_size: int = 1
    gpu: str = "?"
    #: the bytes one sync moves, where that is not the engine's weights: an adapter run's
    #: (``sync_target`` adapter: its largest sync.finished bytes); None: a sync moves Wr
    sync_bytes: int | None = None

    @property
    def moved(self) -> int:
        """What one sync moves: the bucket's cap is this rounded up (a bigger bucket only holds
        memory): the engine's weights, or an adapter's bytes."""
        return self.sync_bytes if self.sync_bytes is not None else self.engine_weights

    def names(self) -> str:
        """The device as a user finds it: rank and GPU when there are several."""
        return f"rank {self.rank} ({self.gpu}, {self.file})" if self.world_size > 1 else f"{self.gpu} ({self.file})"


def _points(trace: LoadedTrace) -> Device:
    head = trace.header
    config = head.get("config") or {}
    tags = head.get("tags") or {}
    total = (head.get("device") or {}).get("total_bytes")
    if not isinstance(total, int) and isinstance(head.get("mem"), dict):
        total = head["mem"]["total"]
    if not isinstance(total, int) or total <= 0:
        raise TuneError(f"{trace.path}: trace.started has no device.total_bytes; cannot size a fraction")
    registered = {k: v.get("bytes", 0) for k, v in tags.items() if isinstance(v, dict)}
    kv_res = bool((tags.get(KV) or {}).get("resident", True))
    weights = registered.get(WEIGHTS)
    phase, step = START, None
    points: list[Point] = []
    max_bucket = 0
    synced = 0  # the largest sync.finished bytes
    admission: Point | None = None  # where the KV pool resident now was admitted
    after_sync = False
    sync_growth: list[tuple[int, int]] = []
    sync_start: tuple[int, int] | None = None  # (R at the sync's start, its staging peak so far)
    for ev, n in zip(trace.events, trace.lines):
        name = ev["event"]
        if isinstance(ev.get("step"), int):
            step = ev["step"]
        admitted = False
        if name == "phase.entered":
            phase = ev["to_phase"]
            after_sync = after_sync or phase == Phase.SYNC.value
        elif name in ("memory.paused", "memory.resumed") and f"{ev['owner']}.{ev['tag']}" == KV:
            kv_res = name == "memory.resumed"
            admitted = kv_res
        elif name == "bucket.finished" and isinstance(ev.get("bytes"), int):
            max_bucket = max(max_bucket, ev["bytes"])
        elif name == "sync.finished" and isinstance(ev.get("bytes"), int):
            synced = max(synced, ev["bytes"])
        admitted = admitted or (n == trace.lines[0] and kv_res)
        mem = ev.get("mem")
        if mem is None:
            continue
        by_tag = dict(mem.get("by_tag") or {})
        if weights is None and by_tag.get(WEIGHTS):
            weights = by_tag[WEIGHTS]
        reserved = mem["used"] - sum(by_tag.values())
        if name == "phase.entered" and ev["to_phase"] == Phase.SYNC.value:
            sync_start = (reserved, 0)
        elif sync_start is not None:
            sync_start = (sync_start[0], max(sync_start[1], by_tag.get(STAGING, 0)))
            if name == "phase.finished" and ev.get("phase") == Phase.SYNC.value:
                sync_growth.append((reserved - sync_start[0], sync_start[1]))
                sync_start = None
        if name == "phase.failed" and isinstance(ev.get("oom_requested"), int) and isinstance(ev.get("oom_free"), int):
            points.append(replace(_refused(trace.path, n, ev, by_tag, kv_res, registered, total, step),
                                  after_sync=after_sync, admission=admission if kv_res else None))
            sync_start = None
        # The phase.entered snapshot is the previous phase's end state; count it there.
        label = (ev["from_phase"] or START) if name == "phase.entered" else phase
        p = Point(trace.path, n, name, label, step, mem["used"], by_tag, kv_res,
                  admission=None if admitted or not kv_res else admission, after_sync=after_sync)
        points.append(p)
        if admitted:
            admission = p
        if name == "phase.finished" and ev.get("phase") == Phase.TRAINER_OFFLOAD.value:
            # the trainer's pause empties its allocator cache (colo.device.cuda_memory.TrainerMemory)
            after_sync = False
    if weights is None:
        raise TuneError(f"{trace.path}: no engine.weights in the trace; expected the engine's weights "
                        "in trace.started tags or in mem.by_tag")
    mfs = config.get("mem_fraction_static")
    bucket = config.get("bucket_bytes")
    return Device(trace.path, total, int(weights), bucket if isinstance(bucket, int) and bucket > 0 else None,
                  config.get("plan"), points, mfs if isinstance(mfs, (int, float)) else None, max_bucket,
                  sync_growth, **_which_gpu(head, config),
                  sync_bytes=synced if config.get("sync_target") == "adapter" and synced else None)


def _which_gpu(head: dict, config: dict) -> dict:
    """Rank, world size and GPU of a trace: the multi-GPU demo records every rank's GPU UUID."""
    rank, world = head.get("rank"), head.get("world_size")
    rank = rank if isinstance(rank, int) and rank >= 0 else 0
    world = world if isinstance(world, int) and world >= 1 else 1
    gpu = str((head.get("device") or {}).get("name") or "?")
    uuids = config.get("gpu_uuids")
    if isinstance(uuids, list) and rank < len(uuids) and isinstance(uuids[rank], str):
        gpu = f"{gpu} {uuids[rank]}"
    return {"rank": rank, "world_size": world, "gpu": gpu}


#: the tags a phase brings back in one step: a refusal of one of them means
#: all of them were coming (the scheduler checks they fit together)
WAKES = {
    Phase.ENGINE_WAKE_KV.value: (KV, "engine.cuda_graph"),
    Phase.ENGINE_WAKE_WEIGHTS.value: (WEIGHTS,),
    Phase.TRAINER_ONLOAD.value: ("trainer.weights", "trainer.optimizer"),
}


def _refused(path, n, ev, by_tag, kv_res, registered, total, step) -> Point:
    """The state the refused allocation would have made.

    The snapshot in ``phase.failed`` is taken after cleanup (staging freed,
    nothing resumed), so the state is rebuilt: every tag the phase wakes at
    resident size, or the staging buffers live at the refusal plus the one asked.
    """
    tag, asked = ev.get("oom_tag"), ev["oom_requested"]
    reserved = ev["mem"]["used"] - sum(by_tag.values())
    after = dict(by_tag)
    wake = WAKES.get(ev["phase"], ())
    for key in wake:
        if not after.get(key):
            after[key] = registered.get(key) or (asked if key == tag else 0)
    if tag == STAGING:
        # oom_free was measured with the live buffers still allocated
        after[STAGING] = (total - ev["oom_free"] + asked) - (ev["mem"]["used"] - by_tag.get(STAGING, 0))
    elif tag and tag not in wake:
        after[tag] = after.get(tag, 0) + asked
    used = reserved + sum(after.values())
    return Point(path, n, ev["event"], ev["phase"], step, used, after, kv_res or KV in wake, virtual=True)


# -- the analysis ---------------------------------------------------------------------

def _floor2(x: float) -> float:
    return math.floor(x * 100 + 1e-9) / 100


def _pow2_floor(n: float) -> int:
    return 1 << (int(n).bit_length() - 1) if n >= 1 else 0


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def default_margin(total: int) -> int:
    return min(MARGIN_CAP, int(total * MARGIN_SHARE))


@dataclass
class DeviceResult:
    device: Device
    margin: int
    max_fraction: float | None
    binding: Point | None  # the peak: the KV-resident event that holds the most besides the pool
    mfs: float | None
    bucket_bytes: int | None
    bucket_limit: float | None
    bucket_point: Point | None
    live_buckets: float
    by_phase: dict[str, float]
    infeasible: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    arithmetic: list[str] = field(default_factory=list)
    tied: list[str] = field(default_factory=list)  # later phases that meet the same peak
    #: bytes the recommended bucket adds to what a sync leaves cached (see _cached_staging)
    extra_cached: int = 0

    @property
    def refused_at(self) -> Point | None:
        """Where a larger fraction is refused: the peak itself when colo admits what
        it adds there (the sync's staging), else where the KV pool it holds was
        admitted (the engine's start, or ``engine_wake_kv``). What a phase adds
        after that (the rollout's activations in the engine) is not admitted by
        colo: only the margin covers it."""
        b = self.binding
        if b is None or b.staging > 0 or b.admission is None:
            return b
        return b.admission


@dataclass(frozen=True)
class Staging:
    """What the recorded syncs say about staging.

    ``slot``: the bytes one bucket in flight took, the larger of the bucket
    budget and the largest bucket recorded (a tensor larger than the budget
    travels alone in a bucket of its own size: the packed transport sizes its
    two slots by its largest bucket); ``live``: slots in flight at the peak;
    ``largest``: the largest tensor, where a bucket over budget shows it;
    ``cached``: the sync's staging stayed on the device after it (R grew
    across the sync by at least its staging peak: the sender's allocator
    caches the freed slots until the trainer's next offload empties it)."""

    budget: int | None
    peak: int
    slot: int | None
    live: float
    largest: int
    cached: bool
    growth: int  # the largest growth of R across one sync

    @classmethod
    def of(cls, dev: Device) -> "Staging":
        budget = dev.bucket_bytes or dev.max_bucket or None
        peak = max((p.staging for p in dev.points), default=0)
        slot = max(budget or 0, dev.max_bucket) or None
        live = peak / slot if slot and peak else DEFAULT_LIVE_BUCKETS
        largest = dev.max_bucket if dev.bucket_bytes and dev.max_bucket > dev.bucket_bytes else 0
        cached = any(sp > 0 and g >= 0.9 * sp for g, sp in dev.sync_growth)
        growth = max((g for g, _ in dev.sync_growth), default=0)
        return cls(budget, peak, slot, live, largest, cached, growth)

    def extra_for(self, bucket: int | None) -> int:
        """What a sync at ``bucket`` leaves cached beyond what the recorded one did
        (never less: a smaller bucket is not assumed to give any back)."""
        if not self.cached or bucket is None or self.slot is None:
            return 0
        return max(0, int(self.live * (max(bucket, self.largest) - self.slot)))


def _bucket(dev: Device, mfs: float | None, limit: int, margin: int, infeasible: list[str],
            notes: list[str]) -> tuple:
    """The largest power-of-two bucket that fits beside what the sync holds, with
    the KV pool at the recommended fraction where it is resident."""
    T, Wr = dev.total, dev.engine_weights
    st = Staging.of(dev)
    live = st.live
    sync_points = [p for p in dev.points if p.staging > 0 or p.phase == Phase.SYNC.value]
    bucket_point, bucket_limit, bucket = None, None, None
    kv_new = (mfs * T - Wr) if mfs is not None else None
    worst = None
    for p in sync_points:
        base = p.used - p.staging
        if p.kv_resident:
            if kv_new is None:
                continue
            base += kv_new - p.kv
        if worst is None or base > worst:
            worst, bucket_point = base, p
    if worst is not None:
        bucket_limit = (limit - worst) / live
        cap = min(BUCKET_CAP, _pow2_ceil(max(1, dev.moved)))
        bucket = _pow2_floor(min(bucket_limit, cap))
        if bucket < MIN_BUCKET_BYTES <= bucket_limit:
            bucket = MIN_BUCKET_BYTES  # a model under the least bucket: one bucket holds all of it
        if bucket < MIN_BUCKET_BYTES:
            infeasible.append(f"{bucket_point.where()}: the sync holds {fmt_bytes(worst)} besides staging; "
                              f"with the {fmt_bytes(margin)} margin on {fmt_bytes(T)} a bucket may take "
                              f"{fmt_bytes(max(0, bucket_limit))}, less than the least bucket colo takes "
                              f"({fmt_bytes(MIN_BUCKET_BYTES)}: --bucket-mib {MIN_BUCKET_MIB:g} as a power of two)")
            bucket = None
    else:
        notes.append("no sync in the trace: no bucket size recommended")
    return bucket, bucket_limit, bucket_point, worst, live, st.peak, st.budget


def _fraction(dev: Device, limit: int, extra: int) -> tuple[dict[str, float], Point | None, int | None]:
    """Per phase the largest fraction that fits, the peak point and what it holds
    besides the pool; ``extra`` is added where a sync's cached staging is held."""
    Wr, T = dev.engine_weights, dev.total
    by_phase: dict[str, float] = {}
    binding, best_other = None, None
    for p in dev.points:
        if not p.kv_resident:
            continue
        other = p.used - p.kv - Wr + (extra if p.after_sync else 0)
        frac = (limit - other) / T
        if p.phase not in by_phase or frac < by_phase[p.phase]:
            by_phase[p.phase] = frac
        # strictly greater: the first event in time that reaches the peak is
        # where a larger fraction fails first
        if best_other is None or other > best_other:
            best_other, binding = other, p
    return by_phase, binding, best_other


def analyse_device(dev: Device, margin: int | None = None) -> DeviceResult:
    T, Wr = dev.total, dev.engine_weights
    margin = default_margin(T) if margin is None else margin
    limit = T - margin
    infeasible: list[str] = []
    notes: list[str] = []
    for p in dev.points:
        if not p.kv_resident and p.staging == 0 and p.used > limit:
            # does not depend on the fraction; staging is the bucket's business below
            (infeasible if p.used > T else notes).append(
                f"{p.where()} holds {fmt_bytes(p.used)} without the KV pool: "
                + (f"more than the device's {fmt_bytes(T)}; no mem_fraction_static fixes that"
                   if p.used > T else f"less than the {fmt_bytes(margin)} margin is left; "
                   "no mem_fraction_static changes that"))
    first = next((p for p in dev.points if p.kv_resident), None)
    if dev.mfs_recorded is not None and first is not None:
        expected = int(T * dev.mfs_recorded) - Wr
        if abs(first.kv - expected) > 0.01 * T:
            notes.append(f"the KV pool was {fmt_bytes(first.kv)} at mem_fraction_static {dev.mfs_recorded}, "
                         f"but T × mfs − Wr = {fmt_bytes(expected)}: this engine does not size its pool "
                         "the way the model assumes, so the recommendation may be off")

    def fraction(extra: int) -> tuple:
        by_phase, binding, best_other = _fraction(dev, limit, extra)
        max_fraction = None if binding is None else (limit - best_other) / T
        mfs = None if max_fraction is None else min(0.99, _floor2(max_fraction))
        return by_phase, binding, best_other, max_fraction, mfs

    by_phase, binding, best_other, max_fraction, mfs = fraction(0)
    # -- bucket: what the sync holds besides staging, at the recommended fraction
    bucket0 = _bucket(dev, mfs if mfs is not None and mfs * T > Wr else None, limit, margin, [], [])[0]
    # A bigger bucket than recorded leaves more staging in the sender's cache after
    # every sync, beside the KV pool: the fraction is for the bucket recommended with
    # it. The bucket was sized at the larger fraction, so it still fits at this one.
    extra = Staging.of(dev).extra_for(bucket0)
    if extra:
        by_phase, binding, best_other, max_fraction, mfs = fraction(extra)
    if mfs is not None and mfs * T - Wr <= 0:
        infeasible.append(
            f"{binding.where()}: the largest fraction that fits, {max_fraction:.4f}, leaves "
            f"T × mfs = {fmt_bytes(max(0, mfs) * T)} for engine weights of {fmt_bytes(Wr)}: no room "
            "for a KV pool")
        mfs = None
    # the same peak met again later (every cycle, typically): worth naming too
    tied = [] if binding is None else list(dict.fromkeys(
        p.phase for p in dev.points if p.kv_resident and p.phase != binding.phase
        and p.used - p.kv - Wr + (extra if p.after_sync else 0) == best_other))
    bucket, bucket_limit, bucket_point, worst, live, peak_staging, budget = _bucket(
        dev, mfs, limit, margin, infeasible, notes)
    if bucket is not None and bucket0 is not None:
        bucket = min(bucket, bucket0)  # the size the cached staging was counted for
    res = DeviceResult(dev, margin, max_fraction, binding, mfs, bucket, bucket_limit, bucket_point, live,
                       by_phase, infeasible, notes, tied=tied, extra_cached=extra)
    res.arithmetic = _arithmetic(res, worst, peak_staging, budget)
    return res


def _what_moves(d: Device) -> str:
    return "Wr" if d.sync_bytes is None else f"the adapter a sync moves ({fmt_bytes(d.sync_bytes)})"


def _breakdown(p: Point, Wr: int) -> str:
    parts = [f"{k} {fmt_bytes(v)}" for k, v in sorted(p.by_tag.items()) if v and k not in (KV, WEIGHTS)]
    parts.append(f"reserved R {fmt_bytes(p.reserved)}")
    return ", ".join(parts)


def _path(d: Device, upto: Point) -> list[tuple[str, int]]:
    """R (what no tag accounts for) at the end of each phase, from the engine's
    start to ``upto``, in the cycle that ends there: where it grew."""
    ends = [p for p in d.points if p.line <= upto.line and not p.virtual
            and (p.event == "phase.finished" or p is d.points[0])]
    # from the last time the KV pool was released before the binding's window
    release = [i for i, p in enumerate(ends) if p.phase == Phase.ENGINE_RELEASE.value]
    cycle = ends[release[-1]:] if release else ends
    out = [(START if p is d.points[0] else p.phase, p.reserved) for p in cycle]
    if out and out[0][0] != START:
        out.insert(0, (START, d.points[0].reserved))
    if upto.event != "phase.finished" and (not cycle or cycle[-1] is not upto):
        out.append((upto.phase, upto.reserved))
    return out


def _arithmetic(r: DeviceResult, sync_base: int | None, peak_staging: int, budget: int | None) -> list[str]:
    d, T, Wr, M = r.device, r.device.total, r.device.engine_weights, r.margin
    L = [f"{d.file}: device T = {fmt_bytes(T, True)}; margin {fmt_bytes(M)}"
         + (" (2% of T, at most 1 GiB)" if M == default_margin(T) else ""),
         f"  the engine sizes its KV pool as T × mfs − Wr, engine weights Wr = {fmt_bytes(Wr)}"]
    if d.mfs_recorded is not None:
        L.append(f"  recorded at mem_fraction_static {d.mfs_recorded}")
    b = r.binding
    st = Staging.of(d)
    if b is None:
        L.append("  the KV pool is never resident in this trace: nothing binds the fraction")
    else:
        held = b.used - b.kv - Wr
        extra = r.extra_cached if b.after_sync else 0
        other = held + extra
        start = next((p for p in d.points if p.kv_resident), None)
        L.append(f"  peak: {b.where()}" + (f"; the same peak recurs in {', '.join(r.tied)}" if r.tied else ""))
        L.append(f"    besides the KV pool and Wr the device held {fmt_bytes(held)}: {_breakdown(b, Wr)}")
        if start is not None and start is not b:
            grown = held - (start.used - start.kv - Wr)
            if grown > 0:
                L.append(f"    (that is {fmt_bytes(grown)} more than at {start.where()}: "
                         "it grew after the engine had sized its pool)")
                L.append("    R at the end of each phase up to it: " + ", ".join(
                    f"{ph} {fmt_bytes(v)}" for ph, v in _path(d, b)))
        if extra:
            L.append(f"    + {fmt_bytes(extra)}: each sync left its staging on the device (R grew by "
                     f"{fmt_bytes(st.growth)} across a sync whose staging peaked at {fmt_bytes(st.peak)}: the "
                     f"sender's allocator keeps the slots until the trainer's next offload), and the "
                     f"recommended {fmt_bytes(r.bucket_bytes or 0)} bucket takes {st.live:.2f} × "
                     f"({fmt_bytes(max(r.bucket_bytes or 0, st.largest))} − {fmt_bytes(st.slot or 0)}) more")
        a = r.refused_at
        if a is not None and a is not b:
            at_admission = a.used - a.kv - Wr + (r.extra_cached if a.after_sync else 0)
            L.append(f"  binding: {a.where()}: the KV pool is admitted there beside "
                     f"{fmt_bytes(at_admission)}; what {b.phase} adds after it ({fmt_bytes(other - at_admission)}, "
                     "the engine's own allocations) is not admitted by colo: a larger fraction is refused at "
                     f"the admission, in {a.phase}, and the margin covers what follows")
        L.append(f"    T × mfs + other + margin ≤ T  →  mfs ≤ (T − margin − other) / T = "
                 f"({T} − {M} − {other}) / {T} = {r.max_fraction:.4f}")
        if r.mfs is not None:
            L.append(f"    → mem_fraction_static = {r.mfs:.2f} (rounded down to 0.01): "
                     f"KV pool = {fmt_bytes(r.mfs * T - Wr)}, free at that point "
                     f"{fmt_bytes(T - (r.mfs * T + other))}")
    if sync_base is not None and r.bucket_limit is not None:
        slot = (f"the {fmt_bytes(st.slot)} slot" + (f" (the largest bucket: a {fmt_bytes(st.largest)} tensor "
                                                     f"over the {fmt_bytes(budget)} budget)" if st.largest else
                                                     " (the bucket budget)")) if st.slot else ""
        live = (f"{r.live_buckets:.2f} × {slot}" if peak_staging and st.slot
                else f"{r.live_buckets:.0f} buckets assumed (no staging recorded)")
        L.append(f"  sync: besides staging the device holds {fmt_bytes(sync_base)} at "
                 f"{r.bucket_point.where()}" + (" (KV pool at the recommended fraction)"
                                                 if r.bucket_point.kv_resident else ""))
        L.append(f"    staging peaked at {fmt_bytes(peak_staging)} = {live}")
        L.append(f"    bucket ≤ (T − margin − sync) / {r.live_buckets:.2f} = {fmt_bytes(max(0, r.bucket_limit))}; "
                 f"cap min(512 MiB, {_what_moves(d)} rounded up to a power of two) = "
                 f"{fmt_bytes(min(BUCKET_CAP, _pow2_ceil(max(1, d.moved))))}")
        if r.bucket_bytes:
            least = r.bucket_bytes == MIN_BUCKET_BYTES and _pow2_floor(
                min(r.bucket_limit, BUCKET_CAP, _pow2_ceil(max(1, d.moved)))) < MIN_BUCKET_BYTES
            L.append(f"    → bucket = {fmt_bytes(r.bucket_bytes)} (a power of two"
                     + (", the least bucket colo takes" if least else "") + ")")
    return L


@dataclass
class Recommendation:
    results: list[DeviceResult]
    source: str  # "trace" or "what-if"
    assumed: dict = field(default_factory=dict)

    @property
    def binding(self) -> DeviceResult | None:
        fitted = [r for r in self.results if r.max_fraction is not None]
        return min(fitted, key=lambda r: r.max_fraction) if fitted else None

    @property
    def feasible(self) -> bool:
        return (not any(r.infeasible for r in self.results) and self.binding is not None
                and self.mem_fraction_static is not None)

    @property
    def mem_fraction_static(self) -> float | None:
        vals = [r.mfs for r in self.results if r.max_fraction is not None]
        return None if not vals or None in vals else min(vals)

    @property
    def bucket_bytes(self) -> int | None:
        vals = [r.bucket_bytes for r in self.results if r.bucket_bytes is not None]
        return min(vals) if vals else None

    def as_dict(self) -> dict:
        b = self.binding
        bp = b.binding if b else None
        ref = b.refused_at if b else None
        return {
            "mem_fraction_static": self.mem_fraction_static,
            "bucket_mib": None if self.bucket_bytes is None else self.bucket_bytes / MiB,
            "binding_phase": ref.phase if ref else None,
            "peak_phase": bp.phase if bp else None,
            "binding_rank": b.device.rank if b else None,
            "binding_gpu": b.device.gpu if b else None,
            "tied_phases": b.tied if b else [],
            "feasible": self.feasible,
            "bucket_bytes": self.bucket_bytes,
            "max_fraction": None if b is None else round(b.max_fraction, 6),
            "binding": None if bp is None else {
                "file": bp.file, "line": bp.line, "event": bp.event, "step": bp.step, "refused": bp.virtual,
                "other_bytes": bp.used - bp.kv - b.device.engine_weights
                + (b.extra_cached if bp.after_sync else 0), "by_tag": bp.by_tag,
                "reserved_bytes": bp.reserved, "extra_cached_staging_bytes": b.extra_cached if bp.after_sync else 0,
                "admitted": None if ref is None else {"line": ref.line, "event": ref.event, "phase": ref.phase,
                                                      "step": ref.step,
                                                      "other_bytes": ref.used - ref.kv - b.device.engine_weights
                                                      + (b.extra_cached if ref.after_sync else 0)}},
            "source": self.source,
            "assumed": self.assumed,
            "devices": [{
                "file": r.device.file, "total_bytes": r.device.total, "margin_bytes": r.margin,
                "engine_weights_bytes": r.device.engine_weights, "plan": r.device.plan,
                "mem_fraction_static": r.mfs, "max_fraction": None if r.max_fraction is None else round(r.max_fraction, 6),
                "binding_phase": r.refused_at.phase if r.binding else None,
                "peak_phase": r.binding.phase if r.binding else None,
                "tied_phases": r.tied,
                "max_fraction_by_phase": {k: round(v, 6) for k, v in r.by_phase.items()},
                "bucket_bytes": r.bucket_bytes,
                "bucket_binding_phase": r.bucket_point.phase if r.bucket_point else None,
                "live_buckets": round(r.live_buckets, 4),
                "infeasible": r.infeasible, "notes": r.notes, "arithmetic": r.arithmetic,
            } for r in self.results],
        }

    def text(self) -> str:
        lines = []
        if self.assumed:
            lines.append("what-if (no trace); assumed, not measured: " + ", ".join(
                f"{k} {v}" for k, v in self.assumed.items()))
        for r in self.results:
            lines += r.arithmetic
            lines += [f"  note: {n}" for n in r.notes]
            lines += [f"  does not fit: {n}" for n in r.infeasible]
        b = self.binding
        if self.feasible:
            bucket = "none (no sync recorded)" if self.bucket_bytes is None else \
                f"{self.bucket_bytes / MiB:g} MiB ({self.bucket_bytes} B)"
            lines.append(f"recommend: mem_fraction_static {self.mem_fraction_static:.2f}, bucket {bucket}; "
                         f"binding phase: {b.refused_at.phase}"
                         + (f"; binding GPU: {b.device.names()}" if len(self.results) > 1 else ""))
        else:
            phase = next((r.refused_at.phase for r in self.results if r.infeasible and r.binding), None)
            lines.append("no recommendation: the trace does not fit the device at any mem_fraction_static"
                         + (f" (binding phase {phase})" if phase else ""))
        return "\n".join(lines)


def tune(traces: list[LoadedTrace], margin_bytes: int | None = None) -> Recommendation:
    """A recommendation over ``traces``: runs of one rank on the device to tune for, or the ranks
    of one multi-GPU run (refused with :class:`BadTrace` if they are ranks of several runs: a
    binding GPU named from another run's trace would be wrong)."""
    if len(traces) > 1 and any(t.world_size > 1 for t in traces):
        check_one_run(traces)
    return Recommendation([analyse_device(_points(t), margin_bytes) for t in traces], "trace")


# -- what-if ---------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class WhatIf:
    """Sizes instead of a trace. The defaults not given on the command line are
    assumptions, printed with the result: record a trace for real numbers."""

    gpu_gib: float
    model_gib: float  # the engine's weights (in the engine's dtype)
    bucket_mib: float = 64.0  # SchedulerConfig's default bucket
    plan: str = "offload-first"
    #: CUDA context, communicator buffers, allocator cache: R
    reserved_gib: float = 1.0
    cuda_graph_gib: float = 0.5
    #: the trainer's weights and optimizer, by default the weights' size and twice it
    trainer_weights_gib: float | None = None
    optimizer_gib: float | None = None
    #: a LoRA run (``colo demo --lora-rank``): the adapter's size. A sync moves it alone, the
    #: engine keeps its base weights through the cycle (the phase table's adapter effects), the
    #: trainer holds the base and the adapter, its optimizer two moments of the adapter only
    adapter_mib: float | None = None

    def __post_init__(self) -> None:
        for name in ("gpu_gib", "model_gib", "bucket_mib"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name} must be > 0, got {v!r}")
        # below these the what-if sizes nothing real: at a 1e-300 GiB model it recommended one-byte buckets
        for name, least in (("model_gib", MIN_MODEL_GIB), ("bucket_mib", MIN_BUCKET_MIB)):
            if getattr(self, name) < least:
                raise ValueError(f"{name} must be at least {least:g}, got {getattr(self, name)!r}")
        a = self.adapter_mib
        if a is not None and (isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 < a <= self.model_gib * 1024):
            raise ValueError(f"adapter_mib must be > 0 and at most the model's {self.model_gib * 1024:g} MiB, got {a!r}")
        for name in ("reserved_gib", "cuda_graph_gib", "trainer_weights_gib", "optimizer_gib"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0):
                raise ValueError(f"{name} must be >= 0, got {v!r}")
        if self.plan not in PLANS:
            raise ValueError(f"plan must be one of {', '.join(PLANS)}, got {self.plan!r}")
        if self.reserved_gib >= self.gpu_gib:
            raise ValueError(f"reserved_gib {self.reserved_gib} leaves nothing of a {self.gpu_gib} GiB device")

    @property
    def adapter_gib(self) -> float:
        return 0.0 if self.adapter_mib is None else self.adapter_mib / 1024

    @property
    def trainer_weights(self) -> float:
        return self.model_gib + self.adapter_gib if self.trainer_weights_gib is None else self.trainer_weights_gib

    @property
    def optimizer(self) -> float:
        trained = self.model_gib if self.adapter_mib is None else self.adapter_gib
        return 2 * trained if self.optimizer_gib is None else self.optimizer_gib

    @property
    def sync_target(self) -> str:
        return "weights" if self.adapter_mib is None else "adapter"

    def assumptions(self) -> dict:
        return {"reserved_gib": self.reserved_gib, "cuda_graph_gib": self.cuda_graph_gib,
                "trainer_weights_gib": self.trainer_weights, "optimizer_gib": self.optimizer}


class _Synth:
    """One cycle of a plan written as the scheduler would record it, from sizes
    alone: the phase table's own effects (``effects_for``) decide what each phase pauses and
    resumes, so the what-if cannot drift from the scheduler."""

    def __init__(self, w: WhatIf):
        self.w, self.T, self.R = w, int(w.gpu_gib * GiB), int(w.reserved_gib * GiB)
        self.size = {"engine.weights": int(w.model_gib * GiB), KV: 0,
                     "engine.cuda_graph": int(w.cuda_graph_gib * GiB),
                     "trainer.weights": int(w.trainer_weights * GiB), "trainer.optimizer": int(w.optimizer * GiB)}
        self.resident = {k: k.startswith("engine.") for k in self.size}
        self.host = {k: k.startswith("trainer.") for k in self.size}
        self.B = max(1, int(w.bucket_mib * MiB))
        self.staging, self.clock, self.out = 0, 0.0, []

    def mem(self) -> dict:
        by_tag = {k: (v if self.resident[k] else 0) for k, v in self.size.items()}
        by_tag[STAGING] = self.staging
        return {"used": self.R + sum(by_tag.values()), "total": self.T, "by_tag": by_tag}

    def emit(self, event: str, **fields) -> None:
        self.clock = round(self.clock + 0.001, 6)
        self.out.append({"event": event, "ts": self.clock, "rank": 0, **fields})

    def flip(self, eff: Effect, tags: tuple[str, ...], on: bool) -> None:
        for tag in tags:
            key = f"{eff.owner}.{tag}"
            if self.resident[key] == on:
                continue
            self.resident[key] = on
            if on:
                self.emit("memory.resumed", owner=eff.owner, tag=tag, bytes=self.size[key], mem=self.mem())
            else:
                self.host[key] = eff.host_copy
                self.emit("memory.paused", owner=eff.owner, tag=tag, bytes=self.size[key],
                          host_copy=eff.host_copy, mem=self.mem())

    def sync(self) -> None:
        # two buckets in flight at the peak, as the pipelined transports do; an adapter smaller
        # than two buckets goes in what it fills
        moved = int(self.w.adapter_gib * GiB) if self.w.adapter_mib is not None else None
        n, B = 2, self.B if moved is None else min(self.B, max(1, moved))
        if moved is not None:
            n = min(2, -(-moved // B))
        for b in range(n):
            self.staging += B
            stages = BUCKET_STAGES if not self.resident["trainer.weights"] else BUCKET_STAGES[1:]
            for s in stages:
                self.emit("bucket.finished", step=0, bucket=b, stage=s, bytes=B, tensors=1, duration_s=0.0,
                          mem=self.mem())
        self.staging = 0
        adapter = {} if moved is None else {"target": "adapter"}
        self.emit("sync.finished", step=0, bytes=n * B if moved is None else moved, buckets=n, tensors=n, params=n,
                  duration_s=0.0, weight_version=1, digest="what-if", cache_flushed=True,
                  source="device" if self.resident["trainer.weights"] else "host", mem=self.mem(), **adapter)

    def header(self) -> dict:
        return {"event": "trace.started", "ts": 0.0, "rank": 0, "schema": SCHEMA, "world_size": 1,
                "device": {"kind": "what-if", "name": f"{self.w.gpu_gib:g} GiB", "total_bytes": self.T},
                "config": {"plan": self.w.plan, "bucket_bytes": self.B, "transport": "what-if",
                           **({"sync_target": "adapter"} if self.w.adapter_mib is not None else {})},
                "tags": {k: {"bytes": v, "resident": self.resident[k], "host_copy": self.host[k]}
                         for k, v in self.size.items()},
                "mem": self.mem(), "engine_weight_version": 0, "trainer_weight_version": 0}

    def cycle(self) -> list[dict]:
        self.out = [self.header()]
        prev = None
        effects = effects_for(self.w.sync_target)
        for phase in PLANS[self.w.plan]:
            eff = effects[phase]
            self.emit("phase.entered", step=0, from_phase=prev, to_phase=phase.value, mem=self.mem())
            self.flip(eff, eff.pause, False)
            self.flip(eff, eff.resume, True)
            if phase is Phase.ROLLOUT:
                self.emit("rollout.finished", step=0, reward=0.0, tokens=0)
            if eff.allocates:
                self.sync()
            self.emit("phase.finished", step=0, phase=phase.value, duration_s=0.0, mem=self.mem())
            prev = phase.value
        self.emit("trace.finished")
        return self.out


def synthesize(w: WhatIf) -> list[dict]:
    """One cycle of ``w.plan`` as the scheduler would record it, from sizes alone.

    The KV pool is recorded resident with 0 bytes: the analysis replaces it by
    ``T × mfs − Wr`` wherever it is resident, so its recorded size never matters.
    """
    return _Synth(w).cycle()


def what_if(w: WhatIf, margin_bytes: int | None = None) -> Recommendation:
    events = synthesize(w)
    trace = LoadedTrace(f"what-if {w.plan}", events, list(range(1, len(events) + 1)))
    rec = Recommendation([analyse_device(_points(trace), margin_bytes)], "what-if", w.assumptions())
    return rec


# -- the command ---------------------------------------------------------------------------

def run_tune(args) -> int:

    margin = None
    warnings: list[str] = []
    if args.margin_gib is not None:
        if not args.margin_gib >= 0:
            raise UsageError(f"--margin-gib must be >= 0, got {args.margin_gib}")
        margin = int(args.margin_gib * GiB)
    whatif_flags = {k: getattr(args, k) for k in ("gpu_gib", "model_gib", "bucket_mib", "plan", "adapter_mib")
                    if getattr(args, k) is not None}
    try:
        if args.traces:
            if whatif_flags:
                raise UsageError("--" + ", --".join(k.replace("_", "-") for k in whatif_flags)
                                 + " describe a what-if without a trace; give either TRACE... or them")
            require_valid(args.traces, "tune")
            traces = [load_trace(p) for p in args.traces]
            warnings = [w for t in traces for w in t.warnings]
            rec = tune(traces, margin)
        else:
            missing = [f"--{k.replace('_', '-')}" for k in ("gpu_gib", "model_gib") if k not in whatif_flags]
            if missing:
                raise UsageError("give TRACE... or a what-if: " + " and ".join(missing) + " missing")
            rec = what_if(WhatIf(**whatif_flags), margin)
    except (BadTrace, TuneError, ValueError) as e:
        if isinstance(e, UsageError):
            raise
        raise UsageError(str(e)) from None
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    if args.json:
        print(json.dumps(rec.as_dict(), indent=2))
    else:
        print(rec.text())
    return 0 if rec.feasible else 1


__all__ = ["Recommendation", "WhatIf", "analyse_device", "synthesize", "tune", "what_if", "TuneError"]
