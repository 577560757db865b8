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

A version is **staged** here (every tensor received, checked and registered) and becomes
**active** only when the driver points its requests at it (:meth:`colo.engine.vllm.VllmEngine
.activate_adapter`), after its digest checked: a failed or abandoned stage registers
nothing, and the version that served before serves on. Versions the driver keeps stay
registered for requests still in flight; the driver drops the rest.

This module imports vLLM (from its functions) and is used only inside a vLLM worker.
"""

from __future__ import annotations

from typing import Any

import torch

from colo.core.buckets import numel
from colo.core.errors import EngineStateError
from colo.core.interfaces import TensorSpec
from colo.digest import ReceivedDigest
from colo.dtypes import dtype_name
from colo.engine.kit import LoadSession, PieceAssembler
from colo.models.lora import AdapterConfig, adapter_shapes
from colo.models.specs import check_specs
from colo.transports.wire import Piece


class AdapterSink:
    """One adapter version at a time as the engine kit's :class:`~colo.engine.kit.WeightSink`:
    :meth:`prepare` says which version and config the next stage is, the kit's preflight,
    begin, loads and end do the rest, and the end registers it with vLLM."""

    def __init__(self, runner: Any, model_config: Any, device: Any):
        self.runner, self.model_config, self.device = runner, model_config, torch.device(device)
        self.config: AdapterConfig | None = None
        self.version: int | None = None
        #: PEFT name -> shape of the prepared version's tensors
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.session: LoadSession | None = None
        self.received = ReceivedDigest()
        self._pieces = PieceAssembler()
        #: the stage's tensors, copies of our own (the sender reuses its staging buffer)
        self._staged: dict[str, torch.Tensor] = {}
        #: version -> the digest of the tensors it was built from, in the accepted order
        self.digests: dict[int, str] = {}

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

    def loaded(self) -> list[int]:
        return sorted(int(i) for i in self.manager()._adapter_manager.list_adapters())

    def drop(self, version: int) -> bool:
        self.digests.pop(int(version), None)
        return bool(self.manager()._adapter_manager.remove_adapter(int(version)))

    # -- the stage -----------------------------------------------------------------------
    def prepare(self, version: Any, config: Any) -> None:
        """The next stage is ``version`` (an id > 0) of an adapter of ``config`` (its JSON);
        refused before any byte moves when vLLM cannot take it."""
        if self.session is not None:
            raise EngineStateError(f"adapter v{self.version} is being staged: end or abort it first")
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise ValueError(f"an adapter version is an integer of at least 1 (vLLM's lora_int_id), got {version!r}")
        cfg = AdapterConfig.from_json(config)
        wm = self.manager()
        if cfg.r > wm.lora_config.max_lora_rank:
            raise ValueError(f"adapter rank {cfg.r} is above this vLLM's max_lora_rank {wm.lora_config.max_lora_rank}: "
                             f"start it with max_lora_rank >= {cfg.r}")
        am = wm._adapter_manager
        if version not in am.list_adapters() and len(am) >= am.capacity:
            raise EngineStateError(f"no room to stage adapter v{version}: vLLM holds {len(am)} adapters "
                                   f"({', '.join(f'v{i}' for i in self.loaded())}) and max_cpu_loras is "
                                   f"{am.capacity}; drop one first, or start vLLM with a larger max_cpu_loras")
        self.shapes = adapter_shapes(self.model_config.hf_config, cfg)
        self.config, self.version = cfg, version

    def expected_specs(self) -> list[TensorSpec]:
        size = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return [TensorSpec(name=n, shape=s, dtype=self.dtype, nbytes=size * numel(s)) for n, s in self.shapes.items()]

    # -- WeightSink ----------------------------------------------------------------------
    def preflight(self, specs: list[TensorSpec]) -> None:
        self._require_prepared()
        check_specs(self.shapes, ((s.name, s.shape, s.dtype) for s in specs), self.dtype,
                    f"adapter v{self.version} does not match its config on the model vLLM serves "
                    f"(r={self.config.r}, targets {', '.join(self.config.targets)}; vLLM keeps adapters "
                    f"in {self.dtype})")

    def begin_load(self) -> None:
        self._require_prepared()
        if self.session is not None:
            raise EngineStateError("an adapter stage is already in progress (begin_load twice without end_load)")
        self.session = LoadSession(self.shapes)
        self.received.clear()
        self._pieces.clear()
        self._staged = {}

    def load_weights(self, named: Any) -> int:
        session = self._require_session()
        items = list(named)
        session.check(items)  # the whole request, before any of it is kept
        self.received.add_many(items)
        for name, tensor in items:
            if isinstance(tensor, Piece):
                self._staged.update(self._pieces.feed([(name, tensor)]))
            else:
                self._staged[name] = tensor.clone()
        return sum(session.advance(name, tensor) for name, tensor in items)

    def end_load(self) -> int:
        session = self._require_session()
        try:
            n = session.finish()
            self._register()
        except BaseException:
            self.abort()
            raise
        self.session = None
        self._staged = {}
        return n

    def flush_cache(self) -> None:
        raise EngineStateError("an adapter stage flushes no cache: the driver resets vLLM's prefix cache")

    def abort(self) -> None:
        """End a failed stage: nothing of it is registered; what was registered stays."""
        self.session = None
        self._staged = {}
        self._pieces.clear()

    # -- into vLLM -----------------------------------------------------------------------
    def _register(self) -> None:
        """The staged tensors as a ``LoRAModel`` of id ``version`` in vLLM's cache (what
        ``WorkerLoRAManager._load_adapter`` builds from a directory, built from memory)."""
        from vllm.lora.peft_helper import PEFTHelper
        from vllm.utils.gpu_sync_debug import gpu_sync_allowed

        wm = self.manager()
        helper = PEFTHelper.from_dict({**self.config.peft_dict(),
                                       "vllm_max_position_embeddings": wm.max_position_embeddings})
        helper.validate_legal(wm.lora_config)
        model = wm._adapter_manager.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        if mapper is not None:
            mapper = mapper.get_rename_mapper()
        lora = wm._lora_model_cls.from_lora_tensors(
            lora_model_id=self.version, tensors=self._staged, peft_helper=helper, device="cpu",
            dtype=wm.lora_config.lora_dtype, model_vocab_size=wm.vocab_size, weights_mapper=mapper,
            skip_prefixes=getattr(model, "lora_skip_prefixes", None))
        am = wm._adapter_manager
        with gpu_sync_allowed():
            am.remove_adapter(self.version)  # the same version staged again replaces itself
            am.add_adapter(lora)

    def _require_prepared(self) -> None:
        if self.version is None:
            raise EngineStateError("no adapter stage is prepared (colo_adapter_preflight names its version first)")

    def _require_session(self) -> LoadSession:
        if self.session is None:
            raise EngineStateError("no adapter stage is active (begin_load first)")
        return self.session


__all__ = ["AdapterSink"]
