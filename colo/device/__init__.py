"""Device memory: what the trainer and the engine hold on a GPU, and how it moves.

- :mod:`colo.device.cuda_memory` — torch_memory_saver regions by tag and the ledger that reads the device;
- :mod:`colo.device.cuda_ipc` — CUDA IPC and pinned shared host handles, keyed by GPU UUID;
- :mod:`colo.device.flat_weights` — a trainer's weights as views into one exportable buffer;
- :mod:`colo.device.zero_copy` — pinned host bytes read in place by a conversion kernel.

Nothing here imports ``torch.cuda`` state at import time; the CPU paths work without a GPU.
"""
