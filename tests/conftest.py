"""Shared test fixtures: a small real engine process, and a leak check for /dev/shm."""

import os

import pytest

from colo.engine.reference.client import EngineClient
from tests.leaks import begin_test, new_segments
from colo.trainers.models import demo_config

#: a model small enough that an engine process starts in a few seconds
SMALL_CFG = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64)


def small_engine_build(log_path, dtype: str = "float32") -> dict:
    """The build of a real engine process of SMALL_CFG on the CPU, stale (no checkpoint)."""
    return {"config": demo_config(**SMALL_CFG).to_dict(), "dtype": dtype, "device": "cpu",
            "total_bytes": 64 << 20, "mem_fraction_static": 0.5, "checkpoint": None, "log_path": str(log_path)}


def fixed_batch(config, seed=1, batch=16, prompt_len=6, new_tokens=10):
    """A rollout's data drawn from ``seed``, rewarded as the demo's task rewards (the share of
    completion tokens in a fixed eighth of the vocabulary): one REINFORCE step's input."""
    import torch
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, config.vocab_size, (batch, prompt_len), generator=g).tolist()
    completions = torch.randint(0, config.vocab_size, (batch, new_tokens), generator=g).tolist()
    rewards = [sum(t % 8 == 0 for t in c) / len(c) for c in completions]
    return SimpleNamespace(prompts=prompts, completions=completions, rewards=rewards)


@pytest.fixture
async def small_engine(tmp_path):
    """A real float32 engine process on the CPU, stale (no checkpoint); its log in tmp_path."""
    config = demo_config(**SMALL_CFG)
    client = await EngineClient.spawn(small_engine_build(tmp_path / "engine.log"))
    try:
        yield client, config
    finally:
        await client.aclose()
    assert not client.process.is_alive()


@pytest.fixture
def no_leftover_segments():
    """Fail a test that leaves one of our /dev/shm segments behind (one it made: see tests/leaks.py)."""
    yield
    assert new_segments() == []


@pytest.fixture(autouse=True)
def _mark_what_this_process_held():
    """Every test's counts of this process's segments are against its own beginning (tests/leaks.py)."""
    begin_test()
    yield


#: units of work (xdist groups) that took minutes in the last fresh-clone run under load,
#: longest first: tools/test hands these out before the rest (tests/apps/test_demo_multi.py is
#: in the ``ray`` group). vLLM's files in the order of their time in the run of 2026-11-30, less
#: the cases moved to COLO_MATRIX=1 since (test_ranks 873 s down to test_tp 97 s): listed after
#: colo's units, test_signals began last and one worker idled the last ~500 s of that part
LONGEST_FIRST = ("tests/vllm/test_ranks.py", "tests/vllm/test_demo.py", "tests/vllm/test_lora_demo.py",
                 "tests/vllm/test_docs.py", "tests/vllm/test_examples.py", "tests/vllm/test_ray.py",
                 "tests/vllm/test_signals.py", "tests/vllm/test_checkpoints.py", "tests/vllm/test_embedding.py",
                 "tests/vllm/test_engine.py", "tests/vllm/test_http.py", "tests/vllm/test_ranks_tp.py",
                 "tests/vllm/test_tp.py", "ray", "tests/docs/test_code_blocks.py",
                 "tests/apps/test_interrupt.py", "tests/proc/test_shm_room.py",
                 "tests/test_examples.py", "tests/apps/test_bench_trainers.py", "tests/bench/test_multi_gpu.py",
                 "tests/apps/test_demo.py")


def _group_of(item) -> str:
    mark = item.get_closest_marker("xdist_group")
    return (mark.args[0] if mark.args else mark.kwargs.get("name", "default")) if mark else ""


def pytest_itemcollected(item):
    """Under ``--dist loadgroup`` (tools/test), a test file is one unit of work: its
    module-scoped fixtures (a two-rank run, a Ray cluster) are made once, on one worker, and
    its tests keep their order. A file marked ``xdist_group("...")`` joins the other files
    of that name on one worker, one after the other.

    Marked as each item is collected: xdist's ``pytest_collection_modifyitems`` reads the
    marks, and this way they are there whichever hook of that name runs first."""
    if not any(True for _ in item.iter_markers("xdist_group")):
        item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))


@pytest.hookimpl(optionalhook=True)  # xdist's hook: unknown where xdist is off (tools/test's serial pass)
def pytest_xdist_node_collection_finished(node, ids):
    """Under ``--dist loadgroup`` every test must carry its group into the id xdist schedules
    by (xdist appends ``@group`` to ``item._nodeid`` on the worker). pytest 9.2 computes
    ``nodeid`` from another field and pytest-xdist 3.8's suffix is lost without a word: each
    test of a file is then its own unit, and two workers each build one module's fixtures
    (two two-rank vLLM runs at once, seen in vLLM's environment). Stopped here, on the
    controller, before a test runs."""
    if node.config.getvalue("dist") != "loadgroup":
        return
    lost = [nodeid for nodeid in ids if "@" not in nodeid]
    if lost:
        raise pytest.UsageError(
            f"pytest-xdist's groups did not reach the test ids ({lost[0]} has none): pytest "
            f"{pytest.__version__} and this pytest-xdist do not work together under --dist loadgroup; "
            f"install the pytest that pyproject.toml's dev extra asks for")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """``gpu2`` and ``gpu4`` tests need two and four CUDA GPUs: skipped where there are fewer. ``soak`` tests run
    for many minutes: skipped unless COLO_SOAK=1 (CI's 15 minutes do not hold them).
    ``matrix`` cases complete a matrix of cases (faults, architectures) whose other cases run
    every time and cover what these would (each says which): skipped unless COLO_MATRIX=1, to keep the README's test
    command within CI's budget on a busy two-core machine."""
    import os

    import torch

    if os.environ.get("PYTEST_XDIST_WORKER"):
        # the longest units first (tools/test passes --no-loadscope-reorder): one that starts
        # last keeps the other worker idle to the end. Only an order: every file still runs.
        first = {name: i for i, name in enumerate(LONGEST_FIRST)}
        items.sort(key=lambda item: first.get(_group_of(item), len(first)))

    if os.environ.get("COLO_SOAK") != "1":
        skip_soak = pytest.mark.skip(reason="a long soak: COLO_SOAK=1 runs it")
        for item in items:
            if "soak" in item.keywords:
                item.add_marker(skip_soak)
    if os.environ.get("COLO_MATRIX") != "1":
        skip_matrix = pytest.mark.skip(reason="the rest of a matrix of cases: COLO_MATRIX=1 runs it")
        for item in items:
            if item.get_closest_marker("matrix") is not None:
                item.add_marker(skip_matrix)
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for marker, need in (("gpu2", 2), ("gpu4", 4)):
        if have >= need:
            continue
        skip = pytest.mark.skip(reason=f"needs {need} CUDA GPUs, this machine has {have}")
        for item in items:
            if marker in item.keywords:
                item.add_marker(skip)


def pytest_runtest_logreport(report):
    """``COLO_TEST_TIMELINE=DIR``: every pytest process appends a line per test phase to
    ``DIR/<its xdist worker, or main>.jsonl`` (the test, the phase, its start and stop in
    seconds since the epoch, the outcome). tools/test prints each test's duration but not
    which worker ran it when, and a run under several workers ends with its slowest one:
    this says which unit of work a run waited on. Nothing is written without the variable."""
    where = os.environ.get("COLO_TEST_TIMELINE")
    if not where or hasattr(report, "node"):  # xdist's controller sees its workers' reports again
        return
    import json

    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(os.path.join(where, f"{worker}.jsonl"), "a") as f:
        f.write(json.dumps({"test": report.nodeid, "when": report.when, "start": report.start,
                            "stop": report.stop, "outcome": report.outcome}) + "\n")


_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    _EXIT_STATUS.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """A GPU test run that loaded torch_memory_saver ends here with pytest's own status:
    the saver's teardown at interpreter exit would make it 1 after every test passed
    (seen on an H100: "23 passed", exit status 1)."""
    if _EXIT_STATUS:
        from colo.device.cuda_memory import exit_past_the_saver

        exit_past_the_saver(_EXIT_STATUS[-1])
