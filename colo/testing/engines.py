"""Engines for tests that drive a real transport.

- :class:`RecordingEngine`: another engine (the real client, a fake) with every
  call passed on and recorded; it can hold each load back, or keep the end of a
  load from the engine.
- :class:`ReceiverOnCore`: the engine's receiving side without the engine
  process: a transport's real receiver feeding a real
  :class:`~colo.engine.reference.core.EngineCore`, in the test's own process, where a test
  can hold a copy back until the sender has moved on.

The in-process engine that implements only the declared engine protocols is
:func:`colo.testing.fakes.protocol_engine`.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import anyio


class RecordingEngine:
    """``inner``, with what was asked of it: ``requests``, every ``transport_load``
    request as the transport handed it; ``calls``, the name of every method called
    through this wrapper, in order (only those in ``only``, where given); ``replies``,
    every ``transport_load``'s reply (the engine's own timing of each load).

    ``delay``: every load waits that many seconds before it is passed on (an engine
    that loads late: the sender runs ahead meanwhile). ``hold_end``: ``end_load``,
    asked on its own or with the last load, is not passed on: the engine keeps the
    buffers mapped, as one that has not finished its load would."""

    def __init__(self, inner: Any, *, only: Iterable[str] | None = None, delay: float = 0.0,
                 hold_end: bool = False):
        self.inner, self.delay, self.hold_end = inner, delay, hold_end
        self.only = None if only is None else frozenset(only)
        self.requests: list[Any] = []
        self.replies: list[Any] = []
        self.calls: list[str] = []

    @property
    def loads(self) -> int:
        return len(self.requests)

    def _record(self, name: str) -> None:
        if self.only is None or name in self.only:
            self.calls.append(name)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name.startswith("_") or not callable(attr):
            return attr

        def called(*args: Any, **kwargs: Any) -> Any:
            self._record(name)
            return attr(*args, **kwargs)

        return called

    async def transport_load(self, name: str, request: Any, on_sent: Any = None, **kwargs: Any) -> Any:
        self._record("transport_load")
        self.requests.append(request)
        if self.delay:
            await anyio.sleep(self.delay)
        if self.hold_end:  # nor the end riding on the last load
            kwargs.pop("end", None)
            kwargs.pop("flush_cache", None)
        reply = await self.inner.transport_load(name, request, on_sent=on_sent, **kwargs)
        self.replies.append(reply)
        return reply

    async def end_load(self, flush_cache: bool = False) -> None:
        self._record("end_load")
        if not self.hold_end:
            await self.inner.end_load(flush_cache)


class ReceiverOnCore:
    """The engine's side of a sync through ``transport`` (its name) in this process:
    ``receiver`` (that transport's real receiver) feeding ``core`` (a real EngineCore).
    Every request goes through JSON as on the wire and is kept in ``requests``.

    ``before_copy(i)``, where given, is awaited before request ``i`` (0, 1, ...) is
    copied, after the sender was told it went out: a test holds a copy back there."""

    def __init__(self, core: Any, receiver: Any, transport: str, *,
                 before_copy: Callable[[int], Awaitable[None]] | None = None):
        self.core, self.receiver, self.transport = core, receiver, transport
        self.before_copy = before_copy
        self.requests: list[dict] = []

    async def preflight(self, specs) -> None:
        self.core.preflight(specs)

    async def begin_load(self) -> None:
        self.core.begin_load()

    async def transport_load(self, name: str, request: Any, on_sent: Any = None, *, end: bool = False,
                             flush_cache: bool = False) -> dict:
        if name != self.transport:
            raise AssertionError(f"in-process engine of {self.transport!r}: a load through {name!r}")
        request = json.loads(json.dumps(request))
        index = len(self.requests)
        self.requests.append(request)
        if on_sent is not None:
            on_sent()
        if self.before_copy is not None:
            await self.before_copy(index)
        with self.receiver.receive(request) as named:
            reply = {"tensors": self.core.load_weights(named)}
        if end:
            await self.end_load(flush_cache)
            reply["ended"] = True
        return reply

    async def end_load(self, flush_cache: bool = False) -> None:
        self.receiver.release()
        self.core.end_load()

    async def drop_handles(self) -> None:
        self.receiver.release()
