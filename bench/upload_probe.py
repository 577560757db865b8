"""How fast small tensors go host -> device, by where the host bytes live.

    python bench/upload_probe.py [OUT.json]

The demo model's 51 fp32 tensors (11.5 MB, 512 B to 1 MiB each), uploaded one
copy per tensor on a side stream and timed with CUDA events, from: the pinned
backup torch_memory_saver keeps for a paused region (what ``offload-first``
uploads from), separately pinned torch tensors, and views of one pinned buffer;
then the same with the conversion to bf16 that the sync does after each upload.
Median of 5 passes after one warm-up; the GPU time of a pass, not the host's.
"""

from __future__ import annotations

import json
import statistics
import sys

import torch

SIZES = None  # filled from the demo model


def demo_sizes() -> list[int]:
    from colo.trainers.models import build_trainer_model, demo_model_config

    return [p.numel() for p in build_trainer_model(demo_model_config("demo"), 0).parameters()]


def event_ms(stream, fn):
    """``(GPU milliseconds of what fn queues on stream, fn's result)``, timed with CUDA events."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        a.record(stream)
        keep = fn()
        b.record(stream)
    b.synchronize()
    return a.elapsed_time(b), keep


def gpu_ms(fn, reps: int = 5, fresh: bool = False) -> float:
    s = torch.cuda.Stream()
    out = []
    for i in range(reps + 1):
        if fresh:
            # what the sync meets after the trainer's offload: an empty allocator cache
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        ms, keep = event_ms(s, fn)
        del keep
        if i:
            out.append(ms)
    return statistics.median(out)


def passes(host: list[torch.Tensor]) -> dict:
    dev = torch.device("cuda")
    out = {"pinned": all(t.is_pinned() for t in host)}
    for fresh in (False, True):
        tag = "_after_empty_cache" if fresh else ""
        out["upload_ms" + tag] = round(gpu_ms(lambda: [t.to(dev, non_blocking=True) for t in host], fresh=fresh), 3)
        out["upload_and_convert_ms" + tag] = round(gpu_ms(
            lambda: [t.to(dev, non_blocking=True).to(torch.bfloat16) for t in host], fresh=fresh), 3)
    return out


def main() -> int:
    sizes = demo_sizes()
    total = sum(sizes) * 4
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "tensors": len(sizes),
                    "bytes": total}
    torch.cuda.init()
    # separately pinned tensors
    sep = [torch.randn(n).pin_memory() for n in sizes]
    result["torch_pinned_each"] = passes(sep)
    # views of one pinned buffer
    flat = torch.empty(sum(sizes), pin_memory=True)
    views, off = [], 0
    for n in sizes:
        views.append(flat[off:off + n])
        off += n
    result["one_pinned_buffer"] = passes(views)
    one = gpu_ms(lambda: flat.to("cuda", non_blocking=True))
    result["one_pinned_buffer_one_copy_ms"] = round(one, 3)
    # torch_memory_saver's backup of a paused region
    from colo.device.cuda_memory import Saver

    saver = Saver()
    with saver.region("probe.weights", cpu_backup=True):
        params = [torch.randn(n, device="cuda") for n in sizes]
    saver.pause("probe.weights")
    backup = [saver.host_view(p) for p in params]
    result["saver_backup"] = passes(backup)
    result["saver_backup_addresses_contiguous"] = all(
        backup[i + 1].data_ptr() == backup[i].data_ptr() + backup[i].nbytes for i in range(len(backup) - 1))
    saver.resume("probe.weights")
    print(json.dumps(result, indent=1))
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
