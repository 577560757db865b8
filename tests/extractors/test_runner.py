"""The multi-process runner the extractor tests rely on: a failing worker fails the test, with its traceback."""

from __future__ import annotations

import pytest

from tests.dist_helpers import run_workers


def failing_worker(rank: int, world: int, tmp_path) -> int:
    import torch.distributed as dist

    if rank == 1:
        raise RuntimeError("boom from rank 1")
    dist.barrier()  # rank 0 would wait here forever: the runner must stop it
    return rank


def echo_worker(rank: int, world: int, tmp_path, base: int) -> dict:
    import torch
    import torch.distributed as dist

    t = torch.tensor([base + rank])
    dist.all_reduce(t)
    return {"rank": rank, "sum": t}


def test_a_failing_worker_fails_the_test_with_its_traceback(tmp_path):
    with pytest.raises(AssertionError) as info:
        run_workers(failing_worker, tmp_path)
    text = str(info.value)
    assert "--- rank 1 ---" in text
    assert "Traceback (most recent call last)" in text
    assert 'raise RuntimeError("boom from rank 1")' in text
    assert "RuntimeError: boom from rank 1" in text


def test_results_come_back_per_rank(tmp_path):
    results = run_workers(echo_worker, tmp_path, 10)
    assert [(r["rank"], int(r["sum"])) for r in results] == [(0, 21), (1, 21)]
