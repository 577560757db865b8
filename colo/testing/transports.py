"""A sender broken on purpose, for the tests that show a check has teeth.

The byte-counting transport the scheduler's unit tests use is
:class:`colo.testing.fakes.FakeTransport`.
"""

from __future__ import annotations

from colo.transports.packed import PackedTransport


class OneBufferPacked(PackedTransport):
    """A broken sender: every bucket goes through buffer 0, reused before the ack."""

    async def _pack(self, bucket, tensors, slot, ctx):
        await super()._pack(bucket, tensors, 0, ctx)

    async def _handoff(self, engine, bucket, slot, ctx):
        await super()._handoff(engine, bucket, 0, ctx)
