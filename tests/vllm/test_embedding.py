"""Issue 41's acceptance: the README's embedding example, run as written, with a tiny
checkpoint of each architecture the field trains (made here, nothing downloaded). The loop's
own rollout calls vLLM, its own step trains colo's hf trainer's model, colo only hands off;
after each of its syncs, every one verified, vLLM's greedy tokens are transformers' on the
trainer's weights, and the trace replays clean."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.archs import VLLM, save_checkpoint, tiny_config
from tests.docs.blocks import blocks, env, scratch

#: the README's first block that needs vLLM: its embedding example
EMBEDDING = next(b for b in blocks() if b.path.name == "README.md" and b.mark == "# needs vLLM")


def test_the_embedding_example_is_the_readmes_loop_of_its_own():
    assert "sched.to_train(" in EMBEDDING.text and "sched.to_rollout()" in EMBEDDING.text
    assert "llm.generate(" in EMBEDDING.text and "sched.cycle()" not in EMBEDDING.text


#: the example's own model runs every time. A checkpoint of each architecture the field trains
#: goes through the same ``main(checkpoint)``, and each is synced into vLLM and compared with
#: transformers after every sync by tests/vllm/test_checkpoints.py (a Qwen2 with tied embeddings,
#: a Qwen3, a Llama: vLLM and colo's hf trainer started from the directory, as here; Qwen3 twice:
#: its own test and `colo demo` on it), so CI runs them there and COLO_MATRIX=1 adds them here
#: (187, 215 and 192 s of a pytest worker in the fresh-clone runs under load of 2026-11-30)
CASES = ["default", pytest.param("qwen2-tied", marks=pytest.mark.matrix), pytest.param("qwen3", marks=pytest.mark.matrix),
         pytest.param("llama", marks=pytest.mark.matrix)]


@pytest.mark.parametrize("case", CASES)
def test_the_readmes_embedding_example_keeps_vllm_on_the_trainers_weights(case, tmp_path):
    cwd = scratch(tmp_path)
    args = []
    if case != "default":  # the example's own tiny Qwen2 (untied) without an argument
        save_checkpoint(tmp_path / case, tiny_config(case, **VLLM), seed=11)
        args = [str(tmp_path / case)]
    script = cwd / "embed.py"
    script.write_text(EMBEDDING.text, encoding="utf-8")
    proc = subprocess.run([sys.executable, str(script), *args], cwd=cwd, env=env(), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    steps = [ln for ln in lines if ln.startswith("step ")]
    assert [ln.split(", vLLM at ")[1] for ln in steps] == [
        f"weight version {v}, its greedy tokens are transformers': True" for v in (1, 2, 3)], proc.stdout
    assert lines[-1] == "trace valid: True"
