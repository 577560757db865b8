"""``python -m bench.collective_cost``: what one all-gather costs the host, each way, every output checked (CPU, gloo)."""

import json

import pytest

from bench.collective_cost import ENV, main


def test_every_way_at_every_size_on_two_gloo_ranks_gathers_exactly(tmp_path):
    out = tmp_path / "cost.json"
    assert main([str(out), "--device", "cpu", "--ranks", "2", "--calls", "3", "--sizes", "64,256",
                 "--coalesce", "3"]) == 0
    result = json.loads(out.read_text())
    assert result["kind"] == "bench.collective_cost" and result["backend"] == "gloo" and result["ranks"] == 2
    assert set(result["env"]) == set(ENV) and result["torch"] and result["date"]
    rows = result["rows"]
    assert [(r["bytes"], r["way"], r["outputs_per_call"]) for r in rows] == [
        (n, way, k) for n in (64, 256)
        for way, k in (("all_gather_into_tensor", 1), ("coalesced", 3), ("process group", 1))]
    for r in rows:
        # every output of every way: each rank's part is that rank's bytes, on both ranks
        assert r["exact"] is True and r["calls"] == 3, r
        assert len(r["host_us_by_rank"]) == 2 and r["host_us"] == max(r["host_us_by_rank"]) > 0
        assert r["wall_us"] >= r["host_us"]


@pytest.mark.parametrize("args", [["--sizes", "65"], ["--ranks", "1"], ["--calls", "0"], ["--sizes", "a,b"]])
def test_bad_arguments_are_refused_before_any_rank_starts(tmp_path, args):
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "x.json"), "--device", "cpu", *args])
    assert e.value.code == 2
    assert not (tmp_path / "x.json").exists()
