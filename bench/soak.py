"""Soak: N cycles of the CPU demo loop; resident memory, fds and /dev/shm entries.

    python bench/soak.py --cycles 500 [--warmup 50] [--out PATH]  (default: bench/results/soak-cpu-<date>[-N].json)

Every sync is verified by the demo itself (digest and probe logits against the
trainer); the run fails otherwise. RSS is this process's (the trainer's side)
plus the engine process's, read from /proc.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import anyio

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from colo.apps.bench import write_result  # noqa: E402
from colo.apps.demo import DemoConfig, run  # noqa: E402
from colo.trace.writer import read_trace  # noqa: E402


#: where results go when no --out is given (the committed results live here)
RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def engine_pids() -> list[int]:
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


def sample() -> dict:
    return {"rss_trainer": rss_bytes(os.getpid()), "rss_engine": sum(rss_bytes(p) for p in engine_pids()),
            "fds": len(os.listdir("/proc/self/fd")), "shm": len(os.listdir("/dev/shm"))}


def soak(cycles: int, warmup: int, trace: str) -> dict:
    samples: dict[int, dict] = {}

    def on_cycle(n: int) -> None:
        if n in (warmup, cycles) or n % 50 == 0:
            samples[n] = sample()

    cfg = DemoConfig(steps=cycles, batch=4, new_tokens=4, trace=trace)
    t0 = time.perf_counter()
    out = anyio.run(lambda: run(cfg, progress=False, on_cycle=on_cycle))
    wall = time.perf_counter() - t0
    syncs = [e for e in read_trace(trace) if e["event"] == "sync.finished"]
    a, b = samples[warmup], samples[cycles]
    rss_a, rss_b = a["rss_trainer"] + a["rss_engine"], b["rss_trainer"] + b["rss_engine"]
    return {"cycles": cycles, "warmup_cycles": warmup, "error": None if out.error is None else str(out.error),
            "cycles_verified": len(syncs), "wall_s": round(wall, 1),
            "rss_after_warmup": rss_a, "rss_end": rss_b, "rss_growth_pct": round(100 * (rss_b - rss_a) / rss_a, 2),
            "fds_after_warmup": a["fds"], "fds_end": b["fds"], "shm_after_warmup": a["shm"], "shm_end": b["shm"],
            "samples": samples, "config": {"batch": 4, "new_tokens": 4, "plan": cfg.plan, "transport": cfg.transport}}


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--cycles", type=int, default=500)
    p.add_argument("--warmup", type=int, default=50)
    # default: bench/results/soak-cpu-<date>.json, or -2, -3 ... if that exists (never overwritten)
    p.add_argument("--out", default=None)
    p.add_argument("--trace", default="/tmp/colo-soak.jsonl")
    a = p.parse_args()
    res = soak(a.cycles, a.warmup, a.trace)
    out = write_result(json.dumps(res, indent=1), out=a.out, directory=RESULTS_DIR,
                       stem=f"soak-cpu-{datetime.date.today().isoformat()}")
    print(f"results: {out}", file=sys.stderr)
    print(json.dumps({k: v for k, v in res.items() if k != "samples"}, indent=1))
    ok = (res["error"] is None and res["cycles_verified"] >= a.cycles and res["rss_growth_pct"] < 5
          and res["fds_end"] == res["fds_after_warmup"] and res["shm_end"] == res["shm_after_warmup"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
