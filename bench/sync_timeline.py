"""Where a small model's sync goes: the demo, run with its host path timed piece by piece.

    python bench/sync_timeline.py OUT.json [--probe-upload] [--profile] -- [colo demo arguments]

Runs ``colo demo`` in this process with timers wrapped around the pieces of the
driver's host path that the stage records do not separate: every engine round
trip (by op), every hop to a worker thread (queued -> running -> done -> back on
the event loop, by function), the staging slots' allocation, the sender's
cleanup, the trainer's ``extractor()``, the cyclic garbage collector's passes. ``--profile`` also runs every sync after the
first under cProfile (the event loop's thread: where a small sync's host work runs)
and writes the functions with the most own time. Writes, per sync, the sum of each piece
and the whole sync's transfer time, and one sync's full timeline. The engine's own
share of a load comes back in its reply (``load_s``) and is kept with the round trip.

This is a measuring tool: the wrappers are installed here only, never by colo.
"""

from __future__ import annotations

import functools
import json
import sys
import threading
import time
from collections import defaultdict
from typing import Any

SPANS: list[dict] = []  # {"kind", "name", "t0", "t1", ...} in perf_counter seconds
SYNCS: list[tuple[float, float, int]] = []  # (start, end of transfer, cudaMalloc calls in it) per sync


def _segments() -> int:
    """cudaMalloc calls the driver's caching allocator has made so far (0 off the GPU)."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return 0
    return int(torch.cuda.memory_stats().get("segment.all.allocated", 0))


def _span(kind: str, name: str, t0: float, t1: float, **extra: Any) -> None:
    SPANS.append({"kind": kind, "name": name, "t0": t0, "t1": t1, **extra})


def _install() -> None:
    import anyio.to_thread

    import colo.scheduler as sched
    import colo.transports.packed as packed
    from colo.engine.reference.client import EngineClient

    real_run_sync = anyio.to_thread.run_sync

    async def run_sync(fn: Any, *args: Any, **kw: Any) -> Any:
        name = getattr(fn, "__qualname__", getattr(fn, "__name__", repr(fn)))
        marks: dict[str, float] = {"queued": time.perf_counter()}

        def timed(*a: Any) -> Any:
            marks["started"] = time.perf_counter()
            try:
                return fn(*a)
            finally:
                marks["ended"] = time.perf_counter()

        try:
            return await real_run_sync(timed, *args, **kw)
        finally:
            back = time.perf_counter()
            if "ended" in marks:
                _span("hop", name, marks["queued"], back, wait=marks["started"] - marks["queued"],
                      run=marks["ended"] - marks["started"], back=back - marks["ended"],
                      thread=threading.get_ident())

    anyio.to_thread.run_sync = run_sync

    real_call = EngineClient.call

    @functools.wraps(real_call)
    async def call(self: Any, op: str, **fields: Any) -> dict:
        t0 = time.perf_counter()
        reply = await real_call(self, op, **fields)
        parts = {f"engine_{k}": reply[k] for k in ("begin_s", "handoff_s", "queue_s", "wait_s", "end_s") if k in reply}
        _span("rt", op, t0, time.perf_counter(), engine_s=(reply.get("handoff_s") or 0) + (reply.get("load_s") or 0),
              **parts)
        return reply

    EngineClient.call = call

    def timed_method(cls: Any, attr: str, kind: str) -> None:
        real = getattr(cls, attr)

        @functools.wraps(real)
        def wrapper(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return real(*a, **kw)
            finally:
                _span(kind, attr, t0, time.perf_counter())

        setattr(cls, attr, wrapper)

    timed_method(packed._Slot, "__init__", "slot")
    _install_gpu_marks(packed)
    timed_method(packed.PackedTransport, "_cleanup", "cleanup")
    timed_method(sched.Scheduler, "_emit", "trace")

    real_transfer = sched.Scheduler._transfer

    async def transfer(self: Any, ctxs: Any) -> Any:
        if PROBE_UPLOAD:
            _probe_upload(self.trainers[0])
        _reference()
        seg0 = _segments()
        prof = PROFILE if PROFILE is not None and SYNCS else None
        t0 = time.perf_counter()
        if prof is not None:
            prof.enable()
        try:
            return await real_transfer(self, ctxs)
        finally:
            if prof is not None:
                prof.disable()
            SYNCS.append((t0, time.perf_counter(), _segments() - seg0))

    sched.Scheduler._transfer = transfer

    import gc

    gc_started: dict[str, float] = {}

    def on_gc(phase: str, info: dict) -> None:
        # the cyclic collector's passes in this process (the driver's event loop stops for them)
        if phase == "start":
            gc_started["t"] = time.perf_counter()
        elif "t" in gc_started:
            _span("gc", f"gen{info.get('generation')}", gc_started.pop("t"), time.perf_counter(),
                  collected=info.get("collected"))

    gc.callbacks.append(on_gc)

    from colo.trainers.base import PolicyTrainer

    for cls in PolicyTrainer.__subclasses__():
        if "extractor" in cls.__dict__:
            timed_method(cls, "extractor", "extractor")


#: (host time, label, CUDA event) on the sender's upload stream, and per sync a reference
#: event on the default stream waited for at the sync's start (its wait is itself a
#: reading: device work of this process still queued when the sync began)
MARKS: list[tuple[float, str, Any]] = []
REFS: list[tuple[float, Any, float]] = []  # (host time after the wait, event, wait in s)


def _install_gpu_marks(packed: Any) -> None:
    """CUDA events on the sender's upload stream, placed on the host timeline: when the
    GPU reached each point (the gather waiting for the default stream, the pack's
    copies starting and ending), against when the host queued it and waited for it."""
    import torch

    if not torch.cuda.is_available():
        return
    real_wait = torch.cuda.Stream.wait_stream
    real_queue = packed.queue_pack

    def mark(stream: Any, label: str) -> None:
        e = torch.cuda.Event(enable_timing=True)
        e.record(stream)
        MARKS.append((time.perf_counter(), label, e))

    def wait_stream(self: Any, other: Any) -> None:
        if self != other:
            mark(self, "wait_default.before")
            real_wait(self, other)
            mark(self, "wait_default.after")
        else:
            real_wait(self, other)

    def queue_pack(flat: Any, bucket: Any, tensors: Any, stream: Any = None, **kw: Any) -> Any:
        if stream is None or not flat.is_cuda:
            return real_queue(flat, bucket, tensors, stream, **kw)
        mark(stream, f"pack{bucket.index}.queued")
        done = real_queue(flat, bucket, tensors, stream, **kw)
        mark(stream, f"pack{bucket.index}.copied")
        return done

    torch.cuda.Stream.wait_stream = wait_stream
    packed.queue_pack = queue_pack


PROBE_UPLOAD = False
PROFILE: Any = None  # a cProfile.Profile with --profile


def _profile_top(n: int = 45) -> list[dict]:
    """The functions with the most own time over the profiled syncs (per sync)."""
    import pstats

    if PROFILE is None:
        return []
    syncs = max(1, len(SYNCS) - 1)
    st = pstats.Stats(PROFILE)
    rows = []
    for (file, line, fn), (cc, nc, tt, ct, _) in st.stats.items():  # type: ignore[attr-defined]
        rows.append({"fn": f"{file.rsplit('/', 2)[-1]}:{line}:{fn}", "calls_per_sync": round(nc / syncs, 1),
                     "own_ms_per_sync": round(tt * 1e3 / syncs, 4), "cum_ms_per_sync": round(ct * 1e3 / syncs, 4)})
    return sorted(rows, key=lambda r: -r["own_ms_per_sync"])[:n]
PROBES: list[tuple[float, dict]] = []  # (host time, GPU ms of each probe)


_PROBE_STATE: dict[str, Any] = {}


def _probe_upload(trainer: Any) -> None:
    """Before the sync, on a side stream, timed on the GPU: (a) the trainer's host views
    (its paused weights' pinned backup) uploaded one copy per tensor, (b) the same bytes
    from one pinned buffer in one copy, (c) the uploaded tensors converted to bf16
    (kernels only). Tells a per-copy cost from a per-byte one in the demo's own process."""
    import torch

    if not torch.cuda.is_available():
        return
    st = _PROBE_STATE
    params = list(trainer.hf_state().values())
    if "stream" not in st:
        st["stream"] = torch.cuda.Stream()
        st["flat"] = torch.empty(sum(t.numel() for t in params), pin_memory=True)
    s = st["stream"]
    if params[0].device.type == "cpu":
        host = params  # the paused weights' pinned backup (offload-first)
    else:  # resident weights (sync-first): the same sizes from one pinned buffer
        host, off = [], 0
        for t in params:
            host.append(st["flat"][off:off + t.numel()])
            off += t.numel()

    from upload_probe import event_ms  # bench/ is this script's folder

    from colo.device.zero_copy import device_view

    def timed(label: str, fn: Any, out: dict) -> Any:
        ms, keep = event_ms(s, fn)
        out[label] = round(ms, 3)
        return keep

    out: dict = {"nvml_before": _nvml()}
    dev = torch.device("cuda", torch.cuda.current_device())
    mapped = [device_view(t, dev).view(-1) for t in host]
    dst = [torch.empty(t.numel(), dtype=torch.bfloat16, device="cuda") for t in host]
    timed("zero_copy_foreach_convert_cold_ms", lambda: torch._foreach_copy_(dst, mapped), out)
    timed("zero_copy_foreach_convert_again_ms", lambda: torch._foreach_copy_(dst, mapped), out)
    out["zero_copy_exact"] = all(torch.equal(d.cpu(), h.reshape(-1).to(torch.bfloat16)) for d, h in zip(dst, host))
    up = lambda: [t.to("cuda", non_blocking=True) for t in host]  # noqa: E731
    dev = timed("per_tensor_upload_ms", up, out)
    timed("per_tensor_upload_again_ms", up, out)
    time.sleep(0.005)
    timed("per_tensor_upload_after_5ms_idle_ms", up, out)
    time.sleep(0.05)
    timed("per_tensor_upload_after_50ms_idle_ms", up, out)
    time.sleep(0.05)
    timed("convert_kernels_after_50ms_idle_ms", lambda: [t.to(torch.bfloat16) for t in dev], out)
    time.sleep(0.05)
    timed("one_copy_upload_after_50ms_idle_ms", lambda: st["flat"].to("cuda", non_blocking=True), out)
    time.sleep(0.05)
    timed("foreach_convert_after_50ms_idle_ms", lambda: torch._foreach_copy_(
        [torch.empty_like(t, dtype=torch.bfloat16) for t in dev], dev), out)
    out["nvml_after"] = _nvml()
    PROBES.append((time.perf_counter(), out))


def _nvml() -> dict:
    """The GPU's clocks, performance state and PCIe link now (NVML), for the probe."""
    try:
        import pynvml as n

        n.nvmlInit()
        h = n.nvmlDeviceGetHandleByIndex(0)
        return {"sm_mhz": n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM),
                "mem_mhz": n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_MEM),
                "pstate": n.nvmlDeviceGetPerformanceState(h),
                "pcie_gen": n.nvmlDeviceGetCurrPcieLinkGeneration(h),
                "pcie_width": n.nvmlDeviceGetCurrPcieLinkWidth(h)}
    except Exception as e:  # no NVML here: the probe goes on without it
        return {"error": f"{type(e).__name__}: {e}"}


def _reference() -> None:
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return
    e = torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    e.record(torch.cuda.default_stream())
    e.synchronize()
    t1 = time.perf_counter()
    REFS.append((t1, e, t1 - t0))


def _gpu_timeline(s0: float, s1: float) -> list[dict]:
    refs = [r for r in REFS if s0 - 1e-3 <= r[0] <= s1]
    if not refs:
        return []
    host_ref, ref, _ = refs[0]
    out = []
    for host, label, e in MARKS:
        if s0 <= host <= s1:
            e.synchronize()
            out.append({"label": label, "queued_ms": round((host - s0) * 1e3, 3),
                        "gpu_reached_ms": round((host_ref - s0) * 1e3 + ref.elapsed_time(e), 3)})
    return out


def summarise() -> dict:
    per_sync = []
    for i, (s0, s1, mallocs) in enumerate(SYNCS):
        spans = [sp for sp in SPANS if s0 <= sp["t0"] and sp["t1"] <= s1 + 1e-9]
        agg: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        for sp in spans:
            key = f"{sp['kind']}:{sp['name']}"
            a = agg[key]
            a["n"] += 1
            a["total_ms"] += (sp["t1"] - sp["t0"]) * 1e3
            for k in ("wait", "run", "back", "engine_s", "engine_begin_s", "engine_handoff_s", "engine_queue_s",
                      "engine_wait_s", "engine_end_s"):
                if k in sp:
                    a[f"{k}_ms"] += sp[k] * 1e3

        ref_wait = [r[2] * 1e3 for r in REFS if s0 - 1e-3 <= r[0] <= s1]
        probe = [ms for t, ms in PROBES if s0 - 0.5 <= t <= s0]
        per_sync.append({"sync": i, "transfer_ms": (s1 - s0) * 1e3, "cuda_mallocs": mallocs,
                         "pending_device_work_ms": round(ref_wait[0], 3) if ref_wait else None,
                         "probe_gpu_ms": probe[-1] if probe else None,
                         "pieces": {k: {kk: round(vv, 3) for kk, vv in v.items()} for k, v in agg.items()}})
    timeline = []
    if SYNCS:
        s0, s1, _ = SYNCS[len(SYNCS) // 2]
        for sp in sorted((sp for sp in SPANS if s0 <= sp["t0"] <= s1), key=lambda sp: sp["t0"]):
            timeline.append({**{k: v for k, v in sp.items() if k not in ("t0", "t1", "thread")},
                             "start_ms": round((sp["t0"] - s0) * 1e3, 3), "ms": round((sp["t1"] - sp["t0"]) * 1e3, 3)})
    gpu = _gpu_timeline(*SYNCS[len(SYNCS) // 2][:2]) if SYNCS else []
    return {"syncs": per_sync, "timeline_of_middle_sync": timeline, "upload_stream_of_middle_sync": gpu,
            "profile_own_time": _profile_top()}


def _write(out: str, argv: list[str], code: Any) -> None:
    result = {"argv": argv, "exit": code, **summarise()}
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    for s in result["syncs"][2:] or result["syncs"]:
        top = sorted(s["pieces"].items(), key=lambda kv: -kv[1]["total_ms"])[:6]
        print(f"sync {s['sync']}: {s['transfer_ms']:.2f} ms, {s['cuda_mallocs']} cudaMalloc, "
              f"probe {s['probe_gpu_ms']};",
              "; ".join(f"{k} x{int(v['n'])} {v['total_ms']:.2f}" for k, v in top), flush=True)


def main() -> int:
    import os

    global PROBE_UPLOAD, PROFILE
    out, rest = sys.argv[1], sys.argv[2:]
    if rest and rest[0] == "--probe-upload":
        PROBE_UPLOAD, rest = True, rest[1:]
    if rest and rest[0] == "--profile":
        import cProfile

        PROFILE, rest = cProfile.Profile(), rest[1:]
    if rest and rest[0] == "--no-empty-cache":
        # an experiment: the trainer's offload keeps its allocator cache
        import torch

        torch.cuda.empty_cache = lambda: None
        rest = rest[1:]
    if rest and rest[0] == "--":
        rest = rest[1:]
    _install()
    real_exit = os._exit

    def exit_after_writing(code: int) -> None:
        # the GPU demo leaves through os._exit (torch_memory_saver's teardown): write first
        _write(out, rest, code)
        real_exit(code)

    os._exit = exit_after_writing
    from colo.cli import main as colo_main

    sys.argv = ["colo", "demo", *rest]
    try:
        code = colo_main()
    except SystemExit as e:
        code = e.code
    _write(out, rest, code)
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
