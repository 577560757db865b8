"""The copying kernel of a one-copy load against one device copy: ``python -m bench.copy_kernel OUT.json``.

Issue 44: a one-copy ``sync-first`` load is one launch of ``colo.digest``'s copying kernel
(``Copies``) out of the trainer's flat buffer into the engine's parameters. On an H200 it
took 2.2-2.4 ms of device time at Qwen2-1.5B where one device copy of the same bytes takes
1.46 ms (call67d), and 2.8 ms under the profiler (call68a). This times that kernel on a
model's tensors (the sources laid out in one buffer as a trainer's flat weights are, the
destinations one allocation each), with and without its checksum lanes, under each launch
shape swept here and in its 4-byte and 16-byte variants (``_COPY_ALIGNED``), its table laid
on the buffer at each launch (``Copies``) and made once (``PlannedCopies``), beside the
same bytes in one ``copy_`` and in torch's ``_foreach_copy_``: the device's own time
(CUDA events, median of ``--reps`` after a warm-up). Every row is checked: the
destinations equal the sources byte for byte and the lanes equal ``colo.digest.lanes`` of
each source.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys

import torch

#: (words per iteration, iterations per program, warps): the launch shapes swept; the first is
#: the kernel's default. call68b swept seven: with 16-byte units they were within 3 % of each other
SHAPES = ((2048, 64, 8), (1024, 64, 4), (8192, 16, 16))


def layout(specs: list, align: int = 256) -> tuple[list[int], int]:
    """Each tensor's byte offset in one buffer, every one on an ``align``-byte boundary."""
    starts, at = [], 0
    for s in specs:
        starts.append(at)
        at += -(-s.nbytes // align) * align
    return starts, at


def measure(model: str, reps: int, shapes=SHAPES) -> dict:
    import colo.digest as D
    from colo.apps.bench import MODELS, median_time
    from colo.engine.reference.weights import expected_hf_specs
    from colo.trainers.models import demo_config

    specs = expected_hf_specs(demo_config(**MODELS[model].config), torch.bfloat16)
    starts, total = layout(specs)
    g = torch.Generator(device="cuda").manual_seed(0)
    flat = torch.empty(total // 2, dtype=torch.bfloat16, device="cuda")
    flat.normal_(generator=g)
    flat = flat.view(torch.uint8)
    srcs = [flat[a:a + s.nbytes].view(torch.bfloat16).view(s.shape) for a, s in zip(starts, specs)]
    dsts = [torch.empty(s.shape, dtype=torch.bfloat16, device="cuda") for s in specs]
    nbytes = sum(s.nbytes for s in specs)
    want = torch.stack([D.lanes(s) for s in srcs]).cpu()
    other = torch.empty_like(flat)
    # the device kept busy while the host queues what is timed: the events then time the device's
    # work, not a launch's host time (the table, its upload) spent before the device had any
    busy = lambda: torch.cuda._sleep(2_000_000)  # noqa: E731
    floors = {"one_copy_ms": median_time(lambda: other.copy_(flat), reps, before_each=busy) * 1e3,
              "foreach_copy_ms": median_time(lambda: torch._foreach_copy_(dsts, srcs), reps, before_each=busy) * 1e3}
    rows = []
    saved = D._COPY_BLOCK, D._COPY_ITERS, D._COPY_WARPS, D._COPY_ALIGNED
    try:
        for block, iters, warps in shapes:
            for aligned in (False, True):
                D._COPY_BLOCK, D._COPY_ITERS, D._COPY_WARPS, D._COPY_ALIGNED = block, iters, warps, aligned
                D._COPY_PRIMED.clear()  # each shape's variants compiled before they are timed
                copies = D.Copies(list(zip(dsts, srcs)))
                unit = D._unit(copies.meta, copies.count)
                # a plan's copies (colo's engine, a layout it loaded before): the table uploaded
                # once, each launch given the buffer; what a one-copy sync-first load runs
                planned = D.PlannedCopies(starts, [d.data_ptr() for d in dsts], [s.nbytes for s in specs],
                                          flat.device)
                for way, run in (("laid", copies.run), ("planned", lambda lanes: planned.run_from(flat, lanes))):
                    for lanes in (False, True):
                        for d in dsts:
                            d.fill_(0)
                        got = run(lanes)
                        torch.cuda.synchronize()
                        exact = all(torch.equal(d, s) for d, s in zip(dsts, srcs)) and \
                            (got is None or torch.equal(got.cpu(), want))
                        ms = median_time(lambda: run(lanes), reps, before_each=busy) * 1e3
                        rows.append({"block": block, "iters": iters, "warps": warps, "unit": unit, "way": way,
                                     "lanes": lanes, "programs": copies.programs, "ms": ms,
                                     "of_one_copy": ms / floors["one_copy_ms"], "exact": exact})
                        print(f"{model} block {block:>5} iters {iters:>4} warps {warps:>2} {unit:>2}-byte {way:<7} "
                              f"{'lanes' if lanes else 'plain'}: {ms:7.3f} ms ({ms / floors['one_copy_ms']:.2f} of one "
                              f"copy) {'exact' if exact else 'WRONG'}", flush=True)
    finally:
        D._COPY_BLOCK, D._COPY_ITERS, D._COPY_WARPS, D._COPY_ALIGNED = saved
    return {"model": model, "tensors": len(specs), "bytes": nbytes, "floors": floors,
            "one_copy_GBps": nbytes / floors["one_copy_ms"] / 1e6, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("out")
    ap.add_argument("--models", default="qwen2-1.5b,qwen2-7b")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.copy_kernel needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    result = {"kind": "bench/copy_kernel.py", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name(), "gpu_count": torch.cuda.device_count(),
              "torch": torch.__version__, "triton": triton.__version__, "reps": args.reps,
              "models": [measure(m.strip(), args.reps) for m in args.models.split(",")]}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for m in result["models"]:
        print(f"{m['model']}: one copy {m['floors']['one_copy_ms']:.3f} ms ({m['one_copy_GBps']:.0f} GB/s), "
              f"_foreach_copy_ {m['floors']['foreach_copy_ms']:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
