"""colo.transports.base.pipeline: bucket i+1 is prepared while bucket i is handed off.

Structural, not timed: each fake prepare(i+1) waits until handoff(i) has begun,
and each handoff(i) waits until prepare(i+1) has begun, so a pipeline that ran
them one after the other would never finish (the test's guard turns that hang
into a failure). The demo's traces (tests/transports/test_transports.py) check
the same order with real transports; their spans are measured and cannot.
"""

from __future__ import annotations

import anyio
import pytest

from colo.core.buckets import Bucket
from colo.transports.base import pipeline

#: a hang guard only: the fakes do no work, a correct pipeline ends at once
HANG_S = 60


def buckets(n: int) -> list[Bucket]:
    return [Bucket(index=i, entries=(), nbytes=0) for i in range(n)]


class Recorder:
    def __init__(self, n: int, *, overlap: bool) -> None:
        self.log: list[tuple[str, int, int, str]] = []
        self.started = {(k, i): anyio.Event() for k in ("prepare", "handoff") for i in range(n)}
        self.n, self.overlap = n, overlap

    async def prepare(self, bucket: Bucket, slot: int) -> None:
        i = bucket.index
        self.log.append(("prepare", i, slot, "start"))
        self.started["prepare", i].set()
        if self.overlap and i > 0:
            await self.started["handoff", i - 1].wait()
        await anyio.lowlevel.checkpoint()
        self.log.append(("prepare", i, slot, "end"))

    async def handoff(self, bucket: Bucket, slot: int) -> None:
        i = bucket.index
        self.log.append(("handoff", i, slot, "start"))
        self.started["handoff", i].set()
        if self.overlap and i + 1 < self.n:
            await self.started["prepare", i + 1].wait()
        await anyio.lowlevel.checkpoint()
        self.log.append(("handoff", i, slot, "end"))

    def at(self, kind: str, i: int, edge: str) -> int:
        return next(k for k, (a, b, _, e) in enumerate(self.log) if (a, b, e) == (kind, i, edge))


@pytest.mark.parametrize("n", [1, 2, 5])
async def test_the_next_bucket_is_prepared_while_this_one_is_handed_off(n):
    rec = Recorder(n, overlap=True)
    with anyio.fail_after(HANG_S):
        await pipeline(buckets(n), rec.prepare, rec.handoff)
    # every bucket prepared and handed off once, in its own slot (index % 2)
    assert sorted((k, i, s) for k, i, s, e in rec.log if e == "end") == sorted(
        (k, i, i % 2) for k in ("prepare", "handoff") for i in range(n))
    for i in range(n):
        assert rec.at("prepare", i, "end") < rec.at("handoff", i, "start")
    for i in range(n - 1):
        # both ran at once: each began before the other ended
        assert rec.at("prepare", i + 1, "start") < rec.at("handoff", i, "end")
        assert rec.at("handoff", i, "start") < rec.at("prepare", i + 1, "end")
        # bucket i+1 goes out only after bucket i's handoff returned (its ack)
        assert rec.at("handoff", i, "end") < rec.at("handoff", i + 1, "start")
    for i in range(n - 2):
        # bucket i+2 reuses bucket i's slot: only after bucket i's handoff returned
        assert rec.at("handoff", i, "end") < rec.at("prepare", i + 2, "start")


async def test_a_pipeline_that_is_not_pipelined_runs_one_step_at_a_time():
    rec = Recorder(4, overlap=False)
    await pipeline(buckets(4), rec.prepare, rec.handoff, pipelined=False)
    steps = [(k, i) for k, i, _, e in rec.log if e == "start"]
    assert steps == [("prepare", 0), ("handoff", 0), ("prepare", 1), ("handoff", 1),
                     ("prepare", 2), ("handoff", 2), ("prepare", 3), ("handoff", 3)]
    # nothing interleaved: every start is followed by its own end
    assert all(rec.log[k][:3] == rec.log[k + 1][:3] for k in range(0, len(rec.log), 2))


async def test_a_failed_handoff_is_raised_as_itself_and_stops_the_pipeline():
    rec = Recorder(4, overlap=False)

    async def handoff(bucket: Bucket, slot: int) -> None:
        await rec.handoff(bucket, slot)
        if bucket.index == 1:
            raise RuntimeError("engine refused bucket 1")

    with pytest.raises(RuntimeError, match="engine refused bucket 1"):
        await pipeline(buckets(4), rec.prepare, handoff)
    assert not any(k == "handoff" and i > 1 for k, i, _, _ in rec.log)
