"""One process's device work in a torch.profiler Chrome trace, summed: ``python -m bench.device_trace TRACE...``.

Issue 44: at Qwen2-1.5B an ``offload-first`` sync of Megatron's weights kept the engine's
device busy 61-64 ms where hf's same bytes took 57-59, and nothing in the engine's reply says
which copies took the rest. A trace of the engine's load (``COLO_BENCH_PROFILE``: colo's
engine records itself beside the trainer) holds every copy and kernel the device ran, with
its bytes; this prints, per trace, the device's span, its busy and idle time, the copies by
kind and size class with their rate, and the longest idle gaps with the event after each.
``--json OUT`` writes the same as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

#: size classes of a copy, bytes: the per-copy cost of a small DMA shows in the small classes' rate
CLASSES = ((64 << 10, "< 64 KiB"), (1 << 20, "64 KiB - 1 MiB"), (16 << 20, "1 - 16 MiB"), (None, ">= 16 MiB"))


def device_events(trace: dict) -> list[dict]:
    """The trace's device activity (kernels, memcpy, memset), ordered by start."""
    out = [e for e in trace.get("traceEvents", [])
           if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    return sorted(out, key=lambda e: float(e["ts"]))


def _class(nbytes: int) -> str:
    for bound, name in CLASSES:
        if bound is None or nbytes < bound:
            return name
    raise AssertionError("unreachable")


def summarize(trace: dict, gaps: int = 8) -> dict[str, Any]:
    events = device_events(trace)
    if not events:
        return {"events": 0}
    start = float(events[0]["ts"])
    end = max(float(e["ts"]) + float(e.get("dur", 0)) for e in events)
    busy, idle, last_end, holes = 0.0, 0.0, start, []
    by: dict[tuple[str, str], dict[str, float]] = {}
    for e in events:
        ts, dur = float(e["ts"]), float(e.get("dur", 0))
        if ts > last_end:
            idle += ts - last_end
            holes.append((ts - last_end, e["name"][:60], int((e.get("args") or {}).get("bytes", 0))))
        busy += max(0.0, ts + dur - max(ts, last_end))
        last_end = max(last_end, ts + dur)
        nbytes = int((e.get("args") or {}).get("bytes", 0))
        kind = e["name"] if e.get("cat") != "kernel" else "kernel"
        row = by.setdefault((kind[:48], _class(nbytes) if e.get("cat") == "gpu_memcpy" else "-"),
                            {"count": 0, "bytes": 0, "us": 0.0})
        row["count"] += 1
        row["bytes"] += nbytes
        row["us"] += dur
    holes.sort(reverse=True)
    return {"events": len(events), "span_ms": (end - start) / 1e3, "busy_ms": busy / 1e3, "idle_ms": idle / 1e3,
            "by_kind": [{"kind": k, "size": c, "count": int(v["count"]), "bytes": int(v["bytes"]),
                         "ms": v["us"] / 1e3, "GBps": (v["bytes"] / (v["us"] * 1e3)) if v["us"] and v["bytes"] else None}
                        for (k, c), v in sorted(by.items(), key=lambda kv: -kv[1]["us"])],
            "longest_idle": [{"us": g, "next": n, "next_bytes": b} for g, n, b in holes[:gaps]]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    out = {}
    for path in args.traces:
        with open(path) as f:
            s = out[path] = summarize(json.load(f))
        print(f"== {path}")
        if not s["events"]:
            print("   no device events")
            continue
        print(f"   {s['events']} device events: span {s['span_ms']:.2f} ms, busy {s['busy_ms']:.2f}, idle {s['idle_ms']:.2f}")
        for r in s["by_kind"]:
            rate = f"{r['GBps']:.1f} GB/s" if r["GBps"] else ""
            print(f"   {r['kind']:<48} {r['size']:<15} {r['count']:>5} x {r['bytes'] / 2**20:>9.1f} MiB "
                  f"{r['ms']:>8.2f} ms {rate}")
        for g in s["longest_idle"]:
            print(f"   idle {g['us']:>8.1f} us before {g['next']} ({g['next_bytes']} B)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
