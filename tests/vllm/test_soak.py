"""Issue 45, item 6: 200 cycles of the demo on a real vLLM keep every process flat: the
driver with vLLM in it, and, with ``--vllm-processes``, vLLM's own engine-core and worker
processes.
Resident memory is sampled every 10 cycles; its least-squares slope after warm-up is printed
per process and bounded; open fds and /dev/shm segments are the same at the end as after
warm-up. A soak: ``COLO_SOAK=1 tools/vllm-env python -m pytest -s tests/vllm/test_soak.py``
runs it (minutes); CI does not."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from colo.trace.writer import read_trace
from tests.soak_probe import slope

pytestmark = [pytest.mark.slow, pytest.mark.soak]

CYCLES, WARMUP, EVERY = 200, 40, 10
#: each process's RSS slope after warm-up: at most 16 KiB a cycle (2.5 MiB over 160 cycles)
SLOPE_BOUND = 16 << 10
REPO = Path(__file__).resolve().parents[2]

_LOOP = r"""
import json, os, sys, anyio
from colo.apps.demo import DemoConfig, run
from tests.soak_probe import cmdline, descendants, sample

cycles, every, trace, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
samples = {}

def on_cycle(n):
    if n % every == 0:
        procs = {"driver": os.getpid()}
        for p in descendants(os.getpid()):
            if "resource_tracker" not in cmdline(p):
                procs[f"child{p}"] = p
        samples[n] = {role: sample(pid) for role, pid in procs.items()}

cfg = DemoConfig(steps=cycles, engine="vllm", engine_dtype="float32", batch=4, new_tokens=4, trace=trace,
                 vllm_processes=sys.argv[5] == "processes")
res = anyio.run(lambda: run(cfg, progress=False, on_cycle=on_cycle))
with open(out, "w") as f:
    json.dump({"error": None if res.error is None else repr(res.error), "rewards": len(res.rewards),
               "samples": samples}, f)
"""


@pytest.mark.parametrize("where", ["in-process", "processes"])
def test_200_cycles_on_vllm_keep_every_process_flat(where, tmp_path):
    trace, out = tmp_path / "t.jsonl", tmp_path / "seen.json"
    proc = subprocess.run([sys.executable, "-c", _LOOP, str(CYCLES), str(EVERY), str(trace), str(out), where],
                          cwd=REPO, capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["error"] is None and got["rewards"] == CYCLES, got["error"]
    syncs = [e for e in read_trace(trace) if e["event"] == "sync.finished"]
    assert [s["weight_version"] for s in syncs] == list(range(1, CYCLES + 1))  # each verified by the demo
    samples = {int(n): s for n, s in got["samples"].items()}
    first, last = samples[WARMUP], samples[CYCLES]
    # the same processes throughout; with --vllm-processes vLLM's own beside the driver
    assert sorted(first) == sorted(last) and len(first) >= (2 if where == "processes" else 1), sorted(first)
    print()
    for role in sorted(first):
        points = [(n, s[role]["rss"]) for n, s in sorted(samples.items()) if n >= WARMUP]
        b = slope(points)
        print(f"{role:14s} pid {first[role]['pid']:>7d}  RSS {first[role]['rss'] / 2**20:7.1f} -> "
              f"{last[role]['rss'] / 2**20:7.1f} MiB  slope {b / 1024:+7.2f} KiB/cycle over cycles "
              f"{WARMUP}..{CYCLES}  fds {first[role]['fds']} -> {last[role]['fds']}  "
              f"segments {first[role]['shm']} -> {last[role]['shm']}")
        assert b < SLOPE_BOUND, f"{role}: RSS grows {b / 1024:.1f} KiB a cycle after warm-up"
        assert (last[role]["fds"], last[role]["shm"]) == (first[role]["fds"], first[role]["shm"]), role
