"""What a test made and left: counted against what this process held when the test began.

A test that fails keeps its frames alive in pytest's report (and in ``sys.last_traceback``)
until later, and with them the segments and descriptors its locals held: a count of all of
this process's segments or fds in the next test would fail that test too (issue 40: a
``[deadline]`` case's failure broke the ``[oom]`` case's teardown, ``assert 56 == 58``). So
each test compares only with its own beginning (the autouse fixture in ``tests/conftest.py``
marks it), and what an earlier test let go meanwhile is not this one's business."""

from __future__ import annotations

import gc
import os
import re

from colo.proc.handles import leftover_segments

#: this process's segments when the current test began
_SEGMENTS_AT_START: frozenset[str] = frozenset()


def begin_test() -> None:
    global _SEGMENTS_AT_START
    _SEGMENTS_AT_START = frozenset(leftover_segments())


def new_segments() -> list[str]:
    """This process's /dev/shm segments made since the current test began and still there."""
    return [n for n in leftover_segments() if n not in _SEGMENTS_AT_START]


def open_fds() -> dict[int, tuple[int, int]]:
    """This process's open descriptors, each by what it is open on ((device, inode)): a
    number closed and reused for another file is another descriptor."""
    gc.collect()
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            st = os.fstat(int(name))
        except OSError:
            continue  # the listing's own descriptor, closed by now
        out[int(name)] = (st.st_dev, st.st_ino)
    return out


def new_fds(before: dict[int, tuple[int, int]]) -> dict[int, str]:
    """Descriptors open now that were not open in ``before`` (fd -> what it points at)."""
    now = open_fds()
    out = {}
    for fd, ident in now.items():
        if before.get(fd) != ident:
            try:
                out[fd] = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                out[fd] = "?"
    return out


#: a UUID's name (uuid4's: eight, four, four, four and twelve hex digits): named after no process
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def named_after(pids) -> list[str]:
    """Entries of /dev/shm and /tmp named after one of ``pids`` (a pid as one of the name's parts
    split on ``.``, ``_`` or ``-``: vLLM's and torch's own names). A UUID's name is not one: its
    hex groups can read as a pid (a fresh-clone CI run matched ``/tmp/ad70f22d-d986-4594-...``,
    some other process's, against pid 4594)."""
    own = {str(p) for p in pids}
    return [f"{d}/{n}" for d in ("/dev/shm", "/tmp") for n in os.listdir(d)
            if not _UUID.fullmatch(n) and own.intersection(n.split(".") + n.split("_") + n.split("-"))]
