"""Issue 32, item 5: whatever a run's start raises reaches the user as one line, with the
exit code of its cause (2 bad input, 1 a run-time failure), never as an ExceptionGroup
traceback; the engine's own reason is in that line.

Before the fix ``DemoRun.start()`` ran outside the run's error handling: every one of
these escaped ``colo demo`` as an ExceptionGroup traceback ending in "engine process
exited with code 1 while starting"."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from colo.apps import demo
from colo.cli import main

REPO = Path(__file__).resolve().parents[2]


def _ram_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err and "ExceptionGroup" not in err
    return lines[0]


def test_a_device_larger_than_this_machines_memory_is_one_line_exit_2(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    big = 2 * _ram_gib() / 0.8 + 1  # the engine's 0.8 of it alone is twice the machine's memory
    rc = main(["demo", "--quiet", "--steps", "1", "--device-mem-gib", f"{big:.0f}", "--trace", str(trace)])
    line = _one_line(capsys.readouterr().err)
    assert rc == 2
    assert line.startswith("colo demo: engine refused its build: ")
    assert f"more than this machine's {_ram_gib():.1f} GiB of memory" in line


def _corrupt_build(monkeypatch, **change):
    build = demo.DemoRun._engine_build

    async def corrupted(self):
        out = await build(self)
        out["config"] = {**out["config"], **change.get("config", {})}
        out.update(change.get("build", {}))
        return out

    monkeypatch.setattr(demo.DemoRun, "_engine_build", corrupted)


def test_a_malformed_engine_config_reaches_the_user_as_the_engines_reason_exit_2(tmp_path, capsys, monkeypatch):
    _corrupt_build(monkeypatch, config={"num_key_value_heads": 3})
    rc = main(["demo", "--quiet", "--steps", "1", "--trace", str(tmp_path / "t.jsonl")])
    line = _one_line(capsys.readouterr().err)
    assert rc == 2
    assert line == ("colo demo: engine refused its build: num_attention_heads (4) must be a multiple of "
                    "num_key_value_heads (3)")


def test_a_run_time_failure_while_starting_is_one_line_exit_1(tmp_path, capsys, monkeypatch):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()  # no manifest: not a committed checkpoint
    _corrupt_build(monkeypatch, build={"checkpoint": str(ckpt)})
    rc = main(["demo", "--quiet", "--steps", "1", "--trace", str(tmp_path / "t.jsonl")])
    line = _one_line(capsys.readouterr().err)
    assert rc == 1
    assert line.startswith("colo demo: engine failed while starting: IncompleteCheckpoint: ")
    assert str(ckpt) in line


def _cli(*argv: str, timeout: float = 300) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "colo.cli", "demo", "--quiet", *argv], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - t0


def test_a_refusal_by_the_engine_ranks_of_gpus_2_is_one_line_exit_2(tmp_path):
    big = 2 * _ram_gib() / 0.8 + 1
    proc, _ = _cli("--gpus", "2", "--steps", "1", "--device-mem-gib", f"{big:.0f}",
                   "--trace", str(tmp_path / "t.jsonl"))
    line = _one_line(proc.stderr)
    assert proc.returncode == 2, proc.stderr
    assert line.startswith("colo demo: worker rank ") and "failed start: EngineRefused: " in line
    assert "engine refused its build: " in line
    assert f"more than this machine's {_ram_gib():.1f} GiB of memory" in line


@pytest.mark.parametrize("address", ["not a host:::", "localhost:0", "localhost:99999", "host:port", ":6379"])
def test_a_malformed_ray_address_is_one_line_exit_2_naming_it(tmp_path, capsys, address):
    pytest.importorskip("ray")
    rc = main(["demo", "--quiet", "--gpus", "2", "--launcher", "ray", "--address", address,
               "--trace", str(tmp_path / "t.jsonl")])
    line = _one_line(capsys.readouterr().err)
    assert rc == 2
    assert line.startswith(f"colo demo: --address {address!r} is not a Ray cluster address")
