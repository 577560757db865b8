"""``colo bench --trainers``: the real trainers' syncs and every transition of the cycle.

Beside the flat-buffer rows of :mod:`colo.apps.bench`, one row per trainer (hf,
megatron, fsdp: :mod:`colo.trainers`) and plan. Each trainer is measured in a
child process of its own (torch_memory_saver is process-wide, and megatron-core
must be imported before a saver exists), as it is deployed: built by its own
builder with its parameters in the engine's dtype on a GPU (fp32 master weights
in its optimizer where that fits beside the engine), colo's engine in a further
process, colo's default transport (``packed``: one copy where the trainer's
weights are one flat buffer).

Per plan, cycles of the real sequence, each step timed on its own:

- ``offload-first``: engine release (KV and weights), trainer onload, trainer
  pause, engine wake weights, the sync from the pinned host backup, engine wake KV;
- ``sync-first``: engine release, trainer onload, engine wake weights, the sync
  from the resident device weights, trainer pause, engine wake KV.

One warm-up cycle and ``reps`` plain cycles (``--verify none``: the trainer's
memory moved by its backend alone), then ``reps`` verified cycles as the demo
verifies (:func:`colo.apps.demo_setup.make_verifier`): the trainer offloads
through ``trainer.offload`` (which takes its digest and the probe's reference on
the device first), and after the sync the engine's digest is checked against
the trainer's and the engine's logits on the probe batch against the trainer's
(under ``sync-first`` the digest against the one the trainer's offload then takes,
after it, as the scheduler checks it: ``checked_at_offload``).
colo's engine digests its own weights, so as the scheduler does it is probed on
the first verified cycle only, and its loads after a digest sum the weights as
they write them. Reported: every step's median, the verification's parts, what
verification adds to a sync (``verify_adds_s``: a verified cycle's sync and
verification against a plain sync), and the verified offload beside the plain
pause (what verification adds to the offload).

The parent (:func:`trainer_rows`) sets every figure against the link limits
measured in the same run; :func:`saver_rows` measures torch_memory_saver's own
CPU backup (``enable_cpu_backup``) over the same bytes, with and without a
retained backup, each in a process of its own (the retain flag is process-wide).

usage (the child): python -m colo.apps.bench_trainers trainer|saver JSON_ARGS OUT
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

#: the plans a trainer row is measured under, per device (a CPU trainer has no device memory to
#: move: its weights are always resident, so only ``sync-first`` means anything there)
PLANS = {"cuda": ("offload-first", "sync-first"), "cpu": ("sync-first",)}
#: the trainers ``--trainers all`` means, in the order they run
TRAINERS = ("hf", "megatron", "fsdp")
#: bytes a parameter costs in a real trainer's optimizer (fp32 master and two fp32 moments)
OPTIMIZER_BYTES_PER_PARAM = 12
#: device memory left free beside the trainer and the engine when deciding whether the
#: optimizer's state fits (activations of the probe, staging, the CUDA contexts)
HEADROOM_BYTES = 4 << 30
#: how long one trainer's child may run (a 7B model is built on the host in fp32 first)
CHILD_TIMEOUT_S = 1800


def engine_build(config: Any, engine_dtype: str, device: str) -> dict:
    """colo's engine as the benchmark starts it: weights in ``engine_dtype`` on ``device`` and the
    smallest KV pool it accepts (one sequence of maximum length), twice over: the benchmark
    never generates, and the device's memory is for the weights. On a GPU its memory is
    torch_memory_saver's, as ``colo demo`` deploys it: a release pauses the weights at their
    addresses, and what the engine planned for them (row blocks, bucket layouts, the summed
    load's tables) holds from cycle to cycle, where freed weights would make every sync
    the engine's first."""
    import torch

    from colo.engine.reference.dims import dims_from_config
    from colo.engine.reference.weights import expected_hf_specs

    dtype = getattr(torch, engine_dtype)
    weights = sum(s.nbytes for s in expected_hf_specs(config, dtype))
    dims = dims_from_config(config)
    kv = 2 * dims.max_positions * dims.slot_bytes(dtype)
    fraction = 0.9
    return {"config": config.to_dict(), "dtype": engine_dtype, "device": device,
            "total_bytes": int((weights + kv) / fraction) + 1, "mem_fraction_static": fraction,
            "checkpoint": None, "memory": "saver" if device == "cuda" else "free"}


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def optimizer_fits(params: int, weight_bytes: int, engine_bytes: int, free_bytes: int) -> tuple[bool, str]:
    """Whether the trainer's optimizer state (12 bytes a parameter) fits on the device beside
    its weights (twice: the hf trainer's adoption into one buffer holds both copies for a
    moment) and the engine's weights, with :data:`HEADROOM_BYTES` to spare; and why."""
    need = params * OPTIMIZER_BYTES_PER_PARAM + 2 * weight_bytes + engine_bytes + HEADROOM_BYTES
    if need <= free_bytes:
        return True, f"fits: {need / 2**30:.1f} GiB of {free_bytes / 2**30:.1f} GiB free"
    return False, (f"left out: {params:,} parameters x {OPTIMIZER_BYTES_PER_PARAM} bytes of fp32 masters and moments "
                   f"need {need / 2**30:.1f} GiB with the weights and the engine, {free_bytes / 2**30:.1f} GiB free")


class _Clock:
    """Seconds of an awaited step, the device's queued work included."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    async def time(self, step: Callable[[], Any]) -> tuple[float, Any]:
        self.sync()
        t0 = time.perf_counter()
        out = await step()
        self.sync()  # a flat buffer's resume is queued: its copy belongs to the step
        return time.perf_counter() - t0, out


#: plain cycles of each plan run before the measured ones (see measure_trainer)
WARMUPS = 2
#: a directory: each trainer's child profiles one more plain sync per plan there (torch.profiler:
#: the trainer process's operators and kernels, the engine's load is in its own process), to
#: find where a sync's time goes before changing it (issue 44: sync-first at ten device copies)
PROFILE_ENV = "COLO_BENCH_PROFILE"
#: a directory: each trainer's child runs ``PYPROFILE_CYCLES`` more plain cycles per plan with
#: their syncs under cProfile (the trainer process's Python: the sender, the engine client, the
#: channel) and writes the functions by cumulative and by own time there, to find which host
#: work a sync waits on (issue 44: 0.9 ms of a 5 ms sync-first sync outside its recorded stages)
PYPROFILE_ENV = "COLO_BENCH_PYPROFILE"
PYPROFILE_CYCLES = 10
#: seconds to wait between the engine's wake-up and each sync (unset: none, as the scheduler
#: runs them). A diagnosis, not a setting: whether the sync right after the trainer released
#: its memory runs slower than the same sync a moment later (issue 44: the one-copy
#: offload-first sync's copies at 49-50 GB/s on the device where the same copies in a process
#: of their own ran at 54.5); every result records the wait it was run with
SETTLE_ENV = "COLO_BENCH_SETTLE_S"


#: the order the trainer's tags are paused in, comma-separated (unset: the cycle's own,
#: ``colo.core.phases``' trainer_offload: the optimizer state, then the weights). A diagnosis:
#: the driver clears device memory a process released, and host<->device copies run at half
#: the link's rate while it does (bench.saver_copy: 25 GB/s right after 18 GiB were released);
#: ``weights,optimizer`` is the order that put the optimizer state's clearing on the sync
PAUSE_ORDER_ENV = "COLO_BENCH_PAUSE_ORDER"


def _pause_order(tags: list[str]) -> list[str]:
    from colo.core.phases import EFFECTS, Phase

    raw = os.environ.get(PAUSE_ORDER_ENV, "")
    if not raw:
        return [t for t in EFFECTS[Phase.TRAINER_OFFLOAD].pause if t in tags]
    order = [t.strip() for t in raw.split(",")]
    if sorted(order) != sorted(tags):
        raise ValueError(f"{PAUSE_ORDER_ENV} must name the tags {tags} each once, got {raw!r}")
    return order


def _settle_s() -> float:
    raw = os.environ.get(SETTLE_ENV, "")
    if not raw:
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{SETTLE_ENV} must be a number of seconds, got {raw!r}") from None
    if not 0.0 <= value <= 60.0:
        raise ValueError(f"{SETTLE_ENV} must be between 0 and 60 seconds, got {raw!r}")
    return value


async def _profiled(where: str, clock: _Clock, step: Callable[[], Any], engine: Any = None) -> tuple[float, Any]:
    """``clock.time(step)`` under torch.profiler; its tables (by self device time and by self
    CPU time) and its Chrome trace written to ``where`` + ``.txt`` / ``.json``. An ``engine``
    that records itself (colo's: ``profile_start``) records the same sync in its own process,
    its trace at ``where`` + ``-engine.json`` and its summary at ``-engine-summary.json``: the
    copies a load queues run there (issue 44: which of Megatron's copies out of the host
    backup run slower than hf's, a device span 4 ms longer for the same bytes)."""
    import json

    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if clock.cuda else [])
    try:  # the transports pack and copy on threads of their own: their operators too
        extra = {"experimental_config": torch._C._profiler._ExperimentalConfig(profile_all_threads=True)}
    except (AttributeError, TypeError):
        extra = {}
    records = callable(getattr(engine, "profile_start", None))
    if records:
        await engine.profile_start()
    with profile(activities=activities, **extra) as prof:
        took, out = await clock.time(step)
    if records:
        summary = await engine.profile_stop(where + "-engine.json")
        with open(where + "-engine-summary.json", "w") as f:
            json.dump(summary, f, indent=1)
    table = prof.key_averages()
    with open(where + ".txt", "w") as f:
        f.write(f"one sync, {took * 1e3:.1f} ms (torch {torch.__version__})\n\n")
        for key in (["self_device_time_total"] if clock.cuda else []) + ["self_cpu_time_total"]:
            f.write(f"== by {key}\n{table.table(sort_by=key, row_limit=30, max_name_column_width=90)}\n")
    prof.export_chrome_trace(where + ".json")
    return took, out


def _pyprofiled(prof: Any, clock: _Clock, step: Callable[[], Any]) -> Any:
    """``clock.time(step)`` with cProfile ``prof`` collecting while it runs."""

    async def run() -> tuple[float, Any]:
        prof.enable()
        try:
            return await clock.time(step)
        finally:
            prof.disable()

    return run()


def _pyprofile_write(prof: Any, where: str, cycles: int) -> None:
    """``prof``'s functions by cumulative and by own time, at ``where``."""
    import io
    import pstats

    out = io.StringIO()
    out.write(f"{cycles} syncs under cProfile (its own overhead included in every figure)\n")
    for key in ("cumulative", "tottime"):
        out.write(f"\n== by {key}\n")
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(45)
    with open(where, "w") as f:
        f.write(out.getvalue())


async def _cycle(plan: str, trainer: Any, engine: Any, transport: Any, tags: list[str], clock: _Clock, step: int,
                 bucket_bytes: int, verifier: tuple[Callable, Callable] | None, probe_now: bool = True,
                 profile_to: str | None = None, pyprofile: Any = None) -> dict:
    """One cycle of ``plan``, each transition timed; with ``verifier`` the demo's verification
    (the probe only where ``probe_now``: the scheduler probes an engine whose digest is of its
    live weights on its first verified sync only); with ``profile_to`` its sync profiled there
    (:func:`_profiled`)."""
    from colo.core.interfaces import SyncContext
    from colo.core.memory import StagingBudget
    from colo.core.phases import effects_for, offload_follows_sync, validate_plan

    out: dict[str, Any] = {}
    backend = trainer.memory_backend
    #: the engine's digest where it is taken beside the trainer's offload (see below)
    beside: list[tuple[str, float]] = []

    async def offload_and_digest(order: list[str]) -> None:
        """The trainer's offload, and beside it the engine's digest of its live weights, each
        timed (the scheduler's Scheduler._digests_beside_offload)."""
        from colo.groups import side_by_side

        async def digest() -> None:
            t0 = time.perf_counter()
            got = await engine.live_digest()
            beside.append((got, time.perf_counter() - t0))

        await side_by_side(trainer.offload(order), digest())

    async def pause(digest_beside: bool = False) -> None:
        order = _pause_order(tags)
        if verifier is not None:
            # as colo's trainer offloads: its digest first, on the device, and the probe's reference
            # where a probe may read it while the weights are paused (the scheduler's rule,
            # Scheduler._want_probe_reference): before an offload-first sync, not after a sync-first one
            want = getattr(verifier[1], "want_reference", None)
            if want is not None:
                want(plan != "sync-first")
            step = (lambda: offload_and_digest(order)) if digest_beside else (lambda: trainer.offload(order))
            out["trainer_offload_verified_s"], _ = await clock.time(step)
        elif backend is not None:
            out["trainer_pause_s"], _ = await clock.time(lambda: backend.pause("trainer", order))
            out["trainer_pause_parts_s"] = dict(getattr(backend, "last_pause_s", {}))

    out["engine_release_s"], _ = await clock.time(lambda: engine.release(["kv_cache", "weights"]))
    if backend is not None and not backend.resident("weights"):  # the first cycle finds it resident, as built
        out["trainer_onload_s"], _ = await clock.time(lambda: backend.resume("trainer", tags))
        out["trainer_onload_parts_s"] = dict(getattr(backend, "last_resume_s", {}))
    if plan == "offload-first":
        await pause()
    out["engine_wake_weights_s"], _ = await clock.time(lambda: engine.resume(["weights"]))
    settle = _settle_s()
    if settle:
        import anyio

        await anyio.sleep(settle)
    source = "host" if backend is not None and not backend.resident("weights") else "device"
    ctx = SyncContext(step=step, weight_version=step, bucket_bytes=bucket_bytes, source=source,
                      staging=StagingBudget(None), flush_cache=True)
    if pyprofile is not None:
        out["sync_s"], result = await _pyprofiled(pyprofile, clock, lambda: transport.sync(trainer, engine, ctx))
    elif profile_to is None:
        out["sync_s"], result = await clock.time(lambda: transport.sync(trainer, engine, ctx))
    else:
        out["sync_s"], result = await _profiled(profile_to, clock, lambda: transport.sync(trainer, engine, ctx),
                                                engine)
    out.update(bytes=result.bytes, buckets=result.buckets, tensors=result.tensors, source=source,
               peak_staging_bytes=ctx.staging.peak_bytes, stage_s=stage_sums(result.stages),
               engine_s=dict(ctx.engine_s))
    # the scheduler's rule (Scheduler._check_at_offload): a sync from the weights the trainer
    # offloads next is checked against the digest that offload takes, not a second read inside it
    deferred = verifier is not None and source == "device" and trainer.digest_at_offload() \
        and offload_follows_sync(validate_plan(plan), effects_for("weights"))
    # ... and the engine's digest, where it reads the live weights, taken beside that offload
    # (Scheduler._digests_beside_offload): nothing of verification inside the sync
    digest_beside = deferred and engine.capabilities.digest_live and callable(getattr(engine, "live_digest", None))
    if verifier is not None:
        verify, probe = verifier
        t0 = time.perf_counter()
        digest = None if digest_beside else await engine.digest()
        t1 = time.perf_counter()
        if not deferred:
            await verify([digest])  # raises VerificationError on a mismatch: the row fails, loudly
        t2 = time.perf_counter()
        if probe_now:
            await probe()
        t3 = time.perf_counter()
        out["verify_s"] = t3 - t0
        out["verify_parts"] = {"engine_digest_s": t1 - t0, "trainer_check_s": t2 - t1,
                               "probe_s": t3 - t2 if probe_now else None}
        out["digest"] = digest
        out["checked_at_offload"] = deferred
        out["digest_beside_offload"] = digest_beside
    if plan == "sync-first":
        await pause(digest_beside)
    if beside:
        digest = out["digest"] = beside[0][0]
        # its own time, beside the offload's (trainer_offload_verified_s holds both)
        out["verify_parts"]["engine_digest_s"] = beside[0][1]
    if deferred:
        t0 = time.perf_counter()
        await verify([digest])
        took = time.perf_counter() - t0
        out["verify_s"] += took
        out["verify_parts"]["trainer_check_s"] = took
    out["engine_wake_kv_s"], _ = await clock.time(lambda: engine.resume(["kv_cache"]))
    return out


def stage_sums(stages: Sequence[Any]) -> dict[str, float]:
    """Seconds per stage of one sync, summed over its buckets (upload, gather, pack, handoff,
    load): where a sync's time goes. Stages of neighbouring buckets overlap in the pipeline,
    so the sums may add up to more than the sync."""
    out: dict[str, float] = {}
    for rec in stages:
        out[rec.stage] = out.get(rec.stage, 0.0) + rec.duration_s
    return out


def _summary(plan: str, plain: list[dict], verified: list[dict]) -> dict:
    """A plan's row: every step's median over its cycles (the warm-up left out by the caller)."""
    steps = ("engine_release_s", "trainer_onload_s", "trainer_pause_s", "engine_wake_weights_s", "sync_s",
             "engine_wake_kv_s")
    last = plain[-1]
    row = {"plan": plan, "source": last["source"], "bytes": last["bytes"], "buckets": last["buckets"],
           "tensors": last["tensors"], "peak_staging_bytes": max(c["peak_staging_bytes"] for c in plain),
           "cycles": len(plain), "verified_cycles": len(verified),
           "sync_s_all": [c["sync_s"] for c in plain],
           # each cycle's engine account too: a median hides one slow load in three (issue 44: hf's
           # sync-first engine queued its one launch for 3.9 ms in two cycles, 1.0 ms in the third)
           "engine_s_all": [dict(c.get("engine_s", {})) for c in plain],
           "step_s": {k: _median([c[k] for c in plain if k in c]) for k in steps if any(k in c for c in plain)},
           "stage_s": {k: _median([c["stage_s"].get(k, 0.0) for c in plain])
                       for k in sorted({k for c in plain for k in c["stage_s"]})},
           # the engine's own account of its loads (the copies queued, waited for...), summed per sync
           "engine_s": {k: _median([c["engine_s"].get(k, 0.0) for c in plain])
                        for k in sorted({k for c in plain for k in c.get("engine_s", {})})}}
    row["sync_s"] = row["step_s"]["sync_s"]
    for key in ("trainer_pause_parts_s", "trainer_onload_parts_s"):
        # where the trainer's pause and onload go: each tag, each part of it (TrainerMemory.last_pause_s)
        parts = [c[key] for c in plain if c.get(key)]
        if parts:
            row[key] = {k: _median([p[k] for p in parts if k in p]) for k in parts[-1]}
    if verified:
        row["verify_s"] = _median([c["verify_s"] for c in verified])
        row["verify_s_all"] = [c["verify_s"] for c in verified]
        # a part that did not run in a cycle (the probe after the first, for an engine whose
        # digest is of its live weights) is left out of its median; one that never ran is None
        ran = {k: [c["verify_parts"][k] for c in verified if c["verify_parts"][k] is not None]
               for k in verified[0]["verify_parts"]}
        row["verify_parts"] = {k: _median(v) if v else None for k, v in ran.items()}
        row["probed_cycles"] = sum(c["verify_parts"]["probe_s"] is not None for c in verified)
        row["verified_sync_s"] = _median([c["sync_s"] for c in verified])
        row["verified_engine_s"] = {k: _median([c["engine_s"].get(k, 0.0) for c in verified])
                                    for k in sorted({k for c in verified for k in c.get("engine_s", {})})}
        # what verification adds to a sync, as --verify every runs it: the verified cycle's sync
        # (its load sums the weights as it writes them) and its verification, against a plain sync
        row["verify_adds_s"] = _median([c["sync_s"] + c["verify_s"] for c in verified]) - row["sync_s"]
        row["digests"] = sorted({c["digest"] for c in verified})
        # the trainer's digest was the one its offload takes (sync-first, Scheduler._check_at_offload):
        # trainer_check_s is then the comparison after the offload, the digest's pass in the verified offload
        row["checked_at_offload"] = all(c.get("checked_at_offload", False) for c in verified)
        # ... and the engine's digest taken beside that offload, not inside the sync: what verification
        # adds is then in offload_verify_adds_s (engine_digest_s: the digest's own time beside it)
        row["digest_beside_offload"] = all(c.get("digest_beside_offload", False) for c in verified)
        offload = [c["trainer_offload_verified_s"] for c in verified if "trainer_offload_verified_s" in c]
        if offload:
            row["trainer_offload_verified_s"] = _median(offload)
            row["trainer_offload_verified_s_all"] = offload
            if "trainer_pause_s" in row["step_s"]:
                # what verification adds to the cycle outside the sync: the offload's digest (and,
                # in a probing cycle, the probe's reference) against a plain pause
                row["offload_verify_adds_s"] = row["trainer_offload_verified_s"] - row["step_s"]["trainer_pause_s"]
    return row


async def measure_trainer(kind: str, model: dict, *, device: str, reps: int, seed: int = 0,
                          say: Callable[[str], None] = lambda _: None) -> dict:
    """``kind``'s rows at ``model`` (a :class:`colo.apps.bench.BenchModel` as a dict: its
    ``name``, ``config``, ``engine_dtype`` and ``bucket_mib``): see the module docstring."""
    import torch
    from colo.apps.demo_setup import LOGIT_TOLERANCE, LOGIT_TOLERANCES, make_verifier
    from colo.engine.reference.client import EngineClient
    from colo.engine.reference.weights import expected_hf_specs
    from colo.trainers import build
    from colo.trainers.models import demo_config
    from colo.transports import make_transport

    if kind == "megatron":
        import megatron.core  # noqa: F401 - before any memory saver exists (its import sets the hook mode)
    name, bucket_bytes = model["name"], int(model["bucket_mib"] * 2**20)
    config = demo_config(**model["config"])
    cuda = device == "cuda"
    engine_dtype = getattr(torch, model["engine_dtype"])
    specs = expected_hf_specs(config, engine_dtype)
    params = sum(s.nbytes // engine_dtype.itemsize for s in specs)
    engine_bytes = sum(s.nbytes for s in specs)
    engine = await EngineClient.spawn(engine_build(config, model["engine_dtype"], device))
    trainer = None
    try:
        optimizer, why = True, "the CPU: host memory"
        if cuda:
            free, _ = torch.cuda.mem_get_info()
            # the engine is up, so its weights are already out of ``free``: the trainer's own bf16
            # weights are the engine's bytes
            optimizer, why = optimizer_fits(params, engine_bytes, 0, free)
        say(f"{kind} at {name}: building (optimizer state {why})")
        t0 = time.perf_counter()
        trainer, _saver = build(kind, model_config=config, seed=seed, engine_dtype=model["engine_dtype"],
                                device=device, optimizer_state=optimizer)
        build_s = time.perf_counter() - t0
        tags = ["weights", "optimizer"] if optimizer else ["weights"]
        tag_bytes = {t: b for t, b in trainer.tag_bytes().items() if t in tags}
        param_dtype = str(next(trainer.model.parameters()).dtype).removeprefix("torch.")
        clock = _Clock(cuda)
        transport = make_transport("packed")
        tolerance = LOGIT_TOLERANCES.get(name, LOGIT_TOLERANCE)  # bf16 rounding adds up over depth and width
        verifier = make_verifier(trainer, engine, config, model["engine_dtype"], seed, tolerance)
        rows = []
        # untimed: each process compiles the checksum kernel on its first digest
        await engine.digest()
        await trainer.compute(trainer.sent_digest, True)
        try:
            for plan in PLANS[device]:
                say(f"{kind} at {name}: {plan}")
                # two warm-ups: after the last plan's verified cycles, colo's engine client still
                # asks the first load's end for a digest (it expects the next verify), and the
                # engine sums the load after one it was asked at; nobody reads either, and the
                # eighteenth session's first measured sync-first cycle was that summed load
                plain = [await _cycle(plan, trainer, engine, transport, tags, clock, i, bucket_bytes, None)
                         for i in range(WARMUPS + reps)][WARMUPS:]
                live = engine.capabilities.digest_live
                verified = [await _cycle(plan, trainer, engine, transport, tags, clock, i, bucket_bytes, verifier,
                                         probe_now=i == 0 or not live)
                            for i in range(reps)]
                rows.append(_summary(plan, plain, verified))
                if os.environ.get(PROFILE_ENV):  # after the rows: the profiler's own cost is in no figure
                    where = os.path.join(os.environ[PROFILE_ENV], f"sync-{kind}-{name}-{plan}")
                    os.makedirs(os.environ[PROFILE_ENV], exist_ok=True)
                    await _cycle(plan, trainer, engine, transport, tags, clock, WARMUPS + reps, bucket_bytes, None,
                                 profile_to=where)
                    say(f"{kind} at {name}: {plan}: one sync profiled in {where}.txt")
                if os.environ.get(PYPROFILE_ENV):
                    import cProfile

                    prof = cProfile.Profile()
                    for i in range(PYPROFILE_CYCLES):
                        await _cycle(plan, trainer, engine, transport, tags, clock, WARMUPS + reps + 1 + i,
                                     bucket_bytes, None, pyprofile=prof)
                    os.makedirs(os.environ[PYPROFILE_ENV], exist_ok=True)
                    where = os.path.join(os.environ[PYPROFILE_ENV], f"pysync-{kind}-{name}-{plan}.txt")
                    _pyprofile_write(prof, where, PYPROFILE_CYCLES)
                    say(f"{kind} at {name}: {plan}: {PYPROFILE_CYCLES} syncs under cProfile in {where}")
        finally:
            await transport.aclose()
        return {"trainer": kind, "model": name, "params": params, "param_dtype": param_dtype,
                "engine_dtype": model["engine_dtype"], "optimizer_state": optimizer, "optimizer_state_why": why,
                # the order the contract digest goes in (:mod:`colo.digest`): the trainer's
                "spec_names": [sp.name for sp in trainer.param_specs()], "tag_bytes": tag_bytes, "trainer_bytes": sum(tag_bytes.values()), "engine_weight_bytes": engine_bytes,
                "build_s": build_s, "bucket_mib": model["bucket_mib"], "probe_tolerance": tolerance, "reps": reps, "transport": "packed",
                "settle_s": _settle_s(), "pause_order": _pause_order(tags),
                "rows": rows}
    finally:
        if trainer is not None:
            trainer.close()
        await engine.aclose()


def measure_saver(nbytes: int, *, retain: bool, reps: int) -> dict:
    """torch_memory_saver's own CPU backup (``enable_cpu_backup``) of one ``nbytes`` region:
    pause (device -> its host backup, the device pages released) and resume, each timed to
    the device's completion; ``retain``: the backup kept between pauses (colo's setting)
    or made anew on every pause (torch_memory_saver's default)."""
    import torch

    from colo.device.cuda_memory import Saver

    saver = Saver(retain_cpu_backup=retain)
    with saver.region("bench.saver", cpu_backup=True):
        x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    x.random_(0, 255)
    want = int(x[:: max(1, nbytes // 4096)].sum())
    pauses, resumes = [], []
    for _ in range(1 + reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        saver.pause("bench.saver")
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        saver.resume("bench.saver")
        torch.cuda.synchronize()
        pauses.append(t1 - t0)
        resumes.append(time.perf_counter() - t1)
    got = int(x[:: max(1, nbytes // 4096)].sum())
    if got != want:
        raise RuntimeError(f"torch_memory_saver's backup changed the region: sample sum {got} != {want}")
    import torch_memory_saver

    return {"bytes": nbytes, "retain_cpu_backup": retain, "reps": reps,
            "torch_memory_saver": getattr(torch_memory_saver, "__version__", None) or _dist_version(),
            "pause_s": statistics.median(pauses[1:]), "resume_s": statistics.median(resumes[1:]),
            "pause_s_all": pauses[1:], "resume_s_all": resumes[1:]}


def _dist_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    for name in ("torch-memory-saver", "torch_memory_saver"):
        try:
            return version(name)
        except PackageNotFoundError:
            pass
    return None


# -- the parent: one child per trainer --------------------------------------------------------

def _run_child(what: str, args: dict, say: Callable[[str], None]) -> dict:
    """``python -m colo.apps.bench_trainers what`` in a process of its own; its JSON, or an
    ``error`` with the end of what it printed."""
    with tempfile.TemporaryDirectory(prefix="colo-bench-trainer-") as d:
        out, log = os.path.join(d, "out.json"), os.path.join(d, "log")
        with open(log, "w", encoding="utf-8") as fh:
            try:
                proc = subprocess.run([sys.executable, "-m", "colo.apps.bench_trainers", what, json.dumps(args), out],
                                      stdout=fh, stderr=subprocess.STDOUT, timeout=CHILD_TIMEOUT_S)
                code: int | str = proc.returncode
            except subprocess.TimeoutExpired:
                code = f"timeout after {CHILD_TIMEOUT_S} s"
        if code == 0 and os.path.exists(out):
            with open(out, encoding="utf-8") as fh:
                return json.load(fh)
        with open(log, encoding="utf-8", errors="replace") as fh:
            tail = fh.read()[-2000:]
        say(f"{what} {args.get('kind', '')} failed ({code}): {tail.strip().splitlines()[-1] if tail.strip() else ''}")
        return {"error": f"exit {code}", "log_tail": tail, **{k: v for k, v in args.items() if k != "model"}}


def against_limits(entry: dict, limits: dict, device: str) -> dict:
    """A trainer's rows over the link limits of the same run: each sync over its floor (its bytes
    over pinned host->device for ``offload-first``, over one device copy for ``sync-first``;
    the host memcpy on a CPU), verification over the sync, the trainer's pause and onload
    over pinned device->host and host->device."""
    if "error" in entry:
        return entry
    trainer_bytes = entry["trainer_bytes"]
    for row in entry["rows"]:
        if device == "cuda":
            if row["plan"] == "offload-first":
                rate, what = limits["pinned_h2d_GBps"], "payload / pinned host->device"
            else:
                rate, what = limits["d2d_copy_GBps_read_plus_write"] / 2, "payload / one device copy"
        else:
            rate, what = limits["memcpy_GBps"], "payload / host memcpy"
        row["floor_s"], row["floor_is"] = row["bytes"] / rate / 1e9, what
        row["sync_over_floor"] = row["sync_s"] / row["floor_s"]
        registered = limits.get("registered_shm_h2d_GBps") if device == "cuda" else None
        if registered and row["plan"] == "offload-first" and row.get("buckets") == 1:
            # one request out of the trainer's shared pinned backup (a registered /dev/shm
            # segment): beside the floor, the rate of the memory it reads, measured the same run
            row["sync_over_registered_shm_h2d"] = row["sync_s"] / (row["bytes"] / registered / 1e9)
        if row.get("verify_s") is not None:
            row["verify_of_sync"] = row["verify_s"] / row["sync_s"]
            row["verify_adds_of_sync"] = row["verify_adds_s"] / row["sync_s"]  # the target: <= 0.05
        steps = row["step_s"]
        rates = {}
        for step, link, key in (("trainer_pause_s", "pinned device->host", "pinned_d2h_GBps"),
                                ("trainer_onload_s", "pinned host->device", "pinned_h2d_GBps")):
            if device == "cuda" and steps.get(step):
                got = trainer_bytes / steps[step] / 1e9
                rates[step.removesuffix("_s")] = {"bytes": trainer_bytes, "GBps": got, "link": link,
                                                  "of_link": got / limits[key]}
                # the pause's each tag, and its copy alone where its pauser timed it (the rest of the
                # tag's time: waiting for the device, freeing the memory). Not the onload's: the flat
                # weights' resume queues its copy, which the next tag's resume then waits behind
                parts = row.get("trainer_pause_parts_s", {}) if step == "trainer_pause_s" else {}
                for tag, nbytes in entry.get("tag_bytes", {}).items():
                    for name in (tag, f"{tag}.copy"):
                        if parts.get(name):
                            got = nbytes / parts[name] / 1e9
                            rates[f"{step.removesuffix('_s')}:{name}"] = {
                                "bytes": nbytes, "GBps": got, "link": link, "of_link": got / limits[key]}
        row["trainer_rates"] = rates
    return entry


def trainer_rows(models: Sequence[Any], trainers: Sequence[str], *, device: str, reps: int | None,
                 say: Callable[[str], None] = lambda _: None,
                 each: Callable[[dict], None] = lambda _: None) -> list[dict]:
    """Every trainer at every model, each in a child process (unset ``reps``: the model's own);
    ``each(entry)`` as each one's entry is done."""
    out = []
    for model in models:
        for kind in trainers:
            entry = _run_child("trainer", {"kind": kind, "model": dataclasses.asdict(model), "device": device,
                                           "reps": reps or model.repeat}, say)
            entry.setdefault("trainer", kind)
            entry.setdefault("model", model.name)
            out.append(entry)
            each(entry)
            for r in entry.get("rows", []):
                say(f"{model.name} {kind:8s} {r['plan']:13s} sync {r['sync_s'] * 1e3:8.1f} ms  "
                    f"verify {r.get('verify_s', float('nan')) * 1e3:7.1f} ms  buckets {r['buckets']}")
    return out


def saver_rows(nbytes: Sequence[int], *, reps: int, say: Callable[[str], None] = lambda _: None) -> list[dict]:
    """torch_memory_saver's CPU backup over each size, retained (colo's) and not (its default)."""
    out = []
    for n in nbytes:
        for retain in (True, False):
            entry = _run_child("saver", {"bytes": n, "retain": retain, "reps": reps}, say)
            out.append(entry)
            if "error" not in entry:
                say(f"torch_memory_saver cpu backup {n / 2**30:.2f} GiB retain={retain}: pause "
                    f"{entry['pause_s'] * 1e3:.0f} ms, resume {entry['resume_s'] * 1e3:.0f} ms")
    return out


def saver_against_limits(entry: dict, limits: dict) -> dict:
    if "error" in entry:
        return entry
    n = entry["bytes"]
    entry["pause_of_link"] = n / entry["pause_s"] / 1e9 / limits["pinned_d2h_GBps"]
    entry["resume_of_link"] = n / entry["resume_s"] / 1e9 / limits["pinned_h2d_GBps"]
    return entry


def table(entries: Sequence[dict], savers: Sequence[dict] = ()) -> str:
    """The README's table of the real trainers: one line per trainer, model and plan."""
    lines = ["| model | trainer | plan | sync ms | of floor | verify ms (adds of sync) | trainer pause / onload of link "
             "| engine release / wake weights / wake KV ms | optimizer state |",
             "|---|---|---|---:|---:|---:|---|---|---|"]
    for e in entries:
        if "error" in e:
            lines.append(f"| {e.get('model')} | {e.get('trainer')} | - | FAILED ({e['error']}) | | | | | |")
            continue
        for r in e["rows"]:
            s, rates = r["step_s"], r.get("trainer_rates", {})
            pause = rates.get("trainer_pause", {}).get("of_link")
            onload = rates.get("trainer_onload", {}).get("of_link")
            link = "-" if pause is None else f"{pause:.2f} / {onload:.2f}"
            verify = "-" if r.get("verify_s") is None else f"{r['verify_s'] * 1e3:.1f} ({r['verify_adds_of_sync']:.2f})"
            eng = " / ".join(f"{s[k] * 1e3:.1f}" for k in ("engine_release_s", "engine_wake_weights_s",
                                                          "engine_wake_kv_s"))
            floor = f"{r['sync_over_floor']:.2f}"
            if r.get("sync_over_registered_shm_h2d") is not None:
                floor += f" ({r['sync_over_registered_shm_h2d']:.2f} of the shm's)"
            lines.append(f"| {e['model']} | {e['trainer']} | {r['plan']} | {r['sync_s'] * 1e3:.1f} "
                         f"| {floor} | {verify} | {link} | {eng} "
                         f"| {'yes' if e['optimizer_state'] else 'no'} |")
    for v in savers:
        if "error" in v:
            continue
        lines.append(f"\ntorch_memory_saver CPU backup, {v['bytes'] / 2**30:.2f} GiB, retain_cpu_backup="
                     f"{v['retain_cpu_backup']}: pause {v['pause_s'] * 1e3:.0f} ms ({v['pause_of_link']:.2f} of "
                     f"pinned device->host), resume {v['resume_s'] * 1e3:.0f} ms ({v['resume_of_link']:.2f} of "
                     "pinned host->device)")
    return "\n".join(lines)


def _child(argv: Sequence[str]) -> int:
    import anyio

    what, args, out = argv
    args = json.loads(args)

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if what == "trainer":
        result = anyio.run(lambda: measure_trainer(args["kind"], args["model"], device=args["device"],
                                                   reps=args["reps"], say=say))
    elif what == "saver":
        result = measure_saver(args["bytes"], retain=args["retain"], reps=args["reps"])
    else:
        raise SystemExit(f"bench_trainers: unknown child {what!r}; expected trainer or saver")
    with open(out, "w", encoding="utf-8") as fh:
        json.dump(result, fh)
    from colo.device.cuda_memory import exit_past_the_saver

    return exit_past_the_saver(0)


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
