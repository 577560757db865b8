"""``colo demo --gpus N``: the demo's RL loop over N ranks, one process per GPU.

Rank r is a worker process (:mod:`colo.ranks.worker`) on GPU r holding
trainer rank r (Megatron TP=N, FSDP2 over N, or data parallel for ``hf``) and
engine rank r, started as the engine's registry entry says (``rank_start``; colo's
engine: rank r of a TP=N engine, a child of the worker). This process is the driver: it
holds only the scheduler, one memory ledger per GPU and one trace per rank
(``run.jsonl`` -> ``run.rank0.jsonl`` ...). Each sync runs inside the workers,
every rank from its own trainer rank straight to its own engine rank.

After every sync each engine rank's shard digest must equal the digest of
that rank's shard of the trainer's weights, and the TP engine's logits on the
probe batch must match the trainer's: a mismatch fails the run. On the CPU
the ranks join gloo groups and the devices are simulated, as in the one-rank
demo; on CUDA they join NCCL groups.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import anyio
import torch

from colo.apps.demo_setup import MULTI_FAULTS
from colo.core.config import SchedulerConfig
from colo.core.memory import MiB, MemoryLedger
from colo.core.phases import IllegalTransition, Phase
from colo.core.errors import InvariantViolation, VerificationError
from colo.groups import together
from colo.proc.lifecycle import make_dir, release_dir, sweep
from colo.offline.summary import PhaseSummary
from colo.scheduler import Scheduler, describe
from colo.trace.writer import TraceWriter, rank_path



def visible_gpus(n: int) -> list[str]:
    """The first ``n`` GPUs of this machine by UUID; a clear error when there are fewer."""
    from colo.core.errors import UsageError

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n > have:
        raise UsageError(f"--gpus {n}: this machine has {have} visible CUDA device(s)")
    # CUDA_VISIBLE_DEVICES takes a UUID with its "GPU-" prefix, which torch's uuid may print without
    return ["GPU-" + str(torch.cuda.get_device_properties(i).uuid).removeprefix("GPU-") for i in range(n)]


class RankRecovery(dict):
    """What one injected fault did to an N-rank run and how it was recovered (the fields
    :meth:`MultiDemoRun.recover` records), as the report says it."""

    def lines(self) -> list[str]:
        what = (f"an engine rank died at step {self['step']} (not injected)" if self["fault"] == "engine-died"
                else f"fault {self['fault']} injected at step {self['step']}")
        out = [f"{what}: {self['cause']}",
               f"  after the failure: engine ranks alive {self['engine_ranks_alive']}, weight versions "
               f"{self['versions_after_failure']}, rollout refused ({self.get('rollout_refused_by_scheduler', '-')})"]
        if self.get("replaced_ranks"):
            pids = ", ".join(f"{old} -> {new}" for old, new in self["engine_pids"])
            out.append(f"  engine rank(s) {self['replaced_ranks']} replaced (processes {pids})")
        out.append("  recovered: every engine rank re-synced from the trainer's weights" if self.get("recovered")
                   else "  recovery FAILED")
        return out


class MultiDemoRun:
    """What one N-rank demo run holds: the workers, the proxies, the ledgers, the
    traces, the scheduler; the same surface as :class:`colo.apps.demo.DemoRun`."""

    def __init__(self, cfg: Any, gpus: int):
        from colo.trainers.models import demo_model_config

        if cfg.fault is not None and cfg.fault not in MULTI_FAULTS:
            raise ValueError(f"--gpus {gpus} supports the fault(s) {', '.join(MULTI_FAULTS)}, got {cfg.fault!r}")
        self.cfg, self.n = cfg, gpus
        #: the engine's name in colo.engine.ENGINES (a config without one: colo's)
        self.engine_name = getattr(cfg, "engine", "colo")
        self.model_config = demo_model_config(getattr(cfg, "model", "demo"))
        self.summary = PhaseSummary()
        self.rewards: list[float] = []
        self.recoveries: list[Any] = []
        self.error: BaseException | None = None
        self.workers: list[Any] = []
        self.trainers: list[Any] = []
        self.engines: list[Any] = []
        self.transports: list[Any] = []
        self.traces: list[TraceWriter] = []
        #: the process groups' stores this process serves (colo.proc.rendezvous)
        self.stores: list[Any] = []
        # what a SIGKILLed run left goes first; this run's dir is locked by this process
        # while it lives (colo.proc.lifecycle)
        sweep()
        self.workdir = make_dir("demo")
        self.final_digest: str | None = None
        self._fault_armed = cfg.fault is not None
        self.sched: Scheduler = None  # type: ignore[assignment]

    # -- set-up ------------------------------------------------------------------
    def claim_traces(self) -> None:
        """Claim every rank's trace (locked, its disk asked for room) before any worker
        starts: a full disk is said at once, not after the workers' start-up (14 s). colo
        derived these paths from the one given: none is opened through a symbolic link."""
        if self.traces:
            return
        for r in range(self.n):
            trace = TraceWriter(rank_path(self.cfg.trace_path, r, self.n), rank=r, world_size=self.n,
                                follow_symlinks=False)
            self.traces.append(trace)  # before open(): close() gives back those claimed
            trace.open()

    async def start(self) -> None:
        from colo.engine import engine_entry

        cfg = self.cfg
        self.claim_traces()  # run() did, unless a caller starts this run itself
        # refused before any process starts: an engine without a layout of N ranks, a TP size
        # that does not divide the heads (the engine's entry: DemoConfig checked it already)
        engine_entry(self.engine_name).check(device=cfg.device, gpus=self.n, launcher=cfg.launcher,
                                             model_config=self.model_config, layout=self._layout(),
                                             lora=getattr(cfg, "lora_rank", None) is not None)
        self.uuids = visible_gpus(self.n) if cfg.device == "cuda" else [None] * self.n
        self.budgets = [self._budget(r) for r in range(self.n)]
        # the two groups meet at stores this process serves (a Ray launcher moves them to
        # rank 0's node): a port chosen here and listened on later by rank 0 was taken by
        # another process in between once (EADDRINUSE, CI 2026-11-27)
        trainer_init, engine_init = self._host_store(), self._host_store()
        specs = [self._spec(r, trainer_init, engine_init) for r in range(self.n)]
        await self._spawn_workers(specs)
        # once the workers exist (a Ray cluster that cannot be reached refuses the run before
        # that, and left empty logs behind it), before their engines start
        cfg.start_engine_logs()
        hellos = await self._each_worker("start")
        self._proxies(hellos)
        self.sched = self._scheduler()

    def _budget(self, r: int) -> tuple[int, int, str]:
        from colo.apps.demo_setup import device_budget

        if self.cfg.device != "cuda":
            return device_budget(self.cfg)
        free, total = torch.cuda.mem_get_info(r)
        return total, total - free, torch.cuda.get_device_name(r)

    def _host_store(self) -> str:
        """The init method of a new group of the N ranks, its store served by this process
        until close() (a Ray run's ranks meet on rank 0's node instead: nothing is served)."""
        from colo.proc.rendezvous import HostedStore

        if self.cfg.launcher == "ray":
            return ""  # replaced by the launcher with rank 0's node
        self.stores.append(HostedStore(self.n))
        return self.stores[-1].init_method

    def _spec(self, r: int, trainer_init: str, engine_init: str) -> Any:
        from colo.ranks.host import RankSpec

        cfg = self.cfg
        rank = getattr(cfg, "lora_rank", None)
        # a LoRA run: every rank's trainer trains the adapter, its engine stages each sync's version
        lora = {"lora": {"rank": rank, "keep": cfg.keep_adapters}} if rank is not None else {}
        return RankSpec(
            rank=r, world_size=self.n, device=cfg.device, trainer=cfg.trainer,
            model_config=self.model_config.to_dict(), seed=cfg.seed, engine_dtype=cfg.engine_dtype,
            transport=cfg.transport, trainer_init=trainer_init, engine_init=engine_init,
            engine_build={"total_bytes": self.budgets[r][0], "mem_fraction_static": cfg.mem_fraction_static,
                          "memory": "saver" if cfg.device == "cuda" else "free", **lora},
            task={"name": "reinforce", "vocab_size": self.model_config.vocab_size, "batch": cfg.batch,
                  "prompt_len": cfg.prompt_len, "new_tokens": cfg.new_tokens, "seed": cfg.seed},
            engine_log=cfg.engine_log_path(r), param_dtype=cfg.trainer_dtype,
            workdir=self.workdir, engine=self.engine_name, layout=self._layout(), lora=lora.get("lora"))

    def _layout(self) -> str:
        from colo.engine import engine_entry

        return engine_entry(self.engine_name).layout(getattr(self.cfg, "engine_layout", None))

    async def _spawn_workers(self, specs: list[Any]) -> None:
        """Every worker at once (each imports torch before it listens); all or none."""
        from colo.ranks.proxy import Worker

        if self.cfg.launcher == "ray":
            from colo.ranks.ray_launcher import spawn_workers

            envs = [{"CUDA_VISIBLE_DEVICES": u} if u else None for u in self.uuids]
            self.workers = await spawn_workers(specs, envs=envs, address=self.cfg.address)
            return

        started: list[Any] = [None] * len(specs)

        async def one(spec: Any) -> None:
            env = {"CUDA_VISIBLE_DEVICES": self.uuids[spec.rank]} if self.uuids[spec.rank] else None
            started[spec.rank] = await Worker.spawn(spec, env=env)

        try:
            # every rank's outcome, the first failure raised naming its rank (a task group
            # would raise an ExceptionGroup of them, which reached the user as a traceback)
            await together([(lambda spec=spec: one(spec)) for spec in specs], "worker", "spawn")
        finally:
            # the ones that started are closed by close(), also when another failed
            self.workers = [w for w in started if w is not None]

    async def _each_worker(self, op: str, **fields: Any) -> list[dict]:
        """``op`` on every worker at once (a verb with collectives needs them all)."""
        calls = [(lambda w=w: w.call(op, **fields)) for w in self.workers]
        results, _ = await together(calls, "worker", op)
        return results

    def _proxies(self, hellos: list[dict]) -> None:
        from colo.apps.demo_setup import CycleSeeded
        from colo.ranks.proxy import RemoteEngine, RemoteTrainer, RemoteTransport

        self.hellos = hellos
        self.trainers = [RemoteTrainer(w, h) for w, h in zip(self.workers, hellos)]
        self.engines = [RemoteEngine(w, h) for w, h in zip(self.workers, hellos)]
        self.transports = [RemoteTransport(w, self.cfg.transport) for w in self.workers]
        self._seeded = [CycleSeeded(e, lambda: len(self.rewards)) for e in self.engines]

    def _ledger(self, r: int) -> MemoryLedger:
        total, reserved, name = self.budgets[r]
        if self.cfg.device == "cuda":
            from colo.device.cuda_memory import cuda_ledger

            return cuda_ledger(accounted_bytes=sum(self.engines[r].tag_bytes().values()), device_name=name,
                               device_index=r)
        from colo.apps.demo_setup import SimulatedDevice

        leftover = int(self.cfg.trainer_leftover_mib * MiB)
        trainer = self.trainers[r]
        return SimulatedDevice(total_bytes=total, reserved_bytes=reserved, device_kind="cpu", device_name=name,
                               leftover=lambda: leftover if trainer.steps else 0)

    def _scheduler(self) -> Scheduler:
        cfg = self.cfg
        traces = self.traces
        traces[0].add_listener(self.summary.feed)
        return Scheduler(
            self.trainers, self._seeded, [self._ledger(r) for r in range(self.n)], self.transports,
            config=SchedulerConfig(plan=cfg.plan, bucket_bytes=cfg.bucket_bytes,
                                   phase_deadline_s=cfg.phase_deadline_s, verify=cfg.verify,
                                   sync_target=getattr(cfg, "sync_target", "weights")),
            trace=traces, verify=self.verify, probe=self.probe,
            run_config={"demo": {k: v for k, v in asdict(cfg).items() if k != "trace"}, "gpus": self.n,
                        "gpu_uuids": self.uuids, "mem_fraction_static": cfg.mem_fraction_static,
                        # which process is which rank's: a signal from outside names one
                        "pids": [{"worker": h["pid"], "engine": h["engine_pid"]} for h in self.hellos],
                        # each rank's trainer sends its engine rank its own slices, no gather (issue 46)
                        "own_slices": [bool(h.get("own_slices")) for h in self.hellos],
                        "model": {"params": self.trainers[0].num_params(), "engine_dtype": cfg.engine_dtype}})

    # -- verification ------------------------------------------------------------
    async def verify(self, digests: list[str]) -> None:
        """Every engine rank holds its part of the trainer's weights: its shard (``tp``) or the
        whole (``replicas``), digest for digest."""
        wants = [r["digest"] for r in await self._each_worker("expected_digest")]
        for rank, (got, want) in enumerate(zip(digests, wants)):
            if got != want:
                raise VerificationError(f"engine rank {rank} digest {got[:16]} != the trainer's digest of its "
                                        f"part {want[:16]} after sync")

    async def probe(self) -> None:
        """The engine answers the probe batch as the trainer computes it: a TP engine once (its
        ranks answer together, rank 0 speaks), every replica on its own. Its probe is its
        entry's (colo's engine: logits; vLLM: logprobs, once its KV cache is back)."""
        from colo.apps.demo_setup import LOGIT_TOLERANCES
        from colo.engine import engine_entry
        from colo.verification import ask_probe, check_probe, probe_batch, probe_columns

        kind = engine_entry(self.engine_name).probe
        batch = probe_batch(self.model_config.vocab_size, self.cfg.seed)
        columns = probe_columns(self.model_config.vocab_size, batch, self.cfg.seed)
        calls = [(lambda e=e: ask_probe(e, kind, batch, columns)) for e in self.engines]
        answers, _ = await together(calls, "engine", kind)
        ref = (await self._each_worker("trainer_logits", tokens=batch))[0]["logits"]
        tolerance = LOGIT_TOLERANCES[getattr(self.cfg, "model", "demo")]  # bf16 rounding grows with depth
        if self._layout() == "tp":
            check_probe(kind, ref, answers[0], batch, columns, tolerance, who="TP engine")
            return
        for rank, answer in enumerate(answers):
            check_probe(kind, ref, answer, batch, columns, tolerance, who=f"engine rank {rank}")

    async def trainer_digest(self) -> str:
        return (await self._each_worker("full_digest"))[0]["digest"]

    # -- the cycle ---------------------------------------------------------------
    async def cycle(self) -> None:
        """One cycle. A failure an injected fault caused (once), or an engine rank that died on
        its own (killed or stopped from outside; up to ``MAX_ENGINE_DEATHS``), is recovered from:
        the cycle counts as done once every engine rank is re-synced if its train completed,
        else it runs again from rollout with the same rollout seed (a train that failed half-way
        left every trainer rank as it was before the step)."""
        self._arm_fault()
        while True:
            version = self.sched.trainer_version
            try:
                await self.sched.cycle()
            except Exception:
                if self.sched.phase is not Phase.FAILED or not await self._recoverable(self.sched.last_error):
                    raise
                trained = self.sched.trainer_version > version
                reward = self.sched.last_rollout.reward if trained else None
                await self.recover()
                if not trained:
                    continue
                self.rewards.append(reward)
                return
            self.rewards.append(self.sched.last_rollout.reward)
            return

    def _injected(self) -> bool:
        """The failure to recover from is the injected fault's (it fires once)."""
        return self.fault_fired and not any(r["fault"] == self.cfg.fault for r in self.recoveries)

    async def _recoverable(self, err: BaseException | None) -> bool:
        """The injected fault, once; or an engine rank's death, up to ``MAX_ENGINE_DEATHS``: the
        error says so, or another rank's failure came first (a TP peer's collective fails as its
        peer dies or stops) and an engine rank is found dead (a stopped one is killed there)."""
        from colo.apps.demo_setup import MAX_ENGINE_DEATHS, engine_died

        if self._injected():
            return True
        if sum(r["fault"] == "engine-died" for r in self.recoveries) >= MAX_ENGINE_DEATHS:
            return False
        if engine_died(err):
            return True
        try:
            alive = [r["alive"] for r in await self._each_worker("engine_alive")]
        except Exception:
            return False  # a worker that cannot answer: not an engine's death this run recovers from
        return not all(alive)

    def _arm_fault(self) -> None:
        if not self._fault_armed or len(self.rewards) < self.cfg.fault_step:
            return
        # the last rank's engine dies after its first bucket is loaded: half-updated
        self.transports[-1].kill_engine_after = 1
        self._fault_armed = False

    @property
    def fault_fired(self) -> bool:
        return bool(self.transports) and self.transports[-1].kills_sent > 0

    def check_fault_fired(self) -> None:
        if self.cfg.fault is not None and not self.fault_fired:
            from colo.core.errors import FaultMissed

            raise FaultMissed(f"fault {self.cfg.fault} was never injected in {self.cfg.steps} steps",
                              steps=len(self.rewards))

    async def recover(self) -> dict:
        """Fail safe, then back to a synced engine: every engine rank stale (rollout
        refused), the whole TP group restarted when a rank died, re-synced."""
        rec = RankRecovery(fault=self.cfg.fault if self._injected() else "engine-died", step=self.sched.step,
                           cause=describe(self.sched.last_error))
        self.recoveries.append(rec)
        try:
            await self.sched.run_phase(Phase.ROLLOUT)
            raise RuntimeError("the scheduler allowed rollout after a failure")
        except (IllegalTransition, InvariantViolation) as e:
            rec["rollout_refused_by_scheduler"] = f"{type(e).__name__}: {e}"
        alive = [r["alive"] for r in await self._each_worker("engine_alive")]
        rec["engine_ranks_alive"] = alive
        rec["versions_after_failure"] = [await e.reported_version() if a else None
                                         for e, a in zip(self.engines, alive)]
        if not all(alive):
            await self._restart_engines(rec, alive)
        await self.sched.recover()
        rec["recovered"] = True
        return rec

    async def _restart_engines(self, rec: dict, alive: list[bool]) -> None:
        """A TP group cannot take one new member: every rank starts a new engine rank in a new
        group. Replicas share no group: only the dead ones are replaced. Each new one is stale
        (colo's empty, vLLM from the first checkpoint); the recovery sync fills all of them."""
        tp = self._layout() == "tp"
        ranks = [r for r in range(self.n) if tp or not alive[r]]
        init = ""
        if tp:
            # the new group meets at engine rank 0: on its node when Ray placed it (maybe not this one)
            init = await self.workers[0].rendezvous() if self.cfg.launcher == "ray" else self._host_store()
        calls = [(lambda r=r: self.workers[r].call("replace_engine", init_method=init)) for r in ranks]
        replies, _ = await together(calls, "worker", "replace_engine")
        rec["engine_pids"] = [(r["old_engine_pid"], r["engine_pid"]) for r in replies]
        rec["replaced_ranks"] = ranks
        for r, reply in zip(ranks, replies):
            self.engines[r].pid = reply["engine_pid"]
            await self.sched.replace_engine(self._seeded[r], r)

    # -- the end -------------------------------------------------------------------
    async def close(self) -> None:
        with anyio.CancelScope(shield=True):
            try:
                if self.workers and all(not w.closed for w in self.workers) and self.sched is not None:
                    with anyio.move_on_after(60):
                        try:
                            self.final_digest = await self.trainer_digest()
                        except Exception:
                            pass
                async with anyio.create_task_group() as tg:
                    for w in self.workers:
                        tg.start_soon(w.aclose)
            finally:
                for trace in self.traces:
                    trace.finish()  # a claim the scheduler never started is given back
                release_dir(self.workdir)
                self.stores.clear()  # the ranks are gone: nobody meets there any more

    def outcome(self) -> Any:
        from colo.apps.demo_setup import DemoOutcome

        # the summary is rank 0's; every rank's trace sits beside it (run.rank1.jsonl ...)
        return DemoOutcome(self.rewards, self.summary, rank_path(self.cfg.trace_path, 0, self.n), self.error,
                           list(self.recoveries), self.final_digest)


__all__ = ["MultiDemoRun", "RankRecovery", "visible_gpus"]
