"""Issue 16, a stopped engine: SIGSTOP'd, it answers nothing but does not close the
channel; the client's heartbeat sees it stopped within seconds, kills it (EngineDied),
and the demo recovers as from a killed engine, to the weights of a run without it."""

import os
import signal

import anyio
import pytest

from colo.apps import demo
from colo.apps.demo import DemoConfig, run
from colo.engine.client import EngineClient
from colo.proc.lifecycle import process_state
from colo.core.errors import EngineDied

from tests.proc.test_lifecycle import _build


async def test_a_stopped_engine_is_engine_died_within_seconds_and_killed(tmp_path):
    client = await EngineClient.spawn(_build(tmp_path), start_timeout_s=60)
    try:
        assert (await client.call("hello"))["ok"]
        os.kill(client.process.pid, signal.SIGSTOP)
        with anyio.fail_after(60):  # a hang guard: the phase deadline would be 600 s
            with pytest.raises(EngineDied, match=rf"process {client.process.pid} was stopped"):
                await client.call("digest")
        assert not client.process.is_alive()
    finally:
        await client.aclose()


async def test_a_busy_engine_is_not_a_stopped_one(tmp_path):
    client = await EngineClient.spawn(_build(tmp_path), start_timeout_s=60)
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


# -- issue 32, item 6: a stopped rank worker -------------------------------------------------

async def test_a_stopped_rank_worker_ends_the_run_within_seconds_naming_the_rank(tmp_path, monkeypatch):
    """``--gpus 2`` with rank 1's worker SIGSTOPped between cycles: the driver's heartbeat
    reads the worker's /proc/<pid>/stat while a request waits, kills it after 3 s stopped,
    and the run ends naming rank 1. Before the fix there was no heartbeat on a rank worker:
    the request waited out the phase deadline (here 30 s), the cleanup waited on the stopped
    worker again, and the run ended after minutes with an empty ``TimeoutError:``."""
    import time

    from colo.apps import demo_multi
    from colo.core.errors import RankDied, RankFailed

    workers = []
    spawn = demo_multi.MultiDemoRun._spawn_workers

    async def spawn_and_note(self, specs):
        await spawn(self, specs)
        workers.extend(self.workers)

    stopped_at: list[float] = []

    def stop_rank_1(cycles):
        if cycles == 1:  # between cycles: the next cycle's rollout needs rank 1
            os.kill(workers[1].process.pid, signal.SIGSTOP)
            stopped_at.append(time.monotonic())

    monkeypatch.setattr(demo_multi.MultiDemoRun, "_spawn_workers", spawn_and_note)
    cfg = DemoConfig(steps=3, seed=5, batch=4, new_tokens=4, gpus=2, phase_deadline_s=30.0,
                     trace=str(tmp_path / "stopped.jsonl"))
    try:
        out = await run(cfg, progress=False, on_cycle=stop_rank_1)
        ended = time.monotonic()
    finally:
        for w in workers:  # never leave a stopped process behind, whatever happened
            if w.process.is_alive():
                os.kill(w.process.pid, signal.SIGKILL)
    pid = workers[1].process.pid
    assert len(out.rewards) == 1
    # found stopped after 3 s, killed; the whole run (rank 0's cleanup included) well
    # inside the 30 s phase deadline even on a loaded 2-core machine
    assert ended - stopped_at[0] < 25
    err = out.error
    assert isinstance(err, RankFailed) and err.rank == 1 and isinstance(err.cause, RankDied)
    assert str(err.cause).startswith(f"rank 1 worker process {pid} was stopped (state T) for ")
    assert str(err.cause).endswith("; killed it")
    assert not any(w.process.is_alive() for w in workers)
