"""Device memory by owner and tag: a pure ledger with a budget.

The ledger is the scheduler's view of the device: which tags are resident,
how many bytes each holds, and what a resume or a staging buffer would cost.
It refuses a double pause or a double resume (the real memory saver aborts the
process on that) and raises :class:`OutOfMemory` before a side effect would
exceed the budget. No I/O, no torch: the CPU simulation *is* this ledger with a
chosen ``total_bytes``; the GPU backend (``colo.device.cuda_memory``) feeds it the
device's real numbers.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from colo.core.units import GiB, MiB, fmt_bytes  # noqa: F401 (re-exported)
from colo.core.errors import OutOfMemory, TagStateError

OWNERS_TAGS: dict[str, tuple[str, ...]] = {
    "engine": ("weights", "kv_cache", "cuda_graph"),
    "trainer": ("weights", "optimizer"),
}
STAGING = "staging"
#: Every key a trace may carry in ``mem.by_tag``.
KNOWN_KEYS: tuple[str, ...] = tuple(
    f"{owner}.{tag}" for owner, tags in OWNERS_TAGS.items() for tag in tags
) + (STAGING,)

def key_of(owner: str, tag: str) -> str:
    if tag not in OWNERS_TAGS.get(owner, ()):
        expected = ", ".join(KNOWN_KEYS[:-1])
        raise ValueError(f"unknown memory tag {owner}.{tag}; expected one of {expected}")
    return f"{owner}.{tag}"


@dataclass
class Region:
    nbytes: int
    resident: bool
    #: a paused region whose contents survive on the host (trainer state)
    host_copy: bool = False
    #: pausing gives the bytes back to the device; False where the owner's release is
    #: control-plane only (vLLM's sleep on a CPU): the bytes stay counted while paused
    frees: bool = True

    @property
    def held(self) -> int:
        """The bytes this region holds on the device now."""
        return self.nbytes if self.resident or not self.frees else 0


@dataclass
class MemoryLedger:
    total_bytes: int
    #: what stays resident whatever the phase (CUDA context, NCCL buffers): R
    reserved_bytes: int = 0
    device_kind: str = "cpu"
    device_name: str = "simulated"
    regions: dict[str, Region] = field(default_factory=dict)
    #: the running sync's staging budget, while one runs (see ``StagingBudget``)
    staging: StagingBudget | None = None
    peak_bytes: int = 0

    def __post_init__(self) -> None:
        if self.total_bytes <= 0:
            raise ValueError(f"total_bytes must be > 0, got {self.total_bytes}")
        if not 0 <= self.reserved_bytes < self.total_bytes:
            raise ValueError(
                f"reserved_bytes must be in [0, total_bytes={self.total_bytes}), got {self.reserved_bytes}"
            )
        self.peak_bytes = self.used_bytes

    # -- reading -------------------------------------------------------------
    @property
    def staging_bytes(self) -> int:
        return self.staging.held_bytes if self.staging is not None else 0

    @property
    def used_bytes(self) -> int:
        return self.reserved_bytes + self.staging_bytes + sum(r.held for r in self.regions.values())

    @property
    def free_bytes(self) -> int:
        return self.total_bytes - self.used_bytes

    def is_resident(self, key: str) -> bool:
        r = self.regions.get(key)
        return bool(r and r.resident)

    def by_tag(self) -> dict[str, int]:
        out = {k: r.held for k, r in self.regions.items()}
        out[STAGING] = self.staging_bytes
        return out

    def snapshot(self, *, staging: int | None = None) -> dict:
        """Memory now; ``staging`` replaces the staging count (a stage record's
        own, when records are written after the stage ended)."""
        by_tag = self.by_tag()
        used = self.used_bytes
        if staging is not None:
            used += staging - by_tag[STAGING]
            by_tag[STAGING] = staging
        return {"used": used, "total": self.total_bytes, "by_tag": by_tag}

    def describe_tags(self) -> dict[str, dict]:
        """Residency of every region, for ``trace.started`` (replay starts from it)."""
        return {
            k: {"bytes": r.nbytes, "resident": r.resident, "host_copy": r.host_copy,
                **({} if r.frees else {"frees": False})}
            for k, r in self.regions.items()
        }

    # -- changing ------------------------------------------------------------
    def _need(self, tag: str, nbytes: int, phase: str | None) -> None:
        if nbytes > self.free_bytes:
            raise OutOfMemory(phase=phase, tag=tag, requested=nbytes, free=self.free_bytes,
                              total=self.total_bytes, in_use=self.by_tag())

    def _bump_peak(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)

    def register(self, owner: str, tag: str, nbytes: int, *, resident: bool = True,
                 host_copy: bool = False, phase: str | None = None, frees: bool = True) -> None:
        key = key_of(owner, tag)
        if nbytes < 0:
            raise ValueError(f"{key}: bytes must be >= 0, got {nbytes}")
        if key in self.regions:
            raise TagStateError(f"{key} is already registered")
        if resident or not frees:
            self._need(key, nbytes, phase)
        self.regions[key] = Region(nbytes, resident, host_copy, frees)
        self._bump_peak()

    def _region(self, key: str) -> Region:
        try:
            return self.regions[key]
        except KeyError:
            raise TagStateError(
                f"{key} is not registered; registered: {', '.join(self.regions) or 'none'}"
            ) from None

    def check_resume(self, key: str, *, phase: str | None = None) -> int:
        """Raise what :meth:`resume` would raise, change nothing; return the bytes it needs
        (none for a region that never gave its bytes back)."""
        r = self._region(key)
        if r.resident:
            raise TagStateError(f"cannot resume {key}: it is already resident (resumed twice)")
        if not r.frees:
            return 0
        self._need(key, r.nbytes, phase)
        return r.nbytes

    def resume(self, key: str, *, phase: str | None = None) -> int:
        """Make ``key`` resident; the region's bytes."""
        self.check_resume(key, phase=phase)
        self.regions[key].resident = True
        self._bump_peak()
        return self.regions[key].nbytes

    def check_pause(self, key: str) -> int:
        r = self._region(key)
        if not r.resident:
            raise TagStateError(f"cannot pause {key}: it is already paused (paused twice)")
        return r.nbytes

    def pause(self, key: str, *, host_copy: bool = False) -> int:
        nbytes = self.check_pause(key)
        r = self.regions[key]
        r.resident, r.host_copy = False, host_copy
        return nbytes

    def resize(self, key: str, nbytes: int, *, phase: str | None = None) -> None:
        r = self._region(key)
        if r.resident and nbytes > r.nbytes:
            self._need(key, nbytes - r.nbytes, phase)
        r.nbytes = nbytes
        self._bump_peak()

    def staging_budget(self, phase: str = "sync", rank: int | None = None) -> StagingBudget:
        """A budget of every byte free now, for one sync's staging buffers."""
        return StagingBudget(self.free_bytes, phase=phase, total=self.total_bytes, in_use=self.by_tag(),
                             rank=rank)

    def note_staging_peak(self, peak: int) -> None:
        self.peak_bytes = max(self.peak_bytes, self.used_bytes - self.staging_bytes + peak)

    def observe(self) -> None:
        """Refresh what the ledger cannot count itself (R) from the device.

        The scheduler calls it after every phase. A plain ledger has nothing to
        refresh; the GPU ledger reads the device, the demo's simulated device
        adds what the trainer left behind.
        """


class StagingBudget:
    """Staging memory one sync may hold, counted before the memory exists.

    Plain data (a limit and what is held): a sender in another process can be
    handed one. An allocation that would pass the limit raises
    :class:`OutOfMemory` before anything is allocated; ``free`` of an unknown
    id is an error (a double free is a bug in the sender).
    """

    def __init__(self, limit: int | None, *, phase: str = "sync", total: int | None = None,
                 in_use: dict[str, int] | None = None, rank: int | None = None):
        if limit is not None and limit < 0:
            raise ValueError(f"staging limit must be >= 0 bytes, got {limit}")
        self.limit, self.phase, self.rank = limit, phase, rank
        self.total = total if total is not None else (limit or 0)
        self.in_use = dict(in_use or {})
        self._held: dict[int, int] = {}
        self._ids = itertools.count()
        self.peak_bytes = 0

    @property
    def held_bytes(self) -> int:
        return sum(self._held.values())

    def alloc(self, nbytes: int) -> int:
        if nbytes <= 0:
            raise ValueError(f"staging buffer size must be > 0, got {nbytes}")
        held = self.held_bytes
        if self.limit is not None and held + nbytes > self.limit:
            raise OutOfMemory(phase=self.phase, tag=STAGING, requested=nbytes, free=self.limit - held,
                              total=self.total, in_use={**self.in_use, STAGING: held}, rank=self.rank)
        sid = next(self._ids)
        self._held[sid] = nbytes
        self.peak_bytes = max(self.peak_bytes, held + nbytes)
        return sid

    def free(self, sid: int) -> int:
        try:
            return self._held.pop(sid)
        except KeyError:
            raise TagStateError(f"staging buffer {sid} is not allocated (freed twice?)") from None

    def free_all(self) -> int:
        freed = self.held_bytes
        self._held.clear()
        return freed
