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
                                         (["demo", "--engine", "vllm"], "vllm"),
                                         (["bench", "--engine", "vllm"], "vllm"),
                                         (["demo", "--engine", "sglang"], "sglang"),
                                         (["bench", "--engine", "sglang"], "sglang")])
def test_a_missing_extra_is_exit_2_with_the_install_line(argv, extra, monkeypatch, capsys):
    from colo.engine import ENGINES

    # an engine's extra is its registry entry's; the others are the command line's own
    engines = {e.extra: e.requires for e in ENGINES.values() if e.extra}
    module = engines.get(extra) or next(m for (_, _, v), (m, e, _) in EXTRAS.items() if e == extra)
    # hide the module (and its parent package) as if the extra were not installed
    monkeypatch.setitem(sys.modules, module.split(".")[0], None)
    if "." in module:
        monkeypatch.setitem(sys.modules, module, None)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"pip install 'colo-rl[{extra}]'" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_a_shortened_flag_is_refused(capsys):
    # argparse's prefix matching would take --engine-vis for --engine-visible-devices
    with pytest.raises(SystemExit) as e:
        main(["demo", "--engine-vis", "0", "--steps", "1"])
    assert e.value.code == 2
    assert "unrecognized arguments: --engine-vis" in capsys.readouterr().err


#: each command's least argv that parses, to which a shortened flag is added
_LEAST_ARGV = {"demo": [], "replay": ["t.jsonl"], "export": ["t.jsonl", "-o", "t.json"], "tune": [], "bench": []}


def _shortened_flags():
    """Every proper prefix (of 3 characters or more) of every long flag of every command that
    is not itself a flag of that command: argparse's prefix matching would take each."""
    for name, parser in _commands().items():
        flags = {o for a in parser._actions for o in a.option_strings}
        for flag in sorted(f for f in flags if f.startswith("--")):
            for k in range(3, len(flag)):
                if flag[:k] not in flags:
                    yield name, flag[:k], flag


def test_the_least_argv_of_every_command_parses():
    assert sorted(_LEAST_ARGV) == sorted(_commands())  # a new command is added here too
    for name, argv in _LEAST_ARGV.items():
        assert build_parser().parse_args([name, *argv]).command == name


@pytest.mark.parametrize("command", ["demo", "replay", "export", "tune", "bench"])
def test_no_command_takes_a_shortened_flag_for_another(command, capsys):
    """Issue 32, item 12: ``colo demo --engine-vis 0`` ran with --engine-visible-devices 0. Every
    shortened spelling of every flag, alone, with a value and as ``--flag=value``, is refused
    naming itself, exit 2, and never taken for the flag it shortens."""
    cases = [(p, f) for c, p, f in _shortened_flags() if c == command]
    assert len(cases) >= 6  # replay has the fewest: --help and --json
    for prefix, flag in cases:
        for extra in ([prefix], [prefix, "1"], [f"{prefix}=1"]):
            with pytest.raises(SystemExit) as e:
                build_parser().parse_args([command, *_LEAST_ARGV[command], *extra])
            err = capsys.readouterr().err
            assert e.value.code == 2, (command, extra, flag)
            # (a value after it may be taken as a TRACE of replay or tune: the flag is refused all the same)
            assert f"unrecognized arguments: {extra[0]}" in err, (command, extra, err)


def test_the_top_level_and_command_names_are_not_shortened_either(capsys):
    for argv, said in ((["--hel", "replay", "t.jsonl"], "unrecognized arguments: --hel"),
                       (["dem"], "invalid choice: 'dem'"), (["rep", "t.jsonl"], "invalid choice: 'rep'")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and said in capsys.readouterr().err


def test_the_issues_case_is_refused_before_anything_runs(capsys, monkeypatch):
    """``colo demo --eng vllm``: not the engine, not the engine's visible devices."""
    monkeypatch.setattr("colo.apps.demo.run_demo", lambda args: pytest.fail("the demo ran"))
    for argv in (["demo", "--eng", "vllm"], ["demo", "--engine-vis", "vllm"], ["demo", "--eng=vllm"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and f"unrecognized arguments: {' '.join(argv[1:])}" in capsys.readouterr().err


def test_the_benchmark_harnesses_refuse_shortened_flags_too(capsys):
    """The harnesses a user runs as ``python -m bench.X`` parse with allow_abbrev=False as colo does."""
    import ast
    from pathlib import Path

    import bench.multi_gpu as multi

    assert multi.main(["--device", "cpu", "--gpus", "2", "--model", "tiny", "--rep", "1"]) == 2
    assert "unrecognized arguments: --rep 1" in capsys.readouterr().err
    root = Path(__file__).resolve().parents[1]
    made = []
    for path in sorted([*root.glob("bench/*.py"), *root.glob("colo/**/*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in (
                    "ArgumentParser", "_Parser", "add_parser"):
                kw = {k.arg: k.value for k in node.keywords}
                made.append(path.name)
                assert isinstance(kw.get("allow_abbrev"), ast.Constant) and kw["allow_abbrev"].value is False, \
                    f"{path}:{node.lineno}: a parser without allow_abbrev=False"
    assert {"cli.py", "multi_gpu.py", "gpu_sync.py", "soak.py", "replay_speed.py"} <= set(made)


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


@pytest.mark.parametrize("encoding", ["ascii", "utf-8:strict"])
def test_a_file_name_the_console_cannot_encode_is_written_as_it_is_on_disk_not_a_traceback(encoding, tmp_path):
    """Issue 32, item 11: a trace name that is not UTF-8 (a latin-1 byte) under a strict console
    encoding ended the demo with a UnicodeEncodeError traceback at the report's ``trace:`` line."""
    import os

    name = os.fsencode(tmp_path) + b"/\xff\xc3\xa9.jsonl"  # a byte no UTF-8 decodes, then an e-acute
    env = {**os.environ, "PYTHONIOENCODING": encoding, "LC_ALL": "C.UTF-8"}
    cmd = [os.fsencode(sys.executable), b"-m", b"colo.cli"]
    # ascii cannot write the e-acute: escaped; the undecodable byte goes back out as itself
    shown = name.replace(b"\xc3\xa9", b"\\xe9") if encoding == "ascii" else name
    demo = subprocess.run([*cmd, b"demo", b"--steps", b"1", b"--quiet", b"--trace", name], capture_output=True,
                          env=env, timeout=600, cwd=tmp_path)
    assert demo.returncode == 0 and b"Traceback" not in demo.stderr, demo.stderr.decode("ascii", "replace")[-2000:]
    assert b"trace: " + shown + b"\n" in demo.stdout and os.path.isfile(name)
    replay = subprocess.run([*cmd, b"replay", name], capture_output=True, env=env, timeout=120)
    assert replay.returncode == 0 and replay.stdout.startswith(shown + b": valid: ")
    missing = name[:-6] + b".missing.jsonl"
    bad = subprocess.run([*cmd, b"export", missing, b"-o", name + b".json"], capture_output=True, env=env,
                         timeout=120)
    assert bad.returncode == 2 and bad.stdout == b""
    assert bad.stderr == b"colo export: " + shown[:-6] + b".missing.jsonl: cannot read (No such file or directory)\n"


def test_a_reader_that_went_away_ends_the_command_quietly_with_status_one(tmp_path):
    """``colo replay T | head -1``: stdout's reader is gone (here before the command starts: a
    pipe with no reader end left), so the first write fails with EPIPE. No traceback: status 1,
    Python's own for EPIPE, and nothing on stderr but what the command itself says."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    r, w = os.pipe()
    os.close(r)
    try:
        proc = subprocess.run([sys.executable, "-m", "colo.cli", "replay", str(repo / "traces" / "cpu-demo.jsonl")],
                              stdout=w, stderr=subprocess.PIPE, text=True, cwd=tmp_path, timeout=300,
                              env={**os.environ, "PYTHONPATH": str(repo)})
    finally:
        os.close(w)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr
