"""The engine's KV pool: sized as SGLang sizes it, handed out in slot ranges."""

from __future__ import annotations

from dataclasses import dataclass

from colo.core.errors import EngineStateError, KVPoolTooSmall


@dataclass(frozen=True, kw_only=True)
class KVPoolPlan:
    """SGLang's static split: KV pool = total x mem_fraction_static - weights.

    SGLang measures free memory after loading the weights and keeps
    ``total x (1 - mem_fraction_static)`` back for activations and the rest;
    with nothing else resident that is the formula above. The pool holds a
    whole number of token slots, so ``kv_bytes`` is the budget rounded down to
    a multiple of ``slot_bytes`` (short of it by less than one slot).
    """

    total_bytes: int
    mem_fraction_static: float
    weight_bytes: int
    slot_bytes: int
    #: one sequence of the model's maximum length must fit
    min_slots: int

    def __post_init__(self) -> None:
        for name in ("total_bytes", "weight_bytes", "slot_bytes", "min_slots"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        mfs = self.mem_fraction_static
        if isinstance(mfs, bool) or not isinstance(mfs, (int, float)) or not 0 < mfs <= 1:
            raise ValueError(f"mem_fraction_static must be in (0, 1], got {mfs!r}")
        if self.budget_bytes <= 0:
            raise KVPoolTooSmall(
                f"mem_fraction_static {mfs} of {self.total_bytes} bytes is {self.static_bytes} bytes, "
                f"which does not exceed the weights' {self.weight_bytes} bytes: no room for a KV pool")
        if self.num_slots < self.min_slots:
            raise KVPoolTooSmall(
                f"KV pool budget {self.budget_bytes} bytes holds {self.num_slots} token slots of "
                f"{self.slot_bytes} bytes; one sequence of max length needs {self.min_slots}: "
                f"raise mem_fraction_static (now {mfs}) or the device size")

    @property
    def static_bytes(self) -> int:
        return int(self.total_bytes * self.mem_fraction_static)

    @property
    def budget_bytes(self) -> int:
        return self.static_bytes - self.weight_bytes

    @property
    def num_slots(self) -> int:
        return self.budget_bytes // self.slot_bytes

    @property
    def kv_bytes(self) -> int:
        return self.num_slots * self.slot_bytes


class SlotAllocator:
    """First-fit allocator of contiguous slot ranges over the pool."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.reset()

    def reset(self) -> None:
        self._free: list[tuple[int, int]] = [(0, self.num_slots)]  # sorted (start, length)

    @property
    def free_slots(self) -> int:
        return sum(n for _, n in self._free)

    def alloc(self, n: int) -> int:
        for i, (start, length) in enumerate(self._free):
            if length >= n:
                if length == n:
                    del self._free[i]
                else:
                    self._free[i] = (start + n, length - n)
                return start
        raise EngineStateError(f"KV pool has no {n} contiguous free slots "
                               f"({self.free_slots} of {self.num_slots} free)")

    def free(self, start: int, n: int) -> None:
        self._free.append((start, n))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for s, length in self._free:
            if merged and merged[-1][0] + merged[-1][1] == s:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((s, length))
        self._free = merged
