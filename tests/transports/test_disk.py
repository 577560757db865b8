"""The disk transport: a crash never leaves a complete-looking checkpoint; a finished one loads back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

import torch

from colo.core.config import SchedulerConfig
from colo.engine.reference.client import EngineClient
from colo.engine.reference.weights import expected_digest
from colo.core.memory import MemoryLedger
from colo.trainers.models import build_trainer_model, demo_config
from colo.core.phases import Phase
from colo.scheduler import Scheduler
from colo.testing.trainers import StateTrainer
from colo.trace.writer import TraceWriter, read_trace
from colo.transports.base import RequestError, TensorMeta
from colo.transports.disk import (DiskInitInfo, DiskReceiver, DiskRequest, DiskTransport, IncompleteCheckpoint,
                                  latest_checkpoint, list_checkpoints, load_checkpoint, remove_incomplete,
                                  write_shard)

from tests.conftest import SMALL_CFG as CFG
from tests.waits import CEILING_S
from tests.leaks import new_segments

pytestmark = pytest.mark.usefixtures("no_leftover_segments")


#: what the scheduler books for a trainer that only syncs
TAG_BYTES = {"weights": 1 << 20, "optimizer": 2 << 20}


def _build(config, tmp_path, checkpoint=None):
    return {"config": config.to_dict(), "dtype": "float32", "device": "cpu", "total_bytes": 64 << 20,
            "mem_fraction_static": 0.5, "checkpoint": checkpoint, "log_path": str(tmp_path / "engine.log")}


async def test_a_failed_sync_leaves_no_checkpoint_and_a_finished_one_loads_back_to_the_digest(tmp_path):
    config = demo_config(**CFG)
    state = {n: p.detach() for n, p in build_trainer_model(config, seed=5).named_parameters()}
    root = tmp_path / "ckpt"
    trainer = StateTrainer(state, tag_bytes=TAG_BYTES, fail_at=2)
    client = await EngineClient.spawn(_build(config, tmp_path))
    try:
        sched = Scheduler(trainer, client, MemoryLedger(total_bytes=256 << 20), DiskTransport(root=root),
                          trace=TraceWriter(tmp_path / "t.jsonl"), engine_synced=False,
                          config=SchedulerConfig(plan="offload-first", bucket_bytes=16 << 10))
        async with sched:
            for phase in (Phase.ENGINE_RELEASE, Phase.TRAINER_OFFLOAD, Phase.ENGINE_WAKE_WEIGHTS):
                await sched.run_phase(phase)
            with pytest.raises(RuntimeError, match="simulated trainer crash while gathering bucket 2"):
                await sched.run_phase(Phase.SYNC)
            # shards 0 and 1 were written (bucket 1 may or may not have been loaded
            # when bucket 2 failed beside it); the temporary directory went with the failure
            stages = [(e["bucket"], e["stage"]) for e in read_trace(tmp_path / "t.jsonl")
                      if e["event"] == "bucket.finished"]
            assert [b for b, s in stages if s == "pack"] == [0, 1] and (0, "load") in stages
            assert os.listdir(root) == [] and list_checkpoints(root) == []
            trainer.fail_at = None
            await sched.recover()
        done = [e for e in read_trace(tmp_path / "t.jsonl") if e["event"] == "sync.finished"]
        assert len(done) == 1 and done[0]["buckets"] > 2
        digest = done[0]["digest"]
        assert sorted(os.listdir(root)) == ["step-0"] and latest_checkpoint(root) == str(root / "step-0")
        manifest = json.loads((root / "step-0" / "manifest.json").read_text())
        assert (manifest["weight_version"], manifest["tensors"], len(manifest["shards"])) == (
            0, len(state), done[0]["buckets"])
        assert manifest["bytes"] == done[0]["bytes"] == sum(t.numel() * 4 for t in state.values())
        # the checkpoint holds exactly what the engine loaded
        assert expected_digest(load_checkpoint(str(root / "step-0")), config, torch.float32) == digest
    finally:
        await client.aclose()
    # and an engine started from it holds the same weights
    fresh = await EngineClient.spawn(_build(config, tmp_path, checkpoint=str(root / "step-0")))
    try:
        assert fresh.weight_version == 0 and await fresh.digest() == digest
    finally:
        await fresh.aclose()
    assert new_segments() == []


KILLED_WRITER = textwrap.dedent("""
    import os, signal, sys
    import anyio, torch
    import colo.transports.disk as disk
    from colo.extractors.plain import PlainExtractor
    from colo.core.interfaces import SyncContext

    root = sys.argv[1]
    real_write = disk.write_durable

    def dying_write(path, data):
        if path.endswith("shard-00002.safetensors") and "step-1" in os.listdir(root):
            # half of shard 2 reaches the disk, then the process is gone
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.write(fd, data[:len(data) // 2])
            os.fsync(fd)
            os.kill(os.getpid(), signal.SIGKILL)
        real_write(path, data)

    disk.write_durable = dying_write

    class Engine:  # acknowledges every shard; the engine is not what is tested here
        async def preflight(self, specs): pass
        async def transport_init(self, name, info): pass
        async def begin_load(self): pass
        async def end_load(self, flush_cache=False): pass
        async def transport_load(self, name, request, on_sent=None):
            on_sent()
            return {"tensors": len(request["tensors"])}

    class Pool:
        held_bytes = 0
        def alloc(self, n): return 1
        def free(self, sid): pass

    class Trainer:
        def __init__(self, seed):
            g = torch.Generator().manual_seed(seed)
            self.state = {f"w{i}": torch.randn(1000, generator=g) for i in range(8)}
        def extractor(self):
            return PlainExtractor(self.state)

    async def main():
        t = disk.DiskTransport(root=root)
        for version in (1, 2):
            ctx = SyncContext(step=version, weight_version=version, bucket_bytes=8000, source="host",
                              staging=Pool())
            await t.sync(Trainer(version), Engine(), ctx)

    anyio.run(main)
""")


def test_a_writer_killed_mid_shard_leaves_only_an_incomplete_hidden_directory(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    proc = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(root)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == -9, proc.stderr
    names = sorted(os.listdir(root))
    assert len(names) == 2 and names[1] == "step-1" and names[0].startswith(".tmp-")
    tmp = root / names[0]
    # shards 0 and 1 whole, shard 2 cut short, and no manifest: nothing says "complete"
    assert sorted(os.listdir(tmp)) == ["shard-00000.safetensors", "shard-00001.safetensors",
                                       "shard-00002.safetensors"]
    assert (tmp / "shard-00002.safetensors").stat().st_size < (tmp / "shard-00001.safetensors").stat().st_size
    assert list_checkpoints(root) == [(1, str(root / "step-1"))]
    with pytest.raises(IncompleteCheckpoint, match="has no manifest.json: not a complete checkpoint"):
        load_checkpoint(str(tmp))
    # the last complete checkpoint is intact: version 1's tensors, bit for bit
    g = torch.Generator().manual_seed(1)
    want = {f"w{i}": torch.randn(1000, generator=g) for i in range(8)}
    got = load_checkpoint(str(root / "step-1"))
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert remove_incomplete(str(root)) == [names[0]] and os.listdir(root) == ["step-1"]


def test_keep_retires_old_checkpoints_out_of_the_step_namespace(tmp_path):
    import anyio

    from colo.core.interfaces import SyncContext

    class Engine:
        async def preflight(self, specs): pass
        async def transport_init(self, name, info): pass
        async def begin_load(self): pass
        async def end_load(self, flush_cache=False): pass

        async def transport_load(self, name, request, on_sent=None):
            on_sent()
            return {"tensors": len(request["tensors"])}

    class Pool:
        held_bytes = 0
        def alloc(self, n): return 1
        def free(self, sid): pass

    state = {"w": torch.arange(10, dtype=torch.float32)}

    async def main():
        t = DiskTransport(root=tmp_path, keep=2)
        for v in (3, 4, 5, 5):  # the last one re-syncs version 5 (after a recovery)
            ctx = SyncContext(step=v, weight_version=v, bucket_bytes=1 << 20, source="host", staging=Pool(),
                              )
            await t.sync(StateTrainer(state), Engine(), ctx)
        return t.last_checkpoint

    last = anyio.run(main)
    assert sorted(os.listdir(tmp_path)) == ["step-4", "step-5"] and last == str(tmp_path / "step-5")
    assert torch.equal(load_checkpoint(last)["w"], state["w"])


# -- the engine reads only what it was told, from where it was told -------------

def test_disk_receiver_refuses_paths_outside_the_root_and_shards_that_disagree(tmp_path):
    root = tmp_path / "root"
    tmpdir = root / (".tmp-" + "a" * 32)
    tmpdir.mkdir(parents=True)
    write_shard(str(tmpdir / "shard-00000.safetensors"), [("w", torch.ones(4))], bucket=0)
    outside = tmp_path / "evil.safetensors"
    write_shard(str(outside), [("w", torch.ones(4))], bucket=0)
    os.symlink(outside, tmpdir / "shard-00001.safetensors")
    rx = DiskReceiver(DiskInitInfo(str(root)))
    w = TensorMeta("w", (4,), "float32", 0, 16)
    with rx.receive({"file": f"{tmpdir.name}/shard-00000.safetensors", "tensors": [w.to_json()]}) as named:
        assert [(n, t.tolist()) for n, t in named] == [("w", [1.0] * 4)]
    for bad in ("../evil.safetensors", str(outside), f"{tmpdir.name}/../../evil.safetensors",
                "step-1/shard-00000.safetensors", f"{tmpdir.name}/shard-0.bin"):
        with pytest.raises(RequestError, match="is not of the form .tmp-<uuid>/shard-<n>.safetensors"):
            with rx.receive({"file": bad, "tensors": [w.to_json()]}):
                pass
    with pytest.raises(RequestError, match="is not a regular file under the checkpoint root"):
        with rx.receive({"file": f"{tmpdir.name}/shard-00001.safetensors", "tensors": [w.to_json()]}):
            pass
    other = TensorMeta("w", (2, 2), "float32", 0, 16)
    with pytest.raises(RequestError, match=r"w is \(4,\) torch.float32, the request says \(2, 2\) float32"):
        with rx.receive(DiskRequest(f"{tmpdir.name}/shard-00000.safetensors", (other,))):
            pass
    with pytest.raises(RequestError, match="checkpoint root must be an absolute path"):
        DiskInitInfo("relative/root")


# -- issue 32, item 4: a killed run's checkpoint dir is owned like colo's other dirs -------

#: a process that makes its checkpoint dir the way ``colo demo --transport disk`` does (no
#: root given), says where, and holds it until its stdin closes
_HOLDER = """
import sys
from colo.transports import make_transport
t = make_transport("disk")
print(t.root, flush=True)
sys.stdin.read()
"""


def _holder(tmp):
    from tests.proc.test_lifecycle import REPO

    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env=env, text=True)
    return proc, proc.stdout.readline().strip()


def test_a_killed_holders_checkpoint_dir_is_swept_and_a_live_holders_is_not(tmp_path):
    from colo.proc.lifecycle import sweep

    tmp = os.path.realpath(tmp_path)
    killed, dead_root = _holder(tmp)
    live, live_root = _holder(tmp)
    try:
        for root in (dead_root, live_root):
            assert os.path.dirname(root) == tmp and os.path.basename(root).startswith("colo-ckpt-"), root
            assert os.path.isdir(root)
        killed.kill()  # no cleanup runs: the model-sized dir stays, as after a SIGKILL mid-sync
        assert killed.wait(CEILING_S) == -signal.SIGKILL
        assert os.path.isdir(dead_root)
        # the next run's sweep removes the dead holder's dir and nothing else of this test's
        # (what else it removes, dead owners' segments in /dev/shm, is other tests')
        assert [p for p in sweep((tmp,)) if os.path.dirname(p) == tmp] == [dead_root]
        assert not os.path.exists(dead_root) and os.path.isdir(live_root)
        assert live.poll() is None
    finally:
        for p in (killed, live):
            p.stdin.close()
            p.wait(CEILING_S)
    # the live holder, ending normally, removed its own
    assert live.returncode == 0 and os.listdir(tmp) == []


def test_a_disk_demo_sigkilled_mid_sync_leaves_no_checkpoint_dir(tmp_path):
    """The driver, which holds the checkpoint dir, SIGKILLed mid-sync: its orphaned engine,
    last of the run, sweeps it with the run's other dirs."""
    from tests.apps.test_interrupt import _assert_nothing_left, _ours, _start_demo_mid_sync

    tmp = tmp_path / "t"
    tmp.mkdir()
    proc, _, children = _start_demo_mid_sync(tmp, "sync", "--transport", "disk")
    made = [n for n in _ours(tmp) if n.startswith("colo-ckpt-")]
    assert len(made) == 1 and any(n.startswith(".tmp-") for n in os.listdir(tmp / made[0])), made
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL
    _assert_nothing_left(proc, children, tmp)
