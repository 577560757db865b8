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
the way colo's engine digests its own (``colo.engine.model.expected_digest``)
and compared with the trainer's: a row whose bytes did not arrive says so.

Nothing here is colo's sync path; the benchmark (``bench.gpu_sync``) runs
it beside colo's rows, in the same run, from the same pinned trainer weights.
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


#: what the benchmark runs by default: the issue's comparison (persistent, its own bucket
#: choice), the same with colo's 512 MiB bucket, and its default per-update process group
DEFAULT_CONFIGS: tuple[PeerConfig, ...] = (PeerConfig(mode="persistent"),
                                          PeerConfig(mode="persistent", bucket_gib=0.5),
                                          PeerConfig(mode="per-update"))


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

        from colo.engine.weights import expected_digest

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
             configs: Iterable[PeerConfig] = DEFAULT_CONFIGS, say: Callable[[str], None] = print) -> dict:
    """Every configuration of checkpoint-engine from ``named_host`` (pinned trainer weights, bf16)
    into one receiver process on this GPU; one row per configuration. ``config`` is the model's
    ``Qwen2Config.to_dict()``."""
    import checkpoint_engine
    import torch.distributed as dist
    from loguru import logger

    configs = check_configs(configs)
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


__all__ = ["DEFAULT_CONFIGS", "MODES", "Copier", "PeerConfig", "Receiver", "check_configs", "digest_config", "pick_handle",
           "read_update_log", "run_peer"]
