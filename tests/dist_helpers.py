"""Shared by the extractor tests: a multi-process runner on gloo, bit equality, a tiny HF-named model.

``run_workers(fn, tmp_path)`` starts ``world_size`` processes; each joins a gloo
group rendezvousing through a file in ``tmp_path``, calls
``fn(rank, world_size, tmp_path, *args)`` and saves what it returns with
``torch.save``. A worker that raises writes its traceback and exits; the
parent then stops the others (they would wait forever in a collective) and
fails the test with every traceback it got.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

#: a guard against a hang, not a measurement: a healthy run takes seconds
HANG_GUARD_S = 240
_GRACE_S = 2.0  # after one worker fails, time for the others to write their own tracebacks


def _entry(fn: Callable, rank: int, world_size: int, tmp: str, args: tuple) -> None:
    tmp_path = Path(tmp)
    try:
        import torch.distributed as dist

        torch.set_num_threads(1)  # two workers share two cores
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=HANG_GUARD_S / 2))
        try:
            result = fn(rank, world_size, tmp_path, *args)
        finally:
            dist.destroy_process_group()
        torch.save(result, tmp_path / f"result{rank}.pt")
    except BaseException:
        (tmp_path / f"error{rank}.txt").write_text(traceback.format_exc())
        os._exit(1)


_PRELOAD = ["torch", "torch.distributed.fsdp", "torch.distributed.tensor", "torch._dynamo",
            "colo.extractors", "tests.dist_helpers"]
_context = None


def _mp_context():
    # A fork server: a clean process (unlike pytest's) that imports torch, FSDP
    # and dynamo (FSDP2 pulls it in) once, then forks every worker of every
    # test; spawning each worker afresh would pay ~5 s of imports apiece.
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(_PRELOAD)
    return _context


def run_workers(fn: Callable, tmp_path: Path, *args: Any, world_size: int = 2) -> list[Any]:
    """``fn`` must be a module-level function (the workers import it by name)."""
    ctx = _mp_context()
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, str(tmp_path), args), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + HANG_GUARD_S
    failed_at = None
    try:
        while any(p.is_alive() for p in procs):
            if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                failed_at = time.monotonic()
            now = time.monotonic()
            if now > deadline or (failed_at is not None and now - failed_at > _GRACE_S):
                break
            time.sleep(0.02)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join(5)
    errors = [f"--- rank {r} ---\n{(tmp_path / f'error{r}.txt').read_text()}"
              for r in range(world_size) if (tmp_path / f"error{r}.txt").exists()]
    codes = [p.exitcode for p in procs]
    if errors or any(c != 0 for c in codes):
        hung = " (hang guard hit)" if time.monotonic() > deadline else ""
        raise AssertionError(f"worker processes failed{hung}, exit codes {codes}:\n" + "\n".join(errors))
    return [torch.load(tmp_path / f"result{r}.pt", weights_only=True) for r in range(world_size)]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers, so equality is bit equality (NaN and -0.0 included)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(ints[t.element_size()])


def assert_bit_equal(got: torch.Tensor, want: torch.Tensor, name: str = "") -> None:
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.equal(bits(got), bits(want)), f"{name}: values differ"


class _Attn(nn.Module):
    def __init__(self, hidden: int, heads: int, groups: int, head_dim: int):
        super().__init__()
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=True)
        self.k_proj = nn.Linear(hidden, groups * head_dim, bias=True)
        self.v_proj = nn.Linear(hidden, groups * head_dim, bias=True)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)


class _MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)


class _MoE(nn.Module):
    def __init__(self, hidden: int, inter: int, experts: int):
        super().__init__()
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(_MLP(hidden, inter) for _ in range(experts))


class _Norm(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))


class _Layer(nn.Module):
    def __init__(self, hidden, heads, groups, head_dim, inter, experts):
        super().__init__()
        self.input_layernorm = _Norm(hidden)
        self.self_attn = _Attn(hidden, heads, groups, head_dim)
        self.post_attention_layernorm = _Norm(hidden)
        self.mlp = _MoE(hidden, inter, experts) if experts else _MLP(hidden, inter)


class _Body(nn.Module):
    def __init__(self, vocab, hidden, heads, groups, head_dim, inter, layers, experts):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(_Layer(hidden, heads, groups, head_dim, inter, experts) for _ in range(layers))
        self.norm = _Norm(hidden)
        # like HF's rotary inv_freq: not part of the state dict, so never sent
        self.register_buffer("inv_freq", torch.arange(4.0), persistent=False)


class TinyLlama(nn.Module):
    """Qwen2-shaped (q/k/v biases, grouped KV heads, SwiGLU), HF checkpoint names, every
    parameter drawn from ``seed`` so separate processes build identical copies."""

    VOCAB, HIDDEN, HEADS, GROUPS, HEAD_DIM, INTER = 37, 8, 4, 2, 2, 12

    def __init__(self, seed: int = 0, *, layers: int = 2, experts: int = 0):
        super().__init__()
        self.model = _Body(self.VOCAB, self.HIDDEN, self.HEADS, self.GROUPS, self.HEAD_DIM, self.INTER,
                           layers, experts)
        self.lm_head = nn.Linear(self.HIDDEN, self.VOCAB, bias=False)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
