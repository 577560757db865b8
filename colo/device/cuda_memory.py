"""The GPU memory backend: torch_memory_saver regions by tag, and a ledger that reads the device.

Each process (the trainer's, the engine's) has its own memory saver; a tag is
``owner.tag`` (``trainer.weights``, ``engine.kv_cache``...). Trainer regions
keep a pinned host backup, and that backup is retained across cycles: pinning
fresh host memory on every pause is what made the saver's pause slow (2.5 GB/s
measured on an H200), while a copy into an already pinned buffer runs at the
PCIe rate. In ``offload-first`` the pinned backup is also the sync's upload
source, through a zero-copy view.

``expandable_segments`` is refused: the memory saver's virtual-memory regions
and the allocator's expandable segments cannot coexist.
"""

from __future__ import annotations

from dataclasses import dataclass

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from colo.core.memory import MemoryLedger


def refuse_expandable_segments() -> None:
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + os.environ.get("PYTORCH_ALLOC_CONF", "")
    if "expandable_segments:true" in conf.replace(" ", "").lower():
        raise ValueError(
            "PYTORCH_CUDA_ALLOC_CONF enables expandable_segments, which is incompatible with "
            "torch_memory_saver's paused regions; unset it (expected expandable_segments:False)")


def exit_past_the_saver(code: int) -> int:
    """End this process now with ``code`` when torch_memory_saver is loaded in it; return
    ``code`` otherwise.

    Its pools are torn down at interpreter exit, outside any region, and its torch
    hook then ends the process with status 1 ("only support interesting region",
    torch-memory-saver 0.0.10) whatever the program returned: a GPU benchmark whose
    every digest checked, and 23 GPU tests that all passed, exited 1 on an H100.
    Whatever the process had to write is written before this is called."""
    if "torch_memory_saver" not in sys.modules:
        return code
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class Saver:
    """This process's torch_memory_saver, in torch hook mode (no LD_PRELOAD needed)."""

    def __init__(self, *, retain_cpu_backup: bool = True):
        refuse_expandable_segments()
        try:
            from torch_memory_saver import torch_memory_saver as tms
        except ImportError as e:
            raise ImportError("the GPU memory backend needs torch-memory-saver: pip install 'colo-rl[gpu]'") from e
        try:
            tms.hook_mode = "torch"
        except AttributeError:
            pass  # already initialised in this process (hook mode fixed then)
        self.tms = tms
        self.retain_cpu_backup = retain_cpu_backup
        self._retain_set = False
        self.paused: set[str] = set()
        #: the last pause's seconds: waiting for the device, then the saver's copies and unmapping
        self.last_pause_s: dict[str, float] = {}

    @contextmanager
    def region(self, key: str, *, cpu_backup: bool = False) -> Iterator[None]:
        with self.tms.region(tag=key, enable_cpu_backup=cpu_backup):
            yield
        if self.retain_cpu_backup and cpu_backup and not self._retain_set:
            self.tms.retain_cpu_backup = True
            self._retain_set = True

    @property
    def retains_backups(self) -> bool:
        """Pinned backups stay allocated from pause to pause (at the same addresses)."""
        return self.retain_cpu_backup and self._retain_set

    def pause(self, key: str) -> None:
        if key in self.paused:
            raise RuntimeError(f"cannot pause {key}: it is already paused (the memory saver would abort)")
        # Kernels still reading the region must finish before its pages go.
        t0 = time.perf_counter()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        self.tms.pause(key)
        self.paused.add(key)
        self.last_pause_s = {"wait": t1 - t0, "copy": time.perf_counter() - t1}

    def resume(self, key: str) -> None:
        if key not in self.paused:
            raise RuntimeError(f"cannot resume {key}: it is already resident (the memory saver would abort)")
        self.tms.resume(key)
        self.paused.discard(key)

    def host_view(self, t: torch.Tensor) -> torch.Tensor:
        """The pinned host backup of a paused tensor, without a copy."""
        view = self.tms.get_cpu_backup(t, zero_copy=True)
        if view is None:
            raise RuntimeError("tensor has no host backup: was it allocated in a region with cpu_backup?")
        return view


class TrainerMemory:
    """The trainer's side of the backend: pause/resume its tags, host views when paused.

    ``flats`` maps a tag (``"weights"``) to the :class:`colo.device.flat_weights.FlatWeights`
    that hold it instead of a saver region: an exportable buffer the engine
    reads straight from in ``sync-first``, paused and resumed by itself."""

    def __init__(self, saver: Saver, *, flats: Any = None):
        self.saver = saver
        self.flats = dict(flats or {})
        #: where the last pause's time went, in seconds: ``empty_cache`` (the allocator's cache
        #: handed back, before and after), each tag's whole pause under its name, and its parts as
        #: ``tag.part`` where its pauser reports them (``wait`` for the device, ``copy`` to the host,
        #: ``free``); a diagnostic for the benchmark (issue 44: pauses at 0.94-0.95 of the link)
        self.last_pause_s: dict[str, float] = {}
        #: the last resume's seconds, by tag (the flat weights' resume queues its copy: the tag
        #: resumed after it waits for that too)
        self.last_resume_s: dict[str, float] = {}

    def resident(self, tag: str) -> bool:
        if tag in self.flats:
            return not self.flats[tag].paused
        return f"trainer.{tag}" not in self.saver.paused

    async def pause(self, owner: str, tags: Any) -> None:
        import anyio.to_thread

        # Activations and gradients lived in the caching allocator: hand those blocks
        # back to the driver too, or the engine's wake-up cannot use them. First, not
        # last: the driver clears memory a process releases, and host<->device copies
        # run at half the link's rate while it does (bench.saver_copy on an H200: 25 of
        # 54 GB/s for the first 2 GB after 18 GiB were released); released before the
        # pauses, the clearing runs beside their device->host copies, which it did not
        # slow (the same run), and not beside an offload-first sync that comes next.
        took: dict[str, float] = {}
        t0 = time.perf_counter()
        torch.cuda.empty_cache()
        cache = time.perf_counter() - t0
        for tag in tags:
            pauser = self.flats.get(tag, self.saver)
            t0 = time.perf_counter()
            if tag in self.flats:
                await anyio.to_thread.run_sync(pauser.pause)
            else:
                await anyio.to_thread.run_sync(pauser.pause, f"{owner}.{tag}")
            took[tag] = time.perf_counter() - t0
            took.update({f"{tag}.{k}": v for k, v in getattr(pauser, "last_pause_s", {}).items()})
        # and whatever the pauses themselves left cached (normally nothing)
        t0 = time.perf_counter()
        torch.cuda.empty_cache()
        self.last_pause_s = {"empty_cache": cache + time.perf_counter() - t0, **took}

    async def resume(self, owner: str, tags: Any) -> None:
        import anyio.to_thread

        took: dict[str, float] = {}
        for tag in tags:
            t0 = time.perf_counter()
            if tag in self.flats:
                await anyio.to_thread.run_sync(self.flats[tag].resume)
            else:
                await anyio.to_thread.run_sync(self.saver.resume, f"{owner}.{tag}")
            took[tag] = time.perf_counter() - t0
        self.last_resume_s = took


@dataclass
class CudaLedger(MemoryLedger):
    """The ledger's budget, with ``used`` read from the device at every event.

    ``device_index``: which of this process's GPUs (a driver of many ranks keeps
    one ledger per GPU); ``None`` is the current device."""

    device_index: int | None = None

    def snapshot(self, *, staging: int | None = None) -> dict:
        free, total = torch.cuda.mem_get_info(self.device_index)
        by_tag = self.by_tag()
        if staging is not None:  # a stage record's own count (see MemoryLedger.snapshot)
            by_tag["staging"] = staging
        return {"used": total - free, "total": total, "by_tag": by_tag}

    def observe(self) -> None:
        # What the trainer's allocator cache, NCCL buffers and both contexts
        # hold grows after start-up: budget checks must see it, or a wake-up
        # that the ledger allows runs out of real memory.
        free, total = torch.cuda.mem_get_info()
        accounted = self.used_bytes - self.reserved_bytes
        self.reserved_bytes = max(0, min(total - 1, (total - free) - accounted))


def cuda_ledger(*, accounted_bytes: int = 0, device_name: str | None = None,
                device_index: int | None = None) -> CudaLedger:
    """A ledger for the whole GPU.

    R (reserved) is what is in use now less ``accounted_bytes``, the resident
    regions the scheduler will register (the engine's weights and KV pool):
    CUDA contexts of both processes, communicator buffers, allocator caches.
    """
    free, total = torch.cuda.mem_get_info(device_index)
    return CudaLedger(total_bytes=total, reserved_bytes=max(0, total - free - accounted_bytes),
                      device_kind="cuda", device_name=device_name or torch.cuda.get_device_name(device_index),
                      device_index=device_index)
