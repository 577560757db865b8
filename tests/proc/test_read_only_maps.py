"""Issue 32, item 10: the side that only reads a shared-memory segment (the engine, through
``open_handle``) maps it read-only, so nothing on that side can write the sender's bytes:
a write through the mapping fails (``mmap`` refuses it; a store through the tensor is a
SIGSEGV that ends the process), and the kernel lists the mapping as ``r--s``. Before the
fix the engine mapped every segment read-write (``rw-s``), so a bug in the engine (or
anything in its process) could change the trainer's staging buffers or, through the
one-copy flat buffer, the trainer's own weights.

The creator keeps its read-write mapping: it packs into it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from colo.proc.handles import ShmSegment, open_handle

REPO = Path(__file__).resolve().parents[2]


def _perms(pid: int | str, name: str) -> list[str]:
    """The permissions of every mapping of /dev/shm/``name`` in process ``pid``."""
    with open(f"/proc/{pid}/maps") as f:
        return [line.split()[1] for line in f if line.rstrip().endswith(f"/dev/shm/{name}")]


def _perm_at(pid: int | str, name: str, address: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            if start <= address < end and line.rstrip().endswith(f"/dev/shm/{name}"):
                return line.split()[1]
    raise AssertionError(f"no mapping of {name} at {address:#x}")


def test_an_opened_handle_is_a_read_only_mapping_of_the_senders_bytes():
    seg = ShmSegment.create(1 << 16)
    try:
        seg.tensor[:] = torch.arange(1 << 16, dtype=torch.int64).to(torch.uint8)
        att = open_handle(seg.handle())
        try:
            assert torch.equal(att.tensor, seg.tensor)  # the same bytes
            assert _perm_at("self", seg.name, att.tensor.data_ptr()) == "r--s"
            assert _perm_at("self", seg.name, seg.tensor.data_ptr()) == "rw-s"  # the sender packs into its own
            with pytest.raises(TypeError, match="read-only|readonly"):
                att._mm[0:1] = b"x"
            # the sender's writes are seen through the read-only mapping (it is shared, not a copy)
            seg.tensor[0] = 200
            assert int(att.tensor[0]) == 200
        finally:
            att.close()
    finally:
        seg.close()


_WRITER = r"""
import sys
from colo.proc.handles import open_handle
att = open_handle({"kind": "shm", "name": sys.argv[1], "nbytes": int(sys.argv[2])})
print("mapped", flush=True)
att.tensor[5] = 99  # a store into a PROT_READ page
print("written", flush=True)
"""


def test_a_write_through_the_readers_tensor_fails_and_the_bytes_stay():
    seg = ShmSegment.create(4096)
    try:
        seg.tensor.fill_(7)
        proc = subprocess.run([sys.executable, "-c", _WRITER, seg.name, "4096"], cwd=REPO, capture_output=True,
                              text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert proc.stdout.split() == ["mapped"], proc.stderr[-2000:]
        assert proc.returncode == -signal.SIGSEGV
        assert torch.equal(seg.tensor, torch.full((4096,), 7, dtype=torch.uint8))
    finally:
        seg.close()


def _shm_perms(pid: int) -> list[str]:
    """The permissions of every mapping of a colo segment in process ``pid``."""
    with open(f"/proc/{pid}/maps") as f:
        return [line.split()[1] for line in f if "/dev/shm/colo-" in line]


async def test_the_engine_process_maps_the_senders_staging_read_only(small_engine):
    """A packed sync of several buckets into a real engine process: between two buckets the
    engine still holds the mappings of the buckets it loaded (until the load ends), and in
    its process every one of them is ``r--s``."""
    from colo.core.interfaces import SyncContext
    from colo.core.memory import StagingBudget
    from colo.engine.reference.weights import expected_digest
    from colo.testing.trainers import StateTrainer
    from colo.trainers.models import build_trainer_model
    from colo.transports.packed import PackedTransport

    client, config = small_engine
    trainer = StateTrainer(build_trainer_model(config, seed=3))
    seen: list[list[str]] = []

    class Peek:
        """The engine, looked into after each bucket it loaded but the last."""

        def __getattr__(self, name):
            return getattr(client, name)

        async def transport_load(self, *args, **kwargs):
            reply = await client.transport_load(*args, **kwargs)
            if not kwargs.get("end"):
                seen.append(_shm_perms(client.pid))
            return reply

    transport = PackedTransport()
    try:
        ctx = SyncContext(step=1, weight_version=1, bucket_bytes=64 << 10, source="device",
                          staging=StagingBudget(None))
        result = await transport.sync(trainer, Peek(), ctx)
        assert result.buckets > 2
        assert await client.digest() == expected_digest(trainer.hf_state(), config, torch.float32)
    finally:
        await transport.aclose()
    assert seen and all(perms for perms in seen)
    assert {p for perms in seen for p in perms} == {"r--s"}
