"""``colo bench --device cuda``: the sync on one GPU against its physical limits and the
verl- and slime-style baselines, and the timing of every other phase of the cycle.

Model: Qwen2-7B layer shapes in bf16 (random weights); the engine is colo's
engine in its own process, its memory in torch_memory_saver regions; the
trainer's weights and AdamW state are in regions with a pinned host backup.
Measured in the same run: pinned host->device and device->host bandwidth and
device->device copy bandwidth (read + write).

Syncs compared, for ``offload-first`` (source: the pinned host backup) and
``sync-first`` (source: weights resident on the GPU):
``ipc`` (one CUDA IPC handle per tensor, verl's way), ``packed`` without
pipelining (slime's way), ``packed`` pipelined (colo).
"""

from __future__ import annotations

import datetime as dt
import json
import platform
import statistics
import sys
import time
from typing import Any

import anyio
import torch

from colo.core.interfaces import SyncContext
from colo.core.memory import GiB, MiB, StagingBudget

QWEN2_7B = dict(vocab_size=152064, hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                num_key_value_heads=4, intermediate_size=18944, max_position_embeddings=4096)
VARIANTS = [("ipc", "ipc", {}), ("packed-serial", "packed", {"pipelined": False}),
            ("packed-pipelined", "packed", {"pipelined": True})]


def _events_time(fn, reps: int) -> float:
    """Median seconds of ``fn`` over ``reps`` runs, timed with CUDA events after one warm-up."""
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1000)
    return statistics.median(out)


def measure_limits(nbytes: int = 2 * GiB, reps: int = 10) -> dict:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.random_(0, 255)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev2 = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev.random_(0, 255)
    h2d = _events_time(lambda: dev.copy_(host, non_blocking=True), reps)
    d2h = _events_time(lambda: host.copy_(dev, non_blocking=True), reps)
    d2d = _events_time(lambda: dev2.copy_(dev), reps)
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    h2d_pageable = _events_time(lambda: dev.copy_(pageable), 3)
    del host, dev, dev2, pageable
    torch.cuda.empty_cache()
    return {"bytes": nbytes, "pinned_h2d_GBps": nbytes / h2d / 1e9, "pinned_d2h_GBps": nbytes / d2h / 1e9,
            "pageable_h2d_GBps": nbytes / h2d_pageable / 1e9,
            "d2d_copy_GBps_read_plus_write": 2 * nbytes / d2d / 1e9}


class BenchTrainer:
    """A trainer's state without a training loop: weights and AdamW moments in saver regions."""

    def __init__(self, config: Any, saver: Any):
        from colo.engine.model import expected_hf_specs

        self.saver = saver
        self.specs = expected_hf_specs(config, torch.bfloat16)
        g = torch.Generator(device="cuda").manual_seed(0)
        with saver.region("trainer.weights", cpu_backup=True):
            self.params = {s.name: (torch.randn(s.shape, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02)
                           for s in self.specs}
        with saver.region("trainer.optimizer", cpu_backup=True):
            # AdamW keeps two moments per parameter, in the parameter's dtype here
            self.moments = {n: (torch.zeros_like(p), torch.zeros_like(p)) for n, p in self.params.items()}
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.params.values())
        self.optimizer_bytes = 2 * self.weight_bytes

    def param_specs(self):
        return self.specs

    def extractor(self):
        from colo.extractors.plain import PlainExtractor

        if "trainer.weights" in self.saver.paused:
            host = self.host_state()
            # same dtype on both sides: the transport uploads straight into its buffer
            return PlainExtractor(host, dtype=torch.bfloat16, upload_to="cuda")
        return PlainExtractor(self.params, dtype=torch.bfloat16)

    def host_state(self) -> dict:
        return {n: self.saver.host_view(p) for n, p in self.params.items()}


async def time_sync(transport: Any, trainer: Any, engine: Any, *, source: str, bucket_bytes: int,
                    reps: int) -> dict:
    stages: list = []
    times, peaks = [], []
    result = None
    for i in range(reps + 1):  # the first is a warm-up
        ctx = SyncContext(step=i, weight_version=1, bucket_bytes=bucket_bytes, source=source,
                          staging=StagingBudget(None))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        result = await transport.sync(trainer, engine, ctx)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()
        if i:
            times.append(elapsed)
            peaks.append(torch.cuda.max_memory_allocated() - base)
            stages.extend(ctx.stages)
    sec = statistics.median(times)
    # where the time goes: each stage's total over the timed syncs, per sync
    by_stage: dict[str, float] = {}
    for rec in stages:
        by_stage[rec.stage] = by_stage.get(rec.stage, 0.0) + rec.duration_s / reps
    return {"sync_s": sec, "stage_s_per_sync": by_stage, "sync_s_all": times, "bytes": result.bytes, "buckets": result.buckets,
            "tensors": result.tensors, "GBps": result.bytes / sec / 1e9, "peak_extra_bytes": max(peaks)}


async def time_phases(trainer: BenchTrainer, engine: Any, cycles: int = 3) -> list[dict]:
    """engine release, trainer onload, trainer offload, both wake stages, per cycle."""
    saver = trainer.saver
    out = []
    for c in range(cycles):
        row: dict[str, Any] = {"cycle": c}
        t = time.perf_counter()
        await engine.release(["kv_cache", "weights"])
        row["engine_release_s"] = time.perf_counter() - t
        t = time.perf_counter()
        for tag in ("trainer.weights", "trainer.optimizer"):
            if tag in saver.paused:
                saver.resume(tag)
        torch.cuda.synchronize()
        row["trainer_onload_s"] = time.perf_counter() - t
        t = time.perf_counter()
        for tag in ("trainer.weights", "trainer.optimizer"):
            saver.pause(tag)
        torch.cuda.synchronize()
        row["trainer_offload_s"] = time.perf_counter() - t
        t = time.perf_counter()
        await engine.resume(["weights"])
        row["engine_wake_weights_s"] = time.perf_counter() - t
        t = time.perf_counter()
        await engine.resume(["kv_cache"])
        row["engine_wake_kv_s"] = time.perf_counter() - t
        moved = trainer.weight_bytes + trainer.optimizer_bytes
        row["trainer_state_bytes"] = moved
        row["trainer_onload_GBps"] = moved / row["trainer_onload_s"] / 1e9
        row["trainer_offload_GBps"] = moved / row["trainer_offload_s"] / 1e9
        out.append(row)
    return out


async def time_variants(trainer: Any, engine: Any, saver: Any, bucket_mib: float, reps: int) -> list[dict]:
    """Every transport variant under both plans; each row printed as it is measured."""
    from colo.transports import make_transport

    rows = []
    for plan, source in (("sync-first", "device"), ("offload-first", "host")):
        if source == "host" and "trainer.weights" not in saver.paused:
            saver.pause("trainer.weights")
        for label, name, opts in VARIANTS:
            transport = make_transport(name, **opts)
            try:
                r = await time_sync(transport, trainer, engine, source=source,
                                    bucket_bytes=int(bucket_mib * MiB), reps=reps)
            finally:
                if hasattr(transport, "aclose"):
                    await transport.aclose()
            r.update(plan=plan, transport=label, bucket_mib=bucket_mib)
            rows.append(r)
            print(json.dumps({"row": r}), flush=True)  # in the log even if the run is cut short
    return rows


def target_ratios(rows: list[dict], limits: dict, bucket_mib: float) -> dict:
    d2d_model_limit = limits["d2d_copy_GBps_read_plus_write"] / 2
    by = {(r["plan"], r["transport"]): r for r in rows}
    pipe_of, pipe_sf = by[("offload-first", "packed-pipelined")], by[("sync-first", "packed-pipelined")]
    return {
        "offload_first_vs_pinned_h2d": pipe_of["GBps"] / limits["pinned_h2d_GBps"],
        "offload_first_vs_slime_style": pipe_of["GBps"] / by[("offload-first", "packed-serial")]["GBps"],
        "offload_first_vs_per_tensor": pipe_of["GBps"] / by[("offload-first", "ipc")]["GBps"],
        "sync_first_vs_d2d_limit": pipe_sf["GBps"] / d2d_model_limit,
        "peak_extra_vs_bound": max(r["peak_extra_bytes"] for r in rows if "packed" in r["transport"])
        / (2 * bucket_mib * MiB + 64 * MiB),
    }


async def bench(*, bucket_mib: float = 512, reps: int = 3, layers: int | None = None) -> dict:
    from colo.cuda_memory import Saver
    from colo.engine.client import EngineClient
    from colo.engine.model import expected_digest
    from colo.models import demo_config

    shapes = dict(QWEN2_7B)
    if layers is not None:
        shapes["num_hidden_layers"] = layers
    config = demo_config(**shapes)
    limits = measure_limits()
    print(json.dumps({"limits": limits}), flush=True)
    saver = Saver()
    trainer = BenchTrainer(config, saver)
    saver.pause("trainer.optimizer")  # kept on the host while we sync
    free, total = torch.cuda.mem_get_info()
    kv = 2 * GiB
    build = {"config": config.to_dict(), "dtype": "bfloat16", "device": "cuda", "total_bytes": total,
             "mem_fraction_static": (trainer.weight_bytes + kv) / total, "checkpoint": None, "memory": "saver"}
    engine = await EngineClient.spawn(build)
    try:
        rows = await time_variants(trainer, engine, saver, bucket_mib, reps)
        # the last sync (offload-first, pipelined) must have delivered the trainer's weights
        digest_ok = await engine.digest() == expected_digest(trainer.host_state(), config, torch.bfloat16)
        print(json.dumps({"digest_verified": digest_ok}), flush=True)
        phases = await time_phases(trainer, engine)
        print(json.dumps({"phases": phases}), flush=True)
    finally:
        await engine.aclose()
    model_bytes = trainer.weight_bytes
    d2d_model_limit = limits["d2d_copy_GBps_read_plus_write"] / 2
    ratios = target_ratios(rows, limits, bucket_mib)
    return {
        "kind": "colo.apps.bench/gpu-sync", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(), "gpu_count": torch.cuda.device_count(), "device_total_bytes": total, "torch": torch.__version__,
        "cuda": torch.version.cuda, "python": platform.python_version(),
        "model": {"shapes": "Qwen2-7B" + ("" if layers is None else f" ({layers} layers)"), **shapes,
                  "dtype": "bfloat16", "bytes": model_bytes, "tensors": len(trainer.specs),
                  "trainer_state_bytes": trainer.weight_bytes + trainer.optimizer_bytes},
        "limits": limits, "sync_first_physical_limit_GBps": d2d_model_limit,
        "syncs": rows, "digest_verified": digest_ok, "phases": phases, "ratios": ratios,
    }


def run_bench_gpu(out: str | None, bucket_mib: float = 512, layers: int | None = None) -> int:
    if not torch.cuda.is_available():
        print("colo bench --device cuda: no CUDA device is visible", file=sys.stderr)
        return 2
    result = anyio.run(lambda: bench(bucket_mib=bucket_mib, layers=layers))
    text = json.dumps(result, indent=2)
    if out:
        with open(out, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    print(json.dumps({k: result[k] for k in ("device", "limits", "ratios", "digest_verified")}, indent=2))
    return 0 if result["digest_verified"] else 1


if __name__ == "__main__":
    sys.exit(run_bench_gpu(sys.argv[1] if len(sys.argv) > 1 else None))
