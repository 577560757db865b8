"""colo: the colocated trainer/engine GPU handoff as an explicit, traced state machine.

The public API is :data:`__all__`. Each name is imported from its module on
first use, so ``import colo`` pulls in nothing heavy: the pure core (phases,
invariants, ledger, buckets) stays importable without torch, and ``colo
replay`` never pays for it.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.2.0"  # the distribution colo-rl's version too (pyproject.toml); scheme: CHANGELOG.md

#: public name -> "module:attribute"
_API = {
    # the scheduler and its configuration; from synchronous code, through an event loop of its own
    "Scheduler": "colo.scheduler:Scheduler",
    "blocking": "colo.blocking:blocking",
    "SchedulerConfig": "colo.core.config:SchedulerConfig",
    "Phase": "colo.core.phases:Phase",
    "PLANS": "colo.core.phases:PLANS",
    "IllegalTransition": "colo.core.phases:IllegalTransition",
    # what the scheduler drives: the sides, the transport, one sync's context
    "TrainerSide": "colo.core.interfaces:TrainerSide",
    "EngineSide": "colo.core.interfaces:EngineSide",
    "EngineReceiver": "colo.core.interfaces:EngineReceiver",
    "WeightExtractor": "colo.core.interfaces:WeightExtractor",
    "Transport": "colo.core.interfaces:Transport",
    "TensorSpec": "colo.core.interfaces:TensorSpec",
    "RolloutResult": "colo.core.interfaces:RolloutResult",
    "SyncContext": "colo.core.interfaces:SyncContext",
    "SyncResult": "colo.core.interfaces:SyncResult",
    # memory
    "MemoryLedger": "colo.core.memory:MemoryLedger",
    "StagingBudget": "colo.core.memory:StagingBudget",
    # traces, offline
    "TraceWriter": "colo.trace.writer:TraceWriter",
    "replay": "colo.offline.replay:replay",
    "tune": "colo.offline.tune:tune",
    # transports and extractors
    "make_transport": "colo.transports:make_transport",
    "get_strategy": "colo.transports:get_strategy",
    "PlainExtractor": "colo.extractors.plain:PlainExtractor",
    "FSDPExtractor": "colo.extractors.fsdp:FSDPExtractor",
    "MegatronExtractor": "colo.extractors.megatron:MegatronExtractor",
    # engines: colo's own (a process behind a client) and the kit any engine hosts
    "EngineClient": "colo.engine.reference.client:EngineClient",
    "EngineKit": "colo.engine.kit:EngineKit",
    "InProcessEngine": "colo.engine.local:InProcessEngine",
    "VllmEngine": "colo.engine.vllm:VllmEngine",
    "SglangEngine": "colo.engine.sglang:SglangEngine",
    # LoRA: an engine whose syncs stage adapter versions (SchedulerConfig(sync_target="adapter")), and
    # what an adapter is (PEFT's layout)
    "AdapterEngine": "colo.engine.adapters:AdapterEngine",
    "AdapterConfig": "colo.models.lora:AdapterConfig",
    "EngineCapabilities": "colo.core.interfaces:EngineCapabilities",
    "EngineLifecycle": "colo.core.interfaces:EngineLifecycle",
    "EngineProbe": "colo.core.interfaces:EngineProbe",
    # the engines by name: a new engine is a folder and one entry
    "ENGINES": "colo.engine:ENGINES",
    "EngineEntry": "colo.engine:EngineEntry",
    "PieceAssembler": "colo.engine.kit:PieceAssembler",
    "LoadSession": "colo.engine.kit:LoadSession",
    "WeightSink": "colo.engine.kit:WeightSink",
    # the verification contract every engine meets, and the scheduler's verify and probe for it
    "weights_digest": "colo.digest:weights_digest",
    "verifier": "colo.verification:make_verifier",
    "ReceivedDigest": "colo.digest:ReceivedDigest",
    # errors
    "ColoError": "colo.core.errors:ColoError",
    "BadInput": "colo.core.errors:BadInput",
    "EngineError": "colo.core.errors:EngineError",
    "EngineDied": "colo.core.errors:EngineDied",
    "VerificationError": "colo.core.errors:VerificationError",
    "WeightMismatch": "colo.core.errors:WeightMismatch",
    "OutOfMemory": "colo.core.errors:OutOfMemory",
}

__all__ = sorted(_API) + ["__version__"]


def __getattr__(name: str) -> Any:
    try:
        module, attr = _API[name].split(":")
    except KeyError:
        raise AttributeError(f"module 'colo' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value  # once imported, a plain attribute
    return value


def __dir__() -> list[str]:
    return __all__
