"""How fast `colo replay` checks a large trace on the CPU.

Records a trace of at least --events events with the real scheduler and the
test fakes (every event kind the scheduler writes, memory snapshots on each),
then times `colo.offline.replay.replay` on it: reading + validation, the invariant
checker, the per-phase summary. Writes bench/results/replay-speed-<host>.json.

    python bench/replay_speed.py [--events 100000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def record(path: Path, events: int) -> int:
    import anyio

    from colo.core.config import SchedulerConfig
    from colo.core.memory import MemoryLedger
    from colo.scheduler import Scheduler
    from colo.trace.writer import TraceWriter
    from colo.testing.fakes import FakeEngine, FakeTrainer, FakeTransport

    async def main() -> int:
        trace = TraceWriter(path)
        count = [0]
        trace.add_listener(lambda ev: count.__setitem__(0, count[0] + 1))
        s = Scheduler(FakeTrainer(), FakeEngine(), MemoryLedger(total_bytes=10_000, reserved_bytes=64),
                      FakeTransport(), trace=trace, config=SchedulerConfig(plan="offload-first", bucket_bytes=50))
        async with s:
            while count[0] < events:
                await s.cycle()
        return count[0]

    return anyio.run(main)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--events", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from colo.offline.replay import check_trace, load_trace, replay

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "big.jsonl"
        n = record(path, args.events)
        size = path.stat().st_size
        totals, loads, checks = [], [], []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            report = replay([path])
            totals.append(time.perf_counter() - t0)
            assert report.valid, report.findings[:3]
            t0 = time.perf_counter()
            trace = load_trace(path)
            t1 = time.perf_counter()
            check_trace(trace)
            t2 = time.perf_counter()
            loads.append(t1 - t0)
            checks.append(t2 - t1)
    lines = len(report.results[0].trace.events)
    result = {
        "benchmark": "replay-speed",
        "what": "colo.offline.replay.replay() on one trace recorded by the scheduler with the test fakes "
                "(offload-first, 4 buckets per sync): read + validate + invariant checker + summary",
        "events": lines,
        "trace_bytes": size,
        "repeat": args.repeat,
        "seconds_median": round(statistics.median(totals), 4),
        "seconds_min": round(min(totals), 4),
        "events_per_s_median": round(lines / statistics.median(totals)),
        "read_validate_s_median": round(statistics.median(loads), 4),
        "check_summary_s_median": round(statistics.median(checks), 4),
        "machine": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": importlib.metadata.version("torch"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    out = Path(args.out or ROOT / "bench" / "results" / f"replay-speed-{platform.node() or 'host'}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
