"""Where an adapter sync's time goes, engine side included, in one process (issue 43).

    python -m bench.adapter_profile OUT.txt [--model qwen2-1.5b] [--rank 8] [--device cuda] [--reps 5]

The adapter (rank R on every dense linear, bf16) lies in one flat buffer, paused on a GPU into
its shared pinned backup as ``colo bench --lora-rank``'s source; the packed transport's one-copy
sync sends it to colo's engine's adapter host (``colo.engine.adapter_host``: the stage, its kit,
colo's ``EngineAdapters`` over a real ``EngineCore`` on the device) held in this same process, so
that one ``cProfile`` sees the sender's and the receiver's Python together. No socket and no
second process: what is left of ``colo bench``'s engine-side ``load`` is their round trips.
Writes the median sync time, the adapter's bytes, and the profile's top functions by own time
and by cumulative time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from typing import Any

import anyio
import torch


async def main(out: str, model: str, rank: int, device: str, reps: int) -> None:
    from colo.apps.bench import MODELS, AdapterSource
    from colo.core.interfaces import SyncContext
    from colo.core.memory import StagingBudget
    from colo.engine.adapter_host import AdapterHost
    from colo.core.interfaces import EngineCapabilities
    from colo.engine.adapters import AdapterEngine, AdapterVersions
    from colo.engine.reference.adapters import EngineAdapters
    from colo.engine.reference.core import EngineCore
    from colo.trainers.models import demo_config
    from colo.transports import make_transport

    bench_model = MODELS[model]
    config = demo_config(**bench_model.config)
    core = EngineCore(config, dtype=bench_model.engine_dtype, device=device, total_bytes=64 << 30,
                      mem_fraction_static=0.1)
    host = AdapterHost(EngineAdapters(core))

    class InProcess(AdapterVersions):
        async def _adapter_op(self, op: str, *args: Any) -> dict:
            return getattr(host, op)(*args)

        async def set_weight_version(self, version: int | None) -> None:
            pass  # the core holds no base weights here: only its adapters are profiled

    inner = InProcess()
    inner.init_adapters()
    inner.capabilities = EngineCapabilities()
    # as colo demo and colo bench drive it: one object across stages, so the sender's layout memo
    # sends a layout the engine holds by its key
    engine = AdapterEngine(inner, None)
    source = AdapterSource(config, rank, dtype=bench_model.engine_dtype, device=device)
    transport = make_transport("packed")
    times: list[float] = []
    profile = cProfile.Profile()
    try:
        for i in range(reps + 1):
            engine.config = source.config
            ctx = SyncContext(step=i, weight_version=i, bucket_bytes=512 << 20, source="host",
                              staging=StagingBudget(None), flush_cache=False)
            if i:
                profile.enable()
            t0 = time.perf_counter()
            result = await transport.sync(source, engine, ctx)
            if device == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - t0
            profile.disable()
            digest = await engine.digest()
            await engine.set_weight_version(i + 1)
            if i:
                times.append(elapsed)
    finally:
        await transport.aclose()
        host.close()
        source.close()
    text = io.StringIO()
    text.write(f"{model} rank {rank} on {device} ({torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}), "
               f"torch {torch.__version__}: {result.bytes} bytes, {result.tensors} tensors, {result.buckets} "
               f"request(s), digest {digest[:16]}; sync ms {[round(t * 1e3, 2) for t in times]}, median {statistics.median(times) * 1e3:.2f}\n")
    for key in ("tottime", "cumulative"):
        text.write(f"\n== by {key}, {reps} syncs\n")
        pstats.Stats(profile, stream=text).sort_stats(key).print_stats(25)
    with open(out, "w", encoding="utf-8") as f:
        f.write(text.getvalue())
    print(text.getvalue()[:4000])


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("out")
    ap.add_argument("--model", default="qwen2-1.5b")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    anyio.run(main, a.out, a.model, a.rank, a.device, a.reps)
