"""What opening a trainer's buffer costs the engine: CUDA IPC, by size (issue 44).

    python -m bench.ipc_open OUT.json [--mib 64,3072,15360] [--reps 5]

A one-copy ``sync-first`` sync has the engine open the trainer's flat buffer (exported
anew every sync: the trainer frees it at its pause) and close it at the end of the load.
On an H200 the engine's "handoff" (the open) took 2.2-2.3 ms at both Qwen2-1.5B and 7B
(3.1 and 15.2 GB) and the close 0.4-0.5 ms, a third of the 1.5B sync's 7.3 ms: not the
bytes. This times, in a second process as the engine is, for a buffer of each size
exported anew each time:

- ``torch_open_ms``: ``colo.device.cuda_ipc.CudaAttachment`` (torch's
  ``rebuild_cuda_tensor``: the producer's ref-counter file, its event, the memory handle);
- ``torch_close_ms``: dropping it (``close``);
- ``raw_open_ms`` / ``raw_close_ms``: the CUDA runtime's ``cudaIpcOpenMemHandle`` /
  ``cudaIpcCloseMemHandle`` of the same memory handle, nothing of torch's around it;
- ``local_index_ms``: finding the GPU by UUID (what the attachment does first).

Each open is checked: the first and last 16 bytes read back equal what the producer wrote.
Needs a CUDA GPU; ``bash bench/gpu_run.sh call50b`` runs it.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import multiprocessing as mp
import statistics
import sys
import time
from typing import Any


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


def _raw_handle(torch_handle: bytes) -> bytes | None:
    """The 64-byte ``cudaIpcMemHandle_t`` inside torch's handle bytes, or None where it is not
    a plain ``cudaMalloc`` block's. c10's ``shareIpcHandle`` writes a version byte (2; 3 from
    torch 2.13), the type byte ``'c'`` (``SHAREABLE_CUDA_MALLOC``), then the handle; a handle
    of 64 bytes alone predates that."""
    if len(torch_handle) == 64:
        return torch_handle
    if len(torch_handle) == 66 and torch_handle[1:2] == b"c":
        return torch_handle[2:]
    return None


def _child(conn: Any) -> None:
    import torch

    from colo.device.cuda_ipc import CudaAttachment, _cudart_function, _unb64, local_index

    torch.cuda.init()
    torch.cuda.current_device()
    open_fn, close_fn = _cudart_function("cudaIpcOpenMemHandle"), _cudart_function("cudaIpcCloseMemHandle")
    while True:
        msg = conn.recv()
        if msg is None:
            return
        handle, first, last = msg
        out: dict = {}
        t0 = time.perf_counter()
        local_index(handle["gpu_uuid"])
        out["local_index_ms"] = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        att = CudaAttachment(handle)
        t1 = time.perf_counter()
        got = att.tensor
        out["exact"] = bytes(got[:16].cpu().tolist()) == first and bytes(got[-16:].cpu().tolist()) == last
        del got
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        att.close()
        del att
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        out["torch_open_ms"], out["torch_close_ms"] = (t1 - t0) * 1e3, (t3 - t2) * 1e3
        raw = _raw_handle(_unb64(handle["handle"], "handle"))
        if raw is None or open_fn is None or close_fn is None:
            out["raw_error"] = "no cudaIpcOpenMemHandle in this process" if open_fn is None else \
                "torch's handle is not a cudaMalloc block's cudaIpcMemHandle_t"
        else:
            ptr = ctypes.c_void_p()
            t0 = time.perf_counter()
            err = open_fn(ctypes.byref(ptr), _IpcHandle(raw), ctypes.c_uint(1))  # cudaIpcMemLazyEnablePeerAccess
            t1 = time.perf_counter()
            if int(err) != 0:
                out["raw_error"] = f"cudaIpcOpenMemHandle returned {int(err)}"
            else:
                t2 = time.perf_counter()
                err = close_fn(ptr)
                t3 = time.perf_counter()
                out["raw_open_ms"], out["raw_close_ms"] = (t1 - t0) * 1e3, (t3 - t2) * 1e3
                if int(err) != 0:
                    out["raw_error"] = f"cudaIpcCloseMemHandle returned {int(err)}"
        conn.send(out)


def _measure(sizes_mib: list[int], reps: int) -> dict:
    import torch

    from colo.device.cuda_ipc import export_cuda

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(target=_child, args=(there,), daemon=True)
    child.start()
    rows = []
    try:
        for mib in sizes_mib:
            buf = torch.empty(mib << 20, dtype=torch.uint8, device="cuda")
            buf.fill_(7)
            buf[:16].copy_(torch.arange(16, dtype=torch.uint8))
            buf[-16:].copy_(torch.arange(100, 116, dtype=torch.uint8))
            torch.cuda.synchronize()
            first, last = bytes(buf[:16].cpu().tolist()), bytes(buf[-16:].cpu().tolist())
            runs = []
            for _ in range(reps + 1):  # the first a warm-up
                here.send((export_cuda(buf), first, last))
                runs.append(here.recv())
                torch.cuda.ipc_collect()  # the child let go: the export's reference count goes
            runs = runs[1:]
            row: dict = {"mib": mib, "exact": all(r.get("exact") for r in runs)}
            for key in ("local_index_ms", "torch_open_ms", "torch_close_ms", "raw_open_ms", "raw_close_ms"):
                vals = [r[key] for r in runs if key in r]
                if vals:
                    row[key] = statistics.median(vals)
            errors = sorted({r["raw_error"] for r in runs if "raw_error" in r})
            if errors:
                row["raw_error"] = "; ".join(errors)
            rows.append(row)
            del buf
            torch.cuda.empty_cache()
    finally:
        here.send(None)
        child.join(30)
        if child.is_alive():
            child.kill()
    return {"kind": "bench.ipc_open", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "device": torch.cuda.get_device_name(), "gpu_count": 1, "torch": torch.__version__, "reps": reps,
            "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("out")
    ap.add_argument("--mib", default="64,3072,15360", help="buffer sizes in MiB, comma-separated")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    try:
        sizes = [int(s) for s in args.mib.split(",")]
    except ValueError:
        ap.error(f"--mib must be comma-separated integers, got {args.mib!r}")
    if args.reps < 1 or not sizes or min(sizes) < 1:
        ap.error("--reps and every size must be at least 1")
    import torch

    if not torch.cuda.is_available():
        print("ipc_open: needs a CUDA GPU (it opens CUDA IPC handles in a second process)", file=sys.stderr)
        return 2
    out = _measure(sizes, args.reps)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    for r in out["rows"]:
        raw = f"raw open {r['raw_open_ms']:.3f} / close {r['raw_close_ms']:.3f} ms" if "raw_open_ms" in r \
            else f"raw: {r.get('raw_error')}"
        print(f"{r['mib']:6d} MiB: torch open {r['torch_open_ms']:.3f} / close {r['torch_close_ms']:.3f} ms, {raw}, "
              f"local_index {r['local_index_ms']:.3f} ms, exact {r['exact']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
