"""``colo bench`` on a tiny model: real engine process, real extractor, every transport."""

from __future__ import annotations

import json

import pytest
import torch

import colo.apps.bench as bench
from colo.core.buckets import plan_buckets
from colo.cli import main
from colo.trainers.models import demo_config
from tests.leaks import new_segments

TINY = bench.BenchModel(name="tiny", description="a test-sized Qwen2",
                        config=dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64),
                        bucket_mib=1 / 32, repeat=1)


def test_bench_reports_every_transport_with_measured_values(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(bench.MODELS, "tiny", TINY)
    real = bench.measure_limits
    monkeypatch.setattr(bench, "measure_limits", lambda: real(nbytes=4 << 20, reps=1, directory=str(tmp_path)))
    out = tmp_path / "r.json"
    assert main(["bench", "--device", "cpu", "--model", "tiny", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["kind"] == "colo.apps.bench/cpu-sync" and result["device"] == "cpu"
    assert {"platform", "cpu", "cores", "python", "torch"} <= set(result["machine"])
    assert result["machine"]["torch"] == torch.__version__
    assert result["limits"]["memcpy_GBps"] > 0 and result["limits"]["file_write_fsync_GBps"] > 0
    [model] = result["models"]
    trainer = bench.SourceTrainer(demo_config(**TINY.config), source_dtype="float32", engine_dtype="bfloat16")
    specs = trainer.extractor().specs()
    buckets = plan_buckets(specs, int(TINY.bucket_mib * (1 << 20)))
    cap = max(b.nbytes for b in buckets)
    payload = sum(s.nbytes for s in specs)
    assert (model["params"], model["tensors"]) == (sum(t.numel() for t in trainer.state.values()), len(specs))
    rows = {r["transport"]: r for r in model["rows"]}
    assert list(rows) == ["ipc", "packed", "broadcast", "disk"]  # the per-tensor baseline first
    for name, r in rows.items():
        assert r["digest_ok"] is True, name
        # verification beside the sync: both digests, timed
        assert r["verify_s"] == pytest.approx(r["engine_digest_s"] + model["trainer_digest_s"]) and r["verify_s"] > 0
        assert r["verify_of_sync"] == pytest.approx(r["verify_s"] / r["sync_s"])
        assert (r["bytes"], r["buckets"], r["tensors"]) == (payload, len(buckets), len(specs))
        assert r["GBps"] == pytest.approx(r["bytes"] / r["sync_s"] / 1e9)
        assert len(r["sync_s_all"]) == TINY.repeat and set(r["stage_s_median"]) == {"gather", "pack", "handoff",
                                                                                   "load"}
    # one request per tensor for the baseline, one per bucket for the rest
    assert rows["ipc"]["requests_per_sync"] == len(specs)
    assert {rows[n]["requests_per_sync"] for n in ("packed", "broadcast", "disk")} == {len(buckets)}
    # staging: two whole buffers for packed; plus the engine's receive buffer for broadcast
    assert rows["packed"]["peak_staging_bytes"] == 2 * cap
    assert 2 * cap + max(b.nbytes for b in buckets[1:]) <= rows["broadcast"]["peak_staging_bytes"] <= 3 * cap
    pairs = max(a.payload_bytes + b.payload_bytes for a, b in zip(buckets, buckets[1:]))
    assert max(b.payload_bytes for b in buckets) <= rows["disk"]["peak_staging_bytes"] <= pairs
    assert max(b.payload_bytes for b in buckets) <= rows["ipc"]["peak_staging_bytes"] <= pairs
    printed = capsys.readouterr().out
    assert bench.table(result) in printed and "| tiny (" in printed
    assert new_segments() == []


@pytest.mark.parametrize("argv,msg", [
    (["--model", "gpt5"], "unknown model gpt5; expected one of demo, qwen2-1b"),
    (["--transports", "packed", "carrier-pigeon"], "unknown transport carrier-pigeon; expected some of packed, ipc"),
])
def test_bench_bad_input_exits_two_naming_the_choice(argv, msg, capsys, tmp_path):
    assert main(["bench", "--out", str(tmp_path / "x.json"), *argv]) == 2
    assert msg in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


async def test_adapter_rows_time_each_new_version_beside_the_full_sync_and_check_its_digest():
    """``colo bench --lora-rank R``: each adapter sync is a new version staged into the same engine
    and activated after it; its bytes are the adapter's (rank R on every dense linear, the
    engine's dtype), compared with the full sync of the same model through the same transport."""
    import dataclasses

    from colo.models.lora import TARGETS, AdapterConfig, adapter_bytes, adapter_shapes

    model = dataclasses.replace(bench.MODELS["demo"], repeat=2)
    cases = [c for c in bench.CASES if c.label in ("packed", "ipc")]
    result = await bench.bench([model], cases, device="cpu", lora_rank=4)
    [m] = result["models"]
    config = demo_config(**model.config)
    want = adapter_bytes(adapter_shapes(config, AdapterConfig(r=4, alpha=8, targets=TARGETS)).values(), 2)
    rows = m["adapter_rows"]
    assert [r["transport"] for r in rows] == ["ipc", "packed"]
    full = {r["transport"]: r for r in m["rows"]}
    for r in rows:
        assert r["bytes"] == want and r["digest_ok"] and r["syncs"] == 3 and r["rank"] == 4
        assert r["bytes_of_full"] == want / full[r["transport"]]["bytes"] < 0.05
        assert r["of_full_sync"] == r["sync_s"] / full[r["transport"]]["sync_s"]
        assert "floor_s" not in r  # the floor is a GPU's (pinned host->device)
    # every sync a new version; the engine keeps the newest two: the last case's last two
    assert sorted(rows[-1]["versions"]) == [5, 6]
    assert "| demo | r=4 | packed |" in bench.table(result)
    assert new_segments() == []
