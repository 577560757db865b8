"""An engine of your own, in this process: :class:`InProcessEngine`.

The smallest adapter colo has: your engine's receiving half is a
:class:`~colo.engine.kit.WeightSink` (where a sync's tensors go), the engine kit
hosts it, and this class is colo's engine protocol around both, with your
generation (a callable) and your memory tags. For an engine in another process
the same kit runs there (as :mod:`colo.engine.vllm_worker` does inside vLLM's
worker) and the driver side forwards each verb over the engine's own RPC (as
:mod:`colo.engine.vllm` does); ``docs/extending.md`` walks through both.

Kit calls run in a worker thread: a receiver may join a collective that the
sender, in this same process, joins at once (``broadcast``).
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import anyio.to_thread

from colo.core.errors import EngineError
from colo.core.interfaces import EngineCapabilities, RolloutResult, TensorSpec
from colo.digest import ReceivedDigest
from colo.engine.kit import EngineKit, WeightSink, check_tags


class _Recording:
    """The sink, with a record of what each sync delivered (the verification contract)."""

    def __init__(self, sink: WeightSink):
        self.sink, self.device = sink, sink.device
        self.received = ReceivedDigest()

    def preflight(self, specs: Sequence[TensorSpec]) -> None:
        self.sink.preflight(specs)

    def begin_load(self) -> None:
        self.received.clear()
        self.sink.begin_load()

    def load_weights(self, named: Any) -> int:
        items = list(named)
        n = self.sink.load_weights(items)  # the sink refuses a bad batch before anything is recorded
        self.received.add_many(items)  # the device's tensors checksummed in one launch
        return n

    def end_load(self) -> int:
        return self.sink.end_load()

    def flush_cache(self) -> None:
        self.sink.flush_cache()


class InProcessEngine:
    """colo's engine protocol around a :class:`~colo.engine.kit.WeightSink` in this process.

    ``generate(step)`` is your rollout for :meth:`Scheduler.cycle` (an async callable
    returning a :class:`~colo.core.interfaces.RolloutResult`); None where your loop rolls
    out itself between ``to_rollout()`` and ``to_train()``; ``tag_bytes`` your memory tags'
    sizes; ``release``/``resume`` (optional async callables taking the tags) free
    and restore them. colo refuses what your engine should: a tag released or
    resumed twice, a rollout on stale weights or without the KV cache. The digest
    is the contract every engine meets (:mod:`colo.digest`).
    """

    def __init__(self, sink: WeightSink, *, generate: Callable[[int], Awaitable[RolloutResult]] | None = None,
                 tag_bytes: Mapping[str, int], release: Callable[[list[str]], Awaitable[None]] | None = None,
                 resume: Callable[[list[str]], Awaitable[None]] | None = None,
                 capabilities: EngineCapabilities | None = None):
        self._recording = _Recording(sink)
        self.kit = EngineKit(self._recording)
        self._generate, self._release, self._resume = generate, release, resume
        self._tag_bytes = {k: int(v) for k, v in tag_bytes.items()}
        self.capabilities = capabilities or EngineCapabilities(tags=tuple(self._tag_bytes))
        self._paused: set[str] = set()
        self.weight_version: int | None = 0
        self._closed = False

    async def _kit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await anyio.to_thread.run_sync(lambda: fn(*args, **kwargs))

    # -- EngineSide ------------------------------------------------------------------
    def tag_bytes(self) -> dict[str, int]:
        return dict(self._tag_bytes)

    def _check(self, tags: Sequence[str], action: str, *, paused: bool) -> list[str]:
        return check_tags(tags, action, engine="this engine", known=list(self._tag_bytes),
                          released_now=self._paused, released=paused)

    async def release(self, tags: Sequence[str]) -> None:
        tags = self._check(tags, "release", paused=False)
        if self._release is not None:
            await self._release(tags)
        self._paused |= set(tags)
        if "weights" in tags:
            self.weight_version = None

    async def resume(self, tags: Sequence[str]) -> None:
        tags = self._check(tags, "resume", paused=True)
        if self._resume is not None:
            await self._resume(tags)
        self._paused -= set(tags)

    async def flush_cache(self) -> None:
        await self._kit(self._recording.flush_cache)

    async def generate(self, step: int) -> RolloutResult:
        if self._paused & {"weights", "kv_cache"}:
            raise EngineError("generate", "EngineStateError", f"cannot generate: {sorted(self._paused)} released")
        if self.weight_version is None:
            raise EngineError("generate", "EngineStateError", "cannot generate: the weights are stale")
        if self._generate is None:
            raise EngineError("generate", "NotImplementedError", "this engine has no generate: its rollout is the "
                              "caller's (Scheduler.to_rollout() / to_train()), not Scheduler.cycle()'s")
        return await self._generate(step)

    async def digest(self) -> str:
        order = [s.name for s in self.kit.accepted] or self._recording.received.names
        return self._recording.received.digest(order)

    async def set_weight_version(self, version: int | None) -> None:
        self.weight_version = version

    # -- EngineReceiver: the kit -----------------------------------------------------------
    async def preflight(self, specs: Sequence[TensorSpec]) -> None:
        wire = [[s.name, list(s.shape), s.dtype] for s in specs]
        await self._kit(self.kit.preflight, wire)

    async def begin_load(self) -> None:
        self.weight_version = None
        await self._kit(self.kit.begin_load)

    async def transport_init(self, transport: str, init_info: dict) -> None:
        await self._kit(self.kit.transport_init, transport, init_info)

    async def transport_load(self, transport: str, request: dict, on_sent: Any = None, *, end: bool = False,
                             flush_cache: bool = False) -> dict:
        if on_sent is not None:
            on_sent()
        return await self._kit(self.kit.transport_load, transport, request, end_load=end, flush_cache=flush_cache)

    async def transport_close(self, transport: str) -> None:
        await self._kit(self.kit.transport_close, transport)

    async def end_load(self, flush_cache: bool = False) -> None:
        await self._kit(self.kit.end_load, flush_cache)

    async def drop_handles(self) -> None:
        await self._kit(self.kit.drop_handles)

    # -- lifecycle (colo.core.interfaces.EngineLifecycle): no kill, it is this process --------
    @property
    def pid(self) -> int:
        """The process that holds the model: this one."""
        return os.getpid()

    def alive(self) -> bool:
        return not self._closed

    async def reported_version(self) -> int | None:
        """The weight version the engine holds (None: stale)."""
        return self.weight_version

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._kit(self.kit.close)


__all__ = ["InProcessEngine"]
