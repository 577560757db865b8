"""Each trainer rank sends its engine rank its own slice, with no gather (issue 46).

When colo's TP engine spans the trainer's tensor-parallel ranks in their order, engine rank
r holds exactly what Megatron's rank r holds of every tensor-parallel tensor (q, k and v of
its query groups, gate and up of its ``linear_fc1``, its columns of ``linear_proj`` and
``linear_fc2``, its vocabulary rows). The extractor's ``tp_slices`` then sends that block
from the rank's own shard: the synthetic Megatron trainer of ``bench.multi_gpu``
(megatron-core's layout: ``tests/engine/test_moe.py`` checks it against megatron-core's own)
syncs through the ``packed`` transport into colo's TP engine on the same N gloo ranks, and
each engine rank must then hold exactly its shard of the trainer's whole model (taken
through the gather, each tensor cut as the loader cuts it), report the expected digest,
have received on the wire exactly its shard's bytes, and the extractor must have entered no
collective. A vocabulary with padding goes whole, gathered, as before.
``tests/extractors/test_megatron_core.py`` checks the same on megatron-core's own model.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_helpers import run_workers


class _Counting:
    """``torch.distributed`` as the extractor module sees it, counting its collectives."""

    NAMES = ("all_gather", "all_gather_into_tensor", "broadcast", "all_to_all_single")

    def __init__(self, inner, counts: dict):
        self._inner, self._counts = inner, counts

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if name not in self.NAMES:
            return attr

        def counted(*a, **k):
            self._counts[name] = self._counts.get(name, 0) + 1
            return attr(*a, **k)

        return counted


def _counted_extract(module, counts: dict, run):
    """Run ``run()`` with every collective of the extractor's module counted into ``counts``."""
    saved = module.dist, module._all_gather_single, module._all_gather_coalesced

    def single(*a, **k):
        counts["all_gather_single"] = counts.get("all_gather_single", 0) + 1
        return saved[1](*a, **k)

    def coalesced(*a, **k):
        counts["coalesced"] = counts.get("coalesced", 0) + 1
        return saved[2](*a, **k)

    module.dist, module._all_gather_single, module._all_gather_coalesced = _Counting(saved[0], counts), single, \
        coalesced
    try:
        return run()
    finally:
        module.dist, module._all_gather_single, module._all_gather_coalesced = saved


def slices_worker(rank: int, world: int, tmp_path, bucket_bytes: int, overrides: dict) -> dict:
    import anyio
    import torch.distributed as dist

    import colo.extractors.megatron as megatron
    from bench.multi_gpu import SyntheticMegatron, engine_build
    from colo.core.interfaces import SyncContext
    from colo.core.memory import StagingBudget
    from colo.engine.reference.tp import TPEngineCore, expected_shard_digest, shard_state_from_hf, split_dims
    from colo.testing.engines import ReceiverOnCore
    from colo.trainers.models import demo_config
    from colo.transports.packed import PackedReceiver, PackedTransport

    cfg = demo_config(**{"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
                         "intermediate_size": 512, "vocab_size": 1024, "num_hidden_layers": 2, **overrides})
    trainer = SyntheticMegatron(cfg, seed=5, engine_dtype="bfloat16", device="cpu")
    build = engine_build(cfg, world)
    core = TPEngineCore(cfg, tp_rank=rank, tp_size=world, group=dist.new_group(list(range(world))),
                        dtype=torch.bfloat16, total_bytes=build["total_bytes"],
                        mem_fraction_static=build["mem_fraction_static"])
    whole = trainer.extractor(whole=True)
    gathered: dict = {}
    full = _counted_extract(megatron, gathered, lambda: dict(whole.extract([s.name for s in whole.specs()])))
    ex = trainer.extractor()
    engine = ReceiverOnCore(core, PackedReceiver(), "packed")
    sender = PackedTransport()
    ctx = SyncContext(step=0, weight_version=1, bucket_bytes=bucket_bytes, source="device",
                      staging=StagingBudget(None))

    result = {}

    async def sync() -> None:
        try:
            result["sync"] = await sender.sync(trainer, engine, ctx)
        finally:
            await sender.aclose()

    collectives: dict = {}
    _counted_extract(megatron, collectives, lambda: anyio.run(sync))
    held = {n: t.clone() for n, t in core.model.named_parameters()}
    want = shard_state_from_hf(full, cfg, torch.bfloat16, rank, world)
    wire_bytes, marked, pieces = 0, {}, set()
    for req in engine.requests:
        for m in req["tensors"]:
            wire_bytes += m["end_idx"] - m["start_idx"]
            if "rank_slice" in m:
                marked[m["name"]] = m["rank_slice"]
                if "piece_offset" in m:
                    pieces.add(m["name"])
    return {"equal": {n: bool(torch.equal(held[n], want[n])) for n in want}, "params": sorted(held),
            "want": sorted(want), "digest": core.digest(),
            "expected": expected_shard_digest(full, cfg, torch.bfloat16, rank, world),
            "shard_bytes": sum(t.numel() * t.element_size() for t in want.values()), "wire_bytes": wire_bytes,
            "marked": marked, "sliced": sorted(ex.sliced),
            "slice_bytes": {sp.name: sp.nbytes for sp in ex.specs()}, "split": sorted(split_dims(cfg, world)),
            "collectives": collectives, "gathered": gathered, "pieces": sorted(pieces),
            "staging_peak": result["sync"].staging_peak, "bucket_bytes": bucket_bytes}


def _check(results: list[dict], world: int, padded: bool = False) -> None:
    for rank, r in enumerate(results):
        assert r["params"] == r["want"]
        assert all(r["equal"].values()), [n for n, ok in r["equal"].items() if not ok]
        assert r["digest"] == r["expected"], f"rank {rank}"
        vocab = {"model.embed_tokens.weight", "lm_head.weight"}
        # every tensor the engine splits went as this rank's slice, but a padded vocabulary
        assert r["sliced"] == sorted(set(r["split"]) - vocab if padded else r["split"])
        assert sorted(r["marked"]) == r["sliced"]
        q = r["marked"]["model.layers.1.self_attn.q_proj.weight"]
        assert q == {"dim": 0, "start": rank * 256 // world, "length": 256}
        down = r["marked"]["model.layers.0.mlp.down_proj.weight"]
        assert down == {"dim": 1, "start": rank * 512 // world, "length": 512}
        if padded:
            # the padded vocabulary's two tensors were gathered whole (a coalesced all-gather
            # or a broadcast per rank); nothing else entered a collective
            assert r["collectives"] and r["wire_bytes"] > r["shard_bytes"]
        else:
            # not one collective, and on the wire exactly the bytes this engine rank holds
            assert r["collectives"] == {}, r["collectives"]
            assert r["wire_bytes"] == r["shard_bytes"]
        # the control: the whole tensors came through collectives (the counting sees them)
        assert sum(r["gathered"].values()) > 0
        # a slice larger than the bucket went in pieces of its own elements, so staging (two
        # buckets) stayed within two budgets
        large = sorted(n for n, m in r["marked"].items() if r["slice_bytes"][n] > r["bucket_bytes"])
        assert r["pieces"] == large
        assert bool(large) == (r["bucket_bytes"] < r["slice_bytes"]["model.layers.0.mlp.down_proj.weight"])
        assert r["staging_peak"] <= 2 * r["bucket_bytes"], (r["staging_peak"], r["bucket_bytes"])


@pytest.mark.parametrize("bucket_bytes", [1 << 20, 3000])
def test_two_ranks_each_engine_rank_gets_its_own_slice_with_no_collective(tmp_path, bucket_bytes):
    """One bucket, and buckets of a few tensors each (q, k and v, gate and up apart)."""
    _check(run_workers(slices_worker, tmp_path, bucket_bytes, {}), 2)


def test_four_ranks_each_engine_rank_gets_its_own_slice_with_no_collective(tmp_path):
    _check(run_workers(slices_worker, tmp_path, 1 << 20, {"num_key_value_heads": 4}, world_size=4), 4)


def test_a_padded_vocabulary_goes_whole_and_the_rest_as_slices(tmp_path):
    # 1021 tokens over 2 ranks: Megatron pads to 1022 rows, 511 a rank; the engine's block 1
    # holds 510 real rows and a padding row, so the embedding and lm_head go whole
    _check(run_workers(slices_worker, tmp_path, 1 << 20, {"vocab_size": 1021}), 2, padded=True)


def refusals_worker(rank: int, world: int, tmp_path) -> list[str]:
    import torch.distributed as dist

    from bench.multi_gpu import SyntheticMegatron
    from colo.extractors.megatron import MegatronExtractor
    from colo.trainers.models import demo_config

    cfg = demo_config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                      vocab_size=256, num_hidden_layers=1)
    trainer = SyntheticMegatron(cfg, seed=1, engine_dtype="bfloat16", device="cpu")
    out = []
    for bad, tp in (({"model.layers.0.self_attn.o_proj.weight": 1, "model.layers.9.mlp.up_proj.weight": 0,
                      "model.layers.0.mlp.down_proj.weight": 5}, trainer.tp_group),
                    ({"model.layers.0.mlp.up_proj.weight": 0}, None),
                    # rank 0 alone: every rank refuses (each one's copies would follow its own mapping)
                    ({"model.layers.0.mlp.up_proj.weight": 0} if rank == 0 else {}, trainer.tp_group)):
        try:
            MegatronExtractor(trainer.params, dtype=torch.bfloat16, group=trainer.meta_group, tp_group=tp,
                              attention=(4, 2), vocab_size=cfg.vocab_size if tp else None, tp_slices=bad)
            out.append("")
        except ValueError as e:
            out.append(str(e))
    dist.barrier()
    return out


def test_what_cannot_be_a_ranks_slice_is_refused_by_name_on_every_rank(tmp_path):
    for unknown, no_group, differ in run_workers(refusals_worker, tmp_path):
        assert "model.layers.9.mlp.up_proj.weight (no parameter becomes it)" in unknown
        assert "model.layers.0.mlp.down_proj.weight (dimension 5 is not one of (64, 128))" in unknown
        assert "o_proj" not in unknown  # the one right entry is not named
        assert "tp_slices needs a tensor-parallel group of 2 or more ranks" in no_group
        assert "expert_scatter or tp_slices differs between rank" in differ
