"""Torch dtypes by name, spelled once: ``torch.bfloat16``, ``"bfloat16"`` and
``"torch.bfloat16"`` all name the same dtype."""

from __future__ import annotations

from typing import Union

import torch

DTypeLike = Union[torch.dtype, str]


def as_dtype(dtype: DTypeLike | None, *, allow_none: bool = False, what: str = "dtype") -> torch.dtype | None:
    """The torch dtype ``dtype`` names; ``None`` passes through where allowed
    (an extractor that keeps each tensor's own dtype)."""
    if dtype is None and allow_none:
        return None
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        found = getattr(torch, dtype.removeprefix("torch."), None)
        if isinstance(found, torch.dtype):
            return found
    raise ValueError(f"{what} {dtype!r} is not a torch dtype (expected e.g. torch.bfloat16 or 'bfloat16')")


#: torch dtype -> its name, filled as asked: extractors and transports name the dtype of every
#: tensor of every sync (a few microseconds each through str(), 5,380 calls a second of a
#: one-rank Megatron extraction's host time on the CPU)
_NAMES: dict[torch.dtype, str] = {}


def dtype_name(dtype: DTypeLike) -> str:
    if isinstance(dtype, torch.dtype):
        name = _NAMES.get(dtype)
        if name is None:
            name = _NAMES[dtype] = str(dtype).removeprefix("torch.")
        return name
    return str(as_dtype(dtype)).removeprefix("torch.")
