"""One process's part of a sync under torch.profiler: a diagnostic.

Where a sync's time goes on a GPU is split between two processes, the trainer rank
that gathers and hands off and the engine rank that copies out of the handed-over
buffer; each records its own CUDA activity. :class:`Recording` is the recording of
one of them: started before the sync, stopped after it with its Chrome trace
written (both traces load together into Perfetto, on one clock) and a summary of
this process's device time returned: totals by kind (NCCL collectives, memcpy and
memset, other kernels) and the kernels with the most time, and the host ops and runtime
calls with the most time of their own. Off a GPU the trace holds
the CPU ops of the recording thread and the totals are zero.
"""

from __future__ import annotations

import time
from typing import Any

import torch


class Recording:
    """``start()``, the work, then ``stop(path)`` -> summary (see the module)."""

    def __init__(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        self.cuda = torch.cuda.is_available()
        self._prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else []))
        self._t0 = 0.0

    def start(self) -> Recording:
        self._prof.__enter__()
        self._t0 = time.perf_counter()
        return self

    def stop(self, path: str) -> dict:
        if self.cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - self._t0
        self._prof.__exit__(None, None, None)
        self._prof.export_chrome_trace(path)
        return {"wall_s": wall, "trace": path, **summarize(self._prof)}


def summarize(prof: Any, top: int = 15) -> dict:
    """A finished profile's device time: ``device_s_by_kind`` and the ``top`` kernels."""
    rows = []
    for ev in prof.key_averages():
        dev = float(getattr(ev, "device_time_total", 0.0) or 0.0)  # microseconds
        if dev > 0 and "CUDA" in str(getattr(ev, "device_type", "")):
            rows.append((dev, ev.key, ev.count))
    kinds = {"nccl": 0.0, "memcpy": 0.0, "other": 0.0}
    for dev, key, _ in rows:
        k = key.lower()
        kinds["nccl" if "nccl" in k else "memcpy" if "memcpy" in k or "memset" in k else "other"] += dev / 1e6
    rows.sort(reverse=True)
    # the host's side: where the recording process's threads spent their own time (a
    # sender that cannot queue its work as fast as the GPU does it: ops, runtime calls)
    host = sorted(((float(getattr(ev, "self_cpu_time_total", 0.0) or 0.0), ev.key, ev.count)
                   for ev in prof.key_averages()), reverse=True)
    return {"device_s_by_kind": kinds,
            "top": [{"name": key[:100], "count": n, "device_s": dev / 1e6} for dev, key, n in rows[:top]],
            "host_top": [{"name": key[:100], "count": n, "self_host_s": t / 1e6} for t, key, n in host[:top] if t > 0]}
