"""The GPU benchmark's CPU-checkable parts: the Qwen2-1.5B shape table against transformers,
and the checkpoint-engine peer's configuration and receiver (its own wire layout, on CPU tensors)."""

from __future__ import annotations

import math
import sys

import pytest
import torch
from transformers import Qwen2ForCausalLM

from bench import gpu_sync as bench_gpu
from bench.peer import Copier, PeerConfig, check_configs, digest_config, pick_handle, read_update_log
from colo.engine.weights import expected_digest, expected_hf_specs
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



def test_missing_checkpoint_engine_skips_the_peer_saying_why(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "checkpoint_engine", None)  # import fails as if not installed
    got = bench_gpu.run_peer_row(None, {}, "digest", [PeerConfig(mode="persistent")], 1.0)
    assert got["rows"] == [] and "checkpoint-engine is not importable" in got["skipped"]
    assert "--no-peer" in got["skipped"] and got["skipped"] in capsys.readouterr().err
