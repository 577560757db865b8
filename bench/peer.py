"""A real peer in the GPU benchmark: MoonshotAI's checkpoint-engine, on the same GPU and weights.

checkpoint-engine's ``ParameterServer`` holds the weights in its own pinned host
memory (``register_checkpoint(named_tensors=...)`` copies them there) and pushes
them with ``update()`` into a receiver process on the same GPU. Per update it
allocates an H2D buffer and a two-slot CUDA IPC buffer of its auto-detected
bucket size, copies each bucket pinned host -> H2D buffer -> IPC slot,
broadcasts the slot over its NCCL process group (one rank here), and tells the
receiver over ZeroMQ which tensors lie where; the receiver runs checkpoint-
engine's own ``update_weights_from_ipc``, whose callback gets each tensor as a
view of the slot and copies it into place (as vLLM's ``load_weights`` does).

Two of its process-group modes are measured:

* ``persistent`` — ``ParameterServer(auto_pg=False)`` and one
  ``init_process_group()`` before the first update: every update reuses it.
  This is the mode the GPU issue compares colo with.
* ``per-update`` — ``auto_pg=True``, its constructor's default: ``update()``
  creates the NCCL process group and destroys it again, every time.

After each configuration's timed updates the receiver's weights are digested
the way colo's engine digests its own (``colo.engine.reference.model.expected_digest``)
and compared with the trainer's: a row whose bytes did not arrive says so.

Nothing here is colo's sync path. ``python -m bench.peer OUT.json`` runs it as a
user would: in a fresh process that holds nothing but checkpoint-engine's
parameter server and the trainer's weights in pinned host memory (seeded as
``bench.gpu_sync``'s trainer seeds its own, ``bench.models``), after measuring the
pinned host->device limit in the same process. It times its default (per-update
process group, its own bucket choice), a persistent process group with its own
bucket choice, and a persistent one under each ``--buckets-gib`` cap, and names
the fastest whose bytes arrived (``best``). ``bench.gpu_sync`` runs it that way, per
model, before it builds any of colo's rows: run in the benchmark's own process
after them, its post-release step (``gc.collect``, ``ipc_collect``, ``empty_cache``
per update) slowed with what that process held (issue 31, item 5).
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import re
import statistics
import time
import traceback
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Any

import torch

from colo.proc.lifecycle import free_port, scoped_env

#: the process-group modes, by the name the results use -> ParameterServer's auto_pg
MODES: dict[str, bool] = {"persistent": False, "per-update": True}


@dataclass(frozen=True, kw_only=True)
class PeerConfig:
    """One checkpoint-engine configuration the benchmark times."""

    #: ``persistent`` (one process group for every update) or ``per-update`` (its default)
    mode: str
    #: its ``PS_MAX_BUCKET_SIZE_GB`` (the largest bucket it may choose); None: its default (8 GiB)
    bucket_gib: float | None = None
    #: its ``mem_fraction`` of free device memory the buckets may use; None: its default (0.9)
    mem_fraction: float | None = None
    warmup: int = 1
    reps: int = 3

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"checkpoint-engine mode {self.mode!r}: expected one of {', '.join(MODES)}")
        if self.bucket_gib is not None and (isinstance(self.bucket_gib, bool) or not isinstance(
                self.bucket_gib, (int, float)) or not math.isfinite(self.bucket_gib) or self.bucket_gib <= 0):
            raise ValueError(f"checkpoint-engine bucket_gib must be a finite number of GiB > 0 or None, "
                             f"got {self.bucket_gib!r}")
        if self.mem_fraction is not None and (isinstance(self.mem_fraction, bool) or not isinstance(
                self.mem_fraction, (int, float)) or not 0 < self.mem_fraction <= 1):
            raise ValueError(f"checkpoint-engine mem_fraction must be in (0, 1] or None, got {self.mem_fraction!r}")
        for name, least in (("warmup", 0), ("reps", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"checkpoint-engine {name} must be an integer >= {least}, got {value!r}")

    @property
    def label(self) -> str:
        bucket = "its default bucket" if self.bucket_gib is None else f"{self.bucket_gib:g} GiB buckets"
        return f"checkpoint-engine {self.mode} ({bucket})"


#: the bucket caps (``PS_MAX_BUCKET_SIZE_GB``) a persistent process group is timed under
#: beside its own choice. Its choice is ``min(max(cap, largest tensor), free device memory
#: x mem_fraction / 3)`` (``ParameterServer._detect_bucket_size``): a cap below the largest
#: tensor (Qwen2-7B's 1.09 GB embedding) gives that tensor's size, which each row reports.
DEFAULT_BUCKETS_GIB: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0)


def peer_configs(buckets_gib: Iterable[float] = DEFAULT_BUCKETS_GIB, *, reps: int = 3,
                 warmup: int = 1) -> list[PeerConfig]:
    """What ``python -m bench.peer`` times: its default (``ParameterServer()``'s ``auto_pg=True``,
    a process group per update, its own bucket choice), a persistent process group with its
    own bucket choice, and a persistent one under each bucket cap."""
    return [PeerConfig(mode="per-update", reps=reps, warmup=warmup),
            PeerConfig(mode="persistent", reps=reps, warmup=warmup),
            *(PeerConfig(mode="persistent", bucket_gib=float(b), reps=reps, warmup=warmup) for b in buckets_gib)]


def check_configs(configs: Iterable[PeerConfig]) -> list[PeerConfig]:
    """The configurations in the order they run: every persistent one first (they share one
    parameter server and its process group), each refused if it is not a ``PeerConfig``."""
    configs = list(configs)
    bad = [c for c in configs if not isinstance(c, PeerConfig)]
    if bad:
        raise ValueError(f"checkpoint-engine configurations must be PeerConfig, got {bad[0]!r}")
    if len(set(configs)) != len(configs):
        raise ValueError("checkpoint-engine configurations repeat one another; expected each once")
    return sorted(configs, key=lambda c: list(MODES).index(c.mode))


# -- the receiver's side: checkpoint-engine's own update_weights_from_ipc ------------------------

class Copier:
    """The ``run`` callback ``update_weights_from_ipc`` calls per bucket: copy each tensor into place.

    A name the receiver does not hold, or a shape or dtype other than its
    own, is an error naming the tensor (checkpoint-engine sends the error text
    back to the parameter server, which fails the update). Counts what it
    copied and how long the copies took."""

    def __init__(self, dest: Mapping[str, torch.Tensor]):
        self.dest = dest
        self.start = time.perf_counter()
        self.stats: dict[str, Any] = {"tensors": 0, "bytes": 0, "buckets": 0, "copy_s": 0.0,
                                      "first_bucket_at_s": None}

    def __call__(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        t0 = time.perf_counter()
        if self.stats["first_bucket_at_s"] is None:
            self.stats["first_bucket_at_s"] = t0 - self.start
        for name, tensor in weights:
            target = self.dest.get(name)
            if target is None:
                raise KeyError(f"checkpoint-engine sent {name}, which the receiver does not hold")
            if target.shape != tensor.shape or target.dtype != tensor.dtype:
                raise ValueError(f"checkpoint-engine sent {name} as {tuple(tensor.shape)} {tensor.dtype}; "
                                 f"the receiver holds {tuple(target.shape)} {target.dtype}")
            target.copy_(tensor)
            self.stats["tensors"] += 1
            self.stats["bytes"] += tensor.numel() * tensor.element_size()
        if any(t.is_cuda for _, t in weights[-1:]):
            torch.cuda.synchronize()  # time the copies, not their launches (its worker synchronizes next anyway)
        self.stats["buckets"] += 1
        self.stats["copy_s"] += time.perf_counter() - t0


def pick_handle(socket_paths: Mapping[str, str], device_uuid: str) -> str:
    """The ZeroMQ address checkpoint-engine gave this GPU (as vLLM's worker extension picks it)."""
    if device_uuid not in socket_paths:
        raise KeyError(f"checkpoint-engine offered no socket for this GPU ({device_uuid}); "
                       f"it offered {', '.join(socket_paths) or 'none'}")
    return socket_paths[device_uuid]


def digest_config(config: Mapping[str, Any]) -> SimpleNamespace:
    """A model config, from ``Qwen2Config.to_dict()``, as the digest reads it, without transformers.

    The receiver must not import transformers: checkpoint-engine runs
    ``gc.collect()`` twice per update in the receiver, and transformers' modules
    double the objects that collection walks (0.23 -> 0.37 s measured on the
    2-core CPU box), a cost of the benchmark's receiver, not of checkpoint-engine."""
    return SimpleNamespace(**config)


def _receiver(conn: Any, specs: list[tuple[str, tuple[int, ...]]], config: dict, device_index: int) -> None:
    """The receiver process: the weights in place on the GPU, updated by checkpoint-engine."""
    try:
        import zmq
        from checkpoint_engine import update_weights_from_ipc

        from colo.engine.reference.weights import expected_digest

        torch.cuda.set_device(device_index)
        dest = {name: torch.zeros(shape, dtype=torch.bfloat16, device="cuda") for name, shape in specs}
        uuid = f"GPU-{torch.cuda.get_device_properties(device_index).uuid}"
        ctx = zmq.Context()
        conn.send(("ok", {"device_uuid": uuid, "pid": os.getpid()}))
        while True:
            op, arg = conn.recv()
            if op == "update":
                copier = Copier(dest)
                update_weights_from_ipc(ctx, pick_handle(arg, uuid), device_index, run=copier)
                conn.send(("ok", {**copier.stats, "wall_s": time.perf_counter() - copier.start}))
            elif op == "zero":  # so that the next digest shows what the next updates delivered
                for t in dest.values():
                    t.zero_()
                torch.cuda.synchronize()
                conn.send(("ok", None))
            elif op == "digest":
                conn.send(("ok", expected_digest(dest, digest_config(config), torch.bfloat16)))
            elif op == "stop":
                conn.send(("ok", None))
                return
            else:
                raise ValueError(f"receiver: unknown request {op!r}")
    except BaseException:  # noqa: BLE001 - the parent reports it, with the traceback
        conn.send(("error", traceback.format_exc()))
        raise


class Receiver:
    """The parent's handle on the receiver process; each request waits for its answer."""

    def __init__(self, specs: list[tuple[str, tuple[int, ...]]], config: dict, device_index: int = 0):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_receiver, args=(child, specs, config, device_index),
                                   name="checkpoint-engine-receiver", daemon=True)
        self.process.start()
        child.close()
        self.info = self._answer("start")

    def _answer(self, what: str, timeout: float = 600.0) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"checkpoint-engine receiver (pid {self.process.pid}) gave no answer to "
                               f"{what} in {timeout:g} s")
        try:
            status, value = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"checkpoint-engine receiver exited ({self.process.exitcode}) during {what}") from None
        if status != "ok":
            raise RuntimeError(f"checkpoint-engine receiver failed during {what}:\n{value}")
        return value

    def request(self, op: str, arg: Any = None) -> Any:
        self.conn.send((op, arg))
        return self._answer(op)

    def close(self) -> None:
        try:
            if self.process.is_alive():
                self.request("stop")
        finally:
            self.process.join(30)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()


# -- the parameter server's side ---------------------------------------------------------------

class _Log:
    """checkpoint-engine's own log lines (loguru), with their times, while it is attached."""

    def __init__(self) -> None:
        self.lines: list[tuple[float, str]] = []

    def sink(self, message: Any) -> None:
        self.lines.append((message.record["time"].timestamp(), message.record["message"]))

    def since(self, t0: float) -> list[tuple[float, str]]:
        return [(round(t - t0, 6), m) for t, m in self.lines if t >= t0]


_BUCKET_SIZE = re.compile(r"auto detect bucket size ([0-9.]+) GiB")
_BUCKET_BEGIN = re.compile(r"begin to update bucket (\d+)/(\d+).*bucket_size: ([0-9.]+)MiB, length: (\d+)")


def read_update_log(lines: list[tuple[float, str]]) -> dict:
    """What one update's log says it did: the bucket size it chose, whether it used its H2D
    buffer, and each bucket's start (seconds after the update began), size and tensor count."""
    out: dict[str, Any] = {"bucket_gib": None, "h2d_buffer": None, "buckets": []}
    for t, msg in lines:
        if (m := _BUCKET_SIZE.search(msg)) is not None:
            out["bucket_gib"] = float(m.group(1))
        elif "use h2d buffer" in msg:
            out["h2d_buffer"] = True
        elif "disable h2d buffer" in msg:
            out["h2d_buffer"] = False
        elif (m := _BUCKET_BEGIN.search(msg)) is not None:
            out["buckets"].append({"index": int(m.group(1)), "of": int(m.group(2)), "start_s": t,
                                   "MiB": float(m.group(3)), "tensors": int(m.group(4))})
    return out


def _make_server(auto_pg: bool, mem_fraction: float | None) -> Any:
    from checkpoint_engine import ParameterServer

    # rank 0 reads as "unset" in its constructor (``rank or int(os.environ["RANK"])``): say it in the environment
    with scoped_env({"RANK": "0", "WORLD_SIZE": "1"}):
        return ParameterServer(rank=0, world_size=1, auto_pg=auto_pg, gpu_count=1, mem_fraction=mem_fraction,
                               master_addr="127.0.0.1", master_port=free_port())


def run_peer(named_host: Mapping[str, torch.Tensor], config: dict, *, want_digest: str,
             configs: Iterable[PeerConfig] | None = None, say: Callable[[str], None] = print) -> dict:
    """Every configuration of checkpoint-engine from ``named_host`` (pinned trainer weights, bf16)
    into one receiver process on this GPU; one row per configuration (``configs``; None:
    :func:`peer_configs`). ``config`` is the model's config as a dict (``Qwen2Config.to_dict()``,
    or ``bench.models.attr_config``'s fields)."""
    import checkpoint_engine
    import torch.distributed as dist
    from loguru import logger

    configs = check_configs(peer_configs() if configs is None else configs)
    specs = [(n, tuple(t.shape)) for n, t in named_host.items()]
    model_bytes = sum(t.numel() * t.element_size() for t in named_host.values())
    log = _Log()
    sink = logger.add(log.sink, level="INFO")
    receiver = Receiver(specs, dict(config), torch.cuda.current_device())
    rows: list[dict] = []
    server, server_mode, setup = None, None, {}

    def close_server() -> None:
        nonlocal server, server_mode
        if server is None:
            return
        server.unregister_checkpoint("bench", force=True)
        if not MODES[server_mode] and dist.is_initialized():  # ours to destroy in persistent mode
            dist.destroy_process_group()
        server, server_mode = None, None

    try:
        for config in configs:
            if server_mode != config.mode:
                close_server()
                t = time.perf_counter()
                server = _make_server(MODES[config.mode], config.mem_fraction)
                if not MODES[config.mode]:
                    server.init_process_group()  # once, for every update of this server
                setup = {"server_init_s": time.perf_counter() - t}
                server_mode = config.mode
                t = time.perf_counter()
                server.register_checkpoint("bench", named_tensors=dict(named_host))
                setup["register_checkpoint_s"] = time.perf_counter() - t
                t = time.perf_counter()
                server.gather_metas("bench")
                setup["gather_metas_s"] = time.perf_counter() - t
                pools = [m for metas in server.get_metas().values() for m in metas.memory_buffer_metas_list]
                setup["pinned_buffers"], setup["pinned_bytes"] = len(pools), sum(m.size for m in pools)
            receiver.request("zero")
            times, received, peaks, timeline = [], [], [], None
            bucket_env = None if config.bucket_gib is None else repr(float(config.bucket_gib))
            with scoped_env({"PS_MAX_BUCKET_SIZE_GB": bucket_env}):
                for i in range(config.warmup + config.reps):
                    answers: list[Any] = []

                    def req(socket_paths: list[tuple[str, str]]) -> None:
                        # its update() runs this on a thread while it drives the buckets
                        try:
                            answers.append(receiver.request("update", dict(socket_paths)))
                        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
                            answers.append(e)

                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                    wall0 = time.time()
                    t0 = time.perf_counter()
                    server.update("bench", req)
                    torch.cuda.synchronize()
                    elapsed = time.perf_counter() - t0
                    if not answers or isinstance(answers[0], BaseException):
                        raise RuntimeError(f"{config.label}: the receiver did not complete update {i}") from (
                            answers[0] if answers else None)
                    if i >= config.warmup:
                        times.append(elapsed)
                        received.append(answers[0])
                        peaks.append(torch.cuda.max_memory_allocated() - base)
                        timeline = log.since(wall0)
            digest_ok = receiver.request("digest") == want_digest
            sec = statistics.median(times)
            parsed = read_update_log(timeline or [])
            last = received[-1]
            row = {
                "peer": "checkpoint-engine", "version": checkpoint_engine.__version__, "label": config.label,
                "config": {**asdict(config), "auto_pg": MODES[config.mode], "world_size": 1, "backend": "nccl",
                           "update": "broadcast (ranks=None), receiver on the same GPU",
                           "receiver": "checkpoint_engine.update_weights_from_ipc, each tensor copy_ into place",
                           "PS_MAX_BUCKET_SIZE_GB": bucket_env or "unset (its default 8)",
                           "mem_fraction": config.mem_fraction if config.mem_fraction is not None else
                           "unset (its default 0.9)"},
                "update_s": sec, "update_s_all": times, "bytes": model_bytes, "GBps": model_bytes / sec / 1e9,
                "digest_ok": digest_ok, "received_bytes": last["bytes"], "received_tensors": last["tensors"],
                "tensors": len(specs),
                # what it pays per update, from its log and the receiver's side
                "bucket_gib": parsed["bucket_gib"], "h2d_buffer": parsed["h2d_buffer"],
                "buckets_per_update": len(parsed["buckets"]), "bucket_starts": parsed["buckets"],
                "receiver_copy_s": statistics.median(r["copy_s"] for r in received),
                "receiver_first_bucket_after_s": statistics.median(r["first_bucket_at_s"] or 0.0 for r in received),
                "receiver_wall_s": statistics.median(r["wall_s"] for r in received),
                "peak_extra_device_bytes": max(peaks), "setup": dict(setup),
                "log_last_update": timeline,
            }
            rows.append(row)
            say(f"{config.label}: {sec:.3f} s per update ({row['GBps']:.1f} GB/s), bucket {row['bucket_gib']} GiB "
                f"x {row['buckets_per_update']}, h2d buffer {row['h2d_buffer']}, receiver copies "
                f"{row['receiver_copy_s']:.3f} s, digest ok {digest_ok}")
    finally:
        try:
            close_server()
        finally:
            receiver.close()
            logger.remove(sink)
            torch.cuda.empty_cache()
    return {"rows": rows, "receiver_pid": receiver.info["pid"], "device_uuid": receiver.info["device_uuid"]}


# -- python -m bench.peer: checkpoint-engine in a process of its own ---------------------------

#: what ``python -m bench.peer`` writes; ``bench.gpu_sync`` reads it (:func:`bench.gpu_sync.read_peer_result`)
KIND = "bench.peer/checkpoint-engine"


def _brief(row: Mapping[str, Any] | None) -> dict | None:
    if row is None:
        return None
    return {"label": row["label"], "mode": row["config"]["mode"], "bucket_gib_cap": row["config"]["bucket_gib"],
            "bucket_gib": row["bucket_gib"], "buckets_per_update": row["buckets_per_update"],
            "update_s": row["update_s"], "GBps": row["GBps"], "digest_ok": row["digest_ok"]}


def summarize(rows: Iterable[Mapping[str, Any]]) -> dict:
    """``default``: the row of its default configuration (per-update process group, its own
    bucket choice), whatever its digest says; ``best``: the fastest row whose digest is ok
    (None when none is): an update that did not deliver the weights is no candidate."""
    rows = list(rows)
    default = next((r for r in rows if r["config"]["mode"] == "per-update" and r["config"]["bucket_gib"] is None),
                   None)
    delivered = [r for r in rows if r["digest_ok"] is True]
    best = min(delivered, key=lambda r: r["update_s"]) if delivered else None
    return {"default": _brief(default), "best": _brief(best)}


def parse_buckets(text: str) -> tuple[float, ...]:
    """``--buckets-gib``: comma-separated bucket caps in GiB, each a finite number > 0, each
    once ("" for none: only its own choice is timed)."""
    items = [x.strip() for x in text.split(",")] if text.strip() else []
    out: list[float] = []
    for item in items:
        try:
            value = float(item)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value <= 0 or value > 1 << 20:
            raise ValueError(f"--buckets-gib takes comma-separated sizes in GiB, each > 0 and at most 1 PiB "
                             f"(e.g. 0.5,1,2,4); got {item!r} in {text!r}")
        if value in out:
            raise ValueError(f"--buckets-gib names {item} GiB twice in {text!r}; expected each size once")
        out.append(value)
    return tuple(out)


class _PeerArgs:
    """argparse, with each bad argument said in one line (exit 2), no usage block."""

    def __init__(self) -> None:
        import argparse

        from bench.models import GPU_MODEL_NAMES

        class Parser(argparse.ArgumentParser):
            def error(self, message: str) -> None:
                raise _BadInput(message)

        p = Parser(prog="python -m bench.peer", allow_abbrev=False,
                   description="checkpoint-engine on one GPU, in this process alone: its default, a persistent "
                               "process group, and each bucket cap")
        p.add_argument("out", help="where the JSON result goes")
        p.add_argument("--model", default=GPU_MODEL_NAMES[0], help=f"one of {', '.join(GPU_MODEL_NAMES)}")
        p.add_argument("--layers", help="cut the model to this many layers (a quick check)")
        p.add_argument("--buckets-gib", default=",".join(f"{b:g}" for b in DEFAULT_BUCKETS_GIB),
                       help="bucket caps (PS_MAX_BUCKET_SIZE_GB) a persistent process group is timed under")
        p.add_argument("--reps", default="3", help="timed updates per configuration, after one warm-up")
        self.parser, self.models = p, GPU_MODEL_NAMES

    def parse(self, argv: Any) -> SimpleNamespace:
        a = self.parser.parse_args(argv)
        if a.model not in self.models:
            raise _BadInput(f"--model {a.model!r}: expected one of {', '.join(self.models)}")
        layers = None if a.layers is None else _positive_int("--layers", a.layers)
        reps = _positive_int("--reps", a.reps)
        try:
            buckets = parse_buckets(a.buckets_gib)
        except ValueError as e:
            raise _BadInput(str(e)) from None
        folder = os.path.dirname(os.path.abspath(a.out))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            raise _BadInput(f"OUT {a.out!r}: its folder {folder} is not a writable folder")
        return SimpleNamespace(out=a.out, model=a.model, layers=layers, reps=reps, buckets_gib=buckets)


class _BadInput(Exception):
    pass


def _positive_int(flag: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise _BadInput(f"{flag} must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise _BadInput(f"{flag} must be an integer >= 1, got {text!r}")
    return value


def _write(path: str, result: Mapping[str, Any]) -> None:
    import json

    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=2)
        fh.write("\n")
    os.replace(tmp, path)  # a reader never sees half a result


def measure(model: str, *, layers: int | None, reps: int, buckets_gib: Iterable[float],
            say: Callable[[str], None] = print) -> dict:
    """The pinned host->device limit, then every configuration, in this process: it makes
    the weights on the GPU (their expected digest computed there), keeps only their pinned
    host copy, and hands that to checkpoint-engine's parameter server."""
    import checkpoint_engine

    from bench.models import attr_config, gpu_models, seeded_flat_weights
    from colo.apps.bench import measure_gpu_limits, release_cached
    from colo.engine.reference.weights import expected_digest, expected_hf_specs

    limits = measure_gpu_limits()  # frees its buffers (device and pinned host) before returning
    say(f"pinned host->device {limits['pinned_h2d_GBps']:.1f} GB/s in this process")
    config = attr_config(model, layers)
    specs = expected_hf_specs(config, torch.bfloat16)
    # the trainer's weights, made as bench.gpu_sync's trainer makes them; digested on the device
    flat = seeded_flat_weights(specs, share_host=False)
    try:
        want = expected_digest(flat.tensors, config, torch.bfloat16)
        flat.pause()  # to its private pinned host copy; the device memory goes back to the driver
        reserved_before = torch.cuda.memory_reserved()
        model_bytes = sum(s.nbytes for s in specs)
        say(f"{model}: {model_bytes / 1e9:.2f} GB of bf16 weights in pinned host memory, "
            f"{reserved_before} B of device memory reserved in this process before the peer")
        peer = run_peer(flat.host_tensors(), dict(vars(config)), want_digest=want,
                        configs=peer_configs(buckets_gib, reps=reps), say=say)
    finally:
        flat.close()
        release_cached()
    limit = limits["pinned_h2d_GBps"]
    for r in peer["rows"]:
        # 1.0 would be one pinned host->device copy of the model at this process's limit
        r["over_h2d_limit"] = r["update_s"] / (r["bytes"] / (limit * 1e9))
    label, _ = gpu_models()[model]
    return {"model": model, "shapes": label + ("" if layers is None else f" ({layers} layers)"),
            "layers": layers, "dtype": "bfloat16", "bytes": model_bytes, "tensors": len(specs),
            "checkpoint_engine": checkpoint_engine.__version__, "limits": limits, "pinned_h2d_GBps": limit,
            "expected_digest": want, "reps": reps, "warmup": 1, "buckets_gib": list(buckets_gib),
            "device_reserved_before_peer_bytes": reserved_before, **peer, **summarize(peer["rows"])}


def main(argv: Any = None) -> int:
    import datetime as dt
    import platform
    import sys

    try:
        a = _PeerArgs().parse(argv)
    except _BadInput as e:
        print(f"python -m bench.peer: error: {e}", file=sys.stderr)
        return 2
    head = {"kind": KIND, "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "model": a.model, "layers": a.layers, "pid": os.getpid(), "torch": torch.__version__,
            "python": platform.python_version()}
    try:
        import checkpoint_engine  # noqa: F401
    except ImportError as e:  # an optional peer: said in the result, which bench.gpu_sync reads
        reason = f"checkpoint-engine is not importable ({e}); pip install checkpoint-engine, or --no-peer"
        _write(a.out, {**head, "skipped": reason, "rows": []})
        print(f"python -m bench.peer: {reason}", file=sys.stderr)
        return 1
    if not torch.cuda.is_available():
        print("python -m bench.peer: no CUDA device is visible", file=sys.stderr)
        return 2
    head.update(device=torch.cuda.get_device_name(), gpu_count=torch.cuda.device_count(),
                device_total_bytes=torch.cuda.mem_get_info()[1], cuda=torch.version.cuda)
    say = lambda line: print(line, flush=True)  # noqa: E731
    try:
        result = {**head, **measure(a.model, layers=a.layers, reps=a.reps, buckets_gib=a.buckets_gib, say=say)}
    except Exception:  # noqa: BLE001 - in the result for bench.gpu_sync, and the exit status
        text = traceback.format_exc()
        _write(a.out, {**head, "error": text, "rows": []})
        print(text, file=sys.stderr, flush=True)
        return 1
    _write(a.out, result)
    for which in ("default", "best"):
        r = result[which]
        say(f"checkpoint-engine {which}: " + ("none (no row delivered the weights)" if r is None else
            f"{r['label']}: {r['update_s']:.3f} s per update ({r['GBps']:.1f} GB/s), bucket {r['bucket_gib']} GiB "
            f"x {r['buckets_per_update']}, digest ok {r['digest_ok']}"))
    return 0 if result["best"] is not None and all(r["digest_ok"] for r in result["rows"]) else 1


__all__ = ["DEFAULT_BUCKETS_GIB", "KIND", "MODES", "Copier", "PeerConfig", "Receiver", "check_configs",
           "digest_config", "main", "measure", "parse_buckets", "peer_configs", "pick_handle", "read_update_log",
           "run_peer", "summarize"]


if __name__ == "__main__":
    import sys

    sys.exit(main())
