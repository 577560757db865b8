"""The reference trainer: a transformers policy (a local checkpoint, or the demo's small
Qwen2), AdamW, and a REINFORCE step.

It is a ``TrainerSide``: its weights and optimizer state are the
``trainer.weights`` and ``trainer.optimizer`` tags, its extractor hands full
tensors in the engine's dtype to the transport, and its step learns from the
engine's rollouts. On the CPU, onload and offload move nothing (host memory is
the only memory; the ledger accounts for the simulated device); on a GPU the
memory backend pauses and resumes the trainer's regions.
"""

from __future__ import annotations

from typing import Any

import torch

from colo.trainers.base import PolicyTrainer, ReinforceConfig, new_optimizer, param_dtype_for  # noqa: F401


class ReferenceTrainer(PolicyTrainer):
    """``flat_weights``: the :class:`~colo.device.flat_weights.FlatWeights` the model's
    parameters were adopted into (their own storage, one buffer): the sync reads the
    engine's bytes straight out of it, or out of its shared host backup while paused
    (the one-copy sync of :mod:`colo.transports.packed`). It must hold the parameters
    in the engine's dtype for that; the memory backend pauses it as the weights tag."""

    def __init__(self, model: torch.nn.Module, *, engine_dtype: str = "bfloat16",
                 config: ReinforceConfig | None = None, memory_backend: Any = None, dp_group: Any = None,
                 flat_weights: Any = None):
        self.model = model
        self._dp_group = dp_group
        self.config = config or ReinforceConfig()
        self.engine_dtype = engine_dtype
        self.flat_weights = flat_weights
        self.opt = new_optimizer(self.model.parameters(), self.config)
        self._extractor = self._live_extractor()
        self._memory_backend = memory_backend
        self._cpu_twin: torch.nn.Module | None = None
        self.steps = 0

    def _live_extractor(self) -> Any:
        """Full tensors of the resident model in the engine dtype (a trainer whose
        parameters are sharded returns an extractor that gathers them)."""
        from colo.extractors.plain import PlainExtractor

        return PlainExtractor(self.model, dtype=getattr(torch, self.engine_dtype))

    def _sequence_logits(self, seq: torch.Tensor) -> torch.Tensor:
        return self.model(seq).logits

    def _new_cpu_twin(self) -> torch.nn.Module:
        """An unsharded CPU model of the same architecture, for logits while paused."""
        return type(self.model)(self.model.config).eval()

    # -- TrainerSide -----------------------------------------------------------
    def extractor(self) -> Any:
        if self._paused() and self.flat_weights is not None:
            # the shared host backup: allocated at the first pause and kept, so its views
            # and the extractor over them are made once (the one-copy layout too)
            if self._host_extractor is None:
                from colo.extractors.plain import PlainExtractor

                self._host_extractor = (None, PlainExtractor(self.flat_weights.host_tensors(),
                                                             dtype=getattr(torch, self.engine_dtype),
                                                             upload_to=self.flat_weights.device))
            return self._host_extractor[1]
        if self._paused():
            # offload-first on a GPU: the weights are paused, their pinned host
            # backup is the source; tensors are uploaded as buckets are built.
            return self._kept_host_extractor(self._new_host_extractor)
        return self._extractor

    def _new_host_extractor(self) -> Any:
        from colo.extractors.plain import PlainExtractor

        host = self.hf_state()  # the pinned backup's views while paused
        device = next(self.model.parameters()).device
        dtype = getattr(torch, self.engine_dtype)
        if all(p.dtype == dtype for p in self.model.parameters()):
            # nothing to convert: the transport uploads straight into its buffer
            return PlainExtractor(host, dtype=dtype, upload_to=device)
        # a conversion is due: the conversion kernel reads the pinned backup in place
        # (colo.device.zero_copy; a host-side conversion would be pageable and slow to upload)
        return PlainExtractor(host, dtype=dtype, device=device)

    def close(self) -> None:
        """The compute thread stops; the flat buffer's name (a ``/dev/shm`` segment on the
        CPU) and its shared host backup go: the parameters keep their mapping while
        the model lives, nothing outlives the process."""
        super().close()
        if self.flat_weights is not None:
            self.flat_weights.close()

    # -- verification ----------------------------------------------------------
    def hf_state(self) -> dict[str, torch.Tensor]:
        if self._paused() and self.flat_weights is not None:
            return self.flat_weights.host_tensors()  # named as named_parameters() names them
        if self._paused():
            # the device pages are unmapped: read the pinned host backup instead
            return {n: self._memory_backend.saver.host_view(p) for n, p in self.model.named_parameters()}
        return {n: p.detach() for n, p in self.model.named_parameters()}

    @torch.no_grad()
    def logits(self, tokens: list[list[int]]) -> torch.Tensor:
        if self._paused():
            # A CPU twin fed the host backup: touching the paused model would
            # read unmapped device memory.
            if self._cpu_twin is None:
                self._cpu_twin = self._new_cpu_twin()
            state = self.hf_state()
            # hf_state lists a tied parameter once (model.embed_tokens.weight); the
            # twin's state dict also has its second name (lm_head.weight)
            state.update({alias: state[first] for alias, first in tied_names(self._cpu_twin).items()
                          if first in state})
            self._cpu_twin.load_state_dict(state, strict=True)
            model, device = self._cpu_twin, torch.device("cpu")
        else:
            model, device = self.model, next(self.model.parameters()).device
        return model(torch.tensor(tokens, dtype=torch.long, device=device)).logits.float().cpu()


def tied_names(model: torch.nn.Module) -> dict[str, str]:
    """Second name of each tied parameter -> the name ``named_parameters()`` lists it under."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[name] = first[id(p)]
        else:
            first[id(p)] = name
    return out


def _data_parallel_world() -> Any:
    """The launcher's world when it has more than one rank; None: this trainer is alone."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


def build(*, model_config: Any, seed: int, engine_dtype: str, device: str,
          param_dtype: str | None = None, optimizer_state: bool = True,
          checkpoint: str | None = None) -> tuple[ReferenceTrainer, Any]:
    """The reference trainer, its parameters in ``param_dtype``
    (:func:`~colo.trainers.base.param_dtype_for`: on a GPU the engine's, with fp32
    master weights in the optimizer).

    One rank with parameters in the engine's dtype: they are adopted into one
    :class:`~colo.device.flat_weights.FlatWeights` buffer, the model's own storage
    from then on, which the engine reads straight from (the one-copy sync). On a GPU
    that buffer pauses to a shared pinned host backup; otherwise the weights live in
    a memory-saver region with a pinned host backup. The optimizer's state (masters
    and moments) lives in a region of its own, so offload and onload are real pauses;
    ``optimizer_state=False`` leaves it unmade (a trainer that only syncs:
    :mod:`colo.apps.bench_trainers`).

    With torch.distributed initialised over N > 1 ranks, this rank of an
    N-rank data-parallel trainer (see the module docstring). ``checkpoint``: the model is
    that local Hugging Face directory's (``from_pretrained``), not ``model_config``'s at random."""
    from colo.trainers.models import initial_model
    from colo.trainers.precision import cast_parameters

    dtype = param_dtype_for(param_dtype, engine_dtype, device)
    group = _data_parallel_world()
    one_copy = group is None and dtype == getattr(torch, engine_dtype)
    if device == "cpu":
        model = cast_parameters(initial_model(model_config, seed, checkpoint), dtype)
        flat = _adopt(model, "cpu") if one_copy else None
        return ReferenceTrainer(model, engine_dtype=engine_dtype, dp_group=group, flat_weights=flat), None
    from colo.device.cuda_memory import Saver, TrainerMemory

    saver = Saver()
    if one_copy:
        model = cast_parameters(initial_model(model_config, seed, checkpoint), dtype).to("cuda")
        flat = _adopt(model, "cuda")
        memory = TrainerMemory(saver, flats={"weights": flat})
    else:
        flat = None
        with saver.region("trainer.weights", cpu_backup=True):
            model = cast_parameters(initial_model(model_config, seed, checkpoint), dtype).to("cuda")
        memory = TrainerMemory(saver)
    trainer = ReferenceTrainer(model, engine_dtype=engine_dtype, memory_backend=memory, dp_group=group,
                               flat_weights=flat)
    if optimizer_state:
        with saver.region("trainer.optimizer", cpu_backup=True):
            trainer.init_optimizer_state()
    return trainer, saver


def _adopt(model: torch.nn.Module, device: str) -> Any:
    """The model's parameters moved into one flat buffer on ``device`` (their storage from now on)."""
    from colo.device.flat_weights import FlatWeights

    return FlatWeights.adopt(model, device=device)
