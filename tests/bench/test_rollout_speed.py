"""``python -m bench.rollout_speed`` without vLLM: colo's engine on the demo's batch, what the
JSON records, and its refusals. No timing is judged here, only what was rolled out."""

from __future__ import annotations

import json

import pytest

from bench import rollout_speed


def test_colos_engine_rolls_out_the_demos_batch_and_the_record_says_what_ran(tmp_path):
    out = tmp_path / "r.json"
    assert rollout_speed.main([str(out), "--engines", "colo", "--reps", "1", "--date", "2026-11-27"]) == 0
    doc = json.loads(out.read_text())
    assert doc["date"] == "2026-11-27" and doc["torch"] and "vllm" not in doc and "median_over_vllm" not in doc
    assert doc["batch"]["prompts"] * doc["batch"]["new_tokens"] == 32 * 24
    [(name, row)] = doc["engines"].items()
    assert (name, row["engine"], row["dtype"], row["threads"]) == ("colo", "colo", "float32", 1)
    assert row["tokens_per_rollout"] == 32 * 24 and len(row["times_s"]) == 1
    assert doc["greedy_equal_tokens"] == {"colo": 1.0} and doc["greedy_equal_tokens_against"] == "colo"


@pytest.mark.parametrize("argv,msg", [(["--engines", "sglang"], "unknown engine(s) ['sglang']"),
                                      (["--reps", "0"], "--reps >= 1"),
                                      (["--rep", "1"], "unrecognized arguments: --rep 1")])
def test_bad_arguments_are_refused_naming_them(argv, msg, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        rollout_speed.main([str(tmp_path / "r.json"), *argv])
    assert e.value.code == 2 and msg in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()
