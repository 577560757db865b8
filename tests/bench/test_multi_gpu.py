"""``python -m bench.multi_gpu --gpus 2``: the multi-rank benchmark runs end to end (CPU, gloo; and on two GPUs)."""

import json

import pytest

from bench.multi_gpu import main as bench_main
from tests.docs.blocks import MULTI_GPU_TINY, REPO, run_command

ROWS = {(p, t) for p in ("sync-first", "offload-first")
        for t in ("colo-packed", "colo-packed-serial", "slime-style", "ipc-per-tensor")}


def _split_bytes(result: dict) -> int:
    """The bf16 bytes of every dense tensor colo's TP engine splits over the run's ranks, whole."""
    import math

    from bench.multi_gpu import is_expert, model_config
    from colo.engine.reference.tp import ShardPlan, TPLayout

    cfg = model_config(result["model"]["name"], result["model"]["layers"])
    plan = ShardPlan.build(TPLayout.from_config(cfg, tp_rank=0, tp_size=result["gpu_count"]))
    return sum(2 * math.prod(s.full_shape) for n, s in plan.slices.items() if s.dim is not None and not is_expert(n))


def _check(result: dict, rows: set = ROWS) -> None:
    """colo's packed rows move each engine rank exactly its shard (issue 46: its own slice of
    every tensor-parallel tensor, no gather; a MoE's experts, its slice from their owner);
    the baselines every tensor whole."""
    assert {(r["plan"], r["transport"]) for r in result["rows"]} == rows
    for key in ("device", "gpu_count", "torch", "date", "limits", "floors", "rows", "ratios", "targets",
                "model", "bucket_mib", "digest_verified"):
        assert key in result, key
    n = result["gpu_count"]
    assert n >= 2 and len(result["limits"]) == n
    model_bytes = result["model"]["bytes"]
    for r in result["rows"]:
        # every row moved the whole model (colo's, of a MoE: each rank's slice of the experts) and
        # every engine rank holds its shard of the trainer's weights
        assert r["digest_ok"] and r["digest_ok_by_rank"] == [True] * n, r
        colo = r["transport"].startswith("colo-packed")
        (shard,) = {lim["engine_shard_bytes"] for lim in result["limits"]}  # the same on every rank
        assert r["bytes"] == (shard if colo else model_bytes), r
        assert r["tensors"] == result["model"]["tensors"]
        assert len(r["sync_s_all"]) == result["reps"] and all(s > 0 for s in r["sync_s_all"])
        if r["transport"].startswith("colo-packed"):
            # the engine's own account: one reply per bucket (the packed transport's one load each)
            eng = r["engine_s_per_sync_rank0"]
            assert eng["loads"] == r["buckets"] and eng["wait"] >= 0 and eng["queue"] > 0, eng
    for lim in result["limits"]:
        assert lim["model_bytes"] == model_bytes
        assert lim["trainer_shard_bytes"] > 0 and lim["engine_shard_bytes"] > 0
        # colo's rows gather nothing: every tensor the engine splits goes as each rank's own slice
        assert lim["colo_gathered_bytes"] == 0 and lim["colo_all_gather_calls"] == 0, lim
        assert lim["own_slice_bytes"] == _split_bytes(result) > 0, lim
    assert result["model"]["own_slices"] is True
    assert result["digest_verified"] is True
    assert set(result["floors"]) >= {"sync-first", "offload-first"}


def test_bench_gpus_2_cpu(tmp_path, no_leftover_segments):
    """docs/multi-gpu.md's command line exactly as written (``MULTI_GPU_TINY``, as the docs' block
    test would run it: in a scratch directory, through bash), so the block test leaves that line
    to this test instead of running the benchmark twice."""
    assert MULTI_GPU_TINY in (REPO / "docs" / "multi-gpu.md").read_text().splitlines()
    proc = run_command(MULTI_GPU_TINY, tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "multi-gpu-tiny.json").read_text())
    _check(result)
    assert result["device"] == "cpu" and result["model"]["name"] == "tiny"
    by = {(r["plan"], r["transport"]): r for r in result["rows"]}
    for plan in ("sync-first", "offload-first"):
        # the slime-style baseline moved every tensor whole, in more buckets than colo's shards
        assert by[(plan, "slime-style")]["bytes"] == result["model"]["bytes"] > by[(plan, "colo-packed")]["bytes"]
        assert by[(plan, "slime-style")]["buckets"] > by[(plan, "colo-packed")]["buckets"] > 1
        # the floors: colo's own (one copy of the shard; its upload) below issue 46's with the gather
        f = result["floors"]
        assert f["colo_all_gather_s"] == 0.0 < f["model_all_gather_s"]
        assert f["sync-first"] == f["engine_shard_copy_s"] < f["sync-first-gathered"]
    assert "| sync-first | slime-style |" in proc.stdout



def test_bench_host_profile_puts_each_ranks_extraction_under_cprofile_for_one_more_sync(tmp_path):
    """--host-profile (issue 46: where a TP sender's host time goes): after each colo-packed
    row's timed syncs, one more with the extraction under cProfile, on every rank; its
    busiest functions in a file per rank and plan and in the row. The extractor's own code
    is what it found, and the trainer's extractor is its own again afterwards."""
    out, folder = tmp_path / "multi.json", tmp_path / "host"  # made by the bench
    code = bench_main(["--device", "cpu", "--gpus", "2", "--model", "tiny", "--reps", "1", "--bucket-mib", "0.5",
                       "--rows", "colo-packed", "--host-profile", str(folder), "--out", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    _check(result, {("sync-first", "colo-packed"), ("offload-first", "colo-packed")})
    assert sorted(p.name for p in folder.iterdir()) == [f"host-{plan}-rank{r}.txt" for plan in
                                                       ("offload-first", "sync-first") for r in (0, 1)]
    for row in result["rows"]:
        for rank, prof in enumerate(row["profile_by_rank"]):
            host = prof["host_profile"]
            assert host["text"] == str(folder / f"host-{row['plan']}-rank{rank}.txt")
            assert host["total_own_s"] > 0 and len(host["top_own"]) == 15
            assert "_gather_together" in (folder / f"host-{row['plan']}-rank{rank}.txt").read_text()


def test_bench_gpus_2_real_megatron_trainer_cpu(tmp_path, no_leftover_segments):
    """``--trainer megatron`` (issue 34, item 3): colo's real megatron-core trainer at TP=2 on
    two gloo ranks, in quarter-MiB buckets (its embedding, lm_head and gate/up cross
    several, gathered piece by piece), every row's shard digests checked on both engine
    ranks. Off a GPU nothing pauses: the sync-first rows only; ``--rows`` leaves the
    slime-style baseline out (it is the synthetic run's)."""
    out = tmp_path / "real.json"
    code = bench_main(["--device", "cpu", "--gpus", "2", "--model", "tiny", "--trainer", "megatron",
                       "--reps", "1", "--bucket-mib", "0.25", "--rows", "colo-packed,ipc-per-tensor",
                       "--profile", str(tmp_path), "--out", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    _check(result, {("sync-first", "colo-packed"), ("sync-first", "ipc-per-tensor")})
    # --profile: one more packed sync per rank under torch.profiler, its Chrome trace beside
    # (off a GPU no device time: the summary's totals are zero, the trace holds CPU ops)
    by = {r["transport"]: r for r in result["rows"]}
    assert by["ipc-per-tensor"]["profile_by_rank"] == [None, None]
    for rank, prof in enumerate(by["colo-packed"]["profile_by_rank"]):
        assert prof["trace"] == str(tmp_path / f"profile-sync-first-rank{rank}.json") and prof["wall_s"] > 0
        assert prof["device_s_by_kind"] == {"nccl": 0.0, "memcpy": 0.0, "other": 0.0} and prof["top"] == []
        # the engine rank's own recording beside it (its copies out of the staging buffer)
        eng = prof["engine"]
        assert eng["trace"] == str(tmp_path / f"profile-sync-first-rank{rank}-engine.json") and eng["wall_s"] > 0
        for path in (prof["trace"], eng["trace"]):
            events = json.loads(open(path).read())["traceEvents"]
            assert any(str(e.get("name", "")).startswith("aten::") for e in events), path
    assert result["model"]["trainer"].startswith("colo's Megatron trainer: a real megatron-core GPTModel")
    assert "sync_first_vs_floor" in result["ratios"] and "offload_first_vs_floor" not in result["ratios"]
    assert "sync_first_vs_slime_style" not in result["ratios"] and "sync_first_vs_per_tensor" in result["ratios"]
    # every HF tensor of the model in bf16, Megatron's vocabulary padding cut off
    from colo.trainers.models import build_trainer_model, demo_config

    hf = build_trainer_model(demo_config(), seed=0)
    assert result["model"]["bytes"] == 2 * sum(p.numel() for p in hf.parameters())
    assert result["model"]["tensors"] == len(list(hf.parameters()))
    assert bench_main(["--device", "cpu", "--gpus", "2", "--model", "qwen3-moe-tiny", "--trainer", "megatron"]) == 2

def test_bench_gpus_bad_model_or_rows(capsys):
    assert bench_main(["--device", "cpu", "--gpus", "2", "--model", "demo-xl"]) == 2
    assert bench_main(["--device", "cpu", "--gpus", "2", "--model", "tiny", "--rows", "colo-packed,fast"]) == 2
    assert ("--rows 'colo-packed,fast': expected labels among colo-packed, colo-packed-serial, slime-style, "
            "ipc-per-tensor") in capsys.readouterr().err


MOE_ROWS = {(p, t) for p in ("sync-first", "offload-first") for t in ("colo-packed", "slime-style")}


def test_bench_gpus_2_moe_cpu(tmp_path, no_leftover_segments):
    """The Qwen3-MoE path of the benchmark on two gloo ranks: trainer TP=2 with EP=2 experts,
    engine TP-MoE over 2 ranks, every row's shard digests checked on both engine ranks."""
    out = tmp_path / "moe.json"
    code = bench_main(["--device", "cpu", "--gpus", "2", "--model", "qwen3-moe-tiny", "--reps", "1",
                       "--bucket-mib", "0.05", "--out", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    experts = result["model"]["expert_bytes"]
    # colo's rows: each engine rank gets its half of every expert (issue 46), slime's every expert whole
    _check(result, MOE_ROWS)
    assert result["model"]["trainer_ep"] == 2 and result["anchor"]["ipc_loop_s"] == 3.0
    # the experts are most of the bytes; the floor counts the half each rank receives by all_to_all
    assert 0 < experts < result["model"]["bytes"] and experts % 2 == 0
    for lim in result["limits"]:
        assert lim["expert_bytes"] == experts and lim["expert_bytes_per_rank"] == experts // 2
        assert lim["model_all_to_all_calls"] > 0 and lim["model_broadcast_calls"] > 0
        assert lim["gathered_bytes"] + lim["expert_bytes"] == lim["model_bytes"]
    assert result["floors"]["model_all_to_all_s"] > 0 and "model_broadcast_s" not in result["floors"]
    assert set(result["targets"]) >= {"sync_first_s", "sync_first_vs_floor"}


def test_bench_moe_8_gpus_refused_on_a_smaller_machine(capsys):
    # this machine has no GPU: the 8-GPU run is refused before any process starts, saying why
    assert bench_main(["--device", "cuda", "--gpus", "8", "--model", "qwen3-30b-a3b"]) == 2
    err = capsys.readouterr().err
    assert "qwen3-30b-a3b" in err or "CUDA" in err
    # the layout of the 8-GPU run is one megatron-core can build: TP=4 (4 query groups), DP=2, EP=8
    from bench.multi_gpu import check_machine, megatron_shards, model_config, trainer_tp

    cfg = model_config("qwen3-30b-a3b")
    assert trainer_tp(cfg, 8) == 4 and trainer_tp(cfg, 2) == 2 and trainer_tp(model_config("qwen2-7b"), 2) == 2
    check_machine("cpu", 8, "qwen3-30b-a3b")
    r5 = {n: s for n, s, _ in megatron_shards(cfg, 5, 8)}
    assert r5["decoder.layers.0.self_attention.linear_qkv.weight"] == ((32 + 2 * 4) * 128 // 4, 2048)
    assert [n for n in r5 if n.startswith("decoder.layers.0.mlp.experts.")][0].endswith(".80.linear_fc1.weight")
    assert sum(".local_experts." in n for n in r5) == 48 * 16 * 2
    # 3 ranks split neither the 32 heads nor the 128 experts
    assert bench_main(["--device", "cpu", "--gpus", "3", "--model", "qwen3-30b-a3b"]) == 2
    assert "does not divide" in capsys.readouterr().err


@pytest.mark.gpu2
def test_bench_gpus_2_cuda(tmp_path):
    from bench.multi_gpu import run_bench_multi

    result, _ = run_bench_multi("cuda", 2, "qwen2-7b", 64, 1, str(tmp_path / "multi.json"), layers=2)
    _check(result)
    assert all(r["device_peak_extra_max"] is not None for r in result["rows"])


@pytest.mark.gpu2
def test_bench_gpus_2_real_megatron_trainer_cuda(tmp_path):
    """colo's real megatron-core trainer at TP=2 on two GPUs, the Qwen2-7B shape cut to 2
    layers, in 64 MiB buckets: both plans (its offload-first syncs read the paused weights'
    pinned backup), every row's digests checked, staging within its bound."""
    from bench.multi_gpu import SLACK_BYTES, run_bench_multi

    result, _ = run_bench_multi("cuda", 2, "qwen2-7b", 64, 1, str(tmp_path / "real.json"), layers=2,
                                trainer="megatron")
    _check(result)
    packed = [r for r in result["rows"] if r["transport"] == "colo-packed"]
    peaks = [(r["plan"], r["transport"], r["device_peak_extra_max"]) for r in packed]
    assert all(peak <= 2 * (64 << 20) + SLACK_BYTES for _, _, peak in peaks), peaks


@pytest.mark.gpu2
def test_bench_gpus_2_moe_cuda(tmp_path):
    """The Qwen3-30B-A3B shape cut to 2 layers on two GPUs (the moe2 rehearsal, shorter)."""
    from bench.multi_gpu import run_bench_multi

    result, _ = run_bench_multi("cuda", 2, "qwen3-30b-a3b", 64, 1, str(tmp_path / "moe.json"), layers=2)
    # colo's rows: each engine rank gets its half of every expert (as on the CPU); slime's every expert whole
    _check(result, MOE_ROWS)
    assert all(r["device_peak_extra_max"] is not None for r in result["rows"])


@pytest.mark.gpu4
def test_bench_gpus_4_cuda(tmp_path):
    """Qwen2-7B's shape cut to 2 layers at TP=4 (its 4 KV heads, one a rank) on four GPUs: every
    rank's own slices, every row's digests on every rank, staging within its bound."""
    from bench.multi_gpu import SLACK_BYTES, run_bench_multi

    result, _ = run_bench_multi("cuda", 4, "qwen2-7b", 64, 1, str(tmp_path / "multi4.json"), layers=2,
                                rows=("colo-packed", "slime-style"))
    _check(result, MOE_ROWS)
    peaks = [r["device_peak_extra_max"] for r in result["rows"] if r["transport"] == "colo-packed"]
    assert all(peak <= 2 * (64 << 20) + SLACK_BYTES for peak in peaks), peaks


@pytest.mark.gpu4
def test_bench_gpus_4_moe_cuda(tmp_path):
    """The Qwen3-30B-A3B shape cut to 2 layers on four GPUs: trainer TP=4 (its 4 query groups)
    and EP=4, engine TP-MoE over 4; each rank its own slices and a quarter of every expert."""
    from bench.multi_gpu import run_bench_multi

    result, _ = run_bench_multi("cuda", 4, "qwen3-30b-a3b", 64, 1, str(tmp_path / "moe4.json"), layers=2)
    _check(result, MOE_ROWS)
    assert result["model"]["trainer_tp"] == 4 and result["model"]["trainer_ep"] == 4


@pytest.mark.parametrize("kind", ["chardev", "fifo", "symlink-to-chardev"])
def test_bench_gpus_out_that_is_not_a_regular_file_is_refused_before_it_runs_and_left_as_it_was(
        kind, tmp_path, capsys, monkeypatch):
    """Issue 32, item 1: the one-rank bench refused these; the multi-rank one replaced them."""
    import os
    import stat

    import bench.multi_gpu as multi

    out = tmp_path / "out.json"
    if kind == "fifo":
        os.mkfifo(out)
    else:
        dev = out if kind == "chardev" else tmp_path / "fulldev"
        try:
            os.mknod(dev, 0o600 | stat.S_IFCHR, os.makedev(1, 7))  # a private /dev/full
        except PermissionError:
            pytest.skip("making a character device needs root")
        if kind != "chardev":
            os.symlink(dev, out)
    before = os.lstat(out)

    async def refuse(**kw):
        raise AssertionError("the benchmark ran for an output it cannot write")

    monkeypatch.setattr(multi, "bench_multi", refuse)
    assert bench_main(["--device", "cpu", "--gpus", "2", "--model", "tiny", "--reps", "1",
                       "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--out {out}" in err and "expected a new path or an existing regular file" in err
    after = os.lstat(out)
    assert (after.st_ino, after.st_mode, after.st_rdev) == (before.st_ino, before.st_mode, before.st_rdev)
    assert sorted(os.listdir(tmp_path)) == sorted(["out.json"] + (["fulldev"] if kind == "symlink-to-chardev" else []))
