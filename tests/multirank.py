"""Shared by the multi-rank tests: one 2-rank CPU demo run per configuration, run once per session.

A 2-rank run starts two worker processes and two engine ranks on a 2-core
machine: the same clean run serves the process-launcher tests and the Ray
tests, which compare against it.
"""

from __future__ import annotations

import anyio

from colo.apps.demo import DemoConfig, run

#: small rollouts: four processes share two cores, and a TP=2 engine all-reduces per layer per token
SMALL = dict(device="cpu", batch=8, new_tokens=8, prompt_len=6)

_CACHE: dict[tuple, tuple] = {}


def two_rank_run(tmp_path, name: str, on_cycle=None, **kw):
    """``colo demo --gpus 2`` with SMALL rollouts (3 steps unless given); (outcome, per-rank trace paths)."""
    trace = tmp_path / f"{name}.jsonl"
    cfg = DemoConfig(**{**SMALL, "steps": 3, "gpus": 2, "trace": str(trace), **kw})
    out = anyio.run(lambda: run(cfg, progress=False, on_cycle=on_cycle))
    return out, [tmp_path / f"{name}.rank0.jsonl", tmp_path / f"{name}.rank1.jsonl"]


def shared_run(tmp_path_factory, **kw):
    """:func:`two_rank_run` once per session for each configuration ``kw``."""
    key = tuple(sorted(kw.items()))
    if key not in _CACHE:
        name = "-".join(f"{k}={v}" for k, v in key).replace("@", "_") or "default"
        _CACHE[key] = two_rank_run(tmp_path_factory.mktemp("shared"), name, **kw)
    return _CACHE[key]
