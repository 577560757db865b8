"""Issue 45, item 3: colo tune (and colo export, unless --lenient) read only traces that
colo replay accepts; before, tune recommended a mem_fraction_static from a trace with 113
violations (decreasing timestamps) and from one with a second trace.started."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from colo.cli import main

TRACE = Path(__file__).resolve().parents[2] / "traces" / "cpu-demo.jsonl"


def _damaged(tmp_path: Path, how: str) -> Path:
    lines = TRACE.read_text().splitlines()
    if how == "decreasing-timestamps":
        events = [json.loads(ln) for ln in lines]
        for e in events[10:]:
            e["ts"] = round(1000.0 - e["ts"], 6)  # runs backwards from the 11th event on
        lines = [json.dumps(e) for e in events]
    else:  # a second run's header in the middle of the file
        lines = lines[:20] + [lines[0]] + lines[20:]
    path = tmp_path / f"{how}.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("how, line", [("decreasing-timestamps", 12), ("second-header", 21)])
def test_tune_and_export_refuse_what_replay_rejects_naming_its_first_violation(how, line, tmp_path, capsys):
    path = _damaged(tmp_path, how)
    assert main(["replay", str(path)]) == 1
    replayed = capsys.readouterr().out.splitlines()[0]
    assert replayed.startswith(f"line {line}: "), replayed
    out = tmp_path / "out.json"
    for argv, command in ((["tune", str(path)], "tune"), (["export", str(path), "-o", str(out)], "export")):
        assert main(argv) == 2
        captured = capsys.readouterr()
        assert captured.out == ""
        [err] = captured.err.strip().splitlines()
        assert err.startswith(f"colo {command}: colo replay rejects this trace, so colo {command} does not read "
                              f"it: {path}: {replayed}"), err
    assert not out.exists()
    # asked for, an export of what is there, said to be damaged
    assert main(["export", str(path), "-o", str(out), "--lenient"]) == 0
    assert capsys.readouterr().err.startswith(f"warning: exported although colo replay rejects it (--lenient): "
                                              f"{path}: line {line}: ")
    assert json.loads(out.read_text())["traceEvents"]


def test_a_clean_trace_is_tuned_and_exported_as_before(tmp_path, capsys):
    assert main(["tune", str(TRACE), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["mem_fraction_static"] > 0
    assert main(["export", str(TRACE), "-o", str(tmp_path / "e.json")]) == 0
    assert "warning" not in capsys.readouterr().err
