"""Trainers the demo can drive, chosen by name (``colo demo --trainer``).

Every trainer is a :class:`~colo.core.interfaces.TrainerSide` and also offers
what the demo verifies a sync against:

- ``hf_state()`` — every parameter as one full tensor under its Hugging Face
  name (sharding undone), the reference the engine's digest must equal;
- ``logits(tokens)`` — full-vocabulary logits on the CPU for the probe batch;
- ``steps`` — optimizer steps taken;
- ``num_params()`` — parameters in the full model.

``build(kind, ...)`` returns ``(trainer, saver)``; ``saver`` is the memory
saver holding the trainer's regions on a GPU, or ``None``. A trainer starts from a
local Hugging Face checkpoint (``checkpoint=DIR``) or from random weights of a config.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

#: name -> "module:function"; a trainer's module (and its framework) is
#: imported only when chosen: megatron-core is an optional extra.
BUILDERS = {
    "hf": "colo.trainers.hf:build",
    "megatron": "colo.trainers.megatron:build",
    "fsdp": "colo.trainers.fsdp:build",
}
#: the trainers that train a LoRA adapter (``colo demo --lora-rank``): name -> "module:function",
#: called as ``build(..., rank=R)``; the others are refused by name
LORA_BUILDERS = {
    "hf": "colo.trainers.lora:build",
}
#: the trainers whose tensor-parallel ranks can send engine rank r its own slice of every
#: tensor both split the same way, with no gather (``send_own_slices(split)``, issue 46), to an
#: engine whose entry takes them (``colo.engine.EngineEntry.rank_slices``)
OWN_SLICES = ("megatron",)


def build(kind: str, *, model_config: Any = None, seed: int = 0, engine_dtype: str, device: str,
          param_dtype: str | None = None, optimizer_state: bool = True,
          checkpoint: str | os.PathLike | None = None) -> tuple[Any, Any]:
    """The trainer ``kind``, starting from either a local Hugging Face checkpoint directory
    (``checkpoint``: transformers' ``from_pretrained``, nothing downloaded; megatron loads
    those tensors into megatron-core through its name rules) or a model of ``model_config``
    initialised at random from ``seed``: exactly one of the two. The architecture is one of
    :mod:`colo.models.arch` (another is refused, ``UnsupportedArchitecture``); a checkpoint
    that is missing, not a Hugging Face directory, or whose tensors differ from its config
    is refused (``CheckpointError``), before any process group or device memory is touched.

    ``param_dtype``: the trainer's parameters' dtype; None: on a GPU the engine's (bf16
    parameters, fp32 master weights in the optimizer), on the CPU float32
    (:func:`colo.trainers.base.param_dtype_for`). ``optimizer_state=False``: the
    optimizer's state is not made (on a GPU, no ``trainer.optimizer`` region): a trainer
    that only syncs, as the benchmark's real-trainer rows at 7B where 12 bytes a
    parameter of fp32 masters and moments would not fit beside the engine."""
    try:
        target = BUILDERS[kind]
    except (KeyError, TypeError):
        raise ValueError(f"unknown trainer {kind!r}; expected one of {', '.join(BUILDERS)}") from None
    if (model_config is None) == (checkpoint is None):
        raise ValueError("a trainer starts from model_config (random weights from seed) or from checkpoint "
                         "(a local Hugging Face directory): give exactly one")
    if checkpoint is not None:
        from colo.trainers.models import checkpoint_config

        # checked here, for every kind, before a builder starts a process group or a memory region
        model_config = checkpoint_config(checkpoint)
        checkpoint = os.fspath(checkpoint)
    else:
        from colo.models.arch import arch_of

        arch_of(model_config)
    module, fn = target.split(":")
    return getattr(importlib.import_module(module), fn)(
        model_config=model_config, seed=seed, engine_dtype=engine_dtype, device=device, param_dtype=param_dtype,
        optimizer_state=optimizer_state, checkpoint=checkpoint)
