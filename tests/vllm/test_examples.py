"""The loops in examples/, each run as a user runs it (a script, a checkpoint of theirs: a
tiny random one made here, nothing downloaded) against a real vLLM."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.archs import VLLM, save_checkpoint, tiny_config
from tests.docs.blocks import env

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_the_grpo_example_learns_with_every_sync_verified_in_vllm(tmp_path):
    save_checkpoint(tmp_path / "qwen2", tiny_config("qwen2", **VLLM), seed=3)
    trace = tmp_path / "grpo.jsonl"
    proc = subprocess.run([sys.executable, str(EXAMPLES / "grpo_vllm.py"), str(tmp_path / "qwen2"), "--steps", "8",
                           "--trace", str(trace)], cwd=tmp_path, env=env(), capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    steps = [ln for ln in lines if ln.startswith("step ")]
    # every step's sync reached vLLM, verified (a mismatch raises and ends the script)
    assert [ln.rsplit("weight version ", 1)[1] for ln in steps] == [str(v) for v in range(1, 9)]
    # "first 3 steps F, last 3 L; trace ... replays clean: True"
    head = lines[-1].split(";")[0]
    first, last = float(head.split(", last 3 ")[0].split()[-1]), float(head.split(", last 3 ")[1])
    assert last > first, lines[-1]  # it learns: more of the rewarded tokens than at the start
    assert lines[-1].endswith(f"trace {trace} replays clean: True")

