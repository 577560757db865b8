"""Experts go from their owner to each TP-MoE engine rank as that rank's slice (issue 46).

The synthetic Megatron trainer of ``bench.multi_gpu`` (megatron-core's TP + EP=N layout,
expert TP 1: rank r holds experts ``r * E/N ..`` whole) syncs ``qwen3-moe-tiny`` through the
``packed`` transport to colo's TP-MoE engine on the same N gloo ranks, with the extractor's
``expert_scatter``: each engine rank's weights must then be exactly its TP-MoE shard of the
trainer's whole model (taken through the broadcast path, each tensor cut as the loader cuts
it), its shard digest the expected one, and the expert bytes it received (on the wire and
through the collective) exactly 1/N of the experts' bytes. A slice that is not the rank's
own, or a slice sent to an engine that holds whole tensors, is refused naming the tensor.
"""

from __future__ import annotations

import json

import pytest
import torch

from colo.core.buckets import plan_buckets, rank_slice_spec
from colo.core.errors import RequestError, WeightMismatch
from colo.transports.wire import Piece, RankSlice, TensorMeta, views
from tests.dist_helpers import run_workers

MODEL = "qwen3-moe-tiny"


def _is_expert(name: str) -> bool:
    return ".mlp.experts." in name


def scatter_worker(rank: int, world: int, tmp_path, bucket_bytes: int) -> dict:
    import anyio
    import torch.distributed as dist

    from bench.multi_gpu import SyntheticMegatron, engine_build, model_config
    from colo.core.interfaces import SyncContext
    from colo.core.memory import StagingBudget
    from colo.engine.reference.moe import MoETPEngineCore
    from colo.engine.reference.tp import expected_shard_digest, shard_state_from_hf, split_dims
    from colo.testing.engines import ReceiverOnCore
    from colo.transports.packed import PackedReceiver, PackedTransport

    cfg = model_config(MODEL)
    trainer = SyntheticMegatron(cfg, seed=3, engine_dtype="bfloat16", device="cpu")
    engine_group = dist.new_group(list(range(world)))
    build = engine_build(cfg, world)
    core = MoETPEngineCore(cfg, tp_rank=rank, tp_size=world, group=engine_group, dtype=torch.bfloat16,
                           total_bytes=build["total_bytes"], mem_fraction_static=build["mem_fraction_static"])
    whole = trainer.extractor(whole=True)
    whole_specs = {s.name: s for s in whole.specs()}
    full = dict(whole.extract(list(whole_specs)))  # every expert broadcast whole: the reference
    scatter = trainer.extractor()
    engine = ReceiverOnCore(core, PackedReceiver(), "packed")
    ctx = SyncContext(step=0, weight_version=1, bucket_bytes=bucket_bytes, source="device",
                      staging=StagingBudget(None))
    sender = PackedTransport()

    async def sync() -> None:
        try:
            await sender.sync(trainer, engine, ctx)
        finally:
            await sender.aclose()

    anyio.run(sync)
    held = {n: t.clone() for n, t in core.model.named_parameters()}
    want = shard_state_from_hf(full, cfg, torch.bfloat16, rank, world)
    # the expert bytes each engine rank got on the wire: entries marked as its slice
    wire_expert, wire_marked, whole_named = 0, [], []
    for req in engine.requests:
        for m in req["tensors"]:
            if _is_expert(m["name"]):
                wire_expert += m["end_idx"] - m["start_idx"]
            if "rank_slice" in m:
                wire_marked.append(m["name"])
    # refusals, on a loaded engine: another rank's block, and a slice of a replicated tensor
    name = "model.layers.0.mlp.experts.1.down_proj.weight"
    whole_down = full[name]
    other = (rank + 1) % world
    length = whole_down.shape[1] // world
    errors = []
    for bad in (RankSlice(whole_down[:, other * length:(other + 1) * length].contiguous(), 1, other * length,
                          tuple(whole_down.shape)),
                RankSlice(full["model.norm.weight"][:4].contiguous(), 0, 0, tuple(full["model.norm.weight"].shape))):
        key = name if bad.dim == 1 else "model.norm.weight"
        core.begin_load()
        try:
            core.load_weights([(key, bad)])
        except WeightMismatch as e:
            errors.append(str(e))
        # nothing of the refused batch was written
        errors.append(bool(torch.equal(core.model._params["model.layers.0.mlp.experts.w2_weight"],
                                       held["model.layers.0.mlp.experts.w2_weight"])))
        try:
            core.end_load()
        except WeightMismatch as e:
            errors.append(str(e))
    # a sync that leaves one expert's slice out is refused at its end, naming it
    slices = core.model.plan.slices
    lost = "model.layers.1.mlp.experts.6.up_proj.weight"
    core.begin_load()
    core.load_weights([(n, RankSlice(t.narrow(slices[n].dim, slices[n].start, slices[n].length).contiguous(),
                                     slices[n].dim, slices[n].start, tuple(t.shape)) if _is_expert(n) else t)
                       for n, t in full.items() if n != lost])
    try:
        core.end_load()
        missing = ""
    except WeightMismatch as e:
        missing = str(e)
    # what cannot be scattered is refused at construction, on every rank alike, by name
    from colo.extractors.megatron import MegatronExtractor

    refused = []
    for bad in ({"model.layers.0.self_attn.o_proj.weight": 1}, {"model.layers.0.mlp.experts.99.up_proj.weight": 0},
                {"model.layers.0.mlp.experts.0.up_proj.weight": 2},
                # rank 0 alone: every rank refuses (each one's collectives would follow its own)
                {"model.layers.0.mlp.experts.0.up_proj.weight": 0} if rank == 0 else {}):
        try:
            MegatronExtractor(trainer.params, dtype=torch.bfloat16, group=trainer.meta_group,
                              tp_group=trainer.tp_group, ep_group=dist.group.WORLD, attention=(4, 2),
                              vocab_size=cfg.vocab_size, expert_scatter=bad)
        except ValueError as e:
            refused.append(str(e))
    return {"equal": {n: bool(torch.equal(held[n], want[n])) for n in want}, "refused": refused, "missing": missing,
            "params": sorted(held), "want": sorted(want),
            "digest": core.digest(), "expected_digest": expected_shard_digest(full, cfg, torch.bfloat16,
                                                                               rank, world),
            "expert_bytes": sum(s.nbytes for n, s in whole_specs.items() if _is_expert(n)),
            "experts": sorted(n for n in whole_specs if _is_expert(n)),
            "wire_expert": wire_expert, "wire_marked": sorted(set(wire_marked)),  # (a slice's pieces: once)
            # the dense tensors the engine splits go as each rank's own slice where the trainer's
            # TP ranks are the engine's (tests/engine/test_tp_slices.py), not at TP2 x DP2
            "own_slices": sorted(n for n in split_dims(cfg, world) if not _is_expert(n)) if trainer.tp_slices else [],
            "stats": dict(scatter.scatter_stats), "errors": errors,
            "spec_slices": {s.name: list(s.rank_slice) for s in scatter.specs() if s.rank_slice is not None},
            "expert_order": [s.name for s in scatter.specs() if _is_expert(s.name)]}


def _check(results: list[dict], world: int) -> None:
    for rank, r in enumerate(results):
        assert r["params"] == r["want"]
        assert all(r["equal"].values()), [n for n, ok in r["equal"].items() if not ok]
        assert r["digest"] == r["expected_digest"], f"rank {rank}"
        total = r["expert_bytes"]
        assert total > 0 and total % (world * world) == 0
        # every expert tensor went as this rank's slice, and nothing else did but the dense
        # tensors sent as each rank's own slice (at two ranks, TP=2: all those the engine splits)
        assert r["wire_marked"] == sorted(r["experts"] + r["own_slices"])
        assert bool(r["own_slices"]) == (world == 2)
        # bytes: 1/N of the experts' on the wire and through the collective, (N-1)/N^2 of them from others
        assert r["wire_expert"] == total // world
        assert r["stats"]["received"] == total // world
        assert r["stats"]["from_others"] == total * (world - 1) // (world * world)
        # each rank sent every other rank its slice of the experts it owns (1/N of them)
        assert r["stats"]["sent"] == total * (world - 1) // (world * world)
        # the slice a rank is told it gets: its block of the intermediate axis
        inter = 8 // world  # qwen3-moe-tiny's moe_intermediate_size over the ranks
        assert r["spec_slices"]["model.layers.1.mlp.experts.5.gate_proj.weight"] == [0, rank * inter, 8]
        assert r["spec_slices"]["model.layers.1.mlp.experts.5.down_proj.weight"] == [1, rank * inter, 8]
        other, replicated = r["errors"][0], r["errors"][3]
        assert "model.layers.0.mlp.experts.1.down_proj.weight" in other
        assert f"tp_rank {rank} of {world}" in other
        start = ((rank + 1) % world) * inter
        assert f"arrived as the block [{start}, {start + inter}) of dimension 1" in other
        assert f"expected the block [{rank * inter}, {rank * inter + inter}) of dimension 1" in other
        assert r["errors"][1] is True and r["errors"][4] is True  # nothing of a refused batch written
        # the end names the refusal again, beside every tensor the refused load left missing
        assert "model.layers.0.mlp.experts.1.down_proj.weight" in r["errors"][2]
        assert "model.norm.weight" in replicated and "expected the whole tensor" in replicated
        # the experts are listed round-robin over their owners (rank r holds experts r*E/N ..), so
        # every bucket's all_to_all has every rank sending
        owners = [int(n.split(".")[5]) // (8 // world) for n in r["expert_order"]]
        assert owners == [i % world for i in range(len(owners))]
        assert "missing" in r["missing"] and "model.layers.1.mlp.experts.6.up_proj.weight" in r["missing"]
        assert r["missing"].count("mlp.experts.") == 1  # every other slice, loaded directly, was taken
        dense, unknown, dim, differ = r["refused"]
        assert "expert_scatter or tp_slices differs between rank" in differ
        assert "every rank must pass the same mapping" in differ
        assert "model.layers.0.self_attn.o_proj.weight (not an expert's)" in dense
        assert "model.layers.0.mlp.experts.99.up_proj.weight (no parameter becomes it)" in unknown
        assert "model.layers.0.mlp.experts.0.up_proj.weight (dimension 2 of (8, 32) does not split" in dim


@pytest.mark.parametrize("bucket_bytes", [1 << 20, 3000])
def test_two_ranks_each_engine_rank_gets_exactly_its_tp_moe_slice_of_every_expert(tmp_path, bucket_bytes):
    """Large buckets (one collective) and buckets that hold a few experts (many buckets,
    gate and up of one expert in different ones)."""
    _check(run_workers(scatter_worker, tmp_path, bucket_bytes), 2)


def test_four_ranks_trainer_tp2_dp2_ep4_to_a_tp4_moe_engine(tmp_path):
    _check(run_workers(scatter_worker, tmp_path, 1 << 20, world_size=4), 4)


# -- the wire and the engine's refusals, one process ----------------------------------

def test_a_rank_slice_travels_marked_and_comes_out_as_a_rank_slice_of_the_whole_shape():
    s = rank_slice_spec("model.layers.0.mlp.experts.3.down_proj.weight", (32, 8), "bfloat16", 1, 4, 4)
    assert s.shape == (32, 4) and s.nbytes == 32 * 4 * 2 and s.rank_slice == (1, 4, 8)
    assert s.whole().shape == (32, 8) and s.whole().nbytes == 32 * 8 * 2 and s.whole().rank_slice is None
    (bucket,) = plan_buckets([s], 1 << 20)
    (meta,) = TensorMeta.of_bucket(bucket)
    wire = json.loads(json.dumps(meta.to_json()))
    assert wire["rank_slice"] == {"dim": 1, "start": 4, "length": 8} and wire["shape"] == [32, 4]
    back = TensorMeta.from_json(wire, buffer_nbytes=bucket.nbytes)
    assert back == meta and back.whole_shape == (32, 8)
    flat = torch.arange(bucket.nbytes, dtype=torch.uint8)
    ((name, got),) = list(views(flat, [back]))
    assert isinstance(got, RankSlice) and got.shape == (32, 8) and got.dim == 1 and got.start == 4
    assert tuple(got.data.shape) == (32, 4)


def test_a_rank_slice_larger_than_the_bucket_is_cut_into_pieces_of_its_own_elements():
    s = rank_slice_spec("e", (64, 8), "float32", 0, 32, 32)  # 1024 bytes
    buckets = plan_buckets([s], 256)
    assert [[(e.spec.name, e.offset, e.nbytes) for e in b.entries] for b in buckets] == \
        [[("e", k * 256, 256)] for k in range(4)]
    # on the wire each piece says both, and comes out as a RankSlice of the Piece of the slice
    flat = torch.arange(256, dtype=torch.uint8)
    for k, bucket in enumerate(buckets):
        (meta,) = TensorMeta.of_bucket(bucket)
        wire = json.loads(json.dumps(meta.to_json()))
        assert wire["piece_offset"] == k * 256 and wire["rank_slice"] == {"dim": 0, "start": 32, "length": 64}
        back = TensorMeta.from_json(wire, buffer_nbytes=256)
        ((name, got),) = list(views(flat, [back]))
        assert isinstance(got, RankSlice) and got.shape == (64, 8) and got.start == 32 and got.length == 32
        assert isinstance(got.data, Piece) and got.data.shape == (32, 8)
        assert (got.data.offset, got.data.end) == (k * 64, (k + 1) * 64)


@pytest.mark.parametrize("field, message", [
    ({"dim": 2, "start": 0, "length": 8}, "is not a block of a whole tensor"),
    ({"dim": 1, "start": 6, "length": 8}, "is not a block of a whole tensor"),
    ({"dim": 1, "start": -1, "length": 8}, "is not a block of a whole tensor"),
    ({"dim": 1, "start": 0}, "has no field 'length'"),
    ({"dim": 1, "start": True, "length": 8}, "must be int"),
])
def test_a_bad_rank_slice_field_is_refused_naming_the_tensor(field, message):
    entry = {"name": "model.layers.0.mlp.experts.3.down_proj.weight", "shape": [32, 4], "dtype": "bfloat16",
             "start_idx": 0, "end_idx": 256, "numel": 256, "rank_slice": field}
    with pytest.raises(RequestError, match=message) as e:
        TensorMeta.from_json(entry, buffer_nbytes=256)
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in str(e.value)


def test_pieces_of_a_rank_slice_load_in_order_and_one_out_of_order_is_refused_by_name():
    """colo's TP engine writes each piece of its slice in place; the load's end counts the
    slice complete only after its last element, and names how far a half-sent one got."""
    from bench.multi_gpu import model_config
    from colo.engine.reference.moe import MoETPEngineCore

    cfg = model_config(MODEL)
    core = MoETPEngineCore(cfg, tp_rank=0, tp_size=1, dtype=torch.float32, total_bytes=64 << 20,
                           mem_fraction_static=0.5)
    name, half = (f"model.layers.0.mlp.experts.{e}.gate_proj.weight" for e in (2, 3))  # (8, 32) each
    block = torch.randn(8, 32)
    flat = block.reshape(-1)

    def piece(a: int, b: int) -> RankSlice:  # elements [a, b) of the one rank's slice: all 8 rows
        return RankSlice(Piece(flat[a:b], a, (8, 32)), 0, 0, (8, 32))

    core.begin_load()
    core.load_weights([(name, piece(0, 96))])
    with pytest.raises(WeightMismatch, match=r"a piece of elements \[200, 256\) where the next piece of its "
                                             r"256 elements starts at 96"):
        core.load_weights([(name, piece(200, 256))])
    core.load_weights([(name, piece(96, 256)), (half, piece(0, 96))])
    s_ = core.model.plan.slices[name]
    held = core.model._params[s_.param][s_.row_offset:s_.row_offset + 8]
    assert torch.equal(held, block)
    with pytest.raises(WeightMismatch) as e:
        core.end_load()
    (line,) = [x for x in str(e.value).splitlines() if x.strip().startswith("missing")]
    missing = [x.split(" (")[0] for x in line.split(": ", 1)[1].split(", ")]
    assert f"{half} (only its first 96 of 256 elements)" in line
    assert half in missing and name not in missing  # the one complete, the other not
    assert len(missing) == len(core.model.sync_map.shards) - 1


def test_an_engine_of_whole_tensors_refuses_a_rank_slice_by_name_and_writes_nothing_of_the_batch():
    from bench.multi_gpu import model_config
    from colo.engine.reference.moe import MoEEngineCore

    cfg = model_config(MODEL)
    core = MoEEngineCore(cfg, dtype=torch.bfloat16, total_bytes=64 << 20, mem_fraction_static=0.5)
    name = "model.layers.0.mlp.experts.2.gate_proj.weight"
    norm = "model.layers.0.input_layernorm.weight"
    before = core.model._params[norm].fill_(3.0).clone()  # (fresh weights are uninitialised: NaNs)
    core.begin_load()
    with pytest.raises(WeightMismatch) as e:
        core.load_weights([(norm, torch.ones(32, dtype=torch.bfloat16)),
                           (name, RankSlice(torch.ones(4, 32, dtype=torch.bfloat16), 0, 0, (8, 32)))])
    assert name in str(e.value) and "this engine loads whole tensors" in str(e.value)
    assert torch.equal(core.model._params[norm], before)


def test_expert_scatter_without_an_expert_parallel_group_is_refused():
    from colo.extractors.megatron import MegatronExtractor

    params = {"decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight": torch.zeros(32, 8)}
    with pytest.raises(ValueError, match="expert_scatter needs an expert-parallel group of 2 or more ranks"):
        MegatronExtractor(params, expert_scatter={"model.layers.0.mlp.experts.0.down_proj.weight": 1})


def test_a_transport_that_cannot_mark_slices_refuses_them_before_the_engine_is_asked():
    import anyio

    from colo.core.interfaces import SyncContext
    from colo.core.memory import StagingBudget
    from colo.transports import make_transport

    class Trainer:
        def extractor(self):
            class Ex:
                def specs(self):
                    return [rank_slice_spec("model.layers.0.mlp.experts.0.up_proj.weight", (8, 32), "bfloat16",
                                            0, 4, 4)]
            return Ex()

    class Engine:
        asked = False

        async def preflight(self, specs):
            Engine.asked = True

    ctx = SyncContext(step=0, weight_version=1, bucket_bytes=1 << 20, source="device", staging=StagingBudget(None))
    sender = make_transport("ipc")
    with pytest.raises(ValueError, match="cannot carry tensors cut for one engine rank"):
        anyio.run(lambda: sender.sync(Trainer(), Engine(), ctx))
    assert not Engine.asked
