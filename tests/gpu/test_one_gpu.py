"""The GPU path: real torch_memory_saver pauses, CUDA IPC keyed by UUID, the demo on CUDA.

Skipped where no GPU exists; they must pass on a GPU machine (see bench/README.md).
"""

import importlib.util
import subprocess
import sys

import pytest
import torch

from colo.core.invariants import InvariantChecker
from colo.trace.writer import read_trace

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytestmark = [pytest.mark.gpu, gpu]

MiB = 1 << 20


def replay_clean(path):
    checker = InvariantChecker()
    events = read_trace(path)
    assert [str(v) for i, e in enumerate(events, 1) for v in checker.feed(e, i)] == []
    return events


def checked_as_planned(events, plan):
    """Every verified sync's digest was checked: under ``sync-first`` against the digest the
    trainer's offload takes, in ``trainer_offload`` after the sync (one ``digest.checked`` per
    sync, of its version), colo's engine digested beside that offload (the sync has no digest,
    the check has the engine's); elsewhere inside the sync."""
    syncs = [e for e in events if e["event"] == "sync.finished"]
    checked = [e for e in events if e["event"] == "digest.checked"]
    deferred = plan == "sync-first"
    assert [s["verify_parts"]["trainer_check_s"] is None for s in syncs] == [deferred] * len(syncs)
    assert [e["weight_version"] for e in checked] == ([s["weight_version"] for s in syncs] if deferred else [])
    assert [s["digest"] is None for s in syncs] == [deferred] * len(syncs)
    assert all(e["digest"] and e["engine_digest_s"] >= 0 for e in checked)


def sync_digests(events):
    """Each sync's engine digest, in order: its own, or where it was taken beside the trainer's
    offload (sync-first), the one its ``digest.checked`` carries."""
    out = []
    for i, e in enumerate(events):
        if e["event"] == "sync.finished":
            if e["digest"] is not None:
                out.append(e["digest"])
                continue
            later = next(x for x in events[i + 1:] if x["event"] == "digest.checked")
            assert later["weight_version"] == e["weight_version"]
            out.append(later["digest"])
    return out


def free_bytes():
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def test_cuda_ipc_handle_names_the_gpu_by_uuid_and_maps_it_back():
    from colo.device.cuda_ipc import export_cuda, gpu_uuid, local_index
    from colo.proc.handles import HandleError

    buf = torch.empty(4096, dtype=torch.uint8, device="cuda")
    h = export_cuda(buf)
    assert h["gpu_uuid"] == gpu_uuid(torch.cuda.current_device())
    assert local_index(h["gpu_uuid"]) == torch.cuda.current_device()
    with pytest.raises(HandleError, match="not visible"):
        local_index("GPU-00000000-0000-0000-0000-000000000000")
    import json
    assert json.loads(json.dumps(h)) == h  # plain JSON: nothing to unpickle


def demo(tmp_path, *args):
    """Run the demo on CUDA in its own process, as a user would; return its trace.

    One trainer per process, as in real deployments: torch_memory_saver keeps
    process-wide state that a second trainer in the same process would inherit."""
    trace = tmp_path / "t.jsonl"
    proc = subprocess.run([sys.executable, "-m", "colo.cli", "demo", "--device", "cuda", "--quiet",
                           "--trace", str(trace), *args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n" + proc.stdout[-3000:] + proc.stderr[-3000:]
    return replay_clean(trace)


@pytest.mark.parametrize("plan", ["offload-first", "sync-first", "single-stage"])
def test_demo_on_cuda_runs_each_plan_with_verified_syncs(plan, tmp_path):
    events = demo(tmp_path, "--plan", plan, "--steps", "2", "--mem-fraction-static", "0.5")
    start = events[0]
    assert start["device"]["kind"] == "cuda" and start["device"]["total_bytes"] == torch.cuda.mem_get_info()[1]
    syncs = [e for e in events if e["event"] == "sync.finished"]
    assert [s["weight_version"] for s in syncs] == [1, 2]
    assert all(s["tensors"] == s["params"] for s in syncs)
    # the engine's KV pool really left the device while the trainer trained
    train = [e for e in events if e["event"] == "phase.entered" and e["to_phase"] == "train"]
    rollout = [e for e in events if e["event"] == "phase.entered" and e["to_phase"] == "rollout"]
    kv = start["tags"]["engine.kv_cache"]["bytes"]
    assert kv > 10 * (1 << 30)
    assert train[0]["mem"]["used"] < rollout[0]["mem"]["used"] - kv + 512 * MiB
    checked_as_planned(events, plan)


@pytest.mark.parametrize("trainer", ["megatron", "fsdp"])
@pytest.mark.parametrize("plan", ["offload-first", "sync-first"])
def test_demo_on_cuda_with_each_framework_trainer_verifies_every_sync(trainer, plan, tmp_path):
    # sync-first packs straight from the trainer's device memory after a step:
    # the allocator then cuts both staging slots from one cached segment
    # found, not imported: megatron.core sets torch_memory_saver's hook mode as it is imported,
    # which fails in a process (this one) whose memory saver another test already started
    if trainer == "megatron" and importlib.util.find_spec("megatron") is None:
        pytest.skip("megatron-core is not installed")
    events = demo(tmp_path, "--trainer", trainer, "--plan", plan, "--steps", "2", "--mem-fraction-static", "0.5")
    syncs = [e for e in events if e["event"] == "sync.finished"]
    assert [s["weight_version"] for s in syncs] == [1, 2] and len(set(sync_digests(events))) == 2
    checked_as_planned(events, plan)
    assert all(s["tensors"] == s["params"] for s in syncs)
    checked_as_planned(events, plan)


def test_engine_with_a_different_cuda_visible_devices_loads_over_ipc(tmp_path):
    # The engine sees the GPU through its UUID, the trainer through its index:
    # handles keyed by index would name the wrong (or no) device.
    from colo.device.cuda_ipc import gpu_uuid

    events = demo(tmp_path, "--steps", "1", "--mem-fraction-static", "0.5",
                  "--engine-visible-devices", "GPU-" + gpu_uuid(torch.cuda.current_device()).removeprefix("GPU-"))
    assert len([e for e in events if e["event"] == "sync.finished"]) == 1


def test_device_memory_does_not_grow_over_fifty_syncs(tmp_path):
    events = demo(tmp_path, "--steps", "50", "--mem-fraction-static", "0.3")
    used = [e["mem"]["used"] for e in events if e["event"] == "phase.finished" and e["phase"] == "sync"]
    assert len(used) == 50
    # after warm-up, the device holds the same at the end of every sync: no
    # leaked staging, no IPC block left uncollected
    assert max(used[5:]) - min(used[5:]) <= 8 * MiB, used


def test_saver_pause_returns_device_memory_and_keeps_a_pinned_backup():
    from colo.device.cuda_memory import Saver

    saver = Saver()
    n = 256 * MiB
    with saver.region("test.weights", cpu_backup=True):
        t = torch.arange(n // 4, dtype=torch.int32, device="cuda")
    before = free_bytes()
    saver.pause("test.weights")
    after = free_bytes()
    assert after - before >= n - 2 * MiB  # the pages really went back to the device
    host = saver.host_view(t)
    assert host.device.type == "cpu" and host.is_pinned()
    assert torch.equal(host[:1000], torch.arange(1000, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="already paused"):
        saver.pause("test.weights")
    saver.resume("test.weights")
    assert free_bytes() <= after - n + 2 * MiB
    assert torch.equal(t[-1000:].cpu(), torch.arange(n // 4 - 1000, n // 4, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="already resident"):
        saver.resume("test.weights")


@pytest.mark.parametrize("transport", ["packed", "ipc", "disk"])
def test_on_cuda_tensors_larger_than_the_bucket_arrive_bit_exact_within_two_buckets(transport, tmp_path):
    # 0.25 MiB buckets: the 1024 x 256 embedding and lm_head (512 KiB in bf16) travel in pieces
    bucket = MiB // 4
    # an fp32 trainer: its bf16 tensors are converted into staging, bucket by bucket (a bf16
    # trainer's hf weights would go in one request out of its own buffer, unbucketed)
    events = demo(tmp_path, "--transport", transport, "--bucket-mib", "0.25", "--steps", "2",
                  "--mem-fraction-static", "0.5", "--trainer-dtype", "float32")
    syncs = [e for e in events if e["event"] == "sync.finished"]
    # every sync verified: the engine's digest equal to the trainer's, all tensors complete
    assert [s["weight_version"] for s in syncs] == [1, 2] and all(s["digest"] for s in syncs)
    assert all(s["tensors"] == s["params"] for s in syncs)
    # the 512 KiB tensors were cut: no bucket carried more than the budget
    assert max(e["bytes"] for e in events if e["event"] == "bucket.finished") <= bucket
    staged = [e["mem"]["by_tag"]["staging"] for e in events if e["event"] == "bucket.finished"]
    assert staged and max(staged) <= 2 * bucket


@pytest.mark.parametrize("plan", ["offload-first", "sync-first"])
def test_demo_on_cuda_in_one_bucket_verifies_every_sync(plan, tmp_path):
    # the whole 5.8 MB model in one bucket: gathered and packed on the event loop,
    # its two staging buffers kept and mapped from sync to sync, the fp32 host backup
    # read by the conversion kernel in place (offload-first); every digest checked
    events = demo(tmp_path, "--plan", plan, "--bucket-mib", "64", "--steps", "4", "--mem-fraction-static", "0.5",
                  "--trainer-dtype", "float32")
    syncs = [e for e in events if e["event"] == "sync.finished"]
    assert [s["weight_version"] for s in syncs] == [1, 2, 3, 4] and len(set(sync_digests(events))) == 4
    checked_as_planned(events, plan)
    assert all(s["buckets"] == 1 and s["tensors"] == s["params"] for s in syncs)


@pytest.mark.parametrize("plan", ["offload-first", "sync-first"])
def test_demo_on_cuda_recovers_a_failed_sync_and_probes_again_against_the_trainers_reference(plan, tmp_path):
    # colo's engine is probed once (its digest is of its live weights) and again after a failure;
    # a sync-first offload takes the probe's reference only for the recovery that follows a failed
    # sync (Scheduler._want_probe_reference): that probe passes against it. In a process of its
    # own, as demo() runs one, for the fault's step, which the command line does not take.
    trace = tmp_path / "t.jsonl"
    code = ("import anyio, sys\n"
            "from colo.apps.demo import DemoConfig, run\n"
            f"cfg = DemoConfig(device='cuda', plan='{plan}', steps=3, fault='raise@sync', fault_step=2, "
            f"trace={str(trace)!r}, mem_fraction_static=0.5)\n"
            "out = anyio.run(lambda: run(cfg, progress=False))\n"
            "sys.exit(1 if out.error else 0)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n" + proc.stdout[-3000:] + proc.stderr[-3000:]
    events = replay_clean(trace)
    assert [(e["phase"], e["step"]) for e in events if e["event"] == "phase.failed"] == [("sync", 2)]
    syncs = [e for e in events if e["event"] == "sync.finished"]
    # the first sync probed, the next did not, the recovery's did
    assert [s["verify_parts"]["probe_s"] is not None for s in syncs] == [True, False, True]
    assert [s["weight_version"] for s in syncs] == [1, 2, 3] and all(sync_digests(events))


def test_zero_copy_conversion_reads_pinned_host_bytes_exactly():
    from colo.device.cuda_memory import Saver
    from colo.device.zero_copy import convert_from_host, device_view

    dev = torch.device("cuda", torch.cuda.current_device())
    saver = Saver()
    with saver.region("test.zero_copy", cpu_backup=True):
        params = [torch.randn(n, device=dev) for n in (3, 1000, 4096 * 33)]
    saver.pause("test.zero_copy")
    try:
        host = [saver.host_view(p) for p in params] + [torch.randn(7, 5).pin_memory()]
        view = device_view(host[1], dev)
        assert view.device == dev and view.data_ptr() == host[1].data_ptr()  # the host bytes, no copy
        out = convert_from_host(host, torch.bfloat16, dev, 16)
        torch.cuda.synchronize()
        for got, want in zip(out, host):
            assert got.device == dev and got.shape == want.shape
            assert torch.equal(got.cpu(), want.to(torch.bfloat16))  # the host's rounding, bit for bit
        # back to back at 16-byte boundaries: one run for the pack
        assert [o.data_ptr() - out[0].data_ptr() for o in out] == [0, 16, 2016, 2016 + 4096 * 33 * 2]
        assert device_view(torch.randn(4), dev) is None  # pageable: not addressable from the GPU
    finally:
        saver.resume("test.zero_copy")


def test_the_same_request_into_the_same_staging_converts_the_new_host_bytes_without_a_lookup(monkeypatch):
    from colo.extractors.plain import PlainExtractor

    dev = torch.device("cuda", torch.cuda.current_device())
    host = {f"w{i}": torch.randn(n).pin_memory() for i, n in enumerate((3, 1000, 4096 * 33))}
    ex = PlainExtractor(host, dtype=torch.bfloat16, device=dev)  # the paused trainer's pinned backup
    staging = torch.empty(sum(t.numel() for t in host.values()), dtype=torch.bfloat16, device=dev)
    into, off = {}, 0
    for name, t in host.items():
        into[name] = staging[off:off + t.numel()]
        off += t.numel()
    names = list(host)
    looked_up = []
    real = ex._convert_batch
    monkeypatch.setattr(ex, "_convert_batch", lambda *a: looked_up.append(1) or real(*a))
    for step in range(3):
        for t in host.values():
            t.mul_(-1.5)  # the next step's weights, in the same pinned backup
        got = dict(ex.extract(names, into))
        torch.cuda.synchronize()
        assert looked_up == [1]  # the first extract only: the later ones repeat its one copy
        for name, t in host.items():
            assert got[name] is into[name]
            assert torch.equal(into[name].cpu(), t.to(torch.bfloat16)), (step, name)
    # staging freed and made again (another bucket size): looked up afresh, into the new views
    del got
    into = {n: torch.empty_like(v) for n, v in into.items()}
    got = dict(ex.extract(names, into))
    torch.cuda.synchronize()
    assert looked_up == [1, 1] and all(got[n] is into[n] for n in names)
    assert all(torch.equal(into[n].cpu(), host[n].to(torch.bfloat16)) for n in names)
