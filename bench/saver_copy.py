"""Where a one-copy ``offload-first`` sync writes: host->device into memory-saver regions (issue 44).

    python -m bench.saver_copy OUT.json [--model qwen2-1.5b] [--reps 5] [--cap-mib 2048] [--free-gib 18]

The one-copy ``offload-first`` sync (a trainer's weights in one flat buffer, paused to a
shared pinned backup) has colo's engine copy each tensor out of that backup into its
parameters. On an H200 those copies ran at 46-52 GB/s (1.17-1.22 of the sync's floor), where
the same model's tensors copied one by one out of a segment of the same kind into plain
device memory ran at the link (54.0 of 54.9 GB/s, ``colo bench``'s
``registered_shm_h2d_by_tensor``). What is left is where they write: the engine allocates
each parameter with ``torch.empty`` inside a torch_memory_saver region, and releases and
wakes the region every cycle. This copies the model's tensors (its first ``--cap-mib`` of
them, in its order, 16-byte aligned as a flat buffer lays them) out of a registered
``/dev/shm`` segment, each tensor its own copy, into:

- ``plain``: one ``torch.empty`` per tensor, outside any region;
- ``region``: the same inside a memory-saver region (``engine.weights``, no host backup), as
  colo's engine allocates its parameters;
- ``region_woken``: that region after a pause and a resume (the saver unmaps and maps its
  pages again), as every colocated cycle leaves the engine's parameters; the first copy
  after the wake-up timed on its own, then the median of the next ones;
- ``region_one``: one allocation in a region of its own holding every tensor as a view at
  its span (as a flat buffer would), the other way the engine could allocate them;
- ``plain_from_read_only``: into plain memory again, out of a second mapping of the segment
  opened as the engine opens the trainer's backup (``cuda_ipc._open_pinned``: read-only,
  pinned with ``cudaHostRegisterReadOnly`` where the GPU can), and ``plain_from_writable``
  out of a second mapping pinned read-write, its control;
- ``after_free_here``: into plain memory right after this process freed ``--free-gib`` of
  device memory it had written (``empty_cache``: back to the driver), the first runs one by
  one, then again after a pause of two seconds (``settled_GBps``); ``after_pause_other``:
  the same right after another process paused a memory-saver region of that size (its pages
  unmapped and released), as the trainer's offload releases its optimizer state just before
  an ``offload-first`` sync; ``d2h_plain`` and ``d2h_after_pause_other``: the other way,
  device -> host into the segment (as a trainer's pause copies), plainly and right after
  another process's release.

Every destination is checked against the source's bytes after its copies. The pinned
host->device rate of the same run stands beside them. Needs a CUDA GPU and
torch-memory-saver; ``bash bench/gpu_run.sh savercopy`` runs it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from typing import Any


def _rate(fn: Any, payload: int) -> float:
    """GB/s of one run of ``fn``'s copies, timed on the device."""
    import torch

    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return payload / (a.elapsed_time(b) / 1e3) / 1e9


def _after_release(fn: Any, payload: int, release: Any, reps: int) -> dict:
    """``fn``'s rate in its first four runs right after ``release()`` returns, then after two seconds."""
    import time

    from colo.apps.bench import median_time

    release()
    runs = [_rate(fn, payload) for _ in range(4)]
    time.sleep(2.0)
    return {"runs_GBps": runs, "settled_GBps": payload / median_time(fn, reps) / 1e9}


def _free_here(gib: int) -> None:
    import torch

    big = torch.empty(gib << 30, dtype=torch.uint8, device="cuda")
    big.fill_(1)
    torch.cuda.synchronize()
    del big
    torch.cuda.empty_cache()


def _hold_then_pause(conn: Any, gib: int) -> None:
    """A process that writes a memory-saver region of ``gib`` GiB, then pauses it when told."""
    import torch

    from colo.device.cuda_memory import Saver, exit_past_the_saver

    saver = Saver()
    with saver.region("trainer.optimizer"):
        big = torch.empty(gib << 30, dtype=torch.uint8, device="cuda")
    big.fill_(1)
    torch.cuda.synchronize()
    conn.send("held")
    conn.recv()
    saver.pause("trainer.optimizer")
    conn.send("paused")
    conn.recv()
    exit_past_the_saver(0)


class _PausedElsewhere:
    """``release()`` for :func:`_after_release`: another process pauses its region."""

    def __init__(self, gib: int):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, there = ctx.Pipe()
        self.proc = ctx.Process(target=_hold_then_pause, args=(there, gib), daemon=True)
        self.proc.start()
        if not self.conn.poll(120) or self.conn.recv() != "held":
            self.proc.kill()
            raise RuntimeError("saver_copy: the other process did not hold its region within 120 s")

    def __call__(self) -> None:
        try:
            self.conn.send("pause")
            if not self.conn.poll(120) or self.conn.recv() != "paused":
                raise RuntimeError("saver_copy: the other process did not pause its region within 120 s")
        finally:
            self.conn.send("exit")


def _measure(model: str, reps: int, cap: int, free: int = 0) -> dict:
    import torch

    from colo.apps.bench import MODELS, flat_spans, measure_gpu_limits, median_time, tensor_bytes
    from colo.device.cuda_ipc import PinnedShm, _open_pinned
    from colo.proc.handles import ShmSegment
    from colo.device.cuda_memory import Saver

    spans = flat_spans(tensor_bytes(MODELS[model]), cap)
    payload = sum(b - a for a, b in spans)
    saver = Saver()  # first: before anything is allocated on the device
    limits = measure_gpu_limits(nbytes=min(cap, 2 << 30), reps=5)
    seg = PinnedShm.create(spans[-1][1])
    try:
        torch.manual_seed(0)
        host = seg.tensor
        host.copy_(torch.randint(0, 256, (host.numel(),), dtype=torch.uint8))
        src = [host[a:b] for a, b in spans]

        def into(dst: list) -> Any:
            def copy_each() -> None:
                for d, s in zip(dst, src):
                    d.copy_(s, non_blocking=True)
            return copy_each

        def exact(dst: list) -> bool:
            torch.cuda.synchronize()
            return all(torch.equal(d.cpu(), s) for d, s in zip(dst, src))

        rows = {}
        plain = [torch.empty(b - a, dtype=torch.uint8, device="cuda") for a, b in spans]
        took = median_time(into(plain), reps)
        rows["plain"] = {"GBps": payload / took / 1e9, "exact": exact(plain)}
        del plain
        torch.cuda.empty_cache()
        with saver.region("engine.weights"):
            region = [torch.empty(b - a, dtype=torch.uint8, device="cuda") for a, b in spans]
        took = median_time(into(region), reps)
        rows["region"] = {"GBps": payload / took / 1e9, "exact": exact(region)}
        saver.pause("engine.weights")
        saver.resume("engine.weights")
        first = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        first[0].record()
        into(region)()
        first[1].record()
        first[1].synchronize()
        took = median_time(into(region), reps)
        rows["region_woken"] = {"GBps": payload / took / 1e9,
                                "first_GBps": payload / (first[0].elapsed_time(first[1]) / 1e3) / 1e9,
                                "exact": exact(region)}
        del region
        with saver.region("engine.flat"):
            flat = torch.empty(spans[-1][1], dtype=torch.uint8, device="cuda")
        one = [flat[a:b] for a, b in spans]
        took = median_time(into(one), reps)
        rows["region_one"] = {"GBps": payload / took / 1e9, "exact": exact(one)}
        del one, flat
        torch.cuda.empty_cache()
        plain = [torch.empty(b - a, dtype=torch.uint8, device="cuda") for a, b in spans]
        for name, opened in (("plain_from_read_only", lambda: _open_pinned(seg.handle())),
                             ("plain_from_writable", lambda: PinnedShm(
                                 ShmSegment(seg.name, seg.nbytes, create=False, writable=True), register=True))):
            try:
                other = opened()
            except Exception as e:  # a second registration of the same pages refused: say so
                rows[name] = {"error": f"{type(e).__name__}: {e}"}
                continue
            try:
                src = [other.tensor[a:b] for a, b in spans]
                took = median_time(into(plain), reps)
                rows[name] = {"GBps": payload / took / 1e9, "exact": exact(plain),
                              "writable_mapping": other.seg.writable}
            finally:
                src = [host[a:b] for a, b in spans]  # the first mapping's views again, for the rows after
                other.close()
        if free > 0:
            rows["after_free_here"] = _after_release(into(plain), payload, lambda: _free_here(free), reps)
            rows["after_pause_other"] = _after_release(into(plain), payload, _PausedElsewhere(free), reps)
            rows["after_pause_other"]["exact"] = exact(plain)

            def out_of(dst: list) -> Any:  # device -> host, back into the segment (the same bytes)
                def copy_each() -> None:
                    for d, s in zip(dst, src):
                        s.copy_(d, non_blocking=True)
                return copy_each

            took = median_time(out_of(plain), reps)
            rows["d2h_plain"] = {"GBps": payload / took / 1e9, "exact": exact(plain)}
            rows["d2h_after_pause_other"] = _after_release(out_of(plain), payload, _PausedElsewhere(free), reps)
            rows["d2h_after_pause_other"]["exact"] = exact(plain)
        del plain
    finally:
        seg.close()
    return {"kind": "bench.saver_copy", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "device": torch.cuda.get_device_name(), "gpu_count": 1, "torch": torch.__version__,
            "model": model, "tensors": len(spans), "bytes": payload, "reps": reps, "free_gib": free, "limits": limits,
            "rows": rows}


def main(argv: list[str] | None = None) -> int:
    from colo.apps.bench import MODELS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("out")
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen2-1.5b")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cap-mib", type=int, default=2048, help="copy the model's first tensors up to this size")
    ap.add_argument("--free-gib", type=int, default=18,
                    help="device memory released just before the after_* rows (0: no such rows)")
    args = ap.parse_args(argv)
    if args.reps < 1 or args.cap_mib < 1 or args.free_gib < 0:
        ap.error("--reps and --cap-mib must be at least 1, --free-gib at least 0")
    import torch

    if not torch.cuda.is_available():
        print("saver_copy: needs a CUDA GPU (it times copies into memory-saver regions on the device)",
              file=sys.stderr)
        return 2
    out = _measure(args.model, args.reps, args.cap_mib << 20, args.free_gib)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    p = out["limits"]["pinned_h2d_GBps"]
    print(f"{out['model']}: {out['tensors']} tensors, {out['bytes']:,} B, each its own copy out of a registered "
          f"/dev/shm segment (pinned host->device {p:.1f} GB/s)")
    for name, row in out["rows"].items():
        if "error" in row:
            print(f"  into {name:13s} not measured: {row['error']}")
            continue
        if "runs_GBps" in row:
            runs = ", ".join(f"{r:.1f}" for r in row["runs_GBps"])
            print(f"  {name}: its first runs {runs} GB/s, after 2 s {row['settled_GBps']:.1f} GB/s")
            continue
        first = f", first after the wake-up {row['first_GBps']:.1f} GB/s" if "first_GBps" in row else ""
        print(f"  into {name:13s} {row['GBps']:6.1f} GB/s ({row['GBps'] / p:.3f} of pinned){first}, "
              f"exact {row['exact']}")
    return 0


if __name__ == "__main__":
    from colo.device.cuda_memory import exit_past_the_saver

    code = main()
    sys.exit(exit_past_the_saver(code))
