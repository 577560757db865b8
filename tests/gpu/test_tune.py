"""``colo tune`` on a real GPU (issue 17): the round trip the CPU test
(``tests/offline/test_tune_demo.py``) makes on the simulated device, on the device itself.

A Qwen2-1.5B-shaped demo (random weights, float32 trainer with AdamW, bf16
engine, the real torch_memory_saver) is recorded at a safe fraction; ``colo
tune`` reads what was resident beside the KV pool at every event and
recommends a fraction; the demo at that fraction completes every step with
verified syncs, and at the recommendation + 0.03 it fails in the phase tune
named, as a clean ``OutOfMemory`` in ``phase.failed`` (colo's own check, from
the device's measured free memory, before the memory saver or CUDA would
abort), with nothing left on the device or in /dev/shm.

Each demo runs in its own process, as a user runs it (torch_memory_saver keeps
process-wide state). ``COLO_GPU_TUNE_OUT``, if set, keeps the traces and the
tune output there (``bench/gpu_run.sh tune`` brings them back from the device).
Cost: three demo runs of a 1.5 B model, about 1 minute each on one H100.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from colo.core.invariants import InvariantChecker
from colo.trace.writer import read_trace

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MODEL = "qwen2-1.5b"
#: the recorded run: a fraction far from the edge, the default bucket of a model this size
BASELINE_MFS, BASELINE_BUCKET_MIB = 0.5, 64
#: two steps: the second rollout runs after a train and a sync, on everything they left behind
STEPS = 2
MiB = 1 << 20


def keep(path: Path) -> None:
    out = os.environ.get("COLO_GPU_TUNE_OUT")
    if out and path.exists():
        shutil.copy(path, Path(out) / path.name)


def demo(path: Path, mfs: float, bucket_mib: float) -> tuple[int, str, list[dict]]:
    proc = subprocess.run([sys.executable, "-m", "colo.cli", "demo", "--device", "cuda", "--quiet",
                           "--model", MODEL, "--steps", str(STEPS), "--mem-fraction-static", f"{mfs:.2f}",
                           "--bucket-mib", f"{bucket_mib:g}", "--trace", str(path)],
                          capture_output=True, text=True, timeout=600)
    log = f"== colo demo --model {MODEL} --mem-fraction-static {mfs:.2f} --bucket-mib {bucket_mib:g}: " \
          f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}\n"
    out = os.environ.get("COLO_GPU_TUNE_OUT")
    if out:
        with open(Path(out) / "gpu-tune-demos.log", "a") as f:
            f.write(log)
    keep(path)
    events = read_trace(path) if path.exists() else []
    return proc.returncode, log, events


def replay_clean(events: list[dict]) -> None:
    checker = InvariantChecker()
    assert [str(v) for i, e in enumerate(events, 1) for v in checker.feed(e, i)] == []


def tune(path: Path) -> dict:
    proc = subprocess.run([sys.executable, "-m", "colo.cli", "tune", str(path), "--json"],
                          capture_output=True, text=True, timeout=120)
    text = subprocess.run([sys.executable, "-m", "colo.cli", "tune", str(path)],
                          capture_output=True, text=True, timeout=120).stdout
    out = os.environ.get("COLO_GPU_TUNE_OUT")
    if out:
        with open(Path(out) / "gpu-tune-demos.log", "a") as f:
            f.write(f"== colo tune {path.name}: exit {proc.returncode}\n{text}\n")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout)


def free_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def test_tune_on_the_gpu_recommends_a_fraction_that_completes_and_three_points_more_fails_where_it_said(
        tmp_path):
    code, log, base = demo(tmp_path / "gpu-tune-baseline.jsonl", BASELINE_MFS, BASELINE_BUCKET_MIB)
    assert code == 0, log
    replay_clean(base)
    rec = tune(tmp_path / "gpu-tune-baseline.jsonl")
    mfs, bucket_mib, phase = rec["mem_fraction_static"], rec["bucket_mib"], rec["binding_phase"]
    assert rec["feasible"] and BASELINE_MFS < mfs < 0.97
    # the KV pool is admitted at its wake-up beside what the trainer and the sync left;
    # only the rollout's activations come after that admission
    assert phase == "engine_wake_kv" and rec["peak_phase"] in ("engine_wake_kv", "rollout")
    assert rec["binding_gpu"].startswith(torch.cuda.get_device_name())
    # what bound it was measured on the device: more than the KV pool and the engine's weights
    assert rec["binding"]["other_bytes"] > 256 * MiB

    code, log, at = demo(tmp_path / "gpu-tune-at.jsonl", mfs, bucket_mib)
    assert code == 0, log
    replay_clean(at)
    syncs = [e for e in at if e["event"] == "sync.finished"]
    assert [s["weight_version"] for s in syncs] == list(range(1, STEPS + 1))
    assert all(s["tensors"] == s["params"] for s in syncs)
    assert not [e for e in at if e["event"] == "phase.failed"]
    # the run at the recommendation tunes to itself: the model holds on the device
    assert abs(tune(tmp_path / "gpu-tune-at.jsonl")["mem_fraction_static"] - mfs) <= 0.01

    before = free_bytes()
    above = round(mfs + 0.03, 2)
    code, log, over = demo(tmp_path / "gpu-tune-above.jsonl", above, bucket_mib)
    assert code == 1, log
    replay_clean(over)
    failed = [e for e in over if e["event"] == "phase.failed"]
    assert len(failed) == 1, log
    assert failed[0]["error_type"] == "OutOfMemory", failed[0]
    assert failed[0]["phase"] == phase, (failed[0], rec["binding"])
    assert failed[0]["oom_tag"] == "engine.kv_cache"
    # refused from the device's measured free memory, before the memory saver tried
    assert failed[0]["oom_requested"] == over[0]["tags"]["engine.kv_cache"]["bytes"] > failed[0]["oom_free"]
    assert over[-1]["event"] == "trace.finished"
    # nothing leaked: the run's processes are gone with their device memory
    assert free_bytes() >= before - 64 * MiB
    from tests.leaks import new_segments

    assert new_segments() == []
