"""Where the pinned host-to-device rate varies (issue 18): the same copy out of several
freshly allocated pinned buffers, each buffer's NUMA placement beside its rate, and
the 1.5B's tensors copied one by one against one copy of the same bytes.

usage: python3 bench/h2d_probe.py OUT.json   (on a GPU machine)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import torch


def gbps(nbytes: int, fn, reps: int = 5) -> float:
    """GB/s of ``fn``'s copy of ``nbytes``: the benchmark's own timing (one warm-up, then
    the median of ``reps`` runs between CUDA events)."""
    from colo.apps.bench import median_time

    return nbytes / median_time(fn, reps) / 1e9


def numa_pages(ptr: int) -> dict:
    """Pages per NUMA node of the mapping that holds ``ptr`` (/proc/self/numa_maps)."""
    with open("/proc/self/maps") as fh:
        start = None
        for line in fh:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= ptr < hi:
                start = lo
                break
    if start is None:
        return {}
    with open("/proc/self/numa_maps") as fh:
        for line in fh:
            if int(line.split()[0], 16) == start:
                return {k: int(v) for k, v in re.findall(r"\b(N\d+)=(\d+)", line)}
    return {}


def main(out: str) -> None:
    from colo.device.cuda_ipc import PinnedShm
    from colo.engine.reference.weights import expected_hf_specs
    from bench.gpu_sync import gpu_models
    from colo.apps.bench import release_cached
    from colo.trainers.models import demo_config

    import datetime as dt

    info: dict = {"kind": "bench/h2d_probe.py", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                  "device": torch.cuda.get_device_name(), "gpu_count": torch.cuda.device_count(),
                  "torch": torch.__version__}
    for cmd in (["nvidia-smi", "topo", "-m"], ["lscpu"]):
        try:
            info[cmd[0]] = subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout[-3000:]
        except Exception as e:  # noqa: BLE001
            info[cmd[0]] = repr(e)
    nodes = sorted(n for n in os.listdir("/sys/devices/system/node") if re.fullmatch(r"node\d+", n)) \
        if os.path.isdir("/sys/devices/system/node") else []
    info["numa_nodes"] = nodes
    bus = torch.cuda.get_device_properties(0)
    info["gpu_pci"] = f"{bus.pci_domain_id:04x}:{bus.pci_bus_id:02x}:{bus.pci_device_id:02x}.0" \
        if hasattr(bus, "pci_bus_id") else None
    if info["gpu_pci"]:
        try:
            with open(f"/sys/bus/pci/devices/{info['gpu_pci']}/numa_node") as fh:
                info["gpu_numa_node"] = int(fh.read())
        except OSError as e:
            info["gpu_numa_node"] = repr(e)
    print(json.dumps({k: v for k, v in info.items() if k not in ("nvidia-smi", "lscpu")}), flush=True)
    print(info["nvidia-smi"], flush=True)

    _, shapes = gpu_models()["qwen2-1.5b"]
    specs = expected_hf_specs(demo_config(**shapes), torch.bfloat16)
    nbytes = sum(s.nbytes for s in specs)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    rows = []
    for kind in ("cudaHostAlloc", "pinned_shm") * 3:
        shm = None
        if kind == "pinned_shm":
            shm = PinnedShm.create(nbytes)
            host = shm.tensor
        else:
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        host.fill_(1)
        rate = gbps(nbytes, lambda: dev.copy_(host, non_blocking=True))
        row = {"kind": kind, "GBps": rate, "numa_pages": numa_pages(host.data_ptr())}
        print(json.dumps(row), flush=True)
        rows.append(row)
        if kind == "pinned_shm":
            # the 1.5B's 338 tensors copied one by one out of this buffer, into tensors of their own
            offs, at = [], 0
            for s in specs:
                at = (at + 15) // 16 * 16
                offs.append((at, at + s.nbytes))
                at += s.nbytes
            dsts = [torch.empty(b - a, dtype=torch.uint8, device="cuda") for a, b in offs]
            srcs = [host[a:b] for a, b in offs]

            def each():
                for d, s in zip(dsts, srcs):
                    d.copy_(s, non_blocking=True)
            row["per_tensor_GBps"] = gbps(nbytes, each)
            row["one_copy_again_GBps"] = gbps(nbytes, lambda: dev.copy_(host, non_blocking=True))
            print(json.dumps(row), flush=True)
            del dsts, srcs
            torch.cuda.empty_cache()
            host = None
            shm.close()
        else:
            del host
            release_cached()
    info["rows"] = rows
    with open(out, "w") as fh:
        json.dump(info, fh, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
