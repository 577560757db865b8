"""``colo tune``: the arithmetic on fake traces, and the property that matters:
a run at the recommended fraction completes, one at +0.05 runs out of memory
in the phase tune named."""

import json

import pytest

from colo.cli import main
from colo.core.config import SchedulerConfig
from colo.core.memory import GiB, MiB, MemoryLedger, OutOfMemory
from colo.offline.replay import LoadedTrace, check_trace, load_trace
from colo.scheduler import Scheduler
from colo.trace.writer import TraceWriter
from colo.offline.tune import WhatIf, synthesize, tune, what_if
from colo.testing.fakes import FakeEngine, FakeTrainer, FakeTransport

#: the fakes' sizes below are in KiB: a bucket fitted to bytes would be one no colo command takes
#: (--bucket-mib: at least 0.01 MiB), and tune recommends none under 16 KiB
U = 1024
T = 2000 * U
W_ENGINE, CG, W_TRAINER, OPT = 100 * U, 20 * U, 100 * U, 200 * U


class LeavesCacheTrainer(FakeTrainer):
    """A trainer whose first step leaves ``grow`` bytes resident for good (its
    allocator cache, its communicator buffers): the engine sized its KV pool
    before that existed."""

    def __init__(self, memory, grow):
        super().__init__(weights=W_TRAINER, optimizer=OPT)
        self.memory, self.grow, self.grown = memory, grow, False

    async def train_step(self, rollout):
        if not self.grown:
            self.memory.reserved_bytes += self.grow
            self.grown = True
        return await super().train_step(rollout)


async def run_at(path, mfs, *, plan="offload-first", total=T, reserved=50, grow=0, cycles=3, bucket=50):
    """The scheduler with fakes whose engine sizes its KV pool as total × mfs − weights
    (``reserved``, ``grow`` and ``bucket`` in KiB).

    Returns None when every cycle completes, else the OutOfMemory raised."""
    reserved, grow, bucket = reserved * U, grow * U, int(bucket * U)
    memory = MemoryLedger(total_bytes=total, reserved_bytes=reserved)
    engine = FakeEngine(weights=W_ENGINE, kv_cache=int(total * mfs) - W_ENGINE, cuda_graph=CG)
    s = Scheduler(LeavesCacheTrainer(memory, grow), engine, memory, FakeTransport(),
                  trace=TraceWriter(path), config=SchedulerConfig(plan=plan, bucket_bytes=bucket),
                  run_config={"mem_fraction_static": mfs})
    try:
        async with s:
            for _ in range(cycles):
                await s.cycle()
    except OutOfMemory as e:
        return e
    return None


def cli(capsys, *argv):
    code = main(["tune", *map(str, argv)])
    io = capsys.readouterr()
    return code, io.out, io.err


async def test_fraction_and_bucket_from_a_trace_with_the_arithmetic(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    assert await run_at(path, 0.5, reserved=50) is None
    code, out, _ = cli(capsys, path, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["feasible"] is True
    # other = R 50 + graphs 20 KiB; margin = 2% of 2000 = 40: (2000 - 40 - 70) / 2000 = 0.945
    assert doc["max_fraction"] == 0.945 and doc["mem_fraction_static"] == 0.94
    assert doc["binding_phase"] == "start"  # nothing grows: the engine's start binds first
    assert doc["tied_phases"] == ["rollout", "engine_wake_kv"]  # ... and every cycle after it
    assert doc["binding"]["other_bytes"] == 70 * U and doc["binding"]["line"] == 1
    # sync holds R 50 + Wr 100 besides staging; staging peaked at 100 KiB = 2 x the 50 KiB budget;
    # (2000 - 40 - 150) / 2 = 905 KiB, capped at Wr rounded up to a power of two: 128 KiB
    dev = doc["devices"][0]
    assert dev["live_buckets"] == 2.0 and dev["bucket_binding_phase"] == "sync"
    assert doc["bucket_bytes"] == 128 * U and doc["bucket_mib"] == 0.125
    assert dev["max_fraction_by_phase"]["engine_wake_kv"] == 0.945
    code, out, _ = cli(capsys, path)
    assert code == 0
    assert "mfs ≤ (T − margin − other) / T = (2048000 − 40960 − 71680) / 2048000 = 0.9450" in out
    assert out.splitlines()[-1] == "recommend: mem_fraction_static 0.94, bucket 0.125 MiB (131072 B); binding phase: start"


async def test_margin_flag_and_what_grew_since_the_engine_started(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    assert await run_at(path, 0.5, reserved=50, grow=300) is None
    code, out, _ = cli(capsys, path, "--margin-gib", 100 * U / GiB, "--json")
    doc = json.loads(out)
    # after the first train the device also holds the trainer's 300 B: other = 50 + 300 + 20
    assert doc["max_fraction"] == pytest.approx((2000 - 100 - 370) / 2000, abs=1e-6)
    assert doc["mem_fraction_static"] == 0.76
    assert doc["binding_phase"] == "engine_wake_kv"
    assert doc["binding"]["event"] == "memory.resumed" and doc["binding"]["reserved_bytes"] == 350 * U
    code, out, _ = cli(capsys, path, "--margin-gib", 100 * U / GiB)
    assert "(that is 300.00 KiB more than at start (t.jsonl line 1: trace.started): it grew after" in out


@pytest.mark.parametrize("plan", ["offload-first", "sync-first", "single-stage"])
async def test_recommended_fraction_completes_and_five_points_more_ooms_in_the_named_phase(plan, tmp_path, capsys):
    assert await run_at(tmp_path / "rec.jsonl", 0.4, plan=plan, grow=300) is None
    rec = tune([load_trace(tmp_path / "rec.jsonl")])
    mfs, phase = rec.mem_fraction_static, rec.binding.binding.phase
    assert phase == {"offload-first": "engine_wake_kv", "sync-first": "engine_wake_kv",
                     "single-stage": "sync"}[plan]  # single-stage: KV and the buckets together
    assert await run_at(tmp_path / "ok.jsonl", mfs, plan=plan, grow=300) is None
    err = await run_at(tmp_path / "oom.jsonl", mfs + 0.05, plan=plan, grow=300)
    assert isinstance(err, OutOfMemory) and err.phase == phase
    # and the recommended bucket size fits at the recommended fraction too
    bucket = rec.bucket_bytes
    assert await run_at(tmp_path / "b.jsonl", mfs, plan=plan, grow=300, bucket=bucket / U) is None


async def test_a_trace_that_ran_out_of_memory_tunes_to_a_fraction_that_fits(tmp_path, capsys):
    err = await run_at(tmp_path / "oom.jsonl", 0.9, grow=300)
    assert err.phase == "engine_wake_kv"
    code, out, _ = cli(capsys, tmp_path / "oom.jsonl", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["binding"]["refused"] is True and doc["binding_phase"] == "engine_wake_kv"
    # the refused resume: R 350 + Wr 100 + KV 1700 + graphs 20 -> other = 370
    assert doc["binding"]["other_bytes"] == 370 * U
    assert doc["mem_fraction_static"] == 0.79  # (2000 - 40 - 370) / 2000 = 0.795
    assert await run_at(tmp_path / "ok.jsonl", doc["mem_fraction_static"], grow=300) is None


async def test_a_staging_oom_in_single_stage_tunes_the_fraction_down(tmp_path, capsys):
    # single-stage at 0.94: R 50 + KV 1780 + Wr 100 + graphs 20 = 1950 KiB; two 50 KiB buckets do not fit
    err = await run_at(tmp_path / "oom.jsonl", 0.94, plan="single-stage")
    assert err.phase == "sync" and err.tag == "staging"
    doc = json.loads(cli(capsys, tmp_path / "oom.jsonl", "--json")[1])
    assert doc["binding_phase"] == "sync" and doc["binding"]["refused"] is True
    # other = R 50 + graphs 20 + both buckets 100: (2000 - 40 - 170) / 2000 = 0.895
    assert doc["binding"]["other_bytes"] == 170 * U and doc["mem_fraction_static"] == 0.89
    assert await run_at(tmp_path / "ok.jsonl", doc["mem_fraction_static"], plan="single-stage",
                        bucket=doc["bucket_bytes"] / U) is None


async def test_several_devices_take_the_tightest(tmp_path, capsys):
    assert await run_at(tmp_path / "a.jsonl", 0.5, reserved=50) is None
    assert await run_at(tmp_path / "b.jsonl", 0.5, reserved=150) is None
    doc = json.loads(cli(capsys, tmp_path / "a.jsonl", tmp_path / "b.jsonl", "--json")[1])
    assert doc["mem_fraction_static"] == 0.89  # (2000 - 40 - 170) / 2000 = 0.895
    assert doc["binding"]["file"].endswith("b.jsonl")


# -- what-if ---------------------------------------------------------------------------------

@pytest.mark.parametrize("plan,mfs,bucket_mib,binding", [
    # other = R 1 + graphs 0.5 GiB; margin 1 GiB: (80 - 1 - 1.5) / 80 = 0.96875
    ("offload-first", 0.96, 512, "start"),
    ("sync-first", 0.96, 512, "start"),
    # the sync also holds two 512 MiB buckets beside the KV pool: (80 - 1 - 2.5) / 80 = 0.95625
    ("single-stage", 0.95, 512, "sync"),
])
def test_what_if_uses_the_same_model(plan, mfs, bucket_mib, binding, capsys):
    code, out, _ = cli(capsys, "--gpu-gib", 80, "--model-gib", 16, "--bucket-mib", 512, "--plan", plan, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["source"] == "what-if"
    assert (doc["mem_fraction_static"], doc["bucket_mib"], doc["binding_phase"]) == (mfs, bucket_mib, binding)
    assert doc["assumed"] == {"reserved_gib": 1.0, "cuda_graph_gib": 0.5, "trainer_weights_gib": 16,
                              "optimizer_gib": 32}


@pytest.mark.parametrize("plan", ["offload-first", "sync-first", "single-stage"])
def test_what_if_trace_is_one_the_checker_accepts(plan):
    events = synthesize(WhatIf(gpu_gib=80, model_gib=16, plan=plan))
    result = check_trace(LoadedTrace("w", events, list(range(1, len(events) + 1))))
    assert result.findings == []
    assert [p for p, _ in result.phases] == [p.value for p in __import__("colo.core.phases", fromlist=["PLANS"]).PLANS[plan]]


async def test_what_if_agrees_with_a_recorded_trace_of_the_same_sizes(tmp_path):
    total, R = 1 * GiB, 64 * MiB
    memory = MemoryLedger(total_bytes=total, reserved_bytes=R)
    engine = FakeEngine(weights=100 * MiB, kv_cache=400 * MiB, cuda_graph=32 * MiB)
    trainer = FakeTrainer(weights=100 * MiB, optimizer=200 * MiB)
    s = Scheduler(trainer, engine, memory, FakeTransport(), trace=TraceWriter(tmp_path / "t.jsonl"),
                  config=SchedulerConfig(plan="sync-first", bucket_bytes=16 * MiB))
    async with s:
        await s.cycle()
    recorded = tune([load_trace(tmp_path / "t.jsonl")])
    w = what_if(WhatIf(gpu_gib=1, model_gib=100 / 1024, reserved_gib=R / GiB, cuda_graph_gib=32 / 1024,
                       optimizer_gib=200 / 1024, plan="sync-first", bucket_mib=16))
    assert w.binding.max_fraction == pytest.approx(recorded.binding.max_fraction, abs=1e-9)
    assert w.mem_fraction_static == recorded.mem_fraction_static


def test_what_if_that_cannot_fit_exits_1_naming_the_phase(capsys):
    # sync-first: R 1 + engine 20 + trainer 20 + optimizer 40 GiB = 81 GiB during sync on 80 GiB
    code, out, _ = cli(capsys, "--gpu-gib", 80, "--model-gib", 20, "--plan", "sync-first")
    assert code == 1
    assert "does not fit: engine_wake_weights, step 0" in out and "no mem_fraction_static fixes that" in out
    doc = json.loads(cli(capsys, "--gpu-gib", 80, "--model-gib", 20, "--plan", "sync-first", "--json")[1])
    assert doc["feasible"] is False


@pytest.mark.parametrize("argv,message", [
    ([], "give TRACE... or a what-if: --gpu-gib and --model-gib missing"),
    (["--gpu-gib", "80"], "--model-gib missing"),
    (["--gpu-gib", "8", "--model-gib", "1", "--margin-gib", "-1"], "--margin-gib must be >= 0, got -1.0"),
    (["TRACE", "--gpu-gib", "80"], "--gpu-gib describe a what-if without a trace"),
    (["--gpu-gib", "1", "--model-gib", "0.5"], "reserved_gib 1.0 leaves nothing of a 1.0 GiB device"),
])
def test_bad_usage_exits_2(argv, message, tmp_path, capsys):
    argv = [str(tmp_path / "x.jsonl") if a == "TRACE" else a for a in argv]
    code, out, err = cli(capsys, *argv)
    assert code == 2 and out == "" and message in err


def test_unreadable_trace_exits_2(tmp_path, capsys):
    (tmp_path / "x.jsonl").write_text("nope\n")
    code, _, err = cli(capsys, tmp_path / "x.jsonl")
    assert code == 2 and "line 1: not JSON" in err


def test_what_if_config_is_validated():
    with pytest.raises(ValueError, match="plan must be one of offload-first, sync-first, single-stage, got 'fast'"):
        WhatIf(gpu_gib=80, model_gib=16, plan="fast")
    with pytest.raises(ValueError, match="model_gib must be > 0, got 0"):
        WhatIf(gpu_gib=80, model_gib=0)
    with pytest.raises(TypeError):
        WhatIf(80, 16)  # keyword-only


def test_over_every_ranks_trace_the_gpu_with_the_largest_leftovers_binds_and_is_named(tmp_path):
    """Two ranks of one run; rank 1 holds 1 GiB more reserved (a fatter NCCL buffer,
    a larger allocator cache): its trace binds, and tune names its rank and GPU."""
    paths = []
    for rank, reserved in ((0, 1.0), (1, 2.0)):
        events = synthesize(WhatIf(gpu_gib=80, model_gib=15, reserved_gib=reserved))
        events[0].update(rank=rank, world_size=2,
                         config={**events[0]["config"], "gpu_uuids": ["GPU-aaaa", "GPU-bbbb"]})
        for ev in events:
            ev["rank"] = rank
        p = tmp_path / f"run.rank{rank}.jsonl"
        p.write_text("".join(json.dumps(ev) + "\n" for ev in events))
        paths.append(str(p))
    rec = tune([load_trace(p) for p in paths])
    d = rec.as_dict()
    assert d["binding_rank"] == 1 and d["binding_gpu"].endswith("GPU-bbbb")
    per_rank = [dev["max_fraction"] for dev in d["devices"]]
    assert per_rank[1] < per_rank[0]  # the fatter GPU allows less
    assert rec.mem_fraction_static == pytest.approx(min(dev["mem_fraction_static"] for dev in d["devices"]))
    assert "binding GPU: rank 1" in rec.text()


async def test_ranks_of_two_runs_are_not_tuned_as_one_run(tmp_path, capsys):
    """Issue 32, item 7: tune recommended on rank 0 of one run and rank 1 of another."""
    from tests.offline.test_replay import _run_of_two_ranks

    (run_a, (a0, a1)), (run_b, (_, b1)) = [await _run_of_two_ranks(tmp_path, n) for n in "ab"]
    code, out, _ = cli(capsys, a0, a1)
    assert code == 0 and "recommend: mem_fraction_static" in out
    code, out, err = cli(capsys, a0, b1)
    assert code == 2 and out == "" and "Traceback" not in err
    assert err.strip() == (f"colo tune: {a0} (rank 0) is of run {run_a} but {b1} (rank 1) is of run {run_b}; "
                           "expected the ranks of one run")
    # runs of one rank each on the device to tune for are several runs, as before
    singles = [await record_single(tmp_path / f"s{i}.jsonl") for i in range(2)]
    code, out, _ = cli(capsys, *singles)
    assert code == 0 and "recommend: mem_fraction_static" in out


async def record_single(path):
    s = Scheduler(FakeTrainer(weights=100 * U, optimizer=200 * U),
                  FakeEngine(weights=100 * U, kv_cache=300 * U, cuda_graph=20 * U),
                  MemoryLedger(total_bytes=10_000 * U), FakeTransport(),
                  trace=TraceWriter(path), config=SchedulerConfig(bucket_bytes=50 * U))
    async with s:
        await s.cycle()
    return path


# -- issue 32, item 9: tune recommends no bucket the command line would refuse ---------------------

def test_a_bucket_under_the_least_the_cli_takes_is_never_recommended(capsys):
    """Before: a 1.8 GiB what-if (sync-first, no margin) recommended a 1-byte bucket
    (``bucket_mib`` 9.5e-07), which ``--bucket-mib`` refuses (at least 0.01). The least
    bucket tune recommends is 16 KiB, the least power of two the flag takes; where less
    than that is left the what-if does not fit, naming why."""
    argv = ("--gpu-gib", 1.8, "--model-gib", 0.2, "--plan", "sync-first", "--margin-gib", 0, "--json")
    code, out, _ = cli(capsys, *argv)
    doc = json.loads(out)
    assert code == 1 and doc["feasible"] is False and doc["bucket_mib"] is None, doc
    (why,) = doc["devices"][0]["infeasible"]
    assert "a bucket may take 1 B, less than the least bucket colo takes (16.00 KiB: --bucket-mib 0.01" in why
    # every bucket recommended over a range of sizes is one the command line takes back
    seen = set()
    for gpu in (1.6, 1.8, 2, 3, 8):
        for model in (0.001, 0.2, 0.5):
            for plan in ("offload-first", "sync-first", "single-stage"):
                code, out, _ = cli(capsys, "--gpu-gib", gpu, "--model-gib", model, "--plan", plan,
                                   "--margin-gib", 0, "--json")
                bucket = json.loads(out)["bucket_mib"]
                if bucket is None:
                    continue
                seen.add(bucket)
                assert bucket >= 0.01, (gpu, model, plan, bucket)
                code, _, err = cli(capsys, "--gpu-gib", gpu, "--model-gib", model, "--plan", plan,
                                   "--bucket-mib", repr(bucket), "--json")
                assert code != 2, err
    assert len(seen) > 3


async def test_a_model_under_the_least_bucket_gets_the_least_bucket(tmp_path):
    """Recorded with a 4 KiB model and 4 KiB buckets: the bucket is capped at the model's
    size (one bucket holds all of it), which was 4 KiB; it is the least colo takes now."""
    memory = MemoryLedger(total_bytes=1 * GiB, reserved_bytes=64 * MiB)
    s = Scheduler(FakeTrainer(weights=4096, optimizer=8192), FakeEngine(weights=4096, kv_cache=400 * MiB),
                  memory, FakeTransport(), trace=TraceWriter(tmp_path / "t.jsonl"),
                  config=SchedulerConfig(bucket_bytes=4096))
    async with s:
        await s.cycle()
    rec = tune([load_trace(tmp_path / "t.jsonl")])
    assert rec.feasible and rec.bucket_bytes == 16 * 1024
    assert rec.results[0].arithmetic[-1].endswith("(a power of two, the least bucket colo takes)")


def test_an_adapter_what_if_moves_the_adapter_keeps_the_engines_weights_and_caps_the_bucket_at_it():
    w = WhatIf(gpu_gib=80, model_gib=15, adapter_mib=80)
    events = synthesize(w)
    paused = [f"{e['owner']}.{e['tag']}" for e in events if e["event"] == "memory.paused"]
    assert "engine.weights" not in paused and "engine.kv_cache" in paused
    [sync] = [e for e in events if e["event"] == "sync.finished"]
    assert sync["bytes"] == 80 * MiB and sync["target"] == "adapter"
    tags = events[0]["tags"]
    assert tags["trainer.optimizer"]["bytes"] == 160 * MiB  # two moments of the adapter, not of the model
    assert tags["trainer.weights"]["bytes"] == 15 * GiB + 80 * MiB
    rec = what_if(w)
    assert rec.results[0].bucket_bytes == 128 * MiB  # 80 MiB rounded up: a bigger bucket only holds memory
    assert what_if(WhatIf(gpu_gib=80, model_gib=15)).results[0].bucket_bytes == 512 * MiB
    with pytest.raises(ValueError, match="adapter_mib must be > 0 and at most the model's"):
        WhatIf(gpu_gib=80, model_gib=0.01, adapter_mib=100)


async def test_a_lora_runs_trace_tunes_its_bucket_to_the_adapter_it_moves(tmp_path, capsys):
    pytest.importorskip("peft")
    from colo.apps.demo import DemoConfig, run

    out = await run(DemoConfig(lora_rank=8, steps=2, bucket_mib=4.0, trace=str(tmp_path / "t.jsonl")), progress=False)
    assert out.error is None, out.error
    adapter = next(e for e in load_trace(out.trace_path).events if e["event"] == "sync.finished")["bytes"]
    rec = tune([load_trace(out.trace_path)])
    assert rec.results[0].bucket_bytes == 1 << (adapter - 1).bit_length()  # the adapter's bytes rounded up
    code, text, _ = cli(capsys, out.trace_path)
    assert code == 0 and f"the adapter a sync moves ({adapter // 1024}.00 KiB)" in text
