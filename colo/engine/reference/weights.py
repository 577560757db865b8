"""The engine's name map: where each trainer (Hugging Face) tensor lands in the fused
parameters, the checks a sync's spec list must pass, and the trainer-side mirror of
the engine's load (its fused state computed from HF tensors on the CPU, and its digest).

Like SGLang's and vLLM's model files, q/k/v live in one ``qkv_proj`` and gate/up in
one ``gate_up_proj``; the map says which row block of which parameter each HF name
fills, so the engine can say precisely which names a sync did not deliver.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from colo.core.buckets import itemsize, numel, spec
from colo.core.interfaces import TensorSpec
from colo.dtypes import DTypeLike, as_dtype, dtype_name
from colo.digest import expected_weights_digest, weights_digest
from colo.engine.reference.dims import TIED, Dims, dims_from_config
from colo.models.arch import expand
from colo.models.specs import check_specs, describe_unexpected


@dataclass(frozen=True)
class Shard:
    """Where one HF tensor lands: rows ``[row_offset, row_offset + shape[0])`` of ``param``."""

    hf_name: str
    param: str
    row_offset: int
    shape: tuple[int, ...]  # the HF tensor's shape


@dataclass(frozen=True)
class WeightMap:
    #: engine parameter name -> shape, in the engine's fixed order
    params: Mapping[str, tuple[int, ...]]
    #: HF name -> shard, in the engine's order (parts of a fused parameter in row order)
    shards: Mapping[str, Shard]
    #: HF names that are another parameter under a second name (tied embeddings)
    tied: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def build(cls, dims: Dims) -> WeightMap:
        """The map of ``dims``' architecture (its name tables, :mod:`colo.models.arch`)."""
        params: dict[str, tuple[int, ...]] = {}
        shards: dict[str, Shard] = {}
        for name, shape, parts in expand(dims.tables(), dims, dims.num_layers, tied=dims.tie_word_embeddings):
            params[name] = shape
            for hf_name, offset, hf_shape in parts:
                shards[hf_name] = Shard(hf_name, name, offset, hf_shape)
        return cls(params, shards, dict(TIED) if dims.tie_word_embeddings else {})

    def lm_head(self) -> str:
        """The engine parameter the logits are computed with."""
        return self.tied.get("lm_head.weight", "lm_head.weight")

    def unexpected(self, name: str) -> str:
        """How an HF name the map has no shard for is listed in a ``WeightMismatch``."""
        return describe_unexpected(name, self.tied)

    def nbytes(self, dtype: DTypeLike) -> int:
        size = itemsize(dtype_name(dtype))
        return sum(numel(shape) * size for shape in self.params.values())

    def hf_specs(self, dtype: DTypeLike) -> list[TensorSpec]:
        name = dtype_name(dtype)
        return [spec(s.hf_name, s.shape, name) for s in self.shards.values()]


def expected_hf_specs(config: Any, dtype: DTypeLike = torch.bfloat16) -> list[TensorSpec]:
    """Every HF name the engine expects in a sync, with its shape and the engine dtype."""
    return WeightMap.build(dims_from_config(config)).hf_specs(dtype)


def _check_specs(wmap: WeightMap, incoming: Iterable[Any], dtype: str | None, context: str) -> None:
    """Compare (name, shape[, dtype]) entries against the map; raise one WeightMismatch
    (:func:`colo.models.specs.check_specs`, the check every engine makes).

    ``dtype=None`` skips the dtype check (the in-process loader converts).
    """
    check_specs({n: s.shape for n, s in wmap.shards.items()}, incoming, dtype, context, tied=wmap.tied)


def _spec_triples(specs: Iterable[Any]) -> Iterator[tuple[str, tuple[int, ...], str]]:
    for s in specs:
        if isinstance(s, TensorSpec):
            yield s.name, tuple(s.shape), s.dtype
        else:
            name, shape, dt = s
            yield name, tuple(shape), dtype_name(dt)


def _named_items(named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]):
    return list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)


def engine_state_from_hf(hf_named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                         config: Any, dtype: DTypeLike = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Fuse trainer tensors into engine parameters on CPU, exactly as the loader would.

    Each HF tensor is converted to ``dtype`` on its own before concatenation,
    as the loader's per-slice ``copy_`` does, so the bits agree.
    """
    wmap = WeightMap.build(dims_from_config(config))
    items = _named_items(hf_named_tensors)
    _check_specs(wmap, ((n, t.shape, None) for n, t in items), None, "trainer state does not match the engine")
    target = as_dtype(dtype)
    by_name = dict(items)
    out: dict[str, torch.Tensor] = {}
    parts: dict[str, list[torch.Tensor]] = {name: [] for name in wmap.params}
    for shard in wmap.shards.values():  # row order within each parameter
        parts[shard.param].append(by_name[shard.hf_name].detach().to(device="cpu", dtype=target))
    for name, pieces in parts.items():
        out[name] = torch.cat(pieces, dim=0).contiguous()
    return out


def digest_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """The contract digest (:mod:`colo.digest`) of ``(name, tensor)`` pairs in the order given,
    each checksummed on its own device (a TP rank's shard digest uses it too)."""
    return weights_digest(named)


def expected_digest(hf_named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                    config: Any, dtype: DTypeLike = torch.bfloat16) -> str:
    """The digest colo's engine reports after receiving these trainer tensors in this order
    (the contract every engine meets, :mod:`colo.digest`: the HF-named tensors it received,
    in the trainer's spec order, each in the engine's dtype). Every name must be one the
    engine takes, exactly once (a tied model's separate ``lm_head.weight`` is refused)."""
    wmap = WeightMap.build(dims_from_config(config))
    items = _named_items(hf_named_tensors)
    _check_specs(wmap, ((n, t.shape, None) for n, t in items), None, "trainer state does not match the engine")
    target = as_dtype(dtype)
    return expected_weights_digest(dict(items), [n for n, _ in items], target)
