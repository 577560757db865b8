import itertools
import re
from pathlib import Path

import pytest

from colo.core.phases import (INITIAL, PLANS, RECOVERY, TRANSITIONS, IllegalTransition, Phase, PhaseMachine,
                         is_legal, mermaid, trigger_for, validate_plan)

P = Phase
LEGAL = {(src, dst) for src, row in TRANSITIONS.items() for dst in row.values()}
EXPECTED_LEGAL = {
    (P.ROLLOUT, P.ENGINE_RELEASE), (P.ENGINE_RELEASE, P.TRAINER_ONLOAD), (P.TRAINER_ONLOAD, P.TRAIN),
    (P.TRAIN, P.TRAINER_OFFLOAD), (P.TRAIN, P.ENGINE_WAKE_WEIGHTS),
    (P.TRAINER_OFFLOAD, P.ENGINE_WAKE_WEIGHTS), (P.TRAINER_OFFLOAD, P.ENGINE_WAKE_KV),
    (P.ENGINE_WAKE_WEIGHTS, P.SYNC), (P.ENGINE_WAKE_WEIGHTS, P.ENGINE_WAKE_KV),
    (P.SYNC, P.ENGINE_WAKE_KV), (P.SYNC, P.TRAINER_OFFLOAD), (P.SYNC, P.ROLLOUT),
    (P.ENGINE_WAKE_KV, P.ROLLOUT), (P.ENGINE_WAKE_KV, P.SYNC),
    # recovery
    (P.FAILED, P.ENGINE_RELEASE), (P.ENGINE_RELEASE, P.TRAINER_OFFLOAD),
} | {(p, P.FAILED) for p in Phase if p is not P.FAILED}


def test_table_is_exactly_the_plans_recovery_and_failure_edges():
    assert LEGAL == EXPECTED_LEGAL


@pytest.mark.parametrize("src,dst", sorted(LEGAL, key=str))
def test_every_legal_transition_is_accepted(src, dst):
    m = PhaseMachine(src)
    assert m.go(dst) is dst
    assert m.phase is dst


ILLEGAL = [(s, d) for s, d in itertools.product([None, *Phase], Phase)
           if not ((s, d) in LEGAL or (s is None and d in INITIAL))]


@pytest.mark.parametrize("src,dst", ILLEGAL, ids=lambda p: str(p))
def test_every_other_pair_is_rejected_and_state_unchanged(src, dst):
    m = PhaseMachine(src)
    trig = trigger_for(src, dst)
    with pytest.raises(IllegalTransition) as ei:
        m.fire(trig, dst)
    assert m.phase is src
    msg = str(ei.value)
    assert str(src or "start") in msg and repr(trig) in msg and str(dst) in msg
    assert not is_legal(src, dst)


def test_a_trigger_that_leads_elsewhere_is_rejected():
    m = PhaseMachine(P.TRAIN)
    with pytest.raises(IllegalTransition, match="trigger 'sync'"):
        m.fire("sync")
    with pytest.raises(IllegalTransition):  # legal trigger, wrong declared target
        m.fire("wake_weights", P.SYNC)
    assert m.phase is P.TRAIN


@pytest.mark.parametrize("name", sorted(PLANS))
def test_named_plans_validate_and_close_their_cycle(name):
    order = validate_plan(name)
    assert order[0] is P.ROLLOUT and len(set(order)) == len(order) == 8
    m = PhaseMachine()
    for _ in range(2):
        for p in order:
            m.go(p)
    assert m.phase is order[-1]


def test_plan_orders_match_the_design():
    assert [p.value for p in PLANS["sync-first"][3:]] == [
        "train", "engine_wake_weights", "sync", "trainer_offload", "engine_wake_kv"]
    assert [p.value for p in PLANS["single-stage"][4:]] == [
        "trainer_offload", "engine_wake_weights", "engine_wake_kv", "sync"]


def test_unknown_or_illegal_plans_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="unknown plan 'fast'.*offload-first"):
        validate_plan("fast")
    with pytest.raises(ValueError, match="train -> rollout is not in the phase table"):
        validate_plan(["rollout", "engine_release", "trainer_onload", "train"])
    # every edge legal, but a walk through recovery edges that is no accepted plan
    walk = ["rollout", "engine_release", "trainer_offload", "engine_wake_weights", "sync"]
    with pytest.raises(ValueError, match="not one of the accepted plans"):
        validate_plan(walk)
    with pytest.raises(ValueError, match="unknown phase 'warmup'"):
        validate_plan(["warmup"])


def test_recovery_path_walks_the_table():
    m = PhaseMachine(P.SYNC)
    m.fire("fail")
    assert m.phase is P.FAILED
    for p in RECOVERY[1:]:
        m.go(p)
    assert m.phase is P.ROLLOUT
    assert trigger_for(P.FAILED, P.ENGINE_RELEASE) == "recover"


def test_readme_diagram_is_generated_from_the_table():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = re.search(r"```mermaid\n(.*?)```", readme, re.S)
    assert block, "README.md has no mermaid block"
    assert block.group(1) == mermaid(), "README diagram is stale: run `python -m tools.readme`"


def test_only_a_plan_whose_sync_is_followed_by_the_weights_offload_can_check_at_the_offload():
    """``offload_follows_sync``: the scheduler's rule and ``colo bench --trainers``'s rows ask
    the same question of a plan (issue 44: a sync-first sync's digests checked against the
    digest the trainer's offload takes). Only ``sync-first`` offloads right after its sync;
    an offload that left the weights resident would take no digest of them."""
    from colo.core.phases import EFFECTS, Effect, effects_for, offload_follows_sync

    weights = effects_for("weights")
    assert {p: offload_follows_sync(validate_plan(p), weights) for p in PLANS} == {
        "offload-first": False, "sync-first": True, "single-stage": False}
    keeps = {**weights, Phase.TRAINER_OFFLOAD: Effect(owner="trainer", verb="offload", pause=("optimizer",))}
    assert EFFECTS[Phase.TRAINER_OFFLOAD].pause != keeps[Phase.TRAINER_OFFLOAD].pause
    assert offload_follows_sync(validate_plan("sync-first"), keeps) is False
