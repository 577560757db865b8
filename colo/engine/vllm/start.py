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
    tp: dict[str, Any] = {}
    if build.get("tp"):
        # one rank of a vLLM of TP=N in this process (start_rank, the tp layout)
        from colo.engine.vllm.executor import RANK_IDENT_ENV, RankExecutor

        tp = {"tensor_parallel_size": int(build["tp"]["size"]), "distributed_executor_backend": RankExecutor}
        os.environ[RANK_IDENT_ENV] = str(build["tp"]["ident"])
    lora: dict[str, Any] = {}
    if build.get("lora"):
        # a run that syncs a LoRA adapter (colo.engine.adapters): vLLM's LoRA manager, one adapter a
        # batch, the kept versions and the one being staged in its CPU cache
        rank, keep = int(build["lora"]["rank"]), int(build["lora"]["keep"])
        lora = {"enable_lora": True, "max_lora_rank": next(r for r in LORA_RANKS if r >= rank), "max_loras": 1,
                "max_cpu_loras": keep + 1}
    engine = await VllmEngine.start(
        build["checkpoint"], task=task, processes=bool((options or {}).get("processes")), skip_tokenizer_init=True,
        dtype=build["dtype"], max_model_len=256, max_num_seqs=max(8, batch), seed=seed,
        enforce_eager=not gpu, enable_sleep_mode=gpu, block_size=None if gpu else 32,
        gpu_memory_utilization=build["mem_fraction_static"] if gpu else 0.2, **tp, **lora)
    if lora:
        engine.keep_adapters = int(build["lora"]["keep"])
    return engine


#: the ranks vLLM 0.32 takes as max_lora_rank (``vllm.config.lora.MaxLoRARanks``): an adapter's
#: rank is served by the least of them at or above it
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)



async def start_rank(host: Any, init_method: str, checkpoint: str | None) -> Any:
    """Engine rank ``host.spec.rank`` beside trainer rank r, on its GPU, from the model directory
    rank 0 wrote (``checkpoint``; None, for a replacement: the same directory again, stale until
    the recovery sync fills it: vLLM cannot start empty). In the layout the spec names:
    ``replicas`` (:func:`_start_replica`) or ``tp`` (:func:`_start_tp_rank`)."""
    s = host.spec
    build = dict(host.engine_build)
    if checkpoint is not None:
        build["checkpoint"] = checkpoint
    if s.engine_log:
        build["log_path"] = s.engine_log
    if s.layout == "tp" and s.world_size > 1:
        return await _start_tp_rank(host, build)
    return await _start_replica(host, build)


async def _start_tp_rank(host: Any, build: dict) -> Any:
    """Rank r of one vLLM of ``tensor_parallel_size=N``, in this process (the rank's worker).

    vLLM's executor for launchers that start its ranks themselves (``external_launcher``, as
    torchrun does; colo's :class:`~colo.engine.vllm.executor.RankExecutor` names the rank): every
    rank runs its own engine core and one worker, all fed the same requests in the same order,
    and their TP collectives meet in vLLM's groups. Its world is the trainer's process group,
    already initialized here (``init_distributed_environment`` builds vLLM's world group from a
    default group it finds, then its TP group over the same ranks): so all N ranks start their
    vLLM together, as they do. Trainer rank r hands engine rank r the whole tensors of each
    bucket, and vLLM's own weight loaders keep rank r's shard of them (its TP slicing, not colo's).
    In the trainer's process it cannot be killed on its own (the registry refuses a kill fault)."""
    s = host.spec
    # the shared-memory groups of vLLM's CPU communicator are named after it: one per run
    build["tp"] = {"rank": s.rank, "size": s.world_size, "ident": f"colo-{os.path.basename(s.workdir)}"}
    return await start(build, task=host.task, options={"processes": False}, seed=s.seed,
                       batch=int(s.task.get("batch", 8)))


async def _start_replica(host: Any, build: dict) -> Any:
    """A whole vLLM (the ``replicas`` layout): replicas join no engine group.

    In vLLM's own engine-core and worker processes, whatever ``--vllm-processes`` said: the rank's
    worker holds the trainer's process group, and a vLLM in that process would take the trainer's
    world for its own (``init_distributed_environment`` skips its own ``init_process_group`` where
    a default group is initialized, and builds its world group from it: N ranks against its
    TP=1). Those processes are spawned, never forked: vLLM spawns them itself on a CPU
    (``platforms/cpu.py``) and where CUDA is initialized (``utils/system_utils.py``); colo asks
    for it everywhere else, since a forked child would carry the trainer's group with it."""
    s = host.spec
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    return await start(build, task=host.task, options={"processes": True}, seed=s.seed,
                       batch=int(s.task.get("batch", 8)))


def check_tp(model_config: Any, n: int) -> None:
    """A vLLM of TP=n splits the query heads and the MLP rows n ways, and the KV heads n ways or
    replicates them (n a multiple of their count), as its linear layers do; refused otherwise
    (ValueError naming the field), before any rank starts."""
    heads = int(model_config.num_attention_heads)
    kv = int(getattr(model_config, "num_key_value_heads", None) or heads)
    rows = int(model_config.intermediate_size)
    for name, value in (("num_attention_heads", heads), ("intermediate_size", rows)):
        if value % n:
            raise ValueError(f"a vLLM of TP={n} splits {name} {n} ways: {value} is not a multiple of {n}")
    if kv % n and n % kv:
        raise ValueError(f"a vLLM of TP={n} splits num_key_value_heads {n} ways or replicates them: {kv} is "
                         f"neither a multiple nor a divisor of {n}")


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


__all__ = ["LORA_RANKS", "check_tp", "logs_to", "start", "start_rank"]
