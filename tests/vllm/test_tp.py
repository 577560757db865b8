"""One real vLLM of ``tensor_parallel_size=2`` whose two ranks each live in a rank's process,
beside that rank's trainer (the ``tp`` layout, issue 42 item 2b), at the wire.

Two spawned processes stand for two rank workers: each joins a gloo process group first (the
trainer's, which the rank's vLLM takes for its world), starts its rank of the vLLM as
``colo demo --engine-layout tp`` does (``colo.engine.vllm.start``), and takes two syncs of new
weights through colo's packed transport from its own sender. The ground truth is vLLM and
transformers: after each sync both ranks generate transformers' greedy tokens and score its
logprobs, report the digest of the trainer's whole tensors, and each rank's own parameters (read
from vLLM's worker) are that rank's slices of the trainer's tensors, as vLLM's own TP layers
cut them."""

from __future__ import annotations

import os
import traceback

import pytest
import torch

from tests.vllm.test_engine import PROBE, PROMPTS, new_weights, order, sync

N = 2
VERSIONS = ((1, 11), (2, 12))  # weight version, the seed of its weights


def _rank(rank: int, store: str, model_dir: str, out_dir: str) -> None:
    """One rank worker: the trainer's group, its vLLM rank, two syncs, what it holds."""
    import anyio
    import torch.distributed as dist

    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=N)
        anyio.run(_work, rank, model_dir, out_dir)
        # vLLM has ended and the trainer's group is still the trainer's: it still reduces
        total = torch.tensor([rank + 1.0])
        dist.all_reduce(total)
        torch.save(float(total), os.path.join(out_dir, f"rank{rank}.after"))
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.error"), "w") as f:
            f.write(traceback.format_exc())
        raise


async def _work(rank: int, model_dir: str, out_dir: str) -> None:
    from colo.engine.vllm.start import start

    build = {"checkpoint": model_dir, "dtype": "float32", "device": "cpu", "mem_fraction_static": 0.8,
             "tp": {"rank": rank, "size": N, "ident": f"colo-test-{os.path.basename(out_dir)}"}}
    engine = await start(build, options={"processes": False}, seed=0, batch=8)
    try:
        out: dict = {"pid": os.getpid(), "engine_pid": engine.pid, "versions": {}}
        for version, seed in VERSIONS:
            _, trainer = new_weights(seed)
            result = await sync(engine, trainer, bucket_bytes=2 << 20, version=version)
            await engine.set_weight_version(version)
            # every rank asks the same, in the same order: its TP collectives meet the other's
            out["versions"][version] = {
                "tensors": result.tensors, "digest": await engine.digest(),
                "tokens": await engine.tokens(PROMPTS, max_new_tokens=8), "logprobs": await engine.logprobs(PROBE)}

        def held(worker):
            from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

            return {"tp_rank": get_tensor_model_parallel_rank(), "tp_size": get_tensor_model_parallel_world_size()}

        out.update(engine.llm.collective_rpc(held)[0])
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        await engine.aclose()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, model_dir):
    """Both ranks' records (each rank a spawned process, as colo's rank workers are)."""
    import multiprocessing as mp

    out = tmp_path_factory.mktemp("vllm-tp")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, str(out / "store"), model_dir, str(out))) for r in range(N)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=1800)  # a ceiling for a hang only
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    errors = [(out / f"rank{r}.error").read_text() for r in range(N) if (out / f"rank{r}.error").exists()]
    assert not errors and all(p.exitcode == 0 for p in procs), (errors, [p.exitcode for p in procs])
    records = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(N)]
    for r, rec in enumerate(records):
        rec["group_after_vllm"] = torch.load(out / f"rank{r}.after")
    return records


def test_each_rank_generates_transformers_tokens_and_reports_the_trainers_digest(ranks):
    from colo.digest import expected_weights_digest
    from tests.vllm.parts import greedy, hf_logprobs

    assert [r["tp_rank"] for r in ranks] == [0, 1] and {r["tp_size"] for r in ranks} == {N}
    # vLLM's teardown left the trainer's group to the trainer: an all-reduce after it summed 1 + 2
    assert [r["group_after_vllm"] for r in ranks] == [3.0, 3.0]
    # vLLM's ranks run in the rank processes themselves: one process each, no worker of vLLM's own
    assert all(r["engine_pid"] == r["pid"] for r in ranks) and ranks[0]["pid"] != ranks[1]["pid"]
    for version, seed in VERSIONS:
        model, trainer = new_weights(seed)
        want_digest = expected_weights_digest(trainer.source, order(trainer), torch.float32)
        want_tokens = greedy(model, PROMPTS, 8)
        want_logprobs = hf_logprobs(model, PROBE)
        for rank, rec in enumerate(ranks):
            got = rec["versions"][version]
            assert got["tensors"] == 51 and got["digest"] == want_digest, (rank, version)
            assert got["tokens"] == want_tokens, (rank, version)
            err = max(abs(a - b) for g, w in zip(got["logprobs"], want_logprobs) for a, b in zip(g, w))
            assert err <= 1e-4, (rank, version, err)
