"""What a soak samples of each of its processes, from inside the soak's own interpreter
(``tests/apps/test_soak_multi.py``, ``tests/vllm/test_soak.py``): resident memory, open fds
and the /dev/shm segments the process holds, read from /proc."""

from __future__ import annotations

import os

from colo.proc.handles import leftover_segments


def children(pid: int, *, all_threads: bool = False) -> list[int]:
    """``pid``'s children: those its main thread started, or with ``all_threads`` those of
    every thread (vLLM starts its engine core from the thread colo runs it on)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task") if all_threads else [str(pid)]
    except OSError:
        return []
    kids: list[int] = []
    for t in tasks:
        try:
            with open(f"/proc/{pid}/task/{t}/children") as f:
                kids += [int(p) for p in f.read().split()]
        except OSError:
            pass
    return kids


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, children of any of its threads."""
    out: list[int] = []
    for k in children(pid, all_threads=True):
        out += [k, *descendants(k)]
    return out


def cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode(errors="replace")


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def sample(pid: int) -> dict:
    """One sample of ``pid``: its resident bytes, open fds and /dev/shm segments."""
    return {"pid": pid, "rss": rss(pid), "fds": len(os.listdir(f"/proc/{pid}/fd")),
            "shm": len(leftover_segments(pid))}


def slope(points: list[tuple[int, int]]) -> float:
    """Least-squares slope of ``(cycle, bytes)`` points, in bytes a cycle."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    return sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
