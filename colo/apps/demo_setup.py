"""What both demo runs share: the configuration, the simulated device, the budget
check, the verification of a sync, and what a run reports.

``colo demo`` runs the one-rank loop (:mod:`colo.apps.demo`) or the N-rank one
(:mod:`colo.apps.demo_multi`); both build on these pieces, and neither imports
the other's run.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from colo.core.config import MIN_BUCKET_MIB, MIN_PHASE_DEADLINE_S
from colo.core.errors import UsageError
from colo.core.memory import GiB, MiB, MemoryLedger, fmt_bytes
from colo.core.phases import PLANS
from colo.engine import ENGINES
from colo.offline.summary import PhaseSummary
from colo.transports import REGISTRY as TRANSPORTS
from colo.verification import (LOGIT_TOLERANCE, LOGPROB_TOLERANCE, PROBE_COLUMNS, make_verifier,  # noqa: F401
                               probe_batch, probe_columns, trainer_digest)


#: the most ranks ``--gpus`` starts (8 GPUs of one host)
MAX_GPUS = 8
#: the one fault a multi-rank demo injects (more kinds need injection inside the workers)
MULTI_FAULTS = ("kill-engine@sync",)
#: engines that died on their own (not an injected fault: killed or stopped from outside) a run
#: replaces before it gives up
MAX_ENGINE_DEATHS = 3


def engine_died(err: BaseException | None) -> bool:
    """``err`` is an engine's death (an engine rank's too, as its worker reported it)."""
    from colo.core.errors import EngineDied

    return isinstance(err, EngineDied) or isinstance(getattr(err, "cause", None), EngineDied)

#: who starts the ranks: local worker processes, or Ray actors (``colo.ranks.ray_launcher``)
LAUNCHERS = ("process", "ray")
#: Simulated always-resident device memory on the CPU (the CUDA context,
#: communicator buffers, allocator cache of a real GPU): a parameter of the
#: simulation, not a measurement.
CPU_RESERVED_MIB = 32
CPU_DEFAULT_GIB = 0.25
#: What the simulated trainer leaves on the device after its first step (a real
#: trainer's allocator cache and communicator buffers): R grows after the
#: engine started, which is what makes engine_wake_kv the phase that binds.
CPU_TRAINER_LEFTOVER_MIB = 8
#: The same bound for a larger demo size: bf16 rounding adds up over depth. Measured
#: on the CPU for qwen2-1.5b (28 layers, random weights, seed 0): 0.036 of the
#: largest logit. The digest check stays exact whatever the size.
LOGIT_TOLERANCES = {"demo": LOGIT_TOLERANCE, "qwen2-1.5b": 0.06,
                    # colo bench's model names too (colo.apps.bench_trainers). Qwen2-7B's shapes
                    # (28 layers of hidden 3584, random weights, seed 0): 0.043 (hf) and 0.050
                    # (megatron) of the largest logit measured on an H100, bf16 engine against
                    # bf16 trainers, with every digest equal; a misplaced tensor moves logits by
                    # the order of the logits themselves
                    "qwen2-1b": 0.06, "qwen2-7b": 0.1,
                    # a user's checkpoint (``--checkpoint``): its depth and weights are its own, so the
                    # loosest bound measured above (the digest check stays exact)
                    "checkpoint": 0.1}
#: The same bound where the engine and the trainer both compute in float32 (the CPU demo's
#: default): only float32 rounding in another order separates them (fused q/k/v and gate/up, the
#: KV pool's layout): 0 of the largest logit on the demo's probe at seed 0, so a bound 30 times
#: tighter than bfloat16's still leaves room for depth, and a misplaced tensor is far beyond it.
FP32_LOGIT_TOLERANCE = 1e-3


def logit_tolerance(cfg: DemoConfig) -> float:
    """The probe's bound for ``cfg``'s engine against its trainer (see ``LOGIT_TOLERANCES``)."""
    return cfg.logit_tolerance


#: the largest bucket (1 TiB): beyond it a size is a typo, and 1e308 MiB overflows every byte count
MAX_BUCKET_MIB = float(1 << 20)


@dataclass
class SimulatedDevice(MemoryLedger):
    """The CPU's stand-in for a GPU: a budget, a fixed R, and what the trainer left behind."""

    leftover: Callable[[], int] = lambda: 0
    base_reserved: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        self.base_reserved = self.reserved_bytes

    def observe(self) -> None:
        self.reserved_bytes = self.base_reserved + self.leftover()
        self._bump_peak()


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    device: str = "cpu"
    #: enough for the reward to rise well above chance with the defaults (0.14 -> 0.64 over the
    #: first and last 5 steps at seed 0): ``colo demo`` shows learning, not only the handoff
    steps: int = 20
    plan: str = "offload-first"
    #: None: the engine's default (its registry entry's first transport: packed, or sglang for SGLang)
    transport: str | None = None
    trainer: str = "hf"
    #: the demo's size (``colo.trainers.models.DEMO_MODELS``): ``demo`` (tiny) or ``qwen2-1.5b``
    model: str = "demo"
    #: a local Hugging Face checkpoint directory to train instead of a demo size (an
    #: architecture of ``colo.models.arch``); checked whole before anything starts
    checkpoint: str | None = None
    bucket_mib: float = 1.0
    mem_fraction_static: float = 0.8
    device_mem_gib: float | None = None
    reserved_mib: float = CPU_RESERVED_MIB
    trainer_leftover_mib: float = CPU_TRAINER_LEFTOVER_MIB
    #: the engine process's own CUDA_VISIBLE_DEVICES (a GPU UUID or index list)
    engine_visible_devices: str | None = None
    trace: str | None = None
    seed: int = 0
    #: the engine's dtype; None: the engine's default on the device (its registry entry's first:
    #: bfloat16 on a GPU, float32 on a CPU, for colo's engine because torch's bfloat16 matmuls
    #: are several times slower than float32 ones on a CPU without bfloat16 instructions, for
    #: vLLM because its bfloat16 CPU kernels hit an illegal instruction on short prompts there)
    engine_dtype: str | None = None
    #: the trainer's parameters' dtype; None: the engine's on a GPU (bf16 parameters, fp32 master
    #: weights in the optimizer, the one-copy sync for the hf trainer), float32 on a CPU
    trainer_dtype: str | None = None
    #: the rollout engine, by its name in :data:`colo.engine.ENGINES`: ``colo`` (colo's own, a
    #: process of its own), ``vllm`` (a real vLLM), ``sglang`` (SGLang in this process)
    engine: str = "colo"
    #: vLLM in its own engine-core and worker processes (else all in this process): the engine
    #: option ``processes``
    vllm_processes: bool = False
    #: with ``gpus`` N: how the engine spans the ranks (:data:`colo.engine.LAYOUTS`): ``replicas``
    #: (a whole engine per rank) or ``tp`` (one engine of TP=N); None: the engine's default
    engine_layout: str | None = None
    batch: int = 32
    prompt_len: int = 8
    new_tokens: int = 24
    #: ``KIND@PHASE`` (see :mod:`colo.testing.faults`): fail that phase once, then recover
    fault: str | None = None
    #: the faulted phase's deadline for a ``deadline`` fault
    fault_deadline_s: float = 30.0
    #: inject at the first occurrence of the phase at this step or later
    fault_step: int = 0
    #: every phase's deadline (``SchedulerConfig.phase_deadline_s``): a hung phase fails after it
    phase_deadline_s: float = 600.0
    #: ranks, one process per GPU (``colo.apps.demo_multi``); 1 is the one-process demo
    gpus: int = 1
    #: who starts the ranks of ``--gpus N``: ``process`` (local worker processes) or ``ray``
    #: (actors in a placement group, one bundle per GPU)
    launcher: str = "process"
    #: the Ray cluster to join (``ray start --head`` prints it); ``None``: a local one
    address: str | None = None
    #: which syncs are verified (the engine's digest against the trainer's, and the probe
    #: logits): ``every`` (the default), ``first`` or ``none``; ``verify_s`` in the trace
    verify: str = "every"
    #: where the engine processes write their own log lines (JSON): ``None`` beside the trace
    #: (``<trace>.engine.log``, a rank's ``<trace>.rank<r>.engine.log``), ``"-"`` the console
    engine_log: str | None = None
    #: train only a LoRA adapter of this rank (:mod:`colo.trainers.lora`) and sync the adapter
    #: (``SchedulerConfig.sync_target == "adapter"``); None: the whole model
    lora_rank: int | None = None
    #: adapter versions the engine keeps loaded, the serving one included
    keep_adapters: int = 2

    @property
    def sync_target(self) -> str:
        """What a sync moves (:data:`colo.core.phases.SYNC_TARGETS`)."""
        return "weights" if self.lora_rank is None else "adapter"

    def __post_init__(self) -> None:
        if not isinstance(self.engine, str) or self.engine not in ENGINES:
            raise ValueError(f"--engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        entry = self.engine_entry
        if self.engine_dtype is None and entry.default_dtype(self.device) is not None:
            object.__setattr__(self, "engine_dtype", entry.default_dtype(self.device))
        if self.transport is None:
            object.__setattr__(self, "transport", entry.takes_transports()[0])
        if self.device_mem_gib is None and self.device == "cpu" and entry.cpu_device_gib is not None:
            # an engine whose memory the demo's default does not hold (vLLM on a CPU holds its KV
            # cache, VLLM_CPU_KVCACHE_SPACE, whether asleep or not)
            object.__setattr__(self, "device_mem_gib", entry.cpu_device_gib)
        if self.plan not in PLANS:
            raise ValueError(f"plan must be one of {', '.join(PLANS)}, got {self.plan!r}")
        from colo.trainers import BUILDERS

        if self.trainer_dtype not in (None, "float32", "bfloat16"):
            raise ValueError(f"--trainer-dtype must be float32 or bfloat16, got {self.trainer_dtype!r}")
        if self.trainer not in BUILDERS:
            raise ValueError(f"trainer must be one of {', '.join(BUILDERS)}, got {self.trainer!r}")
        from colo.trainers.models import DEMO_MODELS

        if self.model not in DEMO_MODELS:
            raise ValueError(f"model must be one of {', '.join(DEMO_MODELS)}, got {self.model!r}")
        self._check_checkpoint()
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {self.transport!r}")
        for name in ("steps", "batch", "prompt_len", "new_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        for name in ("bucket_mib", "mem_fraction_static", "device_mem_gib", "reserved_mib", "trainer_leftover_mib",
                     "fault_deadline_s"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
        if not self.bucket_mib >= MIN_BUCKET_MIB:
            raise ValueError(f"bucket size must be at least {MIN_BUCKET_MIB:g} MiB, got {self.bucket_mib:g}")
        if self.bucket_mib > MAX_BUCKET_MIB:
            raise ValueError(f"bucket size must be at most {int(MAX_BUCKET_MIB)} MiB, got {self.bucket_mib:g}")
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        if self.device_mem_gib is not None and not self.device_mem_gib > 0:
            raise ValueError(f"device memory must be > 0 GiB, got {self.device_mem_gib}")
        if self.device_mem_gib is not None and self.device == "cuda":
            raise ValueError("--device-mem-gib sizes the simulated CPU device; on cuda the GPU's size is used")
        if not self.reserved_mib >= 0:
            raise ValueError(f"reserved memory must be >= 0 MiB, got {self.reserved_mib}")
        if not self.trainer_leftover_mib >= 0:
            raise ValueError(f"trainer leftover must be >= 0 MiB, got {self.trainer_leftover_mib}")
        d = self.phase_deadline_s
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not (d >= MIN_PHASE_DEADLINE_S
                                                                         and math.isfinite(d)):
            raise ValueError(f"--phase-deadline must be a finite number of seconds of at least "
                             f"{MIN_PHASE_DEADLINE_S:g}, got {d!r}")
        if self.fault is not None:
            self.parsed_fault()  # raises ValueError naming the kinds and phases allowed
        from colo.core.config import VERIFY

        if self.verify not in VERIFY:
            raise ValueError(f"--verify must be one of {', '.join(VERIFY)}, got {self.verify!r}")
        if self.fault is not None and self.verify != "every":
            raise ValueError(f"--fault needs --verify every (a recovery is judged by the engine's digest "
                             f"after it), got --verify {self.verify}")
        self._check_gpus()
        self._check_lora()
        self._check_engine()
        self._check_paths()

    def _check_lora(self) -> None:
        from colo.models.lora import MAX_RANK

        for name, most in (("keep_adapters", 64), ("lora_rank", MAX_RANK)):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= most):
                raise ValueError(f"--{name.replace('_', '-')} must be an integer in [1, {most}], got {v!r}")
        if self.lora_rank is None:
            return
        from colo.trainers import LORA_BUILDERS

        if self.trainer not in LORA_BUILDERS:
            raise ValueError(f"--lora-rank trains a PEFT adapter on the {' or '.join(LORA_BUILDERS)} trainer, got "
                             f"--trainer {self.trainer}")
        if self.device != "cpu":
            raise ValueError(f"--lora-rank runs on the CPU so far (its trainer's GPU regions are not built), "
                             f"got --device {self.device}")
        if self.trainer_dtype not in (None, "float32"):
            raise ValueError(f"--lora-rank trains in float32 on the CPU, got --trainer-dtype {self.trainer_dtype}")

    def _check_paths(self) -> None:
        """The trace, and every file colo derives from it (a rank's trace, the engine's log beside
        it), follow :mod:`colo.trace.outputs`' rule, checked before anything starts: a new path or
        a regular file; a path colo derived is not a symbolic link either. A device given as the
        trace is refused with two ranks too, rather than files made beside it (/dev/full.rank0.jsonl)."""
        from colo.trace.outputs import output_path
        from colo.trace.writer import rank_path

        for flag, value in (("--trace", self.trace), ("--engine-log", self.engine_log)):
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{flag} is empty; expected a file path" + (", or - for the console"
                                                                            if flag == "--engine-log" else ""))
        output_path(self.trace_path, "--trace")
        if self.gpus > 1:
            for r in range(self.gpus):
                output_path(rank_path(self.trace_path, r, self.gpus), "trace", follow=False)
        for rank in (range(self.gpus) if self.gpus > 1 else [None]):
            log = self.engine_log_path(rank)
            derived = self.engine_log is None or rank is not None
            if log is not None:
                # a path the user named may be a link to a regular file; one colo derived may not
                output_path(log, "engine log" if derived else "--engine-log", follow=not derived)

    def _check_checkpoint(self) -> None:
        if self.checkpoint is None:
            return
        if not isinstance(self.checkpoint, str) or not self.checkpoint:
            raise ValueError(f"--checkpoint is empty; expected a checkpoint directory, got {self.checkpoint!r}")
        if self.model != "demo":
            raise ValueError(f"--checkpoint and --model {self.model} both name the model: give one")
        if self.gpus != 1:
            # each rank would have to read the directory (a Ray node may not see it): not built yet
            raise ValueError("--checkpoint drives one rank: --gpus N runs the demo's built-in model")
        from colo.models.checkpoint import inspect

        inspect(self.checkpoint)  # CheckpointError / UnsupportedArchitecture: both ValueErrors, one line

    def model_config(self) -> Any:
        """The transformers config of the model this run trains: the checkpoint's, or the demo size's."""
        from colo.trainers.models import checkpoint_config, demo_model_config

        if self.checkpoint is not None:
            return checkpoint_config(self.checkpoint)
        return demo_model_config(self.model)

    @property
    def logit_tolerance(self) -> float:
        """The probe's bound on |engine - trainer| logits, relative to the largest (see LOGIT_TOLERANCES):
        :data:`FP32_LOGIT_TOLERANCE` where both compute in float32."""
        trainer = self.trainer_dtype or ("float32" if self.device == "cpu" else self.engine_dtype)
        if self.engine_dtype == trainer == "float32":
            return FP32_LOGIT_TOLERANCE
        return LOGIT_TOLERANCES["checkpoint" if self.checkpoint is not None else self.model]

    @property
    def engine_entry(self) -> Any:
        """The engine's registry entry (:data:`colo.engine.ENGINES`)."""
        return ENGINES[self.engine]

    @property
    def engine_options(self) -> dict[str, Any]:
        """The engine options this run asks for (the entry's ``options``)."""
        return {"processes": self.vllm_processes}

    def _check_engine(self) -> None:
        """The engine's declared limits (:meth:`colo.engine.EngineEntry.check`), once: its devices,
        dtypes, transports, options, layouts of N ranks, whether a fault can kill it."""
        from colo.testing.faults import kills_engine

        self.engine_entry.check(device=self.device, dtype=self.engine_dtype, transport=self.transport,
                                gpus=self.gpus, launcher=self.launcher, options=self.engine_options,
                                model_config=self.model_config() if self.gpus > 1 else None,
                                kill=kills_engine(self.parsed_fault()),
                                visible_devices=self.engine_visible_devices is not None, layout=self.engine_layout,
                                lora=self.lora_rank is not None)

    def _check_gpus(self) -> None:
        g = self.gpus
        if isinstance(g, bool) or not isinstance(g, int) or not 1 <= g <= MAX_GPUS:
            raise ValueError(f"--gpus must be an integer in [1, {MAX_GPUS}], got {g!r}")
        if self.launcher not in LAUNCHERS:
            raise ValueError(f"--launcher must be one of {', '.join(LAUNCHERS)}, got {self.launcher!r}")
        if self.launcher != "process" and g == 1:
            raise ValueError(f"--launcher {self.launcher} starts ranks: give --gpus N with N >= 2")
        if self.address is not None and self.launcher != "ray":
            raise ValueError("--address names a Ray cluster: it needs --launcher ray")
        if self.address is not None:
            from colo.ranks.address import parse_address

            parse_address(self.address)  # the form only: whether it answers is known at start
        if g == 1 and self.engine_layout is not None:
            raise ValueError(f"--engine-layout says how an engine spans --gpus N ranks (N >= 2), got --gpus {g}")
        if g > 1 and self.engine_visible_devices is not None:
            raise ValueError("--engine-visible-devices is for one GPU; with --gpus N rank r runs on GPU r")
        if g > 1 and self.fault is not None and self.fault not in MULTI_FAULTS:
            raise ValueError(f"--gpus {g} injects only {', '.join(MULTI_FAULTS)}, got --fault {self.fault}")
        if g > 1 and self.device == "cuda" and g > torch.cuda.device_count():
            raise ValueError(f"--gpus {g}: this machine has {torch.cuda.device_count()} visible CUDA device(s)")

    def parsed_fault(self) -> Any:
        from colo.testing.faults import Fault

        if self.fault is None:
            return None
        return Fault.parse(self.fault, step=self.fault_step, deadline_s=self.fault_deadline_s)

    @property
    def bucket_bytes(self) -> int:
        return max(1, int(self.bucket_mib * MiB))

    @property
    def trace_path(self) -> Path:
        return Path(self.trace or f"traces/demo-{self.plan}.jsonl")

    def engine_log_path(self, rank: int | None = None) -> str | None:
        """The engine's (or engine rank ``rank``'s) log file; None: its lines go to stderr."""
        if self.engine_log == "-":
            return None
        if self.engine_log is None and self.trace_path.exists() and not self.trace_path.is_file():
            return None  # a trace on a device or a pipe: nothing is made beside it
        base = Path(self.engine_log) if self.engine_log else self.trace_path.with_suffix("")
        suffix = ".engine.log" if self.engine_log is None else ""
        if rank is not None:
            return f"{base}.rank{rank}{suffix}"
        return f"{base}{suffix}"

    def start_engine_logs(self) -> None:
        """Empty this run's engine logs (an engine appends: a replaced one writes after the first),
        each asked for room first: a log that cannot be written (no room, no permission) is
        bad input said now, in one line, not an engine's traceback as it starts."""
        from colo.trace.writer import TRACE_ROOM_BYTES, _CANNOT_TELL

        for rank in (range(self.gpus) if self.gpus > 1 else [None]):
            path = self.engine_log_path(rank)
            if path is None or not (not os.path.exists(path) or os.path.isfile(path)):
                continue
            made = not os.path.exists(path)
            try:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
                try:
                    try:
                        os.posix_fallocate(fd, 0, TRACE_ROOM_BYTES)
                    except OSError as e:
                        if e.errno not in _CANNOT_TELL:
                            raise
                    os.ftruncate(fd, 0)
                finally:
                    os.close(fd)
            except OSError as e:
                if made:  # a refused start leaves nothing
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                raise UsageError(f"cannot write the engine log {path}: {e.strerror or e} (checked before the "
                                 f"engine starts: a log needs room for {TRACE_ROOM_BYTES >> 10} KiB at least)") \
                    from None


def device_budget(cfg: DemoConfig) -> tuple[int, int, str]:
    """Total bytes, reserved bytes, device name."""
    if cfg.device == "cuda":
        free, total = torch.cuda.mem_get_info()
        return total, total - free, torch.cuda.get_device_name()
    total = int((cfg.device_mem_gib or CPU_DEFAULT_GIB) * GiB)
    reserved = int(cfg.reserved_mib * MiB)
    if reserved >= total:
        raise ValueError(f"reserved memory {fmt_bytes(reserved)} leaves nothing of a {fmt_bytes(total)} device")
    return total, reserved, f"simulated {fmt_bytes(total)} (cpu)"


def check_fits(cfg: DemoConfig, model_config: Any) -> None:
    """Refuse, before anything starts, a device the engine cannot fit on: one too small for
    the run's reserved memory, or one the engine's own check refuses (its entry's ``fits``:
    colo's engine sizes its KV pool as SGLang does, and a pool that cannot exist is bad input,
    not an engine that dies while starting). An engine without one sizes itself and says
    so when it cannot (vLLM)."""
    from colo.engine import load

    try:
        total, reserved, _ = device_budget(cfg)
    except ValueError as e:
        raise UsageError(f"--device-mem-gib {cfg.device_mem_gib:g} is too small for the engine: {e}") from None
    fits = cfg.engine_entry.fits
    if fits is None:
        return
    try:
        load(fits)(model_config, dtype=cfg.engine_dtype, total_bytes=total,
                   mem_fraction_static=cfg.mem_fraction_static)
    except ValueError as e:  # KVPoolTooSmall among them
        raise UsageError(f"--mem-fraction-static {cfg.mem_fraction_static:g} on a {fmt_bytes(total)} device: {e}") \
            from None


#: transports whose CPU buckets are /dev/shm segments: two of them in flight (the packed
#: transport's two slots, the per-tensor ipc transport's two buckets)
SHM_STAGING = ("packed", "ipc")


def check_shm_staging(cfg: DemoConfig, trainer: Any) -> None:
    """Refuse, before the engine starts, a run whose sync cannot have its staging buckets in
    /dev/shm: two of at most the bucket size (or the whole model, if smaller). A trainer
    whose weights are one flat shared buffer (one rank, the engine's dtype: the one-copy
    sync) stages nothing, and its buffer was made already, so /dev/shm had room for it."""
    from colo.core.errors import SharedMemoryFull
    from colo.dtypes import as_dtype
    from colo.proc.handles import SHM_DIR, shm_room

    if cfg.device != "cpu" or cfg.transport not in SHM_STAGING or getattr(trainer, "flat_weights", None) is not None:
        return
    size = as_dtype(cfg.engine_dtype).itemsize
    model = sum(p.numel() for p in trainer.model.parameters()) * size
    need = 2 * min(cfg.bucket_bytes, model)
    room = shm_room()
    if need > room:
        raise SharedMemoryFull(where=SHM_DIR, what=f"the {cfg.transport} transport's two staging buckets", need=need,
                               room=room, before_start=True)


@dataclass
class Recovery:
    """What happened to one injected fault, and what the demo checked after it."""

    fault: str
    phase: str
    step: int
    cause: str
    #: the refusals a stale engine must give: the scheduler's and the engine's own
    rollout_refused_by_scheduler: str = ""
    rollout_refused_by_engine: str = ""
    #: the engine's own weight version after the failure (None: stale)
    engine_weight_version_after_failure: int | None = -1
    staging_bytes_after_failure: int = -1
    segments_after_failure: list[str] = field(default_factory=list)
    trainer_digest_at_fault: str = ""
    trainer_digest_after_failure: str = ""
    engine_replaced: bool = False
    old_engine_pid: int | None = None
    new_engine_pid: int | None = None
    engine_digest_after_recovery: str = ""
    recovered: bool = False

    @property
    def trainer_intact(self) -> bool:
        return bool(self.trainer_digest_at_fault) and self.trainer_digest_at_fault == self.trainer_digest_after_failure

    def lines(self) -> list[str]:
        out = [f"fault {self.fault} injected at step {self.step}: phase {self.phase} failed: {self.cause}",
               f"  after the failure: engine weight version {self.engine_weight_version_after_failure}, rollout refused ({self.rollout_refused_by_engine or '-'}); "
               f"staging {self.staging_bytes_after_failure} B, shared-memory segments "
               f"{len(self.segments_after_failure)}; trainer weights "
               + ("intact" if self.trainer_intact else "CHANGED" if self.trainer_digest_at_fault
                  else "not compared (no injected fault)")]
        if self.engine_replaced:
            out.append(f"  engine process {self.old_engine_pid} died; started engine process {self.new_engine_pid}")
        if self.recovered:
            out.append(f"  recovered: engine digest {self.engine_digest_after_recovery[:16]} equals the trainer's")
        else:
            out.append("  recovery FAILED")
        return out


@dataclass
class DemoOutcome:
    rewards: list[float]
    summary: PhaseSummary
    trace_path: Path
    error: BaseException | None = None
    recoveries: list[Recovery] = field(default_factory=list)
    #: expected_digest of the trainer's weights at the end of the run (None if it had none)
    trainer_digest: str | None = None
    #: the run failed before its first cycle (``error`` says why)
    failed_at_start: bool = False


class CycleSeeded:
    """The engine, rolling out by completed-cycle count rather than scheduler step.

    The scheduler's step also counts a cycle that failed and is run again; the
    rollout of the rerun must be the one the failed attempt drew, so that a run
    with a recovered fault trains on the same data as a run without one.
    """

    def __init__(self, engine: Any, cycle: Callable[[], int]):
        self._engine, self._cycle = engine, cycle

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate(self, step: int) -> Any:
        return await self._engine.generate(self._cycle())
