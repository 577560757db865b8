"""The handoff around a loop of the user's own on a GPU (issue 41): colo's hf trainer loaded
from a checkpoint directory (bf16 parameters, fp32 masters in the memory saver), colo's
engine in a process of its own (memory-saver tags), the user's rollout (the engine's own
generate) and the user's step (a policy-gradient loss on the trainer's model and optimizer)
between ``to_train()`` and ``to_rollout()``. Run in a process of its own, as the memory saver
wants one trainer per process."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.gpu.test_one_gpu import replay_clean

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
REPO = Path(__file__).resolve().parents[2]

_LOOP = r"""
import json, sys
import anyio, torch
import colo
from colo import EngineClient, Scheduler, TraceWriter, make_transport
from colo.device.cuda_memory import cuda_ledger
from colo.tasks import make_task
from colo.trainers import build
from colo.trainers.models import build_trainer_model, demo_model_config

ckpt, trace, out = sys.argv[1], sys.argv[2], sys.argv[3]
config = demo_model_config("demo")
build_trainer_model(config, seed=3).save_pretrained(ckpt)

async def main():
    trainer, saver = build("hf", checkpoint=ckpt, engine_dtype="bfloat16", device="cuda")
    await trainer.offload(["weights", "optimizer"])  # colocated start: the engine starts beside an offloaded trainer
    task = make_task("reinforce", vocab_size=config.vocab_size, batch=8, prompt_len=8, new_tokens=8, seed=0)
    free, total = torch.cuda.mem_get_info()
    engine = await EngineClient.spawn({"config": config.to_dict(), "dtype": "bfloat16", "device": "cuda",
                                       "total_bytes": total, "mem_fraction_static": 0.3, "memory": "saver",
                                       "checkpoint": None, "log_path": trace + ".engine.log"}, task=task)
    seen = []
    try:
        memory = cuda_ledger(accounted_bytes=sum(engine.tag_bytes().values()))
        verify, probe = colo.verifier(trainer, engine, trainer.model.config)
        async with Scheduler(trainer, engine, memory, make_transport("packed"), engine_synced=False,
                             trace=TraceWriter(trace), verify=verify, probe=probe) as sched:
            await sched.to_rollout()
            for step in range(3):
                rollout = await engine.generate(step)                     # the user's rollout
                await sched.to_train(reward=rollout.reward, tokens=rollout.tokens)
                data = rollout.data                                        # the user's step
                ids = torch.tensor([p + c for p, c in zip(data.prompts, data.completions)], device="cuda")
                logits = trainer.model(ids).logits[:, 7:-1].float()
                logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 8:, None]).squeeze(-1)
                adv = torch.tensor(data.rewards, device="cuda")
                (-((adv - adv.mean())[:, None] * logp).mean()).backward()
                trainer.opt.step()
                trainer.opt.zero_grad(set_to_none=True)
                await sched.to_rollout()
                seen.append({"version": sched.engine_version, "digest": await engine.digest(),
                             "trainer": trainer.sent_digest(fresh=True)})
    finally:
        await engine.aclose()
        for key in sorted(saver.paused):
            saver.resume(key)
    json.dump(seen, open(out, "w"))

anyio.run(main)
# torch_memory_saver tears its pools down at interpreter exit, outside any region, and its torch
# hook then ends the process with status 1 whatever it returned (colo's own commands end so too)
from colo.device.cuda_memory import exit_past_the_saver
exit_past_the_saver(0)
"""


def test_a_users_loop_on_a_gpu_syncs_a_checkpoints_trained_weights_verified(tmp_path):
    trace, out = tmp_path / "t.jsonl", tmp_path / "seen.json"
    proc = subprocess.run([sys.executable, "-c", _LOOP, str(tmp_path / "ckpt"), str(trace), str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    seen = json.loads(out.read_text())
    assert [s["version"] for s in seen] == [1, 2, 3]
    assert all(s["digest"] == s["trainer"] for s in seen) and len({s["digest"] for s in seen}) == 3
    events = replay_clean(trace)
    # the engine released its memory for the user's step, for real (the saver freed it)
    paused = [e for e in events if e["event"] == "memory.paused" and e["owner"] == "engine"]
    assert {e["tag"] for e in paused} >= {"weights", "kv_cache"} and not any(e.get("freed") is False for e in paused)
    assert [e["reward"] for e in events if e["event"] == "rollout.finished"] and events[-1]["event"] == "trace.finished"
