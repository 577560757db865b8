"""How fast one GPU copies a model's tensors from one buffer into another, tensor by tensor
or in one launch, with and without the digest's lanes: what an engine's load of a
``sync-first`` bucket could cost (issue 44 items 1 and 3).

    python bench/copy_probe.py OUT.json [--model qwen2-1.5b] [--reps 5]

The tensors are the model's HF tensors (shapes from ``bench.models``) in bf16, laid one
after another in a source buffer (as a packed bucket or a trainer's flat weights lie) and
copied into separately allocated destinations (as an engine's parameters). Timed with CUDA
events, each way ``--reps`` times (median), after a warm-up; the host time to queue each
way is timed on its own. Every way's result is checked against the source byte for byte,
and every way that computes lanes against ``colo.digest``'s batched kernel.

Ways: ``copy_`` per tensor (what colo's engine did for large tensors), one
``torch._foreach_copy_`` over all, colo's one launch over a table of addresses copying 4-byte
words (``batched``: ``colo.digest.Copies``, the engine's load of a device batch), the same
computing the digest's two lanes of the 16-bit words it copies (``batched+lanes``), the
digest's kernel alone over the destinations (``lanes``), and one ``copy_`` of the whole source
into one buffer of its size (the floor: one device copy).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time

import numpy as np
import torch

import colo.digest as D

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("out")
    ap.add_argument("--model", default="qwen2-1.5b")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    from bench.models import attr_config
    from colo.models.arch import hf_shapes

    shapes = hf_shapes(attr_config(args.model))
    names = list(shapes)
    sizes = [int(np.prod(shapes[n])) for n in names]
    total = sum(sizes)
    g = torch.Generator(device="cuda").manual_seed(0)
    src_flat = torch.randint(-2**15, 2**15, (total,), dtype=torch.int16, device="cuda", generator=g).view(torch.bfloat16)
    srcs, at = [], 0
    for n, k in zip(names, sizes):
        srcs.append(src_flat[at:at + k].view(shapes[n]))
        at += k
    dsts = [torch.empty(shapes[n], dtype=torch.bfloat16, device="cuda") for n in names]
    one = torch.empty_like(src_flat)
    nbytes = total * 2
    # colo's own kernel and table (the engine's one-launch load), the table made once as the
    # engine's layout plan makes it; each run uploads it, as the engine's does
    copies = D.Copies(list(zip(dsts, srcs)))

    def per_tensor():
        for d, s in zip(dsts, srcs):
            d.copy_(s)

    def foreach():
        torch._foreach_copy_(dsts, srcs)

    def digest_lanes():
        return D.Blocks(list(zip(names, dsts))).lanes()

    ways = {"copy_ per tensor": per_tensor, "foreach_copy_": foreach, "batched": copies.run,
            "batched+lanes": lambda: copies.run(lanes=True), "lanes (digest kernel)": digest_lanes,
            "one copy_ (floor)": lambda: one.copy_(src_flat)}
    #: the ways whose answer is lanes (the others return what they copied into, or nothing)
    gives_lanes = {"batched+lanes", "lanes (digest kernel)"}
    rows = {}
    want_lanes = None
    for name, fn in ways.items():
        for d in dsts:
            d.zero_()
        if name == "lanes (digest kernel)":
            per_tensor()  # its lanes are of the destinations: they hold the sources' bytes
        fn()  # warm-up (compiles a kernel)
        torch.cuda.synchronize()
        dev_ms, host_ms = [], []
        got = None
        for _ in range(args.reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            a.record()
            t0 = time.perf_counter()
            got = fn()
            host_ms.append((time.perf_counter() - t0) * 1e3)
            b.record()
            b.synchronize()
            dev_ms.append(a.elapsed_time(b))
        if name != "one copy_ (floor)" and not name.startswith("lanes"):
            ok = all(torch.equal(d.view(torch.int16), s.view(torch.int16)) for d, s in zip(dsts, srcs))
        elif name.startswith("one"):
            ok = torch.equal(one.view(torch.int16), src_flat.view(torch.int16))
        else:
            ok = True
        if name in gives_lanes:
            got = got.cpu().tolist() if isinstance(got, torch.Tensor) else got
            if want_lanes is None:
                want_lanes = D.Blocks(list(zip(names, srcs))).lanes().cpu().tolist()
            ok = ok and got == want_lanes
        med = statistics.median(dev_ms)
        rows[name] = {"device_ms": med, "device_ms_all": dev_ms, "host_ms": statistics.median(host_ms),
                      "GBps_read": nbytes / med / 1e6, "exact": ok}
        print(f"{name:24s} {med:8.3f} ms  ({nbytes / med / 1e6:7.1f} GB/s read)  host {rows[name]['host_ms']:.3f} ms"
              f"  exact {ok}", flush=True)
    out = {"kind": "bench.copy_probe", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "device_name": torch.cuda.get_device_name(), "gpus": 1, "torch": torch.__version__,
           "model": args.model, "tensors": len(names), "bytes": nbytes, "reps": args.reps,
           "kernel": {"block": D._COPY_BLOCK, "iters": D._COPY_ITERS, "word_bytes": 4, "num_warps": 8}, "ways": rows}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0 if all(r["exact"] for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
