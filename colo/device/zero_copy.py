"""Pinned host bytes read by a kernel, not moved by the copy engine (issue 18).

``offload-first`` uploads the trainer's weights from their pinned host backup.
Where the engine dtype differs from the trainer's (an fp32 trainer, a bf16
engine), the old path was three device operations per tensor: a copy-engine
upload into an fp32 temporary, a conversion kernel, then the pack's copy. This
module lets one kernel do all of it: a pinned host allocation is addressable
from the GPU at its host address (unified virtual addressing), so a CUDA tensor
over that address is read across PCIe by the conversion kernel itself, which
writes the engine-dtype result straight into its destination.

Why it matters for small models: measured on an H100 in the demo's own process
(``bench/sync_timeline.py --probe-upload``), the demo model's 51 per-tensor
uploads took 17-18 ms of GPU time while the engine's released KV pool (40 GB at
``--mem-fraction-static 0.5``) was being given back, against 0.5 ms in a process
without one; the same bytes read and converted by one kernel from the pinned
backup took 0.33 ms in that same window. The copy engines are what was busy.

A view never owns the host memory: it keeps the host tensor alive, and the
caller must keep the bytes unchanged until the kernels that read them are done
(the trainer stays paused for the whole sync).
"""

from __future__ import annotations

from typing import Any

import torch


class _HostBytes:
    """``__cuda_array_interface__`` over a pinned host tensor's bytes (one uint8 run)."""

    def __init__(self, t: torch.Tensor):
        self.owner = t  # the view's deleter releases this object, and with it the host tensor
        self.__cuda_array_interface__ = {"shape": (t.numel() * t.element_size(),), "typestr": "|u1",
                                         "data": (t.data_ptr(), False), "version": 3, "strides": None}


def device_view(t: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """A CUDA tensor on ``device`` over the same bytes as the pinned, contiguous host
    tensor ``t`` (same dtype and shape), or None where that cannot be had: not
    pinned, not contiguous, empty, or CUDA attributes the pointer to another GPU.
    The caller then falls back to an ordinary upload."""
    if t.device.type != "cpu" or device.type != "cuda" or t.numel() == 0 or not t.is_contiguous():
        return None
    if not t.is_pinned():
        return None  # pageable memory is not addressable from the GPU
    try:
        raw = torch.as_tensor(_HostBytes(t), device=device)
    except (RuntimeError, TypeError, ValueError):
        return None
    if raw.device != device or raw.data_ptr() != t.data_ptr():
        return None  # torch copied (another GPU's mapping): not a view, not what we want
    return raw.view(t.dtype).view(t.shape)


def convert_from_host(tensors: list[torch.Tensor], dtype: torch.dtype, device: torch.device,
                      align: int) -> list[torch.Tensor] | None:
    """``tensors`` (pinned host) converted to ``dtype`` on ``device`` by kernels that read
    the host bytes directly (see :func:`convert_run`). None when some tensor has no
    device view (the caller uploads those the ordinary way)."""
    views = [device_view(t, device) for t in tensors]
    if not tensors or any(v is None for v in views):
        return None
    return convert_run(views, dtype, device, align)


def convert_run(sources: list[torch.Tensor], dtype: torch.dtype, device: torch.device,
                align: int) -> list[torch.Tensor]:
    """``sources`` (tensors a kernel on ``device`` can read: its own memory or device
    views of pinned host bytes) converted to ``dtype`` into ONE new device buffer,
    each result at an ``align``-byte boundary in order (the bucket planner's padded
    layout, so a pack moves the whole run in one copy), written by one multi-tensor
    copy instead of an allocation and a kernel per tensor."""
    item = torch.empty((), dtype=dtype).element_size()
    offsets, end = [], 0
    for t in sources:
        offsets.append(end)
        end += -(-t.numel() * item // align) * align
    buf = torch.empty(end // item, dtype=dtype, device=device)
    out = [buf[o // item:o // item + t.numel()].view(t.shape) for o, t in zip(offsets, sources)]
    copy_all(out, sources)
    return out


def copy_all(dst: list[Any], src: list[Any]) -> None:
    """``dst[i].copy_(src[i])`` for every i, converting dtypes, in as few launches as torch allows."""
    # One fused launch for many small tensors (each a few µs of launch otherwise);
    # torch's private foreach copy converts dtypes on its fast path. Any refusal of
    # it (an older torch) falls back to one copy per tensor, same bytes.
    try:
        torch._foreach_copy_(dst, src)
    except (AttributeError, RuntimeError, NotImplementedError):
        for d, s in zip(dst, src):
            d.copy_(s)
