"""A sync's spec list against a checkpoint's tensors: the check every engine's preflight makes.

A sync names its tensors by their Hugging Face names (``model.layers.0.self_attn.q_proj.weight``),
with a shape and a dtype. Whatever the engine (colo's own, vLLM's worker, SGLang's loaders),
what it can take is the tensors of the model's checkpoint (:func:`colo.models.arch.hf_shapes`),
each exactly once, in the engine's dtype; a tied model takes no ``lm_head.weight``.
:func:`check_specs` compares a list against them and refuses it with one
:class:`~colo.core.errors.WeightMismatch` naming every name at fault, before any byte moves.

Pure: no torch, no anyio (a dtype is its name, ``"bfloat16"``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from colo.core.buckets import spec
from colo.core.errors import WeightMismatch
from colo.core.interfaces import TensorSpec
from colo.models.arch import TIED, config_field, hf_shapes


def dtype_name(dtype: Any) -> str:
    """A dtype's name as specs carry it: ``"bfloat16"`` for ``torch.bfloat16`` or ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def tied_names(config: Any) -> Mapping[str, str]:
    """The HF names that are another tensor under a second name in ``config`` (a tied
    ``lm_head.weight`` is the embedding): none where the config does not tie them."""
    return TIED if bool(config_field(config, "tie_word_embeddings", False)) else {}


def describe_unexpected(name: str, tied: Mapping[str, str]) -> str:
    """How a name the checkpoint has no tensor for is listed in a ``WeightMismatch``."""
    if name in tied:
        # Refused rather than compared: a preflight sees only names and shapes, and a
        # trainer that sends a separate lm_head for a tied config has either untied it
        # (the engine would silently drop its values) or sends the same bytes twice.
        return (f"{name} (the config ties word embeddings: {tied[name]} is also the "
                f"{name.split('.')[0]}; send it once, without {name})")
    return name


def check_specs(expected: Mapping[str, tuple[int, ...]], incoming: Iterable[tuple[str, Any, Any]],
                dtype: str | None, context: str, *, tied: Mapping[str, str] | None = None) -> None:
    """Compare ``(name, shape, dtype)`` entries against ``expected`` (HF name -> shape, in the
    order a missing name is listed); raise one ``WeightMismatch`` naming every missing,
    unexpected, duplicate, misshapen or mistyped tensor. ``dtype=None`` skips the dtype
    check (a loader that converts). ``tied``: names refused with the tie explained."""
    tied = tied or {}
    seen: set[str] = set()
    duplicate, unexpected, wrong_shape, wrong_dtype = [], [], [], []
    for name, shape, got_dtype in incoming:
        if name in seen:
            duplicate.append(name)
            continue
        seen.add(name)
        want = expected.get(name)
        if want is None:
            unexpected.append(describe_unexpected(name, tied))
            continue
        if tuple(shape) != tuple(want):
            wrong_shape.append(f"{name} {tuple(shape)} (expected {tuple(want)})")
        if dtype is not None and got_dtype != dtype:
            wrong_dtype.append(f"{name} {got_dtype} (expected {dtype})")
    missing = [n for n in expected if n not in seen]
    err = WeightMismatch(context, missing=missing, unexpected=unexpected, duplicate=duplicate,
                         wrong_shape=wrong_shape, wrong_dtype=wrong_dtype)
    if not err.empty:
        raise err


def hf_specs(config: Any, dtype: Any) -> list[TensorSpec]:
    """Every tensor a sync of ``config``'s model carries: its HF name, its shape and ``dtype``,
    in the engine's order (the checkpoint's tensors, :func:`colo.models.arch.hf_shapes`)."""
    name = dtype_name(dtype)
    return [spec(n, shape, name) for n, shape in hf_shapes(config).items()]


__all__ = ["check_specs", "describe_unexpected", "dtype_name", "hf_specs", "tied_names"]
