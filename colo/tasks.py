"""Rollout tasks: what the engine generates and how it is scored, chosen by name.

A task travels to another process (a rank worker, a Ray actor) as its name and
keyword arguments (:func:`make_task`), never as an object: the receiving side
builds its own from :data:`TASKS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import torch

from colo.core.interfaces import RolloutResult


class RolloutTask(Protocol):
    """What to generate and how to score it (the demo's task is one)."""

    max_new_tokens: int
    temperature: float

    def prompts(self, step: int) -> list[list[int]]: ...
    def rewards(self, prompts: list[list[int]], completions: list[list[int]]) -> list[float]: ...
    def seed(self, step: int) -> int: ...


@dataclass(frozen=True)
class RolloutData:
    """One rollout as the trainer's step takes it."""

    prompts: list[list[int]]
    completions: list[list[int]]
    rewards: list[float]


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

    @property
    def chance(self) -> float:
        """The mean reward of a policy that ignores the reward (tokens drawn uniformly from the
        vocabulary): the rewarded share of the vocabulary, 0.125. The demo's untrained policy
        starts near it; a reward well above it is learnt."""
        return sum(1 for t in range(self.vocab_size) if self.rewarded(t)) / self.vocab_size

    def rewards(self, prompts: list[list[int]], completions: list[list[int]]) -> list[float]:
        return [sum(self.rewarded(t) for t in c) / len(c) for c in completions]


#: name -> task class; a task crosses processes as ``{"name": ..., **kwargs}``
TASKS: dict[str, type] = {"reinforce": ReinforceTask}


async def roll_out(task: RolloutTask | None, tokens: Callable[..., Awaitable[list[list[int]]]], step: int,
                   engine: str) -> RolloutResult:
    """One rollout step of ``task`` through an engine's ``tokens`` (token-id prompts in,
    completions out): what every adapter's ``generate`` is."""
    if task is None:
        raise RuntimeError(f"{engine} engine has no rollout task: pass task=")
    prompts = task.prompts(step)
    completions = await tokens(prompts, max_new_tokens=task.max_new_tokens, temperature=task.temperature,
                               seed=task.seed(step))
    rewards = task.rewards(prompts, completions)
    return RolloutResult(reward=sum(rewards) / len(rewards), tokens=sum(len(c) for c in completions),
                         data=RolloutData(prompts, completions, rewards))


def make_task(name: str, **kwargs: Any) -> RolloutTask:
    """The task ``name`` built from ``kwargs`` (what a rank receives in its spec)."""
    try:
        cls = TASKS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown rollout task {name!r}; expected one of {', '.join(TASKS)}") from None
    return cls(**kwargs)
