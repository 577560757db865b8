"""``python -m bench.gpu_sync``: the sync on one GPU against its physical limits and the
verl- and slime-style baselines, and the timing of every other phase of the cycle.

Models: Qwen2-7B's and Qwen2-1.5B's shapes (the latter with tied embeddings,
``colo.trainers.models.DEMO_MODELS``) in bf16, random weights; the engine is colo's
engine in its own process, its memory in torch_memory_saver regions; the
trainer's weights and AdamW state are in regions with a pinned host backup.
Measured in the same run: pinned host->device and device->host bandwidth and
device->device copy bandwidth (read + write), and per model its floors: one
pinned host->device copy and one device copy of exactly the model's bytes.

Syncs compared, for ``offload-first`` (source: the pinned host backup) and
``sync-first`` (source: weights resident on the GPU):
``ipc`` (one CUDA IPC handle per tensor, verl's way), ``packed`` without
pipelining (slime's way), ``packed`` pipelined (colo, packing), and under
``sync-first`` ``packed`` one-copy (colo: the engine loads straight out of the
trainer's flat weight buffer, nothing packed; issue 18, item 2). The baselines
and the pipelined row are told not to use the flat buffer, so they still pack.
The trainer's weights are that flat buffer (``colo.device.flat_weights``), paused to
its own pinned host copy. Beside them, per model, a
real peer: MoonshotAI's checkpoint-engine from the same weights (the same seed,
``bench.models``) into a receiver process on the same GPU, run first, as a user
would run it: ``python -m bench.peer`` in a process of its own that holds nothing
else, before this process has built any of colo's rows. Each model's ratios say
how much faster colo's one-copy ``offload-first`` sync is than the peer's best
configuration and than its default.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import anyio
import torch

from colo.core.interfaces import SyncContext
from colo.apps.bench import measure_gpu_limits as measure_limits, median_time, release_cached
from colo.core.memory import GiB, MiB, StagingBudget
from bench.models import GPU_MODEL_NAMES, gpu_models, seeded_flat_weights, shapes_of

#: (label, transport, options, plans it runs under). One-copy is colo's default and runs first
#: under each plan, so the digest taken after it shows it delivered: under sync-first the engine
#: reads the trainer's flat device buffer, under offload-first the paused weights' shared pinned
#: host backup (each time into an engine that holds other weights).
VARIANTS = [("packed-one-copy", "packed", {"pipelined": True}, ("sync-first", "offload-first")),
            ("ipc", "ipc", {}, ("sync-first", "offload-first")),
            ("packed-serial", "packed", {"pipelined": False, "one_copy": False}, ("sync-first", "offload-first")),
            ("packed-pipelined", "packed", {"pipelined": True, "one_copy": False}, ("sync-first", "offload-first"))]


def host_available() -> int | None:
    """MemAvailable of this machine, in bytes (None where /proc/meminfo is not there)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def measure_floors(nbytes: int, reps: int = 5) -> dict:
    """One model's floors: one pinned host->device copy and one device copy of exactly its bytes."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev2 = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    h2d = median_time(lambda: dev.copy_(host, non_blocking=True), reps)
    d2d = median_time(lambda: dev2.copy_(dev), reps)
    del host, dev, dev2
    release_cached()
    return {"bytes": nbytes, "h2d_s": h2d, "h2d_GBps": nbytes / h2d / 1e9, "d2d_s": d2d,
            "d2d_GBps_read_plus_write": 2 * nbytes / d2d / 1e9, "reps": reps}


class BenchTrainer:
    """A trainer's state without a training loop: weights in one flat, exportable buffer
    (``colo.device.flat_weights``: what the one-copy sync reads), AdamW moments in a saver region.

    The region is ``<tag>.optimizer``: a second model's trainer in the same
    process takes another tag, so that pausing one never touches the other's
    (the memory saver aborts on a second pause)."""

    def __init__(self, config: Any, saver: Any, tag: str = "trainer"):
        from colo.engine.reference.weights import expected_hf_specs

        self.saver = saver
        self.weights_tag, self.optimizer_tag = f"{tag}.weights", f"{tag}.optimizer"
        self.specs = expected_hf_specs(config, torch.bfloat16)
        # seeded as bench.peer seeds the peer's: both move the same bytes
        self.flat_weights = seeded_flat_weights(self.specs)
        self.params = self.flat_weights.tensors
        with saver.region(self.optimizer_tag, cpu_backup=True):
            # AdamW keeps two moments per parameter, in the parameter's dtype here
            self.moments = {n: (torch.zeros_like(p), torch.zeros_like(p)) for n, p in self.params.items()}
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.params.values())
        self.optimizer_bytes = 2 * self.weight_bytes
        self._resident_extractor = self._host_extractor = None
        self.first_pause_s: float | None = None

    def param_specs(self):
        return self.specs

    def extractor(self):
        """One extractor per source, built on first use and kept, as a training loop keeps
        its own: the resident weights (their views never change) and their pinned host
        copy (allocated at the first pause and kept). A sync then does not rebuild 339
        specs and views first, and the one-copy sync finds its layout once."""
        from colo.extractors.plain import PlainExtractor

        if self.weights_paused:
            if self._host_extractor is None:
                # same dtype on both sides: the transport uploads straight into its buffer
                self._host_extractor = PlainExtractor(self.host_state(), dtype=torch.bfloat16, upload_to="cuda")
            return self._host_extractor
        if self._resident_extractor is None:
            self._resident_extractor = PlainExtractor(self.params, dtype=torch.bfloat16)
        return self._resident_extractor

    @property
    def weights_paused(self) -> bool:
        return self.flat_weights.paused

    def pause_weights(self) -> None:
        t = time.perf_counter()
        self.flat_weights.pause()
        if self.first_pause_s is None:  # it makes (and registers) the pinned host backup
            self.first_pause_s = time.perf_counter() - t

    def resume_weights(self) -> None:
        self.flat_weights.resume()

    def host_state(self) -> dict:
        """The pinned host copy of the paused weights (views, no copy)."""
        return self.flat_weights.host_tensors()


class EngineCalls:
    """The engine client, with each request's round trip timed by its op, and for loads
    the engine's own split of it (``engine_open_s``: the receiver opening the request's
    handle and making its views; ``engine_copy_s``: the copies into the parameters and
    the wait for them): where a sync's time goes outside the sender's stages."""

    def __init__(self, engine: Any):
        self._engine = engine
        self.totals: dict[str, float] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def _add(self, key: str, seconds: float) -> None:
        self.totals[key] = self.totals.get(key, 0.0) + seconds

    async def _timed(self, op: str, *args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return await getattr(self._engine, op)(*args, **kwargs)
        finally:
            self._add(f"{op}_s", time.perf_counter() - t)

    async def preflight(self, *args: Any, **kwargs: Any) -> Any:
        return await self._timed("preflight", *args, **kwargs)

    async def begin_load(self, *args: Any, **kwargs: Any) -> Any:
        return await self._timed("begin_load", *args, **kwargs)

    async def end_load(self, *args: Any, **kwargs: Any) -> Any:
        return await self._timed("end_load", *args, **kwargs)

    async def transport_load(self, *args: Any, **kwargs: Any) -> dict:
        reply = await self._timed("transport_load", *args, **kwargs)
        self._add("engine_open_s", float(reply.get("handoff_s", 0.0)))
        self._add("engine_copy_s", float(reply.get("load_s", 0.0)))
        return reply


class AdjacentH2D:
    """The pinned host-to-device rate measured right before and right after each timed
    sync, out of the very memory an offload-first sync reads (the paused weights' host
    backup, its first ``nbytes``).

    Why: on the H100 the rate of one and the same copy drifted from 55 to 46 GB/s
    within a minute (bench/h2d_probe.py, 2026-11-24), so a limit measured once at the
    start can sit 10 % away from the rate a sync later gets. Each sync's time over the
    floor at the rate adjacent to it in time says what the sync itself adds."""

    def __init__(self, host: Any, nbytes: int = 2 * GiB):
        self.src = host[:min(nbytes, host.numel())]
        self.dst = torch.empty(self.src.numel(), dtype=torch.uint8, device="cuda")

    def rate(self) -> float:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        self.dst.copy_(self.src, non_blocking=True)
        b.record()
        b.synchronize()
        return self.src.numel() / (a.elapsed_time(b) / 1000) / 1e9

    def close(self) -> None:
        self.dst = self.src = None
        torch.cuda.empty_cache()


async def time_sync(transport: Any, trainer: Any, engine: Any, *, source: str, bucket_bytes: int,
                    reps: int, adjacent: AdjacentH2D | None = None) -> dict:
    stages: list = []
    rates: list[tuple[float, float]] = []  # the adjacent rate before and after each timed sync
    calls = EngineCalls(engine)
    engine = calls
    times, peaks, collect = [], [], []
    result = None
    first_s = None
    for i in range(reps + 1):  # the first is a warm-up
        ctx = SyncContext(step=i, weight_version=1, bucket_bytes=bucket_bytes, source=source,
                          staging=StagingBudget(None))
        before = adjacent.rate() if adjacent is not None and i else None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t0, c0 = time.perf_counter(), ctx.clock()
        result = await transport.sync(trainer, engine, ctx)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        if before is not None:
            rates.append((before, adjacent.rate()))
        t1 = time.perf_counter()
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()  # what slime does after a sync: its cost, beside the sync's
        collect_s = time.perf_counter() - t1
        if not i:
            calls.totals.clear()  # the warm-up's calls are not counted
            first_s = elapsed  # beside the timed ones: what a first sync pays once (a mapping, a registration)
        else:
            times.append(elapsed)
            collect.append(collect_s)
            # the adjacent probe's scratch is allocated before the peak is reset: not counted
            peaks.append(torch.cuda.max_memory_allocated() - base)
            stages.extend(ctx.stages)
            # the last timed sync, stage by stage: [bucket, stage, start_s, end_s] from its start
            timeline = [[r.bucket, r.stage, round(r.at - r.duration_s - c0, 6), round(r.at - c0, 6)]
                        for r in ctx.stages]
    sec = statistics.median(times)
    adjacent_fields = {}
    if rates:
        nbytes = result.bytes
        # each sync over its floor at the mean of the rates measured just before and after it
        over = [t / (nbytes / ((a + b) / 2 * 1e9)) for t, (a, b) in zip(times, rates)]
        adjacent_fields = {"adjacent_h2d_GBps": [[round(a, 2), round(b, 2)] for a, b in rates],
                           "sync_over_adjacent_h2d_floor_all": over,
                           "sync_over_adjacent_h2d_floor": statistics.median(over)}
    # where the time goes: each stage's total over the timed syncs, per sync
    by_stage: dict[str, float] = {}
    for rec in stages:
        by_stage[rec.stage] = by_stage.get(rec.stage, 0.0) + rec.duration_s / reps
    return {"sync_s": sec, "stage_s_per_sync": by_stage,
            "engine_calls_s_per_sync": {k: v / reps for k, v in calls.totals.items()},
            "timeline": timeline, "sync_s_all": times, "first_sync_s": first_s,
            "ipc_collect_and_empty_cache_s": statistics.median(collect), "bytes": result.bytes, "buckets": result.buckets,
            "tensors": result.tensors, "GBps": result.bytes / sec / 1e9, "peak_extra_bytes": max(peaks),
            **adjacent_fields}


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
        if trainer.weights_paused:
            trainer.resume_weights()
        if trainer.optimizer_tag in saver.paused:
            saver.resume(trainer.optimizer_tag)
        torch.cuda.synchronize()
        row["trainer_onload_s"] = time.perf_counter() - t
        t = time.perf_counter()
        trainer.pause_weights()
        saver.pause(trainer.optimizer_tag)
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
    """Every transport variant under the plans it runs under; each row printed as it is
    measured. The engine's digest right after the one-copy row (the first to load) is
    kept as that row's ``engine_digest``, to be checked against the trainer's weights."""
    from colo.transports import make_transport

    rows = []
    adjacent = None
    for plan, source in (("sync-first", "device"), ("offload-first", "host")):
        if source == "host" and not trainer.weights_paused:
            trainer.pause_weights()
            adjacent = AdjacentH2D(trainer.flat_weights.host)
        for label, name, opts, plans in VARIANTS:
            if plan not in plans:
                continue
            transport = make_transport(name, **opts)
            try:
                r = await time_sync(transport, trainer, engine, source=source,
                                    bucket_bytes=int(bucket_mib * MiB), reps=reps, adjacent=adjacent)
            finally:
                if hasattr(transport, "aclose"):
                    await transport.aclose()
            r.update(plan=plan, transport=label, bucket_mib=bucket_mib)
            if label == "packed-one-copy":
                r["engine_digest"] = await engine.digest()
            rows.append(r)
            print(json.dumps({"row": r}), flush=True)  # in the log even if the run is cut short
    if adjacent is not None:
        adjacent.close()
    return rows


def target_ratios(rows: list[dict], limits: dict, bucket_mib: float, floors: dict | None = None) -> dict:
    d2d_model_limit = limits["d2d_copy_GBps_read_plus_write"] / 2
    by = {(r["plan"], r["transport"]): r for r in rows}
    pipe_of, pipe_sf = by[("offload-first", "packed-pipelined")], by[("sync-first", "packed-pipelined")]
    out = {
        "offload_first_vs_pinned_h2d": pipe_of["GBps"] / limits["pinned_h2d_GBps"],
        "offload_first_vs_slime_style": pipe_of["GBps"] / by[("offload-first", "packed-serial")]["GBps"],
        "offload_first_vs_per_tensor": pipe_of["GBps"] / by[("offload-first", "ipc")]["GBps"],
        "sync_first_vs_d2d_limit": pipe_sf["GBps"] / d2d_model_limit,
        "peak_extra_vs_bound": max(r["peak_extra_bytes"] for r in rows if "packed" in r["transport"])
        / (2 * bucket_mib * MiB + 64 * MiB),
    }
    one = by.get(("sync-first", "packed-one-copy"))
    if one is not None:
        out["sync_first_one_copy_vs_d2d_limit"] = one["GBps"] / d2d_model_limit
        out["sync_first_one_copy_vs_packed_pipelined"] = pipe_sf["sync_s"] / one["sync_s"]
    one_of = by.get(("offload-first", "packed-one-copy"))
    # the run's host-to-device limit applied to these bytes: the stricter floor (the
    # model's own single copy below came out slower than the limit in some runs)
    limit_s = pipe_of["bytes"] / (limits["pinned_h2d_GBps"] * 1e9)
    out["offload_first_sync_over_run_limit"] = pipe_of["sync_s"] / limit_s
    if "sync_over_adjacent_h2d_floor" in pipe_of:
        out["offload_first_sync_over_adjacent_h2d_floor"] = pipe_of["sync_over_adjacent_h2d_floor"]
    if one_of is not None:
        if "sync_over_adjacent_h2d_floor" in one_of:
            out["offload_first_one_copy_sync_over_adjacent_h2d_floor"] = one_of["sync_over_adjacent_h2d_floor"]
        out["offload_first_one_copy_vs_pinned_h2d"] = one_of["GBps"] / limits["pinned_h2d_GBps"]
        out["offload_first_one_copy_sync_over_run_limit"] = one_of["sync_s"] / limit_s
        out["offload_first_one_copy_vs_packed_pipelined"] = pipe_of["sync_s"] / one_of["sync_s"]
    if floors is not None:
        # the model's own floors, measured with its exact byte count: sync / floor (1.0 is the floor)
        out["offload_first_sync_over_h2d_floor"] = pipe_of["sync_s"] / floors["h2d_s"]
        out["sync_first_sync_over_d2d_floor"] = pipe_sf["sync_s"] / floors["d2d_s"]
        if one is not None:
            out["sync_first_one_copy_over_d2d_floor"] = one["sync_s"] / floors["d2d_s"]
        if one_of is not None:
            out["offload_first_one_copy_sync_over_h2d_floor"] = one_of["sync_s"] / floors["h2d_s"]
    return out


async def bench_model(name: str, saver: Any, limits: dict, *, bucket_mib: float, reps: int,
                      layers: int | None, peer: dict | None = None) -> dict:
    """One model: its floors, colo's syncs under both plans, the cycle's phases, and their
    ratios against the peer's result (``peer``: :func:`run_peer_process`'s, measured before)."""
    from colo.engine.reference.client import EngineClient
    from colo.engine.reference.weights import expected_digest, expected_hf_specs
    from colo.trainers.models import demo_config

    label = gpu_models()[name][0]
    shapes = shapes_of(name, layers)
    config = demo_config(**shapes)
    model_bytes = sum(s.nbytes for s in expected_hf_specs(config, torch.bfloat16))
    floors = measure_floors(model_bytes)
    print(json.dumps({"model": name, "floors": floors, "host_available_bytes": host_available()}), flush=True)
    trainer = BenchTrainer(config, saver, tag=f"trainer-{name}")
    saver.pause(trainer.optimizer_tag)  # kept on the host while we sync
    free, total = torch.cuda.mem_get_info()
    kv = 2 * GiB
    build = {"config": config.to_dict(), "dtype": "bfloat16", "device": "cuda", "total_bytes": total,
             "mem_fraction_static": (trainer.weight_bytes + kv) / total, "checkpoint": None, "memory": "saver"}
    engine = await EngineClient.spawn(build)
    try:
        rows = await time_variants(trainer, engine, saver, bucket_mib, reps)
        # the last sync (offload-first, pipelined) must have delivered the trainer's weights
        want = expected_digest(trainer.host_state(), config, torch.bfloat16)
        # and the one-copy row, the first to load into this engine, delivered them too
        one_copy_ok = all(r["engine_digest"] == want for r in rows if "engine_digest" in r)
        for r in rows:
            if "engine_digest" in r:
                r["digest_verified"] = r.pop("engine_digest") == want
        digest_ok = await engine.digest() == want and one_copy_ok
        print(json.dumps({"model": name, "digest_verified": digest_ok, "one_copy_digest_verified": one_copy_ok}),
              flush=True)
        phases = await time_phases(trainer, engine)
        print(json.dumps({"model": name, "phases": phases}), flush=True)
    finally:
        await engine.aclose()
    ratios = target_ratios(rows, limits, bucket_mib, floors)
    if peer is not None:
        ratios.update(peer_ratios(peer, rows, want))
        print(json.dumps({"model": name, "peer_ratios": {k: v for k, v in ratios.items() if "checkpoint" in k}}),
              flush=True)
    flat = trainer.flat_weights
    host_backup = {"shared": flat.host_shared, "unshared_reason": flat.host_unshared,
                   "first_pause_s": trainer.first_pause_s}
    # the next model's trainer gets the host memory back: the 7B's 15 GB backup outliving
    # its model left the 1.5B's run to the OOM killer on a 128 GiB machine
    flat.close()
    return {
        "name": name, "shapes": label + ("" if layers is None else f" ({layers} layers)"), **shapes,
        "dtype": "bfloat16", "bytes": model_bytes, "tensors": len(trainer.specs),
        "trainer_state_bytes": trainer.weight_bytes + trainer.optimizer_bytes, "floors": floors,
        "syncs": rows, "digest_verified": digest_ok, "phases": phases, "ratios": ratios, "peer": peer,
        # whether offload-first's one-copy row read a shared pinned backup (else it packed, and says why)
        "host_backup": host_backup,
    }


#: how long one model's peer process may take: its 7B run registers 15 GB of pinned memory
#: twice and times about 24 updates, a few minutes; past this it is stopped and said
PEER_TIMEOUT_S = 1200.0


def peer_command(name: str, out: str, *, layers: int | None, reps: int) -> list[str]:
    """The peer's own process: ``python -m bench.peer`` with this benchmark's model and reps."""
    cmd = [sys.executable, "-m", "bench.peer", out, "--model", name, "--reps", str(reps)]
    return cmd + (["--layers", str(layers)] if layers is not None else [])


def read_peer_result(path: str, returncode: int | None) -> dict:
    """What ``python -m bench.peer`` wrote, or why there is nothing to read.

    ``skipped`` (checkpoint-engine not importable) and ``error`` (it failed, with its
    traceback) are its own results; a process that wrote nothing (killed, timed out) is
    an error here. Its exit status is kept beside its result."""
    from bench.peer import KIND

    said = "timed out" if returncode is None else f"exited {returncode}"
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except FileNotFoundError:
        return {"error": f"bench.peer {said} without writing {path} (its output is in the log above)",
                "rows": [], "returncode": returncode}
    except (OSError, ValueError) as e:
        return {"error": f"bench.peer {said}; its result {path} is unreadable: {e}", "rows": [],
                "returncode": returncode}
    if not isinstance(data, dict) or data.get("kind") != KIND or not isinstance(data.get("rows"), list):
        return {"error": f"bench.peer {said}; {path} is not a {KIND} result", "rows": [], "returncode": returncode}
    if returncode != 0 and "skipped" not in data and "error" not in data and all(r.get("digest_ok") for r in data["rows"]):
        data["error"] = f"bench.peer {said} after writing its result"
    data["returncode"] = returncode
    return data


def run_peer_process(name: str, *, layers: int | None, reps: int, folder: str,
                     timeout_s: float = PEER_TIMEOUT_S) -> dict:
    """checkpoint-engine for one model, in a process of its own (its lines go to this log as
    they come), and its result; a missing checkpoint-engine is a ``skipped`` result."""
    out = os.path.join(folder, f"peer-{name}.json")
    cmd = peer_command(name, out, layers=layers, reps=reps)
    print(json.dumps({"model": name, "peer_command": cmd}), flush=True)
    # the child finds this bench package wherever the caller's working directory is (after
    # the caller's own path, whose order it keeps)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), root) if p)}
    t = time.perf_counter()
    try:
        returncode: int | None = subprocess.run(cmd, timeout=timeout_s, check=False, env=env).returncode
    except subprocess.TimeoutExpired:
        returncode = None
    result = read_peer_result(out, returncode)
    result["process_wall_s"] = time.perf_counter() - t
    for key in ("skipped", "error"):
        if key in result:
            print(f"checkpoint-engine ({name}) {key}: {result[key]}", file=sys.stderr, flush=True)
    return result


def peer_ratios(peer: dict, rows: Sequence[dict], want_digest: str | None = None) -> dict:
    """colo against the peer, > 1 where colo is faster: the peer's best and its default
    update over colo's one-copy ``offload-first`` sync (and its pipelined packed one); each
    peer row gets its own. A default whose bytes did not arrive gets no ratio. With
    ``want_digest`` (colo's trainer's), the peer's result also records whether its own
    weights were the same bytes (``same_weights_as_colo``)."""
    by = {(r["plan"], r["transport"]): r for r in rows}
    colo = {"offload_first_one_copy": by.get(("offload-first", "packed-one-copy")),
            "offload_first": by.get(("offload-first", "packed-pipelined"))}
    out: dict[str, Any] = {}
    for which in ("best", "default"):
        r = peer.get(which)
        if r is None or not r.get("digest_ok"):
            continue
        for key, row in colo.items():
            if row is not None:
                out[f"checkpoint_engine_{which}_over_colo_{key}"] = r["update_s"] / row["sync_s"]
    for r in peer.get("rows", []):
        for key, row in colo.items():
            if row is not None:
                r[f"over_colo_{key}"] = r["update_s"] / row["sync_s"]
    if want_digest is not None and "expected_digest" in peer:
        # the peer's process made its weights itself: the same bytes as colo's trainer, or the ratio is void
        peer["same_weights_as_colo"] = peer["expected_digest"] == want_digest
    return out


async def bench(*, bucket_mib: float = 512, reps: int = 3, layers: int | None = None,
                models: Sequence[str] = GPU_MODEL_NAMES, peer: bool = True) -> dict:
    from colo.device.cuda_memory import Saver

    unknown = [m for m in models if m not in GPU_MODEL_NAMES]
    if unknown or not models:
        raise ValueError(f"unknown model {', '.join(unknown) or repr(models)}; expected some of {', '.join(GPU_MODEL_NAMES)}")
    peers: dict[str, dict] = {}
    if peer:
        # first, each in a process of its own: this process holds nothing on the GPU yet
        with tempfile.TemporaryDirectory(prefix="colo-bench-peer-") as folder:
            for name in models:
                peers[name] = run_peer_process(name, layers=layers, reps=reps, folder=folder)
    limits = measure_limits()
    print(json.dumps({"limits": limits}), flush=True)
    saver = Saver()
    total = torch.cuda.mem_get_info()[1]
    entries = []
    for name in models:
        entries.append(await bench_model(name, saver, limits, bucket_mib=bucket_mib, reps=reps, layers=layers,
                                         peer=peers.get(name)))
    first = entries[0]
    peers_ok = all(peer_ok(e["peer"]) for e in entries)
    return {
        "kind": "colo.apps.bench/gpu-sync", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(), "gpu_count": torch.cuda.device_count(), "device_total_bytes": total,
        "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
        "bucket_mib": bucket_mib, "reps": reps, "warmup": 1,
        "limits": limits, "sync_first_physical_limit_GBps": limits["d2d_copy_GBps_read_plus_write"] / 2,
        "models": entries,
        # the first model's figures where earlier results kept them
        "model": {k: v for k, v in first.items() if k not in ("syncs", "digest_verified", "phases", "ratios", "peer")},
        "syncs": first["syncs"], "phases": first["phases"], "ratios": first["ratios"],
        "digest_verified": all(e["digest_verified"] for e in entries), "peer_digests_verified": peers_ok,
    }


def peer_ok(peer: dict | None) -> bool:
    """Not run, skipped (not installed), or run with every row's bytes delivered, a best
    among them, and the same weights as colo's trainer."""
    if peer is None or "skipped" in peer:
        return True
    return ("error" not in peer and peer.get("best") is not None and all(r["digest_ok"] for r in peer["rows"])
            and peer.get("same_weights_as_colo", True))


def peer_summary(peer: dict | None) -> Any:
    """A model's peer in the log's summary: why it did not run, or its default and best."""
    if peer is None:
        return None
    if "skipped" in peer or "error" in peer:
        return peer.get("skipped") or peer.get("error")
    return {"default": peer.get("default"), "best": peer.get("best"),
            "rows": {r["label"]: {"update_s": r["update_s"], "bucket_gib": r["bucket_gib"], "digest_ok": r["digest_ok"]}
                     for r in peer["rows"]}}


def summary(result: dict) -> dict:
    """What the log ends with: the limits, each model's ratios and the peer's updates."""
    return {"device": result["device"], "limits": result["limits"],
            "models": {e["name"]: {"floors": e["floors"], "ratios": e["ratios"],
                                   "colo": {f"{r['plan']} {r['transport']}": r["sync_s"] for r in e["syncs"]},
                                   "peer": peer_summary(e["peer"])}
                       for e in result["models"]},
            "digest_verified": result["digest_verified"], "peer_digests_verified": result["peer_digests_verified"]}


def run_bench_gpu(out: str | None, bucket_mib: float = 512, layers: int | None = None, *,
                  models: Sequence[str] = GPU_MODEL_NAMES, peer: bool = True, reps: int = 3) -> int:
    if not torch.cuda.is_available():
        print("bench.gpu_sync: no CUDA device is visible", file=sys.stderr)
        return 2
    result = anyio.run(lambda: bench(bucket_mib=bucket_mib, layers=layers, models=models, peer=peer, reps=reps))
    text = json.dumps(result, indent=2)
    if out:
        with open(out, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    print(json.dumps(summary(result), indent=2))
    return 0 if result["digest_verified"] and result["peer_digests_verified"] else 1


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m bench.gpu_sync", allow_abbrev=False, description="colo's sync on one GPU against its limits, the baselines and checkpoint-engine")
    p.add_argument("out", nargs="?", help="where the JSON result goes")
    p.add_argument("--models", default=",".join(GPU_MODEL_NAMES), help=f"comma-separated, of {', '.join(GPU_MODEL_NAMES)}")
    p.add_argument("--layers", type=int, help="cut every model to this many layers (a quick check)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--bucket-mib", type=float, default=512)
    p.add_argument("--no-peer", action="store_true", help="leave checkpoint-engine out")
    a = p.parse_args(argv)
    models = [m.strip() for m in a.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in GPU_MODEL_NAMES]
    if unknown or not models:
        p.error(f"unknown model {', '.join(unknown) or repr(a.models)}; expected some of {', '.join(GPU_MODEL_NAMES)}")
    if a.layers is not None and a.layers < 1:
        p.error(f"--layers must be >= 1, got {a.layers}")
    if a.reps < 1:
        p.error(f"--reps must be >= 1, got {a.reps}")
    return run_bench_gpu(a.out, a.bucket_mib, a.layers, models=models, peer=not a.no_peer, reps=a.reps)


if __name__ == "__main__":
    from colo.device.cuda_memory import exit_past_the_saver

    sys.exit(exit_past_the_saver(main()))
