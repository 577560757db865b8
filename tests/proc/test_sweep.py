"""Issue 16, the start-up sweep: what a SIGKILL of colo demo left behind (its work
dir, bucket segments in flight) is removed by the next demo, and nothing else is."""

import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest

from tests.waits import CEILING_S
from tests.apps.test_interrupt import _demo, _gone, _ours, _segments, _start_demo_mid_sync

#: alone, after every other test (tools/test): these tests leave a dead run's dirs and segments
#: for the next demo to sweep (any colo run on the machine sweeps them too), and one rewinds the
#: kernel's pid counter (/proc/sys/kernel/ns_last_pid), which would hand a running test's
#: recently dead pids out again
pytestmark = pytest.mark.serial


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
    assert proc.wait(CEILING_S) == -signal.SIGKILL
    pids = [proc.pid, *(c.pid for c in children)]
    deadline = time.monotonic() + CEILING_S
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


# -- issue 32, item 3: ownership is a lock the owner holds, not a pid ----------------------

_NS_LAST_PID = "/proc/sys/kernel/ns_last_pid"


def _free_pid() -> int:
    """A pid no process of this namespace has, below the ones being handed out now (the
    kernel counts upward from ns_last_pid, so it is not handed out again before a wrap).
    A fresh container's counter can stand near 500 (CI's did): any free pid from 2 up
    will do, not only those far below it."""
    with open(_NS_LAST_PID) as f:
        pid = int(f.read()) - 1
    while pid > 1 and os.path.exists(f"/proc/{pid}"):
        pid -= 1
    assert pid > 1, "no free pid below the ones in use"
    return pid


def _unshare_works() -> bool:
    import subprocess

    try:
        return subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


needs_unshare = pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists(_NS_LAST_PID) or not _unshare_works(),
                                   reason="needs root and unshare(1) for a second PID namespace")


@needs_unshare
def test_a_live_run_in_another_pid_namespace_keeps_its_dirs_and_segments(short_tmp):
    """A run in a second PID namespace (another container sharing /tmp and /dev/shm): its
    dirs and segments carry a pid that names no process here. Sweeps made here while it
    runs (every demo's start makes one) remove none of them, and it finishes its syncs."""
    import subprocess
    import sys

    from tests.apps.test_interrupt import REPO, _events

    pid = _free_pid()  # the demo's pid inside its namespace: nothing has it here
    trace = short_tmp / "ns.jsonl"
    env = {**os.environ, "TMPDIR": str(short_tmp), "PYTHONPATH": str(REPO)}
    # sh is pid 1 of the new namespace; the next pid it hands out is the demo's
    script = f'echo {pid - 1} > {_NS_LAST_PID}; "$@"; exit $?'
    with open(short_tmp / "stderr", "wb") as err:
        proc = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", script, "sh",
                                 sys.executable, "-m", "colo.cli", "demo", "--quiet", "--trace", str(trace),
                                 "--steps", "4", "--bucket-mib", "0.05"],
                                cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err)
    removed: list[str] = []
    seen_dirs: set[str] = set()
    seen_segments: set[str] = set()
    from colo.proc.lifecycle import sweep

    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        seen_dirs |= {n for n in _ours(short_tmp) if n.startswith((f"colo-demo-{pid}-", f"colo-engine-{pid}-"))}
        seen_segments |= set(_segments([pid]))
        removed += sweep((str(short_tmp),))  # the dirs a second run with this TMPDIR sweeps
        time.sleep(0.02)
    if proc.poll() is None:
        proc.kill()
    code = proc.wait(30)
    ours = [p for p in removed if f"-{pid}-" in os.path.basename(p)]
    assert ours == [], f"a sweep here removed the live run's {ours} (it exited {code})"
    assert code == 0, (short_tmp / "stderr").read_text(errors="replace")[-3000:]
    # the sweeps had something to leave alone: the run's work and socket dirs, and its segments
    assert {n.split("-")[1] for n in seen_dirs} == {"demo", "engine"}, seen_dirs
    assert seen_segments, "no segment of the run seen while it synced"
    assert len([e for e in _events(trace) if e["event"] == "sync.finished"]) == 4
    assert _segments([pid]) == [] and [n for n in seen_dirs if (short_tmp / n).exists()] == []


def _leftovers_of_a_killed_owner(tmp: Path) -> tuple[int, list[str]]:
    """A process that made what a run makes (a demo's work dir, a socket dir, a segment),
    killed outright; its pid and the paths it left."""
    import json
    import subprocess
    import sys

    from tests.apps.test_interrupt import REPO

    code = ("import json, sys, time\n"
            "from colo.apps.demo import DemoConfig, DemoRun\n"
            "from colo.proc.handles import SHM_DIR, ShmSegment\n"
            "from colo.proc.lifecycle import socket_dir\n"
            f"run = DemoRun(DemoConfig(trace={str(tmp / 't.jsonl')!r}))\n"
            "seg = ShmSegment.create(4096)\n"
            "print(json.dumps([run.workdir, socket_dir(), SHM_DIR + '/' + seg.name]), flush=True)\n"
            "time.sleep(600)\n")
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(REPO)}
    owner = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    try:
        paths = json.loads(owner.stdout.readline())
    finally:
        owner.kill()
        owner.wait(CEILING_S)
    return owner.pid, paths


def _run_with_pid(pid: int) -> "subprocess.Popen":
    """An unrelated process that gets ``pid`` (the kernel reusing a dead owner's pid)."""
    import subprocess

    for _ in range(50):
        with open(_NS_LAST_PID, "w") as f:
            f.write(str(pid - 1))
        p = subprocess.Popen(["sleep", "120"])
        if p.pid == pid:
            return p
        p.kill()
        p.wait()
    pytest.skip(f"pid {pid} was taken by another process 50 times running")


@needs_unshare
def test_what_a_dead_owner_left_is_swept_though_its_pid_now_names_another_live_process(short_tmp):
    """Pid reuse: the owner was killed, and its pid now belongs to an unrelated live process.
    A pid cannot say the owner is gone; a lock the owner held until it died can."""
    from colo.proc.lifecycle import sweep

    pid, paths = _leftovers_of_a_killed_owner(short_tmp)
    assert all(os.path.exists(p) for p in paths), paths
    # reused at once, as the kernel may: the segment's name says its maker locked it, so its
    # free lock proves the maker gone whoever has the pid now (no clock is compared: CI once
    # kept it when the reuser started 1.5 s after the kill)
    assert [os.path.basename(p).split("-")[2][0] for p in paths if p.startswith("/dev/shm/")] == ["l"]
    reuser = _run_with_pid(pid)
    try:
        removed = sweep((str(short_tmp),))
        assert sorted(p for p in removed if p in paths) == sorted(paths)
        assert [p for p in paths if os.path.exists(p)] == []
    finally:
        reuser.kill()
        reuser.wait()


def test_the_sweep_leaves_what_it_cannot_prove_unowned(short_tmp):
    """No lock file (a dir being made this instant, or an older colo's), a lock file that
    is a link, an unlocked segment whose named maker may still live (an older colo took no
    lock on its segments), a dir of ours whose owner lives: all left, the link's target
    untouched; the same dir once its owner gave it back is gone."""
    from colo.proc.handles import SHM_DIR
    from colo.proc.lifecycle import LOCK_NAME, make_dir, release_dir, sweep

    no_lock = short_tmp / f"colo-demo-{os.getpid() + 10**6}-abcdefgh"
    no_lock.mkdir()
    linked = short_tmp / f"colo-rank-{os.getpid() + 10**6}-abcdefgh"
    linked.mkdir()
    victim = short_tmp / "victim"
    victim.write_text("keep")
    (linked / LOCK_NAME).symlink_to(victim)
    old_segment = Path(SHM_DIR) / f"colo-{os.getpid()}-{'0' * 32}"
    old_segment.write_bytes(b"\0" * 64)
    mine = make_dir("ckpt", str(short_tmp))
    try:
        # none of this test's (what else it removes, dead owners' segments, is other tests')
        removed = sweep((str(short_tmp),))
        assert [p for p in removed if p.startswith(str(short_tmp)) or p == str(old_segment)] == []
        assert no_lock.exists() and linked.exists() and victim.read_text() == "keep"
        assert old_segment.exists() and os.path.exists(mine)
    finally:
        old_segment.unlink()
        release_dir(mine)
    assert not os.path.exists(mine)
