"""The engine's declared protocols are all a transport may use.

A strict proxy lets through only the members of ``EngineSide`` and
``EngineReceiver``; behind it, an in-process engine with real tensors. Every
transport must complete a real sync against it through the scheduler, and the
engine must end up holding exactly the trainer's tensors.
"""

import anyio
import pytest
import torch

from colo.core.config import SchedulerConfig
from colo.core.interfaces import EngineReceiver, EngineSide
from colo.core.memory import MemoryLedger
from colo.scheduler import Scheduler
from colo.testing.fakes import protocol_engine
from colo.testing.trainers import StateTrainer
from colo.trace.writer import TraceWriter
from colo.transports import LAUNCHERS, STRATEGIES, make_transport

# methods, and attributes declared by annotation (``EngineSide.capabilities``)
DECLARED = frozenset(n for proto in (EngineSide, EngineReceiver)
                     for n in (*vars(proto), *getattr(proto, "__annotations__", {})) if not n.startswith("_"))


class Strict:
    """Only the declared protocol members of ``target`` are reachable."""

    def __init__(self, target):
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "used", set())

    def __getattr__(self, name):
        if name not in DECLARED:
            raise AttributeError(f"{name!r} is not part of the declared engine protocols")
        self.used.add(name)
        return getattr(self._target, name)


def test_the_strict_proxy_refuses_an_undeclared_member():
    engine = Strict(protocol_engine([]))
    with pytest.raises(AttributeError, match="'logits' is not part of the declared engine protocols"):
        engine.logits
    assert {"preflight", "transport_load", "end_load", "drop_handles", "generate"} <= DECLARED


# every transport the engine kit receives (a sender whose receiver is an engine's own, SGLang's,
# speaks to that engine only: tests/sglang/); a transport that runs only under a launcher (rdt:
# between a rank's two Ray actors) needs more than these protocols, an engine that is a Ray
# actor: tests/ranks/test_ray_rdt.py
@pytest.mark.parametrize("name", sorted(n for n in STRATEGIES if n not in LAUNCHERS))
def test_every_transport_completes_a_sync_against_an_engine_of_only_the_protocols(name, tmp_path):
    g = torch.Generator().manual_seed(7)
    # a bf16, an fp32 and an int64 tensor, one larger than the bucket
    state = {"embed.weight": torch.randn(64, 48, generator=g).to(torch.bfloat16),
             "layer.0.weight": torch.randn(300, 40, generator=g),
             "layer.0.bias": torch.randn(40, generator=g),
             "positions": torch.arange(17, dtype=torch.int64)}
    # each tensor in its own dtype; every step adds 1 to all of them
    trainer = StateTrainer(state, dtype=None, trains=True)
    inner = protocol_engine(trainer.param_specs())
    engine = Strict(inner)
    options = {"root": str(tmp_path / "ckpt")} if name == "disk" else {}
    transport = make_transport(name, **options)

    async def main():
        trace = TraceWriter(None, keep_events=True)
        try:
            async with Scheduler(trainer, engine, MemoryLedger(total_bytes=64 << 20), transport, trace=trace,
                                 engine_synced=False,
                                 config=SchedulerConfig(plan="offload-first", bucket_bytes=16 << 10)) as s:
                await s.recover()  # release, offload, wake weights, sync, wake kv
                await s.cycle()  # a full cycle: train changes the weights, the sync delivers them
        finally:
            await transport.aclose()
        return trace.events

    events = anyio.run(main)
    syncs = [e for e in events if e["event"] == "sync.finished"]
    assert [e["weight_version"] for e in syncs] == [0, 1]
    assert syncs[0]["digest"] != syncs[1]["digest"]  # train changed every tensor; the sync delivered it
    for n, t in state.items():
        assert torch.equal(inner.sink.params[n], t), f"{name}: {n} differs after the sync"
    # packed's end rides on its last load request; the others end with a request of its own
    ends = set() if name == "packed" else {"end_load"}
    assert {"preflight", "begin_load", "transport_load"} | ends <= engine.used
    # the prefix cache flushed once before each of the 2 releases and once after each of the 2 syncs
    assert inner.sink.flushes == 4
    buckets = {e["bucket"] for e in events if e["event"] == "bucket.finished" and e["stage"] == "load"}
    assert len(buckets) >= 2  # the 16 KiB bucket splits the 48 KiB tensor set
