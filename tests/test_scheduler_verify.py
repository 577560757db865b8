"""Verification is its own span and optional per step (issue 18, item 4).

``SchedulerConfig.verify`` (``colo demo --verify every|first|none``) says which
syncs compute the engine's digest and run the verifier; ``sync.finished``
carries ``transfer_s`` and ``verify_s`` (``None`` and no digest where nothing
was verified), and such traces replay clean.
"""

from __future__ import annotations

import pytest

from colo.apps.demo import DemoConfig
from colo.cli import main
from colo.core.config import SchedulerConfig
from colo.core.invariants import InvariantChecker
from colo.core.memory import MemoryLedger
from colo.scheduler import Scheduler
from colo.testing.engines import RecordingEngine
from colo.testing.fakes import FakeEngine, FakeTrainer, FakeTransport
from colo.trace.writer import TraceWriter, read_trace


@pytest.mark.parametrize("policy,verified", [("every", [True, True, True]), ("first", [True, False, False]),
                                             ("none", [False, False, False])])
async def test_the_verify_policy_decides_which_syncs_digest_and_verify(policy, verified, tmp_path):
    engine, calls = RecordingEngine(FakeEngine(), only=("digest",)), []

    async def verify(digests):
        calls.append(list(digests))

    path = tmp_path / "t.jsonl"
    s = Scheduler(FakeTrainer(), engine, MemoryLedger(total_bytes=10_000), FakeTransport(),
                  trace=TraceWriter(path), verify=verify,
                  config=SchedulerConfig(plan="offload-first", bucket_bytes=50, verify=policy))
    async with s:
        for _ in range(3):
            await s.cycle()
    events = read_trace(path)
    syncs = [e for e in events if e["event"] == "sync.finished"]
    assert [e["digest"] is not None for e in syncs] == verified
    assert [e["verify_s"] is not None for e in syncs] == verified
    assert len(engine.calls) == len(calls) == sum(verified)
    for e in syncs:  # the transfer is timed apart from the verification, both inside the sync
        assert 0 <= e["transfer_s"] <= e["duration_s"]
        assert e["verify_s"] is None or e["transfer_s"] + e["verify_s"] <= e["duration_s"] + 1e-6
    assert events[0]["config"]["verify"] == policy
    checker = InvariantChecker()
    assert [str(v) for i, e in enumerate(events, 1) for v in checker.feed(e, i)] == []
    assert main(["replay", str(path)]) == 0


def test_a_verify_policy_other_than_every_first_none_is_refused(tmp_path, capsys):
    with pytest.raises(ValueError, match="verify must be one of every, first, none, got 'sometimes'"):
        SchedulerConfig(verify="sometimes")
    with pytest.raises(ValueError, match="--verify must be one of every, first, none, got 'always'"):
        DemoConfig(verify="always")
    with pytest.raises(ValueError, match="--fault needs --verify every .* got --verify first"):
        DemoConfig(fault="raise@sync", verify="first")
    trace = tmp_path / "t.jsonl"
    with pytest.raises(SystemExit) as e:
        main(["demo", "--quiet", "--trace", str(trace), "--verify", "sometimes"])
    assert e.value.code == 2
    assert "argument --verify: invalid choice: 'sometimes' (choose from 'every', 'first', 'none')" in \
        capsys.readouterr().err
    assert not trace.exists()


class _LiveDigestEngine(FakeEngine):
    """An engine whose digest reads the weights its forward uses (as colo's engine declares)."""
    from colo.core.interfaces import EngineCapabilities
    capabilities = EngineCapabilities(digest_live=True)


@pytest.mark.parametrize("engine_cls,probed,after", [(FakeEngine, [True, True, True, True], [1, 2, 3, 5]),
                                                     (_LiveDigestEngine, [True, False, False, True], [1, 5])])
async def test_an_engine_whose_digest_is_of_its_live_weights_is_probed_once_then_again_after_a_failure(
        engine_cls, probed, after, tmp_path):
    """Every verified sync digests; the logits probe, which checks the engine's layout and
    math, runs on every one for an engine whose digest is of what it received (vLLM, SGLang),
    and for one whose digest reads its own weights on its first verified sync and again on
    the first after a failure (a recovery may bring a new engine)."""
    from colo.core.errors import VerificationError

    probes, digests = [], []
    fail_next = []

    async def verify(ds):
        digests.append(list(ds))
        if fail_next:
            fail_next.clear()
            raise VerificationError("a digest mismatch, injected")

    async def probe():
        probes.append(len(digests))

    path = tmp_path / "t.jsonl"
    s = Scheduler(FakeTrainer(), engine_cls(), MemoryLedger(total_bytes=10_000), FakeTransport(),
                  trace=TraceWriter(path), verify=verify, probe=probe,
                  config=SchedulerConfig(plan="offload-first", bucket_bytes=50, verify="every"))
    async with s:
        for _ in range(3):
            await s.cycle()
        fail_next.append(1)
        with pytest.raises(VerificationError):
            await s.cycle()
        await s.recover()
    syncs = [e for e in read_trace(path) if e["event"] == "sync.finished"]
    assert len(digests) == 5 and len(syncs) == 4  # the failed sync finished no sync
    assert [e["verify_parts"]["probe_s"] is not None for e in syncs] == probed
    assert probes == after  # after which verified sync (the 4th failed its digest check, unprobed)
