"""The CUDA-IPC form of colo's SGLang payload, read in another process on the same GPU.

A payload for SGLang's ``update_weights_from_tensor(load_format="flattened_bucket")``
made on the GPU carries the bucket as a CUDA IPC handle, its device named by the GPU's
UUID. A second process (as an SGLang TP rank is) reads it with colo's own receiver
(``decode_payload``), and the tensors it rebuilds, through SGLang 0.5.23's own
``FlattenedTensorBucket`` too, must be the trainer's exactly. SGLang itself cannot be
installed on the GPU machines: its ``tensor_bucket.py`` (imports only torch) is carried
as ``.cache/sglang/0.5.23/sglang/srt/weight_sync/tensor_bucket.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytestmark = [pytest.mark.gpu, gpu]
REPO = Path(__file__).resolve().parents[2]

READER = textwrap.dedent("""
    import json, sys
    import torch
    from colo.engine.sglang import bucket_views, decode_payload
    from tests.sglang_wheel import load_file

    tb = load_file("sglang/srt/weight_sync/tensor_bucket.py", {"dataclasses", "typing", "torch"}, "_tb")
    payloads = json.load(open(sys.argv[1]))
    want = torch.load(sys.argv[2])
    out = []
    for p in payloads:
        flat, meta = decode_payload(p)
        assert flat.is_cuda and flat.dtype == torch.uint8, (flat.device, flat.dtype)
        theirs = tb.FlattenedTensorBucket(flattened_tensor=flat, metadata=[tb.FlattenedTensorMetadata(
            **{**m, "shape": torch.Size(m["shape"]), "dtype": getattr(torch, m["dtype"])}) for m in meta])
        for (name, a), (name2, b) in zip(bucket_views(flat, meta), theirs.reconstruct_tensors()):
            assert name == name2
            w = want[name]
            same = (a.dtype == w.dtype and tuple(a.shape) == tuple(w.shape)
                    and torch.equal(a.cpu().view(torch.uint8), w.view(torch.uint8))
                    and torch.equal(b.cpu().view(torch.uint8), w.view(torch.uint8)))
            out.append([name, same, str(flat.device)])
        del flat, theirs
    torch.cuda.synchronize()
    print(json.dumps(out))
""")


def test_a_cuda_payload_is_read_in_another_process_to_the_trainers_exact_tensors(tmp_path):
    from colo.core.buckets import plan_buckets, spec
    from colo.engine.sglang import bucket_metadata, serialize_payload
    from colo.trainers.models import build_trainer_model, demo_config
    from colo.transports.pack import pack_into
    from colo.transports.wire import UNPADDED, relayout

    config = demo_config(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=48, max_position_embeddings=32,
                         tie_word_embeddings=True)
    state = {n: p.detach().to("cuda", torch.bfloat16)
             for n, p in build_trainer_model(config, seed=7).named_parameters()}
    specs = [spec(n, t.shape, "bfloat16") for n, t in state.items()]
    flats, payloads = [], []
    for bucket in plan_buckets(specs, max(4 << 10, max(s.nbytes for s in specs))):
        laid = relayout(bucket, align=UNPADDED)
        flat = torch.empty(laid.nbytes, dtype=torch.uint8, device="cuda")
        pack_into(flat, laid, [(e.spec.name, state[e.spec.name]) for e in laid.entries])
        torch.cuda.synchronize()
        flats.append(flat)  # alive until the reader is done: it maps this memory
        payloads.append(serialize_payload(flat, bucket_metadata(laid)))
    (tmp_path / "payloads.json").write_text(json.dumps(payloads))
    torch.save({n: t.cpu() for n, t in state.items()}, tmp_path / "want.pt")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", READER, str(tmp_path / "payloads.json"), str(tmp_path / "want.pt")],
                          capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [n for n, _, _ in got] == list(state) and len(payloads) > 2
    assert [n for n, same, _ in got if not same] == []
    assert {d for _, _, d in got} == {f"cuda:{torch.cuda.current_device()}"}
    del flats
    torch.cuda.ipc_collect()
