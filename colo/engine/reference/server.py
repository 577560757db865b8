"""The engine process: an EngineCore behind the authenticated control channel.

Like SGLang's scheduler process, it does one request at a time. It survives
bad peers: a client without the key is refused, a frame that is not JSON
(a pickle, say) is answered with an error and logged, and the engine keeps
serving. Bucket handles are opened by the transports' receivers, through
``colo.proc.handles.open_handle`` only.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import threading
import time
import traceback
from typing import Any

import torch

from colo.core.buckets import ITEMSIZE
from colo.engine.forward import encode_f32
from colo.engine.kit import EngineKit
from colo.proc.channel import HANDSHAKE_S, ChannelError, FrameRefused, Gate, encode, recv_frame, send_frame
from colo.proc.lifecycle import die_with_parent, log, open_log, serve_then_end


def torch_dtype(name: str) -> torch.dtype:
    if name not in ITEMSIZE:
        raise ValueError(f"dtype {name!r} is not allowed; expected one of {', '.join(ITEMSIZE)}")
    return getattr(torch, name)


class EngineServer:
    """colo's own engine behind its control channel: the engine's verbs (memory tags,
    generation, version, digest) on its :class:`EngineCore`, and the receiving half of
    every sync through the engine kit (:class:`colo.engine.kit.EngineKit`), the same
    class an adapter hosts inside another engine's worker."""

    def __init__(self, core: Any):
        self.core = core
        self.kit = EngineKit(core)
        #: the LoRA adapters' receiving half, made at the first adapter request
        self.adapters: Any = None
        self.running = True
        self._recording: Any = None  # a diagnostic profile in progress (profile_start)

    # -- the engine's own verbs ---------------------------------------------------
    def op_hello(self) -> dict:
        # ends_with_digest: a load's end may be asked to answer the digest too (``digest`` below)
        return {"tag_bytes": dict(self.core.tag_bytes()), "weight_version": self.core.weight_version,
                "capabilities": self.core.capabilities.to_json(), "ends_with_digest": True,
                "param_specs": [[s.name, list(s.shape), s.dtype] for s in self.core.param_specs()]}

    def op_release(self, tags: list[str]) -> dict:
        self.core.release(list(tags))
        return {"tag_bytes": dict(self.core.tag_bytes())}

    def op_resume(self, tags: list[str]) -> dict:
        self.core.resume(list(tags))
        return {"tag_bytes": dict(self.core.tag_bytes())}

    def op_flush_cache(self) -> dict:
        self.core.flush_cache()
        return {}

    def op_set_weight_version(self, version: int | None) -> dict:
        self.core.set_weight_version(version)
        return {}

    def op_generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float,
                    seed: int, adapter: int | None = None) -> dict:
        g = torch.Generator().manual_seed(int(seed))
        tokens = torch.tensor(prompts, dtype=torch.long)
        completions, _ = self.core.generate(tokens, int(max_new_tokens), temperature=float(temperature),
                                            generator=g, adapter=adapter)
        return {"completions": completions.tolist()}

    def op_logits(self, tokens: list[list[int]], columns: list[int] | None = None,
                  adapter: int | None = None) -> dict:
        out = self.core.logits(torch.tensor(tokens, dtype=torch.long), adapter=adapter)
        if columns is not None:
            vocab = out.shape[-1]
            bad = [c for c in columns if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c < vocab]
            if bad:
                raise ValueError(f"logits: columns {bad[:5]} are not vocabulary ids (expected integers in "
                                 f"[0, {vocab}))")
            out = out[..., torch.tensor(columns, dtype=torch.long, device=out.device)]
        # as float32 bytes, not a JSON list: formatting and parsing the probe's 17,000 numbers was
        # 23 ms of a 43 ms probe at Qwen2-1.5B on an H100 (bench/probe_cost.py); NaNs pass as
        # bytes, and the verifier's comparison fails on them
        return encode_f32(out)  # the answer colo.engine.forward decodes

    def op_digest(self, order: list[str] | None = None, arm: bool = True) -> dict:
        # in the order asked (an adapter run's check of the base), else of the spec list the
        # last preflight accepted: the trainer's
        if not isinstance(arm, bool):
            raise ValueError(f"digest: arm must be true or false, got {arm!r}")
        return {"digest": self.core.digest(order or [s.name for s in self.kit.accepted] or None, arm=arm)}

    def _with_digest(self, reply: dict, digest: bool, ended: bool) -> dict:
        """A load's end asked with ``digest``: the digest as ``op_digest`` would answer it next,
        in the same reply. Verification asks for it after every sync, and a request of its own
        was most of what verifying cost (1.3-2.4 ms of 5.9-60 ms syncs at Qwen2-1.5B on an H200,
        issue 44); the load summed what it wrote, so here it is read back, not computed again."""
        if digest is True and ended:
            t0 = time.perf_counter()
            reply.update(self.op_digest(), digest_s=time.perf_counter() - t0)
        return reply

    def op_param_entries(self) -> dict:
        # a diagnostic: each parameter's digest entry, naming those a mismatch is in
        return {"entries": self.core.param_entries()}

    def op_profile_start(self) -> dict:
        """A diagnostic: record this engine's own work under torch.profiler until
        ``profile_stop`` (the sender's side records its own: ``colo.device.profile``)."""
        from colo.device.profile import Recording

        if self._recording is not None:
            raise RuntimeError("profile_start: this engine is already recording; profile_stop first")
        self._recording = Recording().start()
        return {}

    def op_profile_stop(self, path: str) -> dict:
        """End the recording: its Chrome trace at ``path``, its summary in the reply."""
        if self._recording is None:
            raise RuntimeError("profile_stop: this engine is not recording; profile_start first")
        recording, self._recording = self._recording, None
        return recording.stop(str(path))

    # -- the receiving half: the engine kit ------------------------------------------
    def op_preflight(self, specs: list[list] | None = None, key: str | None = None) -> dict:
        return self.kit.preflight(specs, key)

    def op_begin_load(self, preflight_key: str | None = None) -> dict:
        return self.kit.begin_load(preflight_key)

    def op_transport_init(self, transport: str, init_info: dict) -> dict:
        return self.kit.transport_init(transport, init_info)

    def op_transport_load(self, transport: str, request: dict, begin_load: bool = False,
                          preflight_key: str | None = None, end_load: bool = False,
                          flush_cache: bool = False, digest: bool = False) -> dict:
        reply = self.kit.transport_load(transport, request, begin_load, preflight_key, end_load, flush_cache)
        return self._with_digest(reply, digest, reply.get("ended") is True)

    def op_transport_close(self, transport: str) -> dict:
        return self.kit.transport_close(transport)

    def op_end_load(self, flush_cache: bool = False, digest: bool = False) -> dict:
        return self._with_digest(self.kit.end_load(flush_cache), digest, True)

    def op_drop_handles(self) -> dict:
        return self.kit.drop_handles()

    # -- LoRA adapters: a second kit, beside the weights' (colo.engine.adapter_host) ----------
    def op_adapter(self, verb: str, args: list) -> dict:
        """One adapter request (``preflight``, ``begin``, ``load``, ``end``, ``transport_init``,
        ``transport_close``, ``abort``, ``list``, ``drop``) of the engine's adapter host."""
        from colo.engine.adapter_host import ADAPTER_OPS

        if verb not in ADAPTER_OPS or not isinstance(args, list):
            raise ValueError(f"adapter: expected one of {', '.join(ADAPTER_OPS)} and a list of arguments, "
                             f"got {verb!r}")
        if self.adapters is None:
            from colo.engine.adapter_host import AdapterHost
            from colo.engine.reference.adapters import EngineAdapters

            self.adapters = AdapterHost(EngineAdapters(self.core))
        return getattr(self.adapters, verb)(*args)

    def op_shutdown(self) -> dict:
        self.running = False
        self.kit.close()
        if self.adapters is not None:
            self.adapters.close()
        return {}

    # -- loop ------------------------------------------------------------------
    def handle(self, msg: dict) -> dict:
        rid, op = msg.get("id"), msg.get("op")
        fn = getattr(self, f"op_{op}", None) if isinstance(op, str) and op.isidentifier() else None
        if fn is None:
            return {"id": rid, "ok": False, "error_type": "UnknownOp", "error": f"unknown op {op!r}"}
        args = {k: v for k, v in msg.items() if k not in ("id", "op")}
        try:
            return {"id": rid, "ok": True, **fn(**args)}
        except Exception as e:  # the engine answers every request; it does not die on one
            from colo.transports.wire import is_layout_not_cached

            # a layout the engine does not hold (a restarted engine, a changed model) is the
            # cache's normal miss: the sender sends it whole, so it is no failure to report
            log("engine.layout_not_cached" if is_layout_not_cached(e) else "engine.request_failed",
                op=op, error=f"{type(e).__name__}: {e}")
            return {"id": rid, "ok": False, "error_type": type(e).__name__, "error": str(e),
                    "trace": traceback.format_exc(limit=3)}

    def reply_bytes(self, msg: dict) -> bytes:
        """The encoded answer to ``msg``; an answer that cannot be encoded (a NaN
        in the logits, say) becomes an error answer instead of ending the engine."""
        reply = self.handle(msg)
        try:
            return encode(reply)
        except (ChannelError, TypeError, ValueError) as e:
            log("engine.reply_refused", op=str(msg.get("op"))[:64], error=str(e))
            rid = reply.get("id")
            return encode({"id": rid if type(rid) in (int, str) else None, "ok": False,
                           "error_type": "ChannelError", "error": f"the reply could not be sent: {e}"})

    def serve_connection(self, conn: socket.socket) -> None:
        """Serve one authenticated connection until it closes, is out of step, or shutdown."""
        while self.running:
            try:
                msg = recv_frame(conn)
            except FrameRefused as e:
                # A frame we will not decode (not JSON, a pickle, nested 100,000
                # deep, a 5,000-digit number) is refused, logged and answered;
                # the engine reads the next one.
                log("channel.rejected_frame", reason=str(e))
                send_frame(conn, {"id": None, "ok": False, "error_type": "ChannelError", "error": str(e)})
                continue
            except ChannelError as e:
                if "closed" in str(e):
                    return
                # the stream is out of step (a length beyond the limit): say why,
                # then drop this connection; the client can connect again
                log("channel.rejected_frame", reason=str(e))
                send_frame(conn, {"id": None, "ok": False, "error_type": "ChannelError",
                                  "error": f"{e}; closing the connection"})
                return
            conn.sendall(self.reply_bytes(msg))


#: the config fields the engine's model reads (colo.engine.reference.dims.Dims.from_config)
CONFIG_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "intermediate_size", "max_position_embeddings", "rms_norm_eps")


def model_config(d: dict) -> Any:
    """The model config the client sent (``Qwen2Config.to_dict()``) as attributes.

    Not rebuilt as a ``transformers.Qwen2Config``: importing transformers costs
    every engine process about 2 s of CPU at start, and the engine reads only
    the plain fields, which ``to_dict()`` carries in full.
    """
    import types

    if not isinstance(d, dict):
        raise ValueError(f"engine build: config must be a dict (Qwen2Config.to_dict()), got {type(d).__name__}")
    missing = [k for k in CONFIG_FIELDS if k not in d]
    if missing:
        raise ValueError(f"engine build: config lacks {', '.join(missing)} (send Qwen2Config.to_dict())")
    return types.SimpleNamespace(**d)


def host_memory_bytes() -> int | None:
    """This machine's physical memory (None where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_build(build: Any) -> None:
    """Refuse a build this engine cannot be, before anything is built: before memory is
    allocated, a process group joined or a checkpoint read. Every refusal is one
    :class:`~colo.core.errors.EngineRefused` naming the field and what was expected.

    Why here and not only in the client: the build is plain data from another process
    (a driver, a rank worker, a Ray actor's caller), and what the engine would otherwise
    make of a bad one is a ZeroDivisionError, a 10^12-row embedding, or a KV pool larger
    than the machine that the allocator refuses with a C++ message."""
    from colo.core.errors import EngineRefused

    try:
        _check_build(build)
    except EngineRefused:
        raise
    except (ValueError, TypeError, ArithmeticError) as e:  # a malformed field, read as such
        raise EngineRefused(f"engine refused its build: {e}") from None


def _check_build(build: Any) -> None:
    from colo.core.errors import EngineRefused
    from colo.core.units import fmt_bytes
    from colo.engine.reference.dims import dims_from_config
    from colo.engine.reference.kvpool import KVPoolPlan
    from colo.engine.reference.weights import WeightMap

    if not isinstance(build, dict):
        raise ValueError(f"the build must be a dict, got {type(build).__name__}")
    device = build.get("device")
    if not isinstance(device, str) or not re.fullmatch(r"cpu|cuda(:[0-9]+)?", device):
        raise ValueError(f"device must be cpu or cuda[:N], got {device!r}")
    dtype = torch_dtype(build.get("dtype"))
    if not dtype.is_floating_point:
        raise ValueError(f"engine dtype must be a floating point dtype, got {build['dtype']}")
    total = build.get("total_bytes")
    if isinstance(total, bool) or not isinstance(total, int) or total <= 0:
        raise ValueError(f"total_bytes must be a positive integer, got {total!r}")
    fraction = build.get("mem_fraction_static")
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise ValueError(f"mem_fraction_static must be in (0, 1], got {fraction!r}")
    if build.get("memory") not in (None, "free", "saver"):
        raise ValueError(f"memory must be free or saver, got {build.get('memory')!r}")
    threads = build.get("threads")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be a positive integer or None, got {threads!r}")
    checkpoint = build.get("checkpoint")
    if checkpoint is not None and not isinstance(checkpoint, str):
        raise ValueError(f"checkpoint must be a path or None, got {type(checkpoint).__name__}")
    config = model_config(build.get("config"))
    tp = build.get("tp")
    if tp is not None:
        from colo.engine.reference.tp import TPLayout

        if not isinstance(tp, dict):
            raise ValueError(f"tp must be a dict (rank, size, init_method, backend), got {type(tp).__name__}")
        # a model that cannot be split is refused before the group is joined (no rank waits on it)
        dims = TPLayout.from_config(config, tp_rank=tp.get("rank"), tp_size=tp.get("size")).local
    else:
        dims = dims_from_config(config)
    # the sizes the engine's model takes (EngineModel): KVPoolTooSmall is bad input already
    plan = KVPoolPlan(total_bytes=total, mem_fraction_static=fraction,
                      weight_bytes=WeightMap.build(dims).nbytes(dtype), slot_bytes=dims.slot_bytes(dtype),
                      min_slots=dims.max_positions)
    ram = host_memory_bytes()
    if device == "cpu" and ram is not None and plan.static_bytes > ram:
        # on a CPU the device is simulated in this machine's memory: a pool larger than it is
        # refused by the allocator at best, and at worst taken lazily until the OOM killer comes
        raise EngineRefused(
            f"engine refused its build: its weights and KV pool take {fmt_bytes(plan.static_bytes)} "
            f"(mem_fraction_static {fraction:g} of a {fmt_bytes(total)} device), more than this machine's "
            f"{ram / (1 << 30):.1f} GiB of memory (a CPU engine's device is host memory)")


#: torch's intra-op threads in an engine on the CPU, unless its build names them (``"threads"``)
CPU_ENGINE_THREADS = 1


def use_engine_threads(build: dict) -> int:
    """Set this engine process's intra-op threads from its build; the number in use.

    On the CPU one thread unless the build says otherwise. The engine shares the
    machine's cores with its trainer (colocated: another process on the same cores)
    and decodes in hundreds of small ops per token, each a parallel region of torch's
    OpenMP pool when it has two threads. libgomp's waiting threads spin, so whenever
    another process holds a core (the trainer, a neighbour's job), every region waits
    for a descheduled thread: the demo's rollout (32 x 24 tokens, fp32, the demo model)
    took 3 to 17 s with two threads on the busy two-core development VM against 0.4 to
    0.5 s with one (bench/rollout_speed.py's ``colo-2-threads`` row times it beside the
    default). On a GPU the host threads only launch kernels: torch's default is kept."""
    threads = build.get("threads")
    if threads is None and str(build.get("device")) == "cpu":
        threads = CPU_ENGINE_THREADS
    if threads is not None:
        torch.set_num_threads(int(threads))
    return torch.get_num_threads()


def start_failure(exc: BaseException) -> dict:
    """The answer an engine that could not start gives to every request: the reason, and
    whether it is the build's fault (``exit_code`` 2) or the run's (1)."""
    from colo.core.errors import exit_code

    return {"ok": False, "error_type": type(exc).__name__, "error": str(exc) or type(exc).__name__,
            "start_failed": True, "exit_code": exit_code(exc)}


def build_core(build: dict, init_state: Any = None) -> Any:
    """The EngineCore described by ``build`` (plain data, made by the client); ``init_state``
    is version 0 already in memory (a Ray engine actor gets it through the object store)
    instead of ``build["checkpoint"]``."""
    from colo.engine.reference.moe import core_class

    checkpoint = build.get("checkpoint") if init_state is None else None
    if checkpoint and os.path.isdir(checkpoint):
        from colo.transports.disk import load_checkpoint

        # A directory the disk transport committed (manifest + shards); one
        # without a manifest is refused as incomplete.
        init_state = load_checkpoint(checkpoint)
    elif checkpoint:
        from safetensors.torch import load_file

        # Like SGLang launching from a model path: version 0 is the checkpoint.
        init_state = load_file(checkpoint)
    saver = None
    if build.get("memory") == "saver":
        from colo.device.cuda_memory import Saver

        saver = Saver()
    if str(build["device"]).startswith("cuda"):
        import colo.device.cuda_ipc  # noqa: F401  (registers the cuda_ipc handle kind)
    if build.get("tp") is not None:
        return _build_tp_core(build, init_state, saver)
    config = model_config(build["config"])
    core = core_class(config, tp=False)  # a Qwen3-MoE's own core (colo.engine.reference.moe), else EngineCore
    return core(config, dtype=torch_dtype(build["dtype"]),
                      device=build["device"], total_bytes=int(build["total_bytes"]),
                      mem_fraction_static=float(build["mem_fraction_static"]), init_state=init_state,
                      saver=saver)


def _init_tp_group(tp: dict) -> tuple[int, int]:
    """Join the engine's TP process group; ``tp`` is ``{"rank", "size", "init_method", "backend"}``.

    This is the *default* group of this process, and that is deliberate: the
    engine rank is a process of its own (spawned by ``EngineClient.spawn_tp``),
    so its default group holds exactly the engine's TP ranks and never a
    trainer's. Code that may share a process with a trainer must not do this.
    """
    import datetime

    import torch.distributed as dist

    from colo.proc.rendezvous import init_default_group

    rank, size = int(tp["rank"]), int(tp["size"])
    if not 0 <= rank < size:
        raise ValueError(f"tp rank {rank} is not in [0, {size})")
    backend = str(tp.get("backend", "gloo"))
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"tp backend {backend!r} is not allowed; expected gloo or nccl")
    if size == 1:
        return rank, size  # nothing to talk to: TPEngineCore needs no group at tp_size 1
    if dist.is_initialized():
        raise RuntimeError("this process already has a default process group: an engine TP rank "
                           "must run in a process of its own")
    # a dead peer must not hang this rank's collectives forever
    timeout = datetime.timedelta(seconds=float(tp.get("timeout_s", 600)))
    init_default_group(backend, str(tp["init_method"]), rank=rank, world_size=size, timeout=timeout)
    return rank, size


def _build_tp_core(build: dict, init_state: Any, saver: Any) -> Any:
    """One rank of a tensor-parallel engine (``build["tp"]``), after joining its group."""
    from colo.engine.reference.moe import core_class

    device = str(build["device"])
    if device.startswith("cuda"):
        # NCCL uses the current device: make it this rank's (with one GPU per rank through
        # the client's CUDA_VISIBLE_DEVICES, that is "cuda" = index 0)
        torch.cuda.set_device(torch.device(device).index or 0)
    rank, size = _init_tp_group(build["tp"])
    # group=None: the default group, which in this process is the engine's TP group
    config = model_config(build["config"])
    return core_class(config, tp=True)(config, tp_rank=rank, tp_size=size, group=None,
                        dtype=torch_dtype(build["dtype"]), device=device, total_bytes=int(build["total_bytes"]),
                        mem_fraction_static=float(build["mem_fraction_static"]), init_state=init_state,
                        saver=saver)


def serve(sock_path: str, key: bytes, build: dict) -> None:
    """Process entry point: build the engine, listen, serve until shutdown.

    The engine dies with the process that started it (``build["parent_pid"]``)
    and removes its own socket directory on the way out."""
    die_with_parent(build.get("parent_pid"), sock_path, build.get("run_dir"))
    try:
        serve_then_end(lambda: _serve(sock_path, key, build), sock_path)
    finally:
        if threading.current_thread() is threading.main_thread():
            # cleaned up: a parent-death signal during interpreter exit just ends the process
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def serve_when_built(sock_path: str, key: bytes, conn: Any) -> None:
    """Process entry point of an engine begun before its build was known
    (:class:`colo.engine.reference.client.Begun`): this process's imports are done by now;
    wait for the build, then :func:`serve` it."""
    try:
        build = conn.recv()
    except (EOFError, OSError):
        return  # the run gave up on this engine before building it, or died: nothing to serve
    finally:
        conn.close()
    serve(sock_path, key, build)


def _serve(sock_path: str, key: bytes, build: dict) -> None:
    open_log(build.get("log_path"))
    try:
        check_build(build)
        use_engine_threads(build)
        core = build_core(build)
    except Exception as e:
        # The client is waiting for this engine's hello: it gets the reason instead, over the
        # same authenticated channel, rather than an exit code and a traceback on stderr.
        from colo.core.errors import BadInput

        refused = isinstance(e, BadInput)
        log("engine.build_refused" if refused else "engine.start_failed", error=f"{type(e).__name__}: {e}",
            **({} if refused else {"trace": traceback.format_exc(limit=5)}))
        reply = start_failure(e)
        _answer_start_failure(sock_path, key, build, reply)
        raise SystemExit(reply["exit_code"])  # the process's status says it too
    server = EngineServer(core)
    listener, gate = _listen(sock_path, key, build)
    log("engine.ready", socket=sock_path)
    try:
        while server.running:
            conn = gate.accept()
            with conn:
                try:
                    server.serve_connection(conn)
                except (OSError, ChannelError) as e:
                    log("channel.dropped", reason=str(e))
                except Exception as e:  # a bug in one connection must not end the engine
                    log("channel.dropped", reason=f"{type(e).__name__}: {e}",
                        trace=traceback.format_exc(limit=5))
    finally:
        gate.close()
        listener.close()
        server.kit.close()
        if build.get("tp") is not None:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def _listen(sock_path: str, key: bytes, build: dict) -> tuple[socket.socket, Gate]:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock_path + ".tmp")
    os.chmod(sock_path + ".tmp", 0o600)
    listener.listen(16)
    # Rename after listen: the client never connects to a socket that is not ready.
    os.replace(sock_path + ".tmp", sock_path)
    gate = Gate(listener, key, timeout_s=float(build.get("handshake_timeout_s", HANDSHAKE_S)),
                on_refused=lambda reason: log("channel.refused", reason=reason))
    return listener, gate


#: how long an engine that could not start waits for its client to ask why: the client
#: connects as soon as the socket appears, so this only bounds a client that went away
START_FAILURE_WAIT_S = 60.0


def _answer_start_failure(sock_path: str, key: bytes, build: dict, reply: dict) -> None:
    """Listen as a started engine would, answer the client's first request (its hello) with
    ``reply``, and end. Bounded: a client that never comes leaves no engine behind."""
    import time

    listener, gate = _listen(sock_path, key, build)
    deadline = time.monotonic() + START_FAILURE_WAIT_S
    try:
        while True:
            try:
                conn = gate.accept(wait_s=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                log("engine.start_failure_unread", waited_s=START_FAILURE_WAIT_S)
                return
            with conn:
                try:
                    msg = recv_frame(conn)
                    send_frame(conn, {**reply, "id": msg.get("id") if isinstance(msg, dict) else None})
                except (OSError, ChannelError) as e:  # a peer that broke off: the client may still come
                    log("channel.dropped", reason=str(e))
                    continue
            return
    finally:
        gate.close()
        listener.close()

