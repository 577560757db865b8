"""The GPU benchmark's CPU-checkable parts: the Qwen2-1.5B shape table against transformers,
the checkpoint-engine peer's configuration and receiver (its own wire layout, on CPU tensors),
``python -m bench.peer``'s arguments and choice of its best row, and the contract between
``bench.gpu_sync`` and the peer's own process (its command, its result, the skip)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys

import pytest
import torch
from transformers import Qwen2ForCausalLM

from bench import gpu_sync as bench_gpu
from bench import peer as bench_peer
from bench.models import GPU_MODEL_NAMES, attr_config, shapes_of
from bench.peer import (Copier, PeerConfig, check_configs, digest_config, parse_buckets, peer_configs, pick_handle,
                        read_update_log, summarize)
from colo.engine.reference.weights import expected_digest, expected_hf_specs
from colo.trainers.models import demo_config


def test_qwen2_1_5b_shapes_are_transformers_own_with_tied_embeddings():
    label, shapes = bench_gpu.gpu_models()["qwen2-1.5b"]
    config = demo_config(**shapes)
    with torch.device("meta"):  # shapes only: no 6 GB of float32 weights
        model = Qwen2ForCausalLM(config)
    assert config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    # named_parameters lists a tied tensor once: lm_head.weight is not a tensor of its own
    theirs = {n: tuple(p.shape) for n, p in model.named_parameters()}
    ours = {s.name: tuple(s.shape) for s in expected_hf_specs(config, torch.bfloat16)}
    assert ours == theirs and "lm_head.weight" not in ours
    params = sum(p.numel() for p in model.parameters())
    assert sum(s.nbytes for s in expected_hf_specs(config, torch.bfloat16)) == 2 * params
    # Qwen/Qwen2-1.5B's own parameter count (tied embeddings), not merely "about 1.5 B"
    assert params == 1_543_714_304 and "tied" in label


@pytest.mark.parametrize("kw,msg", [
    (dict(mode="sometimes"), "mode 'sometimes': expected one of persistent, per-update"),
    (dict(mode="persistent", bucket_gib=0), "bucket_gib must be a finite number of GiB > 0"),
    (dict(mode="persistent", bucket_gib=math.inf), "bucket_gib must be a finite number of GiB > 0"),
    (dict(mode="persistent", bucket_gib=True), "bucket_gib must be a finite number of GiB > 0"),
    (dict(mode="persistent", bucket_gib="8"), "bucket_gib must be a finite number of GiB > 0"),
    (dict(mode="persistent", mem_fraction=1.5), "mem_fraction must be in (0, 1]"),
    (dict(mode="persistent", mem_fraction=math.nan), "mem_fraction must be in (0, 1]"),
    (dict(mode="per-update", reps=0), "reps must be an integer >= 1"),
    (dict(mode="per-update", warmup=-1), "warmup must be an integer >= 0"),
    (dict(mode="per-update", reps=True), "reps must be an integer >= 1"),
])
def test_peer_config_refuses_bad_values_naming_them(kw, msg):
    with pytest.raises(ValueError, match="checkpoint-engine") as e:
        PeerConfig(**kw)
    assert msg in str(e.value)


def test_peer_configs_run_persistent_first_and_once_each():
    per, small, big = PeerConfig(mode="per-update"), PeerConfig(mode="persistent", bucket_gib=0.5), \
        PeerConfig(mode="persistent")
    # the persistent ones share one server and its process group, so they run together, first
    assert check_configs([per, small, big]) == [small, big, per]
    with pytest.raises(ValueError, match="repeat"):
        check_configs([big, PeerConfig(mode="persistent")])
    with pytest.raises(ValueError, match="must be PeerConfig"):
        check_configs([{"mode": "persistent"}])


def _bucket(named: dict[str, torch.Tensor], offset: int = 0) -> tuple[list, torch.Tensor]:
    """A bucket laid out as checkpoint-engine's parameter server lays it out, and its payload."""
    from checkpoint_engine.data_types import ParameterMeta
    from checkpoint_engine.pin_memory import _align_size
    from checkpoint_engine.ps import _to_named_tensor

    metas = [ParameterMeta(name=n, dtype=t.dtype, shape=t.shape, aligned_size=_align_size(t.dtype, t.shape))
             for n, t in named.items()]
    buffer = torch.zeros(offset + sum(m.aligned_size for m in metas), dtype=torch.uint8)
    payload = _to_named_tensor(metas, offset)
    for item, t in zip(payload, named.values()):
        buffer[item["offset"]:item["offset"] + t.nbytes] = t.reshape(-1).view(torch.uint8)
    return payload, buffer


def test_receiver_copies_checkpoint_engines_bucket_into_place():
    pytest.importorskip("checkpoint_engine", reason="checkpoint-engine is installed with the GPU wheels")
    from checkpoint_engine.worker import _extract_weights  # its receiver's view of a bucket

    g = torch.Generator().manual_seed(0)
    src = {"model.embed_tokens.weight": torch.randn(33, 8, generator=g).to(torch.bfloat16),
           "model.norm.weight": torch.randn(8, generator=g).to(torch.bfloat16),
           "model.layers.0.mlp.down_proj.weight": torch.randn(8, 5, generator=g).to(torch.bfloat16)}
    dest = {n: torch.zeros_like(t) for n, t in src.items()}
    copier = Copier(dest)
    first, second = dict(list(src.items())[:2]), dict(list(src.items())[2:])
    for part, offset in ((first, 0), (second, 512)):  # the second bucket in the other slot of its buffer
        payload, buffer = _bucket(part, offset)
        copier(_extract_weights(payload, buffer))
    for n in src:
        assert torch.equal(dest[n], src[n]), n
    assert copier.stats["tensors"] == 3 and copier.stats["buckets"] == 2
    assert copier.stats["bytes"] == sum(t.nbytes for t in src.values())

    payload, buffer = _bucket({"model.norm.weight": torch.ones(9, dtype=torch.bfloat16)})
    with pytest.raises(ValueError, match=r"model.norm.weight as \(9,\) torch.bfloat16; the receiver holds \(8,\)"):
        copier(_extract_weights(payload, buffer))
    payload, buffer = _bucket({"lm_head.weight": torch.ones(4, dtype=torch.bfloat16)})
    with pytest.raises(KeyError, match="lm_head.weight, which the receiver does not hold"):
        copier(_extract_weights(payload, buffer))


def test_receiver_takes_the_socket_of_its_own_gpu():
    paths = {"GPU-a": "ipc://@checkpoint-engine-GPU-a-0.sock", "GPU-b": "ipc://@checkpoint-engine-GPU-b-0.sock"}
    assert pick_handle(paths, "GPU-b") == paths["GPU-b"]
    with pytest.raises(KeyError, match="no socket for this GPU \\(GPU-c\\); it offered GPU-a, GPU-b"):
        pick_handle(paths, "GPU-c")


def test_update_log_is_read_for_bucket_size_buffer_and_timeline():
    # the lines as checkpoint-engine 0.4.2's ParameterServer writes them (ps.py)
    lines = [(0.001, "[rank0] use h2d buffer"),
             (0.002, "[rank0] auto detect bucket size 8.00 GiB"),
             (0.010, "[rank0] begin to update bucket 1/2 receiver_rank 0 in checkpoint bench, bucket_size: "
                     "8192.00MiB, length: 170. Current device allocated 1.00 MB, reserved 2.00 MB."),
             (0.190, "[rank0] begin to update bucket 2/2 receiver_rank 0 in checkpoint bench, bucket_size: "
                     "6333.25MiB, length: 169. Current device allocated 1.00 MB, reserved 2.00 MB.")]
    got = read_update_log(lines)
    assert (got["bucket_gib"], got["h2d_buffer"]) == (8.0, True)
    assert [(b["index"], b["of"], b["start_s"], b["MiB"], b["tensors"]) for b in got["buckets"]] == [
        (1, 2, 0.010, 8192.0, 170), (2, 2, 0.190, 6333.25, 169)]
    assert read_update_log([(0.0, "[rank0] disable h2d buffer when max_tensor_bytes 1 is larger")])["h2d_buffer"] is False


@pytest.mark.parametrize("argv,msg", [(["--models", "qwen2-70b"], "unknown model qwen2-70b; expected some of"),
                                      (["--layers", "0"], "--layers must be >= 1")])
def test_bench_gpu_refuses_bad_arguments(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        bench_gpu.main(argv)
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_receiver_digests_from_the_config_dict_as_from_qwen2config():
    config = demo_config(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=48, max_position_embeddings=16,
                         tie_word_embeddings=True)
    g = torch.Generator().manual_seed(1)
    state = {s.name: torch.randn(s.shape, generator=g).to(torch.bfloat16)
             for s in expected_hf_specs(config, torch.bfloat16)}
    want = expected_digest(state, config, torch.bfloat16)
    assert expected_digest(state, digest_config(config.to_dict()), torch.bfloat16) == want
    state["model.norm.weight"][3] += 1  # one value off: the peer row's check would say so
    assert expected_digest(state, digest_config(config.to_dict()), torch.bfloat16) != want


# -- python -m bench.peer: its own process -------------------------------------------------------

@pytest.mark.parametrize("name", GPU_MODEL_NAMES)
def test_peer_reads_the_shapes_gpu_sync_builds_without_transformers(name):
    """The peer's process builds no Qwen2Config (transformers would lengthen the gc.collect its
    updates run): its attribute config must name exactly the tensors, shapes and order of the
    Qwen2Config bench.gpu_sync builds, and digest them alike."""
    from colo.engine.reference.dims import dims_from_config

    for layers in (None, 2):
        ours, theirs = attr_config(name, layers), demo_config(**shapes_of(name, layers))
        assert expected_hf_specs(ours, torch.bfloat16) == expected_hf_specs(theirs, torch.bfloat16)
        assert dims_from_config(ours) == dims_from_config(theirs)
    assert len(expected_hf_specs(attr_config(name, 2), torch.bfloat16)) < len(expected_hf_specs(attr_config(name),
                                                                                                torch.bfloat16))
    with pytest.raises(ValueError, match="unknown model 'qwen2-70b'; expected one of qwen2-7b, qwen2-1.5b"):
        shapes_of("qwen2-70b")


def test_peer_times_its_default_a_persistent_group_and_each_bucket_cap():
    configs = peer_configs((0.5, 2.0), reps=4)
    assert [(c.mode, c.bucket_gib, c.reps, c.warmup) for c in configs] == [
        ("per-update", None, 4, 1), ("persistent", None, 4, 1), ("persistent", 0.5, 4, 1), ("persistent", 2.0, 4, 1)]
    # ParameterServer's own default is auto_pg=True: a process group made and destroyed per update
    assert bench_peer.MODES["per-update"] is True and bench_peer.MODES["persistent"] is False
    # every persistent row shares one server, so they run first; its default runs last
    assert [c.mode for c in check_configs(configs)] == ["persistent"] * 3 + ["per-update"]
    assert [c.bucket_gib for c in peer_configs()[2:]] == [0.5, 1.0, 2.0, 4.0]


@pytest.mark.parametrize("text,want", [("0.5,1,2,4", (0.5, 1.0, 2.0, 4.0)), (" 2 , 0.25", (2.0, 0.25)), ("", ()),
                                       ("8", (8.0,))])
def test_bucket_list_is_read_in_gib(text, want):
    assert parse_buckets(text) == want


@pytest.mark.parametrize("argv,line", [
    (["--buckets-gib", "0.5,x"], "--buckets-gib takes comma-separated sizes in GiB, each > 0 and at most 1 PiB "
                                 "(e.g. 0.5,1,2,4); got 'x' in '0.5,x'"),
    (["--buckets-gib", "1,,2"], "got '' in '1,,2'"),
    (["--buckets-gib", "0"], "got '0' in '0'"),
    (["--buckets-gib", "inf"], "got 'inf' in 'inf'"),
    (["--buckets-gib", "nan"], "got 'nan' in 'nan'"),
    (["--buckets-gib", "1,1.0"], "--buckets-gib names 1.0 GiB twice in '1,1.0'; expected each size once"),
    (["--reps", "0"], "--reps must be an integer >= 1, got '0'"),
    (["--reps", "1.5"], "--reps must be an integer >= 1, got '1.5'"),
    (["--layers", "-2"], "--layers must be an integer >= 1, got '-2'"),
    (["--model", "qwen2-70b"], "--model 'qwen2-70b': expected one of qwen2-7b, qwen2-1.5b"),
    (["--bucket-gib", "1"], "unrecognized arguments: --bucket-gib 1"),
])
def test_peer_refuses_bad_arguments_in_one_line(argv, line, tmp_path, capsys):
    out = tmp_path / "peer.json"
    assert bench_peer.main([str(out), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("python -m bench.peer: error: ") and line in err, err
    assert not out.exists()  # refused before anything ran or was written


def test_peer_refuses_an_out_path_it_cannot_write(tmp_path, capsys):
    assert bench_peer.main([str(tmp_path / "missing" / "peer.json")]) == 2
    assert capsys.readouterr().err == (f"python -m bench.peer: error: OUT '{tmp_path / 'missing' / 'peer.json'}': "
                                       f"its folder {tmp_path / 'missing'} is not a writable folder\n")
    assert bench_peer.main([]) == 2
    assert "the following arguments are required: out" in capsys.readouterr().err


def _row(mode, bucket, update_s, digest_ok, chosen=8.0):
    return {"label": f"{mode} {bucket}", "config": {"mode": mode, "bucket_gib": bucket}, "bucket_gib": chosen,
            "buckets_per_update": 2, "update_s": update_s, "GBps": 15.2 / update_s, "digest_ok": digest_ok}


def test_best_is_the_fastest_row_whose_bytes_arrived():
    rows = [_row("persistent", None, 0.60, True), _row("persistent", 0.5, 0.41, False, 1.02),
            _row("persistent", 2.0, 0.55, True, 2.0), _row("per-update", None, 0.90, True)]
    got = summarize(rows)
    # the 0.41 s row is faster but did not deliver the weights: never best
    assert got["best"] == {"label": "persistent 2.0", "mode": "persistent", "bucket_gib_cap": 2.0, "bucket_gib": 2.0,
                           "buckets_per_update": 2, "update_s": 0.55, "GBps": 15.2 / 0.55, "digest_ok": True}
    assert (got["default"]["mode"], got["default"]["bucket_gib_cap"], got["default"]["update_s"]) == (
        "per-update", None, 0.90)
    # its default is reported as it came out, a bad digest included; no row delivered: no best
    bad = summarize([_row("per-update", None, 0.5, False), _row("persistent", None, 0.4, None)])
    assert bad["best"] is None and bad["default"]["digest_ok"] is False
    assert summarize([]) == {"default": None, "best": None}


def test_gpu_sync_runs_the_peer_with_arguments_the_peer_takes(tmp_path):
    cmd = bench_gpu.peer_command("qwen2-1.5b", str(tmp_path / "p.json"), layers=2, reps=5)
    assert cmd[:3] == [sys.executable, "-m", "bench.peer"]
    got = bench_peer._PeerArgs().parse(cmd[3:])
    assert (got.out, got.model, got.layers, got.reps, got.buckets_gib) == (
        str(tmp_path / "p.json"), "qwen2-1.5b", 2, 5, (0.5, 1.0, 2.0, 4.0))
    assert "--layers" not in bench_gpu.peer_command("qwen2-7b", "p.json", layers=None, reps=3)


def _peer_result(rows, **extra):
    return {"kind": bench_peer.KIND, "model": "qwen2-7b", "rows": rows, **summarize(rows),
            "expected_digest": "abc", **extra}


def test_gpu_sync_reads_the_peers_result_and_says_why_there_is_none(tmp_path):
    path = tmp_path / "peer.json"
    got = bench_gpu.read_peer_result(str(path), 137)
    assert got == {"error": f"bench.peer exited 137 without writing {path} (its output is in the log above)",
                   "rows": [], "returncode": 137}
    assert "timed out without writing" in bench_gpu.read_peer_result(str(path), None)["error"]
    path.write_text("{not json")
    assert "its result" in bench_gpu.read_peer_result(str(path), 1)["error"]
    path.write_text(json.dumps({"kind": "something else", "rows": []}))
    assert bench_gpu.read_peer_result(str(path), 0)["error"].endswith(f"is not a {bench_peer.KIND} result")
    rows = [_row("persistent", None, 0.6, True), _row("per-update", None, 0.9, True)]
    path.write_text(json.dumps(_peer_result(rows)))
    got = bench_gpu.read_peer_result(str(path), 0)
    assert "error" not in got and got["returncode"] == 0 and got["best"]["update_s"] == 0.6
    assert [r["update_s"] for r in got["rows"]] == [0.6, 0.9]
    # every row delivered, yet the process failed after writing: not a clean result
    assert bench_gpu.read_peer_result(str(path), 1)["error"] == "bench.peer exited 1 after writing its result"


def test_colos_ratio_is_against_the_peers_best_and_its_default():
    colo = [{"plan": "offload-first", "transport": "packed-one-copy", "sync_s": 0.25},
            {"plan": "offload-first", "transport": "packed-pipelined", "sync_s": 0.3},
            {"plan": "sync-first", "transport": "packed-one-copy", "sync_s": 0.02}]
    rows = [_row("persistent", None, 0.6, True), _row("persistent", 0.5, 0.5, True), _row("per-update", None, 0.9, True)]
    peer = _peer_result(rows)
    ratios = bench_gpu.peer_ratios(peer, colo, want_digest="abc")
    assert ratios == pytest.approx({"checkpoint_engine_best_over_colo_offload_first_one_copy": 2.0,
                                    "checkpoint_engine_best_over_colo_offload_first": 0.5 / 0.3,
                                    "checkpoint_engine_default_over_colo_offload_first_one_copy": 3.6,
                                    "checkpoint_engine_default_over_colo_offload_first": 3.0})
    assert [r["over_colo_offload_first_one_copy"] for r in peer["rows"]] == pytest.approx([2.4, 2.0, 3.6])
    assert peer["same_weights_as_colo"] is True and bench_gpu.peer_ok(peer)
    # a default that did not deliver gets no ratio; other weights than colo's void the peer
    rows[2]["digest_ok"] = False
    peer = _peer_result(rows)
    assert set(bench_gpu.peer_ratios(peer, colo, want_digest="other")) == {
        "checkpoint_engine_best_over_colo_offload_first_one_copy", "checkpoint_engine_best_over_colo_offload_first"}
    assert peer["same_weights_as_colo"] is False and not bench_gpu.peer_ok(peer)
    assert not bench_gpu.peer_ok({"error": "boom", "rows": []})
    assert bench_gpu.peer_ok(None) and bench_gpu.peer_ok({"skipped": "not installed", "rows": []})
    summary = bench_gpu.peer_summary(_peer_result([_row("per-update", None, 0.9, True)]))
    assert summary["best"]["update_s"] == summary["default"]["update_s"] == 0.9


@pytest.mark.skipif(importlib.util.find_spec("checkpoint_engine") is not None,
                    reason="checkpoint-engine is installed here: the skip path cannot be taken")
def test_missing_checkpoint_engine_skips_the_peer_in_its_own_process(tmp_path, capfd):
    """The peer's own process, for real: without checkpoint-engine it writes a skipped result
    saying why, and bench.gpu_sync reads it as skipped, not as a failure of its rows."""
    got = bench_gpu.run_peer_process("qwen2-1.5b", layers=1, reps=1, folder=str(tmp_path))
    reason = ("checkpoint-engine is not importable (No module named 'checkpoint_engine'); "
              "pip install checkpoint-engine, or --no-peer")
    assert got["skipped"] == reason and got["rows"] == [] and got["returncode"] == 1
    assert (got["kind"], got["model"], got["layers"]) == (bench_peer.KIND, "qwen2-1.5b", 1)
    assert got["pid"] != os.getpid()  # measured (here: refused) in a process of its own
    err = capfd.readouterr().err
    assert f"python -m bench.peer: {reason}" in err and f"checkpoint-engine (qwen2-1.5b) skipped: {reason}" in err
    assert bench_gpu.peer_ok(got) and bench_gpu.peer_summary(got) == reason
    assert bench_gpu.peer_ratios(got, [{"plan": "offload-first", "transport": "packed-one-copy", "sync_s": 0.3}]) == {}
