"""colo's vLLM engine over HTTP: vLLM's own OpenAI-compatible server, started as a user
would (``VLLM_SERVER_DEV_MODE=1``, colo's worker extension), one sync through colo's
packed transport, the handles out of band."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

from colo.core.errors import BadInput
from colo.digest import expected_weights_digest
from colo.engine.vllm import VllmEngine, server_command
from tests.vllm.parts import greedy
from tests.vllm.test_engine import PROMPTS, new_weights, order, sync


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(model_dir: str, log, *, extension: bool = True) -> tuple[subprocess.Popen, str]:
    port = _port()
    cmd = server_command(model_dir, port=port, python=sys.executable, skip_tokenizer_init=True, enforce_eager=True,
                         dtype="float32", max_model_len=256, gpu_memory_utilization=0.2, block_size=32)
    if not extension:
        i = cmd.index("--worker-extension-cls")
        del cmd[i:i + 4]  # and --weight-transfer-config
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "VLLM_SERVER_DEV_MODE": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the vLLM server exited with {proc.returncode}"
        try:
            urllib.request.urlopen(url + "/health", timeout=2).close()
            return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    pytest.fail("the vLLM server did not answer /health within 240 s")


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait(10)


async def test_one_sync_over_http_then_the_servers_tokens_equal_transformers(model_dir, tmp_path):
    with open(tmp_path / "server.log", "w") as log:
        proc, url = _serve(model_dir, log)
        try:
            engine = await VllmEngine.connect(url, model_dir)
            assert await engine.engine_version() == "0"
            model, trainer = new_weights(61)
            result = await sync(engine, trainer, bucket_bytes=4 << 20, version=1)
            assert result.tensors == 51 and result.cache_flushed
            assert await engine.digest() == expected_weights_digest(trainer.source, order(trainer), torch.float32)
            await engine.set_weight_version(1)
            assert await engine.engine_version() == "1"
            assert await engine.tokens(PROMPTS, max_new_tokens=8) == greedy(model, PROMPTS, 8)
            await engine.release(["kv_cache", "weights"])
            await engine.resume(["weights"])
            await engine.resume(["kv_cache"])
        finally:
            _stop(proc)


async def test_a_server_without_colos_extension_is_refused_naming_it(model_dir, tmp_path):
    with open(tmp_path / "server.log", "w") as log:
        proc, url = _serve(model_dir, log, extension=False)
        try:
            with pytest.raises(BadInput, match="does not take colo's weight updates.*--worker-extension-cls"):
                await VllmEngine.connect(url, model_dir)
        finally:
            _stop(proc)
