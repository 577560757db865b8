"""What one all-gather costs the host: the time to queue torch.distributed's collectives (issue 46).

    python -m bench.collective_cost OUT.json [--device cpu|cuda] [--ranks 2] [--calls 200]
        [--sizes 65536,16777216] [--coalesce 8]

A TP=2 sync of Qwen2-7B on two H200s is host-bound: its extraction queues about 140
all-gathers (``sync-first``; 252 from a host copy), and under cProfile each cost the host
about 0.1 ms and a coalesced one of 8 outputs 0.5 ms, where the GPU needs less for most
of them. This measures that cost without a profiler, three ways, each ``--calls`` times
per size after a warm-up, every rank at once:

- ``all_gather_into_tensor``: torch.distributed's call, one output per call (what the
  row-parallel blocks use);
- ``coalesced``: ``--coalesce`` outputs in one call of the process group's
  ``allgather_into_tensor_coalesced`` (colo's ``_all_gather_coalesced``: a bucket's
  row-gathered outputs);
- ``process group``: the process group's own ``_allgather_base``, one output per call,
  without torch.distributed's Python around it.

``host_us``: the time to return from the calls (on a GPU the collectives are queued, not
done); ``wall_us``: until the device finished them too. On the CPU (gloo) a call returns
when it is done: both are the collective's whole time. Every output is checked: rank r's
part holds r + 1 in every byte. The process group's settings that may cost host time are
recorded as the environment gave them (``TORCH_FR_BUFFER_SIZE``: torch's flight recorder,
2000 entries unless set, capturing a traceback per collective;
``TORCH_NCCL_AVOID_RECORD_STREAMS``); ``bench/gpu_run.sh collcost`` runs it under several.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import sys
import time
from typing import Any

#: the environment variables recorded with the result (set or not)
ENV = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_AVOID_RECORD_STREAMS",
       "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_ENABLE_MONITORING", "NCCL_DEBUG")


def _rank(rank: int, world: int, init: str, device: str, calls: int, sizes: list[int], coalesce: int,
          out: Any) -> None:
    import torch
    import torch.distributed as dist

    from colo.extractors.megatron import _all_gather_coalesced, _all_gather_single
    from colo.proc.rendezvous import init_default_group

    try:
        cuda = device == "cuda"
        if cuda:
            torch.cuda.set_device(rank)
        init_default_group("nccl" if cuda else "gloo", init, rank=rank, world_size=world,
                           timeout=datetime.timedelta(seconds=120))
        dev = torch.device(f"cuda:{rank}" if cuda else "cpu")
        group = dist.group.WORLD

        def settle() -> None:
            if cuda:
                torch.cuda.synchronize(dev)

        rows = []
        for nbytes in sizes:
            part = nbytes // world
            outs = [torch.zeros(part * world, dtype=torch.uint8, device=dev) for _ in range(coalesce)]
            ins = [o[rank * part:(rank + 1) * part] for o in outs]
            for i in ins:
                i.fill_(rank + 1)
            ways = {
                "all_gather_into_tensor": (1, lambda: _all_gather_single(outs[0], ins[0], group=group)),
                "coalesced": (coalesce, lambda: _all_gather_coalesced(outs, ins, group)),
                "process group": (1, lambda: group._allgather_base(outs[0], ins[0]).wait()),
            }
            for way, (n, call) in ways.items():
                for o in outs:
                    o.zero_()
                    o[rank * part:(rank + 1) * part].fill_(rank + 1)
                call()  # warm-up: the communicator, the first allocation
                settle()
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(calls):
                    call()
                host = time.perf_counter() - t0
                settle()
                wall = time.perf_counter() - t0
                want = torch.arange(1, world + 1, dtype=torch.uint8, device=dev).repeat_interleave(part)
                exact = all(torch.equal(o, want) for o in outs[:n])
                rows.append({"bytes": nbytes, "way": way, "outputs_per_call": n, "calls": calls,
                             "host_us": host / calls * 1e6, "wall_us": wall / calls * 1e6, "exact": exact})
        dist.barrier()
        dist.destroy_process_group()
        out.put((rank, rows, None))
    except BaseException as e:  # reported to the driver, which fails the run
        out.put((rank, None, f"{type(e).__name__}: {e}"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("out")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--sizes", default="65536,16777216", help="bytes of one gathered output, comma-separated")
    ap.add_argument("--coalesce", type=int, default=8, help="outputs per coalesced call")
    ap.add_argument("--timeout-s", type=float, default=300.0)
    args = ap.parse_args(argv)
    try:
        sizes = [int(x) for x in args.sizes.split(",")]
    except ValueError:
        ap.error(f"--sizes must be comma-separated byte counts, got {args.sizes!r}")
    if args.ranks < 2 or args.calls < 1 or args.coalesce < 1 or any(s < args.ranks or s % args.ranks for s in sizes):
        ap.error("--ranks must be at least 2, --calls and --coalesce at least 1, and every size a multiple of --ranks")
    import torch

    from colo.proc.rendezvous import HostedStore

    if args.device == "cuda" and torch.cuda.device_count() < args.ranks:
        print(f"collective_cost: {args.ranks} ranks need {args.ranks} CUDA GPUs, this machine has "
              f"{torch.cuda.device_count()}", file=sys.stderr)
        return 2
    store = HostedStore(args.ranks)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args.ranks, store.init_method, args.device, args.calls, sizes,
                                             args.coalesce, q)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    replies: dict[int, list] = {}
    errors = []
    try:
        deadline = time.monotonic() + args.timeout_s
        while len(replies) + len(errors) < args.ranks:
            rank, rows, error = q.get(timeout=max(1.0, deadline - time.monotonic()))
            if error is not None:
                errors.append(f"rank {rank}: {error}")
            else:
                replies[rank] = rows
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
        store.close()
    if errors:
        print("collective_cost: " + "; ".join(errors), file=sys.stderr)
        return 1
    rows = []
    for i, row in enumerate(replies[0]):
        # the slowest rank's, as the sync benchmark reports
        per_rank = [replies[r][i] for r in range(args.ranks)]
        rows.append({**row, "host_us": max(x["host_us"] for x in per_rank),
                     "wall_us": max(x["wall_us"] for x in per_rank),
                     "host_us_by_rank": [x["host_us"] for x in per_rank],
                     "exact": all(x["exact"] for x in per_rank)})
    result = {"kind": "bench.collective_cost", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
              "gpu_count": args.ranks if args.device == "cuda" else 0, "ranks": args.ranks,
              "torch": torch.__version__, "backend": "nccl" if args.device == "cuda" else "gloo",
              "env": {k: os.environ.get(k) for k in ENV}, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for r in rows:
        print(f"{r['bytes']:>10,} B  {r['way']:24s} x{r['outputs_per_call']}  host {r['host_us']:8.1f} us/call"
              f"  wall {r['wall_us']:8.1f} us/call  exact {r['exact']}", flush=True)
    return 0 if all(r["exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
