"""An adapter stage as few requests as its bytes allow (issue 43): colo's engine's adapter host
held in this process (as bench/adapter_profile.py holds it), so that every request the driver
sends is counted. A trainer's flat adapter goes in ONE request once the engine holds its spec
list (the begin, the load and the end together), and the engine derives what it needs from the
request's layout once; what arrived is still checked byte for byte each time (the digest, and
the tensors the engine registers)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from colo.apps.bench import AdapterSource
from colo.core.interfaces import EngineCapabilities, SyncContext
from colo.core.memory import StagingBudget
from colo.digest import expected_weights_digest
from colo.engine.adapter_host import AdapterHost
from colo.engine.adapters import AdapterEngine, AdapterVersions
from colo.engine.reference.adapters import EngineAdapters
from colo.engine.reference.core import EngineCore
from colo.models.lora import PEFT_PREFIX
from colo.trainers.models import demo_config
from colo.transports import make_transport


class InProcess(AdapterVersions):
    """The driver's half, its requests answered by a host in this process, each one recorded."""

    def __init__(self, host: AdapterHost):
        self.host, self.ops = host, []
        self.init_adapters()
        self.capabilities = EngineCapabilities()

    async def _adapter_op(self, op: str, *args: Any) -> dict:
        self.ops.append(op)
        return getattr(self.host, op)(*args)

    async def set_weight_version(self, version: int | None) -> None:
        pass  # no base weights here: only the adapters


def _host(config) -> AdapterHost:
    core = EngineCore(config, dtype="float32", device="cpu", total_bytes=256 << 20, mem_fraction_static=0.1)
    return AdapterHost(EngineAdapters(core))


async def _sync(transport, source, engine, step: int) -> None:
    ctx = SyncContext(step=step, weight_version=step, bucket_bytes=1 << 20, source="host", staging=StagingBudget(None),
                      flush_cache=False)
    result = await transport.sync(source, engine, ctx)
    assert result.buckets == 1 and result.tensors == len(source.state)


class Staging:
    """The trainer's flat adapter, the driver (in-process host), its adapter engine, one transport."""

    def __init__(self):
        self.config = demo_config()
        self.source = AdapterSource(self.config, 4, dtype="float32")
        self.inner = InProcess(_host(self.config))
        self.engine = AdapterEngine(self.inner, self.source.config)
        self.transport = make_transport("packed")

    @property
    def host(self) -> AdapterHost:
        return self.inner.host

    async def close(self) -> None:
        await self.transport.aclose()
        self.host.close()
        self.source.close()


@pytest.fixture
async def staging():
    s = Staging()
    try:
        yield s
    finally:
        await s.close()


async def test_a_flat_adapter_is_one_request_per_stage_and_its_layout_is_planned_once(staging):
    source, host, inner, engine, transport = (staging.source, staging.host, staging.inner, staging.engine,
                                              staging.transport)
    plans = []
    for step in range(4):
        if step == 2:  # the trainer's step: new bytes in the same buffer
            with torch.no_grad():
                for t in source.state.values():
                    t.mul_(-1.5)
        inner.ops.clear()
        await _sync(transport, source, engine, step)
        # the first stage names the spec list whole; each later one is one request
        assert inner.ops == (["preflight", "load"] if step == 0 else ["load"]), (step, inner.ops)
        want = expected_weights_digest(source.state, list(source.state), torch.float32)
        assert await engine.digest() == want
        await engine.set_weight_version(step + 1)
        plans.append(host.stage._plan[2])
        # what the engine registered is the trainer's bytes, each tensor where PEFT names it
        table = host.stage.model.adapters[inner.active_adapter]
        for name, t in source.state.items():
            module, part = name[len(PEFT_PREFIX):].rsplit(".lora_", 1)
            got = table[module][0 if part.startswith("A") else 1]
            assert torch.equal(got, t) and got.data_ptr() != t.data_ptr()
    assert all(p is plans[0] for p in plans)
    assert sorted(host.stage.model.adapters) == [3, 4]  # keep_adapters = 2


async def test_an_engine_that_lost_the_spec_list_is_sent_it_whole_and_a_bad_begin_begins_nothing(staging):
    source, inner, engine = staging.source, staging.inner, staging.engine
    await _sync(staging.transport, source, engine, 0)
    await engine.set_weight_version(1)
    # a restarted engine: the same driver, a host that holds nothing
    staging.host.close()
    inner.host = _host(staging.config)
    inner.ops.clear()
    await staging.transport.aclose()
    staging.transport = make_transport("packed")
    await _sync(staging.transport, source, engine, 1)
    assert inner.ops == ["load", "preflight", "load"]  # refused before a byte moved, then whole
    assert await engine.digest() == expected_weights_digest(source.state, list(source.state), torch.float32)
    # a begin naming a list this host never accepted begins nothing: the stage is not in progress
    with pytest.raises(Exception, match="spec list not cached"):
        staging.host.begin(9, source.config.to_json(), "0" * 32)
    assert staging.host.stage.session is None
