"""Issue 16, interruptions: a signal in the middle of a packed sync is a
cancellation (exit 130, phase.failed "cancelled", trace finished, nothing left)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from colo.handles import SHM_DIR

from tests.test_reliability_process import REPO, _gone


@pytest.fixture
def short_tmp():
    # this test's own TMPDIR: every colo-demo-* and colo-engine-* of the run lands here
    d = tempfile.mkdtemp(prefix="cri-", dir="/tmp")
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


def _events(trace: Path) -> list[dict]:
    out = []
    for line in trace.read_text(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a line still being written
            break
    return out


def _mid_sync(events: list[dict]) -> bool:
    """A bucket has finished since the last phase.entered, and that phase is sync."""
    entered = [i for i, e in enumerate(events) if e.get("event") == "phase.entered"]
    if not entered or events[entered[-1]].get("to_phase") != "sync":
        return False
    return any(e.get("event") == "bucket.finished" for e in events[entered[-1]:])


def _demo(tmp: Path, *extra: str) -> tuple[subprocess.Popen, Path]:
    trace = tmp / "t.jsonl"
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(REPO), "PYTHONFAULTHANDLER": "1"}
    with open(tmp / "stderr", "ab") as ferr:
        proc = subprocess.Popen([sys.executable, "-m", "colo.cli", "demo", "--quiet", "--trace", str(trace),
                                 *extra], cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=ferr)
    return proc, trace


def _start_demo_mid_sync(tmp: Path) -> tuple[subprocess.Popen, Path, list]:
    """A 50-step demo with small buckets, stopped once a sync has handed a bucket over."""
    proc, trace = _demo(tmp, "--steps", "50", "--bucket-mib", "0.05")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if trace.exists() and _mid_sync(_events(trace)):
            break
        if proc.poll() is not None:
            pytest.fail(f"demo exited {proc.returncode} before a sync: {(tmp / 'stderr').read_text()[-2000:]}")
        time.sleep(0.02)
    else:
        proc.kill()
        proc.wait()
        pytest.fail("no bucket of a sync in the trace within 120 s")
    children = psutil.Process(proc.pid).children(recursive=True)
    assert children, "the demo has no engine process"
    return proc, trace, children


def _segments(pids: list[int]) -> list[str]:
    """The /dev/shm segments these processes created (colo names them colo-<pid>-<uuid>)."""
    prefixes = tuple(f"colo-{pid}-" for pid in pids)
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefixes))


def _ours(tmp: Path) -> list[str]:
    """This run's work dirs: the demo's colo-demo-* and the engine's colo-engine-* (TMPDIR is ours)."""
    return sorted(p.name for p in tmp.iterdir() if p.name.startswith(("colo-demo-", "colo-engine-")))


def _assert_nothing_left(proc: subprocess.Popen, children: list, tmp: Path) -> None:
    pids = [proc.pid, *(c.pid for c in children)]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if all(_gone(c) for c in children) and not _ours(tmp) and not _segments(pids):
            break
        time.sleep(0.1)
    assert [c.pid for c in children if not _gone(c)] == [], "processes of the run alive 10 s after it ended"
    assert _ours(tmp) == [], "work dirs of the run left behind"
    assert _segments(pids) == [], "shared-memory segments of the run left behind"


def _assert_cancelled_and_finished(trace: Path) -> None:
    events = _events(trace)
    assert events[-1]["event"] == "trace.finished"
    failed = [e for e in events if e["event"] == "phase.failed"]
    assert failed and failed[-1]["error"] == "cancelled", failed
    assert failed[-1]["phase"] == "sync"


@pytest.mark.parametrize("signals", [(signal.SIGTERM,), (signal.SIGINT, signal.SIGINT)],
                         ids=["sigterm", "sigint-twice"])
def test_a_signal_during_a_packed_sync_cancels_the_run_and_leaves_nothing(signals, short_tmp):
    proc, trace, children = _start_demo_mid_sync(short_tmp)
    for sig in signals:  # back to back: the second lands while the first is being cleaned up
        os.kill(proc.pid, sig)
    code = proc.wait(60)
    err = (short_tmp / "stderr").read_text(errors="replace")
    assert code == 130, (code, err[-3000:])
    assert "Traceback" not in err and "Fatal Python error" not in err, err[-3000:]
    _assert_cancelled_and_finished(trace)
    _assert_nothing_left(proc, children, short_tmp)

