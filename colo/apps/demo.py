"""``colo demo``: a real colocated RL loop on a built-in small model or a local checkpoint.

The trainer (a transformers policy with AdamW: the demo's small Qwen2, or the
Qwen2, Qwen3 or Llama checkpoint of ``--checkpoint``) lives in this process; the rollout
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
import signal
import sys
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import anyio
import torch

from colo.core.errors import (EXIT_BAD_INPUT, EXIT_OK, ColoError, FaultMissed, SharedMemoryFull, TraceUnwritable,
                              UsageError, exit_code)
from colo.core.config import SchedulerConfig
from colo.core.errors import EngineError
from colo.proc.handles import leftover_segments
from colo.proc.lifecycle import make_dir, release_dir, sweep
from colo.core.invariants import InvariantViolation
from colo.apps.demo_setup import (MAX_ENGINE_DEATHS, CycleSeeded, DemoConfig, DemoOutcome, Recovery, SimulatedDevice,
                                  check_fits, check_shm_staging, device_budget, engine_died, make_verifier,
                                  trainer_digest)
from colo.core.memory import OWNERS_TAGS, MiB, MemoryLedger
from colo.engine import load
from colo.core.phases import IllegalTransition, Phase
from colo.scheduler import Scheduler, describe
from colo.tasks import make_task
from colo.offline.summary import PhaseSummary
from colo.trace.writer import TraceWriter, rank_path
from colo.core.errors import VerificationError




def build_trainer(cfg: DemoConfig, model_config: Any) -> tuple[Any, Any]:
    from colo.trainers import build

    if cfg.lora_rank is not None:  # the base frozen, an adapter trained and synced
        from colo.trainers import LORA_BUILDERS

        source = {"checkpoint": cfg.checkpoint, "model_config": model_config if cfg.checkpoint is None else None}
        return load(LORA_BUILDERS[cfg.trainer])(**source, seed=cfg.seed, engine_dtype=cfg.engine_dtype,
                                                device=cfg.device, rank=cfg.lora_rank, param_dtype=cfg.trainer_dtype)
    if cfg.checkpoint is not None:  # the model is the checkpoint's (model_config was read from it)
        return build(cfg.trainer, checkpoint=cfg.checkpoint, seed=cfg.seed, engine_dtype=cfg.engine_dtype,
                     device=cfg.device, param_dtype=cfg.trainer_dtype)
    return build(cfg.trainer, model_config=model_config, seed=cfg.seed, engine_dtype=cfg.engine_dtype,
                 device=cfg.device, param_dtype=cfg.trainer_dtype)


def _refusal(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


async def run(cfg: DemoConfig, *, progress: bool = True,
              on_cycle: Callable[[int], None] | None = None) -> DemoOutcome:
    """The loop, as the phase list reads: set up, one cycle per step, report.

    ``on_cycle(n)`` is called after the n-th completed cycle (the soak measures there).
    """
    if cfg.gpus == 1:
        demo: Any = DemoRun(cfg)
    else:
        from colo.apps.demo_multi import MultiDemoRun

        demo = MultiDemoRun(cfg, cfg.gpus)
    try:
        demo.claim_traces()
    except ColoError as e:  # the trace's disk is full, or another run writes it: nothing started
        demo.error = e
        await demo.close()
        return demo.outcome()
    started = False
    try:
        try:
            await demo.start()
            started = True
        except Exception as e:  # nothing ran: the reason is the whole report (run_demo: one line)
            demo.error = first_error(e)
        if started:
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
            except Exception as e:  # in the trace as phase.failed
                demo.error = e
            finally:
                bar.close()
    finally:
        await demo.close()
    out = demo.outcome()
    out.failed_at_start = not started
    return out


def first_error(exc: BaseException) -> BaseException:
    """The error an exception group stands for: its first (a task group of start-up work
    raises every failure it collected; the first is the cause, the rest its echoes)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def one_line(exc: BaseException) -> str:
    """``exc`` as the one line a user reads: a colo error's own message (it names what and
    why), anything else with its class; a message of many lines joined on one."""
    text = str(exc) if isinstance(exc, ColoError) and str(exc) else f"{type(exc).__name__}: {exc}"
    return "; ".join(part.strip() for part in text.splitlines() if part.strip())


class DemoRun:
    """Everything one demo run holds: trainer, engine processes, transport, ledger,
    trace, scheduler, and the audit of an injected fault."""

    def __init__(self, cfg: DemoConfig):
        self.cfg = cfg
        self.model_config: Any = None  # read in start(), while the engine's process starts
        #: the engine's process begun before the trainer is built, until it is handed its build
        self.begun: Any = None
        self.env: dict[str, str] | None = None  # what the engine process's environment adds
        self.fault = cfg.parsed_fault()
        self.summary = PhaseSummary()
        self.rewards: list[float] = []
        self.recoveries: list[Recovery] = []
        self.error: BaseException | None = None
        self.engines: list[Any] = []  # every engine process this run started, closed at the end
        self.trainer: Any = None
        self.saver: Any = None
        self.transport: Any = None
        self.trace: TraceWriter | None = None
        # What a SIGKILLed run left (no cleanup ran there) goes first; this run's
        # dir is locked by this process, so that any other run can tell it from a dead one's.
        sweep()
        self.workdir = make_dir("demo")
        self._at_fault: list[str] = []
        self.injector: Any = None
        self.final_digest: str | None = None

    # -- set-up ------------------------------------------------------------------
    def claim_traces(self) -> None:
        """Claim the trace (locked, its disk asked for room) before anything starts up: a
        full disk or a trace another run writes is said at once, not after the engine's
        start-up (7 s)."""
        if self.trace is None:
            self.trace = TraceWriter(self.cfg.trace_path)
            self.trace.open()

    async def start(self) -> None:
        from colo.transports import make_transport

        cfg = self.cfg
        self.claim_traces()  # run() did, unless a caller starts this run itself
        self.env = {"CUDA_VISIBLE_DEVICES": cfg.engine_visible_devices} if cfg.engine_visible_devices else None
        if cfg.engine_entry.begin is not None:
            # The engine's interpreter and imports (seconds) overlap the model's config and the
            # trainer's build: the engine is built from the trainer's weights, its process
            # need not wait for them. A run refused below ends it in close().
            self.begun = load(cfg.engine_entry.begin)(self.env)
        self.model_config = cfg.model_config()
        check_fits(cfg, self.model_config)  # before the trainer is built or the engine is built
        torch.manual_seed(cfg.seed)
        try:
            self.trainer, self.saver = build_trainer(cfg, self.model_config)
            check_shm_staging(cfg, self.trainer)  # before the engine starts: the sync's buckets in /dev/shm
        except SharedMemoryFull as e:
            if self.trainer is not None:  # the staging check: said as it is
                e.exit_code = EXIT_BAD_INPUT
                raise
            # the trainer's weights as one flat shared buffer did not fit: a run sized for a
            # /dev/shm it does not have, said before anything started
            raise SharedMemoryFull(
                where=e.where, what="the trainer's weights, one shared buffer the engine reads (the one-copy sync)",
                need=e.need, room=e.room, before_start=True,
                remedy="train in bfloat16 (--trainer-dtype bfloat16: the sync converts, and stages buckets), "
                       "or " + SharedMemoryFull.MORE) from None
        if self.fault is not None:
            from colo.testing.faults import FaultInjector

            self.injector = FaultInjector(self.fault, on_fire=lambda: self._at_fault.append(self.trainer_digest()),
                                          engine=cfg.engine)
        self.task = make_task("reinforce", vocab_size=self.model_config.vocab_size, batch=cfg.batch,
                              prompt_len=cfg.prompt_len, new_tokens=cfg.new_tokens, seed=cfg.seed)
        self.total, self.reserved, self.device_name = device_budget(cfg)
        self.build = await self._engine_build()
        cfg.start_engine_logs()
        await self._spawn_engine(self.build)
        self.transport = make_transport(cfg.transport)
        self.sched = self._scheduler(self._ledger())

    async def _engine_build(self) -> dict:
        """The engine starts from the trainer's initial checkpoint (version 0), as
        SGLang and vLLM start from a model path: in the form its registry entry says."""
        from colo.models.save import save_start

        entry = self.cfg.engine_entry
        # a model directory as vLLM and SGLang load one (the weights in the engine's dtype), or
        # the trainer's tensors as they are for colo's engine
        dtype = getattr(torch, self.cfg.engine_dtype) if entry.starts_from == "hf_dir" else None
        ckpt = save_start(entry.starts_from, self.model_config, self.trainer.start_state(), self.workdir, dtype=dtype)
        if self.saver is not None:
            # Colocated start: the trainer offloads before the engine starts, as
            # slime does, so the engine's KV pool can take its fraction.
            await self.trainer.offload(list(OWNERS_TAGS["trainer"]))
        cfg = self.cfg
        return {"config": self.model_config.to_dict(), "dtype": cfg.engine_dtype, "device": cfg.device,
                "total_bytes": self.total, "mem_fraction_static": cfg.mem_fraction_static, "checkpoint": ckpt,
                "memory": "saver" if self.saver is not None else "free",
                # if this process is killed outright, the engine removes the work dir as it goes
                "run_dir": self.workdir, "log_path": cfg.engine_log_path(),
                **({"lora": {"rank": cfg.lora_rank, "keep": cfg.keep_adapters}} if cfg.lora_rank else {})}

    async def _spawn_engine(self, build: dict) -> Any:
        from colo.engine import start_engine

        cfg = self.cfg
        # the first engine of the run in the process begun for it; a replacement in a new one
        begun, self.begun = self.begun, None
        engine = await start_engine(cfg.engine, build, task=self.task, env=self.env, options=cfg.engine_options,
                                    seed=cfg.seed, batch=cfg.batch, **({} if begun is None else {"begun": begun}))
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
        if self.cfg.lora_rank is not None:
            # its syncs stage adapter versions; a new engine's base weights are checked once
            from colo.engine.adapters import AdapterEngine

            engine = AdapterEngine.for_trainer(engine, self.trainer, self.cfg.engine_dtype)
        engine = CycleSeeded(engine, lambda: len(self.rewards))
        return self.injector.wrap_engine(engine) if self.injector else engine

    def _scheduler(self, memory: MemoryLedger) -> Scheduler:
        cfg = self.cfg
        trace = self.trace
        trace.add_listener(self.summary.feed)
        trainer = self.injector.wrap_trainer(self.trainer) if self.injector else self.trainer
        verify, probe = make_verifier(self.trainer, lambda: sched.engine, self.model_config, cfg.engine_dtype,
                                      cfg.seed, cfg.logit_tolerance)
        sched = Scheduler(
            trainer, self._wrap_engine(self.engines[0]), memory, self.transport,
            config=SchedulerConfig(plan=cfg.plan, bucket_bytes=cfg.bucket_bytes,
                                   phase_deadline_s=cfg.phase_deadline_s,
                                   verify=cfg.verify, sync_target=cfg.sync_target),
            trace=trace, verify=verify, probe=probe,
            run_config={"demo": {k: v for k, v in asdict(cfg).items() if k != "trace"},
                        "mem_fraction_static": cfg.mem_fraction_static,
                        "model": {"params": self.trainer.num_params(), "engine_dtype": cfg.engine_dtype,
                                  "model_type": getattr(self.model_config, "model_type", None)},
                        **self._lora_config()})
        if self.injector:
            self.injector.attach(sched)
        return sched

    def _lora_config(self) -> dict:
        """The adapter a LoRA run syncs, for the trace: its settings and its size beside the base's."""
        if self.cfg.lora_rank is None:
            return {}
        a = self.trainer.adapter
        return {"lora": {"rank": a.r, "alpha": a.alpha, "targets": list(a.targets),
                         "adapter_params": self.trainer.num_params(), "base_params": self.trainer.base_params(),
                         "keep_adapters": self.cfg.keep_adapters}}

    def trainer_digest(self) -> str:
        return trainer_digest(self.trainer, self.cfg.engine_dtype)

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
        if engine_died(err):
            return sum(r.engine_replaced for r in self.recoveries) < MAX_ENGINE_DEATHS
        return self.injector is not None and self.injector.fired and not self.recoveries

    def check_fault_fired(self) -> None:
        if self.injector is not None and self.injector.missed is not None:
            raise FaultMissed(f"fault {self.fault} failed nothing: {self.injector.missed} (the engine takes no "
                              f"memory back in it: {self.engines[-1].capabilities.note or 'it frees none'})",
                              steps=len(self.rewards))
        if self.injector is not None and not self.injector.fired:
            f = self.fault
            raise FaultMissed(f"fault {f} was never injected: no {f.phase} at step >= {f.step} in "
                              f"{self.cfg.steps} steps", steps=len(self.rewards))

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
        if "reported_version" in self.cfg.engine_entry.lifecycle:
            rec.engine_weight_version_after_failure = await self.engines[-1].reported_version()
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
                        segments_after_failure=self._leftover_segments(),
                        trainer_digest_after_failure=self.trainer_digest())

    def _leftover_segments(self) -> list[str]:
        """This process's ``/dev/shm`` segments but the trainer's own storage: a one-copy
        trainer's weights live in one (on the CPU, where the engine reads them straight
        from it), and a failure left nothing there."""
        flat = getattr(self.trainer, "flat_weights", None)
        own = set(flat.segment_names) if flat is not None else set()
        return [name for name in leftover_segments() if name not in own]

    async def _replace_dead_engine(self, rec: Recovery) -> None:
        old = self.engines[-1]
        lifecycle = self.cfg.engine_entry.lifecycle
        if "alive" not in lifecycle or old.alive():
            return  # an engine that cannot die on its own (in this process) is never replaced
        # The trainer's copy is the truth: a new engine starts stale (colo's empty; vLLM
        # cannot start without a model, so from the first checkpoint, then marked stale by
        # replace_engine) and the recovery sync fills it.
        # a LoRA run's sync brings only the adapter: its new engine starts from the base weights
        empty = self.cfg.engine_entry.starts_empty and self.cfg.lora_rank is None
        new = await self._spawn_engine({**self.build, "checkpoint": None} if empty else self.build)
        await self.sched.replace_engine(self._wrap_engine(new))
        rec.engine_replaced = True
        if "pid" in lifecycle:
            rec.old_engine_pid, rec.new_engine_pid = old.pid, new.pid
        await old.aclose()

    # -- the end -------------------------------------------------------------------
    async def close(self) -> None:
        with anyio.CancelScope(shield=True):
            try:
                if self.transport is not None:
                    # the transport first: a broadcast group's other end is the engine
                    await self.transport.aclose()
                if self.begun is not None:  # never built: the run failed before its engine
                    begun, self.begun = self.begun, None
                    await anyio.to_thread.run_sync(begun.abandon)
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
                if self.trace is not None:
                    self.trace.finish()  # a claim the scheduler never started is given back
                release_dir(self.workdir)

    def outcome(self) -> DemoOutcome:
        return DemoOutcome(self.rewards, self.summary, self.cfg.trace_path, self.error, self.recoveries,
                           self.final_digest)


def _progress(steps: int, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=steps, desc="colo demo", unit="cycle", file=sys.stderr, disable=not enabled,
                dynamic_ncols=True)


def chance_reward(cfg: DemoConfig) -> float:
    """The demo task's reward for a policy that ignores it (:attr:`colo.tasks.ReinforceTask.chance`)."""
    from colo.trainers.models import demo_model_config

    return make_task("reinforce", vocab_size=demo_model_config(cfg.model).vocab_size, batch=cfg.batch,
                     prompt_len=cfg.prompt_len, new_tokens=cfg.new_tokens, seed=cfg.seed).chance


def report(cfg: DemoConfig, out: DemoOutcome) -> str:
    chance = chance_reward(cfg)
    # the reward means nothing without its baseline: what a policy that ignores the reward scores
    lines = [out.summary.table(), "",
             f"reward per step (chance {chance:.3f}: the reward is the share of completion tokens in a fixed "
             f"{chance:.1%} of the vocabulary):"]
    for i, r in enumerate(out.rewards):
        lines.append(f"  step {i:3d}  {r:.3f}  " + "#" * int(round(r * 40)))
    if len(out.rewards) >= 10:
        first, last = out.rewards[:5], out.rewards[-5:]
        lines.append(f"mean reward: first 5 steps {sum(first) / 5:.3f}, last 5 steps {sum(last) / 5:.3f} "
                     f"(chance {chance:.3f})")
    lines.append(f"trace: {out.trace_path}")
    log = cfg.engine_log_path(0 if cfg.gpus > 1 else None)
    if log is not None:
        lines.append(f"engine log: {log}" + (f" (one per rank: .rank0 ... .rank{cfg.gpus - 1})" if cfg.gpus > 1 else ""))
    for rec in out.recoveries:
        lines.extend(rec.lines())
    if isinstance(out.error, FaultMissed):
        # every step ran and no phase failed: there is no phase to name
        lines.append(f"FAILED after the last of {out.error.steps} steps: FaultMissed: {out.error}")
    elif out.error is not None:
        lines.append(f"FAILED in phase {_failed_phase(out)}: {type(out.error).__name__}: {out.error}")
    return "\n".join(lines)


def _failed_phase(out: DemoOutcome) -> str:
    err = out.error
    if isinstance(err, TraceUnwritable) and err.phase is not None:
        # the trace's disk filled: the run stopped between phases, none of them failed
        return err.phase + (f" at step {err.step}" if err.step is not None else "")
    # no phase.failed at all: the device could not hold the engine at start-up
    return out.summary.errors[-1].get("phase", "?") if out.summary.errors else "start"


def config_from_args(args: Any) -> DemoConfig:
    try:
        return DemoConfig(device=args.device, steps=args.steps, plan=args.plan, transport=args.transport, trainer=getattr(args, "trainer", "hf"),
                          trainer_dtype=getattr(args, "trainer_dtype", None),
                          model=getattr(args, "model", "demo"), checkpoint=getattr(args, "checkpoint", None),
                          bucket_mib=args.bucket_mib, mem_fraction_static=args.mem_fraction_static,
                          device_mem_gib=args.device_mem_gib, trace=args.trace, seed=args.seed,
                          fault=args.fault, engine_visible_devices=args.engine_visible_devices,
                          phase_deadline_s=getattr(args, "phase_deadline", 600.0),
                          gpus=getattr(args, "gpus", 1), launcher=getattr(args, "launcher", "process"),
                          address=getattr(args, "address", None), verify=getattr(args, "verify", "every"),
                          engine_log=getattr(args, "engine_log", None), engine=getattr(args, "engine", "colo"),
                          vllm_processes=getattr(args, "vllm_processes", False),
                          engine_layout=getattr(args, "engine_layout", None),
                          lora_rank=getattr(args, "lora_rank", None), keep_adapters=getattr(args, "keep_adapters", 2))
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
        check_fits(cfg, cfg.model_config())  # before the trainer, the engine or the trace
    except UsageError as e:
        print(f"colo demo: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    threads = torch.get_num_threads()
    if cfg.device == "cpu" and cfg.engine_entry.own_process:
        # This process's trainer and an engine in a process of its own share the machine's cores
        # (colo's engine takes one thread: colo.engine.reference.server.use_engine_threads). With torch's default of one thread per
        # core, libgomp's spinning waits turn any other load into stalls: a train step of the demo
        # took 9.5 s on two threads beside other jobs on the two-core VM, 0.5 s on one.
        torch.set_num_threads(1)
    try:
        out, signals = anyio.run(functools.partial(run_until_signalled, cfg, progress=not args.quiet))
    finally:
        torch.set_num_threads(threads)  # as the caller had it: main() may run inside a longer process
    if out is None:
        names = ", ".join(signal.Signals(s).name for s in signals)
        # every rank writes its own trace: the files written, not the name they derive from
        traces = ", ".join(str(rank_path(cfg.trace_path, r, cfg.gpus)) for r in range(cfg.gpus))
        print(f"colo demo: interrupted ({names}); the running phase was cancelled and cleaned up; "
              f"trace: {traces}", file=sys.stderr)
        code = EXIT_INTERRUPTED
    elif out.failed_at_start:
        # nothing ran, so there is no summary, reward or trace to show: the reason is the report
        print(f"colo demo: {one_line(out.error)}", file=sys.stderr)
        code = exit_code(out.error)
    else:
        print(report(cfg, out))
        # a refusal carries its exit code (a trace another run holds is bad input: 2)
        code = exit_code(out.error) if out.error is not None else EXIT_OK
    if cfg.device == "cuda":
        from colo.device.cuda_memory import exit_past_the_saver

        exit_past_the_saver(code)  # the run is over and written down
    return code


__all__ = ["DemoConfig", "DemoOutcome", "DemoRun", "run", "run_demo", "run_until_signalled"]
