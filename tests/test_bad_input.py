"""Issue 6, bad input: each a clear error naming the thing and what was expected,
exit 2 at the command line, and nothing overwritten."""

import json

import pytest
import torch

from colo.cli import main
from colo.core.config import SchedulerConfig
from colo.apps.demo import DemoConfig
from colo.extractors.plain import PlainExtractor
from colo.transports import make_transport

KEEP = '{"keep": "me"}\n'


@pytest.mark.parametrize("argv,msg", [
    (["--mem-fraction-static", "0"], "expected a number in (0, 1), got 0"),
    (["--mem-fraction-static", "1"], "expected a number in (0, 1), got 1"),
    (["--mem-fraction-static", "1.5"], "expected a number in (0, 1), got 1.5"),
    (["--bucket-mib", "0"], "expected a positive float, got 0"),
    (["--bucket-mib", "-4"], "expected a positive float, got -4"),
    (["--plan", "fast"], "invalid choice: 'fast'"),
    (["--transport", "pigeon"], "invalid choice: 'pigeon'"),
    (["--fault", "explode@sync"], "unknown fault kind 'explode'; expected one of kill-engine, raise"),
    (["--fault", "raise@synk"], "unknown fault phase 'synk'; expected one of rollout"),
    (["--fault", "oom@train"], "fault oom cannot happen at train; oom is possible at trainer_onload"),
])
def test_cli_demo_bad_input_exits_two_and_leaves_the_trace_untouched(argv, msg, tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text(KEEP)
    code = (lambda: main(["demo", "--quiet", "--trace", str(trace), *argv]))
    try:
        rc = code()
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    assert rc == 2
    assert msg in capsys.readouterr().err
    assert trace.read_text() == KEEP


@pytest.mark.parametrize("kw,msg", [
    (dict(bucket_mib=0), "bucket size must be > 0 MiB, got 0"),
    (dict(bucket_mib=-1.0), "bucket size must be > 0 MiB, got -1.0"),
    (dict(mem_fraction_static=0.0), "mem_fraction_static must be in (0, 1), got 0.0"),
    (dict(mem_fraction_static=1.0), "mem_fraction_static must be in (0, 1), got 1.0"),
    (dict(plan="fast"), "plan must be one of offload-first, sync-first, single-stage, got 'fast'"),
    (dict(transport="pigeon"), "transport must be one of packed, ipc, broadcast, disk, got 'pigeon'"),
    (dict(fault="raise"), "fault must be KIND@PHASE"),
    (dict(fault="deadline@sync", fault_deadline_s=0), "fault deadline must be > 0 seconds, got 0"),
])
def test_demo_config_refuses_bad_values(kw, msg):
    with pytest.raises(ValueError) as ei:
        DemoConfig(**kw)
    assert msg in str(ei.value)


@pytest.mark.parametrize("kw,msg", [
    (dict(bucket_bytes=0), "bucket_bytes must be a positive integer, got 0"),
    (dict(bucket_bytes=-1), "bucket_bytes must be a positive integer, got -1"),
    (dict(plan="fast"), "plan must be one of"),
    (dict(deadlines={"synk": 1.0}), "unknown phase 'synk'"),
])
def test_scheduler_config_refuses_bad_values(kw, msg):
    with pytest.raises(ValueError, match=msg):
        SchedulerConfig(**kw)


def test_an_unknown_transport_is_named():
    with pytest.raises(Exception) as ei:
        make_transport("pigeon")
    assert "pigeon" in str(ei.value)


class _Empty:
    def extractor(self):
        return PlainExtractor({})


async def test_an_empty_model_is_refused_before_anything_moves():
    class NoEngine:
        def __getattr__(self, name):
            raise AssertionError(f"the engine was called ({name}) for an empty model")

    with pytest.raises(ValueError, match=r"the trainer has no parameters to sync \(empty model\)"):
        await make_transport("packed").sync(_Empty(), NoEngine(), None)


def test_a_non_contiguous_trainer_tensor_is_extracted_contiguous_with_its_values():
    src = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()  # a transposed view
    assert not src.is_contiguous()
    [(name, t)] = list(PlainExtractor({"w": src}).extract(["w"]))
    assert name == "w" and t.is_contiguous() and torch.equal(t, src)


# -- traces -----------------------------------------------------------------------

def _trace(tmp_path, lines, name="t.jsonl", mode="w"):
    p = tmp_path / name
    if isinstance(lines, bytes):
        p.write_bytes(lines)
    else:
        p.write_text("".join(json.dumps(x) + "\n" if isinstance(x, dict) else x for x in lines))
    return p


HEAD = {"event": "trace.started", "schema": "colo.trace/1", "ts": 0.0, "rank": 0, "world_size": 1,
        "device": {"kind": "cpu", "name": "x", "total_bytes": 1 << 30}, "config": {}}
ENTER = {"event": "phase.entered", "ts": 0.1, "rank": 0, "step": 0, "from_phase": None,
         "to_phase": "engine_release", "mem": {"used": 0, "total": 1 << 30, "by_tag": {}}}
DONE = {"event": "phase.finished", "ts": 0.2, "rank": 0, "step": 0, "phase": "engine_release",
        "duration_s": 0.1, "mem": {"used": 0, "total": 1 << 30, "by_tag": {}}}
END = {"event": "trace.finished", "ts": 0.3, "rank": 0}


@pytest.mark.parametrize("lines,msg", [
    ([HEAD, "not json at all\n", DONE, END], "line 2"),
    ([{**HEAD, "schema": "colo.trace/0"}, END], "schema 'colo.trace/0'; expected 'colo.trace/1'"),
    ([{k: v for k, v in HEAD.items() if k != "schema"}, END], "trace.started has no schema"),
    (b"\x00\x01\x02\xff\xfe binary\n", "binary content (NUL bytes); expected colo.trace/1 JSON lines"),
    ([HEAD, {**ENTER, "to_phase": "warp"}, END], "line 2: phase.entered has to_phase"),
])
def test_replay_of_a_bad_trace_exits_two_naming_the_line(lines, msg, tmp_path, capsys):
    p = _trace(tmp_path, lines)
    before = p.read_bytes()
    assert main(["replay", str(p)]) == 2
    assert msg in capsys.readouterr().err
    assert p.read_bytes() == before


def test_a_trace_cut_off_by_a_crash_replays_up_to_its_last_complete_line(tmp_path, capsys):
    p = _trace(tmp_path, [HEAD, ENTER, DONE, json.dumps(END)[:12]])
    assert main(["replay", "--json", str(p)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["valid"] is True
    assert any("line 4 is cut off" in w for w in out["warnings"])


def test_a_bucket_with_a_wrong_device_tensor_is_refused_by_name():
    import torch

    from colo.core.buckets import plan_buckets, spec
    from colo.transports.base import check_bucket_tensors

    a = torch.zeros(4)
    b = torch.empty(4, device="meta")  # no GPU here: the meta device stands for "elsewhere"
    bucket = plan_buckets([spec("a", (4,), "float32"), spec("b", (4,), "float32")], 1 << 20)[0]
    with pytest.raises(ValueError, match=r"tensors must be on one device with data, got a on cpu, b on meta"):
        check_bucket_tensors(bucket, [("a", a), ("b", b)])


def test_python_dash_m_cli_reports_usage_errors_with_exit_two(tmp_path):
    import subprocess
    import sys

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    proc = subprocess.run([sys.executable, "-m", "colo.cli", "replay", str(empty)], capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
