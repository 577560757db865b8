"""GRPO that trains only a LoRA adapter (PEFT, the model frozen): vLLM samples groups with the
current adapter; after each step colo sends the adapter's tensors into vLLM's worker in memory,
and vLLM serves the new version only once the worker's digest of them equals the trainer's.

    tools/vllm-env python examples/grpo_lora_vllm.py CHECKPOINT_DIR [--steps N] [--rank R]

CHECKPOINT_DIR: a local Qwen2, Qwen3 or Llama checkpoint. The task: tokens of the lowest eighth of the
vocabulary (chance 0.125). At the end vLLM's greedy tokens are checked against the PEFT-merged model."""

import argparse

import anyio
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from transformers import AutoModelForCausalLM
from vllm import SamplingParams
from vllm.inputs import TokensPrompt

from colo import VllmEngine
from colo.digest import expected_weights_digest
from colo.models.lora import AdapterConfig
from grpo_vllm import GROUP, NEW, PROMPT_LEN, PROMPTS, grpo_loss, rewards_of  # the same GRPO, beside this file

LR = 2e-2  # an adapter's step: larger than a whole model's
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    for _ in range(n):
        ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return ids[0, len(prompt):].tolist()


async def main(checkpoint: str, steps: int, rank: int, seed: int) -> None:
    base = AutoModelForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float32)
    vocab, lora = base.config.vocab_size, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS)
    torch.manual_seed(seed)  # PEFT draws A from torch's global generator
    policy = get_peft_model(base, lora)
    config = AdapterConfig.from_peft(policy.peft_config["default"])  # what colo syncs: plain LoRA
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=LR)
    engine = await VllmEngine.start(checkpoint, enable_lora=True, max_lora_rank=rank, max_loras=1, max_cpu_loras=3,
                                    skip_tokenizer_init=True, enforce_eager=True, dtype="float32", max_model_len=256,
                                    gpu_memory_utilization=0.2, block_size=32)  # what vLLM needs on a CPU
    dtype, llm = getattr(torch, await engine.adapter_dtype()), engine.llm  # the loop samples with vLLM's own LLM

    async def sync(version: int) -> None:
        # the adapter's tensors, converted once to the dtype vLLM keeps adapters in
        adapter = {n: t.detach().to(dtype) for n, t in get_peft_model_state_dict(policy).items()}
        await engine.stage_adapter(adapter, version, config)  # served below only if vLLM got exactly these bytes
        await engine.activate_adapter(version, digest=expected_weights_digest(adapter, list(adapter), dtype))

    g, means = torch.Generator().manual_seed(seed), []
    try:
        await sync(1)  # the adapter as PEFT made it (B = 0: the base model's outputs)
        for step in range(steps):
            prompts = torch.randint(0, vocab, (PROMPTS, PROMPT_LEN), generator=g).tolist()
            params = SamplingParams(n=GROUP, max_tokens=NEW, temperature=1.0, seed=step, ignore_eos=True,
                                    detokenize=False)
            outs = await anyio.to_thread.run_sync(lambda: llm.generate(
                [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False,
                lora_request=engine.lora_request()))
            grouped = [(list(o.prompt_token_ids), list(c.token_ids)) for o in outs for c in o.outputs]
            rewards = rewards_of([c for _, c in grouped], vocab)
            means.append(rewards.mean().item())
            loss = grpo_loss(policy, *zip(*grouped), rewards)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            await sync(step + 2)  # the new version, verified, then served
            print(f"step {step:2d}: mean reward {means[-1]:.3f} (chance 0.125), loss {loss.item():+.4f}, "
                  f"vLLM serving adapter v{engine.active_adapter}", flush=True)
        probe = torch.randint(0, vocab, (3, PROMPT_LEN), generator=g).tolist()
        merged = policy.merge_and_unload().eval()  # training is over: B A folded into the weights
        with torch.no_grad():
            same = await engine.tokens(probe, max_new_tokens=8) == [greedy(merged, p, 8) for p in probe]
    finally:
        await engine.aclose()
    print(f"first 3 steps {sum(means[:3]) / 3:.3f}, last 3 {sum(means[-3:]) / 3:.3f}; vLLM's greedy tokens with "
          f"the last adapter equal transformers' on the merged model: {same}")


if __name__ == "__main__":  # vLLM's engine process imports this file again
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    anyio.run(main, a.checkpoint, a.steps, a.rank, a.seed)
