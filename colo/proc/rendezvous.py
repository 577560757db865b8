"""Where the processes of one process group meet, with no port to race for.

torch's ``tcp://host:port`` rendezvous has rank 0 *listen* on a port that somebody
chose earlier: colo chose one that was free a moment before, closed it, and handed
the number to processes that start seconds later. In the meantime any other process
on the machine may bind it, and rank 0 then fails ``EADDRINUSE`` (CI, 2026-11-27: a
two-rank engine's store, beside tests binding ports of their own).

A :class:`HostedStore` closes that window: the process that starts the ranks (the
driver, or an :class:`~colo.engine.reference.client.EngineClient` starting a TP engine) serves
the group's ``TCPStore`` itself, on a port the kernel gives it *while listening*, and
hands out ``colo-store://host:port``. Every rank, rank 0 included, joins as a client
through :func:`init_default_group`. The store must outlive the group's start (NCCL
also meets there to make its communicators, lazily), so its owner keeps it as long
as the ranks run. Any other init method (``tcp://``, ``file://``, ``env://``) goes
to torch as it is. A Ray run's groups meet at stores its rank 0's actor serves, on
that rank's node (the driver's may not be reachable from the others).
"""

from __future__ import annotations

import datetime
from typing import Any

#: the init method of a group whose store is served by the process that started it
SCHEME = "colo-store://"


class HostedStore:
    """A process group's ``TCPStore``, served by this process for ``world_size`` clients.

    ``init_method`` is what the ranks are given. Dropping the last reference (or
    :meth:`close`) stops serving: do that only after the ranks are gone."""

    def __init__(self, world_size: int | None, host: str = "127.0.0.1", timeout_s: float = 600.0):
        """``host``: the address the ranks are told (the store listens on every interface);
        ``world_size`` None: not known here (the store does not wait for the ranks anyway)."""
        import torch.distributed as dist

        if world_size is not None and (not isinstance(world_size, int) or isinstance(world_size, bool)
                                       or world_size < 1):
            raise ValueError(f"world_size must be a positive number of ranks, got {world_size!r}")
        # port 0: the kernel picks the port as the store starts listening on it, so no
        # other process can take it between the choice and the listen
        self._store: Any = dist.TCPStore(host, 0, world_size, True,
                                         timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
        self.host, self.port = host, int(self._store.port)
        self.init_method = f"{SCHEME}{host}:{self.port}"

    def close(self) -> None:
        self._store = None  # the server stops with the object

    def __repr__(self) -> str:
        return f"HostedStore({self.init_method!r})"


def parse(init_method: str) -> tuple[str, int]:
    """``(host, port)`` of a ``colo-store://host:port`` init method; ValueError names what is wrong."""
    if not init_method.startswith(SCHEME):
        raise ValueError(f"init method {init_method!r} is not {SCHEME}host:port")
    host, sep, port = init_method[len(SCHEME):].rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"init method {init_method!r} is not {SCHEME}host:port (a port in 1..65535)")
    return host, int(port)


def init_default_group(backend: str, init_method: str, *, rank: int, world_size: int,
                       timeout: datetime.timedelta, **kwargs: Any) -> None:
    """``torch.distributed.init_process_group`` for this process's default group, meeting
    at ``init_method``; a ``colo-store://`` one is joined as a client of its hosted store."""
    import torch.distributed as dist

    if init_method.startswith(SCHEME):
        host, port = parse(init_method)
        store = dist.TCPStore(host, port, world_size, False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **kwargs)
    else:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=timeout, **kwargs)
