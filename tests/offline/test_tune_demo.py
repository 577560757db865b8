"""The issue's acceptance test for ``colo tune``, on the real CPU demo: the demo
at the recommended mem_fraction_static completes, and at the recommendation +
0.05 it runs out of memory in the phase tune named.

The demo's simulated trainer leaves memory on the device after its first step
(as a real trainer's allocator cache does), so R grows after the engine sized
its pool and the wake-up of the KV cache is where a larger fraction fails.
"start" would be tune's name for the engine's start-up, before any phase.
"""

import json
from pathlib import Path

from colo.cli import main
from colo.apps.demo import DemoConfig, run
from colo.core.memory import OutOfMemory

#: recorded by ``colo demo --trace traces/cpu-demo.jsonl`` (defaults); if the demo's
#: memory changes, re-record it and this test tunes from the new one
RECORDED = Path(__file__).resolve().parents[2] / "traces" / "cpu-demo.jsonl"
SMALL = dict(steps=1, batch=4, new_tokens=4)  # memory does not depend on the batch: the KV pool is T x mfs - Wr


async def demo(tmp_path, name, mfs):
    """The OutOfMemory the demo ran into, or None when it completed."""
    try:
        out = await run(DemoConfig(mem_fraction_static=mfs, trace=str(tmp_path / name), **SMALL), progress=False)
    except OutOfMemory as e:  # raised while the scheduler starts, before any phase
        return e
    assert out.error is None or isinstance(out.error, OutOfMemory), out.error
    return out.error


async def test_demo_completes_at_the_recommendation_and_ooms_five_points_above_in_the_named_phase(tmp_path, capsys):
    assert main(["tune", str(RECORDED), "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    mfs, phase = rec["mem_fraction_static"], rec["binding_phase"]
    assert 0.5 < mfs < 0.99

    assert await demo(tmp_path, "at.jsonl", mfs) is None

    err = await demo(tmp_path, "above.jsonl", round(mfs + 0.05, 2))
    assert isinstance(err, OutOfMemory)
    assert phase == "engine_wake_kv"
    assert (err.phase or "start") == phase
    assert err.tag == "engine.kv_cache"  # the pool that mem_fraction_static sizes
