"""Every code block in the README and docs/ runs as written (see ``tests/docs/blocks.py``
for how each kind is run); a block marked for a GPU machine or a Ray cluster has its
``colo`` commands parsed by colo's own parser where neither exists."""

from __future__ import annotations

import pytest
import torch

from colo.cli import build_parser
from tests.docs.blocks import HELD, MULTI_GPU_TINY, README_DEMO, README_LORA, REPO, blocks, ci_test_command, colo_argv, commands, run_command, run_python, scratch

#: blocks run, and held to what they print, by a test of their own (run once, not twice)
ELSEWHERE = {"docs/embedding.md": "tests/test_handoff.py"}
HERE = [b for b in blocks() if b.mark != "# needs vLLM"
        and not (b.lang == "python" and str(b.path.relative_to(REPO)) in ELSEWHERE)]


def test_the_readme_test_command_is_what_ci_runs():
    readme = (REPO / "README.md").read_text()
    assert ci_test_command() in readme.splitlines()
    assert ci_test_command() == "pip install torch==2.13.0 -e '.[dev]' && tools/test"
    # and tools/test runs all of it, one part after the other by default: colo's suite whole
    # (everything but tests/vllm, its slowest tests listed: where CI's time goes), then
    # tests/vllm in vLLM's own environment
    script = (REPO / "tools" / "test").read_text()
    assert "\ncolo_suite=(python -m pytest -q -p no:cacheprovider --durations=30 --ignore=tests/vllm)\n" in script
    assert "\nvllm_suite=(tools/vllm-env python -m pytest -q -p no:cacheprovider --durations=30 tests/vllm)\n" in script
    assert '\n  "${vllm_suite[@]}" "${spread[@]}"\n  vllm_status=$?\n' in script
    # colo's suite on three pytest workers by default, then the tests marked serial alone
    assert "\nworkers=${COLO_TEST_WORKERS:-3}\n" in script and "spread=(-n \"$workers\" --dist loadgroup --no-loadscope-reorder)" in script
    assert '\n"${colo_suite[@]}" "${spread[@]}" -m "not serial"\ncolo_status=$?\n' in script
    assert '\n"${colo_suite[@]}" -p no:xdist -m serial\nserial_status=$?\n' in script


def test_the_readmes_first_command_is_run_by_the_default_demos_test():
    # the block test leaves README_DEMO to that test: it must be the README's line and that
    # test must run it (its name and the constant both in its source)
    assert README_DEMO in (REPO / "README.md").read_text().splitlines()
    source = (REPO / "tests" / "apps" / "test_demo.py").read_text()
    assert "def test_the_default_demo_learns_well_above_chance_and_says_what_chance_is" in source
    assert "run_command(README_DEMO.split(\" && \")[-1]" in source


def test_every_line_the_block_test_leaves_to_another_test_is_a_docs_line_that_test_runs():
    # the README's LoRA command too: that test runs the constant through bash as a block would
    assert set(HELD) == {README_DEMO, README_LORA, MULTI_GPU_TINY}
    readme = (REPO / "README.md").read_text().splitlines()
    for line in (README_DEMO, README_LORA):
        assert line in readme, line
    assert MULTI_GPU_TINY in (REPO / "docs" / "multi-gpu.md").read_text().splitlines()
    source = (REPO / HELD[README_LORA]).read_text()
    assert "def test_thirty_adapter_syncs_into_colos_engine_learn_with_every_one_verified" in source
    assert '["bash", "-c", README_LORA]' in source
    source = (REPO / HELD[MULTI_GPU_TINY]).read_text()
    assert "def test_bench_gpus_2_cpu" in source and "run_command(MULTI_GPU_TINY" in source


def test_the_docs_have_the_blocks_this_test_expects():
    # a guide with no code would pass vacuously: the README's four python examples (the user's
    # loop on vLLM, colo's own loop, an in-process engine, vLLM's own) and the command blocks
    # are all found
    readme = [b for b in blocks() if b.path.name == "README.md"]
    assert sum(b.lang == "python" for b in readme) == 4 and sum(b.lang == "bash" for b in readme) >= 3
    assert any(b.mark == "# needs vLLM" for b in readme)


@pytest.mark.parametrize("block", HERE, ids=[b.id for b in HERE])
def test_block_runs_as_written(block, tmp_path):
    cwd = scratch(tmp_path)
    gpu_only = block.mark in ("# on a GPU machine", "# needs a Ray cluster")
    if gpu_only and not (block.mark == "# on a GPU machine" and torch.cuda.is_available()):
        parsed = 0
        for cmd, _ in commands(block):
            for part in cmd.split(" && "):
                argv = colo_argv(part)
                if argv is not None:
                    build_parser().parse_args(argv)  # SystemExit(2) on a flag or value colo does not take
                    parsed += 1
        assert parsed or "colo " not in block.text
        return
    if block.lang == "python":
        proc = run_python(block, cwd)
        assert proc.returncode == 0, f"{block.id}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        return
    ran = held = 0
    for cmd, want in commands(block):
        if cmd == ci_test_command():
            continue  # CI runs exactly this line (test_the_readme_test_command_is_what_ci_runs)
        if cmd in HELD:
            held += 1  # run as written, and held to what it does, by the test HELD names
            continue
        for part in cmd.split(" && "):
            if part.startswith("pip install") or part.startswith("tools/vllm-env"):
                continue  # what the test command installs and runs, in CI
            proc = run_command(part, cwd)
            assert proc.returncode == want, f"{block.id}: {part}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
            ran += 1
    assert ran or held, f"{block.id}: nothing of this block ran"
