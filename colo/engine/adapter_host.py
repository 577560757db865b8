"""The receiving half of LoRA adapters, inside any engine's process: :class:`AdapterHost`.

An adapter's tensors arrive through colo's transports like weights: the same receivers, a
second :class:`~colo.engine.kit.EngineKit` beside the weights' (so a stage never touches the
weights' session), around an :class:`AdapterStage`, the kit's :class:`~colo.engine.kit.WeightSink`
for one adapter version at a time. The stage checks, copies and digests what arrives; at its end
the engine's own subclass registers the version (vLLM: a ``LoRAModel`` in its LoRA manager,
:mod:`colo.engine.vllm.adapters`; colo's engine: its model's adapter table,
:mod:`colo.engine.reference.adapters`). A failed or abandoned stage registers nothing.

The host answers the engine protocol's adapter requests as plain data, whatever carries them
(colo's socket, vLLM's ``collective_rpc``): ``preflight(version, config, specs)``, ``begin()``,
``load(transport, request)``, ``end()``, ``transport_init``, ``transport_close``, ``abort()``,
``list()``, ``drop(version)``. The driver's half is :class:`colo.engine.adapters.AdapterVersions`.
"""

from __future__ import annotations

from typing import Any

import torch

from colo.core.buckets import itemsize, numel
from colo.core.errors import EngineStateError
from colo.core.interfaces import TensorSpec
from colo.digest import ReceivedDigest, Spans
from colo.engine.kit import EngineKit, LoadSession, PieceAssembler
from colo.models.lora import AdapterConfig, adapter_shapes
from colo.models.specs import check_specs
from colo.transports.wire import NOT_CACHED, Piece, PreflightNotCached, contiguous_strides


class AdapterStage:
    """One adapter version at a time as the engine kit's sink: :meth:`prepare` names the
    version and its config, the kit's preflight, begin, loads and end do the rest, and the end
    calls :meth:`register`. A subclass says what the engine takes (:meth:`check`), the dtype it
    keeps adapters in (:attr:`dtype`), and how it registers, lists and drops a version."""

    def __init__(self, hf_config: Any, device: Any):
        self.hf_config, self.device = hf_config, torch.device(device)
        self.config: AdapterConfig | None = None
        self.version: int | None = None
        #: PEFT name -> shape of the prepared version's tensors
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.session: LoadSession | None = None
        self.received = ReceivedDigest()
        self._pieces = PieceAssembler()
        #: the stage's tensors, copies of our own on the engine's device (the sender reuses its
        #: buffer): views of one copy of each request's bytes (:func:`copy_in`)
        self._staged: dict[str, torch.Tensor] = {}
        #: version -> the digest of the tensors it was built from, in the accepted order
        self.digests: dict[int, str] = {}
        #: the last request layout's plan (:class:`_Plan`), with the layout and shapes it is for
        self._plan: tuple[Any, Any, _Plan] | None = None

    # -- what the engine says ---------------------------------------------------------------
    @property
    def dtype(self) -> str:
        """The dtype the engine keeps adapters in: what a stage must send."""
        raise NotImplementedError

    def check(self, version: int, config: AdapterConfig) -> None:
        """Refuse (before any byte moves) an adapter the engine cannot take."""

    def register(self, version: int, config: AdapterConfig, tensors: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError

    def loaded(self) -> list[int]:
        raise NotImplementedError

    def unregister(self, version: int) -> bool:
        raise NotImplementedError

    def drop(self, version: int) -> bool:
        self.digests.pop(int(version), None)
        return self.unregister(int(version))

    # -- the stage -----------------------------------------------------------------------
    def prepare(self, version: Any, config: Any) -> None:
        """The next stage is ``version`` (an id > 0) of an adapter of ``config`` (its JSON);
        refused before any byte moves when the engine cannot take it."""
        if self.session is not None:
            raise EngineStateError(f"adapter v{self.version} is being staged: end or abort it first")
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise ValueError(f"an adapter version is an integer of at least 1, got {version!r}")
        cfg = AdapterConfig.from_json(config)
        self.check(version, cfg)
        if cfg != self.config:  # the same config sync after sync: its shapes (and a plan over them) stay
            self.shapes = adapter_shapes(self.hf_config, cfg)
        self.config, self.version = cfg, version

    def expected_specs(self) -> list[TensorSpec]:
        size = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return [TensorSpec(name=n, shape=s, dtype=self.dtype, nbytes=size * numel(s)) for n, s in self.shapes.items()]

    # -- WeightSink ----------------------------------------------------------------------
    def preflight(self, specs: list[TensorSpec]) -> None:
        self._require_prepared()
        check_specs(self.shapes, ((s.name, s.shape, s.dtype) for s in specs), self.dtype,
                    f"adapter v{self.version} does not match its config on the model this engine serves "
                    f"(r={self.config.r}, targets {', '.join(self.config.targets)}; the engine keeps adapters "
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
        plan = self._plan_of(named, session)
        if plan is not None:
            # the layout seen before: one copy, one checksum launch, the views made from the plan
            copy = plan.copy(named.flat, self.device)
            self.received.add_spans(copy, plan.spans)
            self._staged.update(plan.views(copy))
            return session.advance_whole(plan.spans.names)
        items = list(named)
        session.check(items)  # the whole request, before any of it is kept
        copies = copy_in([(n, t) for n, t in items if not isinstance(t, Piece)], self.device)
        # the digest of what arrived, read from our copies on the engine's device (one launch on a
        # GPU), not from the sender's buffer, which may be host memory
        self.received.add_many([(n, copies[n]) if n in copies else (n, t) for n, t in items])
        self._staged.update(copies)
        for name, tensor in items:
            if isinstance(tensor, Piece):  # the assembler's whole tensor is its own buffer already
                self._staged.update((n, t.to(self.device)) for n, t in self._pieces.feed([(name, tensor)]))
        return sum(session.advance(name, tensor) for name, tensor in items)

    def _plan_of(self, named: Any, session: LoadSession) -> _Plan | None:
        """The plan of a request whose layout (:class:`colo.transports.wire.Views`) is of whole
        tensors, as the first request of a stage; None otherwise (then tensor by tensor).

        An adapter is hundreds of small tensors, the same ones every sync, and the receiver
        hands the same layout back each time (a trainer's flat adapter, sent as it lies): the
        check of the request against the adapter's shapes, where each tensor lies and its
        checksum's table are made once per layout (392 tensors at rank 8 on a 1.5B model:
        most of an adapter sync on a GPU was this, per tensor, per sync)."""
        layout = getattr(named, "layout", None)
        if layout is None or getattr(named, "flat", None) is None or not session.fresh:
            return None
        held = self._plan
        # the same tuple sync after sync where the receiver caches layouts (a sender that keeps its
        # transport); an equal one where each stage is sent afresh (stage_adapter)
        if held is not None and held[1] is self.shapes and (held[0] is layout or held[0] == layout):
            return held[2]
        if any(not m.whole or m.view is not None for m in layout) or not layout:  # byte spans only
            return None
        session.check(list(named))  # refused as ever; accepted once, the same layout is the same answer
        plan = _Plan(layout)
        self._plan = (layout, self.shapes, plan)
        return plan

    def end_load(self) -> int:
        session = self._require_session()
        try:
            n = session.finish()
            self.register(self.version, self.config, self._staged)
        except BaseException:
            self.abort()
            raise
        self.session = None
        self._staged = {}
        return n

    def flush_cache(self) -> None:
        raise EngineStateError("an adapter stage flushes no cache: the driver resets the engine's prefix cache")

    def abort(self) -> None:
        """End a failed stage: nothing of it is registered; what was registered stays."""
        self.session = None
        self._staged = {}
        self._pieces.clear()

    def _require_prepared(self) -> None:
        if self.version is None:
            raise EngineStateError("no adapter stage is prepared (the adapter preflight names its version first)")

    def _require_session(self) -> LoadSession:
        if self.session is None:
            raise EngineStateError("no adapter stage is active (begin_load first)")
        return self.session


def copy_in(items: list[tuple[str, torch.Tensor]], device: torch.device) -> dict[str, torch.Tensor]:
    """Copies of ``items`` on ``device``, made with ONE copy per buffer they lie in: the bytes
    from the first tensor's start to the last one's end, then each tensor a view of that copy.

    A request's tensors are views of one buffer (a packed bucket's staging, or a trainer's whole
    flat adapter in the one-copy sync), and an adapter is hundreds of small tensors (392 at rank
    8 on a 1.5B model): one copy each was most of an adapter sync on a GPU. A tensor that is not
    a contiguous view is copied on its own."""
    out: dict[str, torch.Tensor] = {}
    groups: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for name, t in items:
        if t.is_contiguous():
            groups.setdefault(t.untyped_storage().data_ptr(), []).append((name, t))
        else:
            out[name] = t.to(device, copy=True).contiguous()
    for group in groups.values():
        first = group[0][1]
        spans = [(t.storage_offset() * t.element_size(), t.numel() * t.element_size()) for _, t in group]
        lo = min(a for a, _ in spans)
        hi = max(a + n for a, n in spans)
        raw = torch.empty(0, dtype=torch.uint8, device=first.device)
        raw.set_(first.untyped_storage(), 0, (first.untyped_storage().nbytes(),))
        copy = raw[lo:hi].to(device, copy=True)
        typed: dict[torch.dtype, torch.Tensor] = {}
        for (name, t), (a, n) in zip(group, spans):
            size = t.element_size()
            if (a - lo) % size or (hi - lo) % size:  # not at a multiple of its element: a view of its bytes
                out[name] = copy[a - lo:a - lo + n].view(t.dtype).view(t.shape)
                continue
            if t.dtype not in typed:
                typed[t.dtype] = copy.view(t.dtype)
            # one op per tensor (a slice and two views each was most of this on a GPU's host)
            out[name] = typed[t.dtype].as_strided(t.shape, t.stride(), (a - lo) // size)
    return out


class _Plan:
    """What a stage derives from one layout of whole tensors (``TensorMeta``\\ s): the byte
    range to copy (from the first tensor's start to the last one's end), each tensor's place in
    that copy, and the digest's :class:`~colo.digest.Spans`."""

    def __init__(self, layout: Any):
        self.lo = min(m.start for m in layout)
        self.hi = max(m.end for m in layout)
        self.spans = Spans([(m.name, m.dtype, m.shape, m.start - self.lo, m.nbytes) for m in layout])
        #: per tensor: name, dtype, shape, strides, element offset in the copy viewed as its dtype
        self._views: list[tuple[str, torch.dtype, tuple[int, ...], tuple[int, ...], int]] = []
        for m in layout:
            size = itemsize(m.dtype)
            if (m.start - self.lo) % size or (self.hi - self.lo) % size:
                raise ValueError(f"{m.name}: bytes [{m.start}, {m.end}) are not at a multiple of its "
                                 f"{m.dtype} elements from the request's first byte")
            self._views.append((m.name, getattr(torch, m.dtype), tuple(m.shape), contiguous_strides(tuple(m.shape)),
                                (m.start - self.lo) // size))

    def copy(self, flat: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The request's bytes as our own, on ``device``: one copy."""
        return flat[self.lo:self.hi].to(device, copy=True)

    def views(self, copy: torch.Tensor) -> dict[str, torch.Tensor]:
        typed: dict[torch.dtype, torch.Tensor] = {}
        out = {}
        for name, dtype, shape, strides, at in self._views:
            base = typed.get(dtype)
            if base is None:
                base = typed[dtype] = copy.view(dtype)
            out[name] = base.as_strided(shape, strides, at)
        return out


#: the requests an adapter host answers (its methods of these names)
ADAPTER_OPS = ("preflight", "begin", "load", "end", "transport_init", "transport_close", "abort", "list", "drop")


class AdapterHost:
    """An :class:`AdapterStage` and the engine kit around it: the adapter requests an engine
    serves, each answering plain data."""

    def __init__(self, stage: AdapterStage, **kit: Any):
        self.stage = stage
        self.kit = EngineKit(stage, **kit)
        #: the spec list's key and the config it was accepted for: a stage of the same names them by key
        self._accepted: tuple[str, Any] | None = None

    def preflight(self, version: Any, config: Any, specs: Any, key: Any = None) -> dict:
        """Name the next stage (its version and config) and check its spec list; with ``key``
        (:func:`colo.transports.wire.layout_key` of ``specs``) the list may later be named by
        the key alone, for the same config (:meth:`load`'s ``begin``)."""
        self._accepted = None
        self.stage.prepare(version, config)
        self.kit.preflight(specs, key)
        if key is not None:
            self._accepted = (key, config)
        return {"dtype": self.stage.dtype}

    def begin(self, version: Any = None, config: Any = None, key: Any = None) -> dict:
        """Begin the stage; with ``version`` and ``config`` it is named here and its spec list
        by ``key``, the last list this host accepted for that config (refused with
        ``PreflightNotCached`` otherwise, nothing begun: the driver sends the list whole)."""
        if version is not None:
            accepted = self._accepted
            if key is None or accepted is None or accepted[0] != key or accepted[1] != config:
                raise PreflightNotCached(f"adapter v{version}: {NOT_CACHED} (key {str(key)[:16]} is not the last "
                                         f"spec list this engine accepted for that config); send the specs")
            self.stage.prepare(version, config)
            self.kit.preflight(key=key)
        return self.kit.begin_load()

    def load(self, transport: str, request: Any, begin: Any = None, end: bool = False) -> dict:
        """One request of the stage; ``begin`` (:meth:`begin`'s arguments) begins it first and
        ``end`` ends it after, answering :meth:`end`'s reply too: a one-request stage is one
        round trip."""
        if begin is not None:
            self.begin(*begin)
        try:
            reply = self.kit.transport_load(transport, request)
        except BaseException:
            self.stage.abort()
            self.kit.release(kept=True)
            raise
        if end is True:
            reply = {**reply, **self.end(), "ended": True}
        return reply

    def end(self, begin: Any = None) -> dict:
        """End the stage: the version is registered; the digest of the tensors received (in
        the accepted order) answers. ``begin``: a stage that received nothing begins here."""
        if begin is not None:
            self.begin(*begin)
        stage = self.stage
        version = stage.version
        self.kit.end_load()
        digest = stage.received.digest([s.name for s in self.kit.accepted])
        stage.digests[version] = digest
        return {"version": version, "digest": digest}

    def transport_init(self, transport: str, init_info: Any) -> dict:
        return self.kit.transport_init(transport, init_info)

    def transport_close(self, transport: str) -> dict:
        return self.kit.transport_close(transport)

    def abort(self) -> dict:
        """After a failed stage: nothing of it registered, every mapped buffer let go."""
        self.stage.abort()
        return self.kit.drop_handles()

    def list(self) -> dict:
        """The versions the engine holds, the digest each was built from, and the dtype it keeps
        adapters in."""
        loaded = self.stage.loaded()
        return {"loaded": loaded, "digests": {str(v): self.stage.digests.get(v) for v in loaded},
                "dtype": self.stage.dtype}

    def drop(self, version: Any) -> dict:
        return {"dropped": self.stage.drop(version), "loaded": self.stage.loaded()}

    def close(self) -> None:
        self.kit.close()


__all__ = ["ADAPTER_OPS", "AdapterHost", "AdapterStage"]
