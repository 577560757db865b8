"""``colo demo``: a real colocated RL loop on a built-in small model.

The trainer (an HF Qwen2 policy with AdamW) lives in this process; the rollout
engine (colo's own fused-parameter implementation with a preallocated KV pool)
lives in a spawned process; weights travel through the chosen transport; the
scheduler drives the phases of the chosen plan and writes the trace. After
every sync the engine's digest must equal the trainer's and the engine's logits
on a fixed probe batch must match the trainer's: a mismatch fails the run.

The task is learnable on purpose: the reward is the share of completion tokens
drawn from a fixed eighth of the vocabulary, so the mean reward starts near
0.125 and rises as the policy learns.
"""

from __future__ import annotations

import functools
import math
import os
import signal
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import anyio
import torch

from colo.core.phases import PLANS
from colo.core.errors import EXIT_BAD_INPUT, EXIT_OK, UsageError, exit_code
from colo.transports import REGISTRY as TRANSPORTS
from colo.core.config import SchedulerConfig
from colo.engine.client import EngineError
from colo.core.errors import EngineDied
from colo.proc.handles import leftover_segments
from colo.proc.lifecycle import dir_prefix, sweep
from colo.core.invariants import InvariantViolation
from colo.core.memory import OWNERS_TAGS, GiB, MiB, MemoryLedger, fmt_bytes
from colo.core.phases import IllegalTransition, Phase
from colo.scheduler import Scheduler, describe
from colo.offline.summary import PhaseSummary
from colo.trace.writer import TraceWriter
from colo.core.errors import VerificationError
from colo.apps.demo_multi import LAUNCHERS, MULTI_FAULTS, MultiDemoRun

#: Simulated always-resident device memory on the CPU (the CUDA context,
#: communicator buffers, allocator cache of a real GPU): a parameter of the
#: simulation, not a measurement.
#: the most ranks ``--gpus`` starts (8 GPUs of one host)
MAX_GPUS = 8
CPU_RESERVED_MIB = 32
CPU_DEFAULT_GIB = 0.25
#: What the simulated trainer leaves on the device after its first step (a real
#: trainer's allocator cache and communicator buffers): R grows after the
#: engine started, which is what makes engine_wake_kv the phase that binds.
CPU_TRAINER_LEFTOVER_MIB = 8
#: Largest |engine − trainer| logit difference accepted on the probe batch,
#: relative to the largest trainer logit (bf16 engine against fp32 trainer).
LOGIT_TOLERANCE = 0.03
#: The same bound for a larger demo size: bf16 rounding adds up over depth. Measured
#: on the CPU for qwen2-1.5b (28 layers, random weights, seed 0): 0.036 of the
#: largest logit. The digest check stays exact whatever the size.
LOGIT_TOLERANCES = {"demo": LOGIT_TOLERANCE, "qwen2-1.5b": 0.06}
#: the largest bucket (1 TiB): beyond it a size is a typo, and 1e308 MiB overflows every byte count
MAX_BUCKET_MIB = float(1 << 20)
#: engines that died on their own (not an injected fault) a run replaces before it gives up
MAX_ENGINE_DEATHS = 3


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
    steps: int = 8
    plan: str = "offload-first"
    transport: str = "packed"
    trainer: str = "hf"
    #: the demo's size (``colo.trainers.models.DEMO_MODELS``): ``demo`` (tiny) or ``qwen2-1.5b``
    model: str = "demo"
    bucket_mib: float = 1.0
    mem_fraction_static: float = 0.8
    device_mem_gib: float | None = None
    reserved_mib: float = CPU_RESERVED_MIB
    trainer_leftover_mib: float = CPU_TRAINER_LEFTOVER_MIB
    #: the engine process's own CUDA_VISIBLE_DEVICES (a GPU UUID or index list)
    engine_visible_devices: str | None = None
    trace: str | None = None
    seed: int = 0
    engine_dtype: str = "bfloat16"
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

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if self.plan not in PLANS:
            raise ValueError(f"plan must be one of {', '.join(PLANS)}, got {self.plan!r}")
        from colo.trainers import BUILDERS

        if self.trainer not in BUILDERS:
            raise ValueError(f"trainer must be one of {', '.join(BUILDERS)}, got {self.trainer!r}")
        from colo.trainers.models import DEMO_MODELS

        if self.model not in DEMO_MODELS:
            raise ValueError(f"model must be one of {', '.join(DEMO_MODELS)}, got {self.model!r}")
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
        if not self.bucket_mib > 0:
            raise ValueError(f"bucket size must be > 0 MiB, got {self.bucket_mib}")
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
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not (d > 0 and math.isfinite(d)):
            raise ValueError(f"--phase-deadline must be a finite number of seconds > 0, got {d!r}")
        if self.fault is not None:
            self.parsed_fault()  # raises ValueError naming the kinds and phases allowed
        from colo.core.config import VERIFY

        if self.verify not in VERIFY:
            raise ValueError(f"--verify must be one of {', '.join(VERIFY)}, got {self.verify!r}")
        if self.fault is not None and self.verify != "every":
            raise ValueError(f"--fault needs --verify every (a recovery is judged by the engine's digest "
                             f"after it), got --verify {self.verify}")
        self._check_gpus()

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
        if g > 1 and self.engine_visible_devices is not None:
            raise ValueError("--engine-visible-devices is for one GPU; with --gpus N rank r runs on GPU r")
        if g > 1 and self.fault is not None and self.fault not in MULTI_FAULTS:
            raise ValueError(f"--gpus {g} injects only {', '.join(MULTI_FAULTS)}, got --fault {self.fault}")
        if g > 1 and self.device == "cuda" and g > torch.cuda.device_count():
            raise ValueError(f"--gpus {g}: this machine has {torch.cuda.device_count()} visible CUDA device(s)")
        if g > 1:
            from colo.engine.tp import TPLayout
            from colo.trainers.models import demo_model_config

            # a TP=g engine must split the heads evenly: refused before any process starts
            TPLayout.from_config(demo_model_config(self.model), tp_rank=0, tp_size=g)

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


class ReinforceTask:
    """Random prompts; reward = share of completion tokens in a fixed eighth of the vocabulary."""

    def __init__(self, vocab_size: int, *, batch: int, prompt_len: int, new_tokens: int, seed: int,
                 temperature: float = 1.0):
        self.vocab_size, self.batch, self.prompt_len = vocab_size, batch, prompt_len
        self.max_new_tokens, self.temperature, self._seed = new_tokens, temperature, seed

    def seed(self, step: int) -> int:
        return self._seed * 1_000_003 + step

    def prompts(self, step: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(self.seed(step) ^ 0x5EED)
        return torch.randint(0, self.vocab_size, (self.batch, self.prompt_len), generator=g).tolist()

    @staticmethod
    def rewarded(token: int) -> bool:
        return token % 8 == 0

    def rewards(self, prompts: list[list[int]], completions: list[list[int]]) -> list[float]:
        return [sum(self.rewarded(t) for t in c) / len(c) for c in completions]


def probe_batch(vocab_size: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed ^ 0xBEEF)
    return torch.randint(0, vocab_size, (2, 16), generator=g).tolist()


def make_verifier(trainer: Any, engine: Any, model_config: Any, dtype: str, seed: int,
                  tolerance: float = LOGIT_TOLERANCE):
    """``engine`` is the engine or a zero-argument callable returning the current one
    (the demo replaces an engine that died)."""
    from colo.engine.model import expected_digest

    probe = probe_batch(model_config.vocab_size, seed)
    current = engine if callable(engine) else (lambda: engine)

    async def verify(digests: list[str]) -> None:
        want = expected_digest(trainer.hf_state(), model_config, getattr(torch, dtype))
        for rank, digest in enumerate(digests):
            if digest != want:
                raise VerificationError(f"engine rank {rank} digest {digest[:16]} != trainer digest {want[:16]} "
                                        "after sync")
        got = torch.tensor(await current().logits(probe))
        ref = trainer.logits(probe)
        err = float((got - ref).abs().max())
        bound = tolerance * float(ref.abs().max())
        if not err <= bound:
            raise VerificationError(f"engine logits differ from the trainer's by {err:.4g} on the probe "
                                    f"batch (bound {bound:.4g})")

    return verify


def build_trainer(cfg: DemoConfig, model_config: Any) -> tuple[Any, Any]:
    from colo.trainers import build

    return build(cfg.trainer, model_config=model_config, seed=cfg.seed, engine_dtype=cfg.engine_dtype,
                 device=cfg.device)


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
    """Refuse, before anything starts, a device the engine cannot fit on.

    The engine sizes its KV pool as SGLang does (``KVPoolPlan``: total x
    mem_fraction_static - weights, at least one sequence of maximum length);
    the same numbers are known here from the model config, the engine dtype
    and the device budget, so a pool that cannot exist is bad input, not an
    engine that dies while starting."""
    from colo.dtypes import as_dtype
    from colo.engine.model import Dims, KVPoolPlan, WeightMap
    from colo.core.errors import KVPoolTooSmall

    try:
        total, reserved, _ = device_budget(cfg)
    except ValueError as e:
        raise UsageError(f"--device-mem-gib {cfg.device_mem_gib:g} is too small for the engine: {e}") from None
    dims = Dims.from_config(model_config)
    dtype = as_dtype(cfg.engine_dtype)
    try:
        KVPoolPlan(total_bytes=total, mem_fraction_static=cfg.mem_fraction_static,
                   weight_bytes=WeightMap.build(dims).nbytes(dtype), slot_bytes=dims.slot_bytes(dtype),
                   min_slots=dims.max_positions)
    except KVPoolTooSmall as e:
        raise UsageError(f"--mem-fraction-static {cfg.mem_fraction_static:g} on a {fmt_bytes(total)} device: {e}") \
            from None


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


def _refusal(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


async def run(cfg: DemoConfig, *, progress: bool = True,
              on_cycle: Callable[[int], None] | None = None) -> DemoOutcome:
    """The loop, as the phase list reads: set up, one cycle per step, report.

    ``on_cycle(n)`` is called after the n-th completed cycle (the soak measures there).
    """
    demo: Any = DemoRun(cfg) if cfg.gpus == 1 else MultiDemoRun(cfg, cfg.gpus)
    try:
        await demo.start()
        bar = _progress(cfg.steps, progress)
        try:
            async with demo.sched:
                while len(demo.rewards) < cfg.steps:
                    await demo.cycle()  # rollout ... engine_wake_kv; an injected fault is recovered
                    bar.set_postfix(reward=f"{demo.rewards[-1]:.3f}")
                    bar.update(1)
                    if on_cycle is not None:
                        on_cycle(len(demo.rewards))
                demo.check_fault_fired()
        except Exception as e:  # in the trace as phase.failed (or before it: at start-up)
            demo.error = e
        finally:
            bar.close()
    finally:
        await demo.close()
    return demo.outcome()


class _CycleSeeded:
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


class DemoRun:
    """Everything one demo run holds: trainer, engine processes, transport, ledger,
    trace, scheduler, and the audit of an injected fault."""

    def __init__(self, cfg: DemoConfig):
        from colo.trainers.models import demo_model_config

        self.cfg = cfg
        self.model_config = demo_model_config(cfg.model)
        self.fault = cfg.parsed_fault()
        self.summary = PhaseSummary()
        self.rewards: list[float] = []
        self.recoveries: list[Recovery] = []
        self.error: BaseException | None = None
        self.engines: list[Any] = []  # every engine process this run started, closed at the end
        self.trainer: Any = None
        self.saver: Any = None
        self.transport: Any = None
        # What a SIGKILLed run left (no cleanup ran there) goes first; this run's
        # dir carries this pid so that the next run can tell it from a live one.
        sweep()
        self.workdir = tempfile.mkdtemp(prefix=dir_prefix("demo"))
        self._at_fault: list[str] = []
        self.injector: Any = None
        self.final_digest: str | None = None

    # -- set-up ------------------------------------------------------------------
    async def start(self) -> None:
        from colo.transports import make_transport

        cfg = self.cfg
        check_fits(cfg, self.model_config)  # before the trainer is built or the engine spawned
        torch.manual_seed(cfg.seed)
        self.trainer, self.saver = build_trainer(cfg, self.model_config)
        if self.fault is not None:
            from colo.testing.faults import FaultInjector

            self.injector = FaultInjector(self.fault, on_fire=lambda: self._at_fault.append(self.trainer_digest()))
        self.task = ReinforceTask(self.model_config.vocab_size, batch=cfg.batch, prompt_len=cfg.prompt_len,
                                  new_tokens=cfg.new_tokens, seed=cfg.seed)
        self.total, self.reserved, self.device_name = device_budget(cfg)
        self.build = await self._engine_build()
        self.env = {"CUDA_VISIBLE_DEVICES": cfg.engine_visible_devices} if cfg.engine_visible_devices else None
        await self._spawn_engine(self.build)
        self.transport = make_transport(cfg.transport)
        self.sched = self._scheduler(self._ledger())

    async def _engine_build(self) -> dict:
        """The engine starts from the trainer's initial checkpoint (version 0), as
        SGLang starts from a model path."""
        from safetensors.torch import save_file

        ckpt = os.path.join(self.workdir, "init.safetensors")
        save_file({k: v.contiguous().cpu() for k, v in self.trainer.hf_state().items()}, ckpt)
        if self.saver is not None:
            # Colocated start: the trainer offloads before the engine starts, as
            # slime does, so the engine's KV pool can take its fraction.
            await self.trainer.offload(list(OWNERS_TAGS["trainer"]))
        cfg = self.cfg
        return {"config": self.model_config.to_dict(), "dtype": cfg.engine_dtype, "device": cfg.device,
                "total_bytes": self.total, "mem_fraction_static": cfg.mem_fraction_static, "checkpoint": ckpt,
                "memory": "saver" if self.saver is not None else "free",
                # if this process is killed outright, the engine removes the work dir as it goes
                "run_dir": self.workdir}

    async def _spawn_engine(self, build: dict) -> Any:
        from colo.engine.client import EngineClient

        engine = await EngineClient.spawn(build, task=self.task, env=self.env)
        self.engines.append(engine)
        return engine

    def _ledger(self) -> MemoryLedger:
        if self.cfg.device == "cuda":
            from colo.device.cuda_memory import cuda_ledger

            # R is what the device holds now beyond the engine's regions: both
            # CUDA contexts, the allocator caches.
            return cuda_ledger(accounted_bytes=sum(self.engines[0].tag_bytes().values()),
                               device_name=self.device_name)
        leftover = int(self.cfg.trainer_leftover_mib * MiB)
        return SimulatedDevice(total_bytes=self.total, reserved_bytes=self.reserved, device_kind="cpu",
                               device_name=self.device_name,
                               leftover=lambda: leftover if self.trainer.steps else 0)

    def _wrap_engine(self, engine: Any) -> Any:
        engine = _CycleSeeded(engine, lambda: len(self.rewards))
        return self.injector.wrap_engine(engine) if self.injector else engine

    def _scheduler(self, memory: MemoryLedger) -> Scheduler:
        cfg = self.cfg
        trace = TraceWriter(cfg.trace_path)
        trace.add_listener(self.summary.feed)
        trainer = self.injector.wrap_trainer(self.trainer) if self.injector else self.trainer
        sched = Scheduler(
            trainer, self._wrap_engine(self.engines[0]), memory, self.transport,
            config=SchedulerConfig(plan=cfg.plan, bucket_bytes=cfg.bucket_bytes,
                                   phase_deadline_s=cfg.phase_deadline_s,
                                   deadlines=self.fault.deadlines() if self.fault else {}, verify=cfg.verify),
            trace=trace, verify=make_verifier(self.trainer, lambda: sched.engine, self.model_config,
                                              cfg.engine_dtype, cfg.seed, LOGIT_TOLERANCES[cfg.model]),
            run_config={"demo": {k: v for k, v in asdict(cfg).items() if k != "trace"},
                        "mem_fraction_static": cfg.mem_fraction_static,
                        "model": {"params": self.trainer.num_params(), "engine_dtype": cfg.engine_dtype}})
        if self.injector:
            self.injector.attach(sched)
        return sched

    def trainer_digest(self) -> str:
        from colo.engine.model import expected_digest

        return expected_digest(self.trainer.hf_state(), self.model_config, getattr(torch, self.cfg.engine_dtype))

    # -- the cycle ---------------------------------------------------------------
    async def cycle(self) -> None:
        """One cycle of the plan; a cycle that failed on an injected fault is
        recovered from; it is run again (from rollout, with the same rollout
        seed) only if its train did not complete. A train that failed half-way
        left the trainer as it was before the step (PolicyTrainer._reinforce)."""
        while True:
            version = self.sched.trainer_version
            with anyio.CancelScope() as scope:  # a cancel fault cancels this scope
                if self.injector:
                    self.injector.scope = scope
                try:
                    await self.sched.cycle()
                except Exception:
                    if self.sched.phase is not Phase.FAILED:
                        raise  # refused before any phase started: nothing to recover
            if self.sched.phase is not Phase.FAILED:
                self.rewards.append(self.sched.last_rollout.reward)
                return
            err = self.sched.last_error
            if not self._recoverable(err):
                raise err if isinstance(err, Exception) else RuntimeError(describe(err))
            trained = self.sched.trainer_version > version
            reward = self.sched.last_rollout.reward if trained else None
            if not (await self.recover()).recovered:
                raise VerificationError("recovery did not restore the trainer's weights")
            if trained:
                # This cycle's train completed before the failure and the recovery
                # sync brought the engine to its weights: the cycle is done. Running
                # it again would train a second time, so --steps N would not mean N.
                self.rewards.append(reward)
                return

    def _recoverable(self, err: BaseException | None) -> bool:
        """An injected fault (once), or an engine that died of any cause (killed from
        outside, stopped and killed by the heartbeat) up to ``MAX_ENGINE_DEATHS``
        times. Any other failure nobody injected (a plan that does not fit) would
        recur every cycle."""
        if isinstance(err, EngineDied) or isinstance(getattr(err, "cause", None), EngineDied):
            return sum(r.engine_replaced for r in self.recoveries) < MAX_ENGINE_DEATHS
        return self.injector is not None and self.injector.fired and not self.recoveries

    def check_fault_fired(self) -> None:
        if self.injector is not None and not self.injector.fired:
            f = self.fault
            raise RuntimeError(f"fault {f} was never injected: no {f.phase} at step >= {f.step} in "
                               f"{self.cfg.steps} steps")

    # -- recovery and its audit ------------------------------------------------------
    async def recover(self) -> Recovery:
        """Fail safe, then back to a synced engine: check what a failure must leave
        behind, replace a dead engine, re-sync from the trainer's copy."""
        rec = self._audit_failure()
        self.recoveries.append(rec)
        try:  # a stale engine must never roll out: the scheduler refuses, writing nothing
            await self.sched.run_phase(Phase.ROLLOUT)
            raise RuntimeError("the scheduler allowed rollout after a failure")
        except (IllegalTransition, InvariantViolation) as e:
            rec.rollout_refused_by_scheduler = _refusal(e)
        await self._replace_dead_engine(rec)
        try:  # and the engine itself refuses too
            await self.engines[-1].generate(self.sched.step)
            raise RuntimeError("the engine generated with stale weights after a failure")
        except EngineError as e:
            rec.rollout_refused_by_engine = _refusal(e)
        rec.engine_weight_version_after_failure = (await self.engines[-1].call("hello"))["weight_version"]
        await self.sched.recover()
        rec.engine_digest_after_recovery = self.sched.last_sync["digest"]
        rec.recovered = rec.engine_digest_after_recovery == self.trainer_digest()
        return rec

    def _audit_failure(self) -> Recovery:
        failed = self.summary.errors[-1] if self.summary.errors else {}
        # the injected fault is recovered once; any other recovery is an engine that died on its own
        injected = bool(self._at_fault) and not any(r.trainer_digest_at_fault for r in self.recoveries)
        return Recovery(fault=str(self.fault) if injected else "engine-died", phase=failed.get("phase", "?"),
                        step=self.sched.step, cause=failed.get("error", "?"),
                        trainer_digest_at_fault=self._at_fault[-1] if injected else "",
                        staging_bytes_after_failure=self.sched.memory.staging_bytes,
                        segments_after_failure=leftover_segments(),
                        trainer_digest_after_failure=self.trainer_digest())

    async def _replace_dead_engine(self, rec: Recovery) -> None:
        old = self.engines[-1]
        if old.process.is_alive():
            return
        # The trainer's copy is the truth: a new engine starts empty and stale and
        # the recovery sync fills it.
        new = await self._spawn_engine({**self.build, "checkpoint": None})
        await self.sched.replace_engine(self._wrap_engine(new))
        rec.engine_replaced, rec.old_engine_pid, rec.new_engine_pid = True, old.process.pid, new.process.pid
        await old.aclose()

    # -- the end -------------------------------------------------------------------
    async def close(self) -> None:
        with anyio.CancelScope(shield=True):
            try:
                if self.transport is not None:
                    # the transport first: a broadcast group's other end is the engine
                    await self.transport.aclose()
                for engine in self.engines:
                    await engine.aclose()
                if self.saver is not None:
                    # Leave the process with its regions resident: the memory saver
                    # must not meet paused regions at teardown.
                    for key in sorted(self.saver.paused):
                        self.saver.resume(key)
                if self.trainer is not None:
                    self.final_digest = self.trainer_digest()
                close = getattr(self.trainer, "close", None)
                if close is not None:
                    close()  # a trainer's process group (megatron, fsdp)
            finally:
                shutil.rmtree(self.workdir, ignore_errors=True)

    def outcome(self) -> DemoOutcome:
        return DemoOutcome(self.rewards, self.summary, self.cfg.trace_path, self.error, self.recoveries,
                           self.final_digest)


def _progress(steps: int, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=steps, desc="colo demo", unit="cycle", file=sys.stderr, disable=not enabled,
                dynamic_ncols=True)


def report(cfg: DemoConfig, out: DemoOutcome) -> str:
    lines = [out.summary.table(), "", "reward per step:"]
    for i, r in enumerate(out.rewards):
        lines.append(f"  step {i:3d}  {r:.3f}  " + "#" * int(round(r * 40)))
    if len(out.rewards) >= 10:
        first, last = out.rewards[:5], out.rewards[-5:]
        lines.append(f"mean reward: first 5 steps {sum(first) / 5:.3f}, last 5 steps {sum(last) / 5:.3f}")
    lines.append(f"trace: {out.trace_path}")
    for rec in out.recoveries:
        lines.extend(rec.lines())
    if out.error is not None:
        lines.append(f"FAILED in phase {_failed_phase(out)}: {type(out.error).__name__}: {out.error}")
    return "\n".join(lines)


def _failed_phase(out: DemoOutcome) -> str:
    # no phase.failed at all: the device could not hold the engine at start-up
    return out.summary.errors[-1].get("phase", "?") if out.summary.errors else "start"


def config_from_args(args: Any) -> DemoConfig:
    try:
        return DemoConfig(device=args.device, steps=args.steps, plan=args.plan, transport=args.transport, trainer=getattr(args, "trainer", "hf"),
                          model=getattr(args, "model", "demo"),
                          bucket_mib=args.bucket_mib, mem_fraction_static=args.mem_fraction_static,
                          device_mem_gib=args.device_mem_gib, trace=args.trace, seed=args.seed,
                          fault=args.fault, engine_visible_devices=args.engine_visible_devices,
                          phase_deadline_s=getattr(args, "phase_deadline", 600.0),
                          gpus=getattr(args, "gpus", 1), launcher=getattr(args, "launcher", "process"),
                          address=getattr(args, "address", None), verify=getattr(args, "verify", "every"))
    except ValueError as e:
        raise UsageError(str(e)) from None


#: the exit status of a run ended by SIGINT or SIGTERM (as a shell reports Ctrl-C)
EXIT_INTERRUPTED = 130


async def run_until_signalled(cfg: DemoConfig, *, progress: bool = True) -> tuple[DemoOutcome | None, list[int]]:
    """:func:`run`, ended by SIGINT or SIGTERM as a cancellation: ``(None, signals)``
    if a signal ended it, ``(outcome, [])`` otherwise.

    Neither signal may raise in the driver: a KeyboardInterrupt lands between
    any two bytecodes, also past an ``await`` on a worker thread that is still
    packing into a shared-memory buffer the unwinding then frees (a segfault),
    and asyncio's own Ctrl-C handling cancels the task past anyio's shields.
    Here a signal cancels the run's scope: the running phase is cancelled at
    an await, its shielded cleanup runs (phase.failed "cancelled",
    trace.finished, engines closed, dirs and segments removed). The receiver
    stays open until the cleanup is done, so a second signal meanwhile is
    received and changes nothing.
    """
    got: list[int] = []
    outcome: DemoOutcome | None = None
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with anyio.create_task_group() as tg:
            run_scope = anyio.CancelScope()

            async def watch() -> None:
                async for signum in signals:
                    got.append(signum)
                    run_scope.cancel()

            tg.start_soon(watch)
            with run_scope:
                outcome = await run(cfg, progress=progress)
            tg.cancel_scope.cancel()
    return (None, got) if outcome is None else (outcome, [])


def run_demo(args: Any) -> int:
    try:
        cfg = config_from_args(args)
    except UsageError as e:
        # reported here, not by cli.main: under ``python -m colo.cli`` the CLI module
        # is __main__ and its UsageError is not the class this module raises
        print(f"colo demo: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if cfg.device == "cuda" and not torch.cuda.is_available():
        print("colo demo: --device cuda but no CUDA device is visible", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        from colo.trainers.models import demo_model_config

        check_fits(cfg, demo_model_config(cfg.model))  # before the trainer, the engine or the trace
    except UsageError as e:
        print(f"colo demo: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    out, signals = anyio.run(functools.partial(run_until_signalled, cfg, progress=not args.quiet))
    if out is None:
        names = ", ".join(signal.Signals(s).name for s in signals)
        print(f"colo demo: interrupted ({names}); the running phase was cancelled and cleaned up; "
              f"trace: {cfg.trace_path}", file=sys.stderr)
        code = EXIT_INTERRUPTED
    else:
        print(report(cfg, out))
        # a refusal carries its exit code (a trace another run holds is bad input: 2)
        code = exit_code(out.error) if out.error is not None else EXIT_OK
    if cfg.device == "cuda":
        from colo.device.cuda_memory import exit_past_the_saver

        exit_past_the_saver(code)  # the run is over and written down
    return code


__all__ = ["DemoConfig", "DemoOutcome", "ReinforceTask", "run", "run_demo", "run_until_signalled"]
