"""Issue 6, bad input: each a clear error naming the thing and what was expected,
exit 2 at the command line, and nothing overwritten."""

import json
import os

import pytest
import torch

from colo.cli import main
from colo.core.config import SchedulerConfig
from colo.apps.demo import DemoConfig
from colo.extractors.plain import PlainExtractor
from colo.testing.trainers import StateTrainer
from colo.transports import make_transport
from tests.nodes import KINDS, identity, make_node

KEEP = '{"keep": "me"}\n'


@pytest.mark.parametrize("argv,msg", [
    (["--mem-fraction-static", "0"], "expected a number in (0, 1), got 0"),
    (["--mem-fraction-static", "1"], "expected a number in (0, 1), got 1"),
    (["--mem-fraction-static", "1.5"], "expected a number in (0, 1), got 1.5"),
    (["--bucket-mib", "0"], "expected a positive float, got 0"),
    (["--bucket-mib", "1e-30"], "expected a float of at least 0.01 and at most 1048576, got 1e-30"),
    (["--bucket-mib", "-4"], "expected a positive float, got -4"),
    # integers in ASCII digits only (Python's int() takes ' 3', '1_0' and other scripts' digits)
    (["--steps", " 3"], "argument --steps: expected a positive int in ASCII digits, got ' 3'"),
    (["--steps", "\u0661"], "argument --steps: expected a positive int in ASCII digits, got '\u0661'"),
    (["--steps", "1_0"], "argument --steps: expected a positive int in ASCII digits, got '1_0'"),
    (["--seed", "\uff17"], "argument --seed: expected a number, got '\uff17'"),
    (["--bucket-mib", "\u0661"], "argument --bucket-mib: expected a positive float in ASCII digits, got '\u0661'"),
    (["--plan", "fast"], "invalid choice: 'fast'"),
    (["--transport", "pigeon"], "invalid choice: 'pigeon'"),
    (["--fault", "explode@sync"], "unknown fault kind 'explode'; expected one of kill-engine, raise"),
    (["--fault", "raise@synk"], "unknown fault phase 'synk'; expected one of rollout"),
    (["--fault", "oom@train"], "fault oom cannot happen at train; oom is possible at trainer_onload"),
    (["--lora-rank", "0"], "argument --lora-rank: expected a positive int"),
    (["--lora-rank", "513"], "argument --lora-rank: expected a positive int of at most 512, got 513"),
    (["--lora-rank", "8", "--trainer", "fsdp"], "--lora-rank trains a PEFT adapter on the hf trainer, got "
                                                "--trainer fsdp"),
    (["--keep-adapters", "0"], "argument --keep-adapters: expected a positive int"),
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
    (dict(bucket_mib=0), "bucket size must be at least 0.01 MiB, got 0"),
    (dict(bucket_mib=-1.0), "bucket size must be at least 0.01 MiB, got -1"),
    (dict(bucket_mib=1e-30), "bucket size must be at least 0.01 MiB, got 1e-30"),
    (dict(phase_deadline_s=1e-300), "--phase-deadline must be a finite number of seconds of at least 1, got 1e-300"),
    (dict(trace=""), "--trace is empty; expected a file path"),
    (dict(engine_log=""), "--engine-log is empty; expected a file path, or - for the console"),
    (dict(mem_fraction_static=0.0), "mem_fraction_static must be in (0, 1), got 0.0"),
    (dict(mem_fraction_static=1.0), "mem_fraction_static must be in (0, 1), got 1.0"),
    (dict(plan="fast"), "plan must be one of offload-first, sync-first, single-stage, got 'fast'"),
    (dict(transport="pigeon"), "transport must be one of packed, ipc, broadcast, disk, rdt, sglang, got 'pigeon'"),
    (dict(fault="raise"), "fault must be KIND@PHASE"),
    (dict(fault="deadline@sync", fault_deadline_s=0), "fault deadline must be > 0 seconds, got 0"),
    (dict(lora_rank=8, engine="vllm", trainer="megatron"), "--lora-rank trains a PEFT adapter on the hf trainer, "
                                                           "got --trainer megatron"),
    (dict(lora_rank=8, gpus=2), "--lora-rank on N ranks stages the whole adapter into a whole engine per rank"),
    (dict(lora_rank=8, engine="vllm", gpus=2, engine_layout="tp"), "--engine vllm in the tp layout would need each "
                                                                  "adapter's shard"),
    (dict(lora_rank=8, engine="vllm", trainer_dtype="bfloat16"), "--lora-rank trains in float32 on the CPU"),
    (dict(lora_rank=True, engine="vllm"), "--lora-rank must be an integer in [1, 512], got True"),
    (dict(lora_rank=8, engine="vllm", keep_adapters=0), "--keep-adapters must be an integer in [1, 64], got 0"),
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


async def test_an_empty_model_is_refused_before_anything_moves():
    class NoEngine:
        def __getattr__(self, name):
            raise AssertionError(f"the engine was called ({name}) for an empty model")

    with pytest.raises(ValueError, match=r"the trainer has no parameters to sync \(empty model\)"):
        await make_transport("packed").sync(StateTrainer({}), NoEngine(), None)


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


def test_host_tensors_beside_the_upload_devices_own_are_one_bucket_and_a_third_device_is_not():
    # a one-rank Megatron trainer's paused source: views of its host backup, uploaded into the
    # buffer on the GPU, beside q/k/v re-ordered on that GPU (stand-ins: no GPU here)
    from types import SimpleNamespace

    import torch

    from colo.core.buckets import plan_buckets, spec
    from colo.transports.base import check_bucket_tensors

    def on(device):
        return SimpleNamespace(device=torch.device(device), dtype=torch.float32, shape=torch.Size([4]))

    bucket = plan_buckets([spec("a", (4,), "float32"), spec("b", (4,), "float32")], 1 << 20)[0]
    check_bucket_tensors(bucket, [("a", on("cpu")), ("b", on("cuda:0"))], upload_to=torch.device("cuda:0"))
    with pytest.raises(ValueError, match=r"one device with data, got a on cpu, b on cuda:1"):
        check_bucket_tensors(bucket, [("a", on("cpu")), ("b", on("cuda:1"))], upload_to=torch.device("cuda:0"))
    with pytest.raises(ValueError, match=r"one device with data, got a on cpu, b on cuda:0"):
        check_bucket_tensors(bucket, [("a", on("cpu")), ("b", on("cuda:0"))])


def test_python_dash_m_cli_reports_usage_errors_with_exit_two(tmp_path):
    import subprocess
    import sys

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    proc = subprocess.run([sys.executable, "-m", "colo.cli", "replay", str(empty)], capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr


# -- issue 16, item 5: every float flag, infeasible devices, unwritable outputs ---------------

#: every float flag of every subcommand, with the least argv that reaches its parsing
FLOAT_FLAGS = [("demo", "--bucket-mib"), ("demo", "--mem-fraction-static"), ("demo", "--device-mem-gib"),
               ("demo", "--phase-deadline"), ("tune", "--margin-gib"), ("tune", "--gpu-gib"),
               ("tune", "--model-gib"), ("tune", "--bucket-mib")]


def _no_work(monkeypatch):
    """Fail the test if a demo or a benchmark gets as far as starting anything."""
    from colo.apps import bench, demo

    def refuse(*a, **k):
        raise AssertionError("work started for a bad input")

    monkeypatch.setattr(demo.DemoRun, "start", refuse)
    monkeypatch.setattr(demo, "build_trainer", refuse)
    monkeypatch.setattr(bench, "bench", refuse)
    monkeypatch.setattr(bench, "measure_limits", refuse)


def _exit_code(argv):
    try:
        return main(argv)
    except SystemExit as e:  # argparse's own errors
        return e.code


@pytest.mark.parametrize("value", ["1e308", "inf", "-inf", "nan"])
@pytest.mark.parametrize("command,flag", FLOAT_FLAGS, ids=[f"{c}{f}" for c, f in FLOAT_FLAGS])
def test_every_float_flag_refuses_absurd_and_non_finite_numbers(command, flag, value, tmp_path, monkeypatch,
                                                              capsys):
    _no_work(monkeypatch)
    trace = tmp_path / "t.jsonl"
    extra = ["--quiet", "--trace", str(trace)] if command == "demo" else ["--json"]
    assert _exit_code([command, *extra, f"{flag}={value}"]) == 2
    assert f"argument {flag}:" in capsys.readouterr().err
    assert not trace.exists()


@pytest.mark.parametrize("argv,msg", [
    (["--mem-fraction-static", "0.0000001"], "--mem-fraction-static 1e-07 on a 256.00 MiB device: "
                                             "mem_fraction_static 1e-07 of 268435456 bytes"),
    # the CPU demo's fp32 engine: weights 11.0 MiB + one 256-token sequence of 4 KiB slots = 12.0 MiB
    # = 0.0469 of 256 MiB; 0.045 leaves room for 128 slots
    (["--mem-fraction-static", "0.045"], "--mem-fraction-static 0.045 on a 256.00 MiB device: KV pool budget"),
    (["--device-mem-gib", "0.03"], "--device-mem-gib 0.03 is too small for the engine: reserved memory "
                                   "32.00 MiB leaves nothing of a 30.72 MiB device"),
    (["--device-mem-gib", "0.007"], "--device-mem-gib 0.007 is too small for the engine: reserved memory "
                                    "32.00 MiB leaves nothing of a 7.17 MiB device"),
])
def test_a_demo_the_device_cannot_hold_is_refused_before_any_work(argv, msg, tmp_path, monkeypatch, capsys):
    import psutil

    _no_work(monkeypatch)
    trace = tmp_path / "t.jsonl"
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    assert main(["demo", "--quiet", "--trace", str(trace), *argv]) == 2
    assert msg in capsys.readouterr().err
    assert not trace.exists()
    assert {c.pid for c in psutil.Process().children(recursive=True)} <= before  # no engine process


def test_demo_config_refuses_non_finite_and_absurd_sizes():
    for kw in (dict(bucket_mib=float("inf")), dict(bucket_mib=float("nan")), dict(device_mem_gib=float("inf")),
               dict(reserved_mib=float("nan")), dict(trainer_leftover_mib=float("inf"))):
        with pytest.raises(ValueError, match="must be a finite number"):
            DemoConfig(**kw)
    with pytest.raises(ValueError, match="bucket size must be at most 1048576 MiB, got 1e\\+308"):
        DemoConfig(bucket_mib=1e308)


@pytest.mark.parametrize("out,msg", [
    ("{tmp}/fulldev", "--out {tmp}/fulldev is not a regular file (a character device)"),
    ("{tmp}/a-file/out.json", "--out {tmp}/a-file/out.json: cannot write in {tmp}/a-file"),
    ("{tmp}", "is not a regular file"),
])
def test_bench_refuses_an_output_it_cannot_write_before_it_runs(out, msg, tmp_path, monkeypatch, capsys):
    _no_work(monkeypatch)
    (tmp_path / "a-file").write_text("x")
    if "fulldev" in out:
        make_node(tmp_path / "fulldev", "chardev", tmp_path)  # a private /dev/full, never the system's
    out, msg = out.format(tmp=tmp_path), msg.format(tmp=tmp_path)
    assert main(["bench", "--device", "cpu", "--transports", "packed", "--out", out]) == 2
    assert msg in capsys.readouterr().err
    if "fulldev" in out:
        assert not os.path.isfile(out)  # never replaced by the result


def test_bench_that_cannot_write_its_result_after_the_run_exits_one_with_a_message(tmp_path, monkeypatch,
                                                                                   capsys):
    import errno

    from colo.apps import bench

    async def fake_bench(models, cases, **kw):
        return {"models": []}

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(bench, "bench", fake_bench)
    monkeypatch.setattr(bench, "write_result", full)
    assert main(["bench", "--device", "cpu", "--transports", "packed", "--out", str(tmp_path / "r.json")]) == 1
    err = capsys.readouterr().err
    assert "could not write the result to" in err and "No space left on device" in err


# -- issue 32, item 9: inputs that were taken and should not be ---------------------------

@pytest.mark.parametrize("argv,msg", [
    (["demo", "--bucket-mib", "1e-30"], "argument --bucket-mib: expected a float of at least 0.01"),
    (["bench", "--bucket-mib", "1e-30"], "argument --bucket-mib: expected a float of at least 0.01"),
    (["tune", "--gpu-gib", "80", "--model-gib", "1e-300"], "argument --model-gib: expected a float of at least 0.001"),
    (["tune", "--gpu-gib", "80", "--model-gib", "1", "--bucket-mib", "1e-30"],
     "argument --bucket-mib: expected a float of at least 0.01"),
    # before: taken, and the first phase failed at once, after the whole start-up
    (["demo", "--phase-deadline", "1e-300"], "argument --phase-deadline: expected a float of at least 1 "),
    (["demo", "--phase-deadline", "0.5"], "argument --phase-deadline: expected a float of at least 1 "),
])
def test_sizes_below_a_sane_least_are_refused(argv, msg, tmp_path, monkeypatch, capsys):
    """Before: --bucket-mib 1e-30 ran one-byte buckets (past 180 s for one step), and
    tune --model-gib 1e-300 recommended a one-byte bucket."""
    _no_work(monkeypatch)
    monkeypatch.chdir(tmp_path)
    assert _exit_code(argv) == 2
    out = capsys.readouterr()
    assert msg in out.err and "Traceback" not in out.err and out.out == ""
    assert os.listdir(tmp_path) == []


def test_the_library_refuses_the_same_sizes():
    from colo.apps.bench import BenchModel
    from colo.offline.tune import WhatIf

    with pytest.raises(ValueError, match="model_gib must be at least 0.001, got 1e-300"):
        WhatIf(gpu_gib=80, model_gib=1e-300)
    with pytest.raises(ValueError, match="bucket_mib must be at least 0.01, got 1e-30"):
        WhatIf(gpu_gib=80, model_gib=1, bucket_mib=1e-30)
    with pytest.raises(ValueError, match="bucket_mib must be at least 0.01"):
        BenchModel(name="m", description="", config={}, bucket_mib=1e-30, repeat=1)
    # the least sizes themselves are taken, and tune's bucket is then a real one
    assert WhatIf(gpu_gib=80, model_gib=0.001, bucket_mib=0.01).model_gib == 0.001


def test_bench_multi_gpu_refuses_a_tiny_bucket(capsys):
    import bench.multi_gpu as multi

    assert multi.main(["--device", "cpu", "--gpus", "2", "--model", "tiny", "--bucket-mib", "1e-30"]) == 2
    assert "--bucket-mib must be a finite number of at least 0.01, got 1e-30" in capsys.readouterr().err


def test_an_empty_trace_path_is_refused_not_taken_for_the_default(tmp_path, monkeypatch, capsys):
    """Before: --trace '' wrote traces/demo-offload-first.jsonl."""
    _no_work(monkeypatch)
    monkeypatch.chdir(tmp_path)
    for flag in ("--trace", "--engine-log"):
        assert main(["demo", "--quiet", "--steps", "1", flag, ""]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"colo demo: {flag} is empty; expected a file path") and len(err.splitlines()) == 1
    assert os.listdir(tmp_path) == []


def _children():
    import psutil

    return {c.pid for c in psutil.Process().children(recursive=True)}


@pytest.mark.parametrize("gpus", [1, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_a_trace_that_is_not_a_new_path_or_a_regular_file_is_refused_with_any_number_of_ranks(
        kind, gpus, tmp_path, capsys):
    """Before: with --gpus 2 a device given as the trace had run.rank0.jsonl made beside it
    (/dev/full.rank0.jsonl), and with one rank the refusal came as a run's failed summary."""
    trace = tmp_path / "run"
    make_node(trace, kind, tmp_path)
    before, names, children = identity(trace), sorted(os.listdir(tmp_path)), _children()
    rc = main(["demo", "--quiet", "--steps", "1", "--gpus", str(gpus), "--trace", str(trace)])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and "Traceback" not in err
    assert err.startswith(f"colo demo: --trace {trace} is ") and len(err.splitlines()) == 1, err
    assert "expected a new path or an existing regular file" in err
    assert identity(trace) == before and sorted(os.listdir(tmp_path)) == names  # nothing made beside it
    assert _children() <= children  # nothing started


@pytest.mark.parametrize("planted", ["run.rank1.jsonl", "run.rank0.engine.log", "run.engine.log"])
def test_a_symlink_where_colo_derives_a_path_is_refused_and_its_target_untouched(planted, tmp_path, capsys):
    """A rank's trace and the engine's log are paths colo derives from --trace: a link planted
    there is nobody's request. Before: the engine log's was truncated through the link."""
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    os.symlink(victim, tmp_path / planted)
    gpus = "1" if planted == "run.engine.log" else "2"
    children = _children()
    rc = main(["demo", "--quiet", "--steps", "1", "--gpus", gpus, "--trace", str(tmp_path / "run.jsonl")])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and len(err.splitlines()) == 1, out + err
    assert f"{tmp_path / planted} is a symbolic link colo did not ask for" in err
    assert victim.read_text() == "precious\n" and os.path.islink(tmp_path / planted)
    assert sorted(os.listdir(tmp_path)) == sorted([planted, "victim"])
    assert _children() <= children
