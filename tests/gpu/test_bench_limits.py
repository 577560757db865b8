"""The benchmark's GPU limits that stand beside the one-copy ``offload-first`` sync: host->device
out of a registered ``/dev/shm`` segment, whole and a model's tensors one by one."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_the_registered_segments_rates_count_the_tensors_and_bytes_they_copy():
    from colo.apps.bench import MiB, measure_gpu_limits, registered_h2d_by_tensor

    got = registered_h2d_by_tensor([1000, 17, 4096, 3 * MiB], cap=2 * MiB)
    # 16-byte aligned as a flat buffer lays them; the 3 MiB tensor would end past the cap
    assert (got["tensors"], got["bytes"]) == (3, 1000 + 17 + 4096) and got["GBps"] > 0
    big = registered_h2d_by_tensor([3 * MiB], cap=2 * MiB)  # the first tensor is always taken
    assert (big["tensors"], big["bytes"]) == (1, 3 * MiB)
    limits = measure_gpu_limits(nbytes=64 * MiB, reps=2)
    assert limits["registered_shm_h2d_GBps"] > 0 and limits["pinned_h2d_GBps"] > 0
