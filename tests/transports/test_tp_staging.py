"""Issue 34, item 1, on two gloo ranks: a tensor-parallel trainer's sync gathers into the
staging slot itself.

The ``packed`` transport hands the Megatron extractor views of its slot: each whole
tensor-parallel tensor is gathered there, and a tensor larger than the bucket (the
embedding, ``lm_head``) is gathered piece by piece into each piece's place, never whole
beside the two slots. What each rank's engine received is compared with the unsharded
model, bit for bit.
"""

from __future__ import annotations

from types import SimpleNamespace

import anyio
import torch

from colo.core.buckets import plan_buckets
from colo.core.interfaces import SyncContext
from colo.core.memory import StagingBudget
from colo.extractors import MegatronExtractor
from colo.testing.fakes import protocol_engine
from colo.transports.packed import PackedTransport
from tests.dist_helpers import run_workers
from tests.extractors.test_megatron import ATTENTION, T, hf_reference, megatron_params

BUCKET = 256  # bytes: TinyLlama's 592-byte embedding and lm_head travel in three and four pieces


def packed_sync(ex, pool: StagingBudget):
    """One ``packed`` sync of ``ex`` in ``BUCKET``-byte buckets into a protocol engine of its
    specs: (the engine, the sync's result)."""
    engine = protocol_engine(list(ex.specs()))
    ctx = SyncContext(step=0, weight_version=1, bucket_bytes=BUCKET, source="device", staging=pool)
    transport = PackedTransport()

    async def main():
        try:
            return await transport.sync(SimpleNamespace(extractor=lambda: ex), engine, ctx)
        finally:
            await transport.aclose()

    return engine, anyio.run(main)


def sync_worker(rank: int, world: int, tmp_path) -> dict:
    import torch.distributed as dist

    ex = MegatronExtractor(megatron_params(hf_reference(), tp_rank=rank, tp=world), dtype=torch.bfloat16,
                           tp_group=dist.group.WORLD, attention=ATTENTION, vocab_size=T.VOCAB)
    ranges, wholes, into_views = [], [], []
    real_range, real_extract = ex.extract_range, ex.extract

    def extract_range(name, offset, nbytes, out=None):
        ranges.append((name, offset, nbytes, out is not None))
        return real_range(name, offset, nbytes, out)

    def extract(names, into=None):
        wholes.extend(names)
        for name, t in real_extract(names, into):
            into_views.append((name, into is not None and name in into and t is into[name]))
            yield name, t

    ex.extract_range, ex.extract = extract_range, extract
    pool = StagingBudget(None)
    engine, result = packed_sync(ex, pool)
    return {"params": dict(engine.sink.params), "ranges": ranges, "wholes": wholes, "into": into_views,
            "buckets": result.buckets, "held": pool.held_bytes, "peak": pool.peak_bytes}


def test_a_tp_sync_gathers_into_staging_and_pieces_piece_by_piece(tmp_path):
    ref = {n: t.to(torch.bfloat16) for n, t in hf_reference().items()}
    specs = list(MegatronExtractor(megatron_params(hf_reference()), dtype=torch.bfloat16, attention=ATTENTION,
                                   vocab_size=T.VOCAB).specs())
    plan = plan_buckets(specs, BUCKET)
    cut = [(e.spec.name, e.offset, e.nbytes) for b in plan for e in b.entries if not e.whole]
    assert {n for n, _, _ in cut} == {"model.embed_tokens.weight", "lm_head.weight"} and len(cut) == 7
    for rank, res in enumerate(run_workers(sync_worker, tmp_path)):
        assert sorted(res["params"]) == sorted(ref)
        for name, want in ref.items():
            assert torch.equal(res["params"][name].view(torch.uint8), want.view(torch.uint8)), f"rank {rank} {name}"
        # each piece gathered on its own, into its place in the slot; the two tensors never whole
        assert res["ranges"] == [(n, o, k, True) for n, o, k in cut]
        assert not {"model.embed_tokens.weight", "lm_head.weight"} & set(res["wholes"])
        # every whole tensor asked for with the slot's views; the tensor-parallel ones came back as those views
        gathered = {n for n, inside in res["into"] if inside}
        assert gathered == {e.spec.name for b in plan for e in b.entries if e.whole and "norm" not in e.spec.name}
        assert res["buckets"] == len(plan) and res["held"] == 0
        assert res["peak"] <= 2 * BUCKET


def drain_worker(rank: int, world: int, tmp_path) -> dict:
    """Rank 0 fails after its first two buckets and drains (what a failed rank does so the
    others' collectives complete); rank 1 syncs on."""
    import torch.distributed as dist

    from colo.ranks.host import _Drain
    from colo.transports.base import extract_bucket

    ex = MegatronExtractor(megatron_params(hf_reference(), tp_rank=rank, tp=world), dtype=torch.bfloat16,
                           tp_group=dist.group.WORLD, attention=ATTENTION, vocab_size=T.VOCAB)
    if rank == 0:
        drain = _Drain(SimpleNamespace(extractor=lambda: ex))
        counting = drain.extractor()
        for b in plan_buckets(list(ex.specs()), BUCKET)[:2]:
            extract_bucket(counting, b)
        return {"drained": drain.finish(BUCKET)}
    engine, _ = packed_sync(ex, StagingBudget(None))
    return {"params": dict(engine.sink.params)}


def test_a_failed_rank_drains_with_the_same_collectives_pieces_included(tmp_path):
    ref = {n: t.to(torch.bfloat16) for n, t in hf_reference().items()}
    drained, synced = run_workers(drain_worker, tmp_path)
    specs = list(MegatronExtractor(megatron_params(hf_reference()), dtype=torch.bfloat16, attention=ATTENTION,
                                   vocab_size=T.VOCAB).specs())
    assert drained["drained"] == len(plan_buckets(specs, BUCKET)) - 2
    for name, want in ref.items():
        assert torch.equal(synced["params"][name].view(torch.uint8), want.view(torch.uint8)), name
