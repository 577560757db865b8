"""LoRA adapters into vLLM's worker, in memory: the adapter's tensors arrive through colo's
transports (the same receivers as the weights) and become a vLLM ``LoRAModel`` registered
with the worker's LoRA manager, with no file anywhere.

vLLM loads an adapter only from a directory (``LoRARequest(lora_path=...)``, read by
``WorkerLoRAManager._load_adapter``). Here the worker builds the same object from the
received tensors (``LoRAModel.from_lora_tensors``, as ``_load_adapter`` does after reading
its files; vLLM 0.32, ``vllm/lora/worker_manager.py``) and puts it into the manager's cache
under the adapter's version as its id. A request that names that id finds it registered
and only activates it (``LRUCacheWorkerLoRAManager.add_adapter``): the ``lora_path`` it
carries is never read.

The stage itself (checks, copies, digest) is colo's :class:`~colo.engine.adapter_host.AdapterStage`;
this module says what vLLM takes and registers it. A version is **staged** here (every tensor received, checked and registered) and becomes
**active** only when the driver points its requests at it (:meth:`colo.engine.vllm.VllmEngine
.activate_adapter`), after its digest checked: a failed or abandoned stage registers
nothing, and the version that served before serves on. Versions the driver keeps stay
registered for requests still in flight; the driver drops the rest.

This module imports vLLM (from its functions) and is used only inside a vLLM worker.
"""

from __future__ import annotations

from typing import Any

from colo.core.errors import EngineStateError
from colo.dtypes import dtype_name
from colo.engine.adapter_host import AdapterStage
from colo.models.lora import AdapterConfig


class AdapterSink(AdapterStage):
    """An adapter stage whose versions are vLLM ``LoRAModel`` s in the worker's LoRA manager,
    under the version as their id."""

    def __init__(self, runner: Any, model_config: Any, device: Any):
        super().__init__(model_config.hf_config, device)
        self.runner, self.model_config = runner, model_config

    # -- vLLM's LoRA manager -------------------------------------------------------------
    def manager(self) -> Any:
        wm = getattr(self.runner, "lora_manager", None)
        if wm is None:
            raise EngineStateError("this vLLM was started without LoRA: start it with enable_lora=True, "
                                   "max_lora_rank at least the adapter's rank and max_cpu_loras at least the "
                                   "versions kept plus one")
        return wm

    @property
    def dtype(self) -> str:
        """The dtype vLLM keeps adapters in (its ``lora_dtype``: the model's unless set)."""
        d = self.manager().lora_config.lora_dtype
        return dtype_name(self.model_config.dtype if d in (None, "auto") else d)

    def check(self, version: int, config: AdapterConfig) -> None:
        wm = self.manager()
        if config.r > wm.lora_config.max_lora_rank:
            raise ValueError(f"adapter rank {config.r} is above this vLLM's max_lora_rank "
                             f"{wm.lora_config.max_lora_rank}: start it with max_lora_rank >= {config.r}")
        am = wm._adapter_manager
        if version not in am.list_adapters() and len(am) >= am.capacity:
            raise EngineStateError(f"no room to stage adapter v{version}: vLLM holds {len(am)} adapters "
                                   f"({', '.join(f'v{i}' for i in self.loaded())}) and max_cpu_loras is "
                                   f"{am.capacity}; drop one first, or start vLLM with a larger max_cpu_loras")

    def loaded(self) -> list[int]:
        return sorted(int(i) for i in self.manager()._adapter_manager.list_adapters())

    def unregister(self, version: int) -> bool:
        return bool(self.manager()._adapter_manager.remove_adapter(int(version)))

    def register(self, version: int, config: AdapterConfig, tensors: dict) -> None:
        """The staged tensors as a ``LoRAModel`` of id ``version`` in vLLM's cache (what
        ``WorkerLoRAManager._load_adapter`` builds from a directory, built from memory)."""
        from vllm.lora.peft_helper import PEFTHelper
        from vllm.utils.gpu_sync_debug import gpu_sync_allowed

        wm = self.manager()
        helper = PEFTHelper.from_dict({**config.peft_dict(),
                                       "vllm_max_position_embeddings": wm.max_position_embeddings})
        helper.validate_legal(wm.lora_config)
        model = wm._adapter_manager.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        if mapper is not None:
            mapper = mapper.get_rename_mapper()
        lora = wm._lora_model_cls.from_lora_tensors(
            lora_model_id=version, tensors=tensors, peft_helper=helper, device="cpu",
            dtype=wm.lora_config.lora_dtype, model_vocab_size=wm.vocab_size, weights_mapper=mapper,
            skip_prefixes=getattr(model, "lora_skip_prefixes", None))
        am = wm._adapter_manager
        with gpu_sync_allowed():
            am.remove_adapter(version)  # the same version staged again replaces itself
            am.add_adapter(lora)


__all__ = ["AdapterSink"]
