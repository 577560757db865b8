"""colo inside vLLM's worker: the weight-transfer backend ``colo`` and a worker extension.

Start vLLM with ``worker_extension_cls="colo.engine.vllm.worker.ColoWorkerExtension"``
and ``weight_transfer_config={"backend": "colo"}`` (``colo.engine.vllm.VllmEngine``
does). vLLM imports this module in every worker process while it builds the
worker, before ``load_model`` asks its factory for the transfer engine, so the
backend registers itself here, at import: a registration in the driver alone
does not reach a spawned worker ("Invalid weight transfer backend: colo").

The backend hosts colo's engine kit (:class:`colo.engine.kit.EngineKit`): the same
receivers colo's own engine uses (a packed shared-memory bucket on a CPU, a
packed CUDA IPC buffer keyed by GPU UUID on a GPU), the same load session.
What it adds for vLLM is its sink (:class:`VllmSink`):

- loads run inside vLLM's layerwise reload (``initialize_layerwise_reload`` at
  the start, ``finalize_layerwise_reload`` at the end): on a CPU vLLM repacks
  every linear into a oneDNN handle after loading and leaves an empty
  parameter, so a plain ``load_weights`` after start-up fails;
- a tensor larger than a bucket arrives in pieces and is assembled before
  ``load_weights``, which takes whole tensors only;
- everything it is given is copied into its own memory first: layerwise reload
  keeps the tensors until a whole layer has arrived, after the sender has
  reused its staging buffer;
- names and shapes are checked before anything loads against the tensors colo's
  architecture table gives for the model vLLM serves (:mod:`colo.models.arch`), which
  must be exactly the checkpoint's (its safetensors headers; ``colo_hello`` reports a
  difference and the driver refuses the engine), and a failed load puts back
  the old tensors of half-loaded layers (vLLM would leave them on the ``meta``
  device and the engine unable to generate);
- with tied word embeddings the embedding is also loaded under the tied
  ``lm_head`` name: inside layerwise reload vLLM gives the two separate
  parameters, and the CPU's packed ``lm_head`` would otherwise keep the old
  weights;
- it records a digest of exactly the HF-named tensors it received
  (:class:`colo.digest.ReceivedDigest`), the verification contract: vLLM's own
  checksum hashes the repacked, empty parameters on a CPU.

This module imports vLLM and is imported only inside a vLLM process.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from colo.core.errors import EngineStateError, UnsupportedArchitecture, WeightMismatch
from colo.core.interfaces import TensorSpec
from colo.digest import ReceivedDigest
from colo.dtypes import dtype_name
from colo.engine.kit import EngineKit, LoadSession, PieceAssembler
from colo.models.arch import hf_shapes
from colo.transports.wire import Piece

BACKEND = "colo"
_log = logging.getLogger("colo.vllm")


def _log_line(event: str, **fields: Any) -> None:
    # the kit's log, into vLLM's worker log
    _log.warning("%s %s", event, json.dumps(fields))


@dataclass
class ColoInitInfo(WeightTransferInitInfo):
    """``init_weight_transfer_engine({"init_info": ...})``: transport name -> its init info,
    for transports that keep something across syncs (a process group, a root)."""

    transports: dict = field(default_factory=dict)


@dataclass
class ColoUpdateInfo(WeightTransferUpdateInfo):
    """``update_weights({"update_info": ...})``: one request of one of colo's transports."""

    transport: str = "packed"
    request: dict = field(default_factory=dict)


def checkpoint_specs(model_dir: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """HF name -> (shape, dtype) of every tensor in the safetensors files vLLM loaded."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))) if os.path.isdir(model_dir) else []
    if not files:
        raise ValueError(f"colo: the model {model_dir!r} is not a local directory of safetensors files; colo "
                         f"checks every name it receives against the checkpoint vLLM loaded")
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                out[name] = (tuple(int(s) for s in sl.get_shape()), str(sl.get_dtype()))
    return out


def _layout_problem(hf_config: Any, on_disk: dict[str, tuple[int, ...]]) -> str | None:
    """Why the checkpoint vLLM loaded is not what colo's architecture table gives for its
    config, in one line; None when they agree."""
    from colo.models.checkpoint import NOT_WEIGHTS

    try:
        want = hf_shapes(hf_config, what="the model vLLM serves")
    except (UnsupportedArchitecture, ValueError) as e:
        return str(e)
    weights = {n: s for n, s in on_disk.items() if not n.endswith(NOT_WEIGHTS)}
    missing = [n for n in want if n not in weights]
    extra = [n for n in weights if n not in want]
    wrong = [f"{n} {weights[n]} (expected {s})" for n, s in want.items() if n in weights and weights[n] != s]
    parts = [f"{label} {', '.join(items[:4])}" + (f" and {len(items) - 4} more" if len(items) > 4 else "")
             for label, items in (("missing", missing), ("unexpected", extra), ("wrong shape:", wrong)) if items]
    if not parts:
        return None
    return (f"the checkpoint vLLM loaded is not what colo's {getattr(hf_config, 'model_type', '?')} table "
            f"gives for its config: " + "; ".join(parts))


class VllmSink:
    """vLLM's model as the kit's :class:`~colo.engine.kit.WeightSink` (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, model_config: Any, device: torch.device):
        self.model, self.model_config, self.device = model, model_config, torch.device(device)
        self.dtype = dtype_name(model_config.dtype)
        from vllm.model_executor.models.utils import _get_tied_embedding_params

        #: alias -> canonical HF name (``lm_head.weight`` -> ``model.embed_tokens.weight``)
        self.tied: dict[str, str] = dict(_get_tied_embedding_params(model))
        on_disk = {n: shape for n, (shape, _) in checkpoint_specs(model_config.model).items() if n not in self.tied}
        #: why colo's table and this checkpoint disagree (None: they agree); the driver refuses
        #: the engine on it at hello (raising here would fail vLLM's start with no word of why)
        self.layout_problem = _layout_problem(model_config.hf_config, on_disk)
        #: what a sync must deliver: the table's names (a checkpoint's buffers, such as an old
        #: rotary_emb.inv_freq, are no weights), else the checkpoint's until the driver refuses
        self.shapes = on_disk if self.layout_problem else hf_shapes(model_config.hf_config)
        self.session: LoadSession | None = None
        self.received = ReceivedDigest()
        self._pieces = PieceAssembler()
        #: a failed session left vLLM's worker believing an update is active: the next
        #: finish only closes it (see ColoWeightTransfer.finish_weight_update)
        self.aborted = False
        #: seconds spent per part of the load since the last ``colo_timings`` (where a sync's time goes)
        self.timings: dict[str, float] = {}

    def expected_specs(self) -> list[TensorSpec]:
        size = torch.empty((), dtype=self.model_config.dtype).element_size()
        return [TensorSpec(name=n, shape=s, dtype=self.dtype, nbytes=size * _numel(s)) for n, s in self.shapes.items()]

    # -- WeightSink -------------------------------------------------------------------
    def preflight(self, specs: list[TensorSpec]) -> None:
        missing = set(self.shapes) - {s.name for s in specs}
        unexpected, wrong_shape, wrong_dtype, duplicate, seen = [], [], [], [], set()
        for s in specs:
            if s.name in seen:
                duplicate.append(s.name)
                continue
            seen.add(s.name)
            want = self.shapes.get(s.name)
            if want is None:
                unexpected.append(s.name if s.name not in self.tied else
                                  f"{s.name} (the model ties it to {self.tied[s.name]}: send that once)")
            elif tuple(s.shape) != want:
                wrong_shape.append(f"{s.name} {tuple(s.shape)} (expected {want})")
            elif s.dtype != self.dtype:
                wrong_dtype.append(f"{s.name} {s.dtype} (expected {self.dtype}, vLLM's dtype)")
        err = WeightMismatch("sync does not match the checkpoint vLLM loaded", missing=sorted(missing),
                             unexpected=unexpected, duplicate=duplicate, wrong_shape=wrong_shape,
                             wrong_dtype=wrong_dtype)
        if not err.empty:
            raise err

    def begin_load(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        if self.session is not None:
            raise EngineStateError("a load is already in progress (begin_load twice without end_load)")
        t0 = time.perf_counter()
        self.session = LoadSession(self.shapes)
        self.received.clear()
        self._pieces.clear()
        initialize_layerwise_reload(self.model)
        self.aborted = False
        self._spent("begin_s", t0)

    def load_weights(self, named: Any) -> int:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        session = self._require_session()
        t0 = time.perf_counter()
        items = list(named)
        session.check(items)  # the whole request, before anything of it loads
        t1 = self._spent("check_s", t0)
        self.received.add_many(items)  # the device's tensors checksummed in one launch
        t2 = self._spent("hash_s", t1)
        ready: list[tuple[str, torch.Tensor]] = []
        for name, tensor in items:
            if isinstance(tensor, Piece):  # copied into its whole tensor; loaded with the last piece
                ready += self._pieces.feed([(name, tensor)])
            else:  # a copy of our own: layerwise reload holds it until its layer is complete
                ready.append((name, tensor.clone()))
        ready += [(alias, t) for n, t in ready for alias, canon in self.tied.items() if canon == n]
        t3 = self._spent("copy_s", t2)
        if ready:
            with disable_mtp_completeness_check():
                self.model.load_weights(ready)
        self._spent("load_weights_s", t3)
        return sum(session.advance(name, tensor) for name, tensor in items)

    def _spent(self, what: str, since: float) -> float:
        now = time.perf_counter()
        self.timings[what] = self.timings.get(what, 0.0) + now - since
        return now

    def end_load(self) -> int:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        session = self._require_session()
        try:
            n = session.finish()
        except BaseException:
            self.abort()
            raise
        t0 = time.perf_counter()
        finalize_layerwise_reload(self.model, self.model_config)  # vLLM's processing: the CPU's repacking
        self._spent("finalize_s", t0)
        self.session = None
        return n

    def flush_cache(self) -> None:
        # the prefix cache is the engine core's, not the worker's: the driver resets it
        # (``LLM.reset_prefix_cache``) after the load ends
        raise EngineStateError("vLLM's prefix cache is reset by the driver (reset_prefix_cache), not the worker")

    def _require_session(self) -> LoadSession:
        if self.session is None:
            raise EngineStateError("no weight update is active (start_weight_update first)")
        return self.session

    # -- a failed load leaves vLLM able to generate ------------------------------------------
    def abort(self) -> None:
        """End a failed session: layers loaded in part get their old tensors back; layers
        never touched keep theirs; layers loaded whole keep the new ones. The engine is
        stale (colo marks it so) until the next complete sync."""
        from vllm.model_executor.layers.attention import is_deferred_attention_layer
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
        from vllm.model_executor.model_loader.reload.layerwise import _place_kernel_tensors, get_layerwise_info

        if self.session is None:
            return
        self.session = None
        self._pieces.clear()
        for layer in self.model.modules():
            info = get_layerwise_info(layer)
            if (info.can_load() and (info.load_numel or 0) > 0 and info.kernel_tensors is not None
                    and not is_deferred_attention_layer(layer)):
                _place_kernel_tensors(layer, info)  # the old tensors, back in place
                info.reset()
        quiet = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
        level = quiet.level
        quiet.setLevel(logging.ERROR)  # one "Failed to load weights" per untouched layer otherwise
        try:
            finalize_layerwise_reload(self.model, self.model_config)
        finally:
            quiet.setLevel(level)
        self.aborted = True


def _numel(shape: Any) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


class ColoWeightTransfer(WeightTransferEngine[ColoInitInfo, ColoUpdateInfo]):
    """vLLM's weight-transfer engine ``colo``: each verb of vLLM's update session is one
    of the kit's (start -> begin_load, update_weights -> transport_load, finish -> end_load)."""

    init_info_cls = ColoInitInfo
    update_info_cls = ColoUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.sink = VllmSink(model, vllm_config.model_config, device)
        self.kit = EngineKit(self.sink, log=_log_line)
        #: LoRA adapters' own sink and kit, made on the first adapter request
        #: the LoRA adapters' receiving half (colo.engine.adapter_host), made at the first stage
        self.adapters: Any = None

    def init_transfer_engine(self, init_info: ColoInitInfo) -> None:
        if not isinstance(init_info.transports, dict):
            raise ValueError("colo: init_info.transports must map a transport name to its init info")
        for transport, info in init_info.transports.items():
            self.kit.transport_init(transport, info)

    def start_weight_update(self) -> None:
        self.kit.begin_load()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on a
        # CPU; the kit already waits for the device before it answers.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: ColoUpdateInfo) -> None:
        try:
            self.kit.transport_load(update_info.transport, update_info.request)
        except BaseException:
            # vLLM's worker drops its session on any error here; the model must not stay
            # half on the meta device, and the mapped buffers go back to the sender
            self.sink.abort()
            self.kit.release(kept=True)
            raise

    def finish_weight_update(self) -> None:
        if self.sink.session is None and self.sink.aborted:
            # vLLM's worker keeps its session open when a finish raised: this finish closes it
            self.sink.aborted = False
            return
        self.kit.end_load()

    def shutdown(self) -> None:
        self.kit.close()
        if self.adapters is not None:
            self.adapters.close()


class ColoWorkerExtension:
    """Methods mixed into vLLM's worker (``collective_rpc("colo_...")``). Over HTTP
    (``POST /collective_rpc``) arguments arrive as JSON strings: each accepts either."""

    def _colo(self) -> ColoWeightTransfer:
        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, ColoWeightTransfer):
            raise RuntimeError(f"colo: this vLLM's weight transfer engine is {type(engine).__name__}; start it "
                               f"with weight_transfer_config={{'backend': 'colo'}}")
        return engine

    def colo_hello(self) -> dict:
        """What this worker's model takes in a sync: the spec list in the checkpoint's order."""
        sink = self._colo().sink
        kv = {t.data_ptr(): t.numel() * t.element_size() for t in getattr(self.model_runner, "kv_caches", [])
              if isinstance(t, torch.Tensor)}
        return {"specs": [[s.name, list(s.shape), s.dtype] for s in sink.expected_specs()],
                "tied": dict(sink.tied), "device": str(sink.device), "pid": os.getpid(),
                "kv_cache_bytes": sum(kv.values()),
                "model_type": getattr(sink.model_config.hf_config, "model_type", None),
                "layout_problem": sink.layout_problem}

    def colo_preflight(self, specs: Any = None, key: Any = None) -> dict:
        return self._colo().kit.preflight(_json(specs), key)

    def colo_digest(self) -> str:
        """The digest of the tensors received in the last session, in the accepted spec order."""
        engine = self._colo()
        order = [s.name for s in engine.kit.accepted] or list(engine.sink.shapes)
        return engine.sink.received.digest(order)

    def colo_timings(self) -> dict[str, float]:
        """Seconds per part of the loads since the last call (and start counting again)."""
        sink = self._colo().sink
        out, sink.timings = sink.timings, {}
        return out

    def colo_received(self) -> list[str]:
        return self._colo().sink.received.names

    def colo_transport_init(self, transport: str, init_info: Any) -> dict:
        return self._colo().kit.transport_init(transport, _json(init_info))

    def colo_transport_close(self, transport: str) -> dict:
        return self._colo().kit.transport_close(transport)

    def colo_drop_handles(self) -> dict:
        """After a failed sync: end a session left open and let go of every mapped buffer."""
        engine = self._colo()
        engine.sink.abort()
        return engine.kit.drop_handles()

    # -- LoRA adapters, in memory (colo.engine.vllm.adapters) ---------------------------------
    def _adapters(self) -> Any:
        """The adapter host (colo.engine.adapter_host): a second engine kit beside the weights',
        with receivers of its own, so an adapter's stage never touches the weights' session."""
        engine = self._colo()
        if engine.adapters is None:
            from colo.engine.adapter_host import AdapterHost
            from colo.engine.vllm.adapters import AdapterSink

            engine.adapters = AdapterHost(AdapterSink(self.model_runner, engine.sink.model_config,
                                                      engine.sink.device), log=_log_line)
        return engine.adapters

    def colo_adapter(self, op: str, args: Any = ()) -> dict:
        """One adapter request of the host's (``preflight``, ``begin``, ``load``, ``end``,
        ``transport_init``, ``transport_close``, ``abort``, ``list``, ``drop``)."""
        from colo.engine.adapter_host import ADAPTER_OPS

        if op not in ADAPTER_OPS:
            raise ValueError(f"unknown adapter request {op!r}; expected one of {', '.join(ADAPTER_OPS)}")
        # in this process only (the driver refuses adapters over HTTP): its arguments as sent
        return getattr(self._adapters(), op)(*args)


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


# At import: a spawned worker imports this module (as its worker_extension_cls) before
# load_model builds the transfer engine. The factory refuses a second registration.
if BACKEND not in WeightTransferEngineFactory._registry:
    WeightTransferEngineFactory.register_engine(BACKEND, ColoWeightTransfer)
