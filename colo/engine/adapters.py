"""An engine whose syncs load a LoRA adapter, not weights: :class:`AdapterEngine`.

Around any engine that stages adapters in memory (``adapter_target``, ``activate_adapter``,
``drop_adapter``: :class:`colo.engine.vllm.VllmEngine`), this is the engine protocol the
scheduler drives with ``SchedulerConfig(sync_target="adapter")``:

- a sync's load verbs go to a **new adapter version**, staged beside the one serving (each
  stage a fresh id: a re-sync after a failure never reuses one);
- ``digest()`` is the digest of what the engine received for that stage, checked by the
  scheduler's verifier against the trainer's adapter like a weights digest;
- ``set_weight_version(v)`` **activates** the staged version: the scheduler calls it only after
  every rank's digest checked, so every rank serves the new version from the same point on;
  ``set_weight_version(None)`` (a sync begins, or failed) abandons a stage not activated: it
  is dropped from the engine, and the version that served before stays loaded;
- the probe runs with the staged version where it runs before activation.

The base weights never move (the phase table's ``adapter`` effects release only the KV
cache). Where the engine's digest reads its live weights (``digest_live``), the base's digest
is checked against the trainer's once per engine, at its first verified sync: a replaced
engine is a new :class:`AdapterEngine`, so it is checked again; elsewhere (vLLM, whose digest
is of what it received) the probe, which runs on every verified sync there, answers for base
and adapter together.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from colo.core.errors import EngineStateError, VerificationError


class AdapterEngine:
    """``engine``'s adapter stages as the engine protocol's loads. ``config``: the adapter's
    :class:`~colo.models.lora.AdapterConfig`; ``base_digest``: the trainer's base weights'
    digest (:func:`colo.digest.expected_weights_digest`), checked once where the engine's
    digest is of its live weights."""

    def __init__(self, engine: Any, config: Any, *, base_digest: str | None = None):
        for verb in ("adapter_target", "activate_adapter", "drop_adapter"):
            if not callable(getattr(engine, verb, None)):
                raise TypeError(f"{type(engine).__name__} stages no LoRA adapters (it has no {verb}); expected an "
                                f"engine such as colo.engine.vllm.VllmEngine")
        self._engine, self.config, self._base_digest = engine, config, base_digest
        # the digest vouches for the adapter as received, not for the weights the forward reads
        self.capabilities = replace(engine.capabilities, adapters=True, digest_live=False)
        self._base_checked = base_digest is None or not engine.capabilities.digest_live
        #: the stage of the sync in progress (the engine's receiving side for it)
        self._stage: Any = None
        #: the version staged and verified-to-be, not yet serving, and its digest
        self.staged: int | None = None
        self._staged_digest: str | None = None
        loaded = getattr(engine, "adapter_digests", None) or {}
        self._next = max(loaded, default=0) + 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    @property
    def inner(self) -> Any:
        return self._engine

    # -- the sync's loads: a new stage -------------------------------------------------------
    def _target(self) -> Any:
        if self._stage is None:
            if self.staged is not None:
                raise EngineStateError(f"adapter v{self.staged} is staged and not yet activated: a second stage "
                                       "before set_weight_version")
            self._stage = self._engine.adapter_target(self._next, self.config)
            self._next += 1
        return self._stage

    async def preflight(self, specs: Any) -> None:
        await self._target().preflight(specs)

    async def begin_load(self) -> None:
        await self._target().begin_load()

    async def transport_init(self, transport: str, init_info: dict) -> None:
        await self._target().transport_init(transport, init_info)

    async def transport_load(self, transport: str, request: dict, on_sent: Any = None, *, end: bool = False,
                             flush_cache: bool = False) -> dict:
        reply = await self._target().transport_load(transport, request, on_sent, end=end, flush_cache=flush_cache)
        if end:
            self._ended()
        return reply

    async def transport_close(self, transport: str) -> None:
        await self._target().transport_close(transport)

    async def end_load(self, flush_cache: bool = False) -> None:
        await self._target().end_load(flush_cache=flush_cache)
        self._ended()

    def _ended(self) -> None:
        stage = self._stage
        if stage.digest is None:
            raise EngineStateError(f"adapter v{stage.version}: the stage ended without the engine's digest")
        self.staged, self._staged_digest = stage.version, stage.digest

    async def drop_handles(self) -> None:
        """After a failed sync: the stage in progress ends, nothing of it registered."""
        if self._stage is not None:
            await self._stage.drop_handles()

    # -- verification and activation ------------------------------------------------------------
    async def digest(self) -> str:
        if not self._base_checked:
            got = await self._engine.digest()
            if got != self._base_digest:
                raise VerificationError(f"the engine's base weights digest {got[:16]} != the trainer's base "
                                        f"{self._base_digest[:16]}: an adapter over other base weights is not "
                                        f"the trainer's policy")
            self._base_checked = True
        if self._staged_digest is None:
            raise EngineStateError("no adapter was staged in this sync: nothing to digest")
        return self._staged_digest

    async def logprobs(self, tokens: list[list[int]], **kw: Any) -> Any:
        return await self._engine.logprobs(tokens, adapter=self._probed(), **kw)

    async def logits(self, tokens: list[list[int]], **kw: Any) -> Any:
        return await self._engine.logits(tokens, adapter=self._probed(), **kw)

    def _probed(self) -> int | str | None:
        """The version a probe asks: the staged one until it is activated."""
        return self.staged if self.staged is not None else "active"

    async def set_weight_version(self, version: int | None) -> None:
        if version is None:
            await self._abandon()
        elif self.staged is not None:
            await self._engine.activate_adapter(self.staged, digest=self._staged_digest)
            self.staged, self._staged_digest, self._stage = None, None, None
        await self._engine.set_weight_version(version)

    async def _abandon(self) -> None:
        """A stage that will not be activated: unregistered, the serving version untouched."""
        stage, staged = self._stage, self.staged
        self._stage, self.staged, self._staged_digest = None, None, None
        if staged is not None:
            await self._engine.drop_adapter(staged)
        elif stage is not None:
            await stage.drop_handles()


__all__ = ["AdapterEngine"]
