"""How fast colo's engine rolls out the demo's batch, against a real vLLM on the same batch (issue 41, item 5).

The demo's rollout, as its ``rollout`` phase runs it: the demo model (seed 0, float32), the
demo task's prompts (32 prompts of 8 tokens, 24 new tokens each, temperature 1), one
``generate(step)`` of colo's ``EngineSide`` per rep. Both engines load the same weights from
one model directory and are asked for the same steps' prompts, rep after rep in turn (colo's,
then vLLM's), so that load from other work on the machine falls on both alike:

- ``colo``: colo's engine in a process of its own, as ``colo demo`` runs it (the request and
  its JSON reply over the engine's channel included), at its CPU default of one thread;
- ``colo-2-threads``: the same with ``threads: 2`` in its build (torch's default on two cores);
- ``colo-bfloat16``: colo's engine in bfloat16, one thread (the CPU demo's dtype before);
- ``vllm``: a real vLLM (``VllmEngine.start``, in this process, the settings ``colo demo
  --engine vllm`` gives it on a CPU).

Each engine answers one warm-up rollout first. Before the timing both answer the same
prompts greedily and the share of equal tokens is recorded: the two hold the same model.

    tools/vllm-env python -m bench.rollout_speed OUT.json [--reps 10]
    python -m bench.rollout_speed OUT.json --engines colo,colo-2-threads   # no vLLM needed
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: the engines this benchmark can time, by name: (engine, dtype, build["threads"])
ENGINES = {"colo": ("colo", "float32", None), "colo-2-threads": ("colo", "float32", 2),
           "colo-bfloat16": ("colo", "bfloat16", None), "vllm": ("vllm", "float32", None)}
BATCH, PROMPT_LEN, NEW_TOKENS = 32, 8, 24


def _cpuinfo(key: str) -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_name() -> str:
    return _cpuinfo("model name") or platform.processor() or "?"


def cpu_flags() -> list[str]:
    """The CPU's vector extensions that decide torch's float32 and bfloat16 kernels."""
    have = set(_cpuinfo("flags").split())
    return sorted(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in have)


async def start(name: str, model_dir: str, task: Any) -> Any:
    kind, dtype, threads = ENGINES[name]
    if kind == "vllm":
        from colo.engine.vllm import VllmEngine

        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        # as colo.apps.demo.start_vllm on a CPU
        return await VllmEngine.start(model_dir, task=task, skip_tokenizer_init=True, dtype="float32",
                                      max_model_len=256, max_num_seqs=BATCH, seed=0, enforce_eager=True,
                                      block_size=32, gpu_memory_utilization=0.2)
    import torch
    from safetensors.torch import load_file, save_file

    from colo.engine.reference.client import EngineClient
    from colo.trainers.models import demo_model_config

    # beside the checkpoint, not in it: vLLM's preflight reads every *.safetensors of the
    # directory as the checkpoint's and refuses a tensor found in two files
    os.makedirs(os.path.join(model_dir, "colo-engine"), exist_ok=True)
    ckpt = os.path.join(model_dir, "colo-engine", f"engine-{dtype}.safetensors")
    if not os.path.exists(ckpt):
        state = load_file(os.path.join(model_dir, "model.safetensors"))
        save_file({k: v.to(getattr(torch, dtype)).contiguous() for k, v in state.items()}, ckpt)
    # as colo.apps.demo builds it on a CPU: a simulated 256 MiB device, 0.8 of it static
    build = {"config": demo_model_config("demo").to_dict(), "dtype": dtype, "device": "cpu",
             "total_bytes": 256 << 20, "mem_fraction_static": 0.8, "checkpoint": ckpt, "memory": "free",
             "log_path": os.path.join(model_dir, f"{name}.engine.log")}
    if threads is not None:
        build["threads"] = threads
    return await EngineClient.spawn(build, task=task)


async def greedy(engine: Any, prompts: list[list[int]]) -> list[list[int]]:
    from colo.engine.reference.client import EngineClient

    if isinstance(engine, EngineClient):
        reply = await engine.call("generate", prompts=prompts, max_new_tokens=NEW_TOKENS, temperature=0.0, seed=0)
        return reply["completions"]
    return await engine.tokens(prompts, max_new_tokens=NEW_TOKENS, temperature=0.0, seed=0)


async def measure(names: list[str], reps: int) -> dict:
    from colo.tasks import make_task
    from colo.trainers.models import build_trainer_model, demo_model_config

    task = make_task("reinforce", vocab_size=demo_model_config("demo").vocab_size, batch=BATCH,
                     prompt_len=PROMPT_LEN, new_tokens=NEW_TOKENS, seed=0)
    out: dict[str, Any] = {"load_before": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="colo-rollout-speed-") as model_dir:
        # the demo's model at seed 0, saved as vLLM loads one (fp32 safetensors and its config)
        build_trainer_model(demo_model_config("demo"), seed=0).save_pretrained(model_dir, safe_serialization=True)
        engines = {}
        try:
            for name in names:
                engines[name] = await start(name, model_dir, task)
            check = task.prompts(10_000)  # prompts no timed rep uses
            answers = {name: await greedy(e, check) for name, e in engines.items()}
            first = answers[names[0]]
            out["greedy_equal_tokens"] = {
                name: sum(x == y for a, b in zip(first, got) for x, y in zip(a, b)) / (BATCH * NEW_TOKENS)
                for name, got in answers.items()}
            out["greedy_equal_tokens_against"] = names[0]
            times: dict[str, list[float]] = {name: [] for name in names}
            tokens: dict[str, int] = {}
            for rep in range(reps + 1):  # rep 0 warms each engine up, untimed
                for name, engine in engines.items():
                    t0 = time.perf_counter()
                    result = await engine.generate(rep)
                    took = time.perf_counter() - t0
                    tokens[name] = result.tokens
                    if rep:
                        times[name].append(took)
            if "vllm" in engines:
                import torch

                # the uni executor's worker runs in this process: the threads vLLM chose
                out["vllm_torch_threads"] = torch.get_num_threads()
        finally:
            for engine in engines.values():
                await engine.aclose()
    out["load_after"] = os.getloadavg()
    out["engines"] = {}
    for name in names:
        ts = times[name]
        kind, dtype, threads = ENGINES[name]
        out["engines"][name] = {"engine": kind, "dtype": dtype,
                                "threads": (threads or 1) if kind == "colo" else None,
                                "tokens_per_rollout": tokens[name], "times_s": ts,
                                "median_s": statistics.median(ts), "min_s": min(ts),
                                "tokens_per_s_median": tokens[name] / statistics.median(ts)}
    if "vllm" in names:
        base = out["engines"]["vllm"]["median_s"]
        out["median_over_vllm"] = {n: e["median_s"] / base for n, e in out["engines"].items() if n != "vllm"}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("out", help="where the JSON goes")
    p.add_argument("--reps", type=int, default=10, help="timed rollouts per engine (after one warm-up)")
    p.add_argument("--engines", default="colo,colo-2-threads,colo-bfloat16,vllm",
                   help=f"comma-separated, of {', '.join(ENGINES)}")
    p.add_argument("--date", default=None, help="the date to record (default: today, UTC)")
    args = p.parse_args(argv)
    names = [n for n in args.engines.split(",") if n]
    unknown = [n for n in names if n not in ENGINES]
    if unknown or not names or args.reps < 1:
        p.error(f"unknown engine(s) {unknown}; expected some of {', '.join(ENGINES)}" if unknown
                else "give at least one engine and --reps >= 1")
    import torch

    versions = {"torch": torch.__version__}
    if "vllm" in names:
        import vllm

        versions["vllm"] = f"vllm-cpu {vllm.__version__}"
    result = anyio.run(measure, names, args.reps)
    doc = {"kind": "rollout speed: colo's engine against vLLM on the demo's batch (bench/rollout_speed.py)",
           "date": args.date or datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
           "device": f"cpu: {cpu_name()}, {os.cpu_count()} cores", "cpu_flags": cpu_flags(), **versions,
           "python": platform.python_version(),
           "batch": {"model": "demo (Qwen2, 2.9 M parameters, seed 0)", "prompts": BATCH, "prompt_len": PROMPT_LEN,
                     "new_tokens": NEW_TOKENS, "temperature": 1.0, "task": "reinforce, seed 0, steps 0..reps"},
           "reps": args.reps, **result}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    for name, e in doc["engines"].items():
        ratio = doc.get("median_over_vllm", {}).get(name)
        print(f"{name:16s} median {e['median_s']:.3f} s  min {e['min_s']:.3f} s"
              + (f"  {ratio:.2f}x vLLM" if ratio is not None else ""))
    print(f"load average {doc['load_before']} -> {doc['load_after']}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
