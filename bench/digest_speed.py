"""The device digest's cost at Qwen2-1.5B and Qwen2-7B shapes on one GPU, beside the limits of
the same run: ``python -m bench.digest_speed OUT.json``.

Per model (random bf16 weights on the GPU, every HF tensor of the shape): the contract digest
(:func:`colo.digest.weights_digest`, one Triton pass per tensor and one read-back) as an engine
computes it over what it holds; the trainer's side from fp32 parameters (each converted to bf16 on
the device first, as the demo's trainers do); and, for the 1.5B only, the contract before it
(every tensor copied to the host and hashed there with sha256), once. The floor is one read of
the bytes at the device-copy rate measured in the same run (a copy's rate counts read + write)."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import statistics
import sys
import time

import torch

from colo.apps.bench import machine_info, measure_gpu_limits, release_cached
from colo.digest import expected_weights_digest, weights_digest
from colo.engine.reference.weights import expected_hf_specs
from colo.trainers.models import DEMO_MODELS, QWEN2_7B, demo_config


def timed(fn, reps: int = 5) -> tuple[float, list[float]]:
    fn()  # warm-up (the kernel's compilation on the first)
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()  # ends in a read-back: the device work is done when it returns
        out.append(time.perf_counter() - t0)
    return statistics.median(out), out


def old_contract(state: dict) -> str:
    h = hashlib.sha256()
    for name, t in state.items():
        h.update(name.encode())
        h.update(hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).cpu().numpy()).digest())
    return h.hexdigest()


def main(out_path: str) -> None:
    limits = measure_gpu_limits()
    d2d = limits["d2d_copy_GBps_read_plus_write"]
    rows = []
    for name, fields in (("qwen2-1.5b", DEMO_MODELS["qwen2-1.5b"]), ("qwen2-7b", QWEN2_7B)):
        config = demo_config(**fields)
        g = torch.Generator(device="cuda").manual_seed(0)
        state = {s.name: torch.randn(s.shape, device="cuda", generator=g, dtype=torch.bfloat16)
                 for s in expected_hf_specs(config, torch.bfloat16)}
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        engine_s, engine_all = timed(lambda s=state: weights_digest(s.items()))
        row = {"model": name, "tensors": len(state), "bytes": nbytes, "engine_digest_s": engine_s,
               "engine_digest_s_all": engine_all, "read_GBps": nbytes / engine_s / 1e9,
               "floor_s": nbytes / (d2d * 1e9), "of_floor": (nbytes / (d2d * 1e9)) / engine_s}
        order = list(state)
        if name == "qwen2-1.5b":
            fp32 = {n: t.float() for n, t in state.items()}
            del state
            release_cached()
            row["trainer_fp32_digest_s"], row["trainer_fp32_digest_s_all"] = timed(
                lambda: expected_weights_digest(fp32, order, torch.bfloat16))
            state = {n: t.to(torch.bfloat16) for n, t in fp32.items()}
            del fp32
            release_cached()
            t0 = time.perf_counter()
            old_contract(state)
            row["old_contract_host_sha256_s"] = time.perf_counter() - t0
        print(json.dumps({k: v for k, v in row.items() if not k.endswith("_all")}), flush=True)
        rows.append(row)
        del state
        release_cached()
    result = {"kind": "bench.digest_speed", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name(), "gpus": 1, "torch": torch.__version__,
              "machine": machine_info(), "limits": limits, "rows": rows}
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
