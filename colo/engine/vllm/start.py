"""How a run starts vLLM: the registry's ``vllm`` entry (:data:`colo.engine.ENGINES`).

A real vLLM on a Hugging Face model directory (``build["checkpoint"]``) with colo's worker
extension and backend: on a CPU with the settings vLLM needs there (float32, token ids,
32-token blocks, 1 GiB of KV cache), on a GPU in sleep mode at the run's memory fraction.
Importing this module imports no vLLM.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any


async def start(build: dict, *, task: Any = None, env: Mapping[str, str] | None = None,
                options: Mapping[str, Any] | None = None, seed: int = 0, batch: int = 8) -> Any:
    """``options["processes"]``: vLLM's own engine-core and worker processes (else all in this
    process). ``batch``: the most sequences one generate holds (at least 8)."""
    from colo.engine.vllm import VllmEngine

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    logs_to(build.get("log_path"))
    gpu = str(build["device"]).startswith("cuda")
    return await VllmEngine.start(
        build["checkpoint"], task=task, processes=bool((options or {}).get("processes")), skip_tokenizer_init=True,
        dtype=build["dtype"], max_model_len=256, max_num_seqs=max(8, batch), seed=seed,
        enforce_eager=not gpu, enable_sleep_mode=gpu, block_size=None if gpu else 32,
        gpu_memory_utilization=build["mem_fraction_static"] if gpu else 0.2)


async def start_rank(host: Any, init_method: str, checkpoint: str | None) -> Any:
    """Engine rank ``host.spec.rank`` of the ``replicas`` layout: a whole vLLM beside trainer rank
    r, on its GPU, from the model directory rank 0 wrote (``checkpoint``; None, for a replacement:
    the same directory again, stale until the recovery sync fills it: vLLM cannot start empty).
    ``init_method`` names the engine group of a TP layout: replicas join none.

    In vLLM's own engine-core and worker processes, whatever ``--vllm-processes`` said: the rank's
    worker holds the trainer's process group, and a vLLM in that process would take the trainer's
    world for its own (``init_distributed_environment`` skips its own ``init_process_group`` where
    a default group is initialized, and builds its world group from it: N ranks against its
    TP=1). Those processes are spawned, never forked: vLLM spawns them itself on a CPU
    (``platforms/cpu.py``) and where CUDA is initialized (``utils/system_utils.py``); colo asks
    for it everywhere else, since a forked child would carry the trainer's group with it."""
    s = host.spec
    build = dict(host.engine_build)
    if checkpoint is not None:
        build["checkpoint"] = checkpoint
    if s.engine_log:
        build["log_path"] = s.engine_log
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    return await start(build, task=host.task, options={"processes": True}, seed=s.seed,
                       batch=int(s.task.get("batch", 8)))


def logs_to(path: str | None) -> None:
    """vLLM's log lines into the engine log (the console keeps the report)."""
    import logging

    if path is None:
        return
    os.environ["VLLM_CONFIGURE_LOGGING"] = "0"  # no handler of vLLM's own on the console
    logger = logging.getLogger("vllm")
    if not any(getattr(h, "baseFilename", None) == os.path.abspath(path) for h in logger.handlers):
        logger.addHandler(logging.FileHandler(path))
    logger.setLevel(logging.INFO)
    logger.propagate = False


__all__ = ["logs_to", "start", "start_rank"]
