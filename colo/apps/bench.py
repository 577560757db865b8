"""``colo bench``: whole-sync throughput and peak staging, transport against transport,
on this machine's CPU or GPU.

For each model and each transport: a real engine process (colo's engine,
weights in the engine dtype, on ``--device``), a real trainer-side extractor
(``PlainExtractor`` over the trainer's copy on the host, pinned on a GPU
machine, converted to the engine dtype per bucket where the two differ), and
whole syncs through ``transport.sync`` — one warm-up, then the median of
``--reps``. Reported per transport: sync seconds, payload bytes, GB/s
(payload bytes / median seconds / 1e9) and its share of the link's limit,
peak staging bytes (what the transport counted through ``ctx.staging``),
engine requests per sync, the median time each stage spent (summed over
buckets; stages overlap, so these do not add up to the sync), and whether the
engine's digest after the syncs equals the trainer's. Beside them, measured
in the same run: on the CPU a host memcpy and a fsynced file write, on a GPU
pinned host->device, device->host and device->device copies.

Pluggable: :data:`MODELS` (``BenchModel``) and :data:`CASES` (``Case``: a
label, a registered transport, its options) are plain tables; :func:`bench`
takes any of them. The research harnesses (the GPU benchmark against
checkpoint-engine, the multi-GPU benchmark) live beside the package in
``bench/``.
"""

from __future__ import annotations

import datetime as dt
import importlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import torch

from colo.transports.disk import write_durable
from colo.core.errors import EXIT_FAILED, EXIT_OK, UsageError
from colo.core.memory import StagingBudget
from colo.core.interfaces import SyncContext

from colo.core.config import MIN_BUCKET_MIB
from colo.core.units import GiB, MiB
from colo.trace.outputs import output_path, replace_into
from colo.engine import ENGINES, REFERENCE
from colo.trainers.models import DEMO_MODELS, QWEN2_7B


@dataclass(frozen=True, kw_only=True)
class BenchModel:
    name: str
    description: str
    #: Qwen2Config fields over the demo defaults (``colo.trainers.models.demo_config``)
    config: dict
    bucket_mib: float
    repeat: int
    engine_dtype: str = "bfloat16"
    #: the trainer's copy the extractor converts from (master weights)
    source_dtype: str = "float32"

    def __post_init__(self) -> None:
        if not self.bucket_mib >= MIN_BUCKET_MIB:
            raise ValueError(f"bench model {self.name}: bucket_mib must be at least {MIN_BUCKET_MIB:g}, "
                             f"got {self.bucket_mib}")
        if isinstance(self.repeat, bool) or not isinstance(self.repeat, int) or self.repeat < 1:
            raise ValueError(f"bench model {self.name}: repeat must be a positive integer, got {self.repeat!r}")


@dataclass(frozen=True)
class Case:
    label: str
    transport: str
    options: dict = field(default_factory=dict)


MODELS: dict[str, BenchModel] = {
    "demo": BenchModel(name="demo", description="the demo's Qwen2 (colo.trainers.models.DEMO_DEFAULTS)", config={},
                       bucket_mib=1.0, repeat=5),
    # TinyLlama's layer shapes as a Qwen2 (qkv bias, untied lm_head): 1.1 B parameters
    "qwen2-1b": BenchModel(name="qwen2-1b", description="Qwen2 with TinyLlama-1.1B layer shapes (GQA 32/4)",
                           config=dict(vocab_size=32000, hidden_size=2048, num_hidden_layers=22,
                                       num_attention_heads=32, num_key_value_heads=4, intermediate_size=5632,
                                       max_position_embeddings=256),
                           bucket_mib=64.0, repeat=3),
    # Qwen2-1.5B (tied embeddings) and Qwen2-7B shapes in bf16, as a bf16 trainer holds them: nothing to
    # convert, so a sync moves each byte once over the link (a GPU's size: random weights)
    "qwen2-1.5b": BenchModel(name="qwen2-1.5b", description="Qwen2-1.5B shapes (tied embeddings), bf16",
                             config=dict(DEMO_MODELS["qwen2-1.5b"]), bucket_mib=512.0, repeat=3,
                             source_dtype="bfloat16"),
    "qwen2-7b": BenchModel(name="qwen2-7b", description="Qwen2-7B shapes, bf16", config=dict(QWEN2_7B),
                           bucket_mib=512.0, repeat=3, source_dtype="bfloat16"),
}

#: ``ipc`` first: verl's per-tensor handles are the baseline row.
CASES: list[Case] = [Case("ipc", "ipc"), Case("packed", "packed"), Case("broadcast", "broadcast"),
                     Case("disk", "disk", {"keep": 1})]
#: the transports run by default on each device (a GPU's engine and trainer share the GPU:
#: CUDA IPC; broadcast's NCCL group cannot hold two ranks on one GPU)
DEFAULT_CASES = {"cpu": ("ipc", "packed", "broadcast", "disk"), "cuda": ("ipc", "packed")}


class SourceTrainer:
    """The trainer side a transport needs: its copy of every tensor on the host (pinned,
    for a GPU's engine: ``offload-first``'s source), extracted per bucket."""

    def __init__(self, config: Any, *, source_dtype: str, engine_dtype: str, seed: int = 0,
                 upload_to: str | None = None):
        from colo.models.specs import hf_specs

        g = torch.Generator().manual_seed(seed)
        pin = upload_to is not None and torch.device(upload_to).type == "cuda"
        self.state = {}
        for s in hf_specs(config, source_dtype):
            t = torch.empty(s.shape, dtype=torch.float32).uniform_(-0.05, 0.05, generator=g)
            t = t.to(getattr(torch, source_dtype))
            self.state[s.name] = t.pin_memory() if pin else t
        self.engine_dtype = getattr(torch, engine_dtype)
        self.upload_to = upload_to

    def extractor(self) -> Any:
        from colo.extractors.plain import PlainExtractor

        return PlainExtractor(self.state, dtype=self.engine_dtype, upload_to=self.upload_to)


class _Counting:
    """The engine client, counting the per-request loads of a sync."""

    def __init__(self, client: Any):
        self.client, self.requests = client, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    async def transport_load(self, *args: Any, **kw: Any) -> dict:
        self.requests += 1
        return await self.client.transport_load(*args, **kw)


# -- measured ceilings ------------------------------------------------------------

def median_time(fn: Any, reps: int, *, cuda: bool = True, before_each: Any = None) -> float:
    """Median seconds of ``fn`` over ``reps`` runs after one warm-up: CUDA events on a
    GPU (the device's own time for what ``fn`` queues), the host clock otherwise.
    ``before_each()`` runs untimed before every run (a barrier of ranks, say)."""
    fn()
    if cuda:
        torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        if before_each is not None:
            before_each()
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) / 1000)
        else:
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return statistics.median(out)


def release_cached() -> None:
    """Give back what the caching allocators keep of freed buffers, device and pinned host."""
    torch.cuda.empty_cache()
    host_empty = getattr(torch._C, "_host_emptyCache", None)  # pinned host blocks stay cached otherwise
    if host_empty is not None:
        host_empty()


def measure_gpu_limits(nbytes: int = 2 * GiB, reps: int = 10) -> dict:
    """Pinned host->device and device->host, pageable host->device, and device->device
    (read + write) bandwidth of this GPU, in GB/s."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.random_(0, 255)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev2 = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev.random_(0, 255)
    h2d = median_time(lambda: dev.copy_(host, non_blocking=True), reps)
    d2h = median_time(lambda: host.copy_(dev, non_blocking=True), reps)
    d2d = median_time(lambda: dev2.copy_(dev), reps)
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    h2d_pageable = median_time(lambda: dev.copy_(pageable), 3)
    del host, pageable
    shared = _registered_h2d(dev, reps)
    del dev, dev2
    release_cached()
    return {"bytes": nbytes, "pinned_h2d_GBps": nbytes / h2d / 1e9, "pinned_d2h_GBps": nbytes / d2h / 1e9,
            "pageable_h2d_GBps": nbytes / h2d_pageable / 1e9, **shared,
            "d2d_copy_GBps_read_plus_write": 2 * nbytes / d2d / 1e9,
            "device_name": torch.cuda.get_device_name(), "torch": torch.__version__}


def _registered_h2d(dev: torch.Tensor, reps: int) -> dict:
    """Host->device out of a ``/dev/shm`` segment page-locked with ``cudaHostRegister``
    (:class:`colo.device.cuda_ipc.PinnedShm`): what a one-copy ``offload-first`` sync reads,
    the trainer's shared pinned backup. Its pages are the kernel's 4 KiB ones where
    ``cudaHostAlloc``'s pinned memory is the driver's own, so the rate may differ from
    ``pinned_h2d_GBps`` by machine (the one-copy sync ran at 1.05 of the pinned floor on one
    H200 and 1.18-1.20 on others). Where no such segment can be made (no room in /dev/shm)
    the rate is None and ``registered_shm_why_not`` says why."""
    from colo.core.errors import HandleError
    from colo.device.cuda_ipc import PinnedShm

    try:
        seg = PinnedShm.create(dev.numel())
    except (HandleError, OSError) as e:
        return {"registered_shm_h2d_GBps": None, "registered_shm_why_not": f"{type(e).__name__}: {e}"}
    try:
        seg.tensor.fill_(7)
        took = median_time(lambda: dev.copy_(seg.tensor, non_blocking=True), reps)
        return {"registered_shm_h2d_GBps": dev.numel() / took / 1e9}
    finally:
        seg.close()


def tensor_bytes(model: BenchModel) -> list[int]:
    """The bytes of each tensor a sync of ``model`` moves, in the engine's dtype and its order."""
    from colo.engine.reference.weights import expected_hf_specs
    from colo.trainers.models import demo_config

    return [s.nbytes for s in expected_hf_specs(demo_config(**model.config), model.engine_dtype)]


def flat_spans(sizes: Sequence[int], cap: int) -> list[tuple[int, int]]:
    """Byte ranges of tensors of ``sizes`` bytes laid out in a flat buffer (each start 16-byte
    aligned, as :class:`colo.device.flat_weights.FlatWeights` lays them), the first ones up to
    ``cap`` bytes (the first is always taken)."""
    if not sizes:
        raise ValueError("flat_spans: no tensor sizes")
    out: list[tuple[int, int]] = []
    at = 0
    for n in sizes:
        start = (at + 15) // 16 * 16
        if out and start + n > cap:
            break
        out.append((start, start + n))
        at = start + n
    return out


def registered_h2d_by_tensor(sizes: Sequence[int], *, cap: int = 2 * GiB, reps: int = 5) -> dict:
    """The same copy as :func:`_registered_h2d`, each tensor its own (``sizes``: a model's
    tensors' bytes in its order, laid out 16-byte aligned as a flat buffer lays them, the
    first of them up to ``cap`` bytes) into a plain device buffer: what a one-copy
    ``offload-first`` sync queues out of the trainer's shared backup, but for where it
    writes (the engine's parameters). Beside the one 2 GiB copy it says whether many copies
    of a model's sizes cost the link anything."""
    from colo.core.errors import HandleError
    from colo.device.cuda_ipc import PinnedShm

    spans = flat_spans(sizes, cap)
    at = spans[-1][1]
    try:
        seg = PinnedShm.create(at)
    except (HandleError, OSError) as e:
        return {"why_not": f"{type(e).__name__}: {e}"}
    dev = torch.empty(at, dtype=torch.uint8, device="cuda")
    try:
        seg.tensor.fill_(7)
        src = [seg.tensor[a:b] for a, b in spans]
        dst = [dev[a:b] for a, b in spans]

        def copy_each() -> None:
            for d, h in zip(dst, src):
                d.copy_(h, non_blocking=True)

        took = median_time(copy_each, reps)
        payload = sum(b - a for a, b in spans)
        return {"tensors": len(spans), "bytes": payload, "GBps": payload / took / 1e9}
    finally:
        del dev
        seg.close()


def measure_limits(nbytes: int = 512 * MiB, reps: int = 3, directory: str | None = None) -> dict:
    """The host's ceilings for the CPU transports: a memcpy, and a fsynced file write."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    memcpy = statistics.median(times[1:])
    data = src.numpy().tobytes()
    del src, dst
    wtimes = []
    with tempfile.TemporaryDirectory(dir=directory, prefix="colo-bench-write-") as d:
        for i in range(reps):
            path = os.path.join(d, f"w{i}")
            t0 = time.perf_counter()
            write_durable(path, data)  # the disk transport's own write: the ceiling it meets
            wtimes.append(time.perf_counter() - t0)
            os.unlink(path)
    return {"bytes": nbytes, "memcpy_GBps": nbytes / memcpy / 1e9,
            "file_write_fsync_GBps": nbytes / statistics.median(wtimes) / 1e9,
            "file_write_dir": directory or tempfile.gettempdir()}


# -- the benchmark -----------------------------------------------------------------

async def time_case(case: Case, trainer: Any, engine: Any, *, bucket_bytes: int, repeat: int,
                    warmup: int = 1, after_each: Any = None) -> dict:
    """``warmup`` syncs, then ``repeat`` timed ones, through ``case``'s transport;
    ``after_each(i)`` (awaited, untimed) after sync ``i``: an adapter's activation."""
    from colo.transports import make_transport

    transport = make_transport(case.transport, **case.options)
    counting = _Counting(engine)
    times: list[float] = []
    syncs = 0
    peaks: list[int] = []
    requests: list[int] = []
    stage_sums: dict[str, list[float]] = {}
    result = None
    try:
        for i in range(warmup + repeat):
            pool = StagingBudget(None)  # counts only: the benchmark measures the peak
            ctx = SyncContext(step=i, weight_version=i, bucket_bytes=bucket_bytes, source="host", staging=pool)
            counting.requests = 0
            t0 = time.perf_counter()
            result = await transport.sync(trainer, counting, ctx)
            elapsed = time.perf_counter() - t0
            syncs += 1
            if after_each is not None:
                await after_each(i)
            if pool.held_bytes:
                raise RuntimeError(f"{case.label}: {pool.held_bytes} staging bytes left after a sync")
            stages: dict[str, float] = {}
            for rec in ctx.stages:
                stages[rec.stage] = stages.get(rec.stage, 0.0) + rec.duration_s
            if i >= warmup:
                times.append(elapsed)
                peaks.append(pool.peak_bytes)
                requests.append(counting.requests)
                for stage, s in stages.items():
                    stage_sums.setdefault(stage, []).append(s)
    finally:
        await transport.aclose()
    sec = statistics.median(times)
    return {"transport": case.label, "name": case.transport, "options": case.options, "sync_s": sec,
            "sync_s_all": times, "bytes": result.bytes, "GBps": result.bytes / sec / 1e9,
            "peak_staging_bytes": max(peaks), "buckets": result.buckets, "tensors": result.tensors,
            "requests_per_sync": max(requests), "syncs": syncs,
            "stage_s_median": {k: statistics.median(v) for k, v in stage_sums.items()}}


def _engine_build(config: Any, model: BenchModel, device: str) -> dict:
    from colo.apps.bench_trainers import engine_build

    return engine_build(config, model.engine_dtype, device)


async def _start_engine(kind: str, config: Any, model: BenchModel, device: str, state: dict, workdir: str,
                        lora_rank: int | None = None) -> Any:
    """Engine ``kind`` (:data:`colo.engine.ENGINES`) started as its entry says: empty where it
    can start so (the syncs fill it), else from ``state`` in the form it reads (a model
    directory, or a safetensors file) with half the device for itself (the benchmark's
    trainer copy and digest need the rest)."""
    from colo.engine import engine_entry, start_engine
    from colo.models.save import save_start

    entry = engine_entry(kind)
    build = _engine_build(config, model, device)
    if not entry.starts_empty:
        path = save_start(entry.starts_from, config, state, workdir, dtype=getattr(torch, model.engine_dtype))
        build.update(checkpoint=path, mem_fraction_static=0.5)
    if lora_rank is not None:
        build["lora"] = {"rank": lora_rank, "keep": 2}
    return await start_engine(kind, build)


class AdapterSource:
    """A LoRA adapter of rank ``rank`` on every dense linear of ``config``'s model, in the
    engine's dtype: the trainer side of an adapter sync, as colo's LoRA trainer holds it, in
    one buffer the engine reads straight from (``flat_weights``: the packed transport's one-copy
    sync). On a GPU the buffer is paused into its shared pinned host backup, as an
    ``offload-first`` trainer's between train and sync: the engine's one copy is host->device."""

    def __init__(self, config: Any, rank: int, *, dtype: str, device: str = "cpu", seed: int = 1):
        from colo.device.flat_weights import FlatWeights
        from colo.models.lora import TARGETS, AdapterConfig, adapter_shapes

        self.config = AdapterConfig(r=rank, alpha=2 * rank, targets=TARGETS)
        g = torch.Generator().manual_seed(seed)
        state = {name: torch.empty(shape, dtype=torch.float32).uniform_(-0.05, 0.05, generator=g).to(getattr(torch, dtype))
                 for name, shape in adapter_shapes(config, self.config).items()}
        self.flat_weights = FlatWeights.from_tensors(state, device=device)
        if device == "cuda":
            self.flat_weights.pause()
        self.state = self.flat_weights.host_tensors()
        from colo.extractors.plain import PlainExtractor

        # built once and kept, as a trainer's: the transport walks a new extractor's tensors against
        # the flat buffer again (392 of them: 5.1 ms of a 36.6 ms adapter sync on an H200)
        self._extractor = PlainExtractor(self.state, upload_to=device if device == "cuda" else None)

    def extractor(self) -> Any:
        return self._extractor

    def close(self) -> None:
        self.flat_weights.close()


async def adapter_rows(cases: Sequence[Case], engine: Any, config: Any, model: BenchModel, rank: int, *,
                       device: str, full: Sequence[dict], limits: dict, say: Any) -> list[dict]:
    """Per case, adapter syncs of rank ``rank`` into ``engine`` as a LoRA run makes them (each a new
    version staged through the case's transport, activated after it, untimed), beside the full
    sync of the same model through the same transport (``full``: its row): the time, the bytes
    and both ratios. On a GPU, against the floor of its bytes over pinned host->device
    (:data:`ADAPTER_FLOOR`). Every stage's digest must be the adapter's."""
    source = AdapterSource(config, rank, dtype=model.engine_dtype, device=device)
    try:
        return await _adapter_rows(source, cases, engine, model, rank, device=device, full=full, limits=limits,
                                   say=say)
    finally:
        source.close()


async def _adapter_rows(source: AdapterSource, cases: Sequence[Case], engine: Any, model: BenchModel, rank: int, *,
                        device: str, full: Sequence[dict], limits: dict, say: Any) -> list[dict]:
    from colo.digest import expected_weights_digest
    from colo.engine.adapters import AdapterEngine

    want = expected_weights_digest(source.state, list(source.state), getattr(torch, model.engine_dtype))
    by_case = {r["transport"]: r for r in full}
    rows = []
    for case in cases:
        staged = AdapterEngine(engine, source.config)
        digests: list[bool] = []

        async def activate(i: int, staged: Any = staged, digests: list = digests) -> None:
            digests.append(await staged.digest() == want)
            await staged.set_weight_version(i + 1)

        bucket = int(model.bucket_mib * MiB)
        row = await time_case(case, source, staged, bucket_bytes=bucket, repeat=model.repeat, after_each=activate)
        whole = by_case.get(case.label)
        row.update(rank=rank, digest_ok=all(digests) and len(digests) == row["syncs"],
                   versions=await engine.adapters())
        if whole is not None:
            row.update(full_sync_s=whole["sync_s"], of_full_sync=row["sync_s"] / whole["sync_s"],
                       full_bytes=whole["bytes"], bytes_of_full=row["bytes"] / whole["bytes"])
        if device == "cuda":
            floor = ADAPTER_FLOOR[0] * row["bytes"] / (limits["pinned_h2d_GBps"] * 1e9) + ADAPTER_FLOOR[1]
            row.update(floor_s=floor, within_floor=row["sync_s"] <= floor)
        rows.append(row)
        say(f"{model.name} adapter r={rank}: {case.label:10s} {row['sync_s'] * 1e3:8.2f} ms  "
            f"{row['bytes'] / MiB:8.2f} MiB" + (f"  {row['of_full_sync']:.3f} of the full sync's time, "
                                                f"{row['bytes_of_full']:.4f} of its bytes" if whole else "")
            + f"  digest ok {row['digest_ok']}")
    return rows


#: the adapter sync's bound on one GPU (issue 43): 1.2 x its bytes over pinned host->device + 5 ms
ADAPTER_FLOOR = (1.2, 0.005)


async def bench_model(model: BenchModel, cases: Sequence[Case], *, device: str = "cpu",
                      progress: Any = None, limit_GBps: float | None = None, engine_kind: str = REFERENCE,
                      lora_rank: int | None = None, limits: dict | None = None) -> dict:
    from colo.engine import engine_entry
    from colo.trainers.models import demo_config

    say = progress or (lambda *_: None)
    config = demo_config(**model.config)
    trainer = SourceTrainer(config, source_dtype=model.source_dtype, engine_dtype=model.engine_dtype,
                            upload_to="cuda" if device == "cuda" else None)
    params = sum(t.numel() for t in trainer.state.values())
    want, trainer_digest_s = _trainer_digest(trainer, config, model, device)
    rows = []
    with tempfile.TemporaryDirectory(prefix="colo-bench-") as workdir:
        engine = await _start_engine(engine_kind, config, model, device, trainer.state, workdir, lora_rank)
        adapters: list[dict] = []
        try:
            for case in cases:
                say(f"{model.name} into {engine_kind}: {case.label} ...")
                row = await time_case(case, trainer, engine, bucket_bytes=int(model.bucket_mib * MiB),
                                      repeat=model.repeat)
                if engine_entry(engine_kind).timings:
                    # where the engine's syncs went: its calls, and inside its worker (over every sync timed)
                    row[f"{engine_kind}_call_s"] = {k: v / (row["syncs"]) for k, v in engine.call_s.items()}
                    row[f"{engine_kind}_worker_s"] = {k: v / (row["syncs"])
                                                      for k, v in (await engine.worker_timings()).items()}
                    engine.call_s.clear()
                # the last sync must have delivered the trainer's weights, bit for bit; the engine's
                # side of a verification timed as the scheduler sees it (a call into its process)
                got = await engine.digest()  # once untimed: a process compiles the checksum kernel once
                t0 = time.perf_counter()
                got = await engine.digest()
                row["engine_digest_s"] = time.perf_counter() - t0
                row["digest_ok"] = got == want
                # what --verify every adds to a sync: both digests (the trainer's where a trainer
                # holding its weights on the device computes it, see _trainer_digest)
                row["verify_s"] = row["engine_digest_s"] + trainer_digest_s
                row["verify_of_sync"] = row["verify_s"] / row["sync_s"]
                if limit_GBps:
                    row["of_limit"] = row["GBps"] / limit_GBps
                rows.append(row)
                say(f"{model.name} into {engine_kind}: {case.label:10s} {row['sync_s']:8.3f} s  "
                    f"{row['GBps']:6.3f} GB/s  peak staging {row['peak_staging_bytes'] / MiB:8.1f} MiB  "
                    f"digest ok {row['digest_ok']}")
            if lora_rank is not None:
                adapters = await adapter_rows(cases, engine, config, model, lora_rank, device=device, full=rows,
                                              limits=limits or {}, say=say)
        finally:
            await engine.aclose()
    return {"model": model.name, "engine": engine_kind, "description": model.description, "params": params,
            "tensors": len(trainer.state), "engine_dtype": model.engine_dtype, "source_dtype": model.source_dtype,
            "config": {k: v for k, v in config.to_dict().items()
                       if k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                "num_key_value_heads", "intermediate_size")},
            "bucket_mib": model.bucket_mib, "warmup": 1, "repeat": model.repeat, "digest": want,
            "trainer_digest_s": trainer_digest_s, "rows": rows,
            **({"adapter_rows": adapters} if lora_rank is not None else {})}


def _trainer_digest(trainer: SourceTrainer, config: Any, model: BenchModel, device: str) -> tuple[str, float]:
    """The digest every engine must report (:mod:`colo.digest`) and the seconds the trainer's
    side of it takes. On a GPU the trainer side is timed as a trainer with its weights on the
    device computes it (the demo's trainers take it there, before they offload): the
    benchmark's host copy is uploaded tensor by tensor first, outside the timing, then
    checksummed on the device (the same lanes as on the host: tests/gpu/test_digest_cuda.py)."""
    from colo.digest import expected_weights_digest

    dtype = getattr(torch, model.engine_dtype)
    if device != "cuda":
        t0 = time.perf_counter()
        # the tensors in the engine's order (SourceTrainer made them so), each in the engine's dtype
        want = expected_weights_digest(trainer.state, list(trainer.state), dtype)
        return want, time.perf_counter() - t0
    on_device = {n: t.to("cuda") for n, t in trainer.state.items()}
    order = list(on_device)
    expected_weights_digest(on_device, order, dtype)  # warm-up: the kernel's compilation
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        want = expected_weights_digest(on_device, order, dtype)
        times.append(time.perf_counter() - t0)
    del on_device
    release_cached()
    return want, statistics.median(times)


def machine_info() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        mem = None
    return {"platform": platform.platform(), "cpu": cpu, "cores": os.cpu_count(), "memory_bytes": mem,
            "python": platform.python_version(), "torch": torch.__version__}


async def bench(models: Sequence[BenchModel], cases: Sequence[Case], *, device: str = "cpu",
                progress: Any = None, engine: str = REFERENCE, trainers: Sequence[str] = (),
                trainer_reps: int | None = None, partial: Any = None, lora_rank: int | None = None) -> dict:
    """Every model through every case on ``device``, beside the limits measured first.
    ``engine``: another engine than colo's (its name in :data:`colo.engine.ENGINES`): each model
    into colo's engine and into it, same transport and bucket, and their ratio (``comparison``). ``trainers``: the real trainers' rows at every
    model too, every transition of the cycle timed (:mod:`colo.apps.bench_trainers`), and on a
    GPU torch_memory_saver's own CPU backup over each model's weight bytes. ``partial(result)``,
    where given, gets the result as it stands after the transports' rows and after each
    trainer's: a real trainer's rows take minutes at a GPU's sizes, and a run stopped midway
    keeps what it measured."""
    if device == "cuda":
        limits = measure_gpu_limits()
        limit, link = limits["pinned_h2d_GBps"], "pinned host->device"
        # each model's own tensor sizes, copied one by one out of a registered segment
        limits["registered_shm_h2d_by_tensor"] = {m.name: registered_h2d_by_tensor(tensor_bytes(m)) for m in models}
    else:
        limits = measure_limits()
        limit, link = limits["memcpy_GBps"], "host memcpy"
    kinds = (REFERENCE,) if engine == REFERENCE else (REFERENCE, engine)
    results = [await bench_model(m, cases, device=device, progress=progress, limit_GBps=limit, engine_kind=k,
                                 lora_rank=lora_rank, limits=limits)
               for m in models for k in kinds]
    out = {"kind": f"colo.apps.bench/{device}-sync",
           "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "device": device, "gpus": 1 if device == "cuda" else 0, "machine": machine_info(), "limits": limits,
           "limit": {"link": link, "GBps": limit}, "models": results}
    if engine != REFERENCE:
        out["comparison"] = compare_engines(results)
        out[engine] = {"version": _engine_version(engine)}
    if trainers:
        from colo.apps import bench_trainers as bt

        if device == "cuda":
            release_cached()  # the rows' children get the device as the parent left it: nothing cached
        say = progress or (lambda *_: None)
        out["trainers"] = []

        def measured(entry: dict) -> None:
            out["trainers"].append(bt.against_limits(entry, limits, device))
            if partial is not None:
                partial(out)

        if partial is not None:
            partial(out)
        bt.trainer_rows(models, trainers, device=device, reps=trainer_reps, say=say, each=measured)
        if device == "cuda":
            sizes = sorted({m["rows"][0]["bytes"] for m in results if m["rows"]})
            out["saver_backup"] = [bt.saver_against_limits(e, limits)
                                   for e in bt.saver_rows(sizes, reps=trainer_reps or 3, say=say)]
    return out


def _engine_version(engine: str) -> str:
    """The installed version of the engine's package (its entry's ``requires``)."""
    from importlib.metadata import PackageNotFoundError, version

    from colo.engine import engine_entry

    module = engine_entry(engine).requires
    if module is None:
        from colo import __version__

        return __version__
    mod = importlib.import_module(module)
    found = getattr(mod, "__version__", None)
    if found is None:
        try:
            found = version(module)
        except PackageNotFoundError:
            found = "?"
    return str(found)


def compare_engines(results: Sequence[dict]) -> list[dict]:
    """Per model and transport: each other engine's sync time over colo's engine's (same bytes,
    transport and bucket), and the stages beside each other (where the extra time goes)."""
    out = []
    by = {(m["model"], m["engine"]): m for m in results}
    for (name, kind), m in by.items():
        if kind == REFERENCE or (name, REFERENCE) not in by:
            continue
        ref = {r["transport"]: r for r in by[(name, REFERENCE)]["rows"]}
        for r in m["rows"]:
            c = ref.get(r["transport"])
            if c is not None:
                out.append({"model": name, "engine": kind, "transport": r["transport"], f"{REFERENCE}_s": c["sync_s"],
                            f"{kind}_s": r["sync_s"], "ratio": r["sync_s"] / c["sync_s"],
                            f"{REFERENCE}_stage_s": c["stage_s_median"], f"{kind}_stage_s": r["stage_s_median"],
                            f"{kind}_call_s": r.get(f"{kind}_call_s", {}),
                            f"{kind}_worker_s": r.get(f"{kind}_worker_s", {})})
    return out


def table(result: dict) -> str:
    """The README's table: one row per model, engine and transport (and vLLM against colo's engine)."""
    link = result.get("limit", {}).get("link", "limit")
    lines = [f"| model | transport | sync s | bytes | GB/s | of {link} | peak staging | requests/sync | verify s "
             "(of sync) | digest |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for m in result["models"]:
        for r in m["rows"]:
            share = f"{r['of_limit']:.3f}" if "of_limit" in r else "-"
            engine = f" into {m['engine']}" if m.get("engine", REFERENCE) != REFERENCE else ""
            lines.append(f"| {m['model']}{engine} ({m['params'] / 1e6:,.0f} M params, {m['bucket_mib']:g} MiB buckets) "
                         f"| {r['transport']} | {r['sync_s']:.3f} | {r['bytes']:,} | {r['GBps']:.2f} | {share} "
                         f"| {r['peak_staging_bytes'] / MiB:,.1f} MiB | {r['requests_per_sync']:,} "
                         f"| {r['verify_s']:.4f} ({r['verify_of_sync']:.2f}) "
                         f"| {'ok' if r['digest_ok'] else 'MISMATCH'} |")
    adapters = [(m, r) for m in result["models"] for r in m.get("adapter_rows", ())]
    if adapters:
        lines += ["", "| model | adapter | transport | sync ms | bytes | of the full sync's time | of its bytes "
                      "| floor ms | digest |", "|---|---|---|---:|---:|---:|---:|---:|---|"]
        for m, r in adapters:
            engine = f" into {m['engine']}" if m.get("engine", REFERENCE) != REFERENCE else ""
            lines.append(f"| {m['model']}{engine} | r={r['rank']} | {r['transport']} | {r['sync_s'] * 1e3:.2f} "
                         f"| {r['bytes']:,} | {r.get('of_full_sync', float('nan')):.3f} "
                         f"| {r.get('bytes_of_full', float('nan')):.4f} "
                         + (f"| {r['floor_s'] * 1e3:.2f} ({'within' if r['within_floor'] else 'ABOVE'}) "
                            if "floor_s" in r else "| - ")
                         + f"| {'ok' if r['digest_ok'] else 'MISMATCH'} |")
    for c in result.get("comparison", []):
        kind = c["engine"]
        title = ENGINES[kind].title if kind in ENGINES else kind
        worker = c.get(f"{kind}_worker_s", {})
        lines.append(f"\n{c['model']} over {c['transport']}: {title} {c[f'{kind}_s'] * 1e3:.1f} ms, colo's engine "
                     f"{c[f'{REFERENCE}_s'] * 1e3:.1f} ms: {c['ratio']:.2f}x"
                     + (f"; in {title}'s worker per sync: " + ", ".join(f"{k} {v * 1e3:.1f} ms"
                                                                           for k, v in worker.items())
                        if worker else ""))
    return "\n".join(lines)


# -- the command ---------------------------------------------------------------------

def _choose(args: Any) -> tuple[list[BenchModel], list[Case]]:
    """The models (``--model``, with ``--bucket-mib`` and ``--reps`` over each model's own)
    and the cases (``--transports``, else the device's defaults) the command line asks for."""
    import dataclasses

    from colo.transports import REGISTRY

    names = list(MODELS) if args.model == "all" else [n.strip() for n in str(args.model).split(",")]
    unknown = [n for n in names if n not in MODELS]
    if unknown or not names:
        raise UsageError(f"unknown model {', '.join(unknown) or repr(args.model)}; expected one of "
                         f"{', '.join(MODELS)}, a comma-separated list of them, or all")
    wanted = args.transports or list(DEFAULT_CASES[args.device])
    bad = [t for t in wanted if t not in REGISTRY]
    if bad:
        raise UsageError(f"unknown transport {', '.join(bad)}; expected some of {', '.join(REGISTRY)}")
    by_label = {c.label: c for c in CASES}
    override = {k: v for k, v in (("bucket_mib", args.bucket_mib), ("repeat", args.reps)) if v is not None}
    models = [dataclasses.replace(MODELS[n], **override) for n in names]
    return models, [by_label.get(t, Case(t, t)) for t in wanted]


#: where results go when no --out is given (the committed results live here)
RESULTS_DIR = Path("bench/results")


def write_result(text: str, *, out: str | os.PathLike | None, directory: str | os.PathLike, stem: str) -> Path:
    """Write ``text`` to ``out``, or to ``<directory>/<stem>.json`` when no path was given.

    The text goes to a temporary file in the destination's directory first and
    is moved into place whole, so a reader never sees half a result. A default
    path never replaces a file that exists (a committed result): the next free
    ``<stem>-2.json``, ``<stem>-3.json`` ... is taken, by a hard link, which
    fails rather than replaces if the name was taken meanwhile. An explicit
    ``out`` is replaced, as asked, if it is a regular file (or a link to one:
    the file it names is), and refused if it is anything else.
    """
    target = Path(output_path(out, "--out")) if out is not None else Path(directory) / f"{stem}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if out is not None:
            replace_into(tmp, os.fspath(target), "--out")
            return target
        n = 1
        while True:
            try:
                os.link(tmp, target)
                return target
            except FileExistsError:
                n += 1
                target = target.with_name(f"{stem}-{n}.json")
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def model_for_engine(model: BenchModel, engine: str, device: str) -> BenchModel:
    """The model as both engines take it when ``engine`` is compared with colo's: in a dtype
    the engine runs on ``device`` (its entry's ``dtypes``; vLLM on a CPU: float32, its bfloat16
    CPU kernels hit an illegal instruction on short prompts), the same for colo's engine, and
    converted from the same dtype."""
    import dataclasses

    from colo.engine import engine_entry

    entry = engine_entry(engine)
    entry.check(device=device)  # a device the engine does not run on: bad input (UsageError below)
    if model.engine_dtype in entry.dtypes[device]:
        return model
    dtype = entry.default_dtype(device)
    return dataclasses.replace(model, engine_dtype=dtype, source_dtype=dtype)


def check_out(out: str | None) -> None:
    """Refuse, before the benchmark runs, an ``--out`` it could not be written to.

    The result goes to a temporary file beside the target and is renamed over
    it: the target must be new or a regular file (a device such as /dev/full, a
    FIFO or a link to one would be replaced by the rename:
    :func:`colo.trace.outputs.output_path`), in a directory we can create files in."""
    if out is None:
        return
    target = Path(output_path(out, "--out"))
    parent = target.parent
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".probe", dir=parent)
    except OSError as e:
        raise UsageError(f"--out {out}: cannot write in {parent}: {e.strerror or e}") from None
    os.close(fd)
    os.unlink(probe)


def run_bench(args: Any) -> int:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda, but no CUDA device is visible")
    models, cases = _choose(args)
    check_out(args.out or None)

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    engine = getattr(args, "engine", REFERENCE)
    try:
        models = [model_for_engine(m, engine, args.device) for m in models]
    except ValueError as e:
        raise UsageError(str(e)) from None
    trainers = choose_trainers(getattr(args, "trainers", None), args.device)

    def partial(result: dict) -> None:
        # the rows measured so far, where --out names the file: the finished run replaces them
        if args.out:
            write_result(json.dumps({**result, "partial": True}, indent=2) + "\n", out=args.out,
                         directory=RESULTS_DIR, stem="")

    lora_rank = getattr(args, "lora_rank", None)
    if lora_rank is not None and not ENGINES[engine].adapters:
        raise UsageError(f"--lora-rank times adapter syncs into an engine that stages adapters "
                         f"(--engine {' or '.join(e.name for e in ENGINES.values() if e.adapters)}), got --engine {engine}")
    result = anyio.run(lambda: bench(models, cases, device=args.device, progress=say, engine=engine,
                                     trainers=trainers, trainer_reps=args.reps, partial=partial,
                                     lora_rank=lora_rank))
    print(table(result))
    if trainers:
        from colo.apps.bench_trainers import table as trainer_table

        print()
        print(trainer_table(result["trainers"], result.get("saver_backup", ())))
    try:
        out = write_result(json.dumps(result, indent=2) + "\n", out=args.out or None, directory=RESULTS_DIR,
                           stem=f"{args.device}-sync-{dt.date.today().isoformat()}")
    except OSError as e:  # a disk that filled during the run: the table above is all that is left
        print(f"colo bench: could not write the result to {args.out or RESULTS_DIR}: {e.strerror or e}",
              file=sys.stderr)
        return EXIT_FAILED
    print(f"results: {out}")
    ok = all(r["digest_ok"] for m in result["models"] for r in m["rows"] + m.get("adapter_rows", []))
    # a trainer row that failed (its digest or probe did not match, or its child died) fails the run
    ok = ok and not any("error" in e for e in result.get("trainers", []) + result.get("saver_backup", []))
    return EXIT_OK if ok else EXIT_FAILED


def choose_trainers(value: str | None, device: str) -> list[str]:
    """``--trainers``: a comma-separated list of hf, megatron, fsdp, or all, or none; unset:
    all three on a GPU, none on a CPU (the CPU's rows are the transports')."""
    from colo.apps.bench_trainers import TRAINERS

    if value is None:
        return list(TRAINERS) if device == "cuda" else []
    if value == "none":
        return []
    if value == "all":
        return list(TRAINERS)
    names = [n.strip() for n in value.split(",")]
    bad = [n for n in names if n not in TRAINERS]
    if bad or not names or len(set(names)) != len(names):
        raise UsageError(f"--trainers {value!r}: expected a comma-separated list of {', '.join(TRAINERS)} "
                         "(each once), all, or none")
    return names


__all__ = ["RESULTS_DIR", "write_result", "BenchModel", "CASES", "Case", "MODELS", "bench", "check_out", "bench_model", "machine_info",
           "measure_limits", "run_bench", "table", "time_case"]
