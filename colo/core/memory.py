"""Device memory by owner and tag: a pure ledger with a budget.

The ledger is the scheduler's view of the device: which tags are resident,
how many bytes each holds, and what a resume or a staging buffer would cost.
It refuses a double pause or a double resume (the real memory saver aborts the
process on that) and raises :class:`OutOfMemory` before a side effect would
exceed the budget. No I/O, no torch: the CPU simulation *is* this ledger with a
chosen ``total_bytes``; the GPU backend (``colo.cuda_memory``) feeds it the
device's real numbers.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

OWNERS_TAGS: dict[str, tuple[str, ...]] = {
    "engine": ("weights", "kv_cache", "cuda_graph"),
    "trainer": ("weights", "optimizer"),
}
STAGING = "staging"
#: Every key a trace may carry in ``mem.by_tag``.
KNOWN_KEYS: tuple[str, ...] = tuple(
    f"{owner}.{tag}" for owner, tags in OWNERS_TAGS.items() for tag in tags
) + (STAGING,)

GiB = 1 << 30
MiB = 1 << 20


def fmt_bytes(n: int | float, exact: bool = False) -> str:
    """Human units; with ``exact``, the byte count too where rounding hides it."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}" + (f" ({int(n)} B)" if exact else "")
    return f"{int(n)} B"


def key_of(owner: str, tag: str) -> str:
    if tag not in OWNERS_TAGS.get(owner, ()):
        expected = ", ".join(KNOWN_KEYS[:-1])
        raise ValueError(f"unknown memory tag {owner}.{tag}; expected one of {expected}")
    return f"{owner}.{tag}"


class OutOfMemory(MemoryError):
    """An allocation or resume that would exceed the device budget."""

    def __init__(self, *, phase: str | None, tag: str, requested: int, free: int, total: int,
                 in_use: dict[str, int]):
        self.phase, self.tag, self.requested, self.free, self.total = phase, tag, requested, free, total
        self.in_use = dict(in_use)
        held = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in in_use.items() if v) or "nothing"
        super().__init__(
            f"out of memory in phase {phase or '-'}: {tag} asks {fmt_bytes(requested, True)}, "
            f"{fmt_bytes(free, True)} free of {fmt_bytes(total)}; in use: {held}"
        )


class TagStateError(RuntimeError):
    """Pausing a paused tag or resuming a resident one."""


@dataclass
class Region:
    nbytes: int
    resident: bool
    #: a paused region whose contents survive on the host (trainer state)
    host_copy: bool = False


@dataclass
class MemoryLedger:
    total_bytes: int
    #: what stays resident whatever the phase (CUDA context, NCCL buffers): R
    reserved_bytes: int = 0
    device_kind: str = "cpu"
    device_name: str = "simulated"
    regions: dict[str, Region] = field(default_factory=dict)
    _staging: dict[int, int] = field(default_factory=dict)
    _ids: itertools.count = field(default_factory=itertools.count)
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
        return sum(self._staging.values())

    @property
    def used_bytes(self) -> int:
        return self.reserved_bytes + self.staging_bytes + sum(
            r.nbytes for r in self.regions.values() if r.resident
        )

    @property
    def free_bytes(self) -> int:
        return self.total_bytes - self.used_bytes

    def is_resident(self, key: str) -> bool:
        r = self.regions.get(key)
        return bool(r and r.resident)

    def by_tag(self) -> dict[str, int]:
        out = {k: (r.nbytes if r.resident else 0) for k, r in self.regions.items()}
        out[STAGING] = self.staging_bytes
        return out

    def snapshot(self) -> dict:
        return {"used": self.used_bytes, "total": self.total_bytes, "by_tag": self.by_tag()}

    def describe_tags(self) -> dict[str, dict]:
        """Residency of every region, for ``trace.started`` (replay starts from it)."""
        return {
            k: {"bytes": r.nbytes, "resident": r.resident, "host_copy": r.host_copy}
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
                 host_copy: bool = False, phase: str | None = None) -> None:
        key = key_of(owner, tag)
        if nbytes < 0:
            raise ValueError(f"{key}: bytes must be >= 0, got {nbytes}")
        if key in self.regions:
            raise TagStateError(f"{key} is already registered")
        if resident:
            self._need(key, nbytes, phase)
        self.regions[key] = Region(nbytes, resident, host_copy)
        self._bump_peak()

    def _region(self, key: str) -> Region:
        try:
            return self.regions[key]
        except KeyError:
            raise TagStateError(
                f"{key} is not registered; registered: {', '.join(self.regions) or 'none'}"
            ) from None

    def check_resume(self, key: str, *, phase: str | None = None) -> int:
        """Raise what :meth:`resume` would raise, change nothing; return the bytes."""
        r = self._region(key)
        if r.resident:
            raise TagStateError(f"cannot resume {key}: it is already resident (resumed twice)")
        self._need(key, r.nbytes, phase)
        return r.nbytes

    def resume(self, key: str, *, phase: str | None = None) -> int:
        nbytes = self.check_resume(key, phase=phase)
        self.regions[key].resident = True
        self._bump_peak()
        return nbytes

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

    def alloc_staging(self, nbytes: int, *, phase: str | None = None) -> int:
        if nbytes <= 0:
            raise ValueError(f"staging buffer size must be > 0, got {nbytes}")
        self._need(STAGING, nbytes, phase)
        sid = next(self._ids)
        self._staging[sid] = nbytes
        self._bump_peak()
        return sid

    def free_staging(self, sid: int) -> int:
        try:
            return self._staging.pop(sid)
        except KeyError:
            raise TagStateError(f"staging buffer {sid} is not allocated (freed twice?)") from None

    def observe(self) -> None:
        """Refresh what the ledger cannot count itself (R) from the device.

        The scheduler calls it after every phase. A plain ledger has nothing to
        refresh; the GPU ledger reads the device, the demo's simulated device
        adds what the trainer left behind.
        """

    def free_all_staging(self) -> int:
        freed = self.staging_bytes
        self._staging.clear()
        return freed


class LedgerStaging:
    """A ledger's staging allocations seen as a sync's ``StagingPool`` (alloc/free)."""

    def __init__(self, ledger: MemoryLedger, phase: str = "sync"):
        self._ledger, self._phase = ledger, phase

    def alloc(self, nbytes: int) -> int:
        return self._ledger.alloc_staging(nbytes, phase=self._phase)

    def free(self, sid: int) -> None:
        self._ledger.free_staging(sid)
