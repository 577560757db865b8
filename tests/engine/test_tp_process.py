"""A tensor-parallel engine as processes: two engine ranks (gloo, TP=2) behind the server and client.

Each rank is its own engine process with its own socket; ``EngineClient.spawn_tp``
starts them together and the test drives them as an ``EngineGroup``. The same
full packed buckets go to both ranks (each keeps its shard); the ranks are
checked against ``expected_shard_digest`` and against a TP=1 ``EngineCore``
built in this process on the same weights.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import tempfile

import pytest
import torch

from colo.core.buckets import plan_buckets
from colo.core.buckets import spec as mkspec
from colo.engine.reference.client import EngineClient
from colo.engine.reference.core import EngineCore
from colo.engine.reference.tp import expected_shard_digest
from colo.core.errors import EngineDied, EngineRefused
from colo.groups import EngineGroup
from colo.proc.handles import ShmSegment
from colo.trainers.models import build_trainer_model, demo_config
from colo.transports.base import TensorMeta
from colo.transports.pack import pack_into
from colo.transports.packed import PackedRequest
from tests.conftest import SMALL_CFG
from tests.waits import CEILING_S
from tests.leaks import new_segments

TP = 2
TOTAL, MFS = 64 << 20, 0.5
NEW_TOKENS = 12


class GreedyTask:
    """Four fixed prompts, greedy; the rewards are not looked at here."""

    max_new_tokens = NEW_TOKENS
    temperature = 0.0

    def __init__(self, vocab_size: int):
        self._prompts = torch.randint(0, vocab_size, (4, 8), generator=torch.Generator().manual_seed(3)).tolist()

    def prompts(self, step: int) -> list[list[int]]:
        return self._prompts

    def rewards(self, prompts, completions) -> list[float]:
        return [0.0] * len(completions)

    def seed(self, step: int) -> int:
        return 7


def trainer_state(config) -> dict[str, torch.Tensor]:
    """The trainer's full weights, perturbed so a misplaced shard row shows in the logits."""
    model = build_trainer_model(config, seed=3)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * (0.1 if "norm" in name else 0.05))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture
def short_tmp(monkeypatch, tmp_path_factory):
    """Socket directories go under a directory of our own, so the test can see none is left."""
    # pytest makes its base temp dir on first use, under tempfile's dir: made now, it is
    # not put inside this one (removed below) when a later test is the session's first user
    tmp_path_factory.getbasetemp()
    root = tempfile.mkdtemp(prefix="colo-tp-", dir="/tmp")
    monkeypatch.setattr(tempfile, "tempdir", root)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def socket_dirs(root: str) -> list[str]:
    return [d for d in os.listdir(root) if d.startswith("colo-engine-")]


def engine_children(before: frozenset[int] = frozenset()) -> list:
    """This process's engine children, but those in ``before`` (alive when the test began:
    an earlier test's, not this one's to count)."""
    return [p for p in mp.active_children() if p.name == "colo-engine" and p.pid not in before]


def engines_now() -> frozenset[int]:
    return frozenset(p.pid for p in engine_children())


async def load_full_buckets(group: EngineGroup, state: dict[str, torch.Tensor]) -> list[dict]:
    """The packed path, once for every rank: each rank's transport_load gets the FULL bucket.

    8 KiB buckets: the 32 KiB embedding, lm_head and MLP weights arrive in pieces, and
    each rank writes its slice of every piece in place (the row-parallel down_proj's
    pieces cut across the columns the ranks split)."""
    specs = [mkspec(s.name, s.shape, s.dtype) for s in group.ranks[0].specs]
    await group.each("preflight", specs)
    await group.each("begin_load")
    buckets = plan_buckets(specs, 8 << 10)
    cut = {e.spec.name for b in buckets for e in b.entries if not e.whole}
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.down_proj.weight"} <= cut
    seg = ShmSegment.create(max(b.nbytes for b in buckets))
    replies = []
    try:
        for b in buckets:
            pack_into(seg.tensor, b, [(e.spec.name, state[e.spec.name]) for e in b.entries])
            request = PackedRequest(seg.handle(), tuple(TensorMeta.of_bucket(b))).to_json()
            replies.append(await group.each("transport_load", "packed", request))
        await group.each("end_load")
    finally:
        seg.close()
    return replies


async def test_two_engine_processes_serve_one_tp_engine(short_tmp, tmp_path):
    config = demo_config(**SMALL_CFG)
    build = {"config": config.to_dict(), "dtype": "float32", "device": "cpu", "total_bytes": TOTAL,
             "mem_fraction_static": MFS, "checkpoint": None, "log_path": str(tmp_path / "engine.log")}
    task = GreedyTask(config.vocab_size)
    state = trainer_state(config)
    before = engines_now()
    clients = await EngineClient.spawn_tp(build, TP, task=task)
    group = EngineGroup(clients)
    try:
        assert len({c.process.pid for c in clients}) == TP  # one process per rank
        # every rank announces the full HF names and shapes a sync delivers
        announced = [{s.name: tuple(s.shape) for s in c.specs} for c in clients]
        assert announced[0] == announced[1] == {n: tuple(t.shape) for n, t in state.items()}

        replies = await load_full_buckets(group, state)
        # a load counts the tensors it completed: none for a bucket holding only a middle piece
        assert all(r[0]["tensors"] == r[1]["tensors"] for r in replies)
        assert any(r[0]["tensors"] == 0 for r in replies)
        assert sum(r[0]["tensors"] for r in replies) == len(state)
        assert new_segments() == []
        digests = await group.each("digest")
        for r in range(TP):
            assert digests[r] == expected_shard_digest(state, config, torch.float32, r, TP)
        assert digests[0] != digests[1]
        await group.each("set_weight_version", 1)

        one = EngineCore(config, dtype=torch.float32, device="cpu", total_bytes=TOTAL, mem_fraction_static=MFS,
                         init_state=state)
        probe = torch.randint(0, config.vocab_size, (4, 24), generator=torch.Generator().manual_seed(5))
        want = one.logits(probe).float()
        got = [torch.tensor(x) for x in await group.each("logits", probe.tolist())]
        for r in range(TP):
            diff = (got[r] - want).abs().max().item()
            print(f"rank {r}: max |logit diff| vs TP=1 = {diff:.3g} (max |logit| {want.abs().max().item():.3g})")
            assert got[r].shape == want.shape
            assert torch.allclose(got[r], want, atol=1e-5, rtol=1e-5), diff
        assert torch.equal(got[0], got[1])  # the all-gathered logits are the same bytes on every rank

        # greedy generation: both ranks at once (every step runs collectives)
        rollouts = await group.each("generate", 0)
        want_tokens, _ = one.generate(torch.tensor(task.prompts(0)), NEW_TOKENS, temperature=0.0,
                                      generator=torch.Generator())
        assert rollouts[0].data.completions == rollouts[1].data.completions == want_tokens.tolist()
        assert len({tuple(c) for c in want_tokens.tolist()}) > 1 or len(set(want_tokens[0].tolist())) > 1
    finally:
        await group.each("aclose")
    assert not any(c.process.is_alive() for c in clients)
    assert all(c.process.exitcode is not None for c in clients)
    assert not any(os.path.exists(c._sockdir) for c in clients)
    assert socket_dirs(short_tmp) == []
    assert engine_children(before) == []
    # each rank logged to its own file
    assert all((tmp_path / f"engine.log.rank{r}").exists() for r in range(TP))


async def test_a_rank_that_fails_to_start_takes_every_rank_down(short_tmp):
    config = demo_config(**SMALL_CFG)
    build = {"config": config.to_dict(), "dtype": "float32", "device": "cpu", "total_bytes": TOTAL,
             "mem_fraction_static": MFS, "checkpoint": None}
    # rank 1's interpreter cannot start; rank 0 waits for it at the rendezvous until it is killed
    before = engines_now()
    with pytest.raises(EngineDied, match="exited"):
        await EngineClient.spawn_tp(build, TP, envs=[None, {"PYTHONHOME": "/nonexistent-colo"}],
                                    start_timeout_s=CEILING_S)
    assert engine_children(before) == []
    assert socket_dirs(short_tmp) == []


async def test_a_tp_size_the_model_cannot_split_is_refused_on_every_rank(short_tmp):
    # 4 query heads over 3 ranks: every rank refuses after joining the group, and exits
    config = demo_config(**SMALL_CFG)
    build = {"config": config.to_dict(), "dtype": "float32", "device": "cpu", "total_bytes": TOTAL,
             "mem_fraction_static": MFS, "checkpoint": None}
    # a build the engine refuses is bad input, said in the engine's own words (issue 32, item 5)
    before = engines_now()
    with pytest.raises(EngineRefused, match="tensor-parallel size 3 does not divide num_attention_heads 4"):
        await EngineClient.spawn_tp(build, 3, start_timeout_s=CEILING_S)
    assert engine_children(before) == []
    assert socket_dirs(short_tmp) == []
