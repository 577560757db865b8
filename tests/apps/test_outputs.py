"""Issue 16: outputs a run owns (trace, results) are not clobbered, and a recovered
fault does not change what the run learns."""

from __future__ import annotations

import datetime as dt
import importlib.util
import json
import os
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import anyio
import anyio.to_thread
import pytest
import torch

import colo.apps.bench as bench
import colo.apps.demo as demo
from colo.apps.demo import DemoConfig, run
from colo.core.interfaces import RolloutResult
from colo.core.errors import EXIT_BAD_INPUT, UsageError
from colo.trainers.models import build_trainer_model, demo_config
from colo.trace.writer import TraceWriter, read_trace
from colo.trainers.hf import ReferenceTrainer
from tests.conftest import fixed_batch as shared_fixed_batch
from tests.waits import CEILING_S

ROOT = Path(__file__).resolve().parents[2]


# -- item 2: one trace file, one writer ---------------------------------------------

def test_a_second_writer_of_a_trace_is_refused_naming_the_first_and_leaves_it_untouched(tmp_path):
    path = tmp_path / "run.jsonl"
    first = TraceWriter(path)
    first.start(device={"kind": "cpu"}, config={"who": "first"})
    first.emit("phase.entered", step=0, from_phase=None, to_phase="rollout", mem={})
    before = path.read_bytes()
    assert sorted(os.listdir(tmp_path)) == ["run.jsonl"]  # the lock is the trace's own: no file beside it

    second = TraceWriter(path)
    with pytest.raises(UsageError, match=rf"trace {path} is being written by another run \(pid {os.getpid()}\)") \
            as err:
        second.start(device={"kind": "cpu"}, config={"who": "second"})
    assert err.value.exit_code == EXIT_BAD_INPUT
    assert path.read_bytes() == before
    second.finish()  # never started: nothing to finish, nothing written

    first.finish()
    events = read_trace(path)
    assert [e["event"] for e in events] == ["trace.started", "phase.entered", "trace.finished"]
    assert events[0]["config"] == {"who": "first"}
    assert sorted(os.listdir(tmp_path)) == ["run.jsonl"]

    # finished: the path is free again, and the next writer owns it from scratch
    third = TraceWriter(path)
    third.start(device={"kind": "cpu"}, config={"who": "third"})
    third.finish()
    assert [e["config"] for e in read_trace(path) if e["event"] == "trace.started"] == [{"who": "third"}]


def test_a_lock_file_left_by_a_crashed_run_does_not_block_the_next(tmp_path):
    # an older colo kept its lock in <trace>.lock and a crashed run left it: it blocks
    # nothing, and is not colo's to touch any more
    path = tmp_path / "run.jsonl"
    (tmp_path / "run.jsonl.lock").write_text("999999999\n")  # nobody holds the flock
    w = TraceWriter(path)
    w.start(device={}, config={})
    w.finish()
    assert [e["event"] for e in read_trace(path)] == ["trace.started", "trace.finished"]
    assert (tmp_path / "run.jsonl.lock").read_text() == "999999999\n"


# -- issue 32, item 2: the lock is the file's own, and nothing of it outlives the run -----

def _start(path, **kw):
    w = TraceWriter(path, **kw)
    w.start(device={"kind": "cpu"}, config={})
    return w


def test_a_planted_lock_symlink_is_neither_followed_nor_truncated(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    os.symlink(victim, tmp_path / "run.jsonl.lock")  # a link the run never asked for
    w = _start(tmp_path / "run.jsonl")
    w.finish()
    assert victim.read_text() == "precious\n"
    assert os.readlink(tmp_path / "run.jsonl.lock") == str(victim)
    assert [e["event"] for e in read_trace(tmp_path / "run.jsonl")] == ["trace.started", "trace.finished"]


@pytest.mark.parametrize("spelling", ["symlink", "hard link"])
def test_two_writers_of_one_file_under_two_names_are_refused(spelling, tmp_path):
    """The lock is the opened file's (device and inode), not the path's spelling."""
    a = tmp_path / "a.jsonl"
    first = _start(a)
    first.emit("phase.entered", step=0, from_phase=None, to_phase="rollout", mem={})
    before = a.read_bytes()
    other = tmp_path / "sym.jsonl"
    (os.symlink if spelling == "symlink" else os.link)(a, other)
    with pytest.raises(UsageError, match=rf"trace {other} is being written by another run \(pid {os.getpid()}\)") \
            as err:
        _start(other)
    assert err.value.exit_code == EXIT_BAD_INPUT
    assert a.read_bytes() == before
    first.finish()
    assert [e["event"] for e in read_trace(a)] == ["trace.started", "phase.entered", "trace.finished"]


def test_a_rank_trace_colo_derives_is_never_opened_through_a_symlink(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    os.symlink(victim, tmp_path / "run.rank1.jsonl")
    w = TraceWriter(tmp_path / "run.rank1.jsonl", rank=1, world_size=2, follow_symlinks=False)
    with pytest.raises(UsageError, match="is a symbolic link colo did not ask for"):
        w.start(device={}, config={})
    w.finish()
    assert victim.read_text() == "precious\n" and os.path.islink(tmp_path / "run.rank1.jsonl")


def test_no_lock_file_is_left_after_sigkill_and_the_next_run_is_not_blocked(tmp_path):
    import signal
    import subprocess

    path = tmp_path / "run.jsonl"
    code = ("import sys, time\nfrom colo.trace.writer import TraceWriter\n"
            f"w = TraceWriter({str(path)!r}); w.start(device={{}}, config={{}})\n"
            "print('started', flush=True); time.sleep(3600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert proc.stdout.readline().strip() == "started"
        with pytest.raises(UsageError, match=rf"being written by another run \(pid {proc.pid}\)"):
            _start(path)
        proc.send_signal(signal.SIGKILL)
        proc.wait(CEILING_S)
    finally:
        proc.kill()
        proc.wait()
    assert sorted(os.listdir(tmp_path)) == ["run.jsonl"]  # the kernel dropped the lock with the process
    _start(path).finish()
    assert [e["event"] for e in read_trace(path)] == ["trace.started", "trace.finished"]


def test_a_failed_open_leaves_nothing_beside_the_path(tmp_path):
    (tmp_path / "d.jsonl").mkdir()
    w = TraceWriter(tmp_path / "d.jsonl")
    with pytest.raises(UsageError, match=r"trace .*d\.jsonl is not a regular file \(a directory\)"):
        w.start(device={}, config={})
    w.finish()
    assert sorted(os.listdir(tmp_path)) == ["d.jsonl"]


def test_a_disk_full_at_start_leaves_nothing_and_an_old_trace_as_it_was(tmp_path):
    from colo.core.errors import TraceUnwritable
    from tests.fulldisk import small_disk

    with small_disk(tmp_path / "disk", size_kib=64) as disk:
        w = TraceWriter(disk / "run.jsonl")
        with pytest.raises(TraceUnwritable, match=rf"cannot write the trace {disk}/run\.jsonl: No space left"):
            w.start(device={}, config={})
        w.finish()
        assert sorted(os.listdir(disk)) == ["filler"]  # neither a .lock nor an empty trace


# -- item 7: default result paths never overwrite -------------------------------------

def test_bench_default_out_never_overwrites_an_existing_result(tmp_path, monkeypatch, capsys):
    results = tmp_path / "results"
    results.mkdir()
    name = f"cpu-sync-{dt.date.today().isoformat()}"
    committed = results / f"{name}.json"
    committed.write_bytes(b'{"committed": true}\n')
    (results / f"{name}-2.json").write_bytes(b'{"committed": 2}\n')
    monkeypatch.setattr(bench, "RESULTS_DIR", results)

    async def fake_bench(models, cases, **kw):
        return {"models": [], "made_by": "this test"}

    monkeypatch.setattr(bench, "bench", fake_bench)
    monkeypatch.setattr(bench, "table", lambda result: "")
    args = SimpleNamespace(device="cpu", out=None, models=None, transports="packed", model=None, reps=None)
    monkeypatch.setattr(bench, "_choose", lambda a: ([], []))
    assert bench.run_bench(args) == 0
    assert committed.read_bytes() == b'{"committed": true}\n'
    assert (results / f"{name}-2.json").read_bytes() == b'{"committed": 2}\n'
    new = results / f"{name}-3.json"
    assert json.loads(new.read_text()) == {"models": [], "made_by": "this test"}
    assert f"results: {new}" in capsys.readouterr().out
    assert sorted(p.name for p in results.iterdir()) == sorted([f"{name}.json", f"{name}-2.json", f"{name}-3.json"])


def test_write_result_replaces_an_explicit_out_whole(tmp_path):
    out = tmp_path / "mine.json"
    out.write_text("old")
    assert bench.write_result("new\n", out=out, directory=tmp_path / "unused", stem="x") == out
    assert out.read_text() == "new\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.json"]  # no temp file left


def test_soak_default_out_never_overwrites_an_existing_result(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("soak_under_test", ROOT / "bench" / "soak.py")
    soak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(soak)
    results = tmp_path / "results"
    results.mkdir()
    name = f"soak-cpu-{dt.date.today().isoformat()}"
    committed = results / f"{name}.json"
    committed.write_bytes(b"committed soak\n")
    monkeypatch.setattr(soak, "RESULTS_DIR", str(results))
    fake = {"error": None, "cycles_verified": 3, "rss_growth_pct": 0.0, "fds_end": 1, "fds_after_warmup": 1,
            "shm_end": 0, "shm_after_warmup": 0, "samples": {}}
    monkeypatch.setattr(soak, "soak", lambda cycles, warmup, trace: fake)
    monkeypatch.setattr(sys, "argv", ["soak.py", "--cycles", "3", "--warmup", "1"])
    assert soak.main() == 0
    assert committed.read_bytes() == b"committed soak\n"
    assert json.loads((results / f"{name}-2.json").read_text()) == fake
    assert sorted(p.name for p in results.iterdir()) == sorted([f"{name}.json", f"{name}-2.json"])


# -- item 10: a recovered fault does not change the math ---------------------------------

def fixed_batch(config, seed=1):
    return shared_fixed_batch(config, seed=seed, batch=4, prompt_len=4, new_tokens=6)


def test_a_step_that_fails_half_way_rolls_the_trainer_back():
    config = demo_config(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64)
    trainer = ReferenceTrainer(build_trainer_model(config, seed=0), engine_dtype="float32")
    trainer._reinforce(fixed_batch(config, seed=1))  # AdamW state exists now
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    state = {id(p): {k: v.clone() for k, v in st.items()} for p, st in trainer.opt.state.items()}
    real_step = trainer.opt.step

    def step_then_raise(*a, **kw):
        real_step(*a, **kw)  # the weights and the moments have moved
        raise RuntimeError("failed after the optimizer step")

    trainer.opt.step = step_then_raise
    with pytest.raises(RuntimeError, match="failed after the optimizer step"):
        trainer._reinforce(fixed_batch(config, seed=2))
    assert trainer.steps == 1
    for n, p in trainer.model.named_parameters():
        assert torch.equal(p.detach(), params[n]), n
        assert p.grad is None
        st = trainer.opt.state[p]
        assert st.keys() == state[id(p)].keys() and all(torch.equal(st[k], state[id(p)][k]) for k in st), n
    assert float(trainer.opt.state[next(trainer.model.parameters())]["step"]) == 1.0

    # and the next step is the step an unfailed trainer takes
    del trainer.opt.step
    twin = ReferenceTrainer(build_trainer_model(config, seed=0), engine_dtype="float32")
    twin._reinforce(fixed_batch(config, seed=1))
    trainer._reinforce(fixed_batch(config, seed=2))
    twin._reinforce(fixed_batch(config, seed=2))
    assert trainer.steps == twin.steps == 2
    for (n, a), (_, b) in zip(trainer.model.named_parameters(), twin.model.named_parameters()):
        assert torch.equal(a, b), n


async def demo_run(tmp_path, monkeypatch, fault):
    steps_seen = []
    real_outcome = demo.DemoRun.outcome

    def outcome(self):
        steps_seen.append(self.trainer.steps)
        return real_outcome(self)

    monkeypatch.setattr(demo.DemoRun, "outcome", outcome)
    out = await run(DemoConfig(steps=3, seed=5, batch=4, new_tokens=4, fault=fault,
                               trace=str(tmp_path / f"{fault or 'clean'}.jsonl")), progress=False)
    assert out.error is None, out.error
    return out, steps_seen[0]


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    import anyio

    mp = pytest.MonkeyPatch()
    try:
        return anyio.run(demo_run, tmp_path_factory.mktemp("clean"), mp, None)
    finally:
        mp.undo()


@pytest.mark.parametrize("fault", ["raise@sync", "raise@train"])
async def test_a_recovered_fault_trains_exactly_steps_times_to_the_same_weights(fault, tmp_path, monkeypatch,
                                                                             clean_run):
    clean, clean_steps = clean_run
    out, steps = await demo_run(tmp_path, monkeypatch, fault)
    [rec] = out.recoveries
    assert rec.recovered and rec.phase == fault.split("@")[1]
    assert clean_steps == steps == 3
    assert len(out.rewards) == len(clean.rewards) == 3
    assert out.rewards == clean.rewards
    assert out.trainer_digest is not None and out.trainer_digest == clean.trainer_digest
    trains = [e for e in read_trace(out.trace_path) if e["event"] == "phase.finished" and e["phase"] == "train"]
    assert len(trains) == 3


async def test_every_train_step_runs_on_the_trainers_one_thread_whatever_else_uses_worker_threads():
    # cuBLAS keeps a handle and a workspace per thread for the life of the process:
    # a step on a new worker thread grows device memory (96 MiB on an H100)
    config = demo_config(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64)
    trainer = ReferenceTrainer(build_trainer_model(config, seed=0), engine_dtype="float32")
    seen: list[int] = []
    real = trainer._reinforce

    def reinforce(data):
        seen.append(threading.get_ident())
        return real(data)

    trainer._reinforce = reinforce
    gate = threading.Event()
    try:
        for step in range(4):
            # worker threads busy elsewhere (as the sync's gather and settle are):
            # the pool must grow, and the step must still land on the same thread
            async with anyio.create_task_group() as tg:
                for _ in range(step + 1):
                    tg.start_soon(anyio.to_thread.run_sync, gate.wait, 5)
                await anyio.sleep(0.01)
                await trainer.train_step(RolloutResult(reward=0.0, tokens=8, data=fixed_batch(config, seed=step)))
                gate.set()
            gate.clear()
    finally:
        gate.set()
        trainer.close()
    assert trainer.steps == 4 and len(seen) == 4
    assert len(set(seen)) == 1 and seen[0] != threading.get_ident()
    assert trainer._compute_thread is None  # close stopped it


# -- issue 32, item 11: a disk that fills is said, with where, and at once if it is full already --

def test_a_trace_disk_that_fills_mid_run_stops_it_naming_the_trace_the_step_and_the_phase(tmp_path, capsys):
    """Before: ENOSPC on the trace at step 3 was reported as "FAILED in phase start"."""
    import re

    from colo.cli import main
    from tests.fulldisk import small_disk

    # room for the start-up check (64 KiB) and a few of the demo's cycles (9 KiB each with the
    # CPU default's one-copy sync, 17 KiB with staged buckets)
    with small_disk(tmp_path / "disk", size_kib=256, free_kib=80) as disk:
        trace = disk / "run.jsonl"
        rc = main(["demo", "--quiet", "--steps", "20", "--trace", str(trace),
                   "--engine-log", str(tmp_path / "engine.log")])
        out, err = capsys.readouterr()
        assert rc == 1 and "Traceback" not in err
        failed = [line for line in out.splitlines() if line.startswith("FAILED")]
        assert len(failed) == 1, out
        m = re.fullmatch(rf"FAILED in phase (\w+) at step (\d+): TraceUnwritable: cannot write the trace "
                         rf"{re.escape(str(trace))}: No space left on device \(writing [a-z_.]+ at step \2 in "
                         rf"phase \1; the trace holds every line before it\)", failed[0])
        assert m, failed[0]
        assert int(m[2]) >= 1  # a step the run reached, not its start-up
        # what the disk took replays: every complete line, the cut one dropped with a warning
        capsys.readouterr()
        assert main(["replay", str(trace)]) == 0
        assert sorted(os.listdir(disk)) == ["filler", "run.jsonl"]


@pytest.mark.parametrize("gpus", [1, 2])
def test_a_trace_disk_full_from_the_start_is_said_before_anything_starts(gpus, tmp_path, monkeypatch, capsys):
    """Before: noticed only after the engine's start-up (7 s; 14 s with 2 ranks)."""

    from colo.apps.demo_multi import MultiDemoRun
    from colo.cli import main
    from colo.trace.writer import rank_path
    from tests.fulldisk import small_disk

    started: list[str] = []

    def record(what):
        def fn(*a, **k):
            started.append(what)
            raise RuntimeError(f"{what} started before the trace was found unwritable")
        return fn

    monkeypatch.setattr(demo, "build_trainer", record("trainer"))
    monkeypatch.setattr(MultiDemoRun, "_spawn_workers", record("workers"))
    with small_disk(tmp_path / "disk", size_kib=64) as disk:
        trace = disk / "run.jsonl"
        rc = main(["demo", "--quiet", "--gpus", str(gpus), "--trace", str(trace)])
        out, err = capsys.readouterr()
        assert rc == 1 and "Traceback" not in out + err
        assert (f"FAILED in phase start: TraceUnwritable: cannot write the trace {rank_path(trace, 0, gpus)}: "
                "No space left on device (checked before the run's start-up: a trace needs room for 64 KiB") in out
        assert started == []  # no start-up at all: not the trainer, not a worker
        assert sorted(os.listdir(disk)) == ["filler"]


@pytest.mark.parametrize("argv", [
    ["export", str(ROOT / "traces" / "cpu-demo.jsonl"), "-o", "{out}"],
    ["demo", "--quiet", "--trace", "{out}"],
    ["bench", "--transports", "packed", "--reps", "1", "--out", "{out}"],
], ids=["export", "demo", "bench"])
@pytest.mark.parametrize("out", ["/dev/stdout", "/dev/fd/1"])
def test_an_output_through_a_link_to_an_open_descriptor_is_refused_and_the_redirect_target_kept(argv, out, tmp_path):
    """Issue 45, item 4: ``-o /dev/stdout`` with stdout redirected to a file resolved to that
    file and replaced it by rename (a new inode): the redirect and colo's own status line went
    to the old one, unlinked. Now refused before anything is read or started."""
    import subprocess

    redirect = tmp_path / "stdout.txt"
    redirect.write_text("kept\n")
    inode = redirect.stat().st_ino
    with open(redirect, "a") as stdout:
        proc = subprocess.run([sys.executable, "-m", "colo.cli", *[a.format(out=out) for a in argv]], cwd=tmp_path,
                              stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=CEILING_S,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2, proc.stderr[-2000:]
    [line] = proc.stderr.strip().splitlines()
    assert f" {out} is a link to an open descriptor (/proc/" in line and "/fd/1); colo " in line, line
    assert redirect.stat().st_ino == inode and redirect.read_text() == "kept\n"
    assert not list(tmp_path.glob("colo-*"))


def test_an_engine_log_that_is_a_device_or_on_a_full_disk_is_one_line_exit_2_before_the_engine_starts(tmp_path,
                                                                                                      capsys):
    """Issue 45, item 2: a named --engine-log was not checked as --trace is: on a full disk or a
    device node the engine died at start with its OSError traceback."""
    from colo.cli import main
    from tests.fulldisk import small_disk

    trace = tmp_path / "t.jsonl"
    assert main(["demo", "--quiet", "--engine-log", "/dev/full", "--trace", str(trace)]) == 2
    assert capsys.readouterr().err.strip() == ("colo demo: --engine-log /dev/full is not a regular file (a character "
                                               "device); expected a new path or an existing regular file, and it "
                                               "was left as it was")
    with small_disk(tmp_path / "disk", size_kib=64) as disk:
        assert main(["demo", "--quiet", "--steps", "1", "--engine-log", str(disk / "e.log"), "--trace",
                     str(trace)]) == 2
        [line] = capsys.readouterr().err.strip().splitlines()
        assert line == (f"colo demo: cannot write the engine log {disk / 'e.log'}: No space left on device (checked "
                        "before the engine starts: a log needs room for 64 KiB at least)")
        assert sorted(os.listdir(disk)) == ["filler"]  # nothing left on it
    assert not trace.exists() and not list(tmp_path.glob("colo-*"))


def test_a_log_whose_disk_fills_mid_run_goes_on_to_stderr_and_never_raises(tmp_path):
    """The engine's lifecycle log, its disk full after a few lines: the process lives on, says
    once that the log is lost, and logs to stderr from there."""
    import subprocess

    from tests.fulldisk import small_disk

    code = ("import sys\nfrom colo.proc import lifecycle\nlifecycle.open_log(sys.argv[1])\n"
            "for i in range(2000):\n    lifecycle.log('tick', i=i, pad='x' * 200)\nprint('survived', flush=True)\n")
    with small_disk(tmp_path / "disk", size_kib=64, free_kib=8) as disk:
        proc = subprocess.run([sys.executable, "-c", code, str(disk / "e.log")], capture_output=True, text=True,
                              timeout=CEILING_S, env={**os.environ, "PYTHONPATH": str(ROOT)})
        written = (disk / "e.log").read_text().splitlines()
    assert proc.returncode == 0 and proc.stdout == "survived\n", proc.stderr[-2000:]
    err = [json.loads(ln) for ln in proc.stderr.splitlines()]
    assert err[0]["event"] == "log.unwritable" and err[0]["error"] == "No space left on device"
    assert [e for e in err if e["event"] == "log.unwritable"] == [err[0]]
    # every tick is in the log or on stderr, from where the log stopped (the tick that failed included)
    assert [json.loads(ln)["i"] for ln in written if ln.endswith("}")][:3] == [0, 1, 2]
    assert err[-1]["i"] == 1999 and len(written) + len(err) - 1 >= 2000
