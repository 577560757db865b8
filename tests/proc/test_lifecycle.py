"""Issue 16, items 1 and 9: the engine process dies with the demo that started it,
whatever kills the demo, and a real engine death is EngineDied, not a ChannelError."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio
import psutil
import pytest

from colo.proc.channel import ChannelError
from colo.cli import main as cli_main
from colo.apps.demo import DemoConfig
from colo.engine.reference.client import EngineClient
from colo.core.errors import EngineDied
from colo.trainers.models import demo_config

from tests.waits import CEILING_S
from tests.conftest import SMALL_CFG

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def short_tmp():
    # our own short TMPDIR: the demo's colo-demo-* and the engine's colo-engine-* land here
    d = tempfile.mkdtemp(prefix="crp-", dir="/tmp")
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


def _gone(p: psutil.Process) -> bool:
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _engine_ready(log_path: Path) -> dict | None:
    """The engine's ``engine.ready`` line from its log (beside the trace: ``<trace>.engine.log``)."""
    if not log_path.exists():
        return None
    for line in log_path.read_text(errors="replace").splitlines():
        if line.startswith("{") and '"engine.ready"' in line:
            return json.loads(line)
    return None


def _start_demo_until_sync(tmp: Path, *extra: str, then: str | None = None):
    trace, err = tmp / "t.jsonl", tmp / "stderr"
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(REPO), "PYTHONFAULTHANDLER": "1"}
    with open(err, "wb") as ferr:
        proc = subprocess.Popen([sys.executable, "-m", "colo.cli", "demo", "--steps", "50", "--quiet",
                                 "--trace", str(trace), *extra], cwd=REPO, env=env,
                                stdout=subprocess.DEVNULL, stderr=ferr)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        text = trace.read_text(errors="replace") if trace.exists() else ""
        if '"to_phase":"sync"' in text and (then is None or f'"to_phase":"{then}"' in text.split('"to_phase":"sync"', 1)[1]):
            break
        if proc.poll() is not None:
            pytest.fail(f"demo exited {proc.returncode} before a sync: {err.read_text()[-2000:]}")
        time.sleep(0.1)
    else:
        proc.kill()
        proc.wait()
        pytest.fail("no sync phase in the trace within 120 s")
    ready = _engine_ready(tmp / "t.engine.log")
    assert ready is not None, err.read_text()[-2000:]
    children = psutil.Process(proc.pid).children(recursive=True)
    return proc, trace, ready, children


def _assert_engine_gone(ready: dict, children: list, tmp: Path) -> None:
    engine_pid, sockdir = ready["pid"], Path(ready["socket"]).parent
    assert engine_pid in [c.pid for c in children]
    assert sockdir.parent == tmp and sockdir.name.startswith("colo-engine-")
    deadline = time.monotonic() + CEILING_S
    while time.monotonic() < deadline:
        if all(_gone(c) for c in children) and not sockdir.exists():
            break
        time.sleep(0.1)
    alive = [c.pid for c in children if not _gone(c)]
    assert alive == [], f"children of the demo still alive {CEILING_S:.0f} s after it died: {alive}"
    assert not sockdir.exists(), f"engine socket dir {sockdir} left behind"


def test_sigkill_of_the_demo_ends_its_engine_and_removes_the_socket_dir(short_tmp):
    proc, _, ready, children = _start_demo_until_sync(short_tmp)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(CEILING_S) == -signal.SIGKILL
    _assert_engine_gone(ready, children, short_tmp)


def test_sigterm_of_the_demo_fails_the_phase_finishes_the_trace_and_ends_the_engine(short_tmp):
    # after a sync, in the next train: SIGTERM during a packed sync segfaults the demo
    # (the cancelled sync frees the buffer a worker thread is still packing into; not this item)
    proc, trace, ready, children = _start_demo_until_sync(short_tmp, "--phase-deadline", "120", then="train")
    os.kill(proc.pid, signal.SIGTERM)
    code = proc.wait(CEILING_S)
    assert code in (130, 143), (code, (short_tmp / "stderr").read_text(errors="replace")[-3000:])
    _assert_engine_gone(ready, children, short_tmp)
    events = [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]
    assert events[0]["config"]["phase_deadline_s"] == 120.0
    assert events[-1]["event"] == "trace.finished"
    names = [e["event"] for e in events]
    assert "phase.failed" in names and names.index("phase.failed") < len(names) - 1
    # the shielded cleanup ran: the demo's own work dir is gone too
    assert [p.name for p in short_tmp.iterdir() if p.name.startswith("colo-")] == []


def _build(tmp_path):
    config = demo_config(**SMALL_CFG)
    return {"config": config.to_dict(), "dtype": "float32", "device": "cpu", "total_bytes": 64 << 20,
            "mem_fraction_static": 0.5, "checkpoint": None, "log_path": str(tmp_path / "engine.log")}


def test_engine_killed_from_outside_is_engine_died_not_channel_error(tmp_path):
    async def main():
        outcomes = []
        for _ in range(3):  # a killed engine closes the channel before it can be reaped: every time
            client = await EngineClient.spawn(_build(tmp_path), start_timeout_s=CEILING_S)
            try:
                assert (await client.call("hello"))["ok"]
                os.kill(client.process.pid, signal.SIGKILL)
                try:
                    await client.call("digest")
                    outcomes.append("answered")
                except EngineDied as e:
                    outcomes.append("EngineDied")
                    assert str(client.process.pid) in str(e)
                except ChannelError as e:
                    outcomes.append(f"ChannelError: {e}")
            finally:
                await client.aclose()
        return outcomes

    assert anyio.run(main) == ["EngineDied"] * 3


@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan"])
def test_phase_deadline_flag_refuses_non_positive_or_infinite(value, capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main(["demo", "--phase-deadline", value])
    assert exc.value.code == 2
    assert "colo: error: argument --phase-deadline: expected a" in capsys.readouterr().err


@pytest.mark.parametrize("value", [0, -1.0, float("inf"), float("nan"), True])
def test_demo_config_refuses_a_bad_phase_deadline(value):
    with pytest.raises(ValueError, match="phase-deadline"):
        DemoConfig(phase_deadline_s=value)
    assert DemoConfig(phase_deadline_s=2.5).phase_deadline_s == 2.5


# -- issue 32, item 4: a process that ends before its own cleanup ran still unlinks its segments --

_HOLDER = r"""
import os, sys, time
from colo.proc.handles import ShmSegment
from colo.proc.lifecycle import die_with_parent
die_with_parent(os.getppid(), sys.argv[1], None)
seg = ShmSegment.create(1 << 16)
print(os.getpid(), seg.name, flush=True)
while True:
    # a main thread that does not get to its cleanup: SIGTERM lands inside a step that
    # waits on a peer that left or an engine that does not answer (seen: a --gpus 2
    # worker's engine.aclose outlasting the orphan's grace, its staging left behind)
    try:
        time.sleep(3600)
    except SystemExit:
        pass
"""


def test_an_orphan_whose_main_thread_never_finishes_still_unlinks_its_segments(tmp_path):
    """The parent is SIGKILLed; its child's SIGTERM handler raises SystemExit, but the
    child's main thread never unwinds to its ``finally``. After the orphan's grace the
    watchdog ends the process (os._exit runs no cleanup): the segment it made and its
    socket dir must go with it, not stay in /dev/shm until someone sweeps."""
    from colo.proc.handles import SHM_DIR
    from colo.proc.lifecycle import ORPHAN_GRACE_S

    sockdir = tmp_path / "colo-engine-holder"
    sockdir.mkdir()
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with open(out, "wb") as f:
        parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                                   "subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]]); "
                                   "time.sleep(3600)", _HOLDER, str(sockdir / "engine.sock")],
                                  env=env, stdout=f, cwd=REPO)
    deadline = time.monotonic() + CEILING_S  # a hang guard: a child importing torch, then a line
    while not out.read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.05)
    pid, name = out.read_text().split()
    child = psutil.Process(int(pid))
    assert os.path.exists(os.path.join(SHM_DIR, name))
    parent.kill()
    parent.wait(CEILING_S)
    try:
        child.wait(ORPHAN_GRACE_S + CEILING_S)
    except psutil.TimeoutExpired:
        child.kill()
        pytest.fail(f"the orphan did not end within {ORPHAN_GRACE_S + 10:g} s of its parent")
    left = os.path.exists(os.path.join(SHM_DIR, name))
    if left:
        os.unlink(os.path.join(SHM_DIR, name))
    assert not left, f"segment {name} of the ended orphan left in {SHM_DIR}"
    assert not sockdir.exists()


_ENDING = r"""
import os, signal, sys, time
from colo.proc import lifecycle
from colo.proc.handles import ShmSegment
sock, where = sys.argv[1], sys.argv[2]
lifecycle.die_with_parent(None, sock, None)  # the SIGTERM handler a started process has
seg = ShmSegment.create(1 << 16)
print(seg.name, flush=True)
real = getattr(lifecycle, where)

def late_signal(*args):
    # the parent's death, the moment the clean-up begins (or, for serve_then_end's own
    # call, the instant before): the handler runs during this sleep
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.3)
    return real(*args)

setattr(lifecycle, where, late_signal)
lifecycle.serve_then_end(lambda: None, sock)
"""


@pytest.mark.parametrize("where, code", [("remove_sockdir", 0), ("end_of_process", 128 + signal.SIGTERM)],
                         ids=["inside-the-clean-up", "before-it-began"])
def test_a_sigterm_that_lands_in_the_last_clean_up_does_not_cut_it_short(tmp_path, where, code):
    """An engine its worker has just shut down is in its last clean-up when the worker,
    killed with its driver, dies: the parent-death signal lands there. The socket dir and
    the segments must still go (before, 3 runs in 12 of a two-rank demo SIGKILLed mid-sync
    under load left their engine dirs). Inside the clean-up the signal is only noted (exit
    0); in the instant before it began, the clean-up runs whole and the exit is the signal's."""
    from colo.proc.handles import SHM_DIR

    sockdir = tmp_path / "colo-engine-ending"
    sockdir.mkdir()
    (sockdir / "engine.sock").touch()
    out = subprocess.run([sys.executable, "-c", _ENDING, str(sockdir / "engine.sock"), where],
                         env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    name = out.stdout.strip()
    left = bool(name) and os.path.exists(os.path.join(SHM_DIR, name))
    if left:
        os.unlink(os.path.join(SHM_DIR, name))
    assert out.returncode == code, out.stderr[-2000:]
    assert name.startswith("colo-"), out.stdout
    assert not sockdir.exists(), "the socket dir outlived the process"
    assert not left, f"segment {name} outlived the process"


def test_unlink_own_segments_takes_only_this_process_s_and_refuses_new_ones():
    """Run in a child (it ends the process's segments for good): a forked child's call
    leaves its parent's segment; the process's own call unlinks its own, leaves one
    another process made, and refuses to make more."""
    code = r"""
import os
from colo.core.errors import HandleError
from colo.proc.handles import SHM_DIR, ShmSegment, unlink_own_segments
mine = ShmSegment.create(4096)
other = "colo-1-" + "0" * 32
open(os.path.join(SHM_DIR, other), "wb").close()
pid = os.fork()
if pid == 0:
    os._exit(0 if unlink_own_segments() == [] else 3)
assert os.waitpid(pid, 0)[1] == 0
assert os.path.exists(os.path.join(SHM_DIR, mine.name))
assert unlink_own_segments() == [mine.name]
assert not os.path.exists(os.path.join(SHM_DIR, mine.name))
assert os.path.exists(os.path.join(SHM_DIR, other))
os.unlink(os.path.join(SHM_DIR, other))
try:
    ShmSegment.create(4096)
    raise SystemExit("made a segment after unlink_own_segments")
except HandleError as e:
    assert "is ending" in str(e), e
mine.close()  # already unlinked: nothing to do, no error
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


# -- an orphan unlinks the segments its dead parent sent it, whoever else holds their lock --

_PARENT = r"""
import os, subprocess, sys, time
from colo.proc.handles import ShmSegment
seg = ShmSegment.create(1 << 16)
if os.fork() == 0:
    # a descendant of the parent that inherited the segment's locked descriptor (and
    # outlives it): the sweep cannot prove the segment free while this one lives
    time.sleep(3600)
    os._exit(0)
subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2], seg.name])
time.sleep(3600)
"""

_ORPHAN_CHILD = r"""
import os, sys, time
from colo.proc.handles import ShmSegment
from colo.proc.lifecycle import die_with_parent, end_of_process
die_with_parent(os.getppid(), sys.argv[1], None)
try:  # as an engine or a rank worker serves
    seen = ShmSegment(sys.argv[2], 1 << 16, create=False, writable=False)  # a handle the parent sent
    print(os.getpid(), seen.name, flush=True)
    time.sleep(3600)
finally:
    end_of_process(sys.argv[1])
"""


def test_an_orphan_unlinks_the_segments_its_dead_parent_sent_it_though_their_lock_is_held(tmp_path):
    """The parent is SIGKILLed while a forked descendant of it still holds the segment's
    lock (seen: a one-rank demo SIGKILLed mid-sync left its two staging segments). The
    engine-like child was sent the segment by that parent: once the parent is proven
    gone, the orphan unlinks it by name as it ends, with or without a run dir."""
    from colo.proc.handles import SHM_DIR

    sockdir = tmp_path / "colo-engine-orphan"
    sockdir.mkdir()
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with open(out, "wb") as f:
        parent = subprocess.Popen([sys.executable, "-c", _PARENT, _ORPHAN_CHILD, str(sockdir / "engine.sock")],
                                  env=env, stdout=f, cwd=REPO)
    deadline = time.monotonic() + CEILING_S  # a hang guard: a child importing torch, then a line
    while not out.read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.05)
    pid, name = out.read_text().split()
    path = os.path.join(SHM_DIR, name)
    holders = [c for c in psutil.Process(parent.pid).children() if c.pid != int(pid)]
    assert os.path.exists(path) and len(holders) == 1
    left = _left_after_killing(parent, int(pid), path, holders)
    assert not left, f"segment {name} the dead parent sent its orphan left in {SHM_DIR}"


def _left_after_killing(parent: subprocess.Popen, orphan: int, path: str, holders=()) -> bool:
    """SIGKILL ``parent``, wait for its ``orphan`` to end; whether ``path`` outlived them
    (removed here either way, with any other ``holders`` the test made)."""
    parent.kill()
    parent.wait(CEILING_S)
    try:
        psutil.Process(orphan).wait(CEILING_S)
        return os.path.exists(path)
    finally:
        for h in holders:
            h.kill()
        if os.path.exists(path):
            os.unlink(path)


# -- an orphan without a run dir (a rank worker's engine rank) sweeps what its dead parent had not sent --

_MAKER = r"""
import subprocess, sys, time
from colo.proc.handles import ShmSegment
seg = ShmSegment.create(1 << 16)  # made, never sent: a staging segment the worker was filling
print(seg.name, flush=True)
subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]])
time.sleep(3600)
"""

_RUNLESS_CHILD = r"""
import os, sys, time
from colo.proc.lifecycle import die_with_parent, end_of_process
die_with_parent(os.getppid(), sys.argv[1], None)  # no run dir: as a worker starts its engine rank
try:
    print(os.getpid(), flush=True)
    time.sleep(3600)
finally:
    end_of_process(sys.argv[1])
"""


def test_an_orphan_without_a_run_dir_sweeps_the_segments_its_dead_parent_had_not_sent(tmp_path):
    """A ``--gpus N`` rank worker SIGKILLed (or stopped, then killed by the driver) mid-sync
    holds a staging segment it has not handed to its engine rank yet. The engine rank is its
    orphan, and has no run dir: it must still sweep what its dead parent left (the segment's
    lock died with the parent), or the segment stays in /dev/shm until the next run starts
    (seen: 1 segment left in about half of the killed or stopped workers)."""
    from colo.proc.handles import SHM_DIR

    sockdir = tmp_path / "colo-engine-runless"
    sockdir.mkdir()
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path)}  # its sweep looks here, not in /tmp
    with open(out, "wb") as f:
        parent = subprocess.Popen([sys.executable, "-c", _MAKER, _RUNLESS_CHILD, str(sockdir / "engine.sock")],
                                  env=env, stdout=f, cwd=REPO)
    deadline = time.monotonic() + CEILING_S  # a hang guard: a child importing torch, then a line
    while len(out.read_text().split()) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    name, pid = out.read_text().split()
    path = os.path.join(SHM_DIR, name)
    assert os.path.exists(path) and psutil.Process(int(pid)).ppid() == parent.pid
    left = _left_after_killing(parent, int(pid), path)
    assert not left, f"segment {name} of the dead parent left in {SHM_DIR} after its orphan ended"
    assert not sockdir.exists()
