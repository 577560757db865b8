"""colo.proc.rendezvous: a process group whose store its starter serves.

CI (2026-11-27) failed a two-rank engine's start with ``EADDRINUSE``: rank 0 was
told a port that had been free when the driver chose it and was taken by another
process before rank 0 listened on it. A hosted store is listening from the moment
its init method exists, so nothing can take its port in between.
"""

from __future__ import annotations

import datetime
import errno
import socket
import time
from pathlib import Path

import pytest
import torch

from tests.dist_helpers import HANG_GUARD_S, _mp_context


def _join_and_reduce(init_method: str, rank: int, world_size: int, out: str) -> None:
    import torch.distributed as dist

    from colo.proc.rendezvous import init_default_group

    torch.set_num_threads(1)
    init_default_group("gloo", init_method, rank=rank, world_size=world_size,
                       timeout=datetime.timedelta(seconds=HANG_GUARD_S / 2))
    try:
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        Path(out).write_text(f"{dist.get_rank()} {dist.get_world_size()} {t.item():g}")
    finally:
        dist.destroy_process_group()


def test_the_port_of_a_hosted_store_is_held_from_the_moment_its_init_method_exists():
    from colo.proc.rendezvous import SCHEME, HostedStore, parse

    hosted = HostedStore(2)
    assert hosted.init_method == f"{SCHEME}127.0.0.1:{hosted.port}"
    assert parse(hosted.init_method) == ("127.0.0.1", hosted.port)
    # what took rank 0's port in CI: another process binding it before rank 0 listened
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        with pytest.raises(OSError) as e:
            s.bind(("127.0.0.1", hosted.port))
        assert e.value.errno == errno.EADDRINUSE
    hosted.close()


def test_every_rank_rank_0_too_joins_as_a_client_of_the_store_its_parent_serves(tmp_path):
    from colo.proc.rendezvous import HostedStore

    world = 3
    hosted = HostedStore(world)
    ctx = _mp_context()
    outs = [str(tmp_path / f"rank{r}") for r in range(world)]
    procs = [ctx.Process(target=_join_and_reduce, args=(hosted.init_method, r, world, outs[r]), daemon=True)
             for r in range(world)]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + HANG_GUARD_S
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        assert [p.exitcode for p in procs] == [0] * world
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        hosted.close()
    # each rank is who it was told to be, and the all-reduce met every one of them: 1 + 2 + 3
    assert [Path(o).read_text() for o in outs] == [f"{r} {world} 6" for r in range(world)]


@pytest.mark.parametrize("bad", ["tcp://127.0.0.1:80", "colo-store://127.0.0.1", "colo-store://:80",
                                 "colo-store://h:0", "colo-store://h:65536", "colo-store://h:x1"])
def test_an_init_method_that_is_not_colo_store_host_port_is_refused_by_name(bad):
    from colo.proc.rendezvous import parse

    with pytest.raises(ValueError, match="is not colo-store://host:port") as e:
        parse(bad)
    assert repr(bad) in str(e.value)


@pytest.mark.parametrize("size", [0, -1, True, 2.0])
def test_a_world_size_that_is_not_a_positive_count_is_refused(size):
    from colo.proc.rendezvous import HostedStore

    with pytest.raises(ValueError, match="world_size must be a positive number of ranks"):
        HostedStore(size)
