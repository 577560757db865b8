"""Issue 44, build item 3: tensors that lie strided in the sender's buffer.

A one-copy sync out of a Megatron trainer's flat buffer (``colo.transports.packed.one_copy_bucket``)
hands q, k and v of each fused QKV over as they lie: Megatron interleaves them per query group
(``[q heads; k; v]`` for each group), so each is one run per group with the others' rows between,
described on the wire by ``view_shape`` and ``strides`` (``colo.transports.wire.TensorMeta.view``).
Here the buffer is laid out by hand as Megatron lays it, independently of the sender's code; colo's
engine must load each strided tensor with one copy from where it lies, and its weights and digest
must be the trainer's. Every other receiver gets the tensor in its own shape (a copy made first).
"""

import pytest
import torch

import colo.engine.reference.model as model_mod
from colo.engine.reference.core import EngineCore
from colo.engine.reference.weights import expected_digest
from colo.trainers.models import demo_config
from colo.transports.wire import Strided, TensorMeta, views
from tests.conftest import SMALL_CFG
from tests.engine.test_load_digest import _state  # a model's state with every tensor its own bytes

MiB = 1 << 20


@pytest.fixture(scope="module")
def config():
    return demo_config(**SMALL_CFG)


def megatron_layout(state, config):
    """A float32 buffer layout holding ``state`` as a Megatron trainer's flat buffer does: each
    layer's q, k and v (weight and bias) fused per query group, everything else whole. Returns
    ``(nbytes, layout, fill)``: ``fill(flat, state)`` writes a state's bytes into a buffer."""
    groups = config.num_key_value_heads
    per = config.num_attention_heads // groups
    hd = config.hidden_size // config.num_attention_heads
    metas, writes, offset = [], [], 0
    fused_done = set()
    for name, t in state.items():
        if ".self_attn." in name and name.rsplit(".", 2)[-2] in ("q_proj", "k_proj", "v_proj"):
            prefix, kind = name.rsplit(".", 2)[0], name.rsplit(".", 1)[1]
            if (prefix, kind) in fused_done:
                continue
            fused_done.add((prefix, kind))
            q, k, v = (f"{prefix}.{x}_proj.{kind}" for x in "qkv")
            rest = tuple(state[q].shape[1:])
            inner = 1
            for d in rest:
                inner *= d
            row = (per + 2) * hd  # one group's rows: [its q heads; k; v]
            start = offset
            for x, first, rows in ((q, 0, per * hd), (k, per * hd, hd), (v, (per + 1) * hd, hd)):
                vshape = (groups, rows, *rest)
                strides = (row * inner, *((inner, 1) if rest else (1,)))
                span = (groups - 1) * row * inner + rows * inner
                at = start + first * inner * 4
                metas.append(TensorMeta(x, tuple(state[x].shape), "float32", at, at + span * 4, 0,
                                        (vshape, strides)))
            total = groups * row * inner
            writes.append(("fused", start, (q, k, v), (groups, per, hd, rest)))
            offset = start + total * 4
            offset = (offset + 15) // 16 * 16
            continue
        metas.append(TensorMeta(name, tuple(t.shape), "float32", offset, offset + t.numel() * 4))
        writes.append(("whole", offset, name, None))
        offset = (offset + t.numel() * 4 + 15) // 16 * 16

    def fill(flat, st):
        f32 = flat.view(torch.float32)
        for kind, start, what, dims in writes:
            if kind == "whole":
                t = st[what]
                f32[start // 4:start // 4 + t.numel()].copy_(t.reshape(-1))
                continue
            q, k, v = (st[x] for x in what)
            g, per_, hd_, rest = dims
            parts = [torch.cat([q.reshape(g, per_ * hd_, *rest)[i], k.reshape(g, hd_, *rest)[i],
                                v.reshape(g, hd_, *rest)[i]]) for i in range(g)]
            fused = torch.cat(parts).reshape(-1)
            f32[start // 4:start // 4 + fused.numel()].copy_(fused)

    # the engine's row blocks come in its spec order; the layout keeps the state's order
    order = {n: i for i, n in enumerate(state)}
    return offset, tuple(sorted(metas, key=lambda m: order[m.name])), fill


def _core(config):
    return EngineCore(config, dtype=torch.float32, device="cpu", total_bytes=16 * MiB, mem_fraction_static=0.5,
                      init_state=None)


def test_strided_tensors_are_loaded_from_where_they_lie_and_the_digest_is_the_trainers(config):
    state = _state(config, 0)
    nbytes, layout, fill = megatron_layout(state, config)
    strided = [m for m in layout if m.view is not None]
    assert len(strided) == 6 * config.num_hidden_layers and all(m.whole for m in strided)
    flat = torch.zeros(nbytes, dtype=torch.uint8)
    fill(flat, state)
    # every receiver but colo's engine: the tensor in its own shape, equal to the trainer's
    got = dict(views(flat, layout))
    assert sorted(got) == sorted(state) and all(torch.equal(got[n], state[n]) for n in state)
    # colo's engine: the strided views as they lie (sharing the buffer), never copied first
    sources = dict(views(flat, layout).sources())
    for m in strided:
        s = sources[m.name]
        assert isinstance(s, Strided) and s.shape == m.shape and not s.data.is_contiguous()
        assert s.data.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        assert torch.equal(s.tensor(), state[m.name])
    core = _core(config)
    core.digest()  # asked once: the next loads are summed as they write
    for seed in (1, 2):
        state = _state(config, seed)
        fill(flat, state)
        request = views(flat, layout)
        core.begin_load()
        assert core.load_weights(request) == len(layout)
        assert request._pairs is None  # the receiver's own tensors (copies of the strided ones) never made
        core.end_load()
        assert core.digest() == expected_digest(state, config, torch.float32), seed
        assert all(torch.equal(core.model._row_block(core.model._params, n), state[n]) for n in state), seed


def test_a_tensor_parallel_rank_is_given_the_tensors_in_their_own_shapes(config):
    """A TP engine rank cuts its slice out of each tensor's own shape: it is not given strided
    views, and what it loads is the trainer's tensors (one rank here: a group of two needs two
    processes; the slice is ``write_slice``'s, the same at any size)."""
    from colo.engine.reference.tp import TPEngineModel, expected_shard_digest

    state = _state(config, 3)
    nbytes, layout, fill = megatron_layout(state, config)
    flat = torch.zeros(nbytes, dtype=torch.uint8)
    fill(flat, state)
    model = TPEngineModel(config, tp_rank=0, tp_size=1, dtype=torch.float32, device="cpu",
                          total_bytes=16 * MiB, mem_fraction_static=0.5)
    model.begin_load()
    request = views(flat, layout)
    model.load_weights(request)
    model.end_load()
    assert request._pairs is not None  # given the receiver's tensors, in their own shapes
    assert model.digest() == expected_shard_digest(state, config, torch.float32, 0, 1)


def test_a_strided_layout_loads_in_one_launch_a_run_per_query_group_planned_once(config, monkeypatch):
    """On a GPU every tensor goes in one launch (``colo.digest.Copies``, here its host stand-in),
    a strided one as its contiguous runs (one per query group), each into its place in the row
    block, its lanes counted from the run's first word in the tensor and summed per tensor; the
    layout is planned once: the next buffers of it are neither checked again nor viewed per
    tensor. The weights and the digest (from the launch's lanes alone) are the trainer's."""
    import colo.digest as D
    from colo.engine.kit import LoadSession
    from tests.test_digest import _copy_on_the_host

    run = _copy_on_the_host(D._COPY_BLOCK * D._COPY_ITERS)
    launches = []
    monkeypatch.setattr(D, "_copy_kernel", lambda: run)
    monkeypatch.setattr(D, "_batchable", lambda t: True)
    monkeypatch.setattr(D, "_launch_copy", lambda meta, n, *a: launches.append(n) or run(meta, n, *a))
    checks, writes = [], []
    real_check, real_write = LoadSession.check, model_mod.EngineModel._write
    monkeypatch.setattr(LoadSession, "check", lambda self, items: checks.append(len(items)) or real_check(self, items))

    def write(self, params, name, tensor):
        writes.append((name, type(tensor).__name__))
        return real_write(self, params, name, tensor)

    monkeypatch.setattr(model_mod.EngineModel, "_write", write)
    blocks = []
    real_blocks = model_mod.Blocks.__init__
    monkeypatch.setattr(model_mod.Blocks, "__init__", lambda self, named: blocks.append(len(named)) or real_blocks(self, named))
    core = _core(config)
    states = [_state(config, s) for s in (4, 5, 6)]
    nbytes, layout, fill = megatron_layout(states[0], config)
    strided = [m.name for m in layout if m.view is not None]
    core.digest()  # the loads below are summed as they write
    for i, state in enumerate(states):
        flat = torch.zeros(nbytes + 64 * i, dtype=torch.uint8)[64 * i:]  # a new buffer each sync
        fill(flat, state)
        request = views(flat, layout)
        core.begin_load()
        assert core.load_weights(request) == len(layout)
        assert request._pairs is None
        core.end_load()
        assert core.digest() == expected_digest(state, config, torch.float32), i
        assert all(torch.equal(core.model._row_block(core.model._params, n), state[n]) for n in state), i
    assert checks == [len(layout)]  # the first buffer only
    groups = config.num_key_value_heads
    assert launches == [len(layout) - len(strided) + groups * len(strided)] * 3  # rows: one per run
    assert writes == [] and blocks == []  # nothing copied on its own, no block read again to sum it
