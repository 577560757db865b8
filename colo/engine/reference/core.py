"""``EngineCore``: the in-process engine state machine around ``EngineModel``.

It plays the part of SGLang's scheduler + model runner for colo: memory tags
that can be released and resumed (``weights``, ``kv_cache``, ``cuda_graph``),
a weight version that says whether the held weights are a complete, known
sync, and generation that refuses to run on anything else. The engine
process (another module) wraps it behind a control channel; tests drive it
directly.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from colo.core.memory import OWNERS_TAGS
from colo.core.errors import EngineStateError, WeightMismatch  # noqa: F401 (re-exported)
from colo.dtypes import DTypeLike, dtype_name  # noqa: F401
from colo.engine.reference.model import EngineModel  # noqa: F401
from colo.core.interfaces import EngineCapabilities, TensorSpec

TAGS = OWNERS_TAGS["engine"]  # the one vocabulary of tags (colo.core.memory)


class EngineCore:
    """One engine's state: which tags are resident, what weight version it holds.

    ``weight_version`` is ``None`` (stale) whenever the weights cannot be
    vouched for: after they were released or resumed (storage is fresh and
    uninitialised), from the moment a load begins, and after a failed load.
    Only ``set_weight_version`` makes them current again, and it refuses
    unless a complete load (every expected name exactly once) has finished
    since the storage was last allocated.
    """

    #: colo's engine has every tag, frees what it releases, answers the logits probe, and
    #: digests its own weights (the row blocks its forward reads)
    capabilities = EngineCapabilities(tags=TAGS, digest_live=True)

    def __init__(self, config: Any, *, dtype: DTypeLike = torch.bfloat16, device: str | torch.device = "cpu",
                 total_bytes: int, mem_fraction_static: float,
                 init_state: Mapping[str, torch.Tensor] | None = None, saver: Any = None) -> None:
        #: the model's config (a LoRA adapter's shapes are read from it)
        self.config = config
        self._start(EngineModel(config, dtype=dtype, device=device, total_bytes=total_bytes,
                                mem_fraction_static=mem_fraction_static, saver=saver), init_state)

    def _start(self, model: Any, init_state: Mapping[str, torch.Tensor] | None) -> None:
        """The core's state around ``model`` (a whole model, or one tensor-parallel
        rank's); loads ``init_state`` as weight version 0 when given."""
        self.model = model
        self._paused: set[str] = set()
        self._version: int | None = None
        # the weights hold a complete load since their storage was last allocated
        self._complete = False
        if init_state is not None:
            self.begin_load()
            self.load_weights(init_state)
            self.end_load()
            self._version = 0

    @property
    def device(self) -> torch.device:
        """Where the parameters live (the engine kit maps a sync's buffers onto it)."""
        return self.model.device

    # -- memory tags -----------------------------------------------------------

    def tag_bytes(self) -> dict[str, int]:
        """Bytes of each tag when resident. No CUDA graphs are captured here: 0."""
        return {"weights": self.model.weight_bytes, "kv_cache": self.model.kv_bytes, "cuda_graph": 0}

    def resident_bytes(self) -> dict[str, int]:
        """Bytes held right now, counted from the live tensors."""
        return {**self.model.resident_bytes(), "cuda_graph": 0}

    @property
    def paused_tags(self) -> frozenset[str]:
        return frozenset(self._paused)

    @property
    def kv_bytes(self) -> int:
        return self.model.kv_bytes

    def _check_tags(self, tags: Sequence[str], action: str) -> list[str]:
        if isinstance(tags, str):
            raise ValueError(f"tags must be a sequence of tag names, got the string {tags!r}")
        tags = list(tags)
        unknown = [t for t in tags if t not in TAGS]
        if unknown:
            raise ValueError(f"cannot {action} unknown tag(s) {', '.join(map(repr, unknown))}; "
                             f"expected some of {', '.join(TAGS)}")
        repeated = sorted({t for t in tags if tags.count(t) > 1})
        if repeated:
            raise ValueError(f"cannot {action} tag(s) {', '.join(repeated)} twice in one call")
        return tags

    def release(self, tags: Sequence[str]) -> None:
        """Free the tags' memory. All tags are checked before any is freed."""
        tags = self._check_tags(tags, "release")
        paused = [t for t in tags if t in self._paused]
        if paused:
            raise EngineStateError(f"cannot release tag(s) {', '.join(paused)}: already released "
                                   f"(a memory saver aborts the process on a double pause)")
        for tag in tags:
            if tag == "weights":
                self.model.free_weights()
                self._version = None
                self._complete = False
            elif tag == "kv_cache":
                self.model.free_kv()
            self._paused.add(tag)

    def resume(self, tags: Sequence[str]) -> None:
        """Re-allocate the tags' memory. Resumed weights are uninitialised: stale until a load."""
        tags = self._check_tags(tags, "resume")
        resident = [t for t in tags if t not in self._paused]
        if resident:
            raise EngineStateError(f"cannot resume tag(s) {', '.join(resident)}: already resident")
        for tag in tags:
            if tag == "weights":
                self.model.allocate_weights()
                self._version = None
                self._complete = False
            elif tag == "kv_cache":
                self.model.allocate_kv()
            self._paused.discard(tag)

    def flush_cache(self) -> None:
        self.model.flush_cache()

    # -- weight version --------------------------------------------------------

    @property
    def weight_version(self) -> int | None:
        return self._version

    def set_weight_version(self, version: int | None) -> None:
        if version is None:
            self._version = None
            return
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"weight version must be a non-negative int or None, got {version!r}")
        if "weights" in self._paused:
            raise EngineStateError(f"cannot set weight version {version}: engine weights are released")
        if self.model.loading:
            raise EngineStateError(f"cannot set weight version {version}: a load is in progress")
        if not self._complete:
            raise EngineStateError(f"cannot set weight version {version}: the weights have not been "
                                   f"completely loaded since they were last allocated")
        self._version = version

    # -- loading ---------------------------------------------------------------

    def param_specs(self) -> list[TensorSpec]:
        """Every HF name the engine expects, with its shape and the engine dtype."""
        return self.model.expected_specs()

    def preflight(self, specs: Iterable[TensorSpec | tuple[str, Sequence[int], DTypeLike]]) -> None:
        self.model.preflight(specs)

    def _refuse_if_weights_released(self, what: str) -> None:
        if "weights" in self._paused:
            raise EngineStateError(f"cannot {what}: engine weights are released (resume 'weights' first)")

    def begin_load(self) -> None:
        self._refuse_if_weights_released("begin a load")
        self.model.begin_load()
        # from the first byte written the weights are neither the old version nor the new
        self._version = None
        self._complete = False

    def load_weights(self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> int:
        self._refuse_if_weights_released("load weights")
        return self.model.load_weights(named_tensors)

    @property
    def last_route(self) -> str | None:
        """How the model wrote the last batch (``colo.engine.reference.model.LOAD_ROUTES``)."""
        return self.model.last_route

    @property
    def last_route_parts(self) -> dict[str, float]:
        """The host's seconds in the parts of that route, where the model splits it."""
        return self.model.last_route_parts

    def end_load(self) -> int:
        self._refuse_if_weights_released("end a load")
        n = self.model.end_load()
        self._complete = True
        return n

    def digest(self, order: Sequence[str] | None = None, *, arm: bool = True) -> str:
        """The digest of the HF-named tensors the engine holds, in ``order`` (the spec list the
        last preflight accepted; see ``EngineModel.digest``, and ``arm`` there)."""
        self._refuse_if_weights_released("digest weights")
        return self.model.digest(order, arm=arm)

    def param_entries(self) -> dict[str, str]:
        """See ``EngineModel.param_entries``."""
        self._refuse_if_weights_released("digest weights")
        return self.model.param_entries()

    # -- inference -------------------------------------------------------------

    def generate(self, prompts: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
                 generator: torch.Generator, adapter: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """See ``EngineModel.generate``; refused unless KV is resident and the weights are current.
        ``adapter``: the LoRA adapter version it runs with (None: the base model)."""
        if "kv_cache" in self._paused:
            raise EngineStateError("cannot generate: the KV cache is released (resume 'kv_cache' first)")
        self._refuse_if_weights_released("generate")
        if self._version is None:
            raise EngineStateError("cannot generate: engine weights are stale (no complete sync "
                                   "has been recorded with set_weight_version)")
        with self.model.adapter(adapter):
            return self.model.generate(prompts, max_new_tokens, temperature=temperature, generator=generator)

    def logits(self, tokens: torch.Tensor, adapter: int | None = None) -> torch.Tensor:
        self._refuse_if_weights_released("compute logits")
        with self.model.adapter(adapter):
            return self.model.logits(tokens)

    def describe(self) -> dict[str, Any]:
        """A plain-data summary for traces and the control channel."""
        d = self.model.dims
        return {"dtype": dtype_name(self.model.dtype), "device": str(self.model.device),
                "weight_version": self._version, "paused": sorted(self._paused),
                "tag_bytes": self.tag_bytes(), "kv_slots": self.model.num_slots,
                "layers": d.num_layers, "hidden_size": d.hidden_size, "vocab_size": d.vocab_size}
