"""The executor of one rank of a vLLM of ``tensor_parallel_size=N`` whose ranks colo starts.

vLLM's ``ExecutorWithExternalLauncher`` (``vllm/v1/executor/uniproc_executor.py``) is vLLM's
executor for ranks a launcher starts itself (torchrun): one worker in this process, with the
engine core beside it, each rank fed the same requests. It names its rank from torchrun's
environment (``RANK``, ``LOCAL_RANK``) and its distributed init method as ``env://``. colo's
ranks are not torchrun's, so :class:`RankExecutor` says both itself:

- the rank is this process's rank in the default process group (the trainer's, which vLLM
  takes for its world), which must already exist;
- the init method names the run (:data:`RANK_IDENT_ENV`, set by :mod:`colo.engine.vllm.start`):
  vLLM's CPU worker names the shared-memory segments of its TP communicator after it
  (``VLLM_DIST_IDENT``, ``cpu_worker.py``), and with ``env://`` every run on a machine would
  name them alike (two runs at once would share segments). The default group exists, so vLLM
  never connects to it (``init_distributed_environment`` skips ``init_process_group``);
- the local rank is 0: a rank's worker sees one GPU, its own (``CUDA_VISIBLE_DEVICES``), and
  on a CPU it picks nothing.

Importing this module imports vLLM: :mod:`colo.engine.vllm.start` imports it only for a TP rank.
"""

from __future__ import annotations

import os

import torch.distributed as dist
from vllm.v1.executor.uniproc_executor import ExecutorWithExternalLauncher

#: the run's name for vLLM's TP ranks, set before vLLM starts
RANK_IDENT_ENV = "COLO_VLLM_RANK_IDENT"


class RankExecutor(ExecutorWithExternalLauncher):
    """``ExecutorWithExternalLauncher`` with colo's rank and run name."""

    def _distributed_args(self) -> tuple[str, int, int]:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("a rank of a vLLM of TP=N runs in a rank's worker, whose trainer process group is "
                               "vLLM's world: none is initialized in this process")
        ident = os.environ.get(RANK_IDENT_ENV)
        if not ident:
            raise RuntimeError(f"{RANK_IDENT_ENV} is not set: colo.engine.vllm.start names the run before vLLM starts")
        # file://<name>: vLLM's CPU worker takes the name's last part for VLLM_DIST_IDENT
        return f"file:///{ident}", dist.get_rank(), 0


__all__ = ["RANK_IDENT_ENV", "RankExecutor"]
