"""The small interfaces the scheduler reaches side effects through.

They follow the seed's split: the trainer side owns extraction (``WeightExtractor``)
and the sending half of a transfer strategy; the engine side owns receiving and
loading; a ``Transport`` (the strategy's trainer-side half) moves one sync.
Tests swap in fakes; ``colo.apps.demo`` and the transports provide the real ones.
Nothing here imports torch: metadata is plain data.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class TensorSpec:
    """What a bucket planner needs to know of one tensor: no data.

    ``rank_slice``: None, the whole tensor travels. ``(dim, start, length)``: only the
    block ``[start, start + shape[dim])`` of dimension ``dim`` travels, already cut by the
    sender for the one engine rank that holds it (a TP-MoE rank's slice of an expert, which
    the expert's owner sends to each rank instead of broadcasting the whole expert to all);
    ``length`` is that dimension's size in the whole tensor. ``shape`` and ``nbytes`` are
    always what travels (the block's), so planning, packing and the staging views need
    nothing new; :meth:`whole` is the tensor an engine's preflight checks.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the prefix, e.g. "bfloat16"
    nbytes: int
    rank_slice: tuple[int, int, int] | None = None

    @property
    def whole_shape(self) -> tuple[int, ...]:
        """The whole tensor's shape (``shape`` itself unless a rank's slice travels)."""
        if self.rank_slice is None:
            return self.shape
        dim, _, length = self.rank_slice
        return (*self.shape[:dim], length, *self.shape[dim + 1:])

    def whole(self) -> TensorSpec:
        """The spec of the whole tensor (an engine's preflight checks HF names and their whole
        shapes; where it is cut is said per tensor on the wire, ``colo.transports.wire``)."""
        if self.rank_slice is None:
            return self
        per = self.nbytes // max(1, _prod(self.shape)) if _prod(self.shape) else 0
        return TensorSpec(name=self.name, shape=self.whole_shape, dtype=self.dtype,
                          nbytes=per * _prod(self.whole_shape))


def _prod(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


@dataclass(frozen=True)
class RolloutResult:
    reward: float
    tokens: int
    data: Any = None  # what the trainer needs for its step (sequences, log-probs)


@dataclass(frozen=True)
class StageRecord:
    """One stage of one bucket, as data: what a sender reports and the scheduler
    writes as ``bucket.finished``. ``at`` is the sender's clock when the stage
    ended; ``staging_bytes`` what the sender held then."""

    bucket: int
    stage: str
    bytes: int
    tensors: int
    duration_s: float
    at: float
    staging_bytes: int


@dataclass(frozen=True)
class SyncResult:
    bytes: int
    buckets: int
    tensors: int
    #: every stage of every bucket, in the order they ended
    stages: tuple[StageRecord, ...] = ()
    #: the most staging memory held at once
    staging_peak: int = 0
    #: the engine flushed its prefix cache as it ended the load (``SyncContext.flush_cache``)
    cache_flushed: bool = False


class StagingPool(Protocol):
    """Staging memory for sync buffers, counted against the device budget before it exists."""

    def alloc(self, nbytes: int) -> int: ...
    def free(self, sid: int) -> None: ...

    @property
    def held_bytes(self) -> int: ...


@dataclass
class SyncContext:
    """What one sync needs to know, and what it reports back, as plain data.

    Nothing here points into the scheduler: a context can be built inside
    another process (a Ray actor) from its fields, and its ``stages`` travel
    back as data.
    """

    step: int
    weight_version: int
    bucket_bytes: int
    #: "device" when the trainer's weights are resident (sync-first), "host"
    #: when the pinned host copy is the source (offload-first, single-stage).
    source: str
    staging: StagingPool
    clock: Callable[[], float] = time.perf_counter
    stages: list[StageRecord] = field(default_factory=list)
    #: optional, in-process only: told of each record as it is made, so a local
    #: scheduler writes it while the device still holds what the stage held. A
    #: context rebuilt in another process has none; its records come back as data.
    on_stage: Callable[[StageRecord], None] | None = None
    #: the scheduler flushes the engine's prefix cache after the last load; a transport
    #: may have the engine flush it as it ends the load instead (one round trip less per
    #: sync, measured 0.5 ms on an H100) and says so in ``SyncResult.cache_flushed``
    flush_cache: bool = False
    #: the engine's own sub-state changes inside the sync (``session.opened``, ``session.closed``),
    #: as (event, clock) in order; ``on_mark`` is told of each as it happens (in-process only)
    marks: list[tuple[str, float]] = field(default_factory=list)
    on_mark: Callable[[str], None] | None = None
    #: the engine's own account of its loads, where its replies give one (colo's engine:
    #: ``handoff_s``, ``queue_s`` for the copies queued, ``wait_s`` for the device's finishing
    #: them...), summed over the sync's loads: where a load's time goes inside the engine,
    #: which the sender's ``load`` record (request out to ack back) cannot say
    engine_s: dict[str, float] = field(default_factory=dict)

    def mark(self, event: str) -> None:
        self.marks.append((event, self.clock()))
        if self.on_mark is not None:
            self.on_mark(event)

    def record(self, bucket: int, stage: str, nbytes: int, tensors: int, duration_s: float) -> None:
        rec = StageRecord(int(bucket), stage, int(nbytes), int(tensors), float(duration_s), self.clock(),
                          self.staging.held_bytes)
        self.stages.append(rec)
        if self.on_stage is not None:
            self.on_stage(rec)

    def result(self, *, bytes: int, buckets: int, tensors: int, cache_flushed: bool = False) -> SyncResult:
        peak = getattr(self.staging, "peak_bytes", self.staging.held_bytes)
        return SyncResult(bytes=bytes, buckets=buckets, tensors=tensors, stages=tuple(self.stages),
                          staging_peak=peak, cache_flushed=cache_flushed)


@runtime_checkable
class WeightExtractor(Protocol):
    """Trainer-side source of full, unsharded tensors in the engine's dtype.

    ``specs()`` lists every tensor the engine will receive, in extraction
    order. ``extract(names)`` yields ``(name, tensor)`` for exactly those names,
    in that order: full (sharding undone), converted to the engine dtype,
    contiguous. In a multi-rank trainer every rank calls ``extract`` with the
    same names in the same order (it runs collectives); only the rank that
    sends uses the tensors. Called once per bucket, so bucket i+1 can be
    extracted while bucket i is in flight.
    """

    def specs(self) -> Sequence[TensorSpec]: ...
    def extract(self, names: Sequence[str]) -> Iterator[tuple[str, Any]]: ...


@runtime_checkable
class TrainerSide(Protocol):
    def tag_bytes(self) -> Mapping[str, int]:
        """Bytes of each trainer tag (``weights``, ``optimizer``) when resident."""
        ...

    def param_specs(self) -> Sequence[TensorSpec]:
        """Every parameter as the engine will receive it (name, shape, engine dtype)."""
        ...

    def extractor(self) -> WeightExtractor:
        """The source the transport pulls full tensors from."""
        ...

    async def onload(self, tags: Sequence[str]) -> None: ...
    async def offload(self, tags: Sequence[str]) -> None: ...
    async def train_step(self, rollout: RolloutResult) -> Mapping[str, Any]: ...


#: the verification probes an engine can answer (see ``EngineCapabilities.probe``)
PROBES = ("logits", "logprobs")


@dataclass(frozen=True, kw_only=True)
class EngineCapabilities:
    """What an engine can do beyond the verbs every engine has, declared by the engine
    (never probed with ``getattr``) and written into the trace with the run's config.

    ``tags``: the memory tags it can release and resume (vLLM has no ``cuda_graph``).
    ``frees_memory``: releasing a tag gives its device memory back; False where the
    engine's release is control-plane only (vLLM's sleep on a CPU): the memory
    ledger then keeps counting the tag as held. ``probe``: how it answers the
    verification probe, ``"logits"`` (full logits of a token batch) or
    ``"logprobs"`` (the log-probability of each given token).
    """

    tags: tuple[str, ...] = ("weights", "kv_cache", "cuda_graph")
    frees_memory: bool = True
    probe: str = "logits"
    #: the probe needs the KV cache resident (vLLM's prompt logprobs run through its scheduler):
    #: after a sync that left it released, the probe waits for ``engine_wake_kv``
    probe_needs_kv: bool = False
    #: the engine refuses a weight load outside its own weight-update session (SGLang's
    #: begin/end_weight_update): its sender marks the session in the trace
    #: (``session.opened``/``session.closed``) and replay refuses a load outside one
    sessions: bool = False
    #: the engine pauses its generation before releasing memory and continues it at the next
    #: rollout (SGLang's server: it releases memory only when idle): the trace says so
    #: (``generation.paused``/``generation.continued``)
    pauses_generation: bool = False
    #: the engine's digest reads the weights its forward uses (colo's engine: its own row
    #: blocks), not the tensors as they arrived (vLLM and SGLang repack what they receive):
    #: a matching digest then proves every weight the forward reads, and the logits probe,
    #: which checks the engine's layout and math, runs on the first verified sync of each
    #: engine (again after a replacement or a failure), not on every one
    digest_live: bool = False
    #: what a sync loads is a LoRA adapter, staged beside the version serving and activated once
    #: verified (:class:`colo.engine.adapters.AdapterEngine`): the scheduler marks the stage in the
    #: trace (``adapter.staging``/``adapter.activated``) and replay refuses a load outside one
    adapters: bool = False
    #: the engine's own words on what it can do (why ``frees_memory`` is False, say)
    note: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.tags, tuple) or not all(isinstance(t, str) for t in self.tags):
            raise ValueError(f"engine capabilities: tags must be a tuple of tag names, got {self.tags!r}")
        if not isinstance(self.frees_memory, bool):
            raise ValueError(f"engine capabilities: frees_memory must be a bool, got {self.frees_memory!r}")
        if self.probe not in PROBES:
            raise ValueError(f"engine capabilities: probe must be one of {', '.join(PROBES)}, got {self.probe!r}")
        if not isinstance(self.probe_needs_kv, bool):
            raise ValueError(f"engine capabilities: probe_needs_kv must be a bool, got {self.probe_needs_kv!r}")
        for flag in ("sessions", "pauses_generation", "digest_live", "adapters"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"engine capabilities: {flag} must be a bool, got {getattr(self, flag)!r}")
        if not isinstance(self.note, str):
            raise ValueError(f"engine capabilities: note must be a string, got {self.note!r}")

    def to_json(self) -> dict:
        return {"tags": list(self.tags), "frees_memory": self.frees_memory, "probe": self.probe,
                **({"probe_needs_kv": True} if self.probe_needs_kv else {}),
                **({"sessions": True} if self.sessions else {}),
                **({"pauses_generation": True} if self.pauses_generation else {}),
                **({"digest_live": True} if self.digest_live else {}),
                **({"adapters": True} if self.adapters else {}),
                **({"note": self.note} if self.note else {})}

    @classmethod
    def from_json(cls, d: Mapping[str, Any] | None) -> EngineCapabilities:
        if d is None:
            return cls()
        return cls(tags=tuple(d.get("tags", cls.tags)), frees_memory=d.get("frees_memory", True),
                   probe=d.get("probe", "logits"), probe_needs_kv=d.get("probe_needs_kv", False),
                   sessions=d.get("sessions", False), pauses_generation=d.get("pauses_generation", False),
                   digest_live=d.get("digest_live", False), adapters=d.get("adapters", False),
                   note=d.get("note", ""))


@runtime_checkable
class EngineSide(Protocol):
    #: what the engine declares it can do (memory tags, whether release frees memory, its probe)
    capabilities: EngineCapabilities

    def tag_bytes(self) -> Mapping[str, int]:
        """Bytes of each engine tag (``weights``, ``kv_cache``, ``cuda_graph``) when resident."""
        ...

    async def release(self, tags: Sequence[str]) -> None: ...
    async def resume(self, tags: Sequence[str]) -> None: ...
    async def flush_cache(self) -> None: ...
    async def generate(self, step: int) -> RolloutResult: ...
    async def digest(self) -> str: ...
    async def set_weight_version(self, version: int | None) -> None:
        """The engine's own record of what it holds; ``None`` marks it stale."""
        ...


@runtime_checkable
class EngineLifecycle(Protocol):
    """What a run may ask of an engine beyond the phases' verbs: whether it lives, its
    process, killing it (fault injection, a crash), closing it, and the weight version it
    holds by its own record. An engine has those its registry entry declares
    (``colo.engine.EngineEntry.lifecycle``): an engine in the trainer's process cannot be
    killed on its own, and a run asks it no ``kill``."""

    @property
    def pid(self) -> int | None: ...
    def alive(self) -> bool: ...
    def kill(self) -> None: ...
    async def aclose(self) -> None: ...
    async def reported_version(self) -> int | None: ...


@runtime_checkable
class EngineProbe(Protocol):
    """The verification probe, answered as ``EngineCapabilities.probe`` says: ``logits``
    (``[batch, seq, vocab]``, or only the vocabulary ``columns``) or ``logprobs``
    (log p(token i | the tokens before it), i >= 1). An engine has the one it declares."""

    async def logits(self, tokens: list[list[int]], columns: list[int] | None = None) -> list: ...
    async def logprobs(self, tokens: list[list[int]]) -> list: ...


@dataclass(frozen=True)
class EngineVerb:
    """How one engine verb crosses to an engine in another process: its arguments, and the
    field its answer travels in (``reply``; None: no answer) encoded as ``codec``: ``json``
    (as it is), ``rollout`` (a ``RolloutResult``'s fields), ``f32`` (float32 bytes, base64,
    beside their ``shape``)."""

    args: tuple[str, ...] = ()
    reply: str | None = None
    codec: str = "json"


#: every verb a run asks of an engine in another process: ``EngineSide``'s, the probes
#: (``EngineProbe``) and the engine's own record of its version (``EngineLifecycle``). The
#: one forwarding of them is ``colo.engine.forward``; colo's engine process answers the same.
ENGINE_VERBS: Mapping[str, EngineVerb] = MappingProxyType({
    "release": EngineVerb(("tags",)),
    "resume": EngineVerb(("tags",)),
    "flush_cache": EngineVerb(),
    "set_weight_version": EngineVerb(("version",)),
    # order: HF names (an adapter run's check of the base weights); else the accepted spec list's
    "digest": EngineVerb(("order",), reply="digest"),
    "generate": EngineVerb(("step",), reply="rollout", codec="rollout"),
    "drop_handles": EngineVerb(),
    # adapter: the LoRA adapter version the forward applies (None: the base model)
    "logits": EngineVerb(("tokens", "columns", "adapter"), reply="f32le", codec="f32"),
    "logprobs": EngineVerb(("tokens",), reply="logprobs"),
    "reported_version": EngineVerb(reply="weight_version"),
})


class PhaseHooks(Protocol):
    """Told when a phase is entered (after ``phase.entered`` is written, before
    its effects) and when it failed (after ``phase.failed`` is written). Test
    tooling (the fault injector) acts here, never inside the trace writer."""

    def entered(self, phase: Any, step: int) -> None: ...
    def failed(self, phase: Any, step: int) -> None: ...


@runtime_checkable
class EngineReceiver(Protocol):
    """The engine's receiving half of every transport (the seed's
    ``WeightTransferReceiver`` + ``WeightLoader``): what a sender may call.

    A sync is ``preflight`` (every name, shape and dtype checked before the
    first byte moves), ``begin_load``, any number of ``transport_load`` (one
    request of transport ``transport``, plain JSON; the reply names the
    tensors loaded), ``end_load`` (the engine accepts the whole sync or
    raises; with ``flush_cache`` it then flushes its prefix cache). A sync's
    last ``transport_load`` may carry the end itself (``end=True``): the
    engine loads, then ends as ``end_load`` would, and its reply says
    ``ended``. ``transport_init``/``transport_close`` set up and tear down what a
    transport keeps across syncs (a process group, a checkpoint root).
    ``drop_handles`` lets go of every buffer a failed sync left mapped.
    """

    async def preflight(self, specs: Sequence[TensorSpec]) -> None: ...
    async def begin_load(self) -> None: ...
    async def transport_init(self, transport: str, init_info: dict) -> None: ...
    async def transport_load(self, transport: str, request: dict, on_sent: Callable[[], None] | None = None,
                             *, end: bool = False, flush_cache: bool = False) -> dict: ...
    async def transport_close(self, transport: str) -> None: ...
    async def end_load(self, flush_cache: bool = False) -> None: ...
    async def drop_handles(self) -> None: ...


@runtime_checkable
class Transport(Protocol):
    """The trainer-side half of a transfer strategy: moves one sync."""

    name: str

    async def sync(self, trainer: TrainerSide, engine: EngineSide, ctx: SyncContext) -> SyncResult: ...

    async def abort(self) -> None:
        """Drop in-flight buffers after a failure or cancellation (called shielded)."""
        ...


Clock = Callable[[], float]
