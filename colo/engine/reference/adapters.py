"""LoRA adapters in colo's own engine: a staged version becomes an entry of the model's adapter
table (``EngineModel.adapters``), which a generate or logits call names; its forward adds
``B (A x)`` beside each targeted projection (``EngineModel._add_delta``), the fused q/k/v and
gate/up projections part by part.

The stage (checks, copies, digest) is :class:`colo.engine.adapter_host.AdapterStage`'s. Here:
the engine keeps adapters in its weights' dtype on its device, as the stage received them (one
buffer a version), and scales ``B (A x)`` by ``alpha / r`` in the forward; a dense model at TP=1 only (a TP rank would need each adapter's shard,
a MoE model's experts an adapter layout of their own: refused by name).
"""

from __future__ import annotations

from typing import Any

import torch

from colo.core.errors import EngineStateError
from colo.dtypes import dtype_name
from colo.engine.adapter_host import AdapterStage
from colo.models.lora import PEFT_PREFIX, AdapterConfig


class EngineAdapters(AdapterStage):
    """The adapter stage of an :class:`~colo.engine.reference.core.EngineCore`; its versions
    live in the core's model's adapter table."""

    def __init__(self, core: Any):
        self.core = core
        super().__init__(getattr(core, "config", None), core.device)  # a TP or MoE core is refused first

    @property
    def model(self) -> Any:
        return self.core.model

    @property
    def dtype(self) -> str:
        return dtype_name(self.model.dtype)

    def check(self, version: int, config: AdapterConfig) -> None:
        from colo.engine.reference.model import EngineModel

        if type(self.model) is not EngineModel:
            raise EngineStateError(f"colo's engine takes LoRA adapters on a dense model at TP=1; this engine is a "
                                   f"{type(self.model).__name__} (a TP rank would need each adapter's shard, a MoE "
                                   f"model's experts an adapter layout of their own)")

    def register(self, version: int, config: AdapterConfig, tensors: dict[str, torch.Tensor]) -> None:
        # the stage's own tensors (views of its one buffer, on the engine's device, in its dtype:
        # preflight checked it) as they are: no copy; the forward scales B (A x) by alpha / r
        table: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
        scale = config.alpha / config.r
        for name, a in tensors.items():
            if name.endswith(".lora_A.weight"):
                module = name[len(PEFT_PREFIX):-len(".lora_A.weight")]
                table[module] = (a, tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"], scale)
        self.model.adapters[version] = table

    def loaded(self) -> list[int]:
        return sorted(self.model.adapters)

    def unregister(self, version: int) -> bool:
        return self.model.adapters.pop(int(version), None) is not None


__all__ = ["EngineAdapters"]
