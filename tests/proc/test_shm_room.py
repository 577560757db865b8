"""Issue 45, item 1: a small or full /dev/shm is a clear error, never a SIGBUS.

Each test runs in a private mount namespace whose /dev/shm is a small tmpfs of its own
(``unshare --mount``), so nothing of the machine's /dev/shm is touched; where unshare or
the mount is refused the tests are skipped, saying why."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.waits import CEILING_S

REPO = Path(__file__).resolve().parents[2]
_MOUNT = "mount --make-rprivate / && mount -t tmpfs -o size={size} tmpfs /dev/shm"


def _namespace_refusal() -> str | None:
    try:
        proc = subprocess.run(["unshare", "--mount", "sh", "-c", _MOUNT.format(size="1m")], capture_output=True,
                              text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        return f"unshare(1) cannot run here: {e}"
    if proc.returncode != 0:
        return f"a private mount namespace with its own /dev/shm is refused here: {proc.stderr.strip()}"
    return None


REFUSAL = _namespace_refusal()
pytestmark = pytest.mark.skipif(REFUSAL is not None, reason=REFUSAL or "")


def _in_small_shm(size: str, script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``script`` (sh) run with ``args`` in a mount namespace whose /dev/shm is a ``size`` tmpfs."""
    return subprocess.run(["unshare", "--mount", "sh", "-c", _MOUNT.format(size=size) + " && " + script, "sh",
                           *args], capture_output=True, text=True, timeout=CEILING_S * 5, cwd=cwd,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


def test_a_segment_larger_than_the_room_left_is_refused_naming_both_and_one_that_fits_is_all_there(tmp_path):
    code = r"""
import json, os
from colo.core.errors import SharedMemoryFull
from colo.proc.handles import SHM_DIR, ShmSegment, shm_room
out = {"room": shm_room()}
try:
    ShmSegment.create(2 << 20)
except SharedMemoryFull as e:
    out["refused"] = str(e)
out["left"] = sorted(os.listdir(SHM_DIR))
seg = ShmSegment.create(512 << 10)
# every page allocated at creation: what the tmpfs holds for it is its whole size
out["blocks"] = os.stat(os.path.join(SHM_DIR, seg.name)).st_blocks * 512
out["room_after"] = shm_room()
seg.tensor.fill_(7)  # written whole: no page is missing
seg.close()
print(json.dumps(out))
"""
    proc = _in_small_shm("1m", 'python -c "$1"', code, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["room"] == 1 << 20
    assert out["refused"] == ("/dev/shm has 1.00 MiB free, and 2.00 MiB is needed for a shared-memory segment "
                              "of 2.00 MiB: use a smaller --bucket-mib, or give this machine or container more "
                              "shared memory (a container's /dev/shm is 64 MiB unless started with e.g. "
                              "docker run --shm-size=2g)")
    assert out["left"] == []  # the refused segment is gone, not left half-made
    assert out["blocks"] >= 512 << 10 and out["room_after"] <= (1 << 20) - (512 << 10)


@pytest.mark.parametrize("dtype, need", [
    # the CPU default: the trainer's fp32 weights are one flat shared buffer, the engine reads it whole
    ("float32", "11.02 MiB is needed for the trainer's weights, one shared buffer the engine reads (the "
                "one-copy sync): train in bfloat16 (--trainer-dtype bfloat16: the sync converts, and stages "
                "buckets), or give this machine"),
    # a trainer in bfloat16: the sync converts, and stages two buckets in /dev/shm
    ("bfloat16", "2.00 MiB is needed for the packed transport's two staging buckets: use a smaller --bucket-mib, "
                 "or give this machine"),
])
def test_a_demo_that_cannot_fit_in_dev_shm_is_one_line_exit_2_before_the_engine_starts(dtype, need, tmp_path):
    """Before: rc 135 (SIGBUS), nothing on stdout or stderr, the trace cut mid-sync."""
    proc = _in_small_shm("1m", 'python -m colo.cli demo --quiet --steps 3 --trainer-dtype "$2" --trace "$1"; '
                         'echo "rc=$?"; ls -A /dev/shm', str(tmp_path / "t.jsonl"), dtype, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert "rc=2" in lines, proc.stdout + proc.stderr
    assert lines[-1] == "rc=2"  # and /dev/shm holds nothing of the run
    err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert err[0].startswith(f"colo demo: /dev/shm has 1.00 MiB free, and {need}"), err[0]
    assert not list(tmp_path.glob("colo-*")), list(tmp_path.iterdir())


_FILL_MID_RUN = r"""
python -m colo.cli demo --quiet --steps 3 --trainer-dtype bfloat16 --bucket-mib 0.25 --trace "$1" > "$2" 2>&1 &
demo=$!
# once the first sync has finished, another process takes every byte /dev/shm has left
until grep -q '"sync.finished"' "$1" 2>/dev/null || ! kill -0 $demo 2>/dev/null; do sleep 0.1; done
python -c "
import os
fd = os.open('/dev/shm/filler', os.O_CREAT | os.O_WRONLY)
try:
    while True:
        os.write(fd, b'x' * 4096)
except OSError:
    pass
print('filled')
"
wait $demo
echo "rc=$?"
"""


def test_dev_shm_filled_by_another_process_mid_run_is_no_sigbus(tmp_path):
    """A 64 MiB /dev/shm another process fills once the first sync is done: the next sync's
    staging segment cannot be made, and its phase fails cleanly (exit 1, /dev/shm named, the
    trace finished); a segment already made was reserved whole and is written on. Never the
    SIGBUS (rc 135) of a sparse segment's missing page."""
    trace, out = tmp_path / "t.jsonl", tmp_path / "demo.out"
    proc = _in_small_shm("64m", _FILL_MID_RUN, str(trace), str(out), cwd=tmp_path)
    demo_out = out.read_text(errors="replace")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "filled" in proc.stdout, proc.stdout
    rc = proc.stdout.strip().splitlines()[-1]
    assert rc in ("rc=0", "rc=1"), (rc, demo_out[-3000:])
    assert "Traceback" not in demo_out, demo_out[-3000:]
    events = [json.loads(ln) for ln in trace.read_text().splitlines()]
    assert events[-1]["event"] == "trace.finished"
    if rc == "rc=1":
        assert "FAILED in phase sync: SharedMemoryFull: /dev/shm has " in demo_out, demo_out[-3000:]
        (failed,) = [e for e in events if e["event"] == "phase.failed"]
        assert failed["phase"] == "sync" and failed["error"].startswith("SharedMemoryFull: /dev/shm has ")
    else:
        assert len([e for e in events if e["event"] == "sync.finished"]) == 3
