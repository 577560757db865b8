"""Python's cyclic garbage collector kept out of the handoff's hot paths.

A sync's host path allocates little, but a collection that falls inside it stops the
thread it runs on: 0.3-0.5 ms passes of the young generation landed in about every
other demo sync on an H100, and 2-3 ms older ones now and then, against a 5 ms sync
(issue 18). Both sides of a sync pause the collector for its length: the scheduler
around the sync's transport (the trainer's side) and the engine around each request's
receive and load (:meth:`colo.engine.kit.EngineKit.transport_load`). What the block
leaves is collected after it, at the collector's next turn.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic collector off for the block, and back on (if it was) after, also after a failure."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
