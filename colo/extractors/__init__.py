"""Weight extractors: the trainer-side sources of full tensors in the engine's dtype.

One file per source: ``plain`` (an unsharded module or a name -> tensor
mapping), ``fsdp`` (FSDP2 ``fully_shard``: DTensor ``full_tensor()``),
``megatron`` (tensor-parallel shards in Megatron layout, pipeline and expert
parameters broadcast from their owner, Megatron names made HF). Each follows
``colo.interfaces.WeightExtractor``.
"""

from colo.extractors.plain import PlainExtractor

__all__ = ["PlainExtractor"]
