"""Loading a user's checkpoint: a local Hugging Face directory saved by transformers here
(nothing is downloaded), loaded by colo's trainers, and every bad directory refused in one
line that names it, before any trainer, process group or engine exists."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from colo.core.errors import CheckpointError, UnsupportedArchitecture
from colo.models.checkpoint import inspect
from tests.archs import CASES, save_checkpoint, tiny_config


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """case -> (directory, the model saved there)"""
    out = {}
    for i, case in enumerate(sorted(CASES)):
        path = tmp_path_factory.mktemp(case)
        out[case] = (str(path), save_checkpoint(path, tiny_config(case), seed=10 + i))
    return out


def params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_hf_and_fsdp_trainers_start_from_the_checkpoints_weights(checkpoints, case):
    from colo.trainers import build

    path, saved = checkpoints[case]
    ckpt = inspect(path)
    assert ckpt.arch.model_type == CASES[case][0] and ckpt.config["model_type"] == CASES[case][0]
    want = params(saved)
    for kind in ("hf", "fsdp"):
        trainer, saver = build(kind, checkpoint=path, engine_dtype="float32", device="cpu")
        try:
            assert saver is None
            got = trainer.hf_state()
            assert sorted(got) == sorted(want)
            assert all(torch.equal(got[n].float(), want[n]) for n in want), kind
            assert type(trainer.model.config).__name__ == type(saved.config).__name__
        finally:
            trainer.close()


def test_a_loaded_checkpoint_trains_and_computes_transformers_logits(checkpoints):
    from colo.trainers import build
    from tests.conftest import fixed_batch

    path, saved = checkpoints["qwen3"]
    trainer, _ = build("hf", checkpoint=path, engine_dtype="float32", device="cpu")
    try:
        tokens = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(2)).tolist()
        with torch.no_grad():
            want = saved(torch.tensor(tokens)).logits.float()
        assert torch.equal(trainer.logits(tokens), want)
        trainer._reinforce(fixed_batch(saved.config))
        assert not torch.equal(trainer.logits(tokens), want)  # the step moved the weights
    finally:
        trainer.close()


def test_model_config_and_checkpoint_are_one_or_the_other(checkpoints):
    from colo.trainers import build

    for kw in ({}, {"model_config": tiny_config("qwen2"), "checkpoint": checkpoints["qwen2"][0]}):
        with pytest.raises(ValueError, match="give exactly one"):
            build("hf", engine_dtype="float32", device="cpu", **kw)


def test_an_architecture_the_table_lacks_is_refused_for_a_config_too():
    from transformers import GPT2Config

    from colo.trainers import build

    with pytest.raises(UnsupportedArchitecture, match="model_type 'gpt2' is not an architecture colo supports"):
        build("hf", model_config=GPT2Config(), seed=0, engine_dtype="float32", device="cpu")


# -- bad directories: one line each, naming the directory ---------------------------------------

def _copy(checkpoints, tmp_path, case="llama"):
    dst = tmp_path / "ckpt"
    shutil.copytree(checkpoints[case][0], dst)
    return dst


def _edit_config(path, **fields):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(fields)
    (path / "config.json").write_text(json.dumps(cfg))


def _rewrite_weights(path, change):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(path / "model.safetensors"))


BAD = {
    "missing": (lambda p: p / "nowhere", "does not exist"),
    "a file": (lambda p: (p / "config.json"), "is not a directory"),
    "no config.json": (lambda p: ((p / "config.json").unlink(), p)[1], "has no config.json: not a Hugging Face"),
    "config.json not JSON": (lambda p: ((p / "config.json").write_text("{"), p)[1], "config.json is not readable JSON"),
    "unsupported": (lambda p: (_edit_config(p, model_type="gpt2"), p)[1],
                    "model_type 'gpt2' is not an architecture colo supports; supported: qwen2, qwen3, llama"),
    "a bias the table lacks": (lambda p: (_edit_config(p, attention_bias=True), p)[1], "attention_bias=True"),
    "no weights": (lambda p: ((p / "model.safetensors").unlink(), p)[1], "holds no *.safetensors files"),
    "a tensor missing": (lambda p: (_rewrite_weights(p, lambda t: t.pop("model.layers.1.mlp.up_proj.weight")), p)[1],
                         "missing model.layers.1.mlp.up_proj.weight"),
    "an extra tensor": (lambda p: (_rewrite_weights(p, lambda t: t.update(extra=torch.zeros(2))), p)[1],
                        "unexpected extra"),
    "shapes not the config's": (lambda p: (_edit_config(p, intermediate_size=96), p)[1],
                                "wrong shape: model.layers.0.mlp.gate_proj.weight (128, 64) (the config gives (96, 64))"),
}


@pytest.mark.parametrize("what", sorted(BAD))
def test_a_bad_checkpoint_is_refused_by_the_trainer_before_anything_starts(checkpoints, tmp_path, what):
    import torch.distributed as dist

    from colo.trainers import build

    make, message = BAD[what]
    path = make(_copy(checkpoints, tmp_path))
    for kind in ("hf", "fsdp"):
        with pytest.raises((CheckpointError, UnsupportedArchitecture)) as e:
            build(kind, checkpoint=str(path), engine_dtype="float32", device="cpu")
        text = str(e.value)
        assert message in text and "\n" not in text and e.value.exit_code == 2
        assert str(path) in text
        assert not dist.is_initialized()  # FSDP's process group was never started


@pytest.mark.parametrize("what", ["missing", "no config.json", "unsupported", "shapes not the config's"])
def test_colo_demo_refuses_a_bad_checkpoint_in_one_line_with_exit_2(checkpoints, tmp_path, capsys, what):
    from colo.cli import main

    make, message = BAD[what]
    path = make(_copy(checkpoints, tmp_path))
    trace = tmp_path / "run.jsonl"
    assert main(["demo", "--checkpoint", str(path), "--steps", "1", "--quiet", "--trace", str(trace)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("colo demo: checkpoint ") and message in err and len(err.splitlines()) == 1
    assert not trace.exists()  # nothing started


def test_colo_demo_refuses_checkpoint_with_another_model_size(checkpoints, capsys):
    from colo.cli import main

    assert main(["demo", "--checkpoint", checkpoints["llama"][0], "--model", "qwen2-1.5b"]) == 2
    assert "--checkpoint and --model qwen2-1.5b both name the model: give one" in capsys.readouterr().err
    assert main(["demo", "--checkpoint", checkpoints["llama"][0], "--gpus", "2"]) == 2
    assert "--checkpoint drives one rank" in capsys.readouterr().err


def test_colo_demo_trains_a_llama_checkpoint_and_verifies_every_sync(checkpoints, tmp_path):
    """The whole loop on a user's checkpoint: colo's engine starts from it, every sync's digest
    equals the trainer's and the probe's logits are the trainer's, and the trace replays clean."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    trace = tmp_path / "run.jsonl"
    proc = subprocess.run([sys.executable, "-m", "colo.cli", "demo", "--checkpoint", checkpoints["llama"][0],
                           "--steps", "3", "--quiet", "--trace", str(trace)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(repo)})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    syncs = [e for e in events if e["event"] == "sync.finished"]
    assert len(syncs) == 3 and all(s["digest"] and s["verify_s"] is not None for s in syncs)
    assert events[0]["config"]["model"]["model_type"] == "llama"
    assert events[0]["config"]["demo"]["checkpoint"] == checkpoints["llama"][0]
    replay = subprocess.run([sys.executable, "-m", "colo.cli", "replay", str(trace)], capture_output=True, text=True,
                            cwd=repo)
    assert replay.returncode == 0, replay.stdout + replay.stderr
