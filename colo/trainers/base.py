"""What every demo trainer shares: the REINFORCE step, AdamW state placement,
and onload/offload through the memory backend.

A trainer subclasses :class:`PolicyTrainer` and supplies ``_sequence_logits``
(its framework's forward), its extractor and its verification views.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import anyio.to_thread
import torch

from colo.core.interfaces import RolloutResult, TensorSpec


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

    def tag_bytes(self) -> dict[str, int]:
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        # AdamW keeps exp_avg and exp_avg_sq, each the size of the weights.
        return {"weights": weights, "optimizer": 2 * weights}

    def param_specs(self) -> Sequence[TensorSpec]:
        return self._extractor.specs()

    def init_optimizer_state(self) -> None:
        """Allocate AdamW's state now (it is lazy), so that it lands in the caller's
        memory region (``trainer.optimizer``) rather than wherever the first step runs."""
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
        if self._memory_backend is not None:
            await self._memory_backend.pause("trainer", tags)

    async def train_step(self, rollout: RolloutResult) -> dict[str, float]:
        return await anyio.to_thread.run_sync(self._reinforce, rollout.data)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def _paused(self) -> bool:
        return self._memory_backend is not None and not self._memory_backend.resident("weights")

    # -- the learning ----------------------------------------------------------
    def _sequence_logits(self, seq: torch.Tensor) -> torch.Tensor:
        """``[batch, seq, vocab]`` logits of the policy, in training mode."""
        raise NotImplementedError

    def _reinforce(self, data: Any) -> dict[str, float]:
        """One REINFORCE step with a mean baseline over the batch's sequences."""
        device = next(self.model.parameters()).device
        prompts = torch.tensor(data.prompts, dtype=torch.long, device=device)
        completions = torch.tensor(data.completions, dtype=torch.long, device=device)
        rewards = torch.tensor(data.rewards, dtype=torch.float32, device=device)
        seq = torch.cat([prompts, completions], dim=1)
        p = prompts.shape[1]
        logits = self._sequence_logits(seq)[:, p - 1:-1].float()
        logp = torch.log_softmax(logits, dim=-1).gather(-1, completions.unsqueeze(-1)).squeeze(-1)
        adv = rewards - rewards.mean()
        std = rewards.std()
        if std > 1e-6:
            adv = adv / std
        loss = -(adv.unsqueeze(1) * logp).mean()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
        self.opt.step()
        # The gradients are dead now: dropped here rather than at the next step's
        # start, their memory goes back with the offload that follows.
        self.opt.zero_grad(set_to_none=True)
        self.steps += 1
        return {"loss": float(loss.detach()), "reward": float(rewards.mean())}
