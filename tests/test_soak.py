"""Issue 6, soak: 500 cycles of the demo loop on the CPU keep fds, /dev/shm entries and
resident memory flat, and every cycle's sync is verified (bench/soak.py also measures the
engine process; 500 cycles took 86 s on the 2-core development VM, so this runs in CI)."""

import os

import pytest

from colo.apps.demo import DemoConfig, run
from colo.handles import leftover_segments
from colo.trace.writer import read_trace

pytestmark = pytest.mark.slow

CYCLES, WARMUP = 500, 50


def children() -> list[int]:
    """This process's child processes (the engine)."""
    kids = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid():
                        kids.append(int(pid))
            except (OSError, IndexError, ValueError):
                pass
    return kids


def rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


async def test_five_hundred_cycles_keep_fds_shm_and_memory_flat_and_verify_every_sync(tmp_path):
    seen = {}

    def on_cycle(n):
        if n in (WARMUP, CYCLES):
            engines = children()
            assert engines  # the engine process is one of them
            # only this run's fds and segments: this process's and its engine's, not
            # every segment in /dev/shm (other tests and runs share it)
            fds = {pid: len(os.listdir(f"/proc/{pid}/fd")) for pid in (os.getpid(), *engines)}
            shm = {pid: leftover_segments(pid) for pid in (os.getpid(), *engines)}
            seen[n] = (rss(), fds, shm)

    out = await run(DemoConfig(steps=CYCLES, batch=4, new_tokens=4, trace=str(tmp_path / "t.jsonl")),
                    progress=False, on_cycle=on_cycle)
    assert out.error is None and len(out.rewards) == CYCLES
    syncs = [e for e in read_trace(out.trace_path) if e["event"] == "sync.finished"]
    # the demo's verifier checked digest and probe logits after each of these
    assert [s["weight_version"] for s in syncs] == list(range(1, CYCLES + 1))
    (rss_a, fds_a, shm_a), (rss_b, fds_b, shm_b) = seen[WARMUP], seen[CYCLES]
    assert (fds_b, shm_b) == (fds_a, shm_a)
    assert rss_b < rss_a * 1.05
