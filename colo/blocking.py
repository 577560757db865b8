"""colo from synchronous code: its event loop on a thread of its own.

verl's, TRL's and OpenRLHF's training loops are synchronous. :func:`blocking` starts an
anyio event loop on a thread (anyio's blocking portal) for the length of a ``with`` block;
through it a synchronous loop creates colo's objects, enters the scheduler and calls the
handoff, each call returning when the coroutine has run::

    with colo.blocking() as loop:
        engine = loop.call(VllmEngine.attach, llm)
        sched = loop.enter(Scheduler(trainer, engine, memory, transport))
        sched.to_rollout()
        for batch in data:
            samples = llm.generate(...)     # your rollout, on your thread
            sched.to_train()
            train_step(samples)             # your step
            sched.to_rollout()
        loop.call(engine.aclose)

Nothing runs on the loop's thread between two calls: the phases are sequential, so the
caller's own use of an engine (vLLM's ``generate``) never overlaps colo's.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager
from typing import Any, TypeVar

from anyio.from_thread import BlockingPortal, start_blocking_portal

T = TypeVar("T")


class Loop:
    """The event loop a ``with blocking()`` block runs colo on."""

    def __init__(self, portal: BlockingPortal, stack: contextlib.ExitStack):
        self._portal, self._stack = portal, stack

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
        """``await fn(*args, **kwargs)`` on the loop; its result, or its exception raised here."""
        return self._portal.call(functools.partial(fn, *args, **kwargs))

    def enter(self, cm: AbstractAsyncContextManager[Any]) -> Any:
        """Enter the async context manager ``cm`` on the loop until the block ends (exited
        with the block's exception, if any) and give back what it yields, its coroutine
        methods made synchronous (:class:`Sync`)."""
        return Sync(self._stack.enter_context(self._portal.wrap_async_context_manager(cm)), self)

    def wrap(self, obj: Any) -> Any:
        """``obj`` with its coroutine methods made synchronous, run on the loop."""
        return Sync(obj, self)


class Sync:
    """A view of an object whose coroutine methods run on the loop when called; other
    attributes are the object's own."""

    def __init__(self, obj: Any, loop: Loop):
        object.__setattr__(self, "_obj", obj)
        object.__setattr__(self, "_loop", loop)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._obj, name)
        if inspect.iscoroutinefunction(attr):
            return functools.partial(self._loop.call, attr)
        return attr

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._obj, name, value)

    @property
    def unwrapped(self) -> Any:
        return self._obj


@contextlib.contextmanager
def blocking() -> Iterator[Loop]:
    """An event loop on a thread of its own for the block (see the module); what was entered
    through it is exited, in reverse order, when the block ends."""
    with start_blocking_portal() as portal, contextlib.ExitStack() as stack:
        yield Loop(portal, stack)


__all__ = ["Loop", "Sync", "blocking"]
