"""The real trainers on one GPU with bf16 parameters and fp32 masters (issue 31, item 1).

The hf trainer's parameters live in their own flat buffer, which the engine reads
from (the one-copy sync), and so do a one-rank FSDP2 trainer's local shards
(``adopt_shards``, issue 44); the optimizer (fp32 masters and moments) in a memory-saver
region. Checked here: pause and resume give back and take exactly the tags' memory
with the parameters still the buffer's views, the one-copy sync is exact over
several steps under both plans (the engine's digest against the trainer's, every
sync), and the probe's reference taken at offload is the paused weights' logits.
"""

from __future__ import annotations

import subprocess
import sys

import anyio
import pytest
import torch

from colo.core.units import MiB

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def free_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def local(p: torch.Tensor) -> torch.Tensor:
    """A parameter's bytes on this rank: itself, or an FSDP2 DTensor's local shard."""
    return p.to_local() if hasattr(p, "to_local") else p


@pytest.mark.parametrize("kind", ["hf", "fsdp"])
def test_a_trainer_pauses_and_resumes_exactly_its_tags_with_the_parameters_in_place(kind):
    from colo.trainers import build
    from colo.trainers.models import demo_config
    from colo.trainers.precision import MasterAdamW

    config = demo_config(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, vocab_size=8192)
    trainer, saver = build(kind, model_config=config, seed=0, engine_dtype="bfloat16", device="cuda")
    flat = trainer.flat_weights
    assert flat is not None and isinstance(trainer.opt, MasterAdamW)
    assert {p.dtype for p in trainer.model.parameters()} == {torch.bfloat16}
    assert {m.dtype for m in trainer.opt.masters} == {torch.float32}
    tags = trainer.tag_bytes()
    assert tags["weights"] == flat.nbytes
    elements = sum(p.numel() for p in trainer.model.parameters())
    assert tags["optimizer"] == 12 * elements
    trainer.probe_tokens = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16]]
    before = {n: local(p.detach()).clone() for n, p in trainer.model.named_parameters()}
    masters = [local(m.detach()).clone() for m in trainer.opt.masters]
    resident_logits = trainer.logits(trainer.probe_tokens)

    async def cycle() -> tuple[int, int, int]:
        start = free_bytes()
        await trainer.offload(["weights", "optimizer"])
        paused = free_bytes()
        await trainer.onload(["weights", "optimizer"])
        return start, paused, free_bytes()

    try:
        # the first offload also starts the trainer's compute thread, whose first forward (the
        # probe's reference) makes its own cuBLAS handle and workspace outside torch's
        # allocator (~100 MB on an H100, kept while the process lives): measure the second
        anyio.run(cycle)
        start, paused, resumed = anyio.run(cycle)
        # the device got both tags back (the flat buffer, the saver's region) and took them again
        assert paused - start >= tags["weights"] + tags["optimizer"] - 4 * MiB, (start, paused)
        assert abs(resumed - start) <= 4 * MiB, (start, resumed)
        flat.check()  # every parameter is still its view of the buffer
        assert all(torch.equal(local(p.detach()), before[n]) for n, p in trainer.model.named_parameters())
        assert all(torch.equal(local(m.detach()), w) for m, w in zip(trainer.opt.masters, masters))

        async def paused_probe():
            await trainer.offload(["weights", "optimizer"])
            try:
                cached = trainer.probe_logits(trainer.probe_tokens)
                twin = trainer.logits(trainer.probe_tokens)  # the CPU twin over the host backup
            finally:
                await trainer.onload(["weights", "optimizer"])
            return cached, twin

        cached, twin = anyio.run(paused_probe)
        scale = float(resident_logits.abs().max())
        assert float((cached - resident_logits).abs().max()) <= 1e-6 * scale  # taken on the device
        assert float((twin - cached).abs().max()) <= 0.02 * scale  # bf16 GPU against fp32 CPU
    finally:
        trainer.close()


def demo(tmp_path, *args):
    from tests.gpu.test_one_gpu import replay_clean

    trace = tmp_path / "t.jsonl"
    proc = subprocess.run([sys.executable, "-m", "colo.cli", "demo", "--device", "cuda", "--quiet",
                           "--trace", str(trace), *args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n" + proc.stdout[-3000:] + proc.stderr[-3000:]
    return replay_clean(trace)


@pytest.mark.parametrize("plan", ["offload-first", "sync-first"])
@pytest.mark.parametrize("trainer", ["hf", "fsdp"])
def test_a_one_rank_trainers_one_copy_sync_is_exact_over_several_steps(trainer, plan, tmp_path):
    events = demo(tmp_path, "--trainer", trainer, "--plan", plan, "--steps", "4", "--mem-fraction-static", "0.5")
    start = events[0]
    syncs = [e for e in events if e["event"] == "sync.finished"]
    assert [s["weight_version"] for s in syncs] == [1, 2, 3, 4] and len({s["digest"] for s in syncs}) == 4
    # one request out of the trainer's own buffer (or its shared host backup), nothing staged
    assert all(s["buckets"] == 1 and s["tensors"] == s["params"] for s in syncs)
    assert all(e["mem"]["by_tag"]["staging"] == 0 for e in events if e["event"] == "bucket.finished")
    # bf16 end to end: the bytes sent are the engine's weights, the trainer's tag is its buffer
    assert all(s["bytes"] == start["tags"]["engine.weights"]["bytes"] for s in syncs)
    assert start["tags"]["trainer.weights"]["bytes"] >= syncs[0]["bytes"]
    assert start["tags"]["trainer.weights"]["bytes"] - syncs[0]["bytes"] < 2 * MiB + 4096 * syncs[0]["tensors"]
