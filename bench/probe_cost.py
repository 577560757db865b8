"""Where the verification probe's time goes (issue 31, item 2), on one GPU.

The probe (:func:`colo.apps.demo_setup.make_verifier`) asks the engine for its logits on a
fixed batch at a sample of vocabulary columns and compares them with the trainer's. Timed
here, each the median of ``--reps`` after one warm-up, with colo's engine in its own process
and the hf trainer (bf16 parameters) in this one:

- ``round_trip_s``: a call that does nothing on the engine (``reported_version``);
- ``engine_logits_s``: ``engine.logits(batch, columns)`` as the probe asks it;
- ``engine_logits_one_column_s``: the same forward, one column back (the payload's share);
- ``engine_digest_s``: the engine's digest, beside it;
- ``trainer_logits_s``: the trainer's own forward on the batch, full logits to the host
  (``sync-first``'s reference);
- ``reference_select_s``: the reference taken at offload, cloned and its columns picked
  (``offload-first``'s reference);
- ``probe_s``: the whole probe, as a verified sync runs it.

usage: python -m bench.probe_cost OUT.json [--model qwen2-1.5b] [--reps 10]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
from typing import Any

import anyio
import torch


async def _median(fn: Any, reps: int) -> float:
    await fn()
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        await fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


async def measure(model: str, reps: int) -> dict:
    from colo.apps.bench import MODELS
    from colo.apps.bench_trainers import engine_build
    from colo.apps.demo_setup import make_verifier, probe_batch, probe_columns
    from colo.core.interfaces import SyncContext
    from colo.core.memory import StagingBudget
    from colo.engine.reference.client import EngineClient
    from colo.trainers import build
    from colo.trainers.models import demo_config
    from colo.transports import make_transport

    config = demo_config(**MODELS[model].config)
    batch = probe_batch(config.vocab_size, 0)
    columns = probe_columns(config.vocab_size, batch, 0)
    engine = await EngineClient.spawn(engine_build(config, "bfloat16", "cuda"))
    trainer = None
    try:
        trainer, _ = build("hf", model_config=config, seed=0, engine_dtype="bfloat16", device="cuda",
                           optimizer_state=False)
        transport = make_transport("packed")
        ctx = SyncContext(step=0, weight_version=0, bucket_bytes=512 << 20, source="device",
                          staging=StagingBudget(None), flush_cache=True)
        await transport.sync(trainer, engine, ctx)
        await transport.aclose()
        out: dict[str, Any] = {}

        async def noop() -> None:
            await engine.reported_version()

        async def logits() -> None:
            await engine.logits(batch, columns=columns)

        async def logits_one() -> None:
            await engine.logits(batch, columns=[0])

        async def digest() -> None:
            await engine.digest()

        async def trainer_logits() -> None:
            trainer.logits(batch)

        ref = trainer.logits(batch)

        async def select() -> None:
            ref.clone()[..., columns]

        _, probe = make_verifier(trainer, engine, config, "bfloat16", 0, tolerance=0.1)
        for key, fn in (("round_trip_s", noop), ("engine_logits_s", logits), ("engine_logits_one_column_s", logits_one),
                        ("engine_digest_s", digest), ("trainer_logits_s", trainer_logits),
                        ("reference_select_s", select), ("probe_s", probe)):
            out[key] = await _median(fn, reps)
            print(f"{key:28s} {out[key] * 1e3:8.2f} ms", flush=True)
        return {"bench": "probe_cost", "model": model, "columns": len(columns), "batch": [len(batch), len(batch[0])],
                "vocab": config.vocab_size, "reps": reps, "date": dt.datetime.now(dt.timezone.utc).isoformat(
                    timespec="seconds"), "device_name": torch.cuda.get_device_name(),
                "gpu_count": torch.cuda.device_count(), "torch": torch.__version__, "median_s": out}
    finally:
        if trainer is not None:
            trainer.close()
        await engine.aclose()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.probe_cost", allow_abbrev=False)
    ap.add_argument("out")
    ap.add_argument("--model", default="qwen2-1.5b")
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args(argv)
    result = anyio.run(lambda: measure(a.model, a.reps))
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    from colo.device.cuda_memory import exit_past_the_saver

    return exit_past_the_saver(0)


if __name__ == "__main__":
    sys.exit(main())
