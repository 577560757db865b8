"""Each rank's own slices (``tp_slices``, issue 46) on a GPU: the device copies and the uploads.

Extracting a rank's own slices enters no collective, so two ranks of a TP=2 Megatron layout
can share one GPU (their metadata exchange runs over gloo): each takes its slices of the
benchmark's synthetic Qwen2 layout from its shards on the device (``sync-first``: one batched
copy into the caller's views) and from their pinned host copy (``offload-first``: uploads on
the extractor's own stream, q, k and v of two query groups as strided runs), whole and by byte
range (the pieces of a slice larger than a bucket), and every result must equal, bit for bit,
what the same extractor yields from the same shards on the CPU (the path
``tests/engine/test_tp_slices.py`` and ``tests/extractors/test_megatron_core.py`` check
against the engine and megatron-core).
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_helpers import run_workers

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def cuda_worker(rank: int, world: int, tmp_path, dev: str = "cuda") -> dict:
    import torch.distributed as dist

    from bench.multi_gpu import SyntheticMegatron
    from colo.engine.reference.tp import split_dims
    from colo.extractors.megatron import MegatronExtractor
    from colo.trainers.models import demo_config

    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    if dev == "cuda":
        torch.cuda.set_device(0)  # both ranks on the one GPU: nothing here is a collective on it
    # four query groups: two a rank, so q, k and v are strided views of each fused QKV shard
    cfg = demo_config(hidden_size=256, num_attention_heads=8, num_key_value_heads=4, intermediate_size=512,
                      vocab_size=2048, num_hidden_layers=2)
    trainer = SyntheticMegatron(cfg, seed=7, engine_dtype="bfloat16", device=dev)
    split = {n: d for n, d in split_dims(cfg, world).items()}
    args = {"dtype": torch.bfloat16, "group": trainer.meta_group, "tp_group": trainer.tp_group,
            "attention": (cfg.num_attention_heads, cfg.num_key_value_heads), "vocab_size": cfg.vocab_size,
            "tp_slices": split}

    def carried(t):  # the trainer's parallel attributes on a copy
        for k in ("tensor_model_parallel", "partition_dim", "partition_stride"):
            if hasattr(t[0], k):
                setattr(t[1], k, getattr(t[0], k))
        return t[1]

    cpu = MegatronExtractor({n: carried((t, t.cpu())) for n, t in trainer.params.items()}, **args)
    specs = list(cpu.specs())
    names = [s.name for s in specs]
    ref = {n: t.clone() for n, t in cpu.extract(names)}

    def views() -> dict:
        # the caller's views of one flat device buffer, 16-byte aligned, as a staging slot's
        offsets, at = [], 0
        for s in specs:
            offsets.append(at)
            at += -(-s.nbytes // 16) * 16
        flat = torch.full((at,), 0xAB, dtype=torch.uint8, device=dev)
        return {s.name: flat[o:o + s.nbytes].view(torch.bfloat16).view(s.shape) for s, o in zip(specs, offsets)}

    out: dict = {"sliced": len(cpu.sliced), "names": len(names)}
    device = trainer.extractor()
    into = views()
    got = dict(device.extract(names, into))
    sync()
    out["device_in_place"] = all(got[n] is into[n] for n in names if n in device.sliced)
    out["device_equal"] = [n for n in names if not torch.equal(got[n].cpu(), ref[n])]

    trainer._offload()  # the pinned host copy: the extractor uploads from it
    host = trainer.extractor()
    into = views()
    got = dict(host.extract(names, into))
    sync()
    out["host_equal"] = [n for n in names if not torch.equal(got[n].cpu(), ref[n])]
    out["host_pinned"] = all(t.is_pinned() == (dev == "cuda") for t in trainer.host.values())
    # byte ranges of the rank's vocabulary slice and of a strided-free GLU half, in three pieces each
    ranges = {}
    for name in ("model.embed_tokens.weight", "model.layers.1.mlp.up_proj.weight"):
        n = next(s.nbytes for s in specs if s.name == name)
        cuts = [0, n // 3 // 2 * 2, 2 * n // 3 // 2 * 2, n]
        pieces = []
        for a, b in zip(cuts, cuts[1:]):
            dst = torch.empty(b - a, dtype=torch.uint8, device=dev)
            pieces.append(host.extract_range(name, a, b - a, dst))
        sync()
        ranges[name] = (bool(host.ranged(name)),
                        torch.equal(torch.cat(pieces).cpu(), ref[name].reshape(-1).view(torch.uint8)))
    out["ranges"] = ranges
    out["q_ranged"] = bool(host.ranged("model.layers.0.self_attn.q_proj.weight"))
    out["q_start"] = next(s.rank_slice for s in specs if s.name == "model.layers.0.self_attn.q_proj.weight")
    dist.barrier()
    return out


def test_a_ranks_own_slices_from_the_device_and_from_pinned_host_memory_are_the_cpus_bit_for_bit(tmp_path):
    for rank, r in enumerate(run_workers(cuda_worker, tmp_path)):
        assert r["sliced"] == r["names"] - 2 * 2 - 1 > 0  # all but the norms: 2 a layer and the final one
        assert r["device_in_place"] and r["device_equal"] == [], r["device_equal"][:5]
        assert r["host_pinned"] and r["host_equal"] == [], r["host_equal"][:5]
        for name, (ranged, equal) in r["ranges"].items():
            assert ranged and equal, name
        assert r["q_ranged"] is False  # two query groups' q: strided, sent whole, never by range
        assert r["q_start"] == (0, rank * 8 * 32 // 2, 8 * 32)
