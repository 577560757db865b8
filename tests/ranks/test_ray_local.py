"""Issue 32, items 5 and 11: ``--launcher ray`` on a local Ray cluster the run starts itself
(no ``--address``) leaves nothing of that cluster behind: no session directory in TMPDIR
(or wherever Ray put it), however the run ends, and no Ray process of it once the next
run has started, even after the driver's SIGKILL; a long TMPDIR does not break Ray's
AF_UNIX sockets; a SIGTERM while ``ray.init`` still runs is colo's clean stop.

Every run is a driver process of its own with a private TMPDIR and without RAY_ADDRESS
(a driver given one joins that cluster, which is not its own), so that what it leaves can
be told from what anything else on the machine made."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

pytest.importorskip("ray", reason="Ray is not installed: pip install -e '.[ray]'")

#: one worker runs the modules that start a Ray cluster, one after the other (tests/conftest.py):
#: two clusters starting at once on two busy cores outwait Ray's own start limits
pytestmark = pytest.mark.xdist_group("ray")

REPO = Path(__file__).resolve().parents[2]
#: Ray and two ranks start in ~15 s on an idle 2-core machine; a loaded one takes longer
RUN_TIMEOUT_S = 300


def _env(tmpdir: Path) -> dict[str, str]:
    env = {**os.environ, "TMPDIR": str(tmpdir), "PYTHONPATH": str(REPO)}
    env.pop("RAY_ADDRESS", None)  # a local Ray of the run's own
    env.pop("RAY_TMPDIR", None)
    return env


@pytest.fixture
def private_tmp():
    d = Path(tempfile.mkdtemp(prefix="crl-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


#: the drivers a test started: one still running at its end (a failed test) is killed, and its
#: cluster ended by colo's own sweep, so that no test leaves a Ray behind for the next
_DRIVERS: list[subprocess.Popen] = []


def _demo(tmpdir: Path, out: Path, *extra: str) -> subprocess.Popen:
    with open(out / "stderr", "ab") as ferr, open(out / "stdout", "ab") as fout:
        proc = subprocess.Popen([sys.executable, "-m", "colo.cli", "demo", "--quiet", "--gpus", "2",
                                 "--launcher", "ray", "--trace", str(out / "t.jsonl"), *extra],
                                cwd=REPO, env=_env(tmpdir), stdout=fout, stderr=ferr)
    _DRIVERS.append(proc)
    return proc


@pytest.fixture(autouse=True)
def _no_driver_left(private_tmp):
    yield  # torn down before private_tmp, which holds the cluster's dir
    while _DRIVERS:
        proc = _DRIVERS.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            from colo.proc.lifecycle import sweep

            sweep((str(private_tmp),))
            sweep()


def _torch_own(tmp_path: Path) -> set[str]:
    """What torch itself puts in a fresh TMPDIR when a program imports it as colo's ranks do
    (``torchinductor_<user>``, its compile cache, kept across runs by design): not the run's."""
    d = tmp_path / "torch-only"
    d.mkdir()
    subprocess.run([sys.executable, "-c", "import torch._dynamo"], env=_env(d), check=True, timeout=120)
    return set(os.listdir(d))


def _ray_dirs_of(pid: int) -> list[str]:
    """colo's Ray dirs made by driver ``pid`` in the short fallbacks (a TMPDIR too long for Ray's sockets)."""
    out = []
    for base in ("/tmp", "/var/tmp", "/dev/shm"):
        try:
            out += [os.path.join(base, n) for n in os.listdir(base) if n.startswith(f"colo-ray-{pid}-")]
        except OSError:
            pass
    return out


def _ray_processes_in(root: Path) -> list[int]:
    """Processes that name ``root`` on their command line (Ray's daemons name their session
    dir) or have a file under it open (Ray's workers retitle themselves, ``ray::IDLE``, and
    keep their logs open there); this test process aside."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        if p.pid == os.getpid():
            continue
        try:
            if str(root) in "\0".join(p.info["cmdline"] or []) or any(
                    f.path.startswith(f"{root}/") for f in p.open_files()):
                out.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


def _long_dir(root: Path, length: int) -> Path:
    """A new dir under ``root`` whose path is ``length`` characters long."""
    pad = length - len(str(root)) - 1
    assert pad > 0
    d = root / ("d" * pad)
    d.mkdir()
    assert len(str(d)) == length
    return d


def test_a_run_on_a_local_ray_of_its_own_leaves_nothing_in_tmpdir_however_long(private_tmp, tmp_path):
    """Before: every such run left ``$TMPDIR/ray/session_<date>_<pid>`` (logs, sockets, port
    files) and ``session_latest``; none of it is left now. The TMPDIR is 100 characters
    long: Ray's own default dir there failed ``ray.init`` (its socket paths would pass the
    107 bytes of an AF_UNIX path); colo's own dir for Ray goes where they fit, and goes."""
    tmpdir = _long_dir(private_tmp, 100)
    proc = _demo(tmpdir, tmp_path, "--steps", "1")
    code = proc.wait(RUN_TIMEOUT_S)
    err = (tmp_path / "stderr").read_text(errors="replace")
    assert code == 0, err[-3000:]
    assert sorted(tmp_path.glob("t.rank*.jsonl")) == [tmp_path / "t.rank0.jsonl", tmp_path / "t.rank1.jsonl"]
    left = set(os.listdir(tmpdir)) - _torch_own(tmp_path)
    assert left == set(), f"the run left {sorted(left)} in its TMPDIR"
    assert _ray_dirs_of(proc.pid) == []
    assert _ray_processes_in(private_tmp) == [] and _ray_processes_in(Path("/tmp") / f"colo-ray-{proc.pid}") == []


def test_the_local_rays_dir_fits_its_sockets_for_any_tmpdir(private_tmp, monkeypatch):
    """Where Ray's own default (``$TMPDIR/ray``) stops fitting its sockets, by Ray's own check
    (``validate_socket_filepath``) and naming: at 42 characters with a 5-digit pid (41 with
    6 digits, 40 with 7). colo's dir for a local Ray fits at every length up to 100: in
    TMPDIR while it fits there, else in /tmp; and is the driver's (removed by release_dir)."""
    import datetime

    from ray._common.utils import get_default_ray_temp_dir
    from ray._private.utils import validate_socket_filepath

    from colo.proc.lifecycle import release_dir
    from colo.ranks.ray_launcher import _RayInit

    monkeypatch.delenv("RAY_TMPDIR", raising=False)
    session = f"session_{datetime.datetime.today().strftime('%Y-%m-%d_%H-%M-%S_%f')}_{os.getpid()}"

    def fits(temp_dir: str) -> bool:
        try:
            validate_socket_filepath(os.path.join(temp_dir, session, "sockets", "plasma_store"))
        except OSError:
            return False
        return True

    ray_breaks, placed, lengths = [], {}, range(len(str(private_tmp)) + 2, 101)
    for length in lengths:
        tmpdir = _long_dir(private_tmp, length)
        monkeypatch.setenv("TMPDIR", str(tmpdir))
        monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
        assert get_default_ray_temp_dir() == f"{tmpdir}/ray"
        if not fits(get_default_ray_temp_dir()):
            ray_breaks.append(length)
        own = _RayInit.local({}).dir
        try:
            assert fits(own), own
            assert os.path.basename(own).startswith(f"colo-ray-{os.getpid()}-")
            placed[length] = os.path.dirname(own)
        finally:
            release_dir(own)
        assert not os.path.exists(own)
        tmpdir.rmdir()
    pid_digits = len(str(os.getpid()))
    assert ray_breaks == list(range(47 - pid_digits, 101))  # 42 with a 5-digit pid
    # colo's dir (colo-ray-<pid>-XXXXXXXX, 19 characters and the pid longer than Ray's "ray")
    # is in TMPDIR while it fits there (up to 31 characters less twice the pid's digits)
    assert placed == {n: (str(private_tmp / ("d" * (n - len(str(private_tmp)) - 1)))
                          if n <= 31 - 2 * pid_digits else "/tmp") for n in range(lengths.start, 101)}


def _alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def _demo_in_its_first_rollout(private_tmp: Path, tmp_path: Path) -> subprocess.Popen:
    """A 50-step ``--launcher ray`` demo, once rank 0's trace shows its first rollout (its Ray,
    its actors and their workers all up)."""
    proc = _demo(private_tmp, tmp_path, "--steps", "50")
    rank0 = tmp_path / "t.rank0.jsonl"
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not (rank0.exists() and '"rollout"' in rank0.read_text(errors="replace")):
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr").read_text()[-3000:]
        time.sleep(0.1)
    return proc


def test_the_next_start_ends_the_local_ray_of_a_sigkilled_driver(private_tmp, tmp_path):
    """SIGKILL of the driver mid-run: the GCS and the raylet die with it (Ray starts them
    with the parent-death signal), but the raylet's children (agents, the rank and engine
    actors' workers) lived on for 10 to 90 s, and the session dir for good. The next run's
    start-up sweep (run here alone, as a second process) ends every process of that
    cluster and removes its dir, before it returns."""
    proc = _demo_in_its_first_rollout(private_tmp, tmp_path)
    session = psutil.Process(proc.pid).children(recursive=True)  # Ray's daemons, agents, workers
    names = {p.pid: p.name() for p in session}
    assert any(n == "raylet" for n in names.values()) and any(n.startswith("ray::") for n in names.values()), names
    (ray_dir,) = [p for p in private_tmp.iterdir() if p.name.startswith(f"colo-ray-{proc.pid}-")]
    proc.kill()
    proc.wait()
    sweep = subprocess.run([sys.executable, "-c", "from colo.proc.lifecycle import sweep; print(sweep())"],
                           cwd=REPO, env=_env(private_tmp), capture_output=True, text=True, timeout=120)
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    left = {pid: names[pid] for pid in _alive(list(names))}
    assert left == {}, f"processes of the killed run's Ray left after the next start's sweep: {left}"
    assert not ray_dir.exists() and str(ray_dir) in sweep.stdout
    assert _ray_processes_in(private_tmp) == []


def test_a_failed_run_on_a_local_ray_of_its_own_leaves_nothing_either(private_tmp, tmp_path):
    """A run that fails (a rank actor's process SIGKILLed mid-run: the next phase fails
    naming the rank, exit 1) ends its cluster as a completed run does: nothing in TMPDIR."""
    proc = _demo_in_its_first_rollout(private_tmp, tmp_path)
    actors = [p for p in psutil.Process(proc.pid).children(recursive=True) if p.name().startswith("ray::RankActor")]
    assert actors, [p.name() for p in psutil.Process(proc.pid).children(recursive=True)]
    actors[0].kill()
    code = proc.wait(RUN_TIMEOUT_S)
    out = (tmp_path / "stdout").read_text(errors="replace") + (tmp_path / "stderr").read_text(errors="replace")
    assert code == 1 and "FAILED in phase" in out and "RankDied" in out, (code, out[-3000:])
    left = set(os.listdir(private_tmp)) - _torch_own(tmp_path)
    assert left == set(), f"the run left {sorted(left)} in its TMPDIR"
    assert _ray_processes_in(private_tmp) == []


def _session_starting(tmpdir: Path) -> Path | None:
    """A Ray session dir under ``tmpdir`` (Ray's own ``ray/`` or colo's ``colo-ray-*/``) whose
    driver has not connected yet: ``ray.init`` is starting the cluster. The driver's core
    worker opens ``logs/python-core-driver-*`` as it connects, at the end of ``ray.init``."""
    for session in tmpdir.glob("*/session_2*"):
        if not list(session.glob("logs/python-core-driver-*")):
            return session
    return None


def test_sigterm_while_ray_init_starts_the_cluster_is_one_line_exit_130_and_leaves_nothing(private_tmp, tmp_path):
    """SIGTERM once ``ray.init`` has made the session dir and before the driver connects
    (Ray's GCS, raylet and agents still starting). Before: ``ray.init`` ran on the main
    thread, whose SIGTERM handler it sets first thing (``sys.exit(15)``): exit 15, the
    traces never finished. Now: colo's clean stop, as for a SIGTERM once Ray is up."""
    proc = _demo(private_tmp, tmp_path, "--steps", "1")
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while (session := _session_starting(private_tmp)) is None:
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr").read_text()[-3000:]
        time.sleep(0.005)
    # just seen without a connected driver; ray.init has the raylet and the connect ahead of it
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(RUN_TIMEOUT_S)
    err = (tmp_path / "stderr").read_text(errors="replace")
    assert code == 130, (code, err[-3000:])
    assert "SIGTERM received" not in err and "Traceback" not in err, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.strip() and not re.match(r"^\d{4}-\d\d-\d\d ", ln)]
    assert len(lines) == 1 and lines[0].startswith("colo demo: interrupted (SIGTERM)"), lines
    left = set(os.listdir(private_tmp)) - _torch_own(tmp_path)
    assert left == set(), f"the run left {sorted(left)} in its TMPDIR"
    assert _ray_processes_in(private_tmp) == []


#: a driver that starts a local Ray of its own as colo does and prints its workers' niceness
_NICENESS_DRIVER = """
import os, anyio, ray
from colo.ranks.ray_launcher import _init_ray

@ray.remote(num_cpus=0)
def niceness():
    return os.nice(0)

async def main():
    session = await _init_ray(None)
    try:
        return await anyio.to_thread.run_sync(lambda: ray.get(niceness.remote(), timeout=%d))
    finally:
        session.stop()

print("niceness", anyio.run(main))
"""


def test_the_workers_of_a_local_ray_of_its_own_run_at_colos_niceness_not_rays_15(private_tmp, tmp_path):
    """Before: Ray started the run's actors at its default niceness, 15; beside two busy
    processes of niceness 0 a rank actor got about 5 % of a core, and a Ray run of seconds
    took minutes (tests/ranks/test_ray.py's runs: 41 s quiet, over 8 minutes so). A cluster
    colo starts runs its workers at :data:`~colo.ranks.ray_launcher.WORKER_NICENESS`, 0.

    A driver of its own, as every run here: in this process, after tests/ranks/test_ray.py's
    cluster had come and gone in it, Ray's GCS twice never wrote its port file in CI's full
    suite (the same start passed alone)."""
    from colo.ranks.ray_launcher import WORKER_NICENESS

    env = _env(private_tmp)
    # Ray's own wait for its GCS server's port file, a ceiling that catches only a hang
    env["RAY_gcs_server_port_wait_time_s"] = str(RUN_TIMEOUT_S)
    with open(tmp_path / "out", "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", _NICENESS_DRIVER % RUN_TIMEOUT_S], cwd=REPO, env=env,
                                stdout=out, stderr=subprocess.STDOUT)
    _DRIVERS.append(proc)
    code = proc.wait(2 * RUN_TIMEOUT_S)
    text = (tmp_path / "out").read_text(errors="replace")
    assert code == 0, text[-5000:]
    assert [ln for ln in text.splitlines() if ln.startswith("niceness ")] == [f"niceness {WORKER_NICENESS}"]
    assert WORKER_NICENESS == 0
    assert _ray_dirs_of(proc.pid) == [] and _ray_processes_in(private_tmp) == []


def test_a_local_ray_that_fails_to_start_says_what_its_daemons_logged(tmp_path):
    """Ray's own error names only the port file it waited for; the lines its GCS and raylet
    logged go with it (the cluster's dir, their logs with it, is removed as the start fails)."""
    from colo.ranks.ray_launcher import _ray_start_logs

    session = tmp_path / "session_2026-11-28_01-38-53_842877_12873"
    (session / "logs").mkdir(parents=True)
    (tmp_path / "session_latest").symlink_to(session)
    (session / "logs" / "gcs_server.err").write_text("".join(f"line {i}\n" for i in range(30)))
    (session / "logs" / "raylet.out").write_text("")
    tail = _ray_start_logs(str(tmp_path), lines=3)
    assert tail == "Ray's gcs_server.err ended:\nline 27\nline 28\nline 29"
    assert _ray_start_logs(None) == _ray_start_logs(str(tmp_path / "none")) == ""
