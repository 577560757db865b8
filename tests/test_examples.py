"""The loops in examples/ that run in colo's own environment, run as a user runs them; those
that need vLLM are run by tests/vllm/test_examples.py. Every example is short and run by one
of the two."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.docs.blocks import env

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"


def test_every_example_is_short_and_run_by_a_test():
    tests = (Path(__file__).read_text() + (REPO / "tests" / "vllm" / "test_examples.py").read_text())
    examples = sorted(EXAMPLES.glob("*.py"))
    assert len(examples) >= 2
    for path in examples:
        assert len(path.read_text().splitlines()) <= 100, path
        assert f'"{path.name}"' in tests, f"{path.name} is run by no test"


@pytest.fixture
def short_tmp():
    """A short TMPDIR of the test's own: a local Ray puts its sockets there (an AF_UNIX path
    is at most 107 bytes), and what the run leaves there is this test's to see."""
    d = Path(tempfile.mkdtemp(prefix="cre-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_the_ray_worker_group_example_hands_over_on_every_rank_with_every_sync_verified(tmp_path, short_tmp):
    pytest.importorskip("ray", reason="Ray is not installed: pip install -e '.[ray]'")
    (tmp_path / "traces").mkdir()
    run_env = {k: v for k, v in env().items() if k not in ("RAY_ADDRESS", "RAY_TMPDIR")}
    proc = subprocess.run([sys.executable, str(EXAMPLES / "ray_workers.py"), "--ranks", "2", "--steps", "3"],
                          cwd=tmp_path, env={**run_env, "TMPDIR": str(short_tmp)}, capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    steps = [ln for ln in lines if ln.startswith("step ")]
    # each step's sync reached both engine ranks, each rank's shard verified (a mismatch raises)
    assert [ln.rsplit("weight version ", 1)[1] for ln in steps] == ["1", "2", "3"]
    assert lines[-1].endswith("replay clean together: True")
    # the run's local Ray cluster and its workers ended with it: nothing of colo's left here
    assert sorted(p.name for p in short_tmp.iterdir() if p.name.startswith("colo-")) == []
