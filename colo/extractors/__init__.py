"""Weight extractors: the trainer-side sources of full tensors in the engine's dtype.

One file per source: ``plain`` (an unsharded module or a name -> tensor
mapping), ``fsdp`` (FSDP2 ``fully_shard``: DTensor ``full_tensor()``),
``megatron`` (tensor-parallel shards in Megatron layout, pipeline and expert
parameters broadcast from their owner, Megatron names made HF). Each follows
``colo.core.interfaces.WeightExtractor``.
"""

from colo.extractors.fsdp import FSDPExtractor
from colo.extractors.megatron import LLAMA_RULES, MegatronExtractor, NameRule, global_name
from colo.extractors.plain import PlainExtractor

__all__ = ["FSDPExtractor", "LLAMA_RULES", "MegatronExtractor", "NameRule", "PlainExtractor", "global_name"]
