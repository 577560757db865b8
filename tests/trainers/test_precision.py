"""bf16 parameters with fp32 master weights (issue 31, item 1): what a real trainer keeps.

The ground truth for the optimizer is torch's own AdamW stepping fp32 copies of the
parameters with the same gradients; for the sync, a real engine process's digest of
what it loaded, against the trainer's contract digest, bit for bit.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import pytest_asyncio
import torch
import torch.distributed as dist

from colo.device.flat_weights import FlatWeights
from colo.core.interfaces import SyncContext
from colo.core.memory import StagingBudget
from colo.trainers import build
from colo.trainers.base import param_dtype_for
from colo.trainers.models import demo_config
from colo.trainers.precision import MasterAdamW, cast_parameters
from colo.transports.packed import PackedTransport
from colo.testing.engines import RecordingEngine
from tests.conftest import SMALL_CFG, fixed_batch, small_engine_build
from tests.dist_helpers import run_workers
from tests.leaks import new_segments


def test_master_adamw_steps_fp32_masters_exactly_as_torch_adamw_and_rounds_them_into_the_parameters():
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(5, 7, generator=g), torch.randn(3, generator=g)]
    params = [torch.nn.Parameter(t.to(torch.bfloat16)) for t in full]
    reference = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    opt = MasterAdamW(params, lr=1e-2, weight_decay=0.0)
    ref = torch.optim.AdamW(reference, lr=1e-2, weight_decay=0.0)
    for step in range(3):
        grads = [torch.randn(p.shape, generator=g).to(torch.bfloat16) for p in params]
        for p, r, gr in zip(params, reference, grads):
            p.grad, r.grad = gr.clone(), gr.float()
        opt.step()
        ref.step()
        opt.zero_grad()
        for m, r, p in zip(opt.masters, reference, params):
            assert m.dtype == torch.float32 and torch.equal(m.detach(), r.detach()), step
            assert p.dtype == torch.bfloat16 and torch.equal(p.detach(), r.detach().to(torch.bfloat16)), step
            assert p.grad is None and m.grad is None
    # small updates accumulate in the masters where bf16 alone would round them away
    assert any(not torch.equal(m.detach().to(torch.bfloat16).float(), m.detach()) for m in opt.masters)
    assert opt.state_bytes == 12 * sum(p.numel() for p in params)
    # the masters and each moment: one buffer each, the parameters' views of it back to back
    # (the memory saver pauses and resumes a region allocation by allocation)
    states = [opt.masters, *([opt.inner.state[m][k] for m in opt.masters] for k in ("exp_avg", "exp_avg_sq"))]
    storages = [{t.untyped_storage().data_ptr() for t in ts} for ts in states]
    assert [len(x) for x in storages] == [1, 1, 1] and len(set.union(*storages)) == 3
    assert all(t.untyped_storage().nbytes() == opt.state_bytes // 3 for ts in states for t in ts)
    assert [[t.storage_offset() for t in ts] for ts in states] == [[0, 35]] * 3


def test_master_adamw_restores_a_failed_step_and_refuses_what_it_is_not_for():
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = MasterAdamW([p], lr=0.1)
    assert opt.snapshot() is None
    p.grad = torch.ones_like(p)
    opt.step()
    saved, before = opt.snapshot(), opt.masters[0].detach().clone()
    p.grad = torch.ones_like(p)
    opt.step()
    assert not torch.equal(opt.masters[0].detach(), before)
    moments = {k: opt.inner.state[opt.masters[0]][k] for k in ("exp_avg", "exp_avg_sq")}
    opt.restore(saved)
    assert torch.equal(opt.masters[0].detach(), before)
    assert opt.inner.state[opt.masters[0]]["step"] == 1
    # restored into the moments' own tensors (views of the optimizer's buffers), not the snapshot's
    for k, t in moments.items():
        assert opt.inner.state[opt.masters[0]][k] is t and torch.equal(t, saved[1][0][k]), k
    with pytest.raises(ValueError, match="float32 already"):
        MasterAdamW([torch.nn.Parameter(torch.ones(2))])
    with pytest.raises(ValueError, match="no parameters"):
        MasterAdamW([])


def test_the_parameter_dtype_follows_the_engine_on_a_gpu_and_is_float32_on_the_cpu_unless_asked():
    assert param_dtype_for(None, "bfloat16", "cuda") == torch.bfloat16
    assert param_dtype_for(None, "bfloat16", "cpu") == torch.float32
    assert param_dtype_for("bfloat16", "float32", "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="trainer parameter dtype must be float32, bfloat16 or float16"):
        param_dtype_for("int8", "bfloat16", "cpu")
    with pytest.raises(ValueError, match="trainer parameter dtype 'bf16' is not a torch dtype"):
        param_dtype_for("bf16", "bfloat16", "cpu")


def test_cast_parameters_leaves_the_rotary_frequencies_in_fp32():
    from colo.trainers.models import build_trainer_model

    model = cast_parameters(build_trainer_model(demo_config(**SMALL_CFG), 0), torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {b.dtype for n, b in model.named_buffers() if "inv_freq" in n} == {torch.float32}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def bf16_engine(tmp_path_factory):
    from colo.engine.reference.client import EngineClient

    config = demo_config(**SMALL_CFG)
    client = await EngineClient.spawn(small_engine_build(tmp_path_factory.mktemp("precision") / "engine.log",
                                                         "bfloat16"))
    try:
        yield client, config
    finally:
        await client.aclose()


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("kind", ["hf", "fsdp", "megatron"])
async def test_every_trainer_keeps_bf16_parameters_fp32_masters_and_syncs_exactly_over_steps(bf16_engine, kind):
    client, config = bf16_engine
    trainer, saver = build(kind, model_config=config, seed=3, engine_dtype="bfloat16", device="cpu",
                           param_dtype="bfloat16")
    engine = RecordingEngine(client)
    transport = PackedTransport()
    try:
        assert saver is None and isinstance(trainer.opt, MasterAdamW)
        assert {p.dtype for p in trainer.model.parameters()} == {torch.bfloat16}
        elements = sum(p.numel() for p in trainer.model.parameters())
        if kind != "fsdp":  # (FSDP's counts its padded shard)
            assert trainer.tag_bytes()["optimizer"] == 12 * elements
        trainer.init_optimizer_state()
        assert {m.dtype for m in trainer.opt.masters} == {torch.float32}
        # the masters and each moment in one buffer each (issue 44: the memory saver pauses
        # allocation by allocation), FSDP2's DTensors over views of their local buffers too
        from torch.distributed.tensor import DTensor

        def storages(ts):
            return {(t.to_local() if isinstance(t, DTensor) else t).untyped_storage().data_ptr() for t in ts}

        state = trainer.opt.inner.state
        assert [len(storages(x)) for x in (trainer.opt.masters, [state[m]["exp_avg"] for m in trainer.opt.masters],
                                            [state[m]["exp_avg_sq"] for m in trainer.opt.masters])] == [1, 1, 1]
        assert all(isinstance(m, DTensor) == (kind == "fsdp") for m in trainer.opt.masters)
        digests = []
        for step in (1, 2):
            before = [p.detach().clone() for p in trainer.model.parameters()]
            await trainer.train_step(SimpleNamespace(data=fixed_batch(config, batch=8, new_tokens=8, seed=step)))
            assert trainer.steps == step
            moved = [not torch.equal(b, p.detach()) for b, p in zip(before, trainer.model.parameters())]
            assert sum(moved) > len(moved) // 2, f"step {step}: only {sum(moved)} of {len(moved)} tensors moved"
            # the parameters are the masters, rounded
            for p, m in zip(trainer.model.parameters(), trainer.opt.masters):
                assert torch.equal(p.detach().full_tensor() if kind == "fsdp" else p.detach(),
                                   (m.detach().full_tensor() if kind == "fsdp" else m.detach()).to(torch.bfloat16))
            budget = StagingBudget(None)
            ctx = SyncContext(step=step, weight_version=step, bucket_bytes=64 << 10, source="device",
                              staging=budget)
            result = await transport.sync(trainer, engine, ctx)
            want = trainer.sent_digest(fresh=True)
            assert await client.digest() == want, (kind, step)
            digests.append(want)
            # bf16 end to end: each byte of the model crosses once, nothing converted
            assert result.bytes == sum(2 * p.numel() for p in trainer.hf_state().values())
            if kind in ("hf", "fsdp"):
                # the model's own storage (FSDP2's one-rank shards: adopt_shards) is the flat
                # buffer: one request, nothing staged
                assert isinstance(trainer.flat_weights, FlatWeights)
                assert (result.buckets, result.staging_peak, budget.peak_bytes) == (1, 0, 0)
            else:
                assert result.buckets > 1 and result.staging_peak > 0
        assert digests[0] != digests[1]
    finally:
        await transport.aclose()
        trainer.close()
    assert not dist.is_initialized()
    assert new_segments() == []


async def paused_syncs_keep_their_extractor(trainer, client, transport, ex, resident: str) -> None:
    """Two ``offload-first`` syncs of a paused trainer: each reuses extractor ``ex`` (made once
    while the backup stays where it is) and leaves the engine with the ``resident`` digest."""
    for step in (1, 2):
        ctx = SyncContext(step=step, weight_version=step, bucket_bytes=64 << 10, source="host",
                          staging=StagingBudget(None))
        await transport.sync(trainer, client, ctx)
        assert trainer.extractor() is ex
        assert await client.digest() == trainer.sent_digest(fresh=True) == resident, step


class KeptBackup:
    """Stands in for the GPU's TrainerMemory with the weights paused and the saver keeping its
    backups: ``host_view`` gives the same tensor for a parameter every time (a copy of it, as
    the pinned backup holds it)."""

    retains_backups = True

    def __init__(self):
        self.saver = self
        self.views: dict[int, torch.Tensor] = {}

    def resident(self, tag):
        return False

    def host_view(self, p):
        return self.views.setdefault(id(p), p.detach().clone())


@pytest.mark.asyncio(loop_scope="module")
async def test_a_paused_one_rank_megatron_syncs_exactly_from_views_of_its_backup(bf16_engine):
    """The GPU's offload-first source of a one-rank Megatron trainer, on the CPU: a bf16 trainer
    into a bf16 engine, its backup the source. All but q/k/v (two query groups, re-ordered) come
    out as views of the backup for the transport to copy straight into its buffer, the
    extractor is made once while the backups stay where they are, and the engine ends with the
    trainer's digest, sync after sync."""
    client, config = bf16_engine
    trainer, _ = build("megatron", model_config=config, seed=3, engine_dtype="bfloat16", device="cpu",
                       param_dtype="bfloat16")
    transport = PackedTransport()
    try:
        await trainer.train_step(SimpleNamespace(data=fixed_batch(config, batch=8, new_tokens=8, seed=1)))
        resident = trainer.sent_digest(fresh=True)
        backup = KeptBackup()
        trainer._memory_backend = backup
        ex = trainer.extractor()
        assert trainer.extractor() is ex and ex.upload_to == torch.device("cpu")
        backup_of = {n: backup.host_view(p) for n, p in trainer.model.named_parameters()}
        got = dict(ex.extract(["model.layers.0.mlp.up_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                               "model.layers.1.self_attn.o_proj.weight"]))
        fc1 = backup_of["decoder.layers.0.mlp.linear_fc1.weight"]
        assert got["model.layers.0.mlp.up_proj.weight"].untyped_storage().data_ptr() == \
            fc1.untyped_storage().data_ptr()
        proj = backup_of["decoder.layers.1.self_attention.linear_proj.weight"]
        assert got["model.layers.1.self_attn.o_proj.weight"].data_ptr() == proj.data_ptr()
        qkv = backup_of["decoder.layers.0.self_attention.linear_qkv.weight"]
        assert got["model.layers.0.self_attn.k_proj.weight"].untyped_storage().data_ptr() != \
            qkv.untyped_storage().data_ptr()
        await paused_syncs_keep_their_extractor(trainer, client, transport, ex, resident)
    finally:
        await transport.aclose()
        trainer.close()
    assert not dist.is_initialized()
    assert new_segments() == []


class FlatPaused:
    """Stands in for the GPU's TrainerMemory of a one-rank Megatron trainer whose weights tag is
    a flat buffer (paused): the memory saver has no backup of a parameter to give."""

    retains_backups = True

    def __init__(self):
        self.saver = self

    def resident(self, tag):
        return False

    def host_view(self, p):
        raise AssertionError("the weights' host views must come from the flat buffer, not the saver")


@pytest.mark.asyncio(loop_scope="module")
async def test_a_one_rank_megatron_adopted_into_a_flat_buffer_trains_and_syncs_from_its_backup(bf16_engine):
    """Issue 44: on one GPU the Megatron trainer's parameters are adopted into one flat buffer
    (paused by itself as one copy). On the CPU, with the buffer standing in for its host
    backup: a trainer adopted after a step trains on as one that was not, bit for bit, and a
    paused sync reads the buffer's views (never the saver's), keeps its extractor, and ends
    with the trainer's digest."""
    from colo.device.flat_weights import FlatWeights

    client, config = bf16_engine
    args = dict(model_config=config, seed=3, engine_dtype="bfloat16", device="cpu", param_dtype="bfloat16")
    trainer, _ = build("megatron", **args)
    twin, _ = build("megatron", **args)
    transport = PackedTransport()
    flat = None
    try:
        for t in (trainer, twin):
            await t.train_step(SimpleNamespace(data=fixed_batch(config, batch=8, new_tokens=8, seed=1)))
        flat = FlatWeights.adopt(trainer.model, device="cpu")
        trainer._flat = flat
        assert trainer.tag_bytes()["weights"] == flat.nbytes
        for t in (trainer, twin):
            await t.train_step(SimpleNamespace(data=fixed_batch(config, batch=8, new_tokens=8, seed=2)))
        flat.check()  # the step wrote into the buffer's views
        for (n, p), q in zip(trainer.model.named_parameters(), twin.model.parameters()):
            assert torch.equal(p.detach(), q.detach()), n
        resident = trainer.sent_digest(fresh=True)
        assert resident == twin.sent_digest(fresh=True)
        trainer._memory_backend = FlatPaused()
        ex = trainer.extractor()
        assert trainer.extractor() is ex  # built once while the backup stays where it is
        proj = flat.tensors["decoder.layers.1.self_attention.linear_proj.weight"]
        got = dict(ex.extract(["model.layers.1.self_attn.o_proj.weight"]))
        assert got["model.layers.1.self_attn.o_proj.weight"].data_ptr() == proj.data_ptr()
        await paused_syncs_keep_their_extractor(trainer, client, transport, ex, resident)
    finally:
        await transport.aclose()
        trainer.close()
        twin.close()
    assert not dist.is_initialized()
    assert new_segments() == []


async def test_bf16_parameters_learn_like_fp32_ones_from_the_same_start():
    """One step of the bf16 trainer (fp32 masters) lands where the fp32 trainer's step
    lands, to bf16's rounding of the start: the masters start at the bf16 weights, so
    the fp32 reference starts there too."""
    config = demo_config(**SMALL_CFG)
    low, _ = build("hf", model_config=config, seed=2, engine_dtype="bfloat16", device="cpu", param_dtype="bfloat16")
    full, _ = build("hf", model_config=config, seed=2, engine_dtype="bfloat16", device="cpu")
    try:
        with torch.no_grad():
            for p, q in zip(full.model.parameters(), low.model.parameters()):
                p.copy_(q.float())
        start = [p.detach().clone() for p in full.model.parameters()]
        data = fixed_batch(config, batch=8, new_tokens=8, seed=4)
        a = await low.train_step(SimpleNamespace(data=data))
        b = await full.train_step(SimpleNamespace(data=data))
        assert a["reward"] == b["reward"]
        assert abs(a["loss"] - b["loss"]) < 0.02 * abs(b["loss"]) + 1e-3
        # AdamW's first step moves each weight by about lr (2e-3) in its gradient's direction:
        # the two steps agree where the gradients' signs do, which is nearly everywhere
        apart = torch.cat([(p.detach() - m.detach()).abs().flatten()
                           for m, p in zip(low.opt.masters, full.model.parameters())])
        moved = torch.cat([(p.detach() - s).abs().flatten() for p, s in zip(full.model.parameters(), start)])
        assert float((moved > 1e-3).float().mean()) > 0.5  # the step did move most weights
        assert float((apart > 1e-3).float().mean()) < 0.05, float((apart > 1e-3).float().mean())
    finally:
        low.close()
        full.close()


@pytest.mark.asyncio(loop_scope="module")
async def test_the_probe_asks_the_engine_for_a_sample_of_the_vocabulary_not_all_of_it(bf16_engine):
    """The verifier's probe compares logits on the batch's tokens and a seeded sample of the
    vocabulary (a Qwen2's whole vocabulary is seconds of JSON per sync): the engine returns
    exactly those columns of its full logits, and refuses ids outside the vocabulary."""
    from colo.apps.demo_setup import PROBE_COLUMNS, probe_batch, probe_columns
    from colo.core.errors import EngineError

    client, config = bf16_engine
    tokens = probe_batch(config.vocab_size, seed=0)
    columns = probe_columns(config.vocab_size, tokens, seed=0)
    assert columns == sorted(set(columns)) and {t for row in tokens for t in row} <= set(columns)
    assert len(columns) <= min(config.vocab_size, PROBE_COLUMNS + 32)
    assert probe_columns(config.vocab_size, tokens, seed=0) == columns  # the same every sync
    full = torch.tensor(await client.logits(tokens))
    part = torch.tensor(await client.logits(tokens, columns=columns))
    assert full.shape[-1] == config.vocab_size and torch.equal(part, full[..., columns])
    with pytest.raises(EngineError, match=r"columns \[%d\] are not vocabulary ids" % config.vocab_size):
        await client.logits(tokens, columns=[0, config.vocab_size])


def fsdp_flat_state_worker(rank: int, world: int, tmp_path) -> dict:
    """Two FSDP2 ranks, bf16 parameters cut unevenly (3 and 7 rows over 2 ranks: one rank
    holds fewer rows), three MasterAdamW steps: with the flat state and with a state per
    parameter, from the same start and gradients."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    out: dict = {}
    for flat in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 7, bias=False)).to(torch.bfloat16)
        fully_shard(model)
        opt = MasterAdamW(model.parameters(), lr=1e-2)
        if not flat:
            opt._flat_state = lambda: None  # the state a tensor each, as for anything else
        opt.init_state()
        locals_ = [m.to_local() for m in opt.masters]
        out[f"storages_{flat}"] = len({t.untyped_storage().data_ptr() for t in locals_})
        out[f"dtensors_{flat}"] = all(isinstance(m, DTensor) for m in opt.masters)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(4, 5, generator=g).to(torch.bfloat16)
        for _ in range(3):
            model(x).float().pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        out[f"params_{flat}"] = [p.detach().full_tensor().float() for p in model.parameters()]
        out[f"masters_{flat}"] = [m.detach().full_tensor() for m in opt.masters]
    dist.barrier()
    return out


def test_fsdp2_masters_and_moments_in_one_buffer_each_step_exactly_like_a_state_per_parameter(tmp_path):
    """FSDP2's sharded parameters (issue 44: its state kept an allocation per parameter, and
    its pause stayed at 0.83-0.85 of the link): the masters and moments are DTensors over
    views of one local buffer each, on every rank, uneven shards included, and three steps
    give bit for bit the parameters and masters of a state per parameter."""
    for rank, res in enumerate(run_workers(fsdp_flat_state_worker, tmp_path)):
        assert (res["storages_True"], res["dtensors_True"], res["dtensors_False"]) == (1, True, True), rank
        assert res["storages_False"] == 3, rank  # (a master each of the 3: the baseline really is per parameter)
        for a, b in zip(res["params_True"] + res["masters_True"], res["params_False"] + res["masters_False"]):
            assert torch.equal(a, b), rank
        assert not torch.equal(res["params_True"][0], res["params_True"][0] * 0)
