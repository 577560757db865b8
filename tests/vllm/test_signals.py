"""A real vLLM in processes of its own under signals from outside colo (issue 45, item 5):
SIGSTOP and SIGKILL of vLLM's worker while colo waits on it.

A stopped process answers nothing and closes nothing: the call watches vLLM's processes (its
engine core and worker) as colo's engine client watches its engine, and after
``STOPPED_LIMIT_S`` of a stop kills them and reports the engine dead, instead of waiting out
``call_timeout_s``. A killed worker is reported dead too. Either way the engine is then
refused at once, and closing it leaves no process of vLLM's running."""

from __future__ import annotations

import os
import signal

import anyio
import pytest

from colo.core.errors import EngineDied
from colo.proc.lifecycle import process_state
from tests.leaks import named_after, new_segments
from tests.vllm.parts import LLM_ARGS
from tests.vllm.test_engine import PROMPTS, new_weights, sync

#: a ceiling that only catches a hang (the stop is seen after 3 s; vLLM's own call timeout
#: would be call_timeout_s): the verdict is the error, not the time
HANG_S = 300


async def _engine(model_dir):
    from colo.engine.vllm import VllmEngine

    engine = await VllmEngine.start(model_dir, processes=True, **LLM_ARGS)
    _, trainer = new_weights(11)
    await sync(engine, trainer, bucket_bytes=4 << 20, version=1)
    await engine.set_weight_version(1)
    return engine


def _running(pids):
    return [p for p in pids if process_state(p) not in (None, "Z", "X")]


@pytest.mark.parametrize("sig", [signal.SIGSTOP, signal.SIGKILL], ids=["SIGSTOP", "SIGKILL"])
async def test_a_signalled_vllm_worker_is_reported_dead_and_leaves_no_process(model_dir, sig):
    engine = await _engine(model_dir)
    own = engine._api.own_processes()
    try:
        # its engine core (a child of this process) and its worker, which holds the model
        assert len(own) == 2 and own[-1] == engine.pid != os.getpid(), own
        assert len(await engine.tokens(PROMPTS, max_new_tokens=4)) == len(PROMPTS)
        os.kill(engine.pid, sig)
        with anyio.fail_after(HANG_S):
            with pytest.raises(EngineDied) as err:
                await engine.tokens(PROMPTS, max_new_tokens=4)
        if sig == signal.SIGSTOP:
            assert "stopped (state T)" in str(err.value) and str(engine.pid) in str(err.value), err.value
            # killed, not left stopped: no process of vLLM's is stopped or running on
            assert not [p for p in own if process_state(p) in ("T", "t")]
        # known dead now: refused at once, never asked
        with anyio.fail_after(HANG_S):
            with pytest.raises(EngineDied, match="dead"):
                await engine.digest()
        assert not engine.alive()
    finally:
        with anyio.fail_after(HANG_S):
            await engine.aclose()
    # nothing of vLLM's runs on after the engine is closed (the worker's own parent, the
    # engine core, is gone: it may stay a zombie until init reaps it)
    with anyio.move_on_after(HANG_S):
        while _running(own):
            await anyio.sleep(0.1)
    assert not _running(own), [(p, process_state(p)) for p in own]
    # and nothing of this test's is left in /dev/shm or /tmp: colo's segments of this process,
    # and no entry named after a process of vLLM's (other tests' processes run beside this one)
    assert new_segments() == []
    named = named_after(own)
    assert named == [], named
