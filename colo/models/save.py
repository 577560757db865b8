"""What an engine starts from, written from the trainer's weights (the registry's ``starts_from``).

vLLM and SGLang start from a model directory as ``save_pretrained`` writes one (``hf_dir``:
``config.json`` and ``model.safetensors``, in the engine's dtype); colo's engine from a
safetensors file of the trainer's tensors (``state``). ``colo demo``, ``colo bench`` and the
rank workers of ``--gpus N`` all write it here, so an engine reads the same form whoever
started it. torch and safetensors are imported when a start is written, not with the package.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any


def start_path(starts_from: str, workdir: str) -> str:
    """Where :func:`save_start` writes a start of this form under ``workdir``."""
    if starts_from == "hf_dir":
        return os.path.join(workdir, "model")
    if starts_from == "state":
        return os.path.join(workdir, "init.safetensors")
    raise ValueError(f"an engine starts from 'hf_dir' or 'state', got {starts_from!r}")


def save_start(starts_from: str, config: Any, state: Mapping[str, Any], workdir: str, *,
               dtype: Any = None) -> str:
    """Write ``state`` (HF names -> tensors) under ``workdir`` in the form ``starts_from`` names;
    its path. ``dtype``: the tensors converted to it (None: as they are). Written under a
    temporary name and renamed, so a reader never sees half a file."""
    from safetensors.torch import save_file

    tensors = {k: (v.detach() if dtype is None else v.detach().to(dtype)).contiguous().cpu()
               for k, v in state.items()}
    path = target = start_path(starts_from, workdir)
    if starts_from == "hf_dir":
        config.save_pretrained(path)
        target = os.path.join(path, "model.safetensors")
    save_file(tensors, target + ".tmp")
    os.replace(target + ".tmp", target)
    return path


__all__ = ["save_start", "start_path"]
