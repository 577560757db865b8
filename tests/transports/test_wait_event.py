"""``wait_event``: how a sender waits for a CUDA event without stalling its event loop
or, where a gather runs in a thread beside it, that thread (issue 46).

The events here are stand-ins with CUDA events' two methods (``query``,
``synchronize``): what is checked is where and how often ``wait_event`` calls them,
which needs no GPU."""

from __future__ import annotations

import functools
import threading

import anyio

from colo.transports.base import EVENT_POLL_S, wait_event


class Event:
    """Done after ``queries`` queries, or once synchronized; records the threads that asked."""

    def __init__(self, queries: int):
        self.left = queries
        self.query_threads: list[int] = []
        self.sync_threads: list[int] = []

    def query(self) -> bool:
        self.query_threads.append(threading.get_ident())
        self.left -= 1
        return self.left < 0

    def synchronize(self) -> None:
        self.sync_threads.append(threading.get_ident())
        self.left = -1


def test_without_polling_an_unfinished_event_is_waited_for_in_a_worker_thread_at_once():
    """``poll_s=0``: one query, then the wait goes to a thread; the event loop never spins
    (a spinning loop held the interpreter from the gather thread beside it)."""
    ev = Event(queries=10 ** 9)  # never done by querying

    async def main() -> int:
        await wait_event(ev, poll_s=0.0)
        return threading.get_ident()

    loop_thread = anyio.run(main)
    assert len(ev.query_threads) == 1 and ev.query_threads[0] == loop_thread
    assert len(ev.sync_threads) == 1 and ev.sync_threads[0] != loop_thread


def test_a_finished_event_is_not_waited_for_and_a_soon_finished_one_is_polled_on_the_loop():
    for poll_s in (0.0, EVENT_POLL_S):
        done = Event(queries=0)
        anyio.run(functools.partial(wait_event, done, poll_s=poll_s))
        assert len(done.query_threads) == 1 and done.sync_threads == []
    # done at its third query: within the default poll, no thread (a hop costs ~0.3 ms)
    soon = Event(queries=2)

    async def main() -> int:
        await wait_event(soon, poll_s=60.0)  # a long poll: the third query comes well within it
        return threading.get_ident()

    loop_thread = anyio.run(main)
    assert soon.query_threads == [loop_thread] * 3 and soon.sync_threads == []
