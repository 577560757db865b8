"""The LoRA trainer: the reference trainer's policy with a PEFT adapter beside its linear layers,
the base model frozen; what a sync moves is the adapter (``colo demo --lora-rank R``).

Its sync tensors (``param_specs``, the extractor, ``hf_state``, the digest every engine must
report) are the adapter's, under PEFT's names (:mod:`colo.models.lora`), in the engine's
adapter dtype; the tensors an engine starts from (:meth:`LoraTrainer.start_state`) are the
base model's, under their Hugging Face names. Its optimizer holds the adapter only: AdamW's two
moments of a rank-8 adapter are a few percent of the model's. The REINFORCE step is the
reference trainer's, through PEFT's forward (``W x + (alpha / r) B A x``).

PEFT is an optional extra (``colo-rl[lora]``): imported when the trainer is built.
"""

from __future__ import annotations

from typing import Any

import torch

from colo.trainers.base import ReinforceConfig, new_optimizer
from colo.trainers.hf import ReferenceTrainer, _data_parallel_world

#: the adapter's step: a rank-8 update of a frozen model needs a larger one than a whole model's
#: (the demo's 2e-3 moved a LoRA policy's reward by 0.05 in 30 steps)
LORA_LR = 2e-2
#: PEFT's name of the one adapter a model carries (``get_peft_model``'s default)
ADAPTER_NAME = "default"


def peft_name(param_name: str) -> str:
    """A PEFT model's parameter name as PEFT saves the adapter (``get_peft_model_state_dict``):
    the adapter's own name dropped, ``...q_proj.lora_A.default.weight`` -> ``...q_proj.lora_A.weight``."""
    return param_name.replace(f".{ADAPTER_NAME}.", ".")


def base_name(param_name: str) -> str:
    """A PEFT model's base parameter under the Hugging Face name the engine loads:
    ``base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight`` ->
    ``model.layers.0.self_attn.q_proj.weight``."""
    from colo.models.lora import PEFT_PREFIX

    name = param_name[len(PEFT_PREFIX):] if param_name.startswith(PEFT_PREFIX) else param_name
    return name.replace(".base_layer.", ".")


class LoraTrainer(ReferenceTrainer):
    """A PEFT model (``get_peft_model`` over a transformers policy) whose adapter is what a
    sync moves. ``adapter``: its :class:`~colo.models.lora.AdapterConfig`."""

    def __init__(self, model: torch.nn.Module, adapter: Any, *, engine_dtype: str,
                 config: ReinforceConfig | None = None, memory_backend: Any = None, one_copy: bool = True,
                 dp_group: Any = None):
        #: PEFT's name -> the adapter's parameter, in the model's order (lora_A before lora_B)
        self.adapter_params = {peft_name(n): p for n, p in model.named_parameters() if p.requires_grad}
        if not self.adapter_params:
            raise ValueError("the LoRA trainer's model has no trainable parameter: expected a PEFT model "
                             "(get_peft_model) whose adapter is trainable")
        self.adapter = adapter
        self._memory_backend = memory_backend  # read by hf_state, which the base class's __init__ calls
        flat = None
        if one_copy and all(p.dtype == getattr(torch, engine_dtype) for p in self.adapter_params.values()):
            # the adapter in one buffer the engine reads straight from (the packed transport's one-copy
            # sync: no staging, one request): on the CPU a /dev/shm segment the engine process maps
            from colo.device.flat_weights import FlatWeights

            device = next(iter(self.adapter_params.values())).device
            flat = FlatWeights.adopt_params(self.adapter_params, device=device)
        super().__init__(model, engine_dtype=engine_dtype, config=config or ReinforceConfig(lr=LORA_LR),
                         memory_backend=memory_backend, flat_weights=flat, dp_group=dp_group)
        # the base stays frozen: AdamW over the adapter alone (its moments are the adapter's size)
        self.opt = new_optimizer(self.adapter_params.values(), self.config)

    def _live_extractor(self) -> Any:
        from colo.extractors.plain import PlainExtractor

        return PlainExtractor(self.hf_state(), dtype=getattr(torch, self.engine_dtype))

    def tag_bytes(self) -> dict[str, int]:
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        adapter = sum(p.numel() * p.element_size() for p in self.adapter_params.values())
        return {"weights": weights, "optimizer": self._optimizer_bytes(adapter)}

    def num_params(self) -> int:
        """The adapter's parameters: what is trained and synced (the base's: :meth:`base_params`)."""
        return sum(p.numel() for p in self.adapter_params.values())

    def base_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters()) - self.num_params()

    # -- what is synced, and what an engine starts from ------------------------------------
    def hf_state(self) -> dict[str, torch.Tensor]:
        """The adapter's tensors under PEFT's names (what the engine stages and digests)."""
        if self._paused():
            saver = self._memory_backend.saver
            return {n: saver.host_view(p) for n, p in self.adapter_params.items()}
        return {n: p.detach() for n, p in self.adapter_params.items()}

    def start_state(self) -> dict[str, torch.Tensor]:
        """The base model's tensors under their Hugging Face names: what an engine starts from
        (the adapter, as PEFT made it, has ``B = 0``: the base model's outputs)."""
        return {base_name(n): p.detach() for n, p in self.model.named_parameters() if not p.requires_grad}

    def _new_cpu_twin(self) -> torch.nn.Module:
        raise NotImplementedError("the LoRA trainer answers the probe while resident only")

    def _trained(self) -> list[torch.nn.Parameter]:
        """A step changes the adapter only: a failed one puts it and its moments back, the
        gradient is clipped over it."""
        return list(self.adapter_params.values())


def build(*, model_config: Any, seed: int, engine_dtype: str, device: str, rank: int, alpha: float | None = None,
          targets: tuple[str, ...] | None = None, param_dtype: str | None = None,
          checkpoint: str | None = None) -> tuple[LoraTrainer, Any]:
    """A LoRA trainer of rank ``rank`` (alpha ``2 * rank`` unless given) on every linear layer
    of :data:`colo.models.lora.TARGETS` (or ``targets``), the base model ``model_config``'s at
    random from ``seed`` (moved off its init: :func:`~colo.trainers.models.trained_stand_in`) or
    ``checkpoint``'s. PEFT draws the adapter's A from torch's global
    generator: it is seeded here from ``seed``, so a run repeats itself. On the CPU only: the
    adapter's regions on a GPU are not built yet (refused, naming it)."""
    from colo.models.lora import TARGETS, AdapterConfig
    from colo.trainers.base import param_dtype_for
    from colo.trainers.models import initial_model, trained_stand_in
    from colo.trainers.precision import cast_parameters

    if device != "cpu":
        raise ValueError(f"the LoRA trainer runs on the CPU only so far (got device {device!r})")
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ValueError("the LoRA trainer needs PEFT: pip install 'colo-rl[lora]'") from None
    adapter = AdapterConfig(r=rank, alpha=float(2 * rank if alpha is None else alpha),
                            targets=tuple(targets or TARGETS))
    dtype = param_dtype_for(param_dtype, engine_dtype, device)
    base = initial_model(model_config, seed, checkpoint)
    if checkpoint is None:
        # an adapter adapts a trained model: at its random init the frozen base's outputs cannot be
        # moved far by any adapter (colo.trainers.models.trained_stand_in says why)
        trained_stand_in(base, seed)
    base = cast_parameters(base, dtype)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = get_peft_model(base, LoraConfig(r=adapter.r, lora_alpha=adapter.alpha,
                                                target_modules=list(adapter.targets), lora_dropout=0.0,
                                                bias="none"))
    # what colo syncs is what PEFT holds: checked against the adapter's layout by name and shape
    AdapterConfig.from_peft(model.peft_config[ADAPTER_NAME])
    # N ranks (colo demo --gpus N): data parallel, each rank's rows of the batch, the adapter's
    # gradients summed over the ranks (the frozen base has none), so every rank's adapter is the same
    return LoraTrainer(model, adapter, engine_dtype=engine_dtype, dp_group=_data_parallel_world()), None


__all__ = ["LORA_LR", "LoraTrainer", "base_name", "build", "peft_name"]
