"""Device memory: what the trainer and the engine hold on a GPU, and how it moves.

- :mod:`colo.device.cuda_memory` — torch_memory_saver regions by tag and the ledger that reads the device;
- :mod:`colo.device.cuda_ipc` — CUDA IPC and pinned shared host handles, keyed by GPU UUID;
- :mod:`colo.device.flat_weights` — a trainer's weights as views into one exportable buffer;
- :mod:`colo.device.zero_copy` — pinned host bytes read in place by a conversion kernel;
- :mod:`colo.device.profile` — one process's part of a sync under torch.profiler (a diagnostic);
- :func:`canonical_device` — ``cuda`` and ``cuda:N`` of the current GPU as one device.

Nothing here imports ``torch.cuda`` state at import time; the CPU paths work without a GPU.
"""

from __future__ import annotations

from typing import Any

import torch


def canonical_device(device: Any) -> torch.device:
    """``device`` as a ``torch.device`` that compares equal to a tensor's ``.device`` on it:
    ``cuda`` is the current GPU, so ``cuda`` and ``cuda:0`` are one where GPU 0 is current;
    ``cpu:N`` is ``cpu`` (one host memory, and tensors say ``cpu``); every other as given.
    ``torch.device("cuda") != torch.device("cuda:0")``: an extractor told ``cuda`` took
    every staging view on ``cuda:0`` for another device's and gathered beside it instead
    (two H200s: one bucket more device memory and a pack copy, offload-first)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    elif device.type == "cpu":
        device = torch.device("cpu")
    return device
