"""Trainers for tests that move real tensors through a real transport.

- :class:`StateTrainer`: a state dict (or a module) with a real
  :class:`~colo.extractors.plain.PlainExtractor`; nothing is trained unless asked.
  What a transport asks of a trainer, and what the scheduler asks around it.
- :class:`FlatTrainer`: a real model whose parameters live in one
  :class:`~colo.device.flat_weights.FlatWeights` buffer, stepped in place by a
  real AdamW: what the one-copy sync reads from.
- :class:`CountingExtractor`: another extractor, counted, that can fail on purpose
  (a trainer that crashes while a bucket is gathered).

The byte-counting fakes the scheduler's unit tests use are in :mod:`colo.testing.fakes`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from colo.core.interfaces import TensorSpec
from colo.extractors.plain import PlainExtractor


class CountingExtractor:
    """``inner`` as it is, with the number of ``extract`` calls (``calls``) and of
    tensors produced (``produced``). ``fail_at``: the ``extract`` call of that index
    (0, 1, ...: one per bucket) raises, as a trainer that crashed while gathering it.

    Only ``specs`` and ``extract(names)``: what any extractor has, none of
    PlainExtractor's extras (``extracts_into``)."""

    def __init__(self, inner: Any, *, fail_at: int | None = None):
        self.inner, self.fail_at = inner, fail_at
        self.calls = self.produced = 0

    def specs(self) -> Sequence[TensorSpec]:
        return self.inner.specs()

    def extract(self, names: Sequence[str]) -> Iterator[tuple[str, torch.Tensor]]:
        self.calls += 1
        if self.calls - 1 == self.fail_at:  # at the call, as a bad request to a real extractor fails
            raise RuntimeError(f"simulated trainer crash while gathering bucket {self.fail_at}")
        return self._counted(self.inner.extract(names))

    def _counted(self, items: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for item in items:
            self.produced += 1
            yield item


class StateTrainer:
    """A real ``PlainExtractor`` over ``source`` (a state dict or a module), built once.

    ``dtype``: the engine dtype the extractor converts to (``None`` keeps each
    tensor's); ``upload_to``: the device the extractor uploads host tensors to.
    For a run under the scheduler: ``tag_bytes`` (default: the source's bytes as
    weights, twice that as optimizer state), and ``trains``: a step adds 1 to
    every tensor in place (new weights for every sync); otherwise a step fails the
    test, for the tests that only sync. ``fail_at``: each sync's extractor fails
    at that bucket (:class:`CountingExtractor`); set it to ``None`` to recover."""

    def __init__(self, source: torch.nn.Module | Mapping[str, torch.Tensor], dtype: Any = torch.float32, *,
                 upload_to: Any = None, tag_bytes: Mapping[str, int] | None = None, trains: bool = False,
                 fail_at: int | None = None):
        self.source = source
        self._extractor = PlainExtractor(source, dtype=dtype, upload_to=upload_to)
        self._tag_bytes = dict(tag_bytes) if tag_bytes is not None else None
        self.trains, self.fail_at = trains, fail_at

    def _tensors(self) -> Mapping[str, torch.Tensor]:
        src = self.source
        return dict(src.state_dict()) if isinstance(src, torch.nn.Module) else src

    def tag_bytes(self) -> dict[str, int]:
        if self._tag_bytes is not None:
            return dict(self._tag_bytes)
        n = sum(t.numel() * t.element_size() for t in self._tensors().values())
        return {"weights": n, "optimizer": 2 * n}

    def param_specs(self) -> Sequence[TensorSpec]:
        return self._extractor.specs()

    def hf_state(self) -> Mapping[str, torch.Tensor]:
        """Every tensor under its name (what a verifier compares an engine's digest with)."""
        return self._tensors()

    def extractor(self) -> Any:
        if self.fail_at is None:
            return self._extractor
        return CountingExtractor(self._extractor, fail_at=self.fail_at)

    async def onload(self, tags) -> None:
        pass

    async def offload(self, tags) -> None:
        pass

    async def train_step(self, rollout) -> dict:
        if not self.trains:
            raise AssertionError("not reached: this trainer only syncs (StateTrainer(trains=False))")
        with torch.no_grad():
            for t in self._tensors().values():
                t.add_(1)
        return {}


class FlatTrainer:
    """A real model (:func:`colo.trainers.models.build_trainer_model`) with its parameters
    in one flat buffer and a real AdamW over them.

    ``extractor`` says what each sync gets:

    - ``"fresh"``: a new ``PlainExtractor`` of the model every time (the one-copy
      layout is walked every sync);
    - ``"kept"``: one :class:`CountingExtractor`, built once and handed to every
      sync, as a real trainer would (``self.kept``: how many tensors it produced);
    - ``"host-when-paused"``: while the weights are paused, a ``PlainExtractor`` of
      their pinned host backup, uploaded to the buffer's device (what a training
      loop's offload-first sync reads, as ``BenchTrainer`` does); fresh otherwise.
    """

    EXTRACTORS = ("fresh", "kept", "host-when-paused")

    def __init__(self, config: Any, seed: int, *, device: Any = "cpu", dtype: torch.dtype = torch.float32,
                 engine_dtype: torch.dtype = torch.float32, share_host: bool = True, extractor: str = "fresh"):
        from colo.device.flat_weights import FlatWeights
        from colo.trainers.models import build_trainer_model

        if extractor not in self.EXTRACTORS:
            raise ValueError(f"FlatTrainer: extractor={extractor!r}; expected one of {', '.join(self.EXTRACTORS)}")
        self.model = build_trainer_model(config, seed=seed).to(dtype)
        self.flat_weights = FlatWeights.adopt(self.model, device=device, share_host=share_host)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.engine_dtype = engine_dtype
        self.mode = extractor
        self.kept = (CountingExtractor(PlainExtractor(self.model, dtype=self.engine_dtype))
                     if extractor == "kept" else None)

    def extractor(self) -> Any:
        if self.kept is not None:
            return self.kept
        if self.mode == "host-when-paused" and self.flat_weights.paused:
            return PlainExtractor(self.flat_weights.host_tensors(), dtype=self.engine_dtype,
                                  upload_to=self.flat_weights.device)
        return PlainExtractor(self.model, dtype=self.engine_dtype)

    def step(self, *, behind_cycles: int = 0) -> None:
        """An optimizer step: every parameter changes in place, inside the flat buffer.
        ``behind_cycles``: on a GPU, queue it behind that long a spin of the device,
        so that it is still running when the caller goes on."""
        if behind_cycles:
            torch.cuda._sleep(behind_cycles)
        # (p - 1)^2: a gradient also for parameters that start at zero (biases)
        loss = sum(((p.float() - 1) ** 2).sum() for p in self.model.parameters())
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def state(self) -> dict[str, torch.Tensor]:
        """What the engine should hold: the weights in the engine's dtype, on the host."""
        return {n: p.detach().to(self.engine_dtype).cpu().clone() for n, p in self.model.named_parameters()}
