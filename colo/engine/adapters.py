"""LoRA adapters on the driver's side: the versions an engine holds (:class:`AdapterVersions`),
one version's stage as a transport's receiving side (:class:`AdapterTarget`), and an engine whose
syncs load an adapter, not weights (:class:`AdapterEngine`). The engine's side of all three is
:class:`colo.engine.adapter_host.AdapterHost`.

:class:`AdapterVersions` is mixed into an engine's driver (``VllmEngine``, colo's ``EngineClient``)
that sends the host's requests (``_adapter_op``): stage a version (``stage_adapter``, or
``adapter_target`` for a sender of one's own), activate it once its digest is the trainer's
(``activate_adapter``: requests use it from then on), keep the newest ``keep_adapters`` loaded for
requests still in flight, drop the rest. Versions only grow: one names one set of bytes.

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

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import anyio

from colo.core.errors import EngineError, EngineStateError, VerificationError
from colo.core.interfaces import TensorSpec
from colo.transports.wire import NOT_CACHED


class AdapterVersions:
    """The adapter versions of one engine, on the driver's side. The engine supplies
    ``_adapter_op(op, *args)`` (one request of its :class:`~colo.engine.adapter_host.AdapterHost`)
    and ``_check_adapters()`` (refuses where it serves none), and calls :meth:`init_adapters`."""

    def init_adapters(self) -> None:
        #: the LoRA adapter version requests use (None: the base model alone)
        self.active_adapter: int | None = None
        #: adapter versions the engine holds (oldest first) and the digest each was built from
        self.adapter_digests: dict[int, str] = {}
        #: adapter versions kept loaded, the active one included: a version activated drops
        #: the ones older than the newest ``keep_adapters`` (requests still in flight may use them)
        self.keep_adapters = 2
        #: the newest adapter version staged so far: versions only grow (:meth:`adapter_target`)
        self.newest_adapter = 0
        #: the last spec list sent (the specs, as they travel, their key) and the key and config
        #: the engine accepted last: a stage of the same names them by key (:class:`AdapterTarget`)
        self._adapter_layout: tuple[list, list, str] | None = None
        self._adapter_accepted: tuple[str, dict] | None = None

    async def _adapter_op(self, op: str, *args: Any) -> dict:
        raise NotImplementedError

    def _check_adapters(self) -> None:
        """Refuse (EngineStateError) where this engine stages no adapters."""

    def adapter_target(self, version: int, config: Any) -> AdapterTarget:
        """The receiving side a colo transport sends adapter ``version`` (of ``config``, a
        :class:`colo.models.lora.AdapterConfig`) to, as it sends weights to this engine."""
        self._check_adapters()
        if isinstance(version, int) and not isinstance(version, bool) and version <= self.newest_adapter:
            # a version names one set of bytes: staged again, a request or a kept digest naming it
            # would no longer know which (a stage that failed registered nothing and may be retried)
            raise EngineStateError(f"adapter v{version} was staged already (the newest staged is "
                                   f"v{self.newest_adapter}): a version is staged once; stage "
                                   f"v{self.newest_adapter + 1} (v{self.active_adapter} stays active)")
        return AdapterTarget(self, version, config)

    async def stage_adapter(self, source: Any, version: int, config: Any, *, transport: str = "packed",
                            bucket_bytes: int = 1 << 20) -> str:
        """Send adapter ``version`` to the engine through colo's ``transport`` and register it
        there, inactive. ``source``: the adapter's tensors, PEFT-named (a mapping, as
        ``peft.get_peft_model_state_dict`` gives them, sent in its order and dtype: convert
        on purpose to the engine's, :meth:`adapter_dtype`), or a trainer whose extractor
        yields them. Returns the digest of what the engine received. Nothing is written to
        disk. A failed stage registers nothing: the active version serves on.

        Room first: versions beyond :attr:`keep_adapters` that are not active are dropped."""
        from colo.core.interfaces import SyncContext
        from colo.core.memory import StagingBudget
        from colo.transports import make_transport

        if isinstance(source, Mapping):
            source = _Tensors(source)
        target = self.adapter_target(version, config)
        await self._drop_adapters_but(self.active_adapter, version)
        sender = make_transport(transport)
        ctx = SyncContext(step=version, weight_version=version, bucket_bytes=bucket_bytes, source="host",
                          staging=StagingBudget(None), flush_cache=False)
        try:
            await sender.sync(source, target, ctx)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await target.drop_handles()
            raise
        finally:
            with anyio.CancelScope(shield=True):
                await sender.aclose()
        if target.digest is None:
            raise EngineStateError(f"adapter v{version}: the transport ended without ending the stage")
        return target.digest

    async def activate_adapter(self, version: int | None, *, digest: str | None = None) -> None:
        """Requests use adapter ``version`` from now on (None: the base model). ``digest``: what
        the trainer sent (:func:`colo.digest.expected_weights_digest` of its adapter tensors);
        refused, the active version unchanged, unless the engine received exactly that. Then
        versions older than the newest :attr:`keep_adapters` are dropped."""
        if version is not None:
            got = self.adapter_digests.get(version)
            if got is None:
                raise EngineStateError(f"adapter v{version} is not loaded in the engine "
                                       f"(loaded: {sorted(self.adapter_digests) or 'none'}): stage it first")
            if digest is not None and got != digest:
                raise EngineError("activate_adapter", "DigestMismatch",
                                  f"adapter v{version}: the engine received {got}, the trainer sent {digest}; "
                                  f"v{self.active_adapter} stays active")
        self.active_adapter = version
        await self._drop_adapters_but(version)

    async def _drop_adapters_but(self, *also: int | None) -> None:
        """Drop every loaded version but the newest :attr:`keep_adapters` and ``also``."""
        keep = set(sorted(self.adapter_digests)[-self.keep_adapters:]) | set(also)
        for old in sorted(self.adapter_digests):
            if old not in keep:
                await self.drop_adapter(old)

    async def adapters(self) -> dict[int, str | None]:
        """The adapter versions the engine holds, with the digest each was built from."""
        reply = await self._adapter_op("list")
        return {int(v): d for v, d in reply["digests"].items()}

    async def adapter_dtype(self) -> str:
        """The dtype the engine keeps adapters in (vLLM's ``lora_dtype``; colo's engine: its
        weights'): what a stage must send."""
        return str((await self._adapter_op("list"))["dtype"])

    async def drop_adapter(self, version: int) -> None:
        """Unload adapter ``version`` (not the active one: activate another first)."""
        if version == self.active_adapter:
            raise EngineStateError(f"adapter v{version} is active: activate another (or None) before dropping it")
        await self._adapter_op("drop", version)
        self.adapter_digests.pop(version, None)

    def _adapter_for(self, adapter: int | str | None) -> int | None:
        if adapter == "active":
            return self.active_adapter
        if adapter is not None and adapter not in self.adapter_digests:
            raise EngineStateError(f"adapter v{adapter} is not loaded in the engine "
                                   f"(loaded: {sorted(self.adapter_digests) or 'none'})")
        return adapter


class _Tensors:
    """A mapping of tensors as a sync's source (what a transport asks of a trainer): sent as
    they are, in the mapping's order and dtypes."""

    def __init__(self, tensors: Any):
        from colo.extractors.plain import PlainExtractor

        self._extractor = PlainExtractor(dict(tensors))

    def extractor(self) -> Any:
        return self._extractor


class AdapterTarget:
    """Adapter version ``version`` of ``engine`` as a colo transport's receiving side: the
    engine protocol's load verbs (``EngineReceiver``), each one of the engine's adapter
    requests, so any transport that sends weights sends an adapter, with its own session beside
    the weights' (:meth:`AdapterVersions.adapter_target`)."""

    def __init__(self, engine: AdapterVersions, version: int, config: Any):
        from colo.models.lora import AdapterConfig

        if not isinstance(config, AdapterConfig):
            raise TypeError(f"an adapter's config is a colo.models.lora.AdapterConfig, got {type(config).__name__}")
        self.engine, self.version, self.config = engine, version, config
        #: the digest the engine answered at the end of the stage
        self.digest: str | None = None
        #: what the stage's begin names (version, config, spec list key; ``[]`` once the list
        #: went whole), and whether the begin is still to be sent (with the first request)
        self._begin_args: list | None = None
        self._begin_due = False
        self._layout: tuple[list, list, str] | None = None

    async def preflight(self, specs: Sequence[TensorSpec]) -> None:
        """The engine checks the spec list (every name, shape and dtype against the config on
        its model) before any byte moves. The list a stage of the same config sent before (the
        same spec objects, sync after sync) is named by its key alone, with the begin, on the
        stage's first request: a one-request stage is then one round trip."""
        from colo.transports.wire import layout_key

        engine = self.engine
        specs = list(specs)
        held = engine._adapter_layout
        if held is None or len(held[0]) != len(specs) or any(a is not b for a, b in zip(specs, held[0])):
            wire = [[s.name, list(s.shape), s.dtype] for s in specs]
            held = engine._adapter_layout = (specs, wire, layout_key(wire))
        self._layout = held
        self._begin_args = [self.version, self.config.to_json(), held[2]]
        if engine._adapter_accepted != (held[2], self._begin_args[1]):
            await self._preflight_whole()

    async def _preflight_whole(self) -> None:
        engine, (_, wire, key), config = self.engine, self._layout, self._begin_args[1]
        engine._adapter_accepted = None
        await engine._adapter_op("preflight", self.version, config, wire, key)
        engine._adapter_accepted = (key, config)
        self._begin_args = []  # named and checked: the begin is a plain one

    async def begin_load(self) -> None:
        self._begin_due = True  # sent with the stage's first request

    def _begin(self) -> list | None:
        if not self._begin_due:
            return None
        self._begin_due = False
        args = self._begin_args
        if args is None:
            raise EngineStateError(f"adapter v{self.version}: begin_load before preflight")
        return args

    async def _op_begun(self, op: str, *args: Any, tail: tuple = ()) -> dict:
        """``op`` with the due begin (None: none due) after ``args``, then ``tail``; an engine
        that no longer holds the spec list (restarted, or another list replaced it) began
        nothing: the list goes whole, then the same request again."""
        begin = self._begin()
        try:
            return await self.engine._adapter_op(op, *args, begin, *tail)
        except Exception as e:
            if not begin or NOT_CACHED not in str(e):
                raise
        await self._preflight_whole()
        return await self.engine._adapter_op(op, *args, [], *tail)

    async def transport_init(self, transport: str, init_info: dict) -> None:
        await self.engine._adapter_op("transport_init", transport, init_info)

    async def transport_load(self, transport: str, request: dict, on_sent: Any = None, *, end: bool = False,
                             flush_cache: bool = False) -> dict:
        if on_sent is not None:
            on_sent()
        reply = await self._op_begun("load", transport, request, tail=(bool(end),))
        if not end:
            return {}
        self._ended(reply)  # the stage's last request ended it: one round trip less
        return {"ended": True, "flushed": False}

    async def transport_close(self, transport: str) -> None:
        await self.engine._adapter_op("transport_close", transport)

    async def end_load(self, flush_cache: bool = False) -> None:
        # an adapter's stage changes no weights: the prefix cache stays (engines key their
        # cached blocks by adapter too)
        self._ended(await self._op_begun("end"))

    def _ended(self, reply: dict) -> None:
        self.digest = str(reply["digest"])
        version = int(reply["version"])
        self.engine.adapter_digests[version] = self.digest
        self.engine.newest_adapter = max(self.engine.newest_adapter, version)

    async def drop_handles(self) -> None:
        await self.engine._adapter_op("abort")


class AdapterEngine:
    """``engine``'s adapter stages as the engine protocol's loads. ``config``: the adapter's
    :class:`~colo.models.lora.AdapterConfig`; ``base_digest``: the trainer's base weights'
    digest (:func:`colo.digest.expected_weights_digest`, of the HF names in ``base_order``),
    checked once where the engine's digest is of its live weights."""

    def __init__(self, engine: Any, config: Any, *, base_digest: str | None = None,
                 base_order: Sequence[str] | None = None):
        for verb in ("adapter_target", "activate_adapter", "drop_adapter"):
            if not callable(getattr(engine, verb, None)):
                raise TypeError(f"{type(engine).__name__} stages no LoRA adapters (it has no {verb}); expected an "
                                f"engine such as colo.engine.vllm.VllmEngine")
        self._engine, self.config, self._base_digest = engine, config, base_digest
        #: the HF names in the order ``base_digest`` took them (None: the engine's own)
        self._base_order = None if base_order is None else list(base_order)
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

    @classmethod
    def for_trainer(cls, engine: Any, trainer: Any, engine_dtype: str) -> AdapterEngine:
        """``engine`` staging the adapter of a LoRA ``trainer`` (its ``adapter`` config and its
        ``start_state()``, the base weights): where the engine's digest reads its live weights,
        the base is checked once by the digest of the trainer's base in ``engine_dtype``; else
        the probe with the adapter answers for it. ``colo demo`` and an N-rank run's engine
        ranks both wrap theirs here."""
        base = trainer.start_state()
        digest = None
        if engine.capabilities.digest_live:
            import torch

            from colo.digest import expected_weights_digest

            digest = expected_weights_digest(base, list(base), getattr(torch, engine_dtype))
        return cls(engine, trainer.adapter, base_digest=digest, base_order=list(base))

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
        """After a failed sync: the stage in progress ends, nothing of it registered; with no
        stage (a transport's close) the engine lets go of what its adapter receivers keep mapped
        (a trainer's flat adapter buffer)."""
        if self._stage is not None:
            await self._stage.drop_handles()
        else:
            await self._engine._adapter_op("abort")

    # -- verification and activation ------------------------------------------------------------
    async def digest(self) -> str:
        if not self._base_checked:
            got = await (self._engine.digest() if self._base_order is None
                         else self._engine.digest(order=self._base_order))
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

    def _probed(self) -> int | None:
        """The version a probe asks: the staged one until it is activated, then the active one."""
        return self.staged if self.staged is not None else self._engine.active_adapter

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


__all__ = ["AdapterEngine", "AdapterTarget", "AdapterVersions"]
