"""Issue 16, the start-up sweep: what a SIGKILL of colo demo left behind (its work
dir, bucket segments in flight) is removed by the next demo, and nothing else is."""

import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest

from tests.apps.test_interrupt import _demo, _gone, _ours, _segments, _start_demo_mid_sync


@pytest.fixture
def short_tmp():
    # this test's own TMPDIR: the killed run's work dir and the next run's land here
    d = tempfile.mkdtemp(prefix="crs-", dir="/tmp")
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


def test_what_a_sigkill_left_behind_is_swept_by_the_next_demo(short_tmp):
    proc, _, children = _start_demo_mid_sync(short_tmp)
    # the whole run killed at once (an OOM killer, `kill -9` of the process group): no
    # process of it lives to clean up, not even the engine that otherwise would
    for c in children:
        c.kill()
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(10) == -signal.SIGKILL
    pids = [proc.pid, *(c.pid for c in children)]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(_gone(c) for c in children):
        time.sleep(0.1)
    assert [c.pid for c in children if not _gone(c)] == []
    left = _ours(short_tmp)
    # nothing of the run ran any cleanup: its work dir, named with its pid, is still there
    assert any(name.startswith(f"colo-demo-{proc.pid}-") for name in left), left
    segments = _segments(pids)  # mid-sync: the bucket segments in flight, if the kill caught any
    # a dir of another user's run, and names colo does not own, are never touched
    foreign = [short_tmp / "colo-demo-x", short_tmp / "colo-demo-1-abcdefgh", short_tmp / "unrelated"]
    for d in foreign:
        d.mkdir()
    second, _ = _demo(short_tmp, "--steps", "1")
    assert second.wait(300) == 0, (short_tmp / "stderr").read_text(errors="replace")[-3000:]
    assert [n for n in _ours(short_tmp) if n.startswith(f"colo-demo-{proc.pid}-")] == []
    assert _segments(pids) == [], f"segments of the killed run not swept (were {segments})"
    assert all(d.exists() for d in foreign)
