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

ROOT = Path(__file__).resolve().parents[2]


# -- item 2: one trace file, one writer ---------------------------------------------

def test_a_second_writer_of_a_trace_is_refused_naming_the_first_and_leaves_it_untouched(tmp_path):
    path = tmp_path / "run.jsonl"
    first = TraceWriter(path)
    first.start(device={"kind": "cpu"}, config={"who": "first"})
    first.emit("phase.entered", step=0, from_phase=None, to_phase="rollout", mem={})
    before = path.read_bytes()
    assert (tmp_path / "run.jsonl.lock").read_text().strip() == str(os.getpid())

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
    assert not (tmp_path / "run.jsonl.lock").exists()

    # finished: the path is free again, and the next writer owns it from scratch
    third = TraceWriter(path)
    third.start(device={"kind": "cpu"}, config={"who": "third"})
    third.finish()
    assert [e["config"] for e in read_trace(path) if e["event"] == "trace.started"] == [{"who": "third"}]


def test_a_lock_file_left_by_a_crashed_run_does_not_block_the_next(tmp_path):
    path = tmp_path / "run.jsonl"
    (tmp_path / "run.jsonl.lock").write_text("999999999\n")  # nobody holds the flock
    w = TraceWriter(path)
    w.start(device={}, config={})
    assert (tmp_path / "run.jsonl.lock").read_text().strip() == str(os.getpid())
    w.finish()
    assert [e["event"] for e in read_trace(path)] == ["trace.started", "trace.finished"]


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
    args = SimpleNamespace(device="cpu", out=None, models=None, transports="packed", model=None)
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

def fixed_batch(config, seed=1, batch=4, prompt_len=4, new_tokens=6):
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, config.vocab_size, (batch, prompt_len), generator=g).tolist()
    completions = torch.randint(0, config.vocab_size, (batch, new_tokens), generator=g).tolist()
    rewards = [sum(t % 8 == 0 for t in c) / len(c) for c in completions]
    return SimpleNamespace(prompts=prompts, completions=completions, rewards=rewards)


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
