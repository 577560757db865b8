"""The reference trainer: a small HF Qwen2 policy, AdamW, and a REINFORCE step.

It is a ``TrainerSide``: its weights and optimizer state are the
``trainer.weights`` and ``trainer.optimizer`` tags, its extractor hands full
tensors in the engine's dtype to the transport, and its step learns from the
engine's rollouts. On the CPU, onload and offload move nothing (host memory is
the only memory; the ledger accounts for the simulated device); on a GPU the
memory backend pauses and resumes the trainer's regions.
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


class ReferenceTrainer:
    def __init__(self, model: torch.nn.Module, *, engine_dtype: str = "bfloat16",
                 config: ReinforceConfig | None = None, memory_backend: Any = None):
        self.model = model
        self.config = config or ReinforceConfig()
        self.engine_dtype = engine_dtype
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=self.config.lr, weight_decay=0.0)
        self._extractor = self._live_extractor()
        self._memory_backend = memory_backend
        self._cpu_twin: torch.nn.Module | None = None
        self.steps = 0

    def _live_extractor(self) -> Any:
        """Full tensors of the resident model in the engine dtype (a trainer whose
        parameters are sharded returns an extractor that gathers them)."""
        from colo.extractors.plain import PlainExtractor

        return PlainExtractor(self.model, dtype=getattr(torch, self.engine_dtype))

    def _new_cpu_twin(self) -> torch.nn.Module:
        """An unsharded CPU model of the same architecture, for logits while paused."""
        return type(self.model)(self.model.config).eval()

    # -- TrainerSide -----------------------------------------------------------
    def tag_bytes(self) -> dict[str, int]:
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        # AdamW keeps exp_avg and exp_avg_sq, each the size of the weights.
        return {"weights": weights, "optimizer": 2 * weights}

    def param_specs(self) -> Sequence[TensorSpec]:
        return self._extractor.specs()

    def extractor(self) -> Any:
        if self._paused():
            # offload-first on a GPU: the weights are paused, their pinned host
            # backup is the source; tensors are uploaded as buckets are built.
            from colo.extractors.plain import PlainExtractor

            host = self.hf_state()  # the pinned backup's views while paused
            device = next(self.model.parameters()).device
            dtype = getattr(torch, self.engine_dtype)
            if all(p.dtype == dtype for p in self.model.parameters()):
                # nothing to convert: the transport uploads straight into its buffer
                return PlainExtractor(host, dtype=dtype, upload_to=device)
            # a conversion is due: upload first, convert on the device (a host-side
            # conversion would produce pageable memory, several times slower to upload)
            return PlainExtractor(host, dtype=dtype, device=device)
        return self._extractor

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

    # -- the learning ----------------------------------------------------------
    def _reinforce(self, data: Any) -> dict[str, float]:
        """One REINFORCE step with a mean baseline over the batch's sequences."""
        device = next(self.model.parameters()).device
        prompts = torch.tensor(data.prompts, dtype=torch.long, device=device)
        completions = torch.tensor(data.completions, dtype=torch.long, device=device)
        rewards = torch.tensor(data.rewards, dtype=torch.float32, device=device)
        seq = torch.cat([prompts, completions], dim=1)
        p = prompts.shape[1]
        logits = self.model(seq).logits[:, p - 1:-1].float()
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
        self.steps += 1
        return {"loss": float(loss.detach()), "reward": float(rewards.mean())}

    # -- verification ----------------------------------------------------------
    def num_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def _paused(self) -> bool:
        return self._memory_backend is not None and not self._memory_backend.resident("weights")

    def hf_state(self) -> dict[str, torch.Tensor]:
        if self._paused():
            # the device pages are unmapped: read the pinned host backup instead
            return {n: self._memory_backend.saver.host_view(p) for n, p in self.model.named_parameters()}
        return {n: p.detach() for n, p in self.model.named_parameters()}

    @torch.no_grad()
    def logits(self, tokens: list[list[int]]) -> torch.Tensor:
        if self._paused():
            # A CPU twin fed the host backup: touching the paused model would
            # read unmapped device memory.
            if self._cpu_twin is None:
                self._cpu_twin = self._new_cpu_twin()
            state = self.hf_state()
            # hf_state lists a tied parameter once (model.embed_tokens.weight); the
            # twin's state dict also has its second name (lm_head.weight)
            state.update({alias: state[first] for alias, first in tied_names(self._cpu_twin).items()
                          if first in state})
            self._cpu_twin.load_state_dict(state, strict=True)
            model, device = self._cpu_twin, torch.device("cpu")
        else:
            model, device = self.model, next(self.model.parameters()).device
        return model(torch.tensor(tokens, dtype=torch.long, device=device)).logits.float().cpu()


def tied_names(model: torch.nn.Module) -> dict[str, str]:
    """Second name of each tied parameter -> the name ``named_parameters()`` lists it under."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[name] = first[id(p)]
        else:
            first[id(p)] = name
    return out


def build(*, model_config: Any, seed: int, engine_dtype: str, device: str) -> tuple[ReferenceTrainer, Any]:
    """The reference trainer; on a GPU its weights and AdamW state live in memory-saver
    regions with a pinned host backup, so offload and onload are real pauses."""
    from colo.models import build_trainer_model

    if device == "cpu":
        return ReferenceTrainer(build_trainer_model(model_config, seed), engine_dtype=engine_dtype), None
    from colo.cuda_memory import Saver, TrainerMemory

    saver = Saver()
    with saver.region("trainer.weights", cpu_backup=True):
        model = build_trainer_model(model_config, seed).to("cuda")
    trainer = ReferenceTrainer(model, engine_dtype=engine_dtype, memory_backend=TrainerMemory(saver))
    with saver.region("trainer.optimizer", cpu_backup=True):
        trainer.init_optimizer_state()
    return trainer, saver
