"""A LoRA adapter of a model colo syncs, as data: its settings (:class:`AdapterConfig`) and
the tensors it consists of, by name and shape (:func:`adapter_shapes`).

An adapter travels like weights (any of colo's transports, digest-verified) but is not the
model's weights: it is a set of small matrices beside some of the model's linear layers,
``W x + (alpha / r) * B (A x)``. Its tensors are named as PEFT saves them
(``get_peft_model_state_dict``, ``adapter_model.safetensors``), which is also what vLLM's
LoRA loader parses: for the base weight ``model.layers.0.self_attn.q_proj.weight`` of shape
``(out, in)``, ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` ``(r, in)``
and ``...q_proj.lora_B.weight`` ``(out, r)``.

What is taken: plain LoRA (no DoRA, no rsLoRA, no bias, no extra trained modules, one rank
and one alpha for every layer) on the dense linear layers of a Qwen2, Qwen3 or Llama
(:data:`TARGETS`). A MoE model's experts are refused: vLLM's MoE adapters have a layout of
their own.

Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from colo.models.arch import arch_of, hf_shapes

#: the prefix PEFT puts before a base model's names (``PeftModel.base_model.model``)
PEFT_PREFIX = "base_model.model."
#: the linear layers an adapter may sit beside, by the last part of their name
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: the largest rank taken (vLLM's own ceiling for max_lora_rank)
MAX_RANK = 512


@dataclass(frozen=True)
class AdapterConfig:
    """One adapter's settings: rank ``r``, ``alpha`` (the update is scaled by alpha / r) and
    the layers it sits beside, by the last part of their names (:data:`TARGETS`)."""

    r: int
    alpha: float
    targets: tuple[str, ...]

    def __post_init__(self) -> None:
        if isinstance(self.r, bool) or not isinstance(self.r, int) or not 1 <= self.r <= MAX_RANK:
            raise ValueError(f"adapter rank r must be an integer in [1, {MAX_RANK}], got {self.r!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not self.alpha > 0 \
                or self.alpha == float("inf"):
            raise ValueError(f"adapter alpha must be a finite positive number, got {self.alpha!r}")
        targets = self.targets
        if isinstance(targets, str) or not isinstance(targets, tuple) or not targets:
            raise ValueError(f"adapter targets must be a non-empty tuple of layer names, got {targets!r}")
        unknown = [t for t in targets if t not in TARGETS]
        if unknown:
            raise ValueError(f"adapter targets {unknown} are not layers colo's adapters sit beside; "
                             f"expected some of {', '.join(TARGETS)}")
        if len(set(targets)) != len(targets):
            raise ValueError(f"adapter targets name a layer twice: {targets}")

    @classmethod
    def from_peft(cls, config: Any) -> AdapterConfig:
        """From a PEFT ``LoraConfig`` (or its dict, as ``adapter_config.json`` holds it); what
        this adapter format cannot carry is refused, naming the setting."""
        get = config.get if isinstance(config, Mapping) else (lambda k, d=None: getattr(config, k, d))
        refused = [f"{k}={get(k)!r}" for k, ok in (("use_dora", False), ("use_rslora", False), ("bias", "none"))
                   if get(k, ok) != ok]
        refused += [f"{k}={get(k)!r}" for k in ("modules_to_save", "rank_pattern", "alpha_pattern",
                                                  "layers_to_transform") if get(k)]
        if refused:
            raise ValueError(f"this LoRA config cannot be synced: {', '.join(refused)} (colo syncs plain LoRA: one "
                             f"rank and alpha for every layer, no bias, no DoRA or rsLoRA, no extra modules)")
        targets = get("target_modules")
        if isinstance(targets, str) or targets is None:
            raise ValueError(f"target_modules must list the layers by name (some of {', '.join(TARGETS)}), "
                             f"got {targets!r}")
        return cls(r=get("r"), alpha=get("lora_alpha"), targets=tuple(sorted(targets, key=_target_order)))

    def to_json(self) -> dict:
        """What a request carries and the worker rebuilds the adapter's config from."""
        return {"r": self.r, "alpha": self.alpha, "targets": list(self.targets)}

    @classmethod
    def from_json(cls, d: Any) -> AdapterConfig:
        if not isinstance(d, Mapping) or set(d) != {"r", "alpha", "targets"} or not isinstance(d["targets"], list):
            raise ValueError(f"an adapter config is {{'r', 'alpha', 'targets': [...]}}, got {d!r}")
        return cls(r=d["r"], alpha=d["alpha"], targets=tuple(d["targets"]))

    def peft_dict(self) -> dict:
        """The config as PEFT's ``adapter_config.json`` says it (vLLM's ``PEFTHelper`` reads this)."""
        return {"peft_type": "LORA", "r": self.r, "lora_alpha": self.alpha, "target_modules": list(self.targets),
                "bias": "none", "use_rslora": False, "use_dora": False, "modules_to_save": None,
                "lora_dropout": 0.0, "task_type": "CAUSAL_LM"}


def _target_order(name: Any) -> int:
    return TARGETS.index(name) if name in TARGETS else len(TARGETS)


def adapter_shapes(model_config: Any, adapter: AdapterConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of ``adapter`` on ``model_config``'s model: PEFT's name -> shape, layer by
    layer in the checkpoint's order, ``lora_A`` before ``lora_B`` of each target."""
    arch = arch_of(model_config, what="the adapter's model")
    if arch.moe:
        raise ValueError(f"LoRA adapters on a MoE model ({getattr(model_config, 'model_type', '?')}) are not "
                         f"synced: its experts' adapters have a layout of their own")
    out: dict[str, tuple[int, ...]] = {}
    found: set[str] = set()
    for name, shape in hf_shapes(model_config, what="the adapter's model").items():
        parts = name.split(".")
        if len(shape) != 2 or parts[-1] != "weight" or parts[-2] not in adapter.targets or parts[0] != "model":
            continue
        module = name[:-len(".weight")]
        rows, cols = shape
        out[f"{PEFT_PREFIX}{module}.lora_A.weight"] = (adapter.r, cols)
        out[f"{PEFT_PREFIX}{module}.lora_B.weight"] = (rows, adapter.r)
        found.add(parts[-2])
    missing = [t for t in adapter.targets if t not in found]
    if missing:
        raise ValueError(f"adapter targets {missing} name no layer of this {getattr(model_config, 'model_type', '?')} "
                         f"model")
    return out


def adapter_bytes(shapes: Iterable[tuple[int, ...]], itemsize: int) -> int:
    """The bytes of an adapter's tensors of ``shapes`` at ``itemsize`` bytes an element."""
    total = 0
    for shape in shapes:
        n = 1
        for s in shape:
            n *= int(s)
        total += n * itemsize
    return total


__all__ = ["AdapterConfig", "MAX_RANK", "PEFT_PREFIX", "TARGETS", "adapter_bytes", "adapter_shapes"]
