"""Issue 31, verification that costs (almost) nothing: once a sync's digest has been asked
for, colo's engine checksums each block as its load writes it, so the next digest reads
back sums the load already made instead of a second pass over every weight. These tests
hold the value to the contract (``expected_digest`` of what the trainer sent) and check
that the sums are used exactly when they are the engine's current weights."""

import pytest
import torch

import colo.engine.reference.model as model_mod
from colo.engine.reference.core import EngineCore
from colo.engine.reference.weights import expected_digest
from colo.trainers.models import build_trainer_model, demo_config
from colo.transports.wire import Piece
from tests.conftest import SMALL_CFG

MiB = 1 << 20


@pytest.fixture(scope="module")
def config():
    return demo_config(**SMALL_CFG)


def _state(config, seed):
    model = build_trainer_model(config, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for p in model.parameters():  # no all-ones norms or zero biases: every tensor its own bytes
            p.add_(torch.randn(p.shape, generator=g) * 0.01)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture
def fresh_passes(monkeypatch):
    """How many times the digest made a second pass over the weights (``weights_digest``)."""
    calls = []
    real = model_mod.weights_digest

    def spy(named):
        calls.append(1)
        return real(named)

    monkeypatch.setattr(model_mod, "weights_digest", spy)
    return calls


def _core(config):
    return EngineCore(config, dtype=torch.float32, device="cpu", total_bytes=16 * MiB, mem_fraction_static=0.5,
                      init_state=None)


def _load(core, batch):
    """One load; a name's pieces go in separate batches (one bucket holds one piece of it)."""
    core.begin_load()
    bucket: list = []
    for name, t in batch:
        if any(n == name for n, _ in bucket):
            core.load_weights(bucket)
            bucket = []
        bucket.append((name, t))
    core.load_weights(bucket)
    core.end_load()


def _pieces(state, elements):
    """Every tensor as runs of at most ``elements`` elements, in order (a small bucket's pieces)."""
    out = []
    for name, t in state.items():
        flat = t.reshape(-1)
        for off in range(0, flat.numel(), elements):
            out.append((name, Piece(data=flat[off:off + elements], shape=tuple(t.shape), offset=off)))
    return out


def _views_of_one_buffer(state):
    """``(name, view)`` of each tensor of ``state``'s shapes, back to back in one new buffer (as
    a kept staging slot or a trainer's flat weights hand them over)."""
    flat = torch.empty(sum(t.numel() for t in state.values()))
    views, off = [], 0
    for name, t in state.items():
        views.append((name, flat[off:off + t.numel()].view(t.shape)))
        off += t.numel()
    return views


def test_after_a_digest_the_next_loads_are_summed_as_written_and_equal_the_trainers(config, fresh_passes):
    core = _core(config)
    states = [_state(config, s) for s in (0, 1, 2)]
    _load(core, list(states[0].items()))
    assert core.digest() == expected_digest(states[0], config, torch.float32)
    assert len(fresh_passes) == 1  # nothing asked before the first load: one pass after it
    _load(core, list(states[1].items()))
    assert core.digest() == expected_digest(states[1], config, torch.float32)
    # in pieces that cross tensors' ends, the sums of each whole block once its last piece is in
    _load(core, _pieces(states[2], 777))
    assert core.digest() == expected_digest(states[2], config, torch.float32)
    assert len(fresh_passes) == 1, "a summed load's digest made a second pass over the weights"


def test_the_sums_are_of_what_the_engine_wrote_so_a_bit_flipped_on_the_way_is_caught(config, fresh_passes):
    core = _core(config)
    state = _state(config, 0)
    _load(core, list(state.items()))
    want = core.digest()
    bad = {k: v.clone() for k, v in state.items()}
    name = "model.layers.1.mlp.down_proj.weight"
    bad[name].view(torch.int32).reshape(-1)[5] ^= 1 << 3  # one bit of one element
    _load(core, list(bad.items()))
    got = core.digest()
    assert got != want and got == expected_digest(bad, config, torch.float32)
    assert len(fresh_passes) == 1


def test_the_same_views_loaded_again_with_new_bytes_are_summed_anew(config, fresh_passes, monkeypatch):
    """A kept staging buffer hands over the same views every sync (the engine's batch memo
    writes them without checking again): the sums must be of the new bytes."""
    core = _core(config)
    memo_loads = []
    real = model_mod._BatchMemo.load
    monkeypatch.setattr(model_mod._BatchMemo, "load", lambda self, *a: memo_loads.append(1) or real(self, *a))
    states = [_state(config, s) for s in (0, 1, 2)]
    views = _views_of_one_buffer(states[0])
    for state in states:
        for name, v in views:
            v.copy_(state[name])
        _load(core, views)
        assert core.digest() == expected_digest(state, config, torch.float32)
    assert len(memo_loads) == 2  # the last two loads went through the memo
    assert len(fresh_passes) == 1


def test_no_digest_asked_no_sums_and_weights_that_changed_are_read_again(config, fresh_passes, monkeypatch):
    core = _core(config)
    state = _state(config, 0)
    summed = []
    real = model_mod.Blocks.lanes
    monkeypatch.setattr(model_mod.Blocks, "lanes", lambda self: summed.append(len(self.names)) or real(self))
    _load(core, list(state.items()))
    assert core.last_route == "tensors"  # host tensors, no kernel: one by one and one foreach call
    _load(core, list(state.items()))
    assert core.last_route == "memo"  # the same tensors again: the batch as it was written before
    assert summed == [], "a load summed its blocks though no digest was asked for"
    want = expected_digest(state, config, torch.float32)
    assert core.digest() == want and len(fresh_passes) == 1
    _load(core, list(state.items()))
    assert sum(summed) == len(state)
    # released and woken, the weights are garbage until a load: the sums no longer stand for them
    core.release(["weights"])
    core.resume(["weights"])
    with torch.no_grad():
        core.model._params["model.norm.weight"].fill_(3.0)
    assert core.digest() != want and len(fresh_passes) == 2
    # a load that fails (a name left out) leaves no sums behind either
    core.begin_load()
    core.load_weights([(n, t) for n, t in state.items() if n != "model.norm.weight"])
    with pytest.raises(Exception, match="model.norm.weight"):
        core.end_load()
    assert core.digest() != want and len(fresh_passes) == 3
    _load(core, list(state.items()))
    assert core.digest() == want and len(fresh_passes) == 3


def test_a_summed_load_makes_its_tables_once_per_allocation_of_the_weights(config, fresh_passes, monkeypatch):
    """Issue 44: summing a load is one launch per group of blocks from a table made the first
    time (``colo.digest.Blocks``), not a checksum object per tensor every sync. The kernel's
    stand-in reads the table's addresses on the host, so the table path itself is checked
    against the trainer's digest; a release drops the tables with the weights they point into."""
    import colo.digest as D
    from tests.test_digest import _lanes_on_the_host

    monkeypatch.setattr(D, "_batch_kernel", lambda: _lanes_on_the_host)
    monkeypatch.setattr(D, "_batchable", lambda t: True)
    monkeypatch.setattr(D, "_launch_batch", _lanes_on_the_host)
    monkeypatch.setattr(model_mod, "LOAD_DIGEST_BYTES", 64 << 10)  # several groups in one load
    made = []
    real = model_mod.Blocks.__init__
    monkeypatch.setattr(model_mod.Blocks, "__init__", lambda self, named: made.append(len(named)) or real(self, named))
    core = _core(config)
    states = [_state(config, s) for s in (0, 1, 2, 3)]
    _load(core, list(states[0].items()))
    assert core.digest() == expected_digest(states[0], config, torch.float32) and made == []
    _load(core, list(states[1].items()))
    assert core.digest() == expected_digest(states[1], config, torch.float32)
    groups = len(made)
    assert groups > 1 and sum(made) == len(states[1])  # every block in exactly one group
    _load(core, list(states[2].items()))
    assert core.digest() == expected_digest(states[2], config, torch.float32)
    assert len(made) == groups, "the second summed load made its tables again"
    core.release(["weights"])
    core.resume(["weights"])
    assert core.model._sum_tables == {}
    _load(core, list(states[3].items()))
    assert core.digest() == expected_digest(states[3], config, torch.float32)
    assert len(made) == 2 * groups and len(fresh_passes) == 1


def test_whole_tensors_on_the_engines_device_load_in_one_launch_that_also_sums_them(config, fresh_passes,
                                                                                      monkeypatch):
    """Issue 44: a batch of whole tensors already on the engine's GPU in its dtype (a sync-first
    bucket, a trainer's flat weights) is copied in one launch (``colo.digest.Copies``), and a
    load being summed takes its lanes from that same launch: no second read of the blocks
    (no ``Blocks`` made), no copy per tensor. The kernel's stand-in reads the tables on the
    host, so the engine's use of them is checked here: what it holds and the digest equal the
    trainer's, the batch memo reuses the table, a flipped bit is caught."""
    import colo.digest as D
    from tests.test_digest import _copy_on_the_host

    run = _copy_on_the_host(D._COPY_BLOCK * D._COPY_ITERS)
    launches = []
    monkeypatch.setattr(D, "_copy_kernel", lambda: run)
    monkeypatch.setattr(D, "_batchable", lambda t: True)
    monkeypatch.setattr(D, "_launch_copy", lambda meta, n, *a: launches.append(n) or run(meta, n, *a))
    made = []
    real = model_mod.Blocks.__init__
    monkeypatch.setattr(model_mod.Blocks, "__init__", lambda self, named: made.append(len(named)) or real(self, named))
    monkeypatch.setattr(model_mod.EngineModel, "_write", lambda *a: pytest.fail("a tensor copied on its own"))
    core = _core(config)
    states = [_state(config, s) for s in (0, 1, 2)]
    views = _views_of_one_buffer(states[0])
    routes = []
    for i, state in enumerate(states):
        for name, v in views:
            v.copy_(state[name])
        core.model.last_route_parts = {"table": 1.0}  # as a planned load before this one left it
        _load(core, views)
        routes.append(core.last_route)
        assert core.last_route_parts == {}  # only a planned load's parts are named, not a memo's
        assert core.digest() == expected_digest(state, config, torch.float32), i
        assert all(torch.equal(core.model._row_block(core.model._params, n), state[n]) for n in state)
    assert launches == [len(views)] * 3 and made == [] and len(fresh_passes) == 1
    assert routes == ["launch", "memo_launch", "memo_launch"]
    bad = dict(states[2])
    name = "model.layers.0.self_attn.q_proj.weight"
    flat_view = dict(views)[name]
    flat_view.view(-1).view(torch.int32)[3] ^= 1 << 20
    bad[name] = flat_view.clone()
    _load(core, views)
    assert core.digest() == expected_digest(bad, config, torch.float32) != expected_digest(states[2], config,
                                                                                           torch.float32)


def test_a_layout_loaded_in_one_launch_is_planned_once_and_laid_on_each_new_buffer(config, fresh_passes,
                                                                                    monkeypatch):
    """Issue 44: a sender that frees its staging after each sync maps a new buffer every sync
    with the same layout (the receiver's cached ``TensorMeta`` tuple). The engine plans that
    layout once (each tensor's offset, its row block) and loads the next buffers with no check
    or placement per tensor (``LoadSession.check`` not called again) and no view per tensor
    (the request's views are never made), one launch each; the weights and digests are the
    trainer's; a session that already has one of the names still refuses the batch by name."""
    import colo.digest as D
    from colo.core.buckets import plan_buckets
    from colo.core.errors import WeightMismatch
    from colo.engine.kit import LoadSession
    from colo.extractors.plain import PlainExtractor
    from colo.transports.pack import pack_into
    from colo.transports.wire import TensorMeta, views
    from tests.test_digest import _copy_on_the_host

    run = _copy_on_the_host(D._COPY_BLOCK * D._COPY_ITERS)
    monkeypatch.setattr(D, "_copy_kernel", lambda: run)
    monkeypatch.setattr(D, "_batchable", lambda t: True)
    tables = []  # what each launch was given
    monkeypatch.setattr(D, "_launch_copy", lambda table, *a: tables.append(table) or run(table, *a))
    checks = []
    real_check = LoadSession.check
    monkeypatch.setattr(LoadSession, "check", lambda self, items: checks.append(len(items)) or real_check(self, items))
    core = _core(config)
    states = [_state(config, s) for s in (0, 1, 2)]
    (bucket,) = plan_buckets(PlainExtractor(states[0]).specs(), 1 << 30)
    layout = tuple(TensorMeta.of_bucket(bucket))
    made, routes, parts = [], [], []
    for i, state in enumerate(states):
        flat = torch.zeros(bucket.nbytes + 64 * i, dtype=torch.uint8)[64 * i:]  # a new buffer each sync
        pack_into(flat, bucket, [(e.spec.name, state[e.spec.name]) for e in bucket.entries])
        core.begin_load()
        request = views(flat, layout)
        assert core.load_weights(request) == len(layout)
        made.append(request._pairs is not None)
        routes.append(core.last_route)
        parts.append(dict(core.last_route_parts))
        core.end_load()
        assert core.digest() == expected_digest(state, config, torch.float32), i
    assert checks == [len(layout)]  # the first buffer only
    assert made == [True, False, False]  # a planned layout's views are never made: flat and layout only
    assert routes == ["launch", "plan", "plan"]  # and the engine says so in its reply
    # the planned route's host time in its parts: the table laid on the buffer, and the launch
    # (its own parts on a GPU only: the stand-in here is the whole launch)
    assert parts[0] == {} and all(sorted(p) == ["launch", "table"] and min(p.values()) >= 0 for p in parts[1:])
    # the launch laid its table on the host; the plan's was made and put on the device once, with
    # the sources as offsets: each planned load gives the kernel that same table and its buffer
    assert type(tables[0]).__name__ == "ndarray" and isinstance(tables[1], torch.Tensor) and tables[2] is tables[1]
    core.begin_load()
    first = bucket.entries[0].spec.name
    core.load_weights([(first, states[0][first])])
    with pytest.raises(WeightMismatch, match=first):
        core.load_weights(views(flat, layout))


class _PausingSaver:
    """A memory saver that keeps the tensors where they are (torch_memory_saver on a GPU
    keeps their virtual addresses and unmaps the pages; here nothing is unmapped), with a
    record of what was paused and resumed."""

    def __init__(self):
        self.calls = []

    def region(self, key):
        import contextlib

        return contextlib.nullcontext()

    def pause(self, key):
        self.calls.append(("pause", key))

    def resume(self, key):
        self.calls.append(("resume", key))


def test_weights_paused_by_the_saver_keep_their_plans_and_tables_across_a_release(config, fresh_passes,
                                                                                monkeypatch):
    """Issue 44: every cycle of the colocated loop releases the engine's weights. Paused by the
    memory saver they come back at the same addresses, so the layouts planned, the summed
    load's tables and the row blocks made for them hold: the cycle after a release neither
    checks each tensor again nor makes a table again, and its weights and digest are the
    trainer's. Weights that were dropped (no saver) take all of that with them."""
    import colo.digest as D
    from colo.core.buckets import plan_buckets
    from colo.engine.kit import LoadSession
    from colo.extractors.plain import PlainExtractor
    from colo.transports.pack import pack_into
    from colo.transports.wire import TensorMeta, views
    from tests.test_digest import _copy_on_the_host

    run = _copy_on_the_host(D._COPY_BLOCK * D._COPY_ITERS)
    monkeypatch.setattr(D, "_copy_kernel", lambda: run)
    monkeypatch.setattr(D, "_batchable", lambda t: True)
    monkeypatch.setattr(D, "_launch_copy", run)
    checks, made = [], []
    real_check, real_blocks = LoadSession.check, model_mod.Blocks.__init__
    monkeypatch.setattr(LoadSession, "check", lambda self, items: checks.append(len(items)) or real_check(self, items))
    monkeypatch.setattr(model_mod.Blocks, "__init__", lambda self, named: made.append(len(named)) or real_blocks(self, named))
    saver = _PausingSaver()
    core = EngineCore(config, dtype=torch.float32, device="cpu", total_bytes=16 * MiB, mem_fraction_static=0.5,
                      init_state=None, saver=saver)
    states = [_state(config, s) for s in range(4)]
    (bucket,) = plan_buckets(PlainExtractor(states[0]).specs(), 1 << 30)
    layout = tuple(TensorMeta.of_bucket(bucket))
    blocks = None
    for i, state in enumerate(states):
        if i:
            core.release(["weights"])
            core.resume(["weights"])
        flat = torch.zeros(bucket.nbytes + 64 * i, dtype=torch.uint8)[64 * i:]  # a new buffer each sync
        pack_into(flat, bucket, [(e.spec.name, state[e.spec.name]) for e in bucket.entries])
        core.begin_load()
        core.load_weights(views(flat, layout))
        core.end_load()
        assert core.digest() == expected_digest(state, config, torch.float32), i
        blocks = blocks or dict(core.model._dests)
        assert core.model._dests == blocks  # the same row blocks, cycle after cycle
    assert ("pause", "engine.weights") in saver.calls and ("resume", "engine.weights") in saver.calls
    assert checks == [len(layout)] and made == [] and len(fresh_passes) == 1


def test_a_digest_that_does_not_arm_leaves_the_next_load_unsummed_and_reads_the_live_weights(
        config, fresh_passes, monkeypatch):
    """``digest(arm=False)``: the digest taken beside a trainer's offload (EngineClient.live_digest,
    Scheduler._digests_beside_offload) is read from the weights, and asks no sums of the next load;
    a digest that arms (every other) has the next load sum as it writes, as before."""
    core = _core(config)
    states = [_state(config, s) for s in (0, 1, 2)]
    summed = []
    real = model_mod.Blocks.lanes
    monkeypatch.setattr(model_mod.Blocks, "lanes", lambda self: summed.append(len(self.names)) or real(self))
    _load(core, list(states[0].items()))
    assert core.digest() == expected_digest(states[0], config, torch.float32)  # arms
    _load(core, list(states[1].items()))
    assert sum(summed) == len(states[1])  # summed as it wrote
    assert core.digest(arm=False) == expected_digest(states[1], config, torch.float32)  # the load's sums
    summed.clear()
    _load(core, list(states[2].items()))
    assert summed == [], "a load summed its blocks after a digest that did not arm"
    passes = len(fresh_passes)
    assert core.digest(arm=False) == expected_digest(states[2], config, torch.float32)
    assert len(fresh_passes) == passes + 1  # read from the live weights, one pass
