"""SGLang as colo's rollout engine: :class:`SglangEngine` and its sender :class:`SglangTransport`.

Written against SGLang 0.5.23 (``colo-rl[sglang]``) and checked against that
release's own code from its wheel (``tests/sglang/``), **never run against a
live SGLang**: SGLang needs torch 2.14.1 and a CUDA ``sgl_kernel`` (see
``docs/sglang.md``). Every verb of colo's engine protocol is one of SGLang's
requests, the same body over HTTP and in process:

================================  ==========================================================
colo                              SGLang (``sglang.Engine`` method / HTTP route, io_struct type)
================================  ==========================================================
``release(tags)``                 HTTP only: ``/pause_generation`` ``{"mode": "retract"}``
                                  first (SGLang releases only an idle server), then
                                  ``release_memory_occupation(tags)``
``resume(tags)``                  ``resume_memory_occupation(tags)``
``flush_cache()``                 ``flush_cache()``; a refusal (requests running) is an error
``preflight(specs)``              nothing sent: checked here against the names SGLang's
                                  loader of the architecture takes (Qwen2, Qwen3, Llama)
``begin_load()``                  ``begin_weight_update(selector="target")``
``transport_load("sglang", r)``   ``update_weights_from_tensor`` with ``load_format=
                                  "flattened_bucket"``, one payload per TP rank
``end_load(flush_cache)``         ``end_weight_update()`` (+ ``flush_cache()``)
``set_weight_version(v)``         HTTP ``/update_weight_version``; the ``Engine`` has no such
                                  method (colo keeps the version itself)
``generate(step)``                HTTP ``/continue_generation`` first if paused, then
                                  ``generate(input_ids=..., sampling_params=[...])``
``logprobs(tokens)``              ``generate(..., return_logprob=True, logprob_start_len=0)``
``digest()``                      computed here over the bytes of every payload SGLang
                                  acknowledged (see below)
``weights_checksum()``            HTTP ``/weights_checker`` ``{"action": "checksum"}``
================================  ==========================================================

Verification. colo's contract is a digest of the HF-named tensors the engine
received (:mod:`colo.digest`). SGLang 0.5.23 has no digest of a payload it
received (there is no ``payload_digest``); its ``/weights_checker`` checksums its
own parameters, fused (``qkv_proj``, ``gate_up_proj``) and sharded per TP rank, so
it cannot equal colo's digest. ``digest()`` is therefore the digest of the tensors
as they lie in the payloads SGLang acknowledged, read as SGLang's
``FlattenedTensorBucket`` reads them: it proves what colo handed over, not what
SGLang loaded. What SGLang serves is checked by the logprob probe (``logprobs``),
and ``weights_checksum()`` returns SGLang's per-rank checksums, equal across two
engines that hold the same weights.

SGLang refuses a weight update outside a ``begin_weight_update`` ...
``end_weight_update`` session; colo refuses it first, before any request, and
records the session in the trace (``session.opened`` / ``session.closed``).

The payload of one bucket for TP rank r is what SGLang's own
``MultiprocessingSerializer.serialize`` makes of ``{"flattened_tensor": flat_r,
"metadata": [FlattenedTensorMetadata, ...]}``: a ForkingPickler pickle in which
a CUDA tensor is a CUDA IPC handle (its device as the GPU's UUID, as SGLang's
own ``monkey_patch_torch_reductions`` writes it) and the metadata are SGLang's
class by name, which SGLang's ``SafeUnpickler`` allows. colo writes it without
importing SGLang: the trainer's environment need not hold SGLang (0.5.23 pins
torch 2.14.1). ``flat_r`` is that rank's own copy of the bucket, on its GPU.

The payload's format is :mod:`colo.engine.sglang.payload`, colo's sender of it
:mod:`colo.engine.sglang.transport` (the transport ``sglang``), and how the demo and the
benchmark start SGLang :mod:`colo.engine.sglang.start`: this folder is the registry's
``sglang`` entry (:data:`colo.engine.ENGINES`).

Importing this module imports no SGLang.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

import anyio
import anyio.to_thread

from colo.core.buckets import itemsize, numel
from colo.core.errors import BadInput, EngineDied, EngineError, EngineStateError, WeightMismatch
from colo.core.interfaces import EngineCapabilities, RolloutResult, TensorSpec
from colo.digest import ReceivedDigest
from colo.dtypes import dtype_name
from colo.engine.kit import check_tags
from colo.models.arch import ARCHS, arch_of, hf_shapes, sizes_of
from colo.models.specs import check_specs, tied_names
from colo.tasks import RolloutTask, roll_out

#: the SGLang release this adapter is written against and checked with
SGLANG_VERSION = "0.5.23"
#: SGLang's memory tags (``sglang/srt/constants.py``): it has a cuda_graph tag
TAGS = ("weights", "kv_cache", "cuda_graph")
#: the name of colo's sender for SGLang
TRANSPORT = "sglang"
LOAD_FORMAT = "flattened_bucket"
#: colo syncs the served model only: a speculative draft has its own names
SELECTOR = "target"


# -- the model SGLang serves ----------------------------------------------------------------

class SglangModel:
    """What colo checks a sync against before any request: the HF config SGLang serves,
    its tensor-parallel size and its dtype.

    SGLang's loaders for the dense architectures colo's table gives a model file to
    (:data:`colo.models.arch.ARCHS`' ``sglang``: ``sglang/srt/models/qwen2.py``,
    ``qwen3.py``, ``llama.py``) take the HF names and fuse q/k/v into ``qkv_proj`` and
    gate/up into ``gate_up_proj``, as colo's own engine does (Qwen3's q/k norms are
    parameters of their own); a name they have no parameter for they drop with a log
    warning, so colo refuses it here, by name. Their attention asserts that the TP size
    divides the heads."""

    def __init__(self, config: Any, *, tp_size: int = 1, dtype: Any = "bfloat16"):
        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
            raise BadInput(f"SGLang tp_size must be a positive integer, got {tp_size!r}")
        arch = arch_of(config)  # UnsupportedArchitecture (bad input) names what the table has
        if arch.sglang is None:
            checked = [a.model_type for a in ARCHS.values() if a.sglang]
            raise BadInput(f"colo's SGLang engine checks names against SGLang's loaders of "
                           f"{', '.join(checked)} only; this config is model_type={arch.model_type!r}")
        try:
            sizes = sizes_of(config)
        except ValueError as e:
            raise BadInput(f"SGLang model config refused: {e}") from None
        heads, kv = sizes.q_rows // sizes.head_dim, sizes.kv_rows // sizes.head_dim
        inter = sizes.intermediate_size
        wrong = []
        # SGLang's attention (Qwen2Attention, Qwen3Attention, LlamaAttention): total_num_heads %
        # tp_size == 0; KV heads are split when there are at least tp_size of them, else
        # replicated (tp_size % kv == 0)
        if heads % tp_size:
            wrong.append(f"num_attention_heads {heads} is not a multiple of tp_size {tp_size}")
        if kv >= tp_size and kv % tp_size:
            wrong.append(f"num_key_value_heads {kv} is not a multiple of tp_size {tp_size}")
        if kv < tp_size and tp_size % kv:
            wrong.append(f"tp_size {tp_size} is not a multiple of num_key_value_heads {kv} (SGLang replicates "
                         f"KV heads only that way)")
        # MergedColumnParallelLinear and RowParallelLinear split the MLP rows evenly
        if inter % tp_size:
            wrong.append(f"intermediate_size {inter} is not a multiple of tp_size {tp_size}")
        if wrong:
            raise BadInput("SGLang cannot shard this model: " + "; ".join(wrong))
        self.config, self.tp_size, self.dtype = config, tp_size, dtype_name(dtype)
        self.arch = arch
        #: the checkpoint's tensors (HF name -> shape): what SGLang's loader has a parameter for
        self.shapes = hf_shapes(config)
        self.tied = tied_names(config)

    def nbytes(self) -> int:
        """The served weights' bytes, in the served dtype."""
        return sum(numel(shape) for shape in self.shapes.values()) * itemsize(self.dtype)

    def check_specs(self, specs: Sequence[TensorSpec]) -> None:
        """Every HF name exactly once, each one SGLang's loader has a parameter for, with
        its shape and the served dtype: one ``WeightMismatch`` naming all that is wrong."""
        check_specs(self.shapes, ((s.name, s.shape, s.dtype) for s in specs), self.dtype,
                    f"SGLang's {self.arch.model_type} loader ({self.arch.sglang}) cannot take this sync",
                    tied=self.tied)



# -- the requests (HTTP bodies: fields of SGLang's io_struct request types) ------------------

def release_request(tags: Sequence[str]) -> tuple[str, dict]:
    return "release_memory_occupation", {"tags": list(tags)}  # ReleaseMemoryOccupationReqInput


def resume_request(tags: Sequence[str]) -> tuple[str, dict]:
    return "resume_memory_occupation", {"tags": list(tags)}  # ResumeMemoryOccupationReqInput


def pause_request() -> tuple[str, dict]:
    # retract: running requests go back to the queue and are recomputed after continue, so
    # the KV cache may be released under them (abort would drop them)
    return "pause_generation", {"mode": "retract"}  # PauseGenerationReqInput


def continue_request() -> tuple[str, dict]:
    return "continue_generation", {"torch_empty_cache": True}  # ContinueGenerationReqInput


def begin_request() -> tuple[str, dict]:
    return "begin_weight_update", {"selector": SELECTOR}  # BeginWeightUpdateReqInput


def end_request() -> tuple[str, dict]:
    return "end_weight_update", {}  # EndWeightUpdateReqInput


def update_request(payloads: Sequence[str], *, flush_cache: bool = False,
                   weight_version: str | None = None) -> tuple[str, dict]:
    # UpdateWeightsFromTensorReqInput; the cache is flushed once, after the session ends
    return "update_weights_from_tensor", {
        "serialized_named_tensors": list(payloads), "load_format": LOAD_FORMAT, "flush_cache": flush_cache,
        "abort_all_requests": False, "weight_version": weight_version, "selector": SELECTOR}


def version_request(version: str) -> tuple[str, dict]:
    return "update_weight_version", {"new_version": version, "abort_all_requests": False}


def checksum_request() -> tuple[str, dict]:
    return "weights_checker", {"action": "checksum", "selector": SELECTOR}  # CheckWeightsReqInput


def generate_request(prompts: list[list[int]], *, max_new_tokens: int, temperature: float,
                     seed: int) -> tuple[str, dict]:
    # GenerateReqInput and one SamplingParams per prompt: request i samples with seed + i
    params = [{"max_new_tokens": max_new_tokens, "temperature": temperature, "ignore_eos": True,
               "sampling_seed": seed + i} for i in range(len(prompts))]
    return "generate", {"input_ids": [list(p) for p in prompts], "sampling_params": params}


def probe_request(tokens: list[list[int]]) -> tuple[str, dict]:
    # prompt logprobs from the first token on (SGLang answers None for token 0)
    return "generate", {"input_ids": [list(t) for t in tokens], "return_logprob": True, "logprob_start_len": 0,
                        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}


# -- the two ways to reach SGLang ------------------------------------------------------------

class _Http:
    """SGLang's HTTP server (``python -m sglang.launch_server``)."""

    pauses = True

    def __init__(self, url: str, timeout_s: float):
        self.url, self.timeout_s = url.rstrip("/"), timeout_s

    def call(self, verb: str, body: dict) -> Any:
        # flush_cache takes no body (a query parameter); every other route a JSON body
        data = None if verb == "flush_cache" else json.dumps(body).encode()
        req = urllib.request.Request(f"{self.url}/{verb}", data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                text = r.read().decode()
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"HTTP {e.code} from /{verb}: {_message(e.read().decode(errors='replace'))}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            raise ConnectionError(f"SGLang server at {self.url} did not answer /{verb}: {e}") from None
        try:
            reply = json.loads(text) if text else None
        except ValueError:
            reply = text  # /flush_cache answers plain text
        if isinstance(reply, dict) and reply.get("success") is False:
            raise RuntimeError(f"/{verb}: {reply.get('message')}")
        return reply

    def dead(self) -> bool:
        try:
            urllib.request.urlopen(self.url + "/health", timeout=5).close()
            return False
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return True


def _message(text: str) -> str:
    try:
        d = json.loads(text)
    except ValueError:
        return text
    if isinstance(d, dict):
        err = d.get("error")
        return str(d.get("message") or (err.get("message") if isinstance(err, dict) else err) or d)
    return text


class _InProcess:
    """A user's ``sglang.Engine`` in this process. It has no pause (SGLang: "only supported
    in SGLang Server") and no weight-version verb; its update takes no ``weight_version``."""

    pauses = False
    #: SGLang's Engine method and the body fields it takes, by verb
    KWARGS = {"release_memory_occupation": ("tags",), "resume_memory_occupation": ("tags",),
              "begin_weight_update": ("selector",), "end_weight_update": (),
              "update_weights_from_tensor": ("serialized_named_tensors", "load_format", "flush_cache"),
              "flush_cache": (),
              "generate": ("input_ids", "sampling_params", "return_logprob", "logprob_start_len")}

    def __init__(self, engine: Any):
        self.engine = engine

    def call(self, verb: str, body: dict) -> Any:
        if verb not in self.KWARGS:
            raise EngineStateError(f"SGLang's Engine has no {verb}: it is an HTTP route only")
        kwargs = {k: body[k] for k in self.KWARGS[verb] if k in body}
        if verb == "update_weights_from_tensor":
            kwargs["named_tensors"] = kwargs.pop("serialized_named_tensors")
        reply = getattr(self.engine, verb)(**kwargs)
        if isinstance(reply, tuple) and len(reply) == 2 and reply[0] is False:  # (success, message)
            raise RuntimeError(f"{verb}: {reply[1]}")
        if verb == "flush_cache" and getattr(reply, "success", True) is False:
            raise RuntimeError(f"flush_cache: {getattr(reply, 'message', '') or 'requests are still running'}")
        return reply

    def dead(self) -> bool:
        return False

    def shutdown(self) -> None:
        self.engine.shutdown()


# -- the engine ---------------------------------------------------------------------------------

class SglangEngine:
    """SGLang behind colo's engine protocol (the verb map is the module docstring).

    ``memory_saver``: SGLang was started with ``enable_memory_saver`` (without it its
    release frees nothing, and the ledger keeps counting the tags). ``tag_bytes``: the
    bytes of ``kv_cache`` and ``cuda_graph`` as SGLang reported them (``weights`` is
    computed from the config)."""

    def __init__(self, api: Any, model: SglangModel, *, memory_saver: bool, task: RolloutTask | None = None,
                 tag_bytes: dict[str, int] | None = None, call_timeout_s: float = 600.0, owned: bool = False):
        if not isinstance(memory_saver, bool):
            raise BadInput(f"memory_saver must be a bool (SGLang's enable_memory_saver), got {memory_saver!r}")
        self._api, self.model, self.task, self.call_timeout_s = api, model, task, call_timeout_s
        #: colo started this SGLang (``colo demo --engine sglang``): closing the engine shuts it down
        self.owned = owned
        note = "" if memory_saver else ("SGLang was started without enable_memory_saver: "
                                        "release_memory_occupation frees no memory")
        self.capabilities = EngineCapabilities(
            tags=TAGS, frees_memory=memory_saver, probe="logprobs", probe_needs_kv=True, sessions=True,
            pauses_generation=api.pauses, note=note)
        extra = dict(tag_bytes or {})
        unknown = sorted(set(extra) - set(TAGS))
        if unknown:
            raise BadInput(f"SGLang has no memory tag(s) {', '.join(unknown)}; its tags are {', '.join(TAGS)}")
        self._tag_bytes = {"weights": model.nbytes(), "kv_cache": int(extra.get("kv_cache", 0)),
                           "cuda_graph": int(extra.get("cuda_graph", 0))}
        self._lock = threading.Lock()  # one call into SGLang at a time
        self._released: set[str] = set()
        self.generation_paused = False
        self.session_open = False
        self.weight_version: int | None = 0
        self._accepted: list[str] = []
        #: the digest's record: the tensors of every bucket SGLang acknowledged, read from
        #: the payload as SGLang's FlattenedTensorBucket reads it
        self.received = ReceivedDigest()
        self.closed = False

    @classmethod
    def connect(cls, url: str, config: Any, *, tp_size: int = 1, dtype: Any = "bfloat16", memory_saver: bool,
                task: RolloutTask | None = None, timeout_s: float = 600.0, **kwargs: Any) -> SglangEngine:
        """A running SGLang server at ``url`` serving ``config`` (nothing is sent until a verb)."""
        return cls(_Http(url, timeout_s), SglangModel(config, tp_size=tp_size, dtype=dtype),
                   memory_saver=memory_saver, task=task, call_timeout_s=timeout_s, **kwargs)

    @classmethod
    def attach(cls, engine: Any, config: Any, *, tp_size: int = 1, dtype: Any = "bfloat16",
               memory_saver: bool, task: RolloutTask | None = None, **kwargs: Any) -> SglangEngine:
        """A ``sglang.Engine`` you built (``Engine(model_path=..., enable_memory_saver=True, ...)``)."""
        return cls(_InProcess(engine), SglangModel(config, tp_size=tp_size, dtype=dtype),
                   memory_saver=memory_saver, task=task, **kwargs)

    async def _call(self, request: tuple[str, dict]) -> Any:
        verb, body = request
        if self.closed:
            raise EngineDied(f"SGLang engine is closed: cannot {verb}")

        def run() -> Any:
            with self._lock:
                return self._api.call(verb, body)

        try:
            with anyio.fail_after(self.call_timeout_s):
                return await anyio.to_thread.run_sync(run, abandon_on_cancel=True)
        except TimeoutError:
            raise EngineDied(f"SGLang did not answer {verb} within {self.call_timeout_s:g} s") from None
        except ConnectionError as e:
            raise EngineDied(f"SGLang {verb}: {e}") from e
        except (EngineStateError, BadInput):
            raise
        except Exception as e:
            if self._api.dead():
                raise EngineDied(f"SGLang died during {verb}: {e}") from e
            raise EngineError(verb, type(e).__name__, str(e)) from e

    # -- EngineSide ----------------------------------------------------------------------------
    def tag_bytes(self) -> dict[str, int]:
        return dict(self._tag_bytes)

    def _check_tags(self, tags: Sequence[str], action: str, *, released: bool) -> list[str]:
        tags = check_tags(tags, action, engine="SGLang", known=TAGS, released_now=self._released,
                          released=released)
        if not tags:
            # SGLang reads no tags as every tag
            raise EngineStateError(f"cannot {action} no tags: SGLang would {action} all of them")
        return tags

    async def release(self, tags: Sequence[str]) -> None:
        tags = self._check_tags(tags, "release", released=False)
        if self._api.pauses and not self.generation_paused:
            # the scheduler asserts an idle server before it releases (queued requests of a
            # paused server are allowed)
            await self._call(pause_request())
            self.generation_paused = True
        await self._call(release_request(tags))
        self._released |= set(tags)
        if "weights" in tags:
            self.weight_version = None

    async def resume(self, tags: Sequence[str]) -> None:
        tags = self._check_tags(tags, "resume", released=True)
        await self._call(resume_request(tags))
        self._released -= set(tags)

    async def flush_cache(self) -> None:
        await self._call(("flush_cache", {}))

    async def set_weight_version(self, version: int | None) -> None:
        if self._api.pauses:
            await self._call(version_request("stale" if version is None else str(version)))
        self.weight_version = version

    async def digest(self) -> str:
        return self.received.digest(self._accepted)

    async def weights_checksum(self) -> dict:
        """SGLang's own checksums of the parameters it serves (HTTP ``/weights_checker``;
        the ``Engine`` has no such method): ``{"per_engine_checksum": ..., "ranks": [...]}``,
        one entry per TP rank, each with its parameters' checksums. Over SGLang's fused,
        sharded parameters: comparable between engines, not with colo's digest."""
        if not self._api.pauses:
            raise EngineStateError("SGLang's Engine has no weights_checker: it is an HTTP route only")
        reply = await self._call(checksum_request())
        return {k: reply[k] for k in ("per_engine_checksum", "ranks") if k in reply}

    async def generate(self, step: int) -> RolloutResult:
        return await roll_out(self.task, self.tokens, step, "SGLang")

    async def _ready(self, what: str, *, stale_ok: bool = False) -> None:
        if self._released:
            raise EngineError(what, "EngineStateError", f"cannot {what}: SGLang's {', '.join(sorted(self._released))} "
                                                        f"released")
        if self.weight_version is None and not stale_ok:
            raise EngineError(what, "EngineStateError", f"cannot {what}: SGLang's weights are stale")
        if self.generation_paused:
            await self._call(continue_request())
            self.generation_paused = False

    async def tokens(self, prompts: list[list[int]], *, max_new_tokens: int, temperature: float = 0.0,
                     seed: int = 0) -> list[list[int]]:
        await self._ready("generate")
        reply = await self._call(generate_request(prompts, max_new_tokens=max_new_tokens,
                                                  temperature=temperature, seed=seed))
        return [list(r["output_ids"]) for r in reply]

    async def logprobs(self, tokens: list[list[int]]) -> list[list[float]]:
        """The verification probe: log p(token i | the tokens before it), i >= 1."""
        await self._ready("answer the probe", stale_ok=True)
        reply = await self._call(probe_request(tokens))
        return [[lp for lp, _, _ in r["meta_info"]["input_token_logprobs"][1:]] for r in reply]

    # -- EngineReceiver --------------------------------------------------------------------------
    async def preflight(self, specs: Sequence[TensorSpec]) -> None:
        self.model.check_specs(specs)
        self._accepted = [s.name for s in specs]

    async def begin_load(self) -> None:
        if self.session_open:
            raise EngineStateError("a weight-update session is already open; SGLang refuses a second "
                                   "begin_weight_update until end_weight_update")
        self.weight_version = None  # from the first byte the weights are neither version
        self.received.clear()
        await self._call(begin_request())
        self.session_open = True

    async def transport_init(self, transport: str, init_info: dict) -> None:
        self._check_transport(transport)

    async def transport_close(self, transport: str) -> None:
        self._check_transport(transport)

    def _check_transport(self, transport: str) -> None:
        if transport != TRANSPORT:
            raise BadInput(f"SGLang loads only colo's {TRANSPORT!r} sender (its own flattened_bucket "
                           f"payloads), not {transport!r}")

    async def transport_load(self, transport: str, request: dict, on_sent: Any = None, *, end: bool = False,
                             flush_cache: bool = False) -> dict:
        self._check_transport(transport)
        if not self.session_open:
            raise EngineStateError("update_weights_from_tensor outside a weight-update session: SGLang "
                                   "refuses it (begin_weight_update first); nothing was sent")
        payloads = request.get("serialized_named_tensors")
        if not isinstance(payloads, list) or len(payloads) != self.model.tp_size \
                or not all(isinstance(p, str) for p in payloads):
            got = len(payloads) if isinstance(payloads, list) else type(payloads).__name__
            raise BadInput(f"SGLang with tp_size {self.model.tp_size} takes one base64 payload per TP rank "
                           f"(serialized_named_tensors[tp_rank]), got {got}")
        if on_sent is not None:
            on_sent()
        await self._call(update_request(payloads))
        reply = {"tensors": int(request.get("tensors", 0))}
        if end:
            await self.end_load(flush_cache=flush_cache)
            reply.update(ended=True, flushed=bool(flush_cache))
        return reply

    async def end_load(self, flush_cache: bool = False) -> None:
        if not self.session_open:
            raise EngineStateError("no weight-update session is open: SGLang refuses end_weight_update")
        try:
            await self._call(end_request())
        finally:
            # SGLang closes its session on end whatever the load did (it clears it last)
            self.session_open = False
        missing = [n for n in self._accepted if n not in set(self.received.names)]
        if missing:
            raise WeightMismatch("SGLang acknowledged a sync that left tensors out", missing=missing)
        if flush_cache:
            await self.flush_cache()

    async def drop_handles(self) -> None:
        # a failed sync leaves SGLang's session open: close it, so the next begin is accepted
        if self.session_open:
            try:
                await self.end_load()
            except Exception:
                pass

    # -- lifetime ------------------------------------------------------------------------------------
    def alive(self) -> bool:
        return not self.closed and not self._api.dead()

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.owned:  # else the server or Engine is the caller's: it started it
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._api.shutdown)


__all__ = ["LOAD_FORMAT", "SELECTOR", "SGLANG_VERSION", "TAGS", "TRANSPORT", "SglangEngine", "SglangModel",
           "begin_request", "checksum_request", "continue_request", "end_request", "generate_request",
           "pause_request", "probe_request", "release_request", "resume_request", "update_request",
           "version_request"]
