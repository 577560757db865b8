"""What every demo trainer shares: the REINFORCE step, AdamW state placement,
and onload/offload through the memory backend.

A trainer subclasses :class:`PolicyTrainer` and supplies ``_sequence_logits``
(its framework's forward), its extractor and its verification views.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread
import torch
import torch.distributed as dist

from colo.core.interfaces import RolloutResult, TensorSpec
from colo.groups import side_by_side


@dataclass(frozen=True, kw_only=True)
class ReinforceConfig:
    lr: float = 2e-3
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not self.grad_clip > 0:
            raise ValueError(f"grad_clip must be > 0, got {self.grad_clip}")


class PolicyTrainer:
    """The trainer side of :class:`~colo.core.interfaces.TrainerSide` that does not
    depend on the framework. Subclasses set ``model``, ``opt``, ``config``,
    ``engine_dtype``, ``_extractor``, ``_memory_backend`` and ``steps``."""

    model: torch.nn.Module
    opt: torch.optim.Optimizer
    config: ReinforceConfig
    _memory_backend: Any
    _extractor: Any
    steps: int
    #: the group whose ranks split each batch's rows and all-reduce the gradients
    #: (data parallel, every rank holding the whole model); None: one rank
    _dp_group: Any = None
    #: the one thread that runs the trainer's compute (see :meth:`compute`)
    _compute_thread: ThreadPoolExecutor | None = None
    #: the contract digest of the weights as they were offloaded (see :meth:`sent_digest`);
    #: None whenever the weights may have changed since
    _offloaded_digest: str | None = None
    #: the verifier's probe batch (:meth:`probe_logits`); None: no probe
    probe_tokens: list[list[int]] | None = None
    #: the trainer's logits for ``probe_tokens`` as the weights were offloaded; None whenever
    #: the weights may have changed since
    _offloaded_logits: torch.Tensor | None = None
    #: (what it was built over, the extractor of the paused weights' host backup):
    #: see :meth:`_kept_host_extractor`
    _host_extractor: tuple[Any, Any] | None = None
    #: the model's parameters, listed once (see :meth:`_host_key`)
    _params: list[torch.nn.Parameter] | None = None
    #: the stream an offload's checks run on, beside the pause's copies (see :meth:`_beside_pause`)
    _check_stream: Any = None

    @property
    def memory_backend(self) -> Any:
        """What pauses and resumes this trainer's tags (``pause(owner, tags)``,
        ``resume(owner, tags)``, ``resident(tag)``); None on the CPU, where nothing moves."""
        return self._memory_backend

    def tag_bytes(self) -> dict[str, int]:
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        out = {"weights": weights, "optimizer": self._optimizer_bytes(weights)}
        flat = self._weights_buffer()
        if flat is not None:  # the buffer as allocated: aligned, rounded to the allocator's segments
            out["weights"] = flat.nbytes
        return out

    def _weights_buffer(self) -> Any:
        """The :class:`~colo.device.flat_weights.FlatWeights` the parameters were adopted into,
        which the memory backend pauses as the weights tag; None: they live elsewhere."""
        return getattr(self, "flat_weights", None)

    def _optimizer_bytes(self, weights: int) -> int:
        """AdamW keeps exp_avg and exp_avg_sq, each the size of the weights; over
        low-precision parameters (:class:`~colo.trainers.precision.MasterAdamW`) an fp32
        master and two fp32 moments per element, ``weights`` scaled from the parameters'
        element size to 12 bytes."""
        from colo.trainers.precision import MasterAdamW

        if isinstance(self.opt, MasterAdamW):
            size = next(self.model.parameters()).element_size()
            return weights // size * 12
        return 2 * weights

    def param_specs(self) -> Sequence[TensorSpec]:
        return self._extractor.specs()

    def start_state(self) -> dict[str, torch.Tensor]:
        """The HF-named tensors an engine starts from: the weights a sync moves (a LoRA
        trainer's: the base model's, beside the adapter it syncs)."""
        return self.hf_state()

    def init_optimizer_state(self) -> None:
        """Allocate AdamW's state now (it is lazy), so that it lands in the caller's
        memory region (``trainer.optimizer``) rather than wherever the first step runs."""
        init_state = getattr(self.opt, "init_state", None)
        if init_state is not None:  # MasterAdamW: the fp32 masters too
            init_state()
            return
        for group in self.opt.param_groups:
            for p in group["params"]:
                state = self.opt.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    async def onload(self, tags: Sequence[str]) -> None:
        if self._memory_backend is not None:
            await self._memory_backend.resume("trainer", tags)

    async def offload(self, tags: Sequence[str]) -> None:
        if self._memory_backend is None:
            return
        tags = list(tags)
        if "weights" in tags and not self._paused() and _one_process():
            # The tags before the weights (the optimizer state: six times their bytes in fp32
            # masters and moments, 0.35 s of device->host copies at 1.5B) go to the host while
            # the checks below read the weights, which are paused last. Taken before that pause
            # began, the probe's forward made every verified offload-first offload 57-122 ms
            # longer than a plain pause at Qwen2-1.5B on an H200 (issue 44, call69a).
            first = tags[:-1] if tags[-1] == "weights" else []
            paused: list[str] = []

            async def pause_first() -> None:
                if first:
                    await self._memory_backend.pause("trainer", first)
                    paused.extend(first)

            # what the trainer queued so far (its step), which the checks read after; recorded
            # before the pause queues its copies on the same stream
            ready = _recorded_event(self._params_device())
            try:
                await side_by_side(self._offload_checks(ready), pause_first())
            except Exception:
                if paused:
                    # the checks failed: nothing is offloaded, as before they ran beside the pause
                    with anyio.CancelScope(shield=True):
                        await self._memory_backend.resume("trainer", paused)
                raise
            tags = [t for t in tags if t not in first]
        await self._memory_backend.pause("trainer", tags)

    async def _offload_checks(self, ready: Any = None) -> None:
        """What the offload takes of the weights while they are still on the device: the probe's
        reference where a probe may read it while they are paused (the verifier says,
        colo.verification.make_verifier): one forward on the device now, where paused it would
        load the whole model into a CPU twin (seconds at 1.5B); and their digest (one pass at
        memory speed, where on the host backup it would be seconds per GB). On a GPU, on a stream
        of their own that waits only for ``ready`` (:meth:`_beside_pause`)."""
        self._offloaded_logits = None if self.probe_tokens is None else \
            await self.compute(self._beside_pause, ready, self.logits, self.probe_tokens)
        self._offloaded_digest = await self.compute(self._beside_pause, ready, self.sent_digest, True)

    def _beside_pause(self, ready: Any, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the trainer's check stream, after the work ``ready`` marks: not on the
        default stream, where the memory saver's device->host copies of the tags paused beside
        it are queued (measured at 1.5B on an H200: the checks on the default stream ended
        after those copies, the verified offload-first offload 64-109 ms over a plain pause,
        call69b). None ``ready``: the current stream (the CPU)."""
        if ready is None:
            return fn(*args)
        event, device = ready
        if self._check_stream is None:
            self._check_stream = torch.cuda.Stream(device=device)
        self._check_stream.wait_event(event)
        with torch.cuda.stream(self._check_stream):
            return fn(*args)

    def _params_device(self) -> torch.device:
        return next(self.model.parameters()).device

    def probe_logits(self, tokens: list[list[int]]) -> torch.Tensor:
        """``logits(tokens)``; for the probe batch while paused, the logits taken as the
        weights were offloaded (they cannot have changed without a train step)."""
        if self._offloaded_logits is not None and self._paused() and tokens == self.probe_tokens:
            return self._offloaded_logits.clone()
        return self.logits(tokens)

    def digest_at_offload(self) -> bool:
        """Whether :meth:`offload` takes the weights' digest before they go (and
        :meth:`sent_digest` returns it while they are paused): a scheduler then checks a
        ``sync-first`` sync's digests against that one rather than read every weight a
        second time inside the sync (:meth:`colo.scheduler.Scheduler._check_at_offload`)."""
        return self._memory_backend is not None and _one_process()

    def sent_digest(self, fresh: bool = False) -> str:
        """The contract digest (:mod:`colo.digest`) every engine must report after a sync of
        these weights: the HF-named tensors in the spec order, each converted to the engine's
        dtype, checksummed where they lie. Unless ``fresh``, the digest taken as the weights
        were offloaded (they cannot have changed without a train step, which forgets it):
        it also holds the host backup to the bytes the device had."""
        if not fresh and self._offloaded_digest is not None and self._paused():
            return self._offloaded_digest
        from colo.digest import expected_weights_digest

        names = [s.name for s in self.param_specs()]
        flat = getattr(self, "flat_weights", None)
        if flat is not None:
            # weights in one buffer (the one-copy trainers): read where they lie, in one launch
            got = flat.digest(names, getattr(torch, self.engine_dtype))
            if got is not None:
                return got
        return expected_weights_digest(self.hf_state(), names, getattr(torch, self.engine_dtype))

    async def train_step(self, rollout: RolloutResult) -> dict[str, float]:
        if getattr(self, "dirty", False):
            raise RuntimeError("the trainer is dirty: an earlier step failed half-way on a device where its "
                               "state could not be restored; its weights are not a consistent step")
        self._offloaded_digest = self._offloaded_logits = None
        return await self.compute(self._reinforce, rollout.data)

    async def compute(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` off the event loop, always on this trainer's one thread.

        Not on whichever worker anyio picks: cuBLAS keeps a handle and a workspace
        per thread (32 MiB of workspace and more outside torch's allocator on an
        H100), never given back while the process lives. With the sync's own
        worker threads in the pool, a step that landed on a thread that never ran
        a matmul grew the trainer's device memory by 96 MiB at some step of a
        long run (seen on an H100: one step change at step 35 of 50, so device
        memory at the end of a sync was not flat)."""
        if self._compute_thread is None:
            self._compute_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="colo-trainer")
        future = self._compute_thread.submit(fn, *args)
        # the waiting worker runs no CUDA: only the trainer's thread does
        return await anyio.to_thread.run_sync(future.result)

    def _stop_compute(self) -> None:
        thread, self._compute_thread = self._compute_thread, None
        if thread is not None:
            thread.shutdown(wait=True)

    def close(self) -> None:
        """No process group to end (a launcher's world stays); the compute thread stops."""
        self._stop_compute()

    def num_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def _paused(self) -> bool:
        return self._memory_backend is not None and not self._memory_backend.resident("weights")

    def _kept_host_extractor(self, build: Callable[[], Any]) -> Any:
        """The extractor of the paused weights' host backup: ``build()``'s, kept from sync to
        sync while :meth:`_host_key` says it reads the same memory. A sharded trainer calls
        this only where building is no collective (one rank): ranks whose backups moved
        differently would otherwise disagree about building a new one."""
        key = self._host_key()
        if key is None or self._host_extractor is None or self._host_extractor[0] != key:
            self._host_extractor = (key, build())
        return self._host_extractor[1]

    def _host_key(self) -> tuple | None:
        """What the host extractor was built over: the same parameters, and the saver's
        backups at the same addresses (the first and the last one checked each sync).
        With a retained backup (colo.device.cuda_memory.Saver's default) they stay from pause to
        pause, so the extractor, its host views and their device views are made once:
        building them was 1.8 ms of a 6.8 ms sync of the demo model on an H100. None
        (build anew) when the saver does not retain its backups."""
        saver = self._memory_backend.saver
        if not saver.retains_backups:
            return None
        if self._params is None:
            # this trainer never replaces a parameter object (the optimizer holds them);
            # walking the module for them again was 0.25 ms a sync on an H100 host
            self._params = list(self.model.parameters())
        first, last = self._params[0], self._params[-1]
        return (id(first), id(last), saver.host_view(self._stored(first)).data_ptr(),
                saver.host_view(self._stored(last)).data_ptr())

    @staticmethod
    def _stored(p: torch.Tensor) -> torch.Tensor:
        """The tensor the memory saver backs up for parameter ``p`` (a sharded trainer's: its shard)."""
        return p

    # -- the learning ----------------------------------------------------------
    def _sequence_logits(self, seq: torch.Tensor) -> torch.Tensor:
        """``[batch, seq, vocab]`` logits of the policy, in training mode."""
        raise NotImplementedError

    def _reinforce(self, data: Any) -> dict[str, float]:
        """One REINFORCE step; a step that raises leaves the trainer as it was before it.

        On the CPU the step's state (parameters and AdamW's exp_avg, exp_avg_sq and
        step) is cloned first: three copies of the weights' bytes in host memory and
        one memcpy of each per step, small next to the forward and backward. On a
        GPU that clone would double the trainer's device memory, and the memory
        saver's pinned host backup is not known to be current once the regions are
        resumed, so nothing is cloned there: a failed step marks the trainer
        ``dirty`` and :meth:`train_step` refuses to train on from it.
        """
        on_cpu = next(self.model.parameters()).device.type == "cpu"
        saved = self._snapshot() if on_cpu else None
        try:
            return self._reinforce_step(data)
        except BaseException:
            self.opt.zero_grad(set_to_none=True)
            if saved is not None:
                self._restore(saved)
            else:
                self.dirty = True
            raise

    def _trained(self) -> list[torch.nn.Parameter]:
        """The parameters a step changes: every one of the model's (a LoRA trainer's: its adapter's)."""
        return list(self.model.parameters())

    def _snapshot(self) -> tuple[list[torch.Tensor], Any]:
        params = [p.detach().clone() for p in self._trained()]
        snapshot = getattr(self.opt, "snapshot", None)
        if snapshot is not None:  # MasterAdamW: its masters and their moments
            return params, snapshot()
        state = {p: {k: v.clone() if torch.is_tensor(v) else copy.deepcopy(v) for k, v in st.items()}
                 for p, st in self.opt.state.items()}
        return params, state

    @torch.no_grad()
    def _restore(self, saved: tuple[list[torch.Tensor], Any]) -> None:
        params, state = saved
        for p, old in zip(self._trained(), params):
            p.copy_(old)
        restore = getattr(self.opt, "restore", None)
        if restore is not None:
            restore(state)
            return
        for p in list(self.opt.state):
            if p not in state:
                del self.opt.state[p]  # lazily created by the failed step
        for p, old in state.items():
            self.opt.state[p] = old

    def _reinforce_step(self, data: Any) -> dict[str, float]:
        """One REINFORCE step with a mean baseline over the batch's sequences.

        Data parallel over ``ranks`` ranks (see :meth:`_data_parallel`), this rank
        takes the rows ``rank::ranks``. The advantage is normalised over the FULL
        batch and each rank's loss is divided by the full batch's token count, so
        the ranks' losses (and gradients) add up to the one-rank full-batch mean.
        """
        rank, ranks, group = self._data_parallel()
        if len(data.rewards) < ranks:
            raise ValueError(f"a batch of {len(data.rewards)} sequence(s) cannot be split over {ranks} "
                             f"data-parallel ranks; expected at least {ranks}")
        device = next(self.model.parameters()).device
        rewards = torch.tensor(data.rewards, dtype=torch.float32, device=device)
        prompts = torch.tensor(data.prompts, dtype=torch.long, device=device)
        completions = torch.tensor(data.completions, dtype=torch.long, device=device)
        adv = _advantages(rewards)
        mine = slice(rank, None, ranks)
        prompts, completions, adv, tokens = prompts[mine], completions[mine], adv[mine], completions.numel()
        seq = torch.cat([prompts, completions], dim=1)
        p = prompts.shape[1]
        logits = self._sequence_logits(seq)[:, p - 1:-1].float()
        logp = torch.log_softmax(logits, dim=-1).gather(-1, completions.unsqueeze(-1)).squeeze(-1)
        loss = -(adv.unsqueeze(1) * logp).sum() / tokens
        self.opt.zero_grad(set_to_none=True)
        self._backward(loss)
        self._clip_grads()
        self.opt.step()
        # The gradients are dead now: dropped here rather than at the next step's
        # start, their memory goes back with the offload that follows.
        self.opt.zero_grad(set_to_none=True)
        self.steps += 1
        loss = loss.detach()
        if ranks > 1:
            dist.all_reduce(loss, group=group)  # the full batch's loss, as one rank reports it
        return {"loss": float(loss), "reward": float(rewards.mean())}

    # -- what a parallel trainer changes in the step ------------------------------
    def _data_parallel(self) -> tuple[int, int, Any]:
        """``(rank, ranks, group)`` of the data-parallel group the batch's rows are split over."""
        if self._dp_group is None:
            return 0, 1, None
        return dist.get_rank(self._dp_group), dist.get_world_size(self._dp_group), self._dp_group

    def _backward(self, loss: torch.Tensor) -> None:
        """Leave every rank with the gradient of the full batch's loss (the sum of the ranks')."""
        loss.backward()
        if self._dp_group is None:
            return
        for param in self.model.parameters():
            if not param.requires_grad:
                continue
            if param.grad is None:  # every rank must join every all-reduce, in the same order
                param.grad = torch.zeros_like(param)
            dist.all_reduce(param.grad, group=self._dp_group)

    def _clip_grads(self) -> None:
        torch.nn.utils.clip_grad_norm_(self._trained(), self.config.grad_clip)


def new_optimizer(params: Any, config: ReinforceConfig) -> Any:
    """The trainer's AdamW: over fp32 parameters torch's own, over lower-precision ones
    :class:`~colo.trainers.precision.MasterAdamW` (fp32 masters in the optimizer's state)."""
    params = list(params)
    if all(p.dtype == torch.float32 for p in params):
        return torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
    from colo.trainers.precision import MasterAdamW

    return MasterAdamW(params, lr=config.lr, weight_decay=0.0)


def param_dtype_for(param_dtype: str | None, engine_dtype: str, device: str) -> torch.dtype:
    """The dtype a trainer keeps its parameters in. ``None``: on a GPU the engine's (a real
    trainer's bf16, with fp32 masters in the optimizer; a sync moves each byte once),
    on the CPU float32 (the CPU demo's learning and its tests are fp32)."""
    from colo.dtypes import as_dtype

    if param_dtype is None:
        return as_dtype(engine_dtype, what="engine dtype") if device == "cuda" else torch.float32
    dtype = as_dtype(param_dtype, what="trainer parameter dtype")
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"trainer parameter dtype must be float32, bfloat16 or float16, got {param_dtype!r}")
    return dtype


def _recorded_event(device: torch.device) -> tuple[Any, torch.device] | None:
    """An event recorded now on ``device``'s current stream, and the device (None off a GPU)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event, device


def _one_process() -> bool:
    """No process group of several ranks (where ``hf_state`` would be a collective)."""
    return not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


def _advantages(rewards: torch.Tensor) -> torch.Tensor:
    adv = rewards - rewards.mean()
    std = rewards.std()
    if std > 1e-6:
        adv = adv / std
    return adv
