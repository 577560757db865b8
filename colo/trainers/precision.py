"""Low-precision parameters with fp32 master weights: what a real trainer keeps.

A Megatron trainer with its distributed optimizer, an FSDP2 trainer with bf16
sharded parameters, an HF model trained in bf16: the model's parameters (what
the forward reads, what the engine gets) are bf16, and the optimizer keeps an
fp32 master copy of each beside its two AdamW moments. A step moves the
gradients onto the masters, steps the masters in fp32 and writes them back to
the parameters rounded to bf16. Small updates accumulate in the masters
instead of vanishing in bf16's 8-bit mantissa.

For colo this matters twice: the sync moves half the bytes of an fp32 trainer
(the engine's dtype is the parameters' dtype: nothing to convert, each byte
crosses the link once), and the ``trainer.weights`` tag is the bf16 parameters
while the masters are ``trainer.optimizer`` state, offloaded with the moments.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class MasterAdamW:
    """``torch.optim.AdamW`` stepping fp32 masters of ``params`` (tensors or DTensors of a
    lower precision), written back to ``params`` after each step.

    The masters and the moments are made by :meth:`init_state` (call it inside the
    memory region they belong to) or by the first :meth:`step`. What the trainer's
    step uses: ``zero_grad``, ``step``, and ``snapshot``/``restore`` for a failed step.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], **adamw: Any):
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("MasterAdamW: no parameters that require a gradient")
        if any(p.dtype == torch.float32 for p in self.params):
            # masters of fp32 parameters would be a second copy for nothing
            raise ValueError("MasterAdamW: the parameters are float32 already; use torch.optim.AdamW")
        self._adamw = dict(adamw)
        self.masters: list[torch.Tensor] | None = None
        self.inner: torch.optim.AdamW | None = None

    # -- state ---------------------------------------------------------------------
    @torch.no_grad()
    def init_state(self) -> None:
        """Allocate the masters (the parameters' values in fp32) and both AdamW moments now."""
        if self.inner is not None:
            return
        flat = self._flat_state()
        masters = []
        for i, p in enumerate(self.params):
            if flat is not None:
                m = flat[0][i]
                m.copy_(p.detach())
            else:
                m = p.detach().to(torch.float32)
                if m.data_ptr() == p.data_ptr():  # never alias: a parameter might already be fp32
                    m = m.clone()
            masters.append(m.requires_grad_(True))
        inner = torch.optim.AdamW(masters, **self._adamw)
        for i, m in enumerate(masters):
            state = inner.state[m]
            state["step"] = torch.tensor(0.0)
            if flat is not None:
                state["exp_avg"], state["exp_avg_sq"] = flat[1][i], flat[2][i]
            else:
                state["exp_avg"] = torch.zeros_like(m, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(m, memory_format=torch.preserve_format)
        self.masters, self.inner = masters, inner

    def _flat_state(self) -> list[list[torch.Tensor]] | None:
        """For parameters whose local tensors are contiguous and on one device: the masters,
        then each moment, as views of one fp32 buffer each (three allocations; the moments
        zeroed), in the parameters' order and shapes; None otherwise. A DTensor's (FSDP2's
        sharded parameter) are DTensors again, each over its view of the local buffers, with
        the parameter's mesh, placements, shape and stride.

        Why: the memory saver pauses and resumes a region allocation by allocation, and
        per-parameter state was over a thousand of them at Qwen2-1.5B (a master and two
        moments per parameter: 1014), each with its own copy and its own unmap or map; the
        trainer's pause and onload of 21.6 GB reached 0.85-0.91 of the link where the
        saver's own single 2.88 GiB allocation paused at 0.94 (one H200, issue 44); with
        three, hf's reached 0.95-0.99, and fsdp's, whose DTensor state kept one each,
        stayed at 0.83-0.85."""
        locals_ = [_local(p) for p in self.params]
        if any(t is None or not t.is_contiguous() for t in locals_) or len({t.device for t in locals_}) != 1:
            return None
        total = sum(t.numel() for t in locals_)
        device = locals_[0].device

        def views(buf: torch.Tensor) -> list[torch.Tensor]:
            out, at = [], 0
            for p, t in zip(self.params, locals_):
                v = buf[at:at + t.numel()].view(t.shape)
                at += t.numel()
                out.append(v if t is p else _like(p, v))
            return out

        masters = torch.empty(total, dtype=torch.float32, device=device)  # filled from the parameters
        return [views(masters)] + [views(torch.zeros(total, dtype=torch.float32, device=device)) for _ in range(2)]

    @property
    def state_bytes(self) -> int:
        """What the optimizer holds once initialised: a master and two moments per element, fp32."""
        return sum(3 * 4 * p.numel() for p in self.params)

    # -- the step --------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
        if self.masters is not None:
            for m in self.masters:
                m.grad = None

    @torch.no_grad()
    def step(self) -> None:
        self.init_state()
        assert self.masters is not None and self.inner is not None
        for p, m in zip(self.params, self.masters):
            # upcast gradient by gradient: only one fp32 gradient more than the step needs
            m.grad = None if p.grad is None else p.grad.to(torch.float32)
        self.inner.step()
        for p, m in zip(self.params, self.masters):
            if m.grad is not None:
                p.copy_(m)  # rounded to the parameter's dtype
            m.grad = None

    # -- a failed step ---------------------------------------------------------------
    def snapshot(self) -> Any:
        if self.inner is None:
            return None
        assert self.masters is not None
        return ([m.detach().clone() for m in self.masters],
                [{k: v.clone() if torch.is_tensor(v) else v for k, v in self.inner.state[m].items()}
                 for m in self.masters])

    @torch.no_grad()
    def restore(self, saved: Any) -> None:
        if saved is None:
            # the failed step was the first: it made the state, which is dropped again
            self.masters = self.inner = None
            return
        masters, states = saved
        assert self.masters is not None and self.inner is not None
        for m, old, st in zip(self.masters, masters, states):
            m.copy_(old)
            m.grad = None
            state = self.inner.state[m]
            for k, v in st.items():
                # into the tensors the state has (views of the flat buffers, in their memory
                # region), not the snapshot's own
                if torch.is_tensor(v) and torch.is_tensor(state.get(k)) and state[k].shape == v.shape:
                    state[k].copy_(v)
                else:
                    state[k] = v


def _local(p: torch.Tensor) -> torch.Tensor | None:
    """The plain tensor that holds ``p``'s elements on this rank: ``p`` itself (a plain
    parameter, returned as the very object), a DTensor's local shard, or None (anything else)."""
    if type(p.detach()) is torch.Tensor:
        return p
    from torch.distributed.tensor import DTensor

    return p.to_local() if isinstance(p, DTensor) else None


def _like(p: Any, local: torch.Tensor) -> torch.Tensor:
    """A DTensor laid out as ``p`` (mesh, placements, global shape and stride) over ``local``,
    which it keeps: no copy, no collective (``run_check=False``)."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


@torch.no_grad()
def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``model`` with its parameters (only) in ``dtype``; buffers keep theirs.

    Not ``model.to(dtype)``: that also rounds floating buffers, and a Qwen2's
    rotary ``inv_freq`` in bf16 puts every position's angle off by up to 0.4 %,
    where transformers (loading in bf16) and the engines keep it in fp32. The
    Parameter objects stay (``.data`` is swapped), with whatever a framework
    marked them with."""
    for p in model.parameters():
        if p.dtype != dtype and p.dtype.is_floating_point:
            p.data = p.data.to(dtype)
    return model


__all__ = ["MasterAdamW", "cast_parameters"]
