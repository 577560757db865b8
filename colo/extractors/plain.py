"""Extractor for an unsharded trainer: a plain ``nn.Module`` or a name -> tensor mapping.

Every tensor of the module's state dict (parameters and persistent buffers)
is one engine tensor under the same name, unless ``rename`` maps or drops it.
A parameter the module holds under two names (tied word embeddings) is one
tensor, sent once under the name ``named_parameters()`` gives it.
Floating-point tensors are converted to the engine dtype here, on the
trainer's side; integer and bool buffers keep their dtype.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from colo.core.buckets import ALIGN, spec
from colo.core.interfaces import TensorSpec
from colo.dtypes import as_dtype, dtype_name  # noqa: F401 (re-exported)
from colo.core.errors import UnknownTensor
from colo.device import canonical_device
from colo.device.zero_copy import convert_from_host, convert_run, copy_all, device_view

DTypeLike = torch.dtype | str | None


def resolve_dtype(dtype: DTypeLike) -> torch.dtype | None:
    """``torch.bfloat16``, ``"bfloat16"`` or ``"torch.bfloat16"``; ``None`` keeps each tensor's dtype."""
    return as_dtype(dtype, allow_none=True, what="engine dtype")


def engine_dtype_of(dtype: torch.dtype, engine: torch.dtype | None) -> torch.dtype:
    # Integer and bool tensors (step counters, masks) are not weights to cast.
    if engine is None or not dtype.is_floating_point:
        return dtype
    return engine


def to_engine(t: torch.Tensor, engine: torch.dtype | None, device: torch.device | None) -> torch.Tensor:
    """Move, then convert: the host copy is pinned, so uploading it as is runs at
    full bandwidth, while a copy converted on the host would be pageable (7x
    slower to upload) and the conversion itself is faster on the device.

    A pinned host tensor due for conversion is not uploaded at all: the
    conversion kernel reads it across PCIe where it lies (:mod:`colo.device.zero_copy`)."""
    t = t.detach()
    if device is not None and t.device != device:
        target = engine_dtype_of(t.dtype, engine)
        if target != t.dtype and device.type == "cuda":
            done = convert_from_host([t], target, device, ALIGN)
            if done is not None:
                return done[0]
        # From pinned memory the copy is queued, not waited for: the next
        # tensor's upload overlaps it, and whoever reads the result (pack) is on
        # the same stream, so the order is kept. The source (a pinned host
        # backup) outlives the copy.
        t = t.to(device, non_blocking=t.device.type == "cpu" and t.is_pinned())
    return t.to(engine_dtype_of(t.dtype, engine)).contiguous()


def check_request(names: Sequence[str], known: Mapping[str, Any] | set[str], who: str) -> list[str]:
    """Refuse the whole request before the first collective, so every rank fails alike."""
    if isinstance(names, (str, bytes)):
        raise TypeError(f"{who}: extract() takes a sequence of names, got the single string {names!r}")
    names = list(names)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise UnknownTensor(f"{who}: unknown tensor name(s) {unknown}; the extractor knows {len(known)} "
                            f"names (see specs())")
    seen: set[str] = set()
    dup: list[str] = []
    for n in names:
        if n in seen and n not in dup:
            dup.append(n)
        seen.add(n)
    if dup:
        raise ValueError(f"{who}: tensor name(s) {dup} requested more than once in one extract()")
    return names


def check_against_spec(who: str, name: str, t: torch.Tensor, s: TensorSpec) -> torch.Tensor:
    """The transport packs at offsets planned from ``specs()``: a tensor that no
    longer matches them (a resized parameter) would corrupt its neighbours."""
    if tuple(t.shape) != s.shape or dtype_name(t.dtype) != s.dtype:
        raise ValueError(f"{who}: {name!r} is now {tuple(t.shape)} {dtype_name(t.dtype)}, but specs() "
                         f"promised {s.shape} {s.dtype}; build a new extractor after changing the model")
    return t


class PlainExtractor:
    """Full tensors straight from an unsharded ``module`` (or a name -> tensor ``mapping``).

    ``dtype`` is the engine's dtype (``None``: keep the trainer's). ``device``,
    when given, is where tensors are moved before conversion: set it when
    the source is a pinned host copy (offload-first) so the bucket is built on
    the device. ``rename(name)`` returns the engine's name for a state-dict
    name, or ``None`` to leave the tensor out (e.g. a tied ``lm_head.weight``).

    Tensors are looked up again on every ``extract``, so an optimizer step or
    an offload that swaps ``param.data`` is seen. A yielded tensor may alias
    the trainer's parameter when no conversion or move is needed: consume it
    before the next step and never write to it.
    """

    kind = "plain"

    def __init__(self, source: torch.nn.Module | Mapping[str, torch.Tensor], *, dtype: DTypeLike = None,
                 device: torch.device | str | None = None,
                 rename: Callable[[str], str | None] | None = None, upload_to: torch.device | str | None = None):
        if not isinstance(source, (torch.nn.Module, Mapping)):
            raise TypeError(f"{self.kind} extractor: source must be an nn.Module or a mapping of name to tensor, "
                            f"got {type(source).__name__}")
        self._source = source
        self.dtype = resolve_dtype(dtype)
        # canonical ("cuda" is the current GPU's index): compared with tensors' devices
        self.device = None if device is None else canonical_device(device)
        if upload_to is not None and device is not None:
            raise ValueError(f"{self.kind} extractor: give device (upload here) or upload_to (the transport "
                             "uploads into its own buffer), not both")
        #: where a transport should stage this source's tensors: they come out
        #: on the host and are copied once, straight into the staging buffer
        self.upload_to = None if upload_to is None else canonical_device(upload_to)
        self._engine_to_source: dict[str, str] = {}
        self._specs: dict[str, TensorSpec] = {}
        #: engine name -> (host tensor's address, numel, dtype, device; its device view)
        self._views: dict[str, tuple[tuple, torch.Tensor]] = {}
        #: a request's first name -> how it was extracted (see ``_ExtractMemo``)
        self._memos: dict[str, _ExtractMemo] = {}
        aliases = second_names(source) if isinstance(source, torch.nn.Module) else set()
        for src_name, t in self._tensors().items():
            if src_name in aliases:
                continue
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{self.kind} extractor: {src_name!r} is a {type(t).__name__}, not a tensor")
            self._check_tensor(src_name, t)
            name = src_name if rename is None else rename(src_name)
            if name is None:
                continue
            if name in self._engine_to_source:
                raise ValueError(f"{self.kind} extractor: {src_name!r} and {self._engine_to_source[name]!r} "
                                 f"both map to engine name {name!r}")
            self._engine_to_source[name] = src_name
            self._specs[name] = spec(name, t.shape, dtype_name(engine_dtype_of(t.dtype, self.dtype)))

    def _tensors(self) -> Mapping[str, torch.Tensor]:
        if isinstance(self._source, torch.nn.Module):
            return self._source.state_dict()
        return self._source

    def _check_tensor(self, name: str, t: torch.Tensor) -> None:
        if _is_dtensor(t):
            raise TypeError(f"{self.kind} extractor: {name!r} is a sharded DTensor; use FSDPExtractor, "
                            f"which gathers it with full_tensor()")

    def _full(self, name: str, t: torch.Tensor) -> torch.Tensor:
        return to_engine(t, self.dtype, self.device)

    def specs(self) -> Sequence[TensorSpec]:
        return list(self._specs.values())

    #: ``extract(names, into)`` writes conversions into the caller's tensors
    extracts_into = True

    @property
    def source_device(self) -> torch.device | None:
        """Where the source tensors lie (a module's first parameter, a mapping's first value)."""
        src = self._source
        first = next(iter(src.parameters()), None) if isinstance(src, torch.nn.Module) \
            else next(iter(src.values()), None)
        return None if first is None else first.device

    def extract(self, names: Sequence[str], into: Mapping[str, torch.Tensor] | None = None
                ) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, full tensor in the engine dtype)`` for each name, in order. ``into``:
        where the caller wants some results (a staging buffer's typed views, by name):
        a tensor converted on a GPU is written there and yielded as that tensor."""
        # Checked here, not inside the generator: a bad request fails at the
        # call, on every rank, before anything is gathered.
        names = check_request(names, self._engine_to_source, f"{self.kind} extractor")
        return self._extract(names, into or {})

    def _extract(self, names: list[str], into: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        tensors = self._tensors()
        memo = self._memos.get(names[0]) if names else None
        if memo is not None:
            again = memo.replay(self, names, into, tensors)
            if again is not None:
                yield from again
                return
        sources = []
        for name in names:
            src_name = self._engine_to_source[name]
            t = tensors.get(src_name)
            if t is None:
                raise UnknownTensor(f"{self.kind} extractor: {src_name!r} is no longer in the source "
                               f"(it was there when the extractor was built)")
            sources.append((name, src_name, t))
        groups: list[tuple[list[str], torch.device]] = []
        converted = self._convert_batch(sources, into, groups)
        outs = []
        for name, src_name, t in sources:
            out = converted.get(name)
            outs.append((name, check_against_spec(f"{self.kind} extractor", name,
                                                  out if out is not None else self._full(src_name, t),
                                                  self._specs[name])))
        if names:
            self._memos[names[0]] = _ExtractMemo.of(sources, outs, into, groups)
        yield from outs

    def _convert_batch(self, sources: list[tuple[str, str, torch.Tensor]], into: Mapping[str, torch.Tensor],
                       groups: list[tuple[list[str], torch.device]] | None = None) -> dict[str, torch.Tensor]:
        """The request's tensors that are due for a conversion on a GPU, converted in one
        batch (:func:`colo.device.zero_copy.convert_run`): pinned host tensors read in place by
        the kernel (:func:`colo.device.zero_copy.device_view`), device tensors where they are;
        one buffer and one multi-tensor copy instead of an upload, a conversion and an
        allocation per tensor, and the results lie back to back at the planner's
        alignment, so the pack moves them as one run. Empty when nothing qualifies
        (those tensors take :meth:`_full`)."""
        by_dtype: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
        for name, _, t in sources:
            target = engine_dtype_of(t.dtype, self.dtype)
            if target == t.dtype or _is_dtensor(t):
                continue  # nothing to convert; a shard is gathered first (a subclass's _full)
            where = self.device if self.device is not None else t.device
            if where.type != "cuda":
                continue
            src = t.detach() if t.device == where else self._device_view(name, t.detach(), where)
            if src is not None:
                by_dtype.setdefault(target, []).append((name, src))
        out: dict[str, torch.Tensor] = {}
        for target, group in by_dtype.items():
            device = group[0][1].device
            dests = [into.get(name) for name, _ in group]
            if all(d is not None and d.device == device and d.dtype == target and d.shape == t.shape
                   for d, (_, t) in zip(dests, group)):
                copy_all(dests, [t for _, t in group])  # straight into the caller's buffer
                done = dests
                if groups is not None:  # what a later extract of the same request repeats
                    groups.append(([name for name, _ in group], device))
            else:
                done = convert_run([t for _, t in group], target, device, ALIGN)
            out.update(zip((name for name, _ in group), done))
        return out

    def _device_view(self, name: str, t: torch.Tensor, device: torch.device) -> torch.Tensor | None:
        """A device view of pinned host tensor ``t`` (None: upload it instead), kept while
        ``t`` is the same memory: a host backup that stays allocated from pause to pause
        (torch_memory_saver's retained backup, flat weights' pinned copy) is viewed once,
        not every sync (about 25 us a view)."""
        key = (t.data_ptr(), t.numel(), t.dtype, device)
        held = self._views.get(name)
        if held is not None and held[0] == key:
            return held[1]
        view = device_view(t, device)
        if view is not None:
            self._views[name] = (key, view)
        return view


class _ExtractMemo:
    """One request as it was extracted, for the next extract of the same request.

    A transport asks for the same names sync after sync, often into the same staging
    views; a paused trainer's source is its pinned host backup, the same tensors at the
    same addresses. Then each result is what it was: either the caller's own tensor,
    converted into by one multi-tensor copy (done again, reading the new bytes), or the
    source tensor itself (nothing converted or moved). Looking up, converting, checking
    and placing 51 tensors again was about 1 ms of host time on an H100, most of the
    demo model's gather (issue 18); matching them is a few microseconds each.

    Sources and destinations are held weakly (a staging buffer freed after its sync,
    a backup the trainer dropped, go when their owners let go) and each source's
    address is compared: a tensor swapped or moved is extracted afresh. A request
    with any other result (an upload, a gathered shard) is not kept."""

    __slots__ = ("names", "src_names", "srcs", "ptrs", "dests", "groups")

    @classmethod
    def of(cls, sources: list, outs: list, into: Mapping[str, torch.Tensor],
           groups: list[tuple[list[str], torch.device]]) -> _ExtractMemo | None:
        in_groups = {n for names, _ in groups for n in names}
        dests: list[Any] = []
        for (name, _, t), (_, out) in zip(sources, outs):
            if name in in_groups and out is into.get(name):
                dests.append(weakref.ref(out))
            elif out.data_ptr() == t.data_ptr() and out.shape == t.shape and out.dtype == t.dtype \
                    and out.device == t.device:
                dests.append(None)  # the source itself
            else:
                return None
        memo = cls()
        memo.names = [n for n, _, _ in sources]
        memo.src_names = [sn for _, sn, _ in sources]
        memo.srcs = [weakref.ref(t) for _, _, t in sources]
        memo.ptrs = [t.data_ptr() for _, _, t in sources]
        memo.dests = dests
        position = {n: i for i, n in enumerate(memo.names)}
        memo.groups = [([position[n] for n in names], device) for names, device in groups]
        return memo

    def replay(self, extractor: PlainExtractor, names: list[str], into: Mapping[str, torch.Tensor],
               tensors: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]] | None:
        """The request's results again (its conversions queued on the current stream), or
        None where anything differs."""
        if names != self.names:
            return None
        outs, current = [], []
        for name, src_name, ref, ptr, dest in zip(self.names, self.src_names, self.srcs, self.ptrs, self.dests):
            t = tensors.get(src_name)
            if t is None or t is not ref() or t.data_ptr() != ptr:
                return None
            current.append(t)
            if dest is None:
                outs.append((name, t.detach()))
                continue
            d = dest()
            if d is None or into.get(name) is not d:
                return None
            outs.append((name, d))
        for positions, device in self.groups:
            # the kernels' sources as the first extract had them: the tensor where it
            # lies, or the held device view of its pinned host bytes
            src = []
            for i in positions:
                t = current[i]
                v = t.detach() if t.device == device else extractor._device_view(self.names[i], t, device)
                if v is None:
                    return None
                src.append(v)
            copy_all([outs[i][1] for i in positions], src)
        return outs


def second_names(module: torch.nn.Module) -> set[str]:
    """State-dict names of parameters the module also holds under an earlier name.

    A tied ``lm_head.weight`` is ``model.embed_tokens.weight``: ``state_dict()``
    lists both, ``named_parameters()`` only the first. Sending both would move
    the same bytes twice, and an engine that ties them refuses the second name.
    """
    every = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    return every - {n for n, _ in module.named_parameters()}


def _is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return False
    return isinstance(t, DTensor)
