"""Issue 16, a stopped engine: SIGSTOP'd, it answers nothing but does not close the
channel; the client's heartbeat sees it stopped within seconds, kills it (EngineDied),
and the demo recovers as from a killed engine, to the weights of a run without it."""

import os
import signal

import anyio
import pytest

from colo.apps import demo
from colo.apps.demo import DemoConfig, run
from colo.engine.reference.client import EngineClient
from colo.proc.lifecycle import process_state
from colo.core.errors import EngineDied

from tests.proc.test_lifecycle import _build
from tests.waits import CEILING_S


async def test_a_stopped_engine_is_engine_died_within_seconds_and_killed(tmp_path):
    client = await EngineClient.spawn(_build(tmp_path), start_timeout_s=CEILING_S)
    try:
        assert (await client.call("hello"))["ok"]
        os.kill(client.process.pid, signal.SIGSTOP)
        with anyio.fail_after(CEILING_S):  # a hang guard: the phase deadline would be 600 s
            with pytest.raises(EngineDied, match=rf"process {client.process.pid} was stopped"):
                await client.call("digest")
        assert not client.process.is_alive()
    finally:
        await client.aclose()


async def test_a_busy_engine_is_not_a_stopped_one(tmp_path):
    client = await EngineClient.spawn(_build(tmp_path), start_timeout_s=CEILING_S)
    try:
        assert process_state(client.process.pid) in ("R", "S", "D")
        assert process_state(2**22 + 12345) is None  # no such process
    finally:
        await client.aclose()


def _demo_cfg(tmp_path, name):
    return DemoConfig(steps=3, seed=5, batch=4, new_tokens=4, trace=str(tmp_path / f"{name}.jsonl"))


async def test_the_demo_recovers_from_a_stopped_engine_to_the_fault_free_weights(tmp_path, monkeypatch):
    clean = await run(_demo_cfg(tmp_path, "clean"), progress=False)
    assert clean.error is None, clean.error

    pids = []
    spawn = demo.DemoRun._spawn_engine

    async def spawn_and_note(self, build):
        engine = await spawn(self, build)
        pids.append(engine.process.pid)
        return engine

    def stop_the_engine(cycles):
        if cycles == 1:  # between cycles: the next cycle's first request meets a stopped engine
            os.kill(pids[0], signal.SIGSTOP)

    monkeypatch.setattr(demo.DemoRun, "_spawn_engine", spawn_and_note)
    with anyio.fail_after(300):  # a hang guard: the stall would last the 600 s phase deadline
        out = await run(_demo_cfg(tmp_path, "stopped"), progress=False, on_cycle=stop_the_engine)
    assert out.error is None, out.error
    [rec] = out.recoveries
    assert rec.recovered and rec.engine_replaced and rec.old_engine_pid == pids[0]
    assert "was stopped" in rec.cause
    assert len(pids) == 2
    assert out.rewards == clean.rewards
    assert out.trainer_digest is not None and out.trainer_digest == clean.trainer_digest


