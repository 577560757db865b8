"""``colo bench --trainers``: the real trainers' rows, each trainer in a process of its own."""

from __future__ import annotations

import json

import statistics

import pytest
import torch

import colo.apps.bench as bench
from colo.apps.bench_trainers import OPTIMIZER_BYTES_PER_PARAM, HEADROOM_BYTES, PYPROFILE_CYCLES, optimizer_fits
from colo.cli import main
from colo.core.buckets import plan_buckets
from colo.digest import expected_weights_digest
from colo.engine.reference.weights import expected_hf_specs
from colo.trainers.models import build_trainer_model, demo_config

from tests.apps.test_bench import TINY
from tests.leaks import new_segments


def test_every_real_trainer_row_delivers_the_trainers_own_weights_verified(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(bench.MODELS, "tiny", TINY)
    real = bench.measure_limits
    monkeypatch.setattr(bench, "measure_limits", lambda: real(nbytes=4 << 20, reps=1, directory=str(tmp_path)))
    out = tmp_path / "r.json"
    written = []  # (partial?, trainers in it) of every write of --out, in order
    real_write = bench.write_result

    def write_result(text, **kw):
        d = json.loads(text)
        written.append((d.get("partial", False), [e["trainer"] for e in d.get("trainers", [])]))
        return real_write(text, **kw)

    monkeypatch.setattr(bench, "write_result", write_result)
    assert main(["bench", "--device", "cpu", "--model", "tiny", "--transports", "packed", "--trainers",
                 "hf,megatron,fsdp", "--reps", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    # what was measured is on disk as each trainer's rows are done; the whole run replaces it
    assert written == [(True, []), (True, ["hf"]), (True, ["hf", "megatron"]),
                       (True, ["hf", "megatron", "fsdp"]), (False, ["hf", "megatron", "fsdp"])]
    assert "partial" not in result
    config = demo_config(**TINY.config)
    specs = expected_hf_specs(config, torch.bfloat16)
    # every trainer starts from the reference model of seed 0 (megatron and fsdp load its weights):
    # the engine's digest after each trainer's verified syncs is that model's, in the engine's dtype,
    # over the trainer's own spec order
    ref = {n: p.detach() for n, p in build_trainer_model(config, 0).named_parameters()}
    assert [e["trainer"] for e in result["trainers"]] == ["hf", "megatron", "fsdp"]
    memcpy = result["limits"]["memcpy_GBps"]
    for e in result["trainers"]:
        name = e["trainer"]
        assert "error" not in e, e.get("log_tail")
        assert (e["model"], e["param_dtype"], e["engine_dtype"], e["optimizer_state"]) == \
            ("tiny", "float32", "bfloat16", True), name
        assert e["params"] == sum(t.numel() for t in ref.values()) and e["engine_weight_bytes"] == \
            sum(s.nbytes for s in specs)
        [row] = e["rows"]  # a CPU trainer's weights are always resident: sync-first only
        assert (row["plan"], row["source"], row["cycles"], row["verified_cycles"]) == ("sync-first", "device", 1, 1)
        assert sorted(e["spec_names"]) == sorted(s.name for s in specs)
        assert row["digests"] == [expected_weights_digest(ref, e["spec_names"], torch.bfloat16)], name
        assert (row["bytes"], row["tensors"]) == (sum(s.nbytes for s in specs), len(specs)), name
        by_name = {s.name: s for s in specs}
        ordered = [by_name[n] for n in e["spec_names"]]
        assert row["buckets"] == len(plan_buckets(ordered, int(TINY.bucket_mib * (1 << 20)))), name
        assert row["floor_s"] == pytest.approx(row["bytes"] / memcpy / 1e9)
        assert row["sync_over_floor"] == pytest.approx(row["sync_s"] / row["floor_s"])
        assert row["verify_of_sync"] == pytest.approx(row["verify_s"] / row["sync_s"])
        assert row["verify_adds_s"] == pytest.approx(row["verified_sync_s"] + row["verify_s"] - row["sync_s"])
        assert row["verify_adds_of_sync"] == pytest.approx(row["verify_adds_s"] / row["sync_s"])
        assert set(row["verify_parts"]) == {"engine_digest_s", "trainer_check_s", "probe_s"}
        assert row["probed_cycles"] == 1  # colo's engine digests its live weights: probed once
        assert row["verify_s"] >= sum(row["verify_parts"].values()) * 0.999 > 0
        # every step of the cycle a CPU has, timed (no trainer memory moves on a CPU)
        assert set(row["step_s"]) == {"engine_release_s", "engine_wake_weights_s", "sync_s", "engine_wake_kv_s"}
        # where the sync's time went, stage by stage, summed over its buckets
        assert {"gather", "pack", "handoff", "load"} <= set(row["stage_s"]), row["stage_s"]
        assert all(v >= 0 for v in row["stage_s"].values()) and row["stage_s"]["load"] > 0
        # colo's engine's own account of its loads: the copies queued and waited for, inside the
        # sender's load (request out, ack back), which also holds the round trip
        parts = row["engine_s"]
        assert {"queue_s", "wait_s", "handoff_s", "load_s"} <= set(parts), parts
        # (each positive, not ordered: the sender stamps a request sent after its write returns, and
        # on a busy machine the engine can have loaded it before the sender runs again)
        assert parts["load_s"] > 0 and row["stage_s"]["load"] > 0
        # a verified cycle's engine account has the same parts, and the digest its load's end answered
        # (the route each load took, route_*_s, may differ: a summed load is planned anew)
        plain, verified = ({k for k in d if not k.startswith("route_")} for d in (parts, row["verified_engine_s"]))
        assert plain <= verified and verified - plain <= {"digest_s"}, row["verified_engine_s"]
        assert any(k.startswith("route_") for k in parts), parts
        # and each plain cycle's, whose median per key is the row's
        cycles = row["engine_s_all"]
        assert len(cycles) == row["cycles"] == len(row["sync_s_all"])
        assert {k: statistics.median(c[k] for c in cycles) for k in parts} == pytest.approx(parts)
        assert row["trainer_rates"] == {}
    printed = capsys.readouterr().out
    assert "| tiny | megatron | sync-first |" in printed and "| tiny | fsdp | sync-first |" in printed
    assert new_segments() == []


@pytest.mark.parametrize("value,msg", [
    ("gpt", "--trainers 'gpt': expected a comma-separated list of hf, megatron, fsdp (each once), all, or none"),
    ("hf,hf", "--trainers 'hf,hf': expected"),
    ("", "--trainers '': expected"),
])
def test_bad_trainers_exit_two_naming_the_choice(value, msg, tmp_path, capsys):
    assert main(["bench", "--trainers", value, "--out", str(tmp_path / "x.json")]) == 2
    assert msg in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_the_optimizer_state_is_left_out_only_where_it_cannot_fit():
    params, weights = 1_000, 2_000
    need = params * OPTIMIZER_BYTES_PER_PARAM + 2 * weights + 500 + HEADROOM_BYTES
    assert optimizer_fits(params, weights, 500, need)[0] is True
    fits, why = optimizer_fits(params, weights, 500, need - 1)
    assert fits is False and "1,000 parameters x 12 bytes" in why
    # Qwen2-7B's shapes beside its engine on an 80 GB device: 7.6 B parameters need 106 GB of trainer state
    p7 = 7_615_616_512
    assert optimizer_fits(p7, 2 * p7, 2 * p7, 79 << 30)[0] is False


def test_the_benchmarks_engine_keeps_its_memory_as_the_demo_deploys_it():
    """On a GPU colo's engine runs under torch_memory_saver in ``colo demo`` (a release pauses the
    weights at their addresses); the benchmark's engine the same, or every measured sync would
    be the engine's first after a fresh allocation. The build goes through the server's own
    check of it. On the CPU nothing pauses: its memory is freed."""
    from colo.apps.bench_trainers import engine_build
    from colo.engine.reference.server import check_build
    from colo.trainers.models import demo_config

    config = demo_config(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64)
    for device, memory in (("cuda", "saver"), ("cpu", "free")):
        build = engine_build(config, "bfloat16", device)
        assert build["memory"] == memory
        check_build(build)


def test_a_one_copy_offload_first_row_is_set_beside_the_rate_of_the_registered_shm_it_reads():
    """The one-copy ``offload-first`` sync reads the trainer's shared pinned backup (a
    registered /dev/shm segment), whose host->device rate the same run measures: a row of one
    request from the host gets its sync over that rate beside its floor; a packed row (several
    buckets) and a ``sync-first`` row do not."""
    from colo.apps.bench_trainers import against_limits, table

    limits = {"pinned_h2d_GBps": 50.0, "pinned_d2h_GBps": 50.0, "d2d_copy_GBps_read_plus_write": 4000.0,
              "registered_shm_h2d_GBps": 40.0}
    steps = {"engine_release_s": 0.005, "engine_wake_weights_s": 0.005, "engine_wake_kv_s": 0.001,
             "trainer_pause_s": 0.5, "trainer_onload_s": 0.5}

    def row(plan, buckets):
        return {"plan": plan, "bytes": 4_000_000_000, "buckets": buckets, "sync_s": 0.11, "step_s": dict(steps)}

    entry = {"model": "m", "trainer": "fsdp", "trainer_bytes": 25_000_000_000, "optimizer_state": True,
             "rows": [row("offload-first", 1), row("offload-first", 6), row("sync-first", 1)]}
    against_limits(entry, limits, "cuda")
    one, packed, first = entry["rows"]
    assert one["floor_s"] == pytest.approx(0.08) and one["sync_over_floor"] == pytest.approx(1.375)
    assert one["sync_over_registered_shm_h2d"] == pytest.approx(0.11 / 0.1)
    assert "sync_over_registered_shm_h2d" not in packed and "sync_over_registered_shm_h2d" not in first
    lines = table([entry]).splitlines()
    assert "| 1.38 (1.10 of the shm's) |" in lines[2] and "of the shm" not in lines[3] + lines[4]
    # a run that could not make the segment (no room in /dev/shm) has no such rate
    entry["rows"] = [row("offload-first", 1)]
    against_limits(entry, dict(limits, registered_shm_h2d_GBps=None), "cuda")
    assert "sync_over_registered_shm_h2d" not in entry["rows"][0]


def test_a_rows_pause_is_set_beside_the_link_tag_by_tag_and_each_copy_alone():
    """Where a trainer's pause goes (issue 44: 0.94-0.95 of the link): each tag's bytes over its
    pause and over its copy alone, where the trainer's memory backend timed them
    (``trainer_pause_parts_s``, medians over the plain cycles by ``_summary``)."""
    from colo.apps.bench_trainers import _summary, against_limits

    def cycle(optimizer_copy):
        return {"source": "host", "bytes": 10, "buckets": 1, "tensors": 1, "peak_staging_bytes": 0,
                "sync_s": 0.1, "stage_s": {}, "trainer_pause_s": 0.5, "trainer_onload_s": 0.45,
                "trainer_pause_parts_s": {"empty_cache": 0.01, "optimizer": 0.4, "optimizer.copy": optimizer_copy,
                                          "weights": 0.09, "weights.copy": 0.08},
                "trainer_onload_parts_s": {"optimizer": 0.36, "weights": 0.09}}

    row = _summary("offload-first", [cycle(0.36), cycle(0.32), cycle(0.38)], [])
    assert row["trainer_pause_parts_s"]["optimizer.copy"] == 0.36  # the median of three
    entry = {"model": "m", "trainer": "hf", "trainer_bytes": 25_000_000_000, "optimizer_state": True,
             "tag_bytes": {"weights": 4_000_000_000, "optimizer": 21_000_000_000}, "rows": [row]}
    limits = {"pinned_h2d_GBps": 50.0, "pinned_d2h_GBps": 50.0, "d2d_copy_GBps_read_plus_write": 4000.0}
    rates = against_limits(entry, limits, "cuda")["rows"][0]["trainer_rates"]
    assert rates["trainer_pause"]["of_link"] == pytest.approx(1.0)  # 25 GB in 0.5 s at 50 GB/s
    assert rates["trainer_pause:optimizer"]["of_link"] == pytest.approx(21 / 0.4 / 50)
    assert rates["trainer_pause:optimizer.copy"]["of_link"] == pytest.approx(21 / 0.36 / 50)
    assert rates["trainer_pause:weights.copy"]["GBps"] == pytest.approx(50.0)
    # the onload's tags are timed but not set beside the link: the weights' resume only queues its copy
    assert sorted(k for k in rates if k.startswith("trainer_onload")) == ["trainer_onload"]
    # a row without parts (a trainer on a backend that times none) has the whole rates only
    del row["trainer_pause_parts_s"], row["trainer_onload_parts_s"]
    assert sorted(against_limits(entry, limits, "cuda")["rows"][0]["trainer_rates"]) == \
        ["trainer_onload", "trainer_pause"]


def test_flat_spans_lay_tensors_out_as_a_flat_buffer_does_up_to_the_cap():
    from colo.apps.bench import MiB, flat_spans

    assert flat_spans([1000, 17, 4096, 3 * MiB], 2 * MiB) == [(0, 1000), (1008, 1025), (1040, 5136)]
    assert flat_spans([3 * MiB, 5], 2 * MiB) == [(0, 3 * MiB)]  # the first is always taken
    with pytest.raises(ValueError, match="no tensor sizes"):
        flat_spans([], 1)


def test_saver_copy_refuses_a_machine_without_a_gpu(tmp_path, capsys):
    """bench.saver_copy times copies into memory-saver regions on the device: without one it
    says so and exits 2, writing nothing."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the refusal is for machines without one")
    from bench.saver_copy import main as saver_copy

    assert saver_copy([str(tmp_path / "out.json")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err and not (tmp_path / "out.json").exists()


def test_ipc_open_refuses_a_machine_without_a_gpu_and_reads_torchs_handle_format(tmp_path, capsys):
    """bench.ipc_open opens CUDA IPC handles in a second process: without a GPU it says so and
    exits 2, writing nothing. The raw open takes the 64-byte ``cudaIpcMemHandle_t`` inside
    torch's handle (after its version and ``'c'`` type bytes), and nothing else."""
    from bench.ipc_open import _raw_handle, main as ipc_open

    assert _raw_handle(b"\x02c" + bytes(range(64))) == bytes(range(64))
    assert _raw_handle(b"\x03c" + bytes(range(64))) == bytes(range(64))
    assert _raw_handle(bytes(range(64))) == bytes(range(64))
    assert _raw_handle(b"\x02e" + bytes(64)) is None and _raw_handle(bytes(65)) is None
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the refusal is for machines without one")
    assert ipc_open([str(tmp_path / "out.json")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err and not (tmp_path / "out.json").exists()


def test_the_trainer_rows_pause_in_the_cycles_order_unless_told_and_settle_only_when_told(monkeypatch):
    """colo bench times the trainer's pause in the order the cycle pauses its tags (the
    optimizer state first: ``colo.core.phases``), so its rows are the scheduler's; the two
    diagnoses (another order, a wait before each sync) apply only when set, and refuse what
    is not a permutation of the tags or a number of seconds."""
    from colo.apps.bench_trainers import PAUSE_ORDER_ENV, SETTLE_ENV, _pause_order, _settle_s

    monkeypatch.delenv(PAUSE_ORDER_ENV, raising=False)
    monkeypatch.delenv(SETTLE_ENV, raising=False)
    assert _pause_order(["weights", "optimizer"]) == ["optimizer", "weights"]
    assert _pause_order(["weights"]) == ["weights"] and _settle_s() == 0.0
    monkeypatch.setenv(PAUSE_ORDER_ENV, "weights, optimizer")
    assert _pause_order(["weights", "optimizer"]) == ["weights", "optimizer"]
    monkeypatch.setenv(PAUSE_ORDER_ENV, "weights")
    with pytest.raises(ValueError, match="each once"):
        _pause_order(["weights", "optimizer"])
    monkeypatch.setenv(SETTLE_ENV, "0.5")
    assert _settle_s() == 0.5
    for bad in ("soon", "-1", "61"):
        monkeypatch.setenv(SETTLE_ENV, bad)
        with pytest.raises(ValueError, match=SETTLE_ENV):
            _settle_s()


def _tiny_hf_rows(tmp_path, monkeypatch, env: str, folder: str):
    """``colo bench`` of the tiny model's hf rows (one rep, small limits) with ``env`` naming
    ``tmp_path / folder``; that folder. The result is ``tmp_path / "r.json"``."""
    monkeypatch.setitem(bench.MODELS, "tiny", TINY)
    real = bench.measure_limits
    monkeypatch.setattr(bench, "measure_limits", lambda: real(nbytes=4 << 20, reps=1, directory=str(tmp_path)))
    where = tmp_path / folder
    monkeypatch.setenv(env, str(where))
    assert main(["bench", "--device", "cpu", "--model", "tiny", "--transports", "packed", "--trainers", "hf",
                 "--reps", "1", "--out", str(tmp_path / "r.json")]) == 0
    return where


def test_a_profiled_sync_records_the_engines_own_process_beside_the_trainers(tmp_path, monkeypatch):
    # the copies a load queues run in the engine's process: its trace is written beside the trainer's
    prof = _tiny_hf_rows(tmp_path, monkeypatch, "COLO_BENCH_PROFILE", "prof")
    where = prof / "sync-hf-tiny-sync-first"
    assert (where.parent / (where.name + ".txt")).read_text().startswith("one sync, ")
    trainer = json.loads((where.parent / (where.name + ".json")).read_text())
    engine = json.loads((where.parent / (where.name + "-engine.json")).read_text())
    summary = json.loads((where.parent / (where.name + "-engine-summary.json")).read_text())
    # two processes, each its own recording: the engine's holds the engine's pid only
    pids = lambda trace: {e["pid"] for e in trace["traceEvents"]  # noqa: E731
                          if e.get("ph") == "X" and isinstance(e["pid"], int)}  # ("Spans": the profiler's own)
    assert pids(engine) and pids(trainer) and not pids(engine) & pids(trainer)
    # the engine wrote the sync's tensors into its parameters while it recorded
    names = {e["name"] for e in engine["traceEvents"] if e.get("ph") == "X"}
    assert any("copy" in n for n in names), sorted(names)[:40]
    assert summary["trace"] == str(where.parent / (where.name + "-engine.json")) and summary["wall_s"] > 0
    assert set(summary["device_s_by_kind"]) == {"nccl", "memcpy", "other"}


def test_python_profiled_syncs_name_the_senders_own_functions_with_their_calls(tmp_path, monkeypatch):
    # COLO_BENCH_PYPROFILE: more plain cycles per plan, their syncs' Python under cProfile, written out
    prof = _tiny_hf_rows(tmp_path, monkeypatch, "COLO_BENCH_PYPROFILE", "py")
    plans = [r["plan"] for r in json.loads((tmp_path / "r.json").read_text())["trainers"][0]["rows"]]
    assert plans and sorted(p.name for p in prof.iterdir()) == sorted(f"pysync-hf-tiny-{p}.txt" for p in plans)
    for plan in plans:
        text = (prof / f"pysync-hf-tiny-{plan}.txt").read_text()
        assert text.startswith(f"{PYPROFILE_CYCLES} syncs under cProfile")
        assert "== by cumulative" in text and "== by tottime" in text
        # the sender's sync ran in every profiled cycle (a coroutine counts a call per resumption),
        # and what it called is listed under it
        sync = [line for line in text.splitlines() if "packed.py" in line and line.rstrip().endswith("(sync)")]
        assert sync and int(sync[0].split()[0]) >= PYPROFILE_CYCLES, sync
        assert "transport_load" in text
