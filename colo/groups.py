"""Sides as groups: one verb fanned out to every rank of the trainer or the engine.

The scheduler never talks to one rank: it calls a verb on a group, and the
group calls it on every rank at once and waits for all of them (a rank that
takes part in a collective cannot be left behind while another is cancelled).
One GPU is the group of one. The first real error is raised — the original
exception for a group of one, :class:`~colo.core.errors.RankFailed` naming the rank
otherwise — and what every rank did is kept in ``last_outcomes`` for the trace.

A rank is anything that satisfies the side protocol of
:mod:`colo.core.interfaces` (an in-process trainer, an engine client, a Ray
actor proxy): the group only awaits its methods.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio

from colo.core.errors import RankFailed


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


async def side_by_side(first: Awaitable[Any], second: Awaitable[Any]) -> None:
    """Both at once, each to its end; then the first's failure (else the second's) raised as
    itself, not as an ExceptionGroup: what a failed phase reports names it. (A trainer's offload
    checks its weights beside the pause of its other tags; the scheduler digests the engines
    beside that offload.)"""
    failed: list[tuple[int, BaseException]] = []

    async def run(i: int, step: Awaitable[Any]) -> None:
        try:
            await step
        except Exception as e:  # cancellation is not caught
            failed.append((i, e))

    async with anyio.create_task_group() as tg:
        tg.start_soon(run, 1, second)
        await run(0, first)
    if failed:
        raise min(failed, key=lambda f: f[0])[1]


async def together(calls: Sequence[Callable[[], Awaitable[Any]]], side: str, verb: str
                   ) -> tuple[list[Any], dict[int, str]]:
    """Run one call per rank at once and wait for all; raise the first real error.

    Every rank finishes its part before the error is raised: a rank inside a
    collective cannot be left waiting for one that was cancelled.
    """
    results: list[Any] = [None] * len(calls)
    errors: list[tuple[int, BaseException]] = []

    async def one(r: int) -> None:
        try:
            results[r] = await calls[r]()
        except Exception as exc:  # kept per rank; cancellation is not caught
            errors.append((r, exc))

    if len(calls) == 1:
        await one(0)
    else:
        async with anyio.create_task_group() as tg:
            for r in range(len(calls)):
                tg.start_soon(one, r)
    failed = dict(errors)
    outcomes = {r: _describe(failed[r]) if r in failed else "ok" for r in range(len(calls))}
    if errors:
        rank, exc = errors[0]  # in the order they happened: the first is the cause
        if len(calls) == 1:
            raise exc
        raise RankFailed(side, verb, rank, exc, outcomes) from exc
    return results, outcomes


class Group:
    side = "?"

    def __init__(self, ranks: Sequence[Any]):
        if not ranks:
            raise ValueError(f"a {self.side} group needs at least one rank, got none")
        self.ranks = list(ranks)
        #: rank -> "ok" or the error it raised, for the last verb
        self.last_outcomes: dict[int, str] = {}

    @classmethod
    def of(cls, side: Any) -> Group:
        """``side`` itself if it is a group already, the group of a list of ranks,
        else the group of one."""
        if isinstance(side, Group):
            return side
        return cls(list(side)) if isinstance(side, (list, tuple)) else cls([side])

    @property
    def size(self) -> int:
        return len(self.ranks)

    def __getitem__(self, rank: int) -> Any:
        return self.ranks[rank]

    def __len__(self) -> int:
        return len(self.ranks)

    def replace(self, rank: int, new: Any) -> None:
        """Swap in a new rank for one that died (recovery re-syncs it)."""
        self.ranks[rank] = new

    async def each(self, verb: str, *args: Any, per_rank: Sequence[tuple] | None = None) -> list:
        """``verb(*args)`` on every rank at once (or ``verb(*per_rank[r])``); results by rank."""
        calls = [(lambda r=r: getattr(self.ranks[r], verb)(*(per_rank[r] if per_rank is not None else args)))
                 for r in range(self.size)]
        results, self.last_outcomes = await together(calls, self.side, verb)
        return results

    def first(self, attr: str) -> Any:
        """A read-only property every rank agrees on (param specs, tag sizes): rank 0's."""
        return getattr(self.ranks[0], attr)()


class TrainerGroup(Group):
    side = "trainer"


class EngineGroup(Group):
    side = "engine"

    @property
    def capabilities(self) -> Any:
        """What the engine declares (``EngineCapabilities``): every rank of one engine is alike."""
        return self.ranks[0].capabilities
