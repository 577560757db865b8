"""The real trainers' syncs and transitions on one GPU (issue 31, items 1, 3 and 4).

For each trainer (hf, megatron, fsdp) and each plan, one ``colo demo --device cuda``
run in a process of its own (a trainer per process, as deployed: torch_memory_saver
is process-wide), every sync verified; from its trace, with the first cycle left
out (it allocates and registers what later cycles reuse):

- ``sync_s``: the median ``transfer_s`` of the syncs, beside its floor: the
  payload over pinned host->device (``offload-first``'s source is the host
  backup) or one device copy of it (``sync-first``: read and write on the device);
- ``verify_s``: the median verification time of a sync, and its share of the sync;
- every transition (trainer offload and onload, engine release, wake weights,
  wake KV) as the median phase time, beside the bytes it moved over the link
  where it moves any (the trainer's tags, the engine's weights).

The copy limits are measured in the same call right before the first run and
after the last (``colo.apps.bench.measure_gpu_limits``); the runs' rates are
set against the lower of the two.

usage: python -m bench.trainer_syncs OUT.json [--model qwen2-1.5b] [--steps 5]
       [--trainers hf,megatron,fsdp] [--plans offload-first,sync-first] [--trace-dir DIR]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

TRANSITIONS = ("trainer_offload", "trainer_onload", "engine_release", "engine_wake_weights", "engine_wake_kv",
               "sync", "train", "rollout")


def run_demo(trainer: str, plan: str, model: str, steps: int, trace: str, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "colo.cli", "demo", "--device", "cuda", "--quiet", "--model", model,
           "--trainer", trainer, "--plan", plan, "--steps", str(steps), "--verify", "every",
           "--bucket-mib", "512", "--mem-fraction-static", "0.5", "--trace", trace, *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t0
    out = {"trainer": trainer, "plan": plan, "command": " ".join(cmd[1:]), "exit": proc.returncode,
           "wall_s": wall}
    if proc.returncode != 0:
        out["error"] = (proc.stdout[-1500:] + proc.stderr[-1500:]).strip()
        return out
    return {**out, **summarise(trace)}


def summarise(trace: str) -> dict:
    events = [json.loads(line) for line in open(trace)]
    start = events[0]
    syncs = [e for e in events if e["event"] == "sync.finished"]
    later = syncs[1:] or syncs
    phases: dict[str, list[float]] = {}
    for e in events:
        if e["event"] == "phase.finished" and e.get("step", 0) >= 1:
            phases.setdefault(e["phase"], []).append(e["duration_s"])
    tags = {k: v["bytes"] for k, v in start["tags"].items()}
    med = statistics.median
    return {
        "syncs": len(syncs), "syncs_counted": len(later),
        "bytes": later[0]["bytes"], "buckets": later[0]["buckets"], "tensors": later[0]["tensors"],
        "source": later[0].get("source"),
        "sync_s": med(e["transfer_s"] for e in later),
        "sync_s_all": [e["transfer_s"] for e in syncs],
        "verify_s": med(e["verify_s"] for e in later),
        "verify_s_all": [e["verify_s"] for e in syncs],
        "digests_distinct": len({e["digest"] for e in syncs}),
        "tags_bytes": tags,
        "phase_s_median": {p: med(v) for p, v in phases.items()},
        "phase_count": {p: len(v) for p, v in phases.items()},
        "failed_phases": sum(e["event"] == "phase.failed" for e in events),
    }


def against_limits(row: dict, limits: dict) -> dict:
    """The run's figures over the copy limits of the same call."""
    if row.get("exit") != 0:
        return row
    h2d, d2h = limits["pinned_h2d_GBps"] * 1e9, limits["pinned_d2h_GBps"] * 1e9
    d2d_one_copy = limits["d2d_copy_GBps_read_plus_write"] / 2 * 1e9  # bytes copied per second
    b = row["bytes"]
    floor = b / h2d if row["plan"] == "offload-first" else b / d2d_one_copy
    row["floor_s"] = floor
    row["floor_is"] = "payload / pinned h2d" if row["plan"] == "offload-first" else "payload / one device copy"
    row["sync_over_floor"] = row["sync_s"] / floor
    row["verify_share_of_sync"] = row["verify_s"] / row["sync_s"]
    tags = row["tags_bytes"]
    trainer_bytes = tags.get("trainer.weights", 0) + tags.get("trainer.optimizer", 0)
    ph = row["phase_s_median"]
    rates = {}
    for phase, nbytes, link, rate in (("trainer_offload", trainer_bytes, "pinned d2h", d2h),
                                      ("trainer_onload", trainer_bytes, "pinned h2d", h2d)):
        if phase in ph and ph[phase] > 0:
            rates[phase] = {"bytes": nbytes, "s": ph[phase], "GBps": nbytes / ph[phase] / 1e9, "link": link,
                            "of_link": nbytes / ph[phase] / rate}
    row["transition_rates"] = rates
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.trainer_syncs", allow_abbrev=False)
    ap.add_argument("out")
    ap.add_argument("--model", default="qwen2-1.5b")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--trainers", default="hf,megatron,fsdp")
    ap.add_argument("--plans", default="offload-first,sync-first")
    ap.add_argument("--trace-dir", default=None)
    ap.add_argument("--demo-arg", action="append", default=[], help="one more argument for every demo")
    args = ap.parse_args(argv)
    import torch

    from colo.apps.bench import measure_gpu_limits

    trace_dir = args.trace_dir or tempfile.mkdtemp(prefix="colo-trainer-syncs-")
    before = measure_gpu_limits()
    rows = []
    for trainer in args.trainers.split(","):
        for plan in args.plans.split(","):
            trace = os.path.join(trace_dir, f"{trainer}-{plan}.jsonl")
            row = run_demo(trainer, plan, args.model, args.steps, trace, args.demo_arg)
            rows.append(row)
            brief = {k: row.get(k) for k in ("trainer", "plan", "exit", "sync_s", "verify_s", "buckets", "bytes")}
            print(json.dumps(brief), flush=True)
    after = measure_gpu_limits()
    limits = {k: min(before[k], after[k]) for k in ("pinned_h2d_GBps", "pinned_d2h_GBps",
                                                     "d2d_copy_GBps_read_plus_write")}
    rows = [against_limits(r, limits) for r in rows]
    result = {"bench": "trainer_syncs", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "device_name": torch.cuda.get_device_name(), "gpu_count": torch.cuda.device_count(),
              "torch": torch.__version__, "model": args.model, "steps": args.steps,
              "limits_before": before, "limits_after": after, "limits_used": limits, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for r in rows:
        if r.get("exit") != 0:
            print(f"{r['trainer']:9s} {r['plan']:14s} FAILED exit {r['exit']}: {r.get('error', '')[-400:]}")
            continue
        tr = r["transition_rates"]
        print(f"{r['trainer']:9s} {r['plan']:14s} sync {r['sync_s'] * 1e3:7.1f} ms = {r['sync_over_floor']:.2f} x "
              f"floor {r['floor_s'] * 1e3:.1f} ms; verify {r['verify_s'] * 1e3:.1f} ms "
              f"({r['verify_share_of_sync']:.2f} of sync); buckets {r['buckets']}; offload "
              f"{tr.get('trainer_offload', {}).get('of_link', float('nan')):.2f}, onload "
              f"{tr.get('trainer_onload', {}).get('of_link', float('nan')):.2f} of link; phases "
              + ", ".join(f"{p} {s * 1e3:.0f}" for p, s in r["phase_s_median"].items()))
    return 0 if all(r.get("exit") == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
