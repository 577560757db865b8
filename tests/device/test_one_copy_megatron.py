"""Issue 44, build item 3: the Megatron trainer at one rank syncs in one copy.

Its parameters lie in one flat buffer (``colo.device.flat_weights.FlatWeights``, adopted as
the trainer does on a GPU; here on the CPU, a ``/dev/shm`` segment), and the extractor says
where each HF tensor lies in it (``MegatronExtractor.source_views``): gate and up are row
ranges of ``linear_fc1``, q, k and v strided views of the fused ``linear_qkv`` (per query
group ``[q heads; k; v]``). ``one_copy_bucket`` makes that one bucket, the strided entries
carrying their strides on the wire, and the engine copies each tensor straight out of the
trainer's memory.

Real parts: megatron-core's GPTModel (the trainer of ``--trainer megatron``), the packed
transport's receiver, colo's engine in its own process; values compared bit for bit and
digests as the verifier compares them.
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

import pytest_asyncio  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from colo.core.errors import RequestError  # noqa: E402
from colo.core.interfaces import SyncContext  # noqa: E402
from colo.core.memory import StagingBudget  # noqa: E402
from colo.device.flat_weights import FlatWeights  # noqa: E402
from colo.engine.reference.weights import expected_digest  # noqa: E402
from colo.testing.engines import RecordingEngine  # noqa: E402
from colo.trainers import build  # noqa: E402
from colo.trainers.models import demo_config  # noqa: E402
from colo.transports.packed import PackedReceiver, PackedRequest, PackedTransport, one_copy_bucket  # noqa: E402
from colo.transports.wire import Strided, TensorMeta, views  # noqa: E402
from tests.conftest import SMALL_CFG, small_engine_build  # noqa: E402
from tests.leaks import new_segments  # noqa: E402


def _qkv_names(config) -> list[str]:
    return [f"model.layers.{i}.self_attn.{x}_proj.{w}" for i in range(config.num_hidden_layers)
            for w in ("weight", "bias") for x in "qkv"]


@pytest.fixture
def megatron_flat():
    """A float32 megatron-core trainer (engine float32: nothing converted) of SMALL_CFG (4
    heads in 2 query groups: q, k and v interleave), its parameters adopted into one flat
    buffer on the CPU as :func:`colo.trainers.megatron.build` adopts them on a GPU."""
    config = demo_config(**SMALL_CFG)
    trainer, _ = build("megatron", model_config=config, seed=1, engine_dtype="float32", device="cpu")
    flat = FlatWeights.adopt(trainer.model, device="cpu")
    trainer.flat_weights = flat
    try:
        yield trainer, flat, config
    finally:
        flat.close()
        trainer.close()
    assert not dist.is_initialized()
    assert new_segments() == []


def test_megatron_at_one_rank_is_one_bucket_whose_strided_entries_the_receiver_views_exactly(megatron_flat):
    trainer, flat, config = megatron_flat
    assert config.num_attention_heads // config.num_key_value_heads > 1 < config.num_key_value_heads
    want = trainer.hf_state()  # the old path: extract, q, k and v copied out of the fused QKV
    specs = trainer.param_specs()
    bucket = one_copy_bucket(flat, trainer.extractor())
    assert bucket is not None and bucket.index == 0 and bucket.nbytes == flat.nbytes
    assert [e.spec.name for e in bucket.entries] == [s.name for s in specs]
    strided = {e.spec.name: e for e in bucket.entries if e.view is not None}
    assert sorted(strided) == sorted(_qkv_names(config))
    assert all(e.whole and e.last and e.nbytes == e.spec.nbytes for e in bucket.entries)
    # gate and up are row ranges of linear_fc1: contiguous entries, each half of its slot
    a, b = flat.slots["decoder.layers.0.mlp.linear_fc1.weight"]
    entry = {e.spec.name: e for e in bucket.entries}
    gate, up = entry["model.layers.0.mlp.gate_proj.weight"], entry["model.layers.0.mlp.up_proj.weight"]
    assert (gate.start, gate.end, up.start, up.end) == (a, (a + b) // 2, (a + b) // 2, b)
    # q of layer 0 starts where linear_qkv does and spans to its last group's last q row
    a, b = flat.slots["decoder.layers.0.self_attention.linear_qkv.weight"]
    q = strided["model.layers.0.self_attn.q_proj.weight"]
    groups, per = config.num_key_value_heads, config.num_attention_heads // config.num_key_value_heads
    hd, hidden = config.hidden_size // config.num_attention_heads, config.hidden_size
    assert q.start == a and q.view == ((groups, per * hd, hidden), ((per + 2) * hd * hidden, hidden, 1))
    assert q.end == a + ((groups - 1) * (per + 2) * hd + per * hd) * hidden * 4 <= b
    # through the wire as the engine gets it: JSON, parsed, viewed out of the exported handle
    metas = [m.to_json() for m in TensorMeta.of_bucket(bucket)]
    assert [TensorMeta.from_json(m, buffer_nbytes=flat.nbytes).to_json() for m in metas] == metas
    assert {"strides", "view_shape"} <= set(next(m for m in metas if m["name"] in strided))
    plain = next(m for m in metas if m["name"] not in strided)
    assert set(plain) == {"name", "shape", "dtype", "start_idx", "end_idx", "numel"}  # SGLang's six, as ever
    request = PackedRequest.from_json({"handle": flat.export(), "tensors": metas})
    receiver = PackedReceiver()
    try:
        with receiver.receive(request) as named:
            got = dict(named)
            assert list(got) == [s.name for s in specs]
            for name, t in want.items():
                assert tuple(got[name].shape) == tuple(t.shape) and torch.equal(got[name], t), name
            for name, s in named.sources():
                if name in strided:
                    assert isinstance(s, Strided) and not s.data.is_contiguous() and s.shape == tuple(want[name].shape)
                    assert torch.equal(s.tensor(), want[name]), name
    finally:
        receiver.close()
    # the views are the trainer's memory: a change in place shows in the next bucket's bytes
    qkv = dict(trainer.model.named_parameters())["decoder.layers.1.self_attention.linear_qkv.bias"]
    with torch.no_grad():
        qkv.add_(1.0)
    again = dict(views(flat.readable(), TensorMeta.of_bucket(bucket)))
    assert torch.equal(again["model.layers.1.self_attn.v_proj.bias"], want["model.layers.1.self_attn.v_proj.bias"] + 1)


def test_the_real_extractors_source_views_share_the_parameters_memory_and_equal_extract(megatron_flat):
    """Through megatron-core's own GPTModel parameters at TP=1: every output ``source_views``
    gives is a view of its parameter (the same storage, inside the parameter's bytes), bit for
    bit what ``extract`` (the packed path's source) yields, and not a copy: written through the
    parameter, the view shows it."""
    trainer, flat, config = megatron_flat
    ex = trainer.extractor()
    names = [s.name for s in trainer.param_specs()]
    old = {n: t.clone() for n, t in ex.extract(names)}
    params = dict(trainer.model.named_parameters())
    for name, view in ex.source_views(names):
        p = params[ex._by_target[name]].detach()
        assert view is not None and view.untyped_storage().data_ptr() == p.untyped_storage().data_ptr(), name
        lo = p.storage_offset()
        assert lo <= view.storage_offset() and view.storage_offset() - lo + 1 <= p.numel(), name
        assert torch.equal(view.reshape(old[name].shape), old[name]), name
    k = "model.layers.1.self_attn.k_proj.bias"
    with torch.no_grad():
        params["decoder.layers.1.self_attention.linear_qkv.bias"].mul_(-1)
    (_, view), = ex.source_views([k])
    assert torch.equal(view.reshape(-1), -old[k])


def test_a_conversion_is_not_one_copy(megatron_flat):
    from colo.extractors.megatron import MegatronExtractor

    trainer, flat, _ = megatron_flat
    converting = MegatronExtractor(list(trainer.model.named_parameters()), dtype=torch.bfloat16,
                                   **trainer._extractor_args)
    assert one_copy_bucket(flat, converting) is None


def test_flat_weights_locate_views_inside_the_buffer_only(megatron_flat):
    trainer, flat, _ = megatron_flat
    fused = dict(trainer.model.named_parameters())["decoder.layers.0.self_attention.linear_qkv.weight"].detach()
    a, b = flat.slots["decoder.layers.0.self_attention.linear_qkv.weight"]
    k = dict(trainer.extractor().source_views(["model.layers.0.self_attn.k_proj.weight"]))[
        "model.layers.0.self_attn.k_proj.weight"]
    assert flat.locate(k) is None  # not contiguous: no byte range holds it alone
    start, end, strides = flat.locate_view(k)
    assert a < start < end <= b and strides == k.stride()
    assert flat.locate_view(fused) == (a, b, fused.stride())
    assert flat.locate_view(fused.clone()) is None  # another storage
    # a view reaching past the buffer's end is not located (the storage is the buffer, so no
    # such view can be made: the buffer is told it ends inside k's span instead)
    real, flat.nbytes = flat.nbytes, end - 4
    try:
        assert flat.locate_view(k) is None
    finally:
        flat.nbytes = real


def _strided_meta(bucket, name: str) -> dict:
    return next(m.to_json() for m in TensorMeta.of_bucket(bucket) if m.name == name)


@pytest.mark.parametrize("change, message", [
    (lambda m: m.update(end_idx=m["end_idx"] + 4, numel=m["numel"] + 4), r"expected end_idx \d+ \(got \d+\)"),
    (lambda m: m.update(strides=[m["strides"][0] * 1000, *m["strides"][1:]]),
     r"reads bytes \[\d+, \d+\); expected end_idx"),
    (lambda m: m.update(strides=m["strides"][1:]), r"2 strides .* for the 3 dimensions of view_shape"),
    (lambda m: m.update(view_shape=[m["view_shape"][0] + 1, *m["view_shape"][1:]]),
     r"view_shape \[\d+, \d+, \d+\] holds \d+ elements; expected the \d+ of shape"),
    (lambda m: m.update(strides=[-1, 1, 1]), r"strides must be a list of non-negative integers"),
    (lambda m: m.pop("strides"), r"view_shape without strides"),
    (lambda m: m.update(piece_offset=0), r"cannot be a piece"),
])
def test_a_strided_entry_that_would_leave_the_buffer_or_misdescribe_its_tensor_is_refused(megatron_flat, change,
                                                                                            message):
    trainer, flat, _ = megatron_flat
    bucket = one_copy_bucket(flat, trainer.extractor())
    name = "model.layers.1.self_attn.v_proj.weight"  # the last part of a fused QKV: its span ends with it
    meta = _strided_meta(bucket, name)
    change(meta)
    with pytest.raises(RequestError, match=message) as err:
        PackedRequest.from_json({"handle": flat.export(), "tensors": [meta]})
    assert repr(name) in str(err.value)


def test_a_strided_entry_past_the_end_of_the_buffer_it_arrives_in_is_refused(megatron_flat):
    """Checked against the request's own buffer (the handle's bytes), on parse and again where
    the views are made: no view ever reaches past the buffer, whatever the request says."""
    trainer, flat, _ = megatron_flat
    bucket = one_copy_bucket(flat, trainer.extractor())
    name = "model.layers.1.self_attn.v_proj.weight"
    meta = _strided_meta(bucket, name)
    handle = {**flat.export(), "nbytes": meta["end_idx"] - 4}
    with pytest.raises(RequestError, match=rf"'{name}'.* inside the {meta['end_idx'] - 4} B buffer"):
        PackedRequest.from_json({"handle": handle, "tensors": [meta]})
    built = TensorMeta.from_json(meta)
    short = flat.readable()[:meta["end_idx"] - 4]
    with pytest.raises(RequestError, match=rf"'{name}': bytes \[\d+, {meta['end_idx']}\) do not fit"):
        views(short, [built])
    # an entry built by hand whose end_idx understates its view is checked by the view itself
    lying = TensorMeta(built.name, built.shape, built.dtype, built.start, built.start + 4, 0, built.view)
    with pytest.raises(RequestError, match=rf"'{name}': bytes \[\d+, {meta['end_idx']}\) do not fit"):
        views(short, [lying])


# -- a sync through colo's engine in its own process ----------------------------------------

@pytest_asyncio.fixture
async def cpu_engine(tmp_path):
    from colo.engine.reference.client import EngineClient

    client = await EngineClient.spawn(small_engine_build(tmp_path / "engine.log"))
    try:
        yield client
    finally:
        await client.aclose()


def _context(step: int) -> tuple[SyncContext, StagingBudget]:
    budget = StagingBudget(None)
    return SyncContext(step=step, weight_version=step, bucket_bytes=64 << 10, source="device",
                       staging=budget), budget


@pytest.mark.asyncio
async def test_sync_first_from_megatron_flat_weights_is_one_request_and_the_digest_is_the_trainers(
        megatron_flat, cpu_engine):
    trainer, flat, config = megatron_flat
    client = cpu_engine
    engine = RecordingEngine(client)
    transport = PackedTransport()
    n = len(trainer.param_specs())
    try:
        for step in (1, 2):
            if step == 2:
                with torch.no_grad():  # the weights change in place; the next sync carries the new ones
                    for p in trainer.model.parameters():
                        p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
            ctx, budget = _context(step)
            result = await transport.sync(trainer, engine, ctx)
            state = trainer.hf_state()
            got = await client.digest()
            assert got == expected_digest(state, config, torch.float32) == trainer.sent_digest(fresh=True), step
            assert (result.buckets, result.tensors, result.staging_peak) == (1, n, 0)
            assert budget.peak_bytes == 0 and len(engine.requests) == step
            assert result.bytes == sum(t.numel() * 4 for t in state.values())
            assert [(r.bucket, r.stage) for r in ctx.stages] == [(0, "gather"), (0, "handoff"), (0, "load")]
        first, second = engine.requests
        assert first["handle"] == flat.export()
        assert sorted(m["name"] for m in first["tensors"] if "strides" in m) == sorted(_qkv_names(config))
        assert "tensors" not in second and second["layout"] == first["layout"]  # the layout went once
    finally:
        await transport.aclose()
