"""InProcessEngine: colo's engine protocol around a sink in this process (the README's
"your own engine" runs a whole loop on one; this checks its refusals and its digest)."""

from __future__ import annotations

import pytest
import torch

from colo.core.errors import EngineError, EngineStateError, WeightMismatch
from colo.core.interfaces import RolloutResult, SyncContext
from colo.core.memory import StagingBudget
from colo.digest import weights_digest
from colo.engine.kit import LoadSession
from colo.engine.local import InProcessEngine
from colo.testing.trainers import StateTrainer
from colo.transports import make_transport
from colo.transports.wire import Piece


class DictSink:
    device = torch.device("cpu")

    def __init__(self, shapes):
        self.params = {n: torch.zeros(s) for n, s in shapes.items()}

    def preflight(self, specs):
        pass

    def begin_load(self):
        self.session = LoadSession({n: tuple(p.shape) for n, p in self.params.items()})

    def load_weights(self, named):
        self.session.check(named)
        for name, t in named:
            if isinstance(t, Piece):  # a run of a tensor larger than the bucket, in place
                self.params[name].view(-1)[t.offset:t.end].copy_(t.data)
            else:
                self.params[name].copy_(t)
        return sum(self.session.advance(n, t) for n, t in named)

    def end_load(self):
        return self.session.finish()

    def flush_cache(self):
        pass


async def _rollout(step):
    return RolloutResult(reward=1.0, tokens=1)


async def test_a_sync_lands_and_the_digest_is_of_what_arrived_in_spec_order():
    state = {"w": torch.randn(300, 40), "b": torch.randn(7)}
    sink = DictSink({n: t.shape for n, t in state.items()})
    engine = InProcessEngine(sink, generate=_rollout, tag_bytes={"weights": 0, "kv_cache": 0})
    ctx = SyncContext(step=0, weight_version=1, bucket_bytes=16 << 10, source="host", staging=StagingBudget(None))
    transport = make_transport("packed")
    result = await transport.sync(StateTrainer(state), engine, ctx)  # "w" is larger than a bucket: pieces
    await transport.aclose()
    assert result.buckets > 2 and all(torch.equal(sink.params[n], t) for n, t in state.items())
    assert await engine.digest() == weights_digest(state.items())
    await engine.set_weight_version(1)
    assert (await engine.generate(0)).reward == 1.0


async def test_it_refuses_what_an_engine_must():
    sink = DictSink({"w": (4,)})
    engine = InProcessEngine(sink, generate=_rollout, tag_bytes={"weights": 16, "kv_cache": 0})
    await engine.release(["kv_cache", "weights"])
    with pytest.raises(EngineStateError, match="already released"):
        await engine.release(["weights"])
    with pytest.raises(EngineStateError, match="not a tag of this engine"):
        await engine.release(["cuda_graph"])
    with pytest.raises(EngineError, match="released"):
        await engine.generate(0)
    await engine.resume(["kv_cache", "weights"])
    with pytest.raises(EngineError, match="stale"):
        await engine.generate(0)  # resumed weights hold nothing until a sync
    await engine.begin_load()
    with pytest.raises(WeightMismatch, match="w"):
        await engine.end_load()  # a sync that delivered nothing is refused, naming what is missing
