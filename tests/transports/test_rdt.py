"""The ``rdt`` transport's parts that need no Ray cluster: what crosses as JSON, the tensor
transport Ray calls on each end (over a real gloo pair group, in two threads), the engine's
receiver, and its refusals. Whole runs between Ray actors: tests/ranks/test_ray_rdt.py."""

from __future__ import annotations

import datetime
import threading

import anyio
import pytest
import torch

pytest.importorskip("ray", reason="Ray is not installed: pip install -e '.[ray]'")

from colo.core.buckets import plan_buckets  # noqa: E402
from colo.core.errors import EngineDied, RequestError, UsageError  # noqa: E402
from colo.core.interfaces import TensorSpec  # noqa: E402
from colo.transports import launcher_refusal, make_transport  # noqa: E402
from colo.transports import rdt  # noqa: E402
from colo.transports.base import pipeline  # noqa: E402
from colo.transports.broadcast import DistributedInitInfo  # noqa: E402
from colo.transports.pack import pack_into  # noqa: E402
from colo.transports.wire import TensorMeta  # noqa: E402


def _pair(name: str) -> tuple[DistributedInitInfo, threading.Thread]:
    """Pair group ``name``: this process joins as the trainer's end in a thread (call
    ``.join()`` on it once the other end joined too)."""
    store = torch.distributed.TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=30),
                                       wait_for_workers=False)
    info = DistributedInitInfo(master_addr="127.0.0.1", master_port=store.port, world_size=2, backend="gloo",
                               group_name=name, timeout_s=30.0)
    t = threading.Thread(target=rdt._join, args=(info, rdt.TRAINER_RANK, store))
    t.start()
    t.store = store  # the server lives as long as the thread object
    return info, t


def test_init_info_and_request_cross_as_json_and_refuse_what_does_not_fit():
    group = DistributedInitInfo(master_addr="127.0.0.1", master_port=1234, world_size=2, backend="gloo",
                                group_name="colo-rdt-x")
    info = rdt.RdtInitInfo("COLO_GLOO", group)
    assert rdt.RdtInitInfo.from_json(info.to_json()) == info
    assert rdt.RdtInitInfo.from_json({"tensor_transport": "COLO_CUDA_IPC"}).group is None
    with pytest.raises(RequestError, match="COLO_GLOO needs pair group"):
        rdt.RdtInitInfo("COLO_GLOO")
    with pytest.raises(RequestError, match="COLO_CUDA_IPC takes no pair group"):
        rdt.RdtInitInfo("COLO_CUDA_IPC", group)
    with pytest.raises(RequestError, match="tensor_transport must be one of COLO_GLOO, COLO_NCCL, COLO_CUDA_IPC"):
        rdt.RdtInitInfo.from_json({"tensor_transport": "GLOO"})  # Ray's own: not usable beside a trainer's group
    req = rdt.RdtRequest(16, (TensorMeta("w", (2, 2), "float32", 0, 16),))
    assert rdt.RdtRequest.from_json(req.to_json()) == req
    with pytest.raises(RequestError, match="nbytes must be positive"):
        rdt.RdtRequest.from_json({"nbytes": 0, "tensors": []})


def test_the_sender_refuses_outside_a_ray_rank_actor_in_one_line():
    assert launcher_refusal("rdt", "ray") is None and launcher_refusal("packed", None) is None
    assert launcher_refusal("rdt", "process") == rdt.NEEDS == launcher_refusal("rdt", None)
    assert "--launcher ray" in rdt.NEEDS and "\n" not in rdt.NEEDS
    with pytest.raises(ValueError, match="rdt backend must be one of gloo, nccl, cuda_ipc"):
        make_transport("rdt", backend="GLOO")
    sender = make_transport("rdt")

    class NoActor:  # an engine behind a socket: no Ray actor to send to
        ray_actor = None

    with pytest.raises(UsageError) as e:
        anyio.run(sender._ensure_pair, NoActor(), torch.device("cpu"))
    assert str(e.value) == f"{rdt.NEEDS} (this engine is no Ray actor)"


def test_ray_calls_the_pair_transport_on_each_end_and_the_bytes_arrive():
    """What Ray's ``__ray_send__`` and ``__ray_recv__`` call on the two actors' threads,
    here on two threads of one process over a real gloo pair group."""
    store = torch.distributed.TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=30),
                                       wait_for_workers=False)
    info = DistributedInitInfo(master_addr="127.0.0.1", master_port=store.port, world_size=2, backend="gloo",
                               group_name="colo-rdt-unit-pair", timeout_s=30.0)
    ends: dict = {}
    joins = [threading.Thread(target=lambda r=r: ends.update({r: rdt.make_group(info, r, store if r == 0 else None)}))
             for r in (rdt.TRAINER_RANK, rdt.ENGINE_RANK)]
    for t in joins:
        t.start()
    for t in joins:
        t.join(30)
    rdt._groups[info.group_name] = ends[rdt.ENGINE_RANK]  # the engine's end, as its receiver registers it
    manager = rdt.ColoGlooTransport()
    assert manager.tensor_transport_backend() == "COLO_GLOO" and manager.can_abort_transport()
    assert not manager.is_one_sided()
    sent = [torch.arange(1000, dtype=torch.int32).to(torch.uint8)]
    meta = manager.extract_tensor_transport_metadata("obj", sent)
    assert meta.tensor_meta == [(torch.Size([1000]), torch.uint8)] and meta.tensor_device == "cpu"
    got: list = []
    recv = threading.Thread(target=lambda: got.extend(
        manager.recv_multiple_tensors("obj", meta, rdt.PairMetadata(group=info.group_name))))
    recv.start()
    ends[rdt.TRAINER_RANK].send(sent, rdt.ENGINE_RANK, rdt.TAG).wait()  # the sender's end's call
    recv.join(30)
    assert len(got) == 1 and torch.equal(got[0], sent[0])
    # an aborted transfer drops the group: the next send or receive on it fails at once, naming it
    manager.abort_transport("obj", rdt.PairMetadata(group=info.group_name))
    assert info.group_name not in rdt.process_state()["groups"]
    with pytest.raises(RuntimeError, match="pair group colo-rdt-unit-pair is closed"):
        manager.send_multiple_tensors(sent, meta, rdt.PairMetadata(group=info.group_name))


def test_the_receiver_views_the_tensor_ray_delivered_and_refuses_a_request_without_it():
    info, trainer_end = _pair("colo-rdt-unit-receiver")
    receiver = rdt.STRATEGY.create_receiver(rdt.RdtInitInfo("COLO_GLOO", info), device="cpu")
    trainer_end.join()
    try:
        state = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64)}
        specs = [TensorSpec(n, tuple(t.shape), str(t.dtype).removeprefix("torch."), t.nbytes) for n, t in state.items()]
        (bucket,) = plan_buckets(specs, 1 << 20)
        flat = torch.empty(bucket.nbytes, dtype=torch.uint8)
        pack_into(flat, bucket, list(state.items()))
        request = {"nbytes": bucket.nbytes, "tensors": [m.to_json() for m in TensorMeta.of_bucket(bucket)]}
        with pytest.raises(RequestError, match="came without it"):
            with receiver.receive(request):
                pass
        with rdt.arrived([flat.clone()]):
            with receiver.receive(request) as named:
                assert [n for n, _ in named] == ["a", "b"]
                for n, t in named:
                    assert torch.equal(t, state[n])
        with rdt.arrived([flat[:-1].clone()]), pytest.raises(RequestError, match="expected one uint8 tensor"):
            with receiver.receive(request):
                pass
    finally:
        receiver.close()
    assert info.group_name not in rdt.process_state()["groups"]


class _AbortedPair:
    """The sender's pair after Ray aborted its group (a transfer on it failed)."""

    def alive(self) -> bool:
        return False


def _sync_with_the_pair_aborted(handoff_error: BaseException | None) -> None:
    """A pipelined rdt sync of two buckets whose pair Ray aborted during bucket 0's handoff:
    bucket 1's pack finds it aborted first, then bucket 0's handoff ends (``handoff_error``
    raised, or not). The packs and the engine request are doubles; the handoff's wrapper and
    the pair check are the transport's own."""
    t = rdt.RdtTransport()
    t._pair, t._pair_checked = _AbortedPair(), True
    packing = anyio.Event()

    async def handoff_bucket(engine, bucket, slot, ctx):
        await packing.wait()  # bucket 1's pack reached the pair check before this handoff ended
        if handoff_error is not None:
            raise handoff_error

    async def prepare(bucket, slot):
        if bucket == 0:
            t._handoffs[slot] = rdt._Handoff()  # what bucket 0's pack leaves: its handoff pending
        else:
            packing.set()
            await t._sync_pair(torch.device("cpu"), slot)

    t._handoff_bucket = handoff_bucket
    anyio.run(pipeline, [0, 1], prepare, lambda bucket, slot: t._handoff(None, bucket, slot, None))


def test_a_pair_aborted_by_a_failed_handoff_fails_the_sync_with_the_handoffs_error():
    # the engine actor died mid-transfer: Ray aborts the pair, and the next bucket's pack can find
    # it aborted before the handoff's own error arrives; the sync's error is the cause, not the pair
    died = EngineDied("engine actor colo-engine-1 (pid 4242) died during transport_load: ActorDiedError")
    with pytest.raises(EngineDied) as caught:
        _sync_with_the_pair_aborted(died)
    assert caught.value is died
    # a pair aborted while its handoff succeeded: nothing else to blame, the pair is named
    with pytest.raises(RuntimeError, match="pair group was aborted during this sync"):
        _sync_with_the_pair_aborted(None)


@pytest.mark.parametrize("argv", [["demo", "--transport", "rdt"],
                                  ["demo", "--transport", "rdt", "--gpus", "2"],
                                  ["demo", "--transport", "rdt", "--launcher", "ray"]])
def test_the_command_line_refuses_rdt_outside_ray_ranks_in_one_line_before_anything_starts(argv, capsys):
    from colo.cli import main

    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == f"colo demo: {rdt.NEEDS}\n"


def test_colo_bench_refuses_rdt_and_names_the_harness_that_times_it(capsys):
    from colo.cli import main

    assert main(["bench", "--transports", "packed", "rdt"]) == 2
    assert capsys.readouterr().err == ("colo bench: --transports rdt needs --launcher ray, and colo bench starts "
                                       "no ranks: python -m bench.rdt times it beside packed\n")
