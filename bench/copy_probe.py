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

Ways: ``copy_`` per tensor (what colo's engine does for large tensors), one
``torch._foreach_copy_`` over all, one Triton launch over a table of addresses copying 4-byte
words (``batched``), the same computing the digest's two lanes of the 16-bit words it copies
(``batched+lanes``), the digest's kernel alone over the destinations (``lanes``), and one
``copy_`` of the whole source into one buffer of its size (the floor: one device copy).

This is a measuring tool; nothing in colo uses its kernels.
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

BLOCK, ITERS = 2048, 64  # int32 words per iteration and iterations per program (2 x span 16-bit words <= 2**22)
_fmix = None  # the digest's fmix32 (a Triton function), a global the kernel calls


def _kernels():
    import triton
    import triton.language as tl

    global _fmix
    assert D._triton_kernel() is not None
    _fmix = D._FMIX

    @triton.jit
    def copy_kernel(meta, N, P, out, LANES: tl.constexpr, S1: tl.constexpr, K1: tl.constexpr,
                    S2: tl.constexpr, K2: tl.constexpr, LOW_BITS: tl.constexpr, BLOCK: tl.constexpr,
                    ITERS: tl.constexpr):
        pid = tl.program_id(0)
        t = tl.load(meta + 4 * N + pid)
        start = tl.load(meta + 4 * N + P + pid)
        src = tl.load(meta + t).to(tl.pointer_type(tl.int32))
        dst = tl.load(meta + N + t).to(tl.pointer_type(tl.int32))
        n = tl.load(meta + 2 * N + t)
        first = tl.load(meta + 3 * N + t)
        if LANES:
            base = ((2 * start + first) >> LOW_BITS).to(tl.uint32)
            here = tl.full((BLOCK,), 0, tl.uint32) + base
            b1 = _fmix(here + tl.full((BLOCK,), K1, tl.uint32)) | 1
            b1_next = _fmix(here + 1 + tl.full((BLOCK,), K1, tl.uint32)) | 1
            b2 = _fmix(here + tl.full((BLOCK,), K2, tl.uint32)) | 1
            b2_next = _fmix(here + 1 + tl.full((BLOCK,), K2, tl.uint32)) | 1
            acc1 = tl.zeros((BLOCK,), tl.uint32)
            acc2 = tl.zeros((BLOCK,), tl.uint32)
        for k in range(ITERS):
            offs = start + k * BLOCK + tl.arange(0, BLOCK)
            keep = offs < n
            x = tl.load(src + offs, mask=keep, other=0)
            tl.store(dst + offs, x, mask=keep)
            if LANES:
                u = x.to(tl.uint32, bitcast=True)
                for half in tl.static_range(2):
                    w = (u >> (16 * half)) & 0xFFFF
                    j = 2 * offs + half + first
                    low = (j & ((1 << LOW_BITS) - 1)).to(tl.uint32)
                    nxt = (j >> LOW_BITS).to(tl.uint32) != base
                    m1 = (_fmix(low ^ tl.full((BLOCK,), S1, tl.uint32)) | 1) * tl.where(nxt, b1_next, b1)
                    m2 = (_fmix(low ^ tl.full((BLOCK,), S2, tl.uint32)) | 1) * tl.where(nxt, b2_next, b2)
                    acc1 += w * m1
                    acc2 += w * m2
        if LANES:
            tl.store(out + pid * 2, tl.sum(acc1, axis=0).to(tl.int64))
            tl.store(out + pid * 2 + 1, tl.sum(acc2, axis=0).to(tl.int64))

    return copy_kernel


def _table(srcs: list[torch.Tensor], dsts: list[torch.Tensor],
           device: str = "cuda") -> tuple[torch.Tensor, torch.Tensor, int, int]:
    ns = np.array([t.numel() * t.element_size() // 4 for t in srcs], dtype=np.int64)
    span = BLOCK * ITERS
    counts = np.maximum((ns + span - 1) // span, 1)
    item = np.repeat(np.arange(len(ns), dtype=np.int64), counts)
    starts = (np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)) * span
    meta = np.concatenate([[t.data_ptr() for t in srcs], [t.data_ptr() for t in dsts], ns,
                           np.zeros(len(ns), dtype=np.int64), item, starts]).astype(np.int64)
    return torch.from_numpy(meta).to(device), torch.from_numpy(item).to(device), len(ns), len(item)


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
    kernel = _kernels()
    meta, item, n_t, programs = _table(srcs, dsts)
    (s1, k1), (s2, k2) = D.LANE_SEEDS
    partial = torch.empty(programs, 2, dtype=torch.int64, device="cuda")

    def batched(lanes: bool):
        def run():
            kernel[(programs,)](meta, n_t, programs, partial, LANES=lanes, S1=s1, K1=k1, S2=s2, K2=k2,
                                LOW_BITS=D.BLOCK_BITS, BLOCK=BLOCK, ITERS=ITERS, num_warps=8)
            if lanes:
                return torch.zeros(n_t, 2, dtype=torch.int64, device="cuda").index_add_(0, item, partial) & D._MASK
        return run

    def per_tensor():
        for d, s in zip(dsts, srcs):
            d.copy_(s)

    def foreach():
        torch._foreach_copy_(dsts, srcs)

    def digest_lanes():
        return D.Blocks(list(zip(names, dsts))).lanes()

    ways = {"copy_ per tensor": per_tensor, "foreach_copy_": foreach, "batched": batched(False),
            "batched+lanes": batched(True), "lanes (digest kernel)": digest_lanes,
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
           "kernel": {"block": BLOCK, "iters": ITERS, "word_bytes": 4, "num_warps": 8}, "ways": rows}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0 if all(r["exact"] for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
