"""The one-GPU benchmark's models and the trainer's weights, shared by ``bench.gpu_sync``
(colo's rows) and ``bench.peer`` (checkpoint-engine, in a process of its own).

Both processes must move the same bytes for their figures to compare: the same
shapes, and weights seeded the same way (:func:`seeded_flat_weights`), so the
peer's expected digest equals the one colo's rows are checked against.

Nothing here imports transformers: the peer's process, and the receiver it
spawns, run ``gc.collect()`` on every checkpoint-engine update (its own code), and
transformers' modules add a quarter to the objects that collection walks. The
peer therefore reads a model's shapes from :func:`attr_config`, colo's own size
tables read as attributes (what ``colo.engine.reference.dims.dims_from_config`` accepts, the
same as a ``Qwen2Config``'s ``to_dict()``); ``tests/bench/test_peer.py`` checks it
gives exactly the specs of the ``Qwen2Config`` that ``bench.gpu_sync`` builds.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import torch

from colo.trainers.models import DEMO_DEFAULTS, DEMO_MODELS, QWEN2_7B

#: the benchmark's models, in the order they run (:func:`gpu_models` has their shapes)
GPU_MODEL_NAMES: tuple[str, ...] = ("qwen2-7b", "qwen2-1.5b")


def gpu_models() -> dict[str, tuple[str, dict]]:
    """name -> (what the results call its shapes, Qwen2Config overrides).

    Qwen2-1.5B is the demo's 1.5B size (``colo.trainers.models.DEMO_MODELS``: tied
    embeddings, no lm_head of its own)."""
    return {"qwen2-7b": ("Qwen2-7B", dict(QWEN2_7B)),
            "qwen2-1.5b": ("Qwen2-1.5B (tied embeddings)", dict(DEMO_MODELS["qwen2-1.5b"]))}


def shapes_of(name: str, layers: int | None = None) -> dict:
    """The Qwen2Config overrides of a benchmark model, cut to ``layers`` layers if given."""
    models = gpu_models()
    if name not in models:
        raise ValueError(f"unknown model {name!r}; expected one of {', '.join(GPU_MODEL_NAMES)}")
    shapes = dict(models[name][1])
    if layers is not None:
        shapes["num_hidden_layers"] = layers
    return shapes


def attr_config(name: str, layers: int | None = None) -> SimpleNamespace:
    """The model's config as attributes, without transformers: the demo's defaults under
    the model's overrides, as ``colo.trainers.models.demo_config`` passes them to
    ``Qwen2Config`` (the engine's name map reads only these fields)."""
    return SimpleNamespace(**{**DEMO_DEFAULTS, **shapes_of(name, layers)})


def seeded_flat_weights(specs: Sequence[Any], *, share_host: bool = True) -> Any:
    """The trainer's bf16 weights as one flat buffer on the current GPU
    (``colo.device.flat_weights``), each tensor ``randn * 0.02`` from one CUDA generator
    seeded 0, drawn in spec order: the same bits in every process that asks."""
    from colo.device.flat_weights import FlatWeights

    g = torch.Generator(device="cuda").manual_seed(0)
    flat = FlatWeights({s.name: (s.shape, torch.bfloat16) for s in specs}, device="cuda", share_host=share_host)
    for s in specs:
        flat.tensors[s.name].copy_(torch.randn(s.shape, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02)
    return flat


__all__ = ["GPU_MODEL_NAMES", "attr_config", "gpu_models", "seeded_flat_weights", "shapes_of"]
