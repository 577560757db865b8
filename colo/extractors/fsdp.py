"""Extractor for an FSDP2 (``fully_shard``) trainer: DTensor shards gathered with ``full_tensor()``.

FSDP2 keeps each parameter as a DTensor sharded on dim 0 over the data-parallel
mesh (``torch.distributed.fsdp.fully_shard``, torch >= 2.6). ``full_tensor()``
is a collective over that mesh, so every rank must extract the same names in
the same order; every rank then holds the full tensor (only the sender uses it).
On a mesh of one rank the shard is the tensor and is read as it is (``to_local()``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from colo.extractors.plain import DTypeLike, PlainExtractor, engine_dtype_of, to_engine


class FSDPExtractor(PlainExtractor):
    """Full tensors from a module wrapped with ``fully_shard`` (same arguments as ``PlainExtractor``).

    Names and order are those of ``module.state_dict()``, which FSDP2 keeps
    free of its own prefixes. Reading the state dict also puts every
    parameter group back into its sharded state, so extraction sees the
    same DTensors on every rank even if a forward left some unsharded.
    """

    kind = "fsdp"

    def __init__(self, module: torch.nn.Module, *, dtype: DTypeLike = None,
                 device: torch.device | str | None = None,
                 rename: Callable[[str], str | None] | None = None):
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"fsdp extractor: expected the fully_shard-ed nn.Module, got {type(module).__name__}")
        super().__init__(module, dtype=dtype, device=device, rename=rename)

    def _check_tensor(self, name: str, t: torch.Tensor) -> None:
        pass  # DTensors are what this extractor is for; plain tensors pass through

    def _full(self, name: str, t: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        if not isinstance(t, DTensor):
            return to_engine(t, self.dtype, self.device)
        t = t.detach()
        local = t.to_local()
        if t.device_mesh.size() == 1 and local.shape == t.shape:
            # One rank: its shard is the whole tensor, and full_tensor() would only add
            # DTensor's redistribution, host work per tensor in every one-GPU sync (the
            # profile of a sync-first sync at Qwen2-1.5B on an H200, issue 44). The same
            # bits, converted and moved as any plain tensor.
            return to_engine(local, self.dtype, self.device)
        if self.device is not None:
            t = t.to(self.device)
        target = engine_dtype_of(t.dtype, self.dtype)
        # Cast the shard before the all-gather: the cast is elementwise, so the
        # bits are the same as casting the full tensor, and a bf16 gather moves
        # half the bytes of an fp32 one. Not for 1-byte floats: gloo refuses
        # float8 tensors ("Invalid scalar type"), so those are cast after.
        if target.itemsize > 1 or not target.is_floating_point:
            t = t.to(target)
        return t.full_tensor().to(target).contiguous()
