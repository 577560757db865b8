"""The Triton kernels of colo.digest (the batched checksum and the copying kernel) run by
Triton's interpreter on the CPU, where Triton is installed (it is not in CI: there the
kernels' tables are checked with stand-ins, tests/test_digest.py, and the kernels themselves
on a GPU, tests/gpu/test_digest_cuda.py). What this adds: the kernels' own arithmetic checked
on a machine without a GPU before a device call, through the engine's load and the pack."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = r'''
import numpy as np
import torch
import triton.language as tl
import colo.digest as D
D.tl = tl  # the interpreter looks the language up in the kernels' module
D._COPY_BLOCK, D._COPY_ITERS = 64, 4  # several programs per tensor at these sizes
D._batchable = lambda t: True  # host tensors stand for device ones
from colo.core.buckets import plan_buckets
from colo.engine.reference.core import EngineCore
from colo.engine.reference.weights import expected_digest
from colo.extractors.plain import PlainExtractor
from colo.trainers.models import build_trainer_model, demo_config
from colo.transports.pack import pack_batched, pack_into
from tests.conftest import SMALL_CFG

config = demo_config(**SMALL_CFG)
core = EngineCore(config, dtype=torch.float32, device="cpu", total_bytes=16 << 20, mem_fraction_static=0.5,
                  init_state=None)
for seed in range(3):
    state = {k: v.detach().clone() for k, v in build_trainer_model(config, seed=seed).state_dict().items()}
    (bucket,) = plan_buckets(PlainExtractor(state).specs(), 1 << 30)
    named = [(e.spec.name, state[e.spec.name]) for e in bucket.entries]
    flat, want = torch.zeros(bucket.nbytes, dtype=torch.uint8), torch.zeros(bucket.nbytes, dtype=torch.uint8)
    assert pack_batched(flat, bucket, named)
    pack_into(want, bucket, named)
    assert all(torch.equal(flat[e.start:e.end], want[e.start:e.end]) for e in bucket.entries)
    # half the tensors already at their entry (an extractor given the slot's views): the rest around them
    mixed, half = torch.zeros(bucket.nbytes, dtype=torch.uint8), []
    for i, (e, (n, t)) in enumerate(zip(bucket.entries, named)):
        if i % 2:
            view = mixed[e.start:e.end].view(t.dtype).view(t.shape)
            view.copy_(t)
            t = view
        half.append((n, t))
    assert pack_batched(mixed, bucket, half) and torch.equal(mixed, want)
    views = [(e.spec.name, flat[e.start:e.end].view(torch.float32).view(e.spec.shape)) for e in bucket.entries]
    core.begin_load()
    core.load_weights(views)
    core.end_load()
    assert core.digest() == expected_digest(state, config, torch.float32), seed
g = torch.Generator().manual_seed(1)
srcs = [torch.randn(s, generator=g).to(dt) for s, dt in [((300, 2), torch.bfloat16), ((33,), torch.float32)]]
dsts = [torch.zeros_like(t) for t in srcs]
lanes = D.Copies(list(zip(dsts, srcs))).run(lanes=True)
assert lanes.tolist() == [D.lanes(t, 0, "host") for t in srcs]
assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))
# a tensor lying strided (q of a fused QKV): its runs, each from its first word, summed as the whole's
q = torch.randn(3, 300, 2, generator=g).to(torch.bfloat16)[:, :101]
dq = torch.zeros(3, 101, 2, dtype=torch.bfloat16)
runs = D.Copies([(dq[i], q[i]) for i in range(3)], firsts=[(dq[i].data_ptr() - dq.data_ptr()) // 2 for i in range(3)],
                owners=[0, 0, 0])
assert runs.run(lanes=True).tolist() == [D.lanes(q.contiguous(), 0, "host")] and torch.equal(dq, q)
# the kernel's 16-byte units (every pair 16-byte aligned and sized; the last block of the second
# tensor 4 words long) and its 4-byte ones: the same bytes, the same lanes
big = [torch.randn(s, generator=g).to(dt) for s, dt in [((40, 48), torch.bfloat16), ((4096 + 68,), torch.float32)]]
probe = D.Copies(list(zip([torch.zeros_like(t) for t in big], big)))
assert D._unit(probe.meta, probe.count, 0) == 16
for flag in (True, False):
    D._COPY_ALIGNED = flag
    outs = [torch.zeros_like(t) for t in big]
    got = D.Copies(list(zip(outs, big))).run(lanes=True)
    assert got.tolist() == [D.lanes(t, 0, "host") for t in big], flag
    assert all(torch.equal(o, t) for o, t in zip(outs, big)), flag
    outs = [torch.zeros_like(t) for t in big]
    assert D.Copies(list(zip(outs, big))).run() is None and all(torch.equal(o, t) for o, t in zip(outs, big)), flag
D._COPY_ALIGNED = True
# a plan's copies out of a buffer mapped anew each time: its table made once, each run given the buffer;
# a buffer off 16 bytes is copied through a table laid on it
nb = [t.numel() * t.element_size() for t in big]
starts = [0, nb[0]]
outs = [torch.zeros_like(t) for t in big]
planned = D.PlannedCopies(np.array(starts), np.array([o.data_ptr() for o in outs]), np.array(nb), torch.device("cpu"))
assert planned.unit == 16
for shift in (0, 16, 4, 0):
    buf = torch.zeros(sum(nb) + 64, dtype=torch.uint8)
    flat = buf[shift:shift + sum(nb)]
    for t, a in zip(big, starts):
        flat[a:a + t.numel() * t.element_size()].copy_(t.reshape(-1).view(torch.uint8))
    for o in outs:
        o.zero_()
    got = planned.run_from(flat, lanes=True)
    assert got.tolist() == [D.lanes(t, 0, "host") for t in big], shift
    assert all(torch.equal(o, t) for o, t in zip(outs, big)), shift
    assert (planned._uploaded is not None) and planned.run_from(flat) is None
print("ok")
'''


def test_the_kernels_interpreted_copy_and_sum_as_the_host_does():
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(
        [str(root), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]])}
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=root, env=env, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
