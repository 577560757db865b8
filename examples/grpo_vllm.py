"""A GRPO-style loop: vLLM samples a group of completions per prompt, each is scored, the
advantages are normalised within its group, and a Hugging Face model takes the
policy-gradient step. colo only hands the device over between the two, with every sync of
the new weights verified in vLLM.

    tools/vllm-env python examples/grpo_vllm.py CHECKPOINT_DIR [--steps N] [--trace PATH]

CHECKPOINT_DIR is any local Qwen2, Qwen3 or Llama checkpoint (config.json + safetensors). The
task: make tokens of the lowest eighth of the vocabulary; chance is 0.125.
"""

import argparse

import torch
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

import colo
from colo import MemoryLedger, Scheduler, TraceWriter, VllmEngine, make_transport
from colo.engine.vllm import BACKEND, EXTENSION
from colo.trainers import build

PROMPTS, GROUP, PROMPT_LEN, NEW = 8, 4, 8, 12


def rewards_of(completions: list[list[int]], vocab: int) -> torch.Tensor:
    return torch.tensor([sum(t < vocab // 8 for t in c) / len(c) for c in completions])


def grpo_loss(model, prompts: list[list[int]], completions: list[list[int]], rewards: torch.Tensor) -> torch.Tensor:
    groups = rewards.view(-1, GROUP)  # a prompt's GROUP completions are consecutive
    advantages = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)).flatten()
    ids = torch.tensor([p + c for p, c in zip(prompts, completions)])
    logits = model(ids).logits[:, PROMPT_LEN - 1:-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, PROMPT_LEN:, None]).squeeze(-1)
    return -(advantages[:, None] * logp).mean()


def main(checkpoint: str, steps: int, trace: str) -> list[float]:
    trainer, _ = build("hf", checkpoint=checkpoint, engine_dtype="float32", device="cpu")
    trainer.opt.param_groups[0]["lr"] = 5e-3
    vocab = trainer.model.config.vocab_size
    llm = LLM(model=checkpoint, worker_extension_cls=EXTENSION, weight_transfer_config={"backend": BACKEND},
              skip_tokenizer_init=True, enforce_eager=True, dtype="float32", max_model_len=256,
              gpu_memory_utilization=0.2, block_size=32)  # what vLLM needs on a CPU
    g = torch.Generator().manual_seed(0)
    means = []
    with colo.blocking() as loop:
        engine = loop.call(VllmEngine.attach, llm)
        verify, probe = colo.verifier(trainer, engine, trainer.model.config)
        sched = loop.enter(Scheduler(trainer, engine, MemoryLedger(total_bytes=4 << 30), make_transport("packed"),
                                     trace=TraceWriter(trace), verify=verify, probe=probe))
        sched.to_rollout()
        for step in range(steps):
            prompts = torch.randint(0, vocab, (PROMPTS, PROMPT_LEN), generator=g).tolist()
            params = SamplingParams(n=GROUP, max_tokens=NEW, temperature=1.0, seed=step, ignore_eos=True,
                                    detokenize=False)
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
            grouped = [(list(o.prompt_token_ids), list(c.token_ids)) for o in outs for c in o.outputs]
            rewards = rewards_of([c for _, c in grouped], vocab)
            means.append(rewards.mean().item())
            sched.to_train(reward=means[-1], tokens=NEW * len(grouped))
            loss = grpo_loss(trainer.model, *zip(*grouped), rewards)
            loss.backward()
            trainer.opt.step()
            trainer.opt.zero_grad(set_to_none=True)
            sched.to_rollout()  # offload, wake vLLM's weights, sync and verify, KV cache back
            print(f"step {step:2d}: mean reward {means[-1]:.3f} (chance 0.125), loss {loss.item():+.4f}, "
                  f"vLLM at weight version {sched.engine_version}", flush=True)
        loop.call(engine.aclose)
    print(f"first 3 steps {sum(means[:3]) / 3:.3f}, last 3 {sum(means[-3:]) / 3:.3f}; "
          f"trace {trace} replays clean: {colo.replay([trace]).valid}")
    return means


if __name__ == "__main__":  # vLLM's engine process imports this file again
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--trace", default="traces/grpo.jsonl")
    a = ap.parse_args()
    main(a.checkpoint, a.steps, a.trace)
