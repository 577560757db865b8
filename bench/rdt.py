"""``python -m bench.rdt``: the ``rdt`` transport's sync beside ``packed``'s, between the same two Ray actors.

``colo bench`` times syncs into an engine process of its own and starts no ranks, and
``rdt`` runs only between a rank's trainer actor and its engine actor (``--launcher
ray``). So this starts one rank the way ``colo demo --launcher ray`` does
(:func:`colo.ranks.ray_launcher.spawn_workers`, a local Ray cluster of the run's own,
stopped with it): a rank actor holding the demo's trainer (``hf``, fp32 parameters
converted to the engine's bf16 per bucket, as in ``colo bench --device cpu``) and its
engine actor (colo's engine) on one placement-group bundle, both with tensor transport.
In those two actors, for the same model and bucket size, the two transports take turns
sync by sync: ``packed`` (the bucket's ``/dev/shm`` segment handed to the engine actor in
the request's frame) and ``rdt`` (the bucket moved by Ray Direct Transport over colo's
gloo pair group). One warm-up sync each (``rdt``'s forms its pair group), then ``--reps``
timed ones; before every sync the trainer's weights change (negated), and after every
sync the engine's digest must equal the trainer's, or the run fails. Timed inside the
rank actor, from the sync's start to its last acknowledgement: no driver round trip.

    python -m bench.rdt --out bench/results/cpu-rdt-2026-11-27.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import torch

from colo.core.errors import EXIT_FAILED, EXIT_OK
from colo.ranks.host import RankHost

#: the transports timed, in the order they take turns
TRANSPORTS = ("packed", "rdt")
KIND = "colo.bench/cpu-rdt"


class TimingHost(RankHost):
    """A rank with one more verb: the transports' syncs, timed where they run."""

    def _change_weights(self) -> None:
        with torch.no_grad():
            for p in self.trainer.model.parameters():
                p.neg_()

    def _expected_digest(self) -> str:
        from colo.engine.reference.tp import expected_shard_digest

        # what the rank's verification compares (RankHost.op_expected_digest): this rank's engine
        # shard of the trainer's weights, here the whole model (one rank)
        return expected_shard_digest(self.trainer.hf_state(), self.model_config,
                                     getattr(torch, self.spec.engine_dtype), self.spec.rank, self.spec.world_size)

    async def op_time_syncs(self, transports: list[str], bucket_bytes: int, reps: int) -> dict:
        from colo.core.interfaces import SyncContext
        from colo.core.memory import StagingBudget
        from colo.transports import make_transport

        senders = {name: make_transport(name) for name in transports}
        rows: dict[str, dict] = {name: {"sync_s_all": [], "stages": [], "peaks": []} for name in transports}
        result: dict[str, Any] = {}
        try:
            for i in range(reps + 1):  # the first of each is a warm-up
                for name, sender in senders.items():
                    await anyio.to_thread.run_sync(self._change_weights)
                    pool = StagingBudget(None)  # counts only: the peak is what it measures
                    ctx = SyncContext(step=i, weight_version=i + 1, bucket_bytes=bucket_bytes, source="host",
                                      staging=pool)
                    t0 = time.perf_counter()
                    res = await sender.sync(self.trainer, self.engine, ctx)
                    elapsed = time.perf_counter() - t0
                    want = await anyio.to_thread.run_sync(self._expected_digest)
                    got = await self.engine.digest()
                    if got != want:
                        raise RuntimeError(f"{name}: sync {i}: the engine's digest {got} is not the trainer's {want}")
                    result[name] = res
                    if i:
                        # where the last timed sync's time went: each stage's end, ms from its start
                        rows[name]["timeline_ms"] = [[r.bucket, r.stage, round((r.at - t0) * 1e3, 2),
                                                      round(r.duration_s * 1e3, 2)] for r in res.stages]
                        stages: dict[str, float] = {}
                        for rec in res.stages:
                            stages[rec.stage] = stages.get(rec.stage, 0.0) + rec.duration_s
                        rows[name]["sync_s_all"].append(elapsed)
                        rows[name]["stages"].append(stages)
                        rows[name]["peaks"].append(pool.peak_bytes)
        finally:
            with anyio.CancelScope(shield=True):
                for sender in senders.values():
                    await sender.aclose()
        out = {}
        for name, row in rows.items():
            res = result[name]
            sec = statistics.median(row["sync_s_all"])
            out[name] = {"transport": name, "sync_s": sec, "sync_s_all": row["sync_s_all"], "bytes": res.bytes,
                         "GBps": res.bytes / sec / 1e9, "buckets": res.buckets, "tensors": res.tensors,
                         "peak_staging_bytes": max(row["peaks"]),
                         "stage_s_median": {k: statistics.median(s[k] for s in row["stages"])
                                            for k in row["stages"][0]},
                         "timeline_ms_last": row["timeline_ms"], "digest_ok": True}
        return {"rows": out}


async def measure(*, reps: int, bucket_mibs: list[float]) -> dict:
    from colo.ranks.host import RankSpec
    from colo.ranks.ray_launcher import spawn_workers
    from colo.trainers.models import demo_model_config

    config = demo_model_config("demo")
    root = str(Path(__file__).resolve().parents[1])
    load_before = os.getloadavg()
    cases = []
    with tempfile.TemporaryDirectory(prefix="colo-bench-rdt-") as workdir:
        spec = RankSpec(rank=0, world_size=1, device="cpu", trainer="hf", model_config=config.to_dict(), seed=0,
                        engine_dtype="bfloat16", transport="rdt", trainer_init="", engine_init="",
                        engine_build={"total_bytes": 256 << 20, "mem_fraction_static": 0.5, "memory": "free"},
                        task={"name": "reinforce", "vocab_size": config.vocab_size, "batch": 8, "prompt_len": 8,
                              "new_tokens": 8, "seed": 0},
                        workdir=workdir, host_class="bench.rdt:TimingHost")
        # the rank actor imports this module: it must find the repository (and this checkout's colo)
        path = os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])
        workers = await spawn_workers([spec], envs=[{"PYTHONPATH": path}])
        try:
            hello = await workers[0].call("start")
            for mib in bucket_mibs:
                reply = await workers[0].call("time_syncs", transports=list(TRANSPORTS),
                                              bucket_bytes=int(mib * (1 << 20)), reps=reps)
                rows = reply["rows"]
                cases.append({"bucket_mib": mib, "rows": [rows[n] for n in TRANSPORTS],
                              "rdt_over_packed": rows["rdt"]["sync_s"] / rows["packed"]["sync_s"]})
        finally:
            with anyio.CancelScope(shield=True):
                for w in workers:
                    await w.aclose()
    import ray

    from colo.apps.bench import machine_info

    return {"kind": KIND, "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "device": "cpu",
            "machine": machine_info(), "torch": torch.__version__, "ray": ray.__version__,
            # the host is shared: its load (1, 5, 15 min) before and after, beside numbers it moves
            "load_average": {"before": load_before, "after": os.getloadavg()},
            "model": {"name": "demo", "params": int(hello["num_params"]), "config": {k: getattr(config, k) for k in (
                "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads")}, "engine_dtype": "bfloat16", "source_dtype": "float32"},
            "setup": "one rank on a local Ray cluster: trainer actor and engine actor on one bundle, both with "
                     "tensor transport; the two transports take turns sync by sync in the same actors; timed "
                     "in the rank actor; every sync's engine digest checked against the trainer's",
            "warmup": 1, "repeat": reps, "cases": cases}


def main(argv: Any = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.rdt", allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=7, help="timed syncs per transport after one warm-up (default 7)")
    p.add_argument("--bucket-mib", type=float, nargs="+", default=[1.0, 8.0], metavar="MIB",
                   help="bucket sizes (default 1, the demo's: 7 buckets, and 8: the model in one)")
    p.add_argument("--out", default=None, help="result JSON (default: print only)")
    a = p.parse_args(argv)
    if a.reps < 1 or not all(m > 0 for m in a.bucket_mib):
        p.error("--reps must be >= 1 and every --bucket-mib > 0")
    try:
        result = anyio.run(lambda: measure(reps=a.reps, bucket_mibs=a.bucket_mib))
    except Exception as e:  # one line: what failed (a digest that did not match, a rank that died)
        print(f"bench.rdt: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_FAILED
    for case in result["cases"]:
        print(f"{case['bucket_mib']:g} MiB buckets:")
        for r in case["rows"]:
            stages = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in r["stage_s_median"].items())
            print(f"  {r['transport']:>7}: {r['sync_s'] * 1e3:.1f} ms per sync ({r['bytes']:,} B in {r['buckets']} "
                  f"bucket(s), {r['GBps']:.3f} GB/s; stages ms, summed over buckets: {stages}), digest ok")
        print(f"  rdt / packed: {case['rdt_over_packed']:.2f}")
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {a.out}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
