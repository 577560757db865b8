"""colo's SGLang engine against SGLang 0.5.23's own code, loaded from its wheel.

SGLang cannot run here (torch 2.14.1, a CUDA ``sgl_kernel``), so nothing here is a live
SGLang. What is SGLang's own code (``tests/sglang_wheel.py`` says what is stubbed and why):

- the request types (``sglang.srt.managers.io_struct``), validated the way its FastAPI
  routes do (pydantic, through the types' own ``__get_pydantic_core_schema__``);
- the payload serializer (``sglang.srt.utils.common.MultiprocessingSerializer`` and its
  ``SafeUnpickler`` allow-list) and ``FlattenedTensorBucket``, with the body of the model
  runner's ``_update_weights_from_flattened_bucket`` taken from its file;
- the scheduler's session and memory manager (``SchedulerWeightUpdaterManager``: the
  begin/end session, the refusal of an update outside it, the idle assertion of a
  release, the tag bookkeeping), one per TP rank, with SGLang's no-op memory saver.

What stands in for SGLang (:class:`SglangOnItsOwnCode`): the HTTP hop (FastAPI's body
validation is done with pydantic here, a ``success: false`` reply raises as colo's HTTP
client raises it), the model (its ``load_weights`` records the tensors it is given), the
TP worker's ``deserialize_own_rank`` (SGLang's three lines: rank r deserializes
``serialized_named_tensors[r]``), a server with requests queued (idle only while paused),
and the runtime context's ``get_parallel``/``get_model``.
"""

from __future__ import annotations

import ast
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from colo.core.errors import BadInput, EngineStateError, WeightMismatch
from colo.core.interfaces import SyncContext
from colo.core.memory import StagingBudget
from colo.digest import weights_digest
from colo.core.buckets import plan_buckets
from colo.engine.sglang import (SglangEngine, SglangModel, SglangTransport, begin_request, bucket_metadata,
                                bucket_views, checksum_request, continue_request, decode_payload,
                                serialize_payload, end_request, generate_request, pause_request,
                                probe_request, release_request, resume_request, update_request, version_request)
from colo.engine.reference.weights import expected_digest
from colo.testing.trainers import StateTrainer
from colo.trainers.models import build_trainer_model, demo_config
from colo.transports.pack import pack_into
from colo.transports.wire import UNPADDED, relayout
from tests.sglang_wheel import SGLANG_VERSION, import_sglang, member

RUNNER_FILE = "sglang/srt/model_executor/model_runner_components/weight_updater.py"


@pytest.fixture(scope="module")
def sg():
    common, io, wu, tb, saver = import_sglang(
        "sglang.srt.utils.common", "sglang.srt.managers.io_struct",
        "sglang.srt.managers.scheduler_components.weight_updater", "sglang.srt.weight_sync.tensor_bucket",
        "sglang.srt.utils.torch_memory_saver_adapter")
    # the model runner's flattened-bucket load, SGLang's own function body from its file (the file
    # itself imports the model layers, which reach sgl_kernel)
    tree = ast.parse(member(RUNNER_FILE).read_text())
    (fn,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
             and n.name == "_update_weights_from_flattened_bucket"]
    fn.args.args[0].annotation = None  # `self: WeightUpdater`, a class of the unimported file
    ns = {"FlattenedTensorMetadata": tb.FlattenedTensorMetadata, "FlattenedTensorBucket": tb.FlattenedTensorBucket}
    exec(compile(ast.Module([fn], []), RUNNER_FILE, "exec"), ns)
    # SGLang's managers barrier on the TP CPU group after each session call: one gloo process
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield types.SimpleNamespace(common=common, io=io, wu=wu, tb=tb, saver=saver,
                                load_bucket=ns["_update_weights_from_flattened_bucket"])
    if started:
        dist.destroy_process_group()


# -- SGLang, on its own code, behind colo's HTTP client's contract -----------------------------

class _Model(torch.nn.Module):
    """Where SGLang's runner puts what it reconstructed: ``load_weights`` records it."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", torch.arange(4.0))  # what release stashes and resume restores
        self.loaded: list[tuple[str, torch.Tensor]] = []

    def load_weights(self, weights):
        self.loaded.extend((n, t.clone()) for n, t in weights)


class _RunnerUpdater:
    def __init__(self, sg, model):
        self.sg, self.model, self.calls = sg, model, []

    def get_model(self):
        return self.model

    def begin_weight_update(self):
        self.calls.append("begin")

    def end_weight_update(self, run_post_load):
        self.calls.append(("end", run_post_load))

    def update_weights_from_tensor(self, named_tensors, load_format=None):
        # the model runner's branch for load_format == "flattened_bucket"; colo sends no other
        self.calls.append(("update", load_format))
        assert load_format == "flattened_bucket"
        return self.sg.load_bucket(self, named_tensors)


class _TpWorker:
    def __init__(self, sg, rank):
        self.sg, self.rank = sg, rank
        self.model_runner = types.SimpleNamespace(model=_Model())
        self.updater = _RunnerUpdater(sg, self.model_runner.model)

    def deserialize_own_rank(self, serialized_named_tensors):
        # sglang/srt/managers/tp_worker.py: each rank deserializes only its own payload
        return self.sg.common.MultiprocessingSerializer.deserialize(serialized_named_tensors[self.rank])

    def weight_update_runners(self):
        return [("target", types.SimpleNamespace(weight_updater=self.updater))]


class SglangOnItsOwnCode:
    """The ``api`` of :class:`SglangEngine` (its HTTP client's contract: ``call(verb, body)``,
    a refusal raised), answered by SGLang's own request types and session managers."""

    pauses = True
    TYPES = {"release_memory_occupation": "ReleaseMemoryOccupationReqInput",
             "resume_memory_occupation": "ResumeMemoryOccupationReqInput",
             "pause_generation": "PauseGenerationReqInput", "continue_generation": "ContinueGenerationReqInput",
             "begin_weight_update": "BeginWeightUpdateReqInput", "end_weight_update": "EndWeightUpdateReqInput",
             "update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
             "update_weight_version": "UpdateWeightVersionReqInput", "weights_checker": "CheckWeightsReqInput"}

    def __init__(self, sg, tp_size: int):
        from sglang.srt.disaggregation.utils import DisaggregationMode

        self.sg, self.calls, self.paused, self.flushes = sg, [], False, 0
        self.versions: list = []  # what the scheduler's record_weight_version_change was told
        self.scheduler = types.SimpleNamespace(_engine_paused=False, disaggregation_mode=DisaggregationMode.NULL,
                                               record_weight_version_change=lambda new_version: self.versions.append(
                                                   new_version))
        self.workers = [_TpWorker(sg, r) for r in range(tp_size)]
        self.managers = []
        wu = sg.wu
        saved = wu.get_parallel, wu.get_model
        wu.get_parallel = lambda: types.SimpleNamespace(tp_group=types.SimpleNamespace(cpu_group=None))
        wu.get_model = lambda: types.SimpleNamespace(weight_cache_mode="off")
        try:
            for w in self.workers:
                self.managers.append(wu.SchedulerWeightUpdaterManager(
                    tp_worker=w, draft_worker=None,
                    memory_saver_adapter=sg.saver.TorchMemorySaverAdapter.create(enable=False),
                    flush_cache=self._flush, scheduler=self.scheduler,
                    # requests are queued: the server is idle only once paused
                    is_fully_idle=lambda ignore_waiting=False: ignore_waiting))
        finally:
            # get_model is read again at release: it stays; get_parallel only at construction
            wu.get_parallel = saved[0]

    def _flush(self, empty_cache=False):
        self.flushes += 1
        return True

    def validate(self, verb: str, body: dict):
        """The body as SGLang's route parses it (FastAPI: pydantic over the io_struct type)."""
        from pydantic import TypeAdapter

        cls = getattr(self.sg.io, self.TYPES[verb])
        fields = {f.name for f in __import__("msgspec").structs.fields(cls)}
        # SGLang's schema ignores unknown keys: a misspelt one would be dropped silently
        assert set(body) <= fields, f"{verb}: {sorted(set(body) - fields)} are not fields of {cls.__name__}"
        return TypeAdapter(cls).validate_python(body)

    def call(self, verb: str, body: dict):
        self.calls.append(verb)
        if verb == "flush_cache":
            assert body == {}  # a query parameter (timeout), no body
            return self._flush()
        req = self.validate(verb, body)
        if verb == "pause_generation":
            self.scheduler._engine_paused = True
            return {"status": "ok"}
        if verb == "continue_generation":
            self.scheduler._engine_paused = False
            return {"status": "ok"}
        if verb in ("update_weight_version", "weights_checker"):
            return {"success": True}
        out = [getattr(m, verb)(req) for m in self.managers]
        for o in out:
            if getattr(o, "success", True) is False:
                raise RuntimeError(f"HTTP 400 from /{verb}: {o.message}")
        return {"success": True}

    def dead(self) -> bool:
        return False


# -- models ------------------------------------------------------------------------------------

def qwen2(tied: bool, **over):
    return demo_config(**{**dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, intermediate_size=48, max_position_embeddings=32,
                                 tie_word_embeddings=tied), **over})


def engine_for(sg, config, tp_size=1):
    api = SglangOnItsOwnCode(sg, tp_size)
    return SglangEngine(api, SglangModel(config, tp_size=tp_size, dtype="bfloat16"), memory_saver=True), api


def ctx(**kw):
    return SyncContext(step=0, weight_version=1, bucket_bytes=kw.pop("bucket_bytes", 4 << 10), source="host",
                       staging=StagingBudget(None), **kw)


def assert_exact(got, want):
    assert [n for n, _ in got] == [n for n, _ in want]
    for (name, a), (_, b) in zip(got, want):
        assert a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape), name
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), name


# -- requests ----------------------------------------------------------------------------------

def test_every_request_body_colo_sends_is_sglangs_own_request_type(sg):
    api = SglangOnItsOwnCode(sg, 1)
    payload = "gASVAgAAAAAAAAB9lC4="  # any base64: SGLang's route decodes it to bytes
    bodies = {
        "release": release_request(["kv_cache", "cuda_graph"]), "resume": resume_request(["weights"]),
        "pause": pause_request(), "continue": continue_request(), "begin": begin_request(), "end": end_request(),
        "update": update_request([payload, payload], weight_version="3"), "version": version_request("3"),
        "checksum": checksum_request()}
    got = {k: api.validate(verb, body) for k, (verb, body) in bodies.items()}
    assert got["release"].tags == ["kv_cache", "cuda_graph"] and got["resume"].tags == ["weights"]
    assert got["pause"].mode == "retract" and got["continue"].torch_empty_cache is True
    assert got["begin"].selector == "target"
    u = got["update"]
    assert u.serialized_named_tensors == [bytes.fromhex("80049502000000000000007d942e")] * 2
    assert (u.load_format, u.flush_cache, u.abort_all_requests, u.weight_version, u.selector) == \
        ("flattened_bucket", False, False, "3", "target")
    assert got["version"].new_version == "3" and got["version"].abort_all_requests is False
    assert got["checksum"].action == "checksum"
    # SGLang's own types refuse what colo must never send: a check that can fail
    with pytest.raises(Exception, match="retract"):
        api.validate("pause_generation", {"mode": "pause"})
    with pytest.raises(Exception, match="base64"):
        api.validate("update_weights_from_tensor", {"serialized_named_tensors": ["not base64!"]})
    with pytest.raises(AssertionError, match=r"\['tag'\] are not fields of ReleaseMemoryOccupationReqInput"):
        api.validate("release_memory_occupation", {"tag": ["weights"]})


def test_generate_and_probe_bodies_construct_sglangs_generate_request(sg):
    # /generate's pydantic schema needs the multimodal types stubbed here; SGLang's own
    # constructor and its batch normalisation read the same fields
    for _, body in (generate_request([[1, 2, 3], [4, 5]], max_new_tokens=4, temperature=1.0, seed=7),
                    probe_request([[1, 2, 3]])):
        req = sg.io.GenerateReqInput(**body)
        req.normalize_batch_and_arguments()
        assert req.input_ids == body["input_ids"] and req.batch_size == len(body["input_ids"])
    req = sg.io.GenerateReqInput(**generate_request([[1, 2], [3]], max_new_tokens=4, temperature=1.0, seed=7)[1])
    req.normalize_batch_and_arguments()
    assert [p["sampling_seed"] for p in req.sampling_params] == [7, 8]
    probe = sg.io.GenerateReqInput(**probe_request([[1, 2, 3]])[1])
    probe.normalize_batch_and_arguments()
    assert probe.return_logprob == [True] and probe.logprob_start_len == [0]


# -- payloads and the session ---------------------------------------------------------------------

CASES = {"untied": (False, 1), "tied": (True, 1), "tp2": (False, 2)}


@pytest.mark.parametrize("case", sorted(CASES))
async def test_a_sync_goes_through_sglangs_session_and_its_ranks_decode_the_trainers_exact_tensors(sg, case):
    tied, tp = CASES[case]
    config = qwen2(tied)
    model = build_trainer_model(config, seed=3)
    state = {n: p.detach() for n, p in model.named_parameters()}
    assert ("lm_head.weight" in state) is not tied
    want = [(n, t.to(torch.bfloat16)) for n, t in state.items()]
    engine, api = engine_for(sg, config, tp)
    c = ctx()
    transport = SglangTransport()
    try:
        result = await transport.sync(StateTrainer(state, dtype=torch.bfloat16), engine, c)
    finally:
        await transport.aclose()
    buckets = result.buckets
    assert buckets > 2 and result.tensors == len(state)
    # the order colo issued, as every rank's SGLang session manager took it
    assert api.calls == ["begin_weight_update"] + ["update_weights_from_tensor"] * buckets + ["end_weight_update"]
    for w, m in zip(api.workers, api.managers):
        assert m._session is None  # SGLang closed the session
        assert w.updater.calls == ["begin"] + [("update", "flattened_bucket")] * buckets + [("end", False)]
        # rank r decoded serialized_named_tensors[r] with SGLang's serializer and bucket: the
        # trainer's tensors, bit for bit, in the trainer's order
        assert_exact(w.model_runner.model.loaded, want)
    assert [e for e, _ in c.marks] == ["session.opened", "session.closed"]
    assert api.flushes == 0  # each update said flush_cache=False; the scheduler flushes once
    assert api.versions == [None] * buckets * tp  # no version rides on an update: colo sets it after
    # the verification contract: colo's digest of what SGLang decoded, of what colo says it
    # handed over, and of the trainer's tensors are one
    decoded = weights_digest(api.workers[0].model_runner.model.loaded)
    assert decoded == await engine.digest() == expected_digest(state, config, torch.bfloat16)


async def test_each_tp_rank_gets_its_own_payload_and_colos_receiver_reads_what_sglang_reads(sg):
    config = qwen2(False)
    state = {n: p.detach() for n, p in build_trainer_model(config, seed=5).named_parameters()}
    engine, api = engine_for(sg, config, 2)
    sent = []
    real = api.call

    def spy(verb, body):
        if verb == "update_weights_from_tensor":
            sent.append(body["serialized_named_tensors"])
        return real(verb, body)

    api.call = spy
    transport = SglangTransport()
    await transport.sync(StateTrainer(state, dtype=torch.bfloat16), engine, ctx())
    await transport.aclose()
    # two payloads per update, of two buffers (a payload of a CPU tensor names its storage's
    # shared-memory handle: one per rank's copy)
    assert sent and all(len(p) == 2 and p[0] != p[1] for p in sent)
    # the same buckets serialized again (a CPU payload's file descriptor is taken once): SGLang's
    # serializer and colo's own receiver read one payload to the same tensors
    specs = list(StateTrainer(state, dtype=torch.bfloat16).extractor().specs())
    named = [(n, t.to(torch.bfloat16)) for n, t in state.items()]
    # SGLang has no pieces: a bucket grows to the largest tensor (the transport plans so)
    for bucket in plan_buckets(specs, max(4 << 10, max(sp.nbytes for sp in specs))):
        laid = relayout(bucket, align=UNPADDED)
        flat = torch.empty(laid.nbytes, dtype=torch.uint8)
        pack_into(flat, laid, [(n, t) for n, t in named if n in {e.spec.name for e in laid.entries}])
        metadata = bucket_metadata(laid)
        obj = sg.common.MultiprocessingSerializer.deserialize(serialize_payload(flat, metadata))
        assert set(obj) == {"flattened_tensor", "metadata"}
        assert all(type(m) is sg.tb.FlattenedTensorMetadata for m in obj["metadata"])
        mine, my_meta = decode_payload(serialize_payload(flat, metadata))
        assert my_meta == metadata and torch.equal(mine, obj["flattened_tensor"]) and mine.dtype == torch.uint8
        theirs = sg.tb.FlattenedTensorBucket(**obj).reconstruct_tensors()
        assert_exact(bucket_views(mine, my_meta), theirs)
        assert_exact(theirs, [(n, t) for n, t in named if n in {m["name"] for m in metadata}])


def test_colos_receiver_refuses_a_global_a_bucket_never_holds(sg):
    import base64
    import pickle

    evil = base64.b64encode(pickle.dumps({"flattened_tensor": __import__("os").getcwd, "metadata": []})).decode()
    with pytest.raises(pickle.UnpicklingError, match="posix.getcwd, which a flattened bucket never holds"):
        decode_payload(evil)
    # SGLang's own allow-list refuses it too
    with pytest.raises(RuntimeError, match="Blocked unsafe global"):
        sg.common.MultiprocessingSerializer.deserialize(evil)


# -- what SGLang refuses, colo refuses first ---------------------------------------------------------

async def test_an_update_outside_the_session_is_refused_before_any_request_and_sglang_would_refuse_it(sg):
    engine, api = engine_for(sg, qwen2(False))
    with pytest.raises(EngineStateError, match="update_weights_from_tensor outside a weight-update session"):
        await engine.transport_load("sglang", {"serialized_named_tensors": ["gAQu"], "tensors": 1})
    assert api.calls == []
    # the same request sent anyway: SGLang's own session manager refuses it
    with pytest.raises(RuntimeError, match=r"update_weights_from_tensor must run between begin_weight_update\(\) "
                                           r"and end_weight_update\(\)"):
        api.call(*update_request(["gAQu"]))
    await engine.begin_load()
    with pytest.raises(EngineStateError, match="a weight-update session is already open"):
        await engine.begin_load()
    with pytest.raises(RuntimeError, match="a weight-update session is already open; call end_weight_update"):
        api.call(*begin_request())
    await engine.end_load()
    with pytest.raises(EngineStateError, match="no weight-update session is open"):
        await engine.end_load()
    with pytest.raises(RuntimeError, match="no weight-update session is open; call begin_weight_update"):
        api.call(*end_request())


async def test_release_pauses_first_and_a_tag_twice_is_refused_before_sglang_sees_it(sg):
    engine, api = engine_for(sg, qwen2(False))
    # SGLang asserts an idle server: with requests queued, only a paused one is
    with pytest.raises(AssertionError, match="release_memory_occupation should be called only when server is idle"):
        api.managers[0].release_memory_occupation(sg.io.ReleaseMemoryOccupationReqInput(tags=["kv_cache"]))
    await engine.release(["kv_cache", "cuda_graph"])
    await engine.release(["weights"])
    assert api.calls == ["pause_generation", "release_memory_occupation", "release_memory_occupation"]
    assert api.managers[0].offload_tags == {"kv_cache", "cuda_graph", "weights"}
    assert api.flushes == 1  # SGLang flushes the cache as it releases kv_cache
    with pytest.raises(EngineStateError, match="cannot release tag.s. weights: already released"):
        await engine.release(["weights"])
    await engine.resume(["weights"])
    with pytest.raises(EngineStateError, match="cannot resume tag.s. weights: already resident"):
        await engine.resume(["weights"])
    # SGLang itself fails a second resume of a tag (offload_tags.remove)
    with pytest.raises(KeyError, match="weights"):
        api.managers[0].resume_memory_occupation(sg.io.ResumeMemoryOccupationReqInput(tags=["weights"]))
    await engine.resume(["kv_cache", "cuda_graph"])
    assert api.managers[0].offload_tags == set()
    assert api.calls[-2:] == ["resume_memory_occupation"] * 2
    with pytest.raises(EngineStateError, match="SGLang has only weights, kv_cache, cuda_graph"):
        await engine.release(["activations"])
    with pytest.raises(EngineStateError, match="cannot release no tags: SGLang would release all of them"):
        await engine.release([])


# -- bad input: a clear error before any request --------------------------------------------------

def test_a_model_sglangs_loaders_cannot_take_is_refused():
    from transformers import GPT2Config

    from colo.trainers.models import moe_model_config

    # the architecture table's: SGLang's qwen2.py, qwen3.py and llama.py take the dense three
    with pytest.raises(BadInput, match="model_type 'gpt2' is not an architecture colo supports"):
        SglangModel(GPT2Config(), tp_size=1)
    with pytest.raises(BadInput, match="SGLang's loaders of qwen2, qwen3, llama only; this config is "
                                       "model_type='qwen3_moe'"):
        SglangModel(moe_model_config("qwen3-moe-tiny"), tp_size=1)
    # heads 4, kv heads 2, intermediate 48 (SGLang's Qwen2Attention and linear layers assert these)
    with pytest.raises(BadInput, match="num_attention_heads 4 is not a multiple of tp_size 3"):
        SglangModel(qwen2(False), tp_size=3)
    with pytest.raises(BadInput, match="tp_size 4 is not a multiple of num_key_value_heads 3"):
        SglangModel(qwen2(False, num_attention_heads=12, num_key_value_heads=3, hidden_size=48), tp_size=4)
    with pytest.raises(BadInput, match="intermediate_size 51 is not a multiple of tp_size 2"):
        SglangModel(qwen2(False, intermediate_size=51), tp_size=2)
    with pytest.raises(BadInput, match="tp_size must be a positive integer, got 0"):
        SglangModel(qwen2(False), tp_size=0)


async def test_names_sglang_cannot_take_are_refused_before_any_request(sg):
    config = qwen2(True)
    untied = {n: p.detach() for n, p in build_trainer_model(qwen2(False), seed=1).named_parameters()}
    engine, api = engine_for(sg, config)
    renamed = {("model.embed.weight" if n == "model.embed_tokens.weight" else n): t for n, t in untied.items()}
    transport = SglangTransport()
    # a tied model served: a separate lm_head.weight has nowhere to go
    with pytest.raises(WeightMismatch, match="lm_head.weight"):
        await transport.sync(StateTrainer(untied, dtype=torch.bfloat16), engine, ctx())
    with pytest.raises(WeightMismatch, match="model.embed.weight"):
        await transport.sync(StateTrainer(renamed, dtype=torch.bfloat16), engine, ctx())
    assert api.calls == []
    # one payload per TP rank, or nothing is sent
    engine2, api2 = engine_for(sg, qwen2(False), 2)
    await engine2.begin_load()
    with pytest.raises(BadInput, match="tp_size 2 takes one base64 payload per TP rank .*got 1"):
        await engine2.transport_load("sglang", {"serialized_named_tensors": ["gAQu"], "tensors": 1})
    assert api2.calls == ["begin_weight_update"]
    with pytest.raises(BadInput, match="3 device.s. for SGLang's 2 TP ranks"):
        await SglangTransport(devices=["cpu"] * 3).sync(StateTrainer(untied, dtype=torch.bfloat16), engine2, ctx())


def test_this_is_the_release_the_adapter_was_written_against():
    from colo.engine import sglang

    assert sglang.SGLANG_VERSION == SGLANG_VERSION
    assert Path(member("sglang/srt/managers/io_struct.py")).stat().st_size > 0


def test_the_in_process_calls_match_the_engine_methods_sglang_ships():
    """``sglang.Engine`` cannot be imported here (engine.py reaches sgl_kernel): its methods'
    signatures are read from the file, and every call colo's in-process path makes must fit."""
    from colo.engine.sglang.engine import _InProcess

    tree = ast.parse(member("sglang/srt/entrypoints/engine.py").read_text())
    (engine_cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine"]
    methods = {f.name: [a.arg for a in f.args.args[1:] + f.args.kwonlyargs]
               for f in engine_cls.body if isinstance(f, ast.FunctionDef)}
    for verb, fields in _InProcess.KWARGS.items():
        assert verb in methods, f"sglang.Engine has no {verb}"
        names = ["named_tensors" if f == "serialized_named_tensors" else f for f in fields]
        assert set(names) <= set(methods[verb]), f"Engine.{verb}{tuple(methods[verb])} takes no {names}"
    # and what it lacks, colo does not call in process
    assert not {"pause_generation", "continue_generation", "update_weight_version", "weights_checker",
                "check_weights"} & set(methods)
    assert methods["update_weights_from_tensor"] == ["named_tensors", "load_format", "flush_cache"]


def test_the_demos_sglang_engine_takes_only_fields_of_sglangs_server_args():
    """``colo demo --engine sglang`` builds ``sglang.Engine(**kwargs)``; Engine passes them to
    ``ServerArgs``, whose input fields are the annotated fields of the classes in
    ``sglang/srt/arg_groups/fields/`` (read from the wheel: SGLang cannot be imported here)."""
    from colo.engine.sglang.start import check_version, engine_kwargs

    import zipfile

    from tests.sglang_wheel import wheel

    folder = "sglang/srt/arg_groups/fields/"
    with zipfile.ZipFile(wheel()) as z:
        files = sorted(n for n in z.namelist() if n.startswith(folder) and n.endswith(".py"))
    assert len(files) > 5, files
    fields = set()
    for name in files:
        for node in ast.walk(ast.parse(member(name).read_text())):
            if isinstance(node, ast.ClassDef):
                fields |= {a.target.id for a in node.body
                           if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name)}
    kwargs = engine_kwargs({"checkpoint": "/m", "dtype": "bfloat16", "mem_fraction_static": 0.8}, seed=3, batch=32)
    assert set(kwargs) <= fields, sorted(set(kwargs) - fields)
    assert kwargs["enable_memory_saver"] is True and kwargs["tp_size"] == 1 and kwargs["random_seed"] == 3
    check_version(SGLANG_VERSION)
    with pytest.raises(BadInput, match="SGLang 0.5.24 is not supported.*written against 0.5.23"):
        check_version("0.5.24")


def test_sglangs_sender_is_a_registered_transport_only_sglang_takes():
    from colo.engine import ENGINES
    from colo.transports import ENGINE_OWN, REGISTRY, STRATEGIES, get_strategy, make_transport

    assert isinstance(make_transport("sglang"), SglangTransport) and "sglang" in REGISTRY
    assert ENGINE_OWN == {"sglang": "sglang"} and "sglang" not in STRATEGIES  # SGLang's ranks receive it
    with pytest.raises(ValueError, match="unknown transport 'sglang'"):
        get_strategy("sglang")  # no engine kit builds a receiver for it
    assert [n for n, e in ENGINES.items() if "sglang" in e.takes_transports()] == ["sglang"]


def test_what_docs_sglang_md_says_does_not_import_here_still_does_not():
    """The modules only read, not run (docs/sglang.md), each with the import that stops it,
    tried in a fresh process with the same stubs (a half-imported SGLang stays out of this one)."""
    import json
    import subprocess
    import sys

    script = (
        "import json, sys\n"
        "from tests.sglang_wheel import import_sglang\n"
        "out = {}\n"
        "for name in sys.argv[1:]:\n"
        "    try:\n"
        "        import_sglang(name)\n"
        "        out[name] = 'imported'\n"
        "    except BaseException as e:\n"
        "        out[name] = str(e)\n"
        "print(json.dumps(out))\n")
    names = ["sglang.srt.entrypoints.engine", "sglang.srt.entrypoints.http_server", "sglang.srt.managers.tp_worker",
             "sglang.srt.model_executor.model_runner_components.weight_updater", "sglang.srt.models.qwen2"]
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", script, *names], capture_output=True, text=True, timeout=300,
                          cwd=repo, env={**__import__("os").environ, "PYTHONPATH": str(repo)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    doc = (repo / "docs" / "sglang.md").read_text()
    for name in names:
        # the first import that stops it depends on what is installed (docs/sglang.md names the
        # one seen here); past the pure-Python ones each reaches the kernels (tvm_ffi, sgl_kernel)
        assert got[name] != "imported" and ("Error: " in got[name]), (name, got[name][:500])
        assert f"`{name}`" in doc
