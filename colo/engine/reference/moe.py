"""The engine's Qwen3-MoE: a sparse MoE block in place of the MLP, q/k RMSNorm, no attention bias.

The same math as transformers' ``Qwen3MoeForCausalLM`` (checked against it in
``tests/engine/test_moe.py``): per token the router's softmax over all experts, the
top-k kept (renormalised when ``norm_topk_prob``), each chosen expert's SwiGLU
weighted and summed; q and k are RMS-normalised per head before the rotary
embedding.

Layout, as SGLang's ``FusedMoE``: the experts of a layer live in two fused
parameters, ``mlp.experts.w13_weight`` (expert e's ``[gate_e; up_e]``, rows
``e * 2I .. (e + 1) * 2I``) and ``mlp.experts.w2_weight`` (expert e's down
projection, rows ``e * H .. (e + 1) * H``), so the engine's name table
(:meth:`MoEDims.tables`) maps each per-expert checkpoint tensor
(``mlp.experts.<e>.gate_proj.weight`` ...) to its row block the way the dense
table maps q/k/v into ``qkv_proj``. A sync delivers the checkpoint's names.

Tensor parallelism: **TP-MoE** (SGLang's default for Qwen3-MoE when no
``--ep-size`` is given): every rank holds every expert, each expert's
intermediate dimension split over the ranks exactly like the dense MLP's
(``gate``/``up`` rows and ``down`` columns: the ``intermediate_size`` axis of
:mod:`colo.engine.reference.tp`, which for a MoE is ``moe_intermediate_size``). Each rank
computes a partial sum over its slice of every chosen expert and the block's
output is all-reduced once, as the dense MLP's is. Chosen over EP-MoE (whole
experts per rank) because it needs no token dispatch (all-to-all) in the
engine, its load is balanced whatever the router picks, and it is the dense
TP engine with one more split tensor: the loader, the shard digests and the
sync's verification are the same code. The router (``mlp.gate.weight``) and the
q/k norms are replicated, so every rank routes every token identically.

Nothing here is tuned for speed: the experts run one by one over their tokens
(transformers' own loop), enough for the CPU tests and the probe; the
benchmarks never generate.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from colo.engine.reference.core import EngineCore
from colo.dtypes import DTypeLike
from colo.engine.reference.dims import MoEDims, is_moe_config  # noqa: F401 (re-exported)
from colo.engine.reference.model import EngineModel
from colo.engine.reference.tp import TPEngineCore, TPEngineModel, split_dims


class _MoEForward:
    """What Qwen3-MoE changes in ``EngineModel``'s forward: the sparse block in place of the
    MLP. The rest (its attention, without bias and with per-head q/k norms, as the
    architecture table says; embedding, rotary, KV pool, reduce, lm_head) is the dense
    model's, whole or one TP rank's shard when mixed into ``TPEngineModel``."""

    dims: MoEDims

    def _mlp(self, pre: str, x: torch.Tensor) -> torch.Tensor:
        """The sparse block in place of the dense MLP, on the tokens flattened."""
        b, t, _ = x.shape
        return self._moe(pre, x.reshape(b * t, -1)).view(b, t, -1)

    def _moe(self, pre: str, x: torch.Tensor) -> torch.Tensor:
        """The sparse block on ``[N, H]`` tokens: this rank's partial sum (the whole sum at TP=1)."""
        p, d = self._params, self.dims
        inter = d.intermediate_size  # this rank's slice of each expert
        # as transformers' Qwen3MoeTopKRouter: softmax in float32 over every expert, top-k,
        # optionally renormalised, then back to the activations' dtype
        probs = torch.softmax(F.linear(x, p[pre + "mlp.gate.weight"]), dim=-1, dtype=torch.float)
        weights, chosen = torch.topk(probs, d.top_k, dim=-1)
        if d.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        w13 = p[pre + "mlp.experts.w13_weight"].view(d.num_experts, 2 * inter, d.hidden_size)
        w2 = p[pre + "mlp.experts.w2_weight"].view(d.num_experts, d.hidden_size, inter)
        out = torch.zeros_like(x)
        for e in torch.unique(chosen).tolist():
            token, slot = torch.where(chosen == e)
            gate, up = F.linear(x[token], w13[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, w2[e]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out


class MoEEngineModel(_MoEForward, EngineModel):
    """The whole Qwen3-MoE on one device."""


class MoETPEngineModel(_MoEForward, TPEngineModel):
    """One rank of a TP-MoE engine: its heads, its slice of every expert, its vocabulary block."""


class MoEEngineCore(EngineCore):
    """``EngineCore`` around :class:`MoEEngineModel`."""

    def __init__(self, config: Any, *, dtype: DTypeLike = torch.bfloat16, device: str | torch.device = "cpu",
                 total_bytes: int, mem_fraction_static: float, init_state: Any = None, saver: Any = None) -> None:
        self._start(MoEEngineModel(config, dtype=dtype, device=device, total_bytes=total_bytes,
                                   mem_fraction_static=mem_fraction_static, saver=saver), init_state)


class MoETPEngineCore(TPEngineCore):
    """``TPEngineCore`` around :class:`MoETPEngineModel`."""

    def __init__(self, config: Any, *, tp_rank: int, tp_size: int, group: Any = None,
                 dtype: DTypeLike = torch.bfloat16, device: str | torch.device = "cpu", total_bytes: int,
                 mem_fraction_static: float, init_state: Any = None, saver: Any = None) -> None:
        self._start(MoETPEngineModel(config, tp_rank=tp_rank, tp_size=tp_size, group=group, dtype=dtype,
                                     device=device, total_bytes=total_bytes,
                                     mem_fraction_static=mem_fraction_static, saver=saver), init_state)


def expert_split_dims(config: Any, tp_size: int) -> dict[str, int]:
    """Each expert tensor's HF name -> the dimension a TP-MoE engine of ``tp_size`` ranks splits
    it on (0: gate and up rows, 1: down columns; the intermediate axis), what an extractor
    needs to send each rank only its slice (``MegatronExtractor(expert_scatter=...)``)."""
    return {n: d for n, d in split_dims(config, tp_size).items() if ".mlp.experts." in n}


def core_class(config: Any, *, tp: bool) -> type:
    """The engine core for ``config``: the MoE one for a Qwen3-MoE, else the dense one."""
    if is_moe_config(config):
        return MoETPEngineCore if tp else MoEEngineCore
    return TPEngineCore if tp else EngineCore
