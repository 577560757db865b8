import pytest

from colo.core.memory import MemoryLedger, OutOfMemory, TagStateError


def ledger(total=1000):
    m = MemoryLedger(total_bytes=total, reserved_bytes=50)
    m.register("engine", "weights", 200)
    m.register("engine", "kv_cache", 500)
    m.register("trainer", "weights", 200, resident=False, host_copy=True)
    return m


def test_bytes_are_counted_by_tag_and_reserve():
    m = ledger()
    assert m.used_bytes == 750 and m.free_bytes == 250
    assert m.by_tag() == {"engine.weights": 200, "engine.kv_cache": 500, "trainer.weights": 0, "staging": 0}
    m.pause("engine.kv_cache")
    assert m.used_bytes == 250 and m.by_tag()["engine.kv_cache"] == 0
    assert m.peak_bytes == 750


def test_double_pause_and_double_resume_are_refused_and_change_nothing():
    m = ledger()
    with pytest.raises(TagStateError, match="cannot resume engine.weights: it is already resident"):
        m.resume("engine.weights")
    m.pause("engine.weights")
    with pytest.raises(TagStateError, match="cannot pause engine.weights: it is already paused"):
        m.pause("engine.weights")
    assert not m.is_resident("engine.weights") and m.used_bytes == 550


def test_oom_names_phase_tag_asked_and_free_and_changes_nothing():
    m = ledger()
    m.staging = m.staging_budget()
    m.staging.alloc(100)
    with pytest.raises(OutOfMemory) as ei:
        m.resume("trainer.weights", phase="trainer_onload")
    e = ei.value
    assert (e.phase, e.tag, e.requested, e.free, e.total) == ("trainer_onload", "trainer.weights", 200, 150, 1000)
    assert "out of memory in phase trainer_onload: trainer.weights asks 200 B, 150 B free" in str(e)
    assert not m.is_resident("trainer.weights") and m.used_bytes == 850


def test_staging_is_budgeted_and_freed_once():
    m = ledger()
    budget = m.staging_budget()  # every free byte of the device, as plain data
    m.staging = budget
    a = budget.alloc(100)
    budget.alloc(100)
    assert m.staging_bytes == 200 and m.snapshot()["by_tag"]["staging"] == 200
    with pytest.raises(OutOfMemory, match="staging asks 100 B, 50 B free"):
        budget.alloc(100)
    assert budget.free(a) == 100
    with pytest.raises(TagStateError, match="freed twice"):
        budget.free(a)
    assert budget.free_all() == 100 and m.staging_bytes == 0 and budget.peak_bytes == 200
    m.staging = None
    m.note_staging_peak(budget.peak_bytes)
    assert m.peak_bytes >= m.used_bytes + 200


@pytest.mark.parametrize("kw,msg", [
    (dict(total_bytes=0), "total_bytes must be > 0"),
    (dict(total_bytes=10, reserved_bytes=10), "reserved_bytes must be in"),
])
def test_bad_ledger_config(kw, msg):
    with pytest.raises(ValueError, match=msg):
        MemoryLedger(**kw)


def test_unknown_tag_is_refused():
    m = MemoryLedger(total_bytes=10)
    with pytest.raises(ValueError, match="unknown memory tag engine.activations"):
        m.register("engine", "activations", 1)
