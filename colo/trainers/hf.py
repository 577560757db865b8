"""The reference trainer: a small HF Qwen2 policy, AdamW, and a REINFORCE step.

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

from colo.trainers.base import PolicyTrainer, ReinforceConfig  # noqa: F401 (re-exported)


class ReferenceTrainer(PolicyTrainer):
    def __init__(self, model: torch.nn.Module, *, engine_dtype: str = "bfloat16",
                 config: ReinforceConfig | None = None, memory_backend: Any = None, dp_group: Any = None):
        self.model = model
        self._dp_group = dp_group
        self.config = config or ReinforceConfig()
        self.engine_dtype = engine_dtype
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=self.config.lr, weight_decay=0.0)
        self._extractor = self._live_extractor()
        self._memory_backend = memory_backend
        self._cpu_twin: torch.nn.Module | None = None
        #: (what it was built over, the extractor of the paused weights' host backup)
        self._host_extractor: tuple[Any, Any] | None = None
        self._params: list[torch.nn.Parameter] | None = None
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
        if self._paused():
            # offload-first on a GPU: the weights are paused, their pinned host
            # backup is the source; tensors are uploaded as buckets are built.
            key = self._host_key()
            if key is None or self._host_extractor is None or self._host_extractor[0] != key:
                self._host_extractor = (key, self._new_host_extractor())
            return self._host_extractor[1]
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

    def _host_key(self) -> tuple | None:
        """What the host extractor was built over: the same parameters, and the saver's
        backups at the same addresses (the first and the last one checked each sync).
        With a retained backup (colo.device.cuda_memory.Saver's default) they stay from pause to
        pause, so the extractor, its host views and their device views are made once:
        building them was 1.8 ms of a 6.8 ms sync of the demo model on an H100. None
        (build anew) when the saver does not retain its backups."""
        saver = self._memory_backend.saver
        if not saver.retains_backups:
            return None
        if self._params is None:
            # this trainer never replaces a parameter object (the optimizer holds them);
            # walking the module for them again was 0.25 ms a sync on an H100 host
            self._params = list(self.model.parameters())
        first, last = self._params[0], self._params[-1]
        return id(first), id(last), saver.host_view(first).data_ptr(), saver.host_view(last).data_ptr()

    # -- verification ----------------------------------------------------------
    def hf_state(self) -> dict[str, torch.Tensor]:
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


def build(*, model_config: Any, seed: int, engine_dtype: str, device: str) -> tuple[ReferenceTrainer, Any]:
    """The reference trainer; on a GPU its weights and AdamW state live in memory-saver
    regions with a pinned host backup, so offload and onload are real pauses.

    With torch.distributed initialised over N > 1 ranks, this rank of an
    N-rank data-parallel trainer (see the module docstring)."""
    from colo.trainers.models import build_trainer_model

    group = _data_parallel_world()
    if device == "cpu":
        model = build_trainer_model(model_config, seed)
        return ReferenceTrainer(model, engine_dtype=engine_dtype, dp_group=group), None
    from colo.device.cuda_memory import Saver, TrainerMemory

    saver = Saver()
    with saver.region("trainer.weights", cpu_backup=True):
        model = build_trainer_model(model_config, seed).to("cuda")
    trainer = ReferenceTrainer(model, engine_dtype=engine_dtype, memory_backend=TrainerMemory(saver),
                               dp_group=group)
    with saver.region("trainer.optimizer", cpu_backup=True):
        trainer.init_optimizer_state()
    return trainer, saver
