"""FSDPExtractor: a model sharded with FSDP2 ``fully_shard`` over 2 gloo processes, gathered bit-exactly."""

from __future__ import annotations

import torch

from colo.core.buckets import plan_buckets
from tests.dist_helpers import TinyLlama, assert_bit_equal, run_workers

SEED = 11


def fsdp_worker(rank: int, world: int, tmp_path) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from colo.extractors import FSDPExtractor, PlainExtractor

    model = TinyLlama(SEED)
    model.register_buffer("steps", torch.tensor([3, 4]))  # a persistent buffer FSDP leaves unsharded
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    local_rows = {n: tuple(p.to_local().shape) for n, p in model.named_parameters() if isinstance(p, DTensor)}
    if world == 1:  # one rank's shard is the whole tensor: read as it is, never redistributed
        def no_gather(self, *a, **kw):
            raise AssertionError("full_tensor() on a mesh of one rank")
        DTensor.full_tensor = no_gather

    ex = FSDPExtractor(model, dtype=torch.bfloat16)
    specs = [(s.name, list(s.shape), s.dtype, s.nbytes) for s in ex.specs()]
    by_bucket = {}
    for b in plan_buckets(list(ex.specs()), 128):
        names = [e.spec.name for e in b.entries]
        out = list(ex.extract(names))
        assert [n for n, _ in out] == names
        by_bucket.update(out)
    names = [s[0] for s in specs]
    reversed_order = dict(ex.extract(names[::-1]))
    fp8 = dict(FSDPExtractor(model, dtype="float8_e4m3fn").extract(names))
    try:
        PlainExtractor(model)
        plain_error = ""
    except TypeError as e:
        plain_error = str(e)
    return {"specs": specs, "local_rows": local_rows, "by_bucket": by_bucket, "reversed": reversed_order,
            "reversed_names": list(reversed_order), "fp8": fp8, "plain_error": plain_error}


def _reference() -> dict:
    ref_model = TinyLlama(SEED)
    ref_model.register_buffer("steps", torch.tensor([3, 4]))
    return ref_model.state_dict()


def test_one_rank_fsdp2_is_read_without_a_gather_and_bit_exact(tmp_path):
    (res,) = run_workers(fsdp_worker, tmp_path, world_size=1)
    ref = _reference()
    assert res["local_rows"]["model.embed_tokens.weight"] == (37, 8)  # one rank holds every row
    assert list(res["by_bucket"]) == list(ref) and res["reversed_names"] == list(ref)[::-1]
    for n, t in ref.items():
        want = t if n == "steps" else t.to(torch.bfloat16)
        assert type(res["by_bucket"][n]) is torch.Tensor, type(res["by_bucket"][n])  # a plain tensor, not a DTensor
        assert_bit_equal(res["by_bucket"][n], want, n)
        assert_bit_equal(res["reversed"][n], want, f"{n} (reversed)")
        assert_bit_equal(res["fp8"][n], t if n == "steps" else t.to(torch.float8_e4m3fn), f"{n} fp8")


def test_fsdp2_shards_gathered_with_full_tensor_are_bit_exact(tmp_path):
    results = run_workers(fsdp_worker, tmp_path)
    ref_model = TinyLlama(SEED)
    ref_model.register_buffer("steps", torch.tensor([3, 4]))
    ref = ref_model.state_dict()

    for rank, res in enumerate(results):
        # the model really was sharded: rank 0 holds 19 of the 37 vocabulary rows, rank 1 the other 18
        assert res["local_rows"]["model.embed_tokens.weight"] == ((19, 8) if rank == 0 else (18, 8))
        assert res["specs"] == [(n, list(t.shape), "int64" if n == "steps" else "bfloat16",
                                 t.numel() * (8 if n == "steps" else 2)) for n, t in ref.items()]
        assert list(res["by_bucket"]) == list(ref)
        assert res["reversed_names"] == list(ref)[::-1]
        for n, t in ref.items():
            want = t if n == "steps" else t.to(torch.bfloat16)
            assert_bit_equal(res["by_bucket"][n], want, f"rank {rank} {n}")
            assert_bit_equal(res["reversed"][n], want, f"rank {rank} {n} (reversed)")
            assert_bit_equal(res["fp8"][n], t if n == "steps" else t.to(torch.float8_e4m3fn), f"rank {rank} {n} fp8")
        assert res["plain_error"] == ("plain extractor: 'model.embed_tokens.weight' is a sharded DTensor; use "
                                      "FSDPExtractor, which gathers it with full_tensor()")
