"""The command line a person expects: every flag explained with its default, the fault
kinds listed, a missing optional extra refused with the line that installs it, no
shortened flag taken for another, and nothing but the report on the console."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from colo.cli import EXTRAS, build_parser, main


def _commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


@pytest.mark.parametrize("command", ["demo", "replay", "export", "tune", "bench"])
def test_every_flag_has_a_description_and_says_its_default(command):
    parser = _commands()[command]
    assert parser.description
    help_text = parser.format_help()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"colo {command} {action.option_strings or action.dest}: no description"
        if action.option_strings and action.default not in (None, False):
            # argparse's own text, or a default the help states in its own words
            rendered = parser._get_formatter()._get_help_string(action) % {"default": action.default}
            assert "default" in rendered, f"{action.option_strings}: no default in {rendered!r}"
    assert "``" not in help_text and "``" not in build_parser().format_help()  # no raw markup


def test_fault_help_lists_every_kind_and_where_it_can_happen():
    from colo.testing.faults import KINDS

    text = _commands()["demo"].format_help()
    for kind in KINDS:
        assert kind in text
    assert "kill-engine (at rollout, engine_release" in " ".join(text.split())


@pytest.mark.parametrize("argv, extra", [(["demo", "--trainer", "megatron"], "megatron"),
                                         (["demo", "--gpus", "2", "--launcher", "ray"], "ray"),
                                         (["demo", "--engine", "vllm"], "vllm")])
def test_a_missing_extra_is_exit_2_with_the_install_line(argv, extra, monkeypatch, capsys):
    module = next(m for (_, _, v), (m, e, _) in EXTRAS.items() if e == extra)
    # hide the module (and its parent package) as if the extra were not installed
    monkeypatch.setitem(sys.modules, module.split(".")[0], None)
    if "." in module:
        monkeypatch.setitem(sys.modules, module, None)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"pip install 'colo[{extra}]'" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_a_shortened_flag_is_refused(capsys):
    # argparse's prefix matching would take --engine-vis for --engine-visible-devices
    with pytest.raises(SystemExit) as e:
        main(["demo", "--engine-vis", "0", "--steps", "1"])
    assert e.value.code == 2
    assert "unrecognized arguments: --engine-vis" in capsys.readouterr().err


def test_the_demo_prints_no_raw_json_and_logs_the_engine_beside_the_trace(tmp_path):
    trace = tmp_path / "run.jsonl"
    proc = subprocess.run([sys.executable, "-m", "colo.cli", "demo", "--steps", "1", "--quiet", "--trace", str(trace)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    for stream in (proc.stdout, proc.stderr):
        assert not [ln for ln in stream.splitlines() if ln.lstrip().startswith("{")], stream
    log = tmp_path / "run.engine.log"
    assert f"engine log: {log}" in proc.stdout
    events = [json.loads(line)["event"] for line in log.read_text().splitlines()]
    assert events[0] == "engine.ready"


def test_bench_honours_model_reps_bucket_and_transports(tmp_path):
    out = tmp_path / "b.json"
    assert main(["bench", "--model", "demo", "--transports", "packed", "ipc", "--reps", "1", "--bucket-mib", "0.5",
                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    (model,) = result["models"]
    assert model["model"] == "demo" and model["repeat"] == 1 and model["bucket_mib"] == 0.5
    assert [r["transport"] for r in model["rows"]] == ["packed", "ipc"]
    for row in model["rows"]:
        assert len(row["sync_s_all"]) == 1 and row["digest_ok"]
        # 0.5 MiB buckets: more of them than the model's own 1 MiB default gives
        assert row["buckets"] > model["params"] * 2 // (1 << 20)
    assert result["limit"]["link"] == "host memcpy" and all(0 < r["of_limit"] for r in model["rows"])


def test_bench_on_cuda_without_a_gpu_says_so(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["bench", "--device", "cuda", "--model", "qwen2-1.5b"]) == 2
    assert "no CUDA device is visible" in capsys.readouterr().err
