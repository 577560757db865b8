"""``colo bench --gpus 2``: the multi-rank benchmark runs end to end (CPU, gloo; and on two GPUs)."""

import json

import pytest

from colo.cli import main

ROWS = {(p, t) for p in ("sync-first", "offload-first") for t in ("colo-packed", "slime-style", "ipc-per-tensor")}


def _check(result: dict) -> None:
    assert {(r["plan"], r["transport"]) for r in result["rows"]} == ROWS
    for key in ("device", "gpu_count", "torch", "date", "limits", "floors", "rows", "ratios", "targets",
                "model", "bucket_mib", "digest_verified"):
        assert key in result, key
    assert result["gpu_count"] == 2 and len(result["limits"]) == 2
    model_bytes = result["model"]["bytes"]
    for r in result["rows"]:
        # every row moved the whole model and every engine rank holds its shard of the trainer's weights
        assert r["digest_ok"] and r["digest_ok_by_rank"] == [True, True], r
        assert r["bytes"] == model_bytes, r
        assert r["tensors"] == result["model"]["tensors"]
        assert len(r["sync_s_all"]) == result["reps"] and all(s > 0 for s in r["sync_s_all"])
    for lim in result["limits"]:
        assert lim["model_bytes"] == model_bytes
        assert lim["trainer_shard_bytes"] > 0 and lim["engine_shard_bytes"] > 0
    assert result["digest_verified"] is True
    assert set(result["floors"]) >= {"sync-first", "offload-first"}


def test_bench_gpus_2_cpu(tmp_path, capsys, no_leftover_segments):
    out = tmp_path / "multi.json"
    code = main(["bench", "--device", "cpu", "--gpus", "2", "--model", "tiny", "--reps", "1",
                 "--bucket-mib", "0.5", "--out", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    _check(result)
    assert result["device"] == "cpu" and result["model"]["name"] == "tiny"
    by = {(r["plan"], r["transport"]): r for r in result["rows"]}
    for plan in ("sync-first", "offload-first"):
        # the slime-style baseline moved the same bytes in the same buckets as colo
        assert by[(plan, "slime-style")]["bytes"] == by[(plan, "colo-packed")]["bytes"]
        assert by[(plan, "slime-style")]["buckets"] == by[(plan, "colo-packed")]["buckets"] > 1
    assert "| sync-first | slime-style |" in capsys.readouterr().out


def test_bench_gpus_bad_model():
    assert main(["bench", "--device", "cpu", "--gpus", "2", "--model", "demo-xl"]) == 2


@pytest.mark.gpu2
def test_bench_gpus_2_cuda(tmp_path):
    from colo.apps.bench_multi import run_bench_multi

    result, _ = run_bench_multi("cuda", 2, "qwen2-7b", 64, 1, str(tmp_path / "multi.json"), layers=2)
    _check(result)
    assert all(r["device_peak_extra_max"] is not None for r in result["rows"])
