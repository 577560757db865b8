"""The README's and docs/' blocks that need vLLM, run as written in vLLM's environment
(``tests/docs/test_code_blocks.py`` runs every other block)."""

from __future__ import annotations

import pytest

from tests.docs.blocks import blocks, run_python, scratch

#: the README's embedding example is run, with a checkpoint of each architecture, by test_embedding.py
VLLM = [b for b in blocks() if b.mark == "# needs vLLM" and "sched.to_train(" not in b.text]


@pytest.mark.parametrize("block", VLLM, ids=[b.id for b in VLLM])
def test_vllm_block_runs_as_written(block, tmp_path):
    assert block.lang == "python"
    proc = run_python(block, scratch(tmp_path), timeout=600)
    assert proc.returncode == 0, f"{block.id}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    if block.path.name == "README.md":
        assert "2 cycles on vLLM; its weight version: 2" in proc.stdout
    else:
        assert "EngineCapabilities(tags=('weights', 'kv_cache')" in proc.stdout


def test_there_is_a_vllm_block():
    assert VLLM
