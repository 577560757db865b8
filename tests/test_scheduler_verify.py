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


class _DigestAtOffloadTrainer(FakeTrainer):
    """A trainer whose offload takes its weights' digest, as colo's one-process trainers on a GPU do."""

    def digest_at_offload(self) -> bool:
        return True


@pytest.mark.parametrize("plan,trainer_cls,deferred", [("sync-first", _DigestAtOffloadTrainer, True),
                                                       ("offload-first", _DigestAtOffloadTrainer, False),
                                                       ("sync-first", FakeTrainer, False)])
async def test_a_sync_first_sync_is_checked_against_the_digest_the_trainer_offload_takes(
        plan, trainer_cls, deferred, tmp_path):
    """Under ``sync-first`` the trainer offloads right after the sync and takes its digest as it
    does: the engines' digests (taken inside the sync) are compared in ``trainer_offload``, after
    the trainer's offload and before the KV cache returns, instead of the trainer reading every
    weight a second time inside the sync. Elsewhere, or for a trainer that takes no digest as it
    offloads, the check stays inside the sync."""
    trainer = trainer_cls()
    checks: list[tuple] = []

    async def verify(ds):
        # the trainer's offloads so far when its digest was compared
        checks.append((list(ds), [c for c in trainer.calls if c[0] == "offload"]))

    path = tmp_path / "t.jsonl"
    s = Scheduler(trainer, FakeEngine(), MemoryLedger(total_bytes=10_000), FakeTransport(), trace=TraceWriter(path),
                  verify=verify, config=SchedulerConfig(plan=plan, bucket_bytes=50, verify="every"))
    async with s:
        for _ in range(2):
            await s.cycle()
    events = read_trace(path)
    syncs = [e for e in events if e["event"] == "sync.finished"]
    checked = [e for e in events if e["event"] == "digest.checked"]
    assert len(syncs) == len(checks) == 2
    assert all(d == [e["digest"]] for (d, _), e in zip(checks, syncs))  # the sync's own digests, compared later
    assert [e["verify_parts"]["trainer_check_s"] is None for e in syncs] == [deferred, deferred]
    assert len(checked) == (2 if deferred else 0)
    # cycle i offloads once: sync-first after its sync, offload-first before it; a check inside
    # a sync-first sync comes before that cycle's offload, a deferred one after it
    assert [len(off) for _, off in checks] == ([0, 1] if plan == "sync-first" and not deferred else [1, 2])
    assert all(c[1] == ("optimizer", "weights") for _, off in checks for c in off)
    if deferred:
        # in trainer_offload (after its pause), before engine_wake_kv, of the version the sync moved
        phases = [e for e in events if e["event"] in ("phase.entered", "digest.checked")]
        assert [phases[phases.index(ev) - 1]["to_phase"] for ev in checked] == ["trainer_offload"] * 2
        assert [e["weight_version"] for e in checked] == [e["weight_version"] for e in syncs] == [1, 2]
    checker = InvariantChecker()
    assert [str(v) for i, e in enumerate(events, 1) for v in checker.feed(e, i)] == []
    assert main(["replay", str(path)]) == 0


async def test_a_deferred_digest_mismatch_fails_trainer_offload_and_leaves_the_engine_stale(tmp_path):
    """A ``sync-first`` digest that disagrees with the trainer's offload digest fails
    ``trainer_offload``: every engine rank is marked stale, no KV cache is brought back, the
    trainer's weights are on the host as offloaded; the recovery syncs from there and checks
    inside that sync (the trainer is not resident)."""
    from colo.core.errors import VerificationError

    trainer, engine, bad, seen = _DigestAtOffloadTrainer(), FakeEngine(), [], []

    async def verify(ds):
        seen.append(list(ds))
        if bad:
            bad.clear()
            raise VerificationError("engine rank 0 digest differs from the trainer's, injected")

    path = tmp_path / "t.jsonl"
    s = Scheduler(trainer, engine, MemoryLedger(total_bytes=10_000), FakeTransport(), trace=TraceWriter(path),
                  verify=verify, config=SchedulerConfig(plan="sync-first", bucket_bytes=50, verify="every"))
    async with s:
        await s.cycle()
        bad.append(1)
        with pytest.raises(VerificationError, match="injected"):
            await s.cycle()
        assert s.engine_version is None and engine.version is None and s.stale
        assert s.memory.is_resident("engine.kv_cache") is False
        assert "weights" not in trainer.resident
        await s.recover()
        assert s.engine_version == s.trainer_version == 2 and engine.version == 2
    events = read_trace(path)
    failed = [e for e in events if e["event"] == "phase.failed"]
    assert [(e["phase"], e["error_type"]) for e in failed] == [("trainer_offload", "VerificationError")]
    syncs = [e for e in events if e["event"] == "sync.finished"]
    # the recovery's sync came from the host backup: checked inside it
    assert [e["source"] for e in syncs] == ["device", "device", "host"]
    assert [e["verify_parts"]["trainer_check_s"] is None for e in syncs] == [True, True, False]
    assert len(seen) == 3 and len([e for e in events if e["event"] == "digest.checked"]) == 1
    assert main(["replay", str(path)]) == 0


class _Recording(FakeTrainer):
    """A trainer that notes its offloads and onloads in a shared log, beside the probes."""

    def __init__(self, log):
        super().__init__()
        self.log = log

    async def onload(self, tags):
        self.log.append("onload")
        await super().onload(tags)

    async def offload(self, tags):
        self.log.append("offload")
        await super().offload(tags)


class _KVProbedEngine(FakeEngine):
    """An engine probed through its KV cache, on every verified sync (as vLLM and SGLang declare)."""
    from colo.core.interfaces import EngineCapabilities
    capabilities = EngineCapabilities(probe_needs_kv=True)


@pytest.mark.parametrize("plan", ["offload-first", "sync-first", "single-stage"])
@pytest.mark.parametrize("engine_cls", [FakeEngine, _LiveDigestEngine, _KVProbedEngine])
async def test_the_trainer_takes_the_probes_reference_as_it_offloads_only_where_a_probe_may_read_it(
        plan, engine_cls, tmp_path):
    """Before each offload the scheduler tells the verifier whether the trainer takes the probe's
    reference logits as it goes (``want_reference``, a forward of the probe batch): every probe
    that runs while the trainer is paused found it asked for at the offload before it, and a
    sync-first offload, after the sync probed the resident weights, asks for it only where a
    probe follows (the KV cache's, a recovery's): the trainer took it at every verified offload."""
    from colo.core.errors import VerificationError

    log: list = []
    fail_next = []

    async def verify(ds):
        if fail_next:
            fail_next.clear()
            raise VerificationError("a digest mismatch, injected")

    async def probe():
        log.append("probe")

    probe.want_reference = lambda wanted: log.append(("want", wanted))
    s = Scheduler(_Recording(log), engine_cls(), MemoryLedger(total_bytes=10_000), FakeTransport(),
                  trace=TraceWriter(tmp_path / "t.jsonl"), verify=verify, probe=probe,
                  config=SchedulerConfig(plan=plan, bucket_bytes=50, verify="every"))
    async with s:
        for _ in range(3):
            await s.cycle()
        fail_next.append(1)
        with pytest.raises(VerificationError):
            await s.cycle()
        await s.recover()
        await s.cycle()
    wants = [e[1] for e in log if isinstance(e, tuple)]
    assert log.count("probe") >= 2 and wants  # probes ran, and the scheduler asked before offloads
    # the ask comes right before each offload (and in a recovery's trainer_offload, where the
    # trainer is already paused and does nothing)
    assert all(isinstance(log[i - 1], tuple) for i, e in enumerate(log) if e == "offload")
    # asked for where a probe may come before the trainer's next onload: at a sync-first offload
    # exactly where one does (after the sync probed the resident weights, none does); before an
    # offload-first or single-stage sync, at every verified one (it may fail, and the recovery probes)
    for i, e in enumerate(log):
        if isinstance(e, tuple):
            rest = log[i + 1:]
            until = rest.index("onload") if "onload" in rest else len(rest)
            assert e[1] == (plan != "sync-first" or "probe" in rest[:until]), f"asked {e[1]} at event {i} of {log}"
    if plan == "sync-first" and engine_cls is not _KVProbedEngine:
        assert wants.count(True) == 1  # the recovery's, after the failed sync


class _LiveDigestsBeside(_LiveDigestEngine):
    """An engine of live digests that gives one on its own (colo's engine client: ``live_digest``),
    noting when it was asked; it answers only once the trainer's offload has begun, and the
    trainer's offload ends only once it was asked: taken one after the other, a cycle would hang."""

    def __init__(self, trainer, log):
        super().__init__()
        self.trainer, self.log = trainer, log

    async def digest(self):
        self.log.append("digest")
        return await super().digest()

    async def live_digest(self):
        self.log.append("live_digest")
        self.trainer.asked.set()
        import anyio

        with anyio.fail_after(30):  # a hang guard
            await self.trainer.offloading.wait()
        return await super().digest()


class _OffloadingTrainer(_DigestAtOffloadTrainer):
    def __init__(self, log):
        super().__init__()
        self.log = log

    async def offload(self, tags):
        import anyio

        self.log.append("offload")
        self.offloading.set()
        if "weights" in tags:
            with anyio.fail_after(30):
                await self.asked.wait()
        await super().offload(tags)

    async def onload(self, tags):
        import anyio

        self.offloading, self.asked = anyio.Event(), anyio.Event()
        await super().onload(tags)


@pytest.mark.parametrize("plan", ["sync-first", "offload-first"])
async def test_a_sync_first_syncs_engine_digests_are_taken_beside_the_trainers_offload(plan, tmp_path):
    """An engine whose digest reads its live weights, and which can give it without arming its
    next load (``live_digest``), is digested beside the trainer's offload under ``sync-first``:
    nothing of verification inside the sync (sync.finished carries no digest, ``digest.checked``
    the engine's), the digest taken while the trainer offloads, checked after. A mismatch fails
    ``trainer_offload`` as before. ``offload-first`` digests inside the sync, as before."""
    from colo.core.errors import VerificationError

    log: list = []
    trainer = _OffloadingTrainer(log)
    trainer.offloading = trainer.asked = None
    engine = _LiveDigestsBeside(trainer, log)
    checked, bad = [], []

    async def verify(ds):
        checked.append(list(ds))
        if bad:
            bad.clear()
            raise VerificationError("a digest mismatch, injected")

    path = tmp_path / "t.jsonl"
    s = Scheduler(trainer, engine, MemoryLedger(total_bytes=10_000), FakeTransport(), trace=TraceWriter(path),
                  verify=verify, config=SchedulerConfig(plan=plan, bucket_bytes=50, verify="every"))
    if plan == "offload-first":  # nothing waits beside its offload: the trainer does not wait to be asked
        trainer.offload = lambda tags, t=trainer: FakeTrainer.offload(t, tags)
    async with s:
        for _ in range(2):
            await s.cycle()
        if plan == "sync-first":
            bad.append(1)
            with pytest.raises(VerificationError, match="injected"):
                await s.cycle()
            assert s.engine_version is None and s.stale
            await s.recover()
    events = read_trace(path)
    syncs = [e for e in events if e["event"] == "sync.finished"]
    digests = [e for e in events if e["event"] == "digest.checked"]
    if plan == "offload-first":
        assert log.count("live_digest") == 0 and log.count("digest") == len(syncs) == 2
        assert all(e["digest"] and e["verify_parts"]["engine_digest_s"] is not None for e in syncs) and not digests
        return
    # three syncs from the device, each digested beside its offload; the recovery's from the host, inside it
    assert [e["source"] for e in syncs] == ["device"] * 3 + ["host"]
    assert [e["digest"] is None for e in syncs] == [True, True, True, False]
    assert [e["verify_parts"]["engine_digest_s"] is None for e in syncs] == [True, True, True, False]
    assert log.count("live_digest") == 3 and log.count("digest") == 1
    assert [e["digest"] for e in digests] == [c[0] for c in checked[:2]]  # the third failed: no event
    assert all(e["engine_digest_s"] >= 0 for e in digests)
    failed = [e for e in events if e["event"] == "phase.failed"]
    assert [(e["phase"], e["error_type"]) for e in failed] == [("trainer_offload", "VerificationError")]
    checker = InvariantChecker()
    assert [str(v) for i, e in enumerate(events, 1) for v in checker.feed(e, i)] == []
    assert main(["replay", str(path)]) == 0
