"""The engine kit: the half of an engine that receives weights, for any engine.

colo's own engine server uses it, and an adapter for another engine (vLLM's
worker, SGLang's scheduler) hosts it inside that engine's process. It holds:

- the transports' receivers by name (:data:`colo.transports.STRATEGIES` is the
  allow-list: a receiver is built only for a registered transport), built from
  their init info, closed on request, and told to let go of what a sync mapped
  (or, with ``kept``, also of what a sender keeps from sync to sync);
- the spec list the engine last accepted, by key, so that a sync whose tensors
  did not change names it by key alone;
- the load session (:class:`LoadSession`): every HF name of the sync exactly
  once, tensors larger than a bucket arriving as pieces in order, one error
  naming every missing, unexpected, duplicate or misshapen tensor;
- pieces assembled into whole tensors (:class:`PieceAssembler`) for an engine
  whose loader takes only whole tensors (vLLM's ``load_weights``).

What the kit loads into is a :class:`WeightSink`: the engine's own verbs
(preflight, begin, load, end, flush). The kit never imports an engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from colo.core.buckets import itemsize, numel
from colo.core.errors import EngineStateError, WeightMismatch
from colo.core.interfaces import TensorSpec
from colo.proc.collector import collector_paused
from colo.proc.lifecycle import log
from colo.transports.wire import Piece, PreflightNotCached, RankSlice, layout_key, piece_in


class LoadSession:
    """One sync's accounting over the HF names it must deliver.

    ``expected`` maps each name to its full shape. A batch is checked as a
    whole before anything of it is written (:meth:`check`); a name arrives
    whole once, or as pieces whose element ranges continue where the last one
    stopped (:meth:`advance`); :meth:`finish` refuses a sync that left a name
    out or half done. Refusals are remembered, so the end names them too.

    ``rank_slices``: the engine takes a tensor cut for one of its ranks
    (:class:`~colo.transports.wire.RankSlice`, checked against its shape like a
    whole tensor; the engine checks that it is its own block). Off by default:
    every other loader (vLLM's, SGLang's, a user's sink) holds whole tensors, and
    a slice is refused by name before anything of its batch is written.
    """

    def __init__(self, expected: Mapping[str, tuple[int, ...]], *,
                 describe_unexpected: Callable[[str], str] = str, rank_slices: bool = False) -> None:
        self.expected = expected
        self._describe_unexpected = describe_unexpected
        self.rank_slices = rank_slices
        self.loaded: set[str] = set()
        #: names in the order they were completed
        self.order: list[str] = []
        #: elements written so far of each tensor arriving in pieces (bounded staging)
        self.partial: dict[str, int] = {}
        #: and how many elements they have in all (a rank's slice: fewer than the tensor)
        self._piece_total: dict[str, int] = {}
        self.duplicate: list[str] = []
        self.unexpected: list[str] = []
        self.wrong_shape: list[str] = []

    def check(self, items: Sequence[tuple[str, Any]]) -> None:
        """Refuse the whole batch (one ``WeightMismatch``) if any entry is unknown, repeated
        (within the batch or in the session), misshapen, or a piece out of order."""
        seen: set[str] = set()
        duplicate, unexpected, wrong_shape = [], [], []
        for name, tensor in items:
            part = piece_in(tensor)  # a piece of the tensor, or of a rank's slice of it
            piece = part is not None
            if name in seen or name in self.loaded or (not piece and name in self.partial):
                duplicate.append(name)
                continue
            seen.add(name)
            shape = self.expected.get(name)
            if shape is None:
                unexpected.append(self._describe_unexpected(name))
            elif tuple(tensor.shape) != tuple(shape):
                wrong_shape.append(f"{name} {tuple(tensor.shape)} (expected {tuple(shape)})")
            elif isinstance(tensor, RankSlice) and not self.rank_slices:
                wrong_shape.append(f"{name}: arrived as the {tensor.describe()} (cut for one engine rank), "
                                   f"expected the whole tensor: this engine loads whole tensors")
            elif piece and (part.offset != self.partial.get(name, 0) or part.end > numel(part.shape)
                            or part.data.dim() != 1):
                # (a rank's slice: its own elements, counted as a whole tensor's are)
                wrong_shape.append(f"{name}: a piece of elements [{part.offset}, {part.end}) where the "
                                   f"next piece of its {numel(part.shape)} elements starts at "
                                   f"{self.partial.get(name, 0)}")
        if duplicate or unexpected or wrong_shape:
            self.duplicate += duplicate
            self.unexpected += unexpected
            self.wrong_shape += wrong_shape
            raise WeightMismatch("load_weights refused the batch (nothing from it was written)",
                                 duplicate=duplicate, unexpected=unexpected, wrong_shape=wrong_shape)

    def advance(self, name: str, tensor: Any) -> bool:
        """Count ``tensor`` (checked) as written; True when its name is now complete."""
        part = piece_in(tensor)
        if part is not None and part.end < numel(part.shape):
            self.partial[name] = part.end
            self._piece_total[name] = numel(part.shape)  # a rank's slice: its own elements
            return False
        self.partial.pop(name, None)
        self.loaded.add(name)
        self.order.append(name)
        return True

    def advance_whole(self, names: Sequence[str]) -> int:
        """Count whole tensors of a batch :meth:`check` accepted (or one known to be the same as
        an accepted one, into a session that holds nothing yet) as written."""
        self.loaded.update(names)
        self.order.extend(names)
        return len(names)

    @property
    def fresh(self) -> bool:
        """Nothing loaded yet, nothing in part, nothing refused."""
        return not (self.loaded or self.partial or self.duplicate or self.unexpected or self.wrong_shape)

    def finish(self) -> int:
        """The number of names loaded; one ``WeightMismatch`` unless every expected name came
        exactly once and nothing was refused on the way."""
        missing = [n if n not in self.partial else
                   f"{n} (only its first {self.partial[n]} of {self._piece_total[n]} elements)"
                   for n in self.expected if n not in self.loaded]
        err = WeightMismatch("weight sync incomplete", missing=missing, unexpected=self.unexpected,
                             duplicate=self.duplicate, wrong_shape=self.wrong_shape)
        if not err.empty:
            raise err
        return len(self.loaded)


class PieceAssembler:
    """Whole tensors out of pieces, for an engine that loads only whole tensors.

    A piece (:class:`colo.transports.wire.Piece`) is a run of a tensor's row-major
    elements. The assembler copies each into a buffer of the whole tensor and
    yields the tensor once its last element arrived; whole tensors pass through.
    The buffer is the engine's own: the sender may reuse its staging at once.
    """

    def __init__(self) -> None:
        self._open: dict[str, torch.Tensor] = {}

    def feed(self, named: Iterable[tuple[str, Any]]) -> list[tuple[str, torch.Tensor]]:
        out = []
        for name, tensor in named:
            if not isinstance(tensor, Piece):
                out.append((name, tensor))
                continue
            buf = self._open.get(name)
            if buf is None:
                buf = self._open[name] = torch.empty(tensor.shape, dtype=tensor.data.dtype,
                                                     device=tensor.data.device)
            buf.view(-1)[tensor.offset:tensor.end].copy_(tensor.data)
            if tensor.end == numel(tensor.shape):
                out.append((name, self._open.pop(name)))
        return out

    @property
    def pending(self) -> list[str]:
        return sorted(self._open)

    def clear(self) -> None:
        self._open.clear()


@runtime_checkable
class WeightSink(Protocol):
    """What the kit loads into: an engine's own verbs for one sync.

    ``device`` is where the engine's parameters live (a receiver maps onto it);
    ``load_weights`` takes ``(HF name, tensor)`` pairs of one request and returns
    how many names it completed. Its tensors are views of the sender's staging:
    they must be copied out before the call returns.
    """

    device: torch.device

    def preflight(self, specs: Sequence[TensorSpec]) -> None: ...
    def begin_load(self) -> None: ...
    def load_weights(self, named: Sequence[tuple[str, Any]]) -> int: ...
    def end_load(self) -> int: ...
    def flush_cache(self) -> None: ...


def parse_specs(specs: Sequence[Sequence[Any]]) -> list[TensorSpec]:
    """A spec list as it crosses the channel (``[[name, shape, dtype], ...]``), as ``TensorSpec``\\ s."""
    out = []
    for entry in specs:
        name, shape, dtype = entry
        out.append(TensorSpec(name=name, shape=tuple(shape), dtype=dtype, nbytes=numel(shape) * itemsize(dtype)))
    return out


class EngineKit:
    """The receiving half of an engine, around its :class:`WeightSink`.

    Every method is one request of colo's engine protocol
    (:class:`colo.core.interfaces.EngineReceiver`) and answers plain data, so
    an engine can serve them over any channel: colo's socket, Ray, vLLM's
    ``collective_rpc``. The kit keeps no state of the engine's own (versions,
    memory tags): that is the adapter's.
    """

    def __init__(self, sink: WeightSink, *, log: Callable[..., None] = log) -> None:
        self.sink = sink
        self._log = log
        #: transport name -> its engine-side receiver (``colo.transports``)
        self._receivers: dict[str, Any] = {}
        #: the key of the last spec list preflight accepted: a sync whose specs did not
        #: change since then sends only the key (metadata cached across syncs)
        self._preflight_key: str | None = None
        #: the spec list preflight last accepted, in the trainer's order
        self.accepted: list[TensorSpec] = []

    # -- the spec list -------------------------------------------------------------
    def preflight(self, specs: list[list] | None = None, key: str | None = None) -> dict:
        """Check a sync's (name, shape, dtype) list; ``key`` alone names the last list this
        engine accepted (a list that changed is sent whole again and checked again)."""
        if specs is None:
            if key is None or key != self._preflight_key:
                raise PreflightNotCached(f"preflight key {key} is not the last spec list this engine accepted "
                                         f"({self._preflight_key}); send the specs")
            return {}
        parsed = parse_specs(specs)
        self._preflight_key = None
        self.sink.preflight(parsed)
        self.accepted = parsed
        if key is not None:
            if key != layout_key(specs):
                raise ValueError(f"preflight key {key} is not the hash of its specs ({layout_key(specs)})")
            self._preflight_key = key
        return {}

    # -- the load session -------------------------------------------------------------
    def begin_load(self, preflight_key: str | None = None) -> dict:
        """Begin a load; ``preflight_key`` first names the spec list this engine last
        accepted (a sync whose specs did not change checks them in this request)."""
        if preflight_key is not None:
            self.preflight(key=preflight_key)
        self.sink.begin_load()
        return {}

    def transport_load(self, transport: str, request: dict, begin_load: bool = False,
                       preflight_key: str | None = None, end_load: bool = False,
                       flush_cache: bool = False) -> dict:
        """Receive one request through the transport's receiver and load what it yields.

        ``begin_load``: begin the load first (with ``preflight_key``, see
        :meth:`begin_load`): a sync's first load carries its begin, one round trip
        less per sync. ``end_load``: end it afterwards, as :meth:`end_load` (with
        ``flush_cache``): a sync's last load carries its end, one more round trip less.
        Transports whose init info is empty get a receiver on first use."""
        began = time.perf_counter()
        if begin_load is True:
            self.begin_load(preflight_key=preflight_key)
        receiver = self._receiver(transport)
        t0 = time.perf_counter()
        device = self.sink.device
        # the collector paused for the request (colo.proc.collector): a collection inside it
        # stops the load as one in the trainer's sync stops the sync
        with collector_paused(), receiver.receive(request) as named:
            opened = time.perf_counter()
            # the device's own span of the load, from the first copy it could start to the
            # last one's end: a host clock cannot tell copies running slow from copies
            # queued late (issue 44: a one-copy offload-first load at 48-52 GB/s)
            marks = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) \
                if device.type == "cuda" else None
            if marks is not None:
                marks[0].record()
            # copied into the engine's parameters: after the reply the sender may
            # reuse or free whatever ``named`` views
            n = self.sink.load_weights(named)
            del named
            queued = time.perf_counter()
            if marks is not None:
                marks[1].record()
                # The ack promises the sender may reuse or free the memory: the
                # copies out of it must have finished, not merely been queued.
                torch.cuda.synchronize(device)
        done = time.perf_counter()
        # where the engine's time went (a sync's timeline, bench/sync_timeline.py): load_s
        # is the copies queued (queue_s) and waited for (wait_s)
        reply = {"handoff_s": opened - t0, "load_s": done - opened, "queue_s": queued - opened,
                 "wait_s": done - queued, "begin_s": t0 - began, "tensors": n}
        if marks is not None:
            reply["device_s"] = marks[0].elapsed_time(marks[1]) / 1e3
        route = getattr(self.sink, "last_route", None)
        if isinstance(route, str):
            # the queueing's seconds again under the route the sink took (colo's engine: a layout
            # planned before, one launch, tensor by tensor...), summed per sync like every ``_s``
            reply[f"route_{route}_s"] = queued - opened
            for part, seconds in (getattr(self.sink, "last_route_parts", None) or {}).items():
                reply[f"route_{route}_{part}_s"] = seconds
        if end_load is True:
            # a refused end (a tensor missing) answers this request with its error: the
            # load above happened, the sync did not, and the sender treats it as failed
            reply.update(self.end_load(flush_cache=flush_cache), ended=True, end_s=time.perf_counter() - done)
        return reply

    def end_load(self, flush_cache: bool = False) -> dict:
        """End the load (the engine accepts the whole sync or raises); ``flush_cache``: then
        flush the prefix cache, as SGLang's weight update does by default, instead of a
        request of its own after the sync."""
        self.release()
        self.sink.end_load()
        if flush_cache is True:
            self.sink.flush_cache()
        return {"flushed": flush_cache is True}

    # -- transports ---------------------------------------------------------------------
    def transport_init(self, transport: str, init_info: dict) -> dict:
        """Build the receiver of ``transport`` from its init info (replacing an old one).

        A broadcast receiver joins the sender's process group here: the sender
        must be joining it at the same time."""
        from colo.transports import get_strategy

        strategy = get_strategy(transport)
        self._set_receiver(transport, strategy, strategy.init_info_type.from_json(init_info))
        return {}

    def transport_close(self, transport: str) -> dict:
        receiver = self._receivers.pop(transport, None) if isinstance(transport, str) else None
        if receiver is not None:
            receiver.close()
        return {}

    def _receiver(self, transport: str) -> Any:
        from colo.transports import get_strategy
        from colo.transports.base import EmptyInitInfo

        receiver = self._receivers.get(transport) if isinstance(transport, str) else None
        if receiver is None:
            strategy = get_strategy(transport)  # the allow-list: only registered transports
            if strategy.init_info_type is not EmptyInitInfo:
                raise ValueError(f"transport {transport!r} is not initialised on the engine: "
                                 f"call transport_init first")
            receiver = self._set_receiver(transport, strategy, EmptyInitInfo())
        return receiver

    def _set_receiver(self, transport: str, strategy: Any, info: Any) -> Any:
        old = self._receivers.pop(transport, None)
        if old is not None:
            old.close()
        receiver = strategy.create_receiver(info, device=self.sink.device)
        self._receivers[transport] = receiver
        return receiver

    # -- mapped buffers -------------------------------------------------------------------
    def release(self, *, kept: bool = False) -> None:
        """Let go of what the last sync mapped (segments, handles); a process group or a
        checkpoint root outlives the sync, and so does a buffer the sender keeps from
        sync to sync, unless ``kept``."""
        for receiver in self._receivers.values():
            receiver.release(kept=kept)

    def drop_handles(self) -> dict:
        """After a failed sync: let go of every buffer the sender mapped, kept ones too."""
        self.release(kept=True)
        return {}

    def close(self) -> None:
        """Let go of everything and close every receiver (the engine is shutting down)."""
        self.release(kept=True)
        for receiver in self._receivers.values():
            try:
                receiver.close()
            except Exception as e:  # closing one must not keep the others open
                self._log("transport.close_failed", error=f"{type(e).__name__}: {e}")
        self._receivers.clear()


__all__ = ["EngineKit", "LoadSession", "PieceAssembler", "WeightSink", "parse_specs"]


def check_tags(tags: Sequence[str], action: str, *, engine: str, known: Sequence[str],
               released_now: set[str], released: bool) -> list[str]:
    """The tags an adapter may ``action`` (release or resume), checked before its engine
    is asked. ``released`` says which state each tag must be in now: a real engine only
    warns on a tag woken twice (vLLM), raises deep in its scheduler (SGLang) or aborts
    the process on a second pause (torch_memory_saver), so colo refuses both directions
    first, naming the engine's own tags when it is given one it does not have."""
    if isinstance(tags, str):
        raise EngineStateError(f"tags must be a sequence of tag names, got the string {tags!r}")
    tags = list(tags)
    unknown = [t for t in tags if t not in known]
    if unknown:
        raise EngineStateError(f"cannot {action} tag(s) {', '.join(unknown)}: not a tag of this engine "
                               f"({engine} has only {', '.join(known)})")
    wrong = [t for t in tags if (t in released_now) != released]
    if wrong:
        raise EngineStateError(f"cannot {action} tag(s) {', '.join(wrong)}: already "
                               f"{'released' if not released else 'resident'}")
    return tags
