"""Device memory: what the trainer and the engine hold on a GPU, and how it moves.

- :mod:`colo.device.cuda_memory` — torch_memory_saver regions by tag and the ledger that reads the device;
- :mod:`colo.device.cuda_ipc` — CUDA IPC and pinned shared host handles, keyed by GPU UUID;
- :mod:`colo.device.flat_weights` — a trainer's weights as views into one exportable buffer;
- :mod:`colo.device.zero_copy` — pinned host bytes read in place by a conversion kernel;
- :func:`canonical_device` — ``cuda`` and ``cuda:N`` of the current GPU as one device.

Nothing here imports ``torch.cuda`` state at import time; the CPU paths work without a GPU.
"""

from __future__ import annotations

from typing import Any

import torch


def canonical_device(device: Any) -> torch.device:
    """``device`` as a ``torch.device`` with its index: ``cuda`` is the current GPU, so
    ``cuda`` and ``cuda:0`` compare equal where GPU 0 is current; every other as given."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device
