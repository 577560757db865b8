"""``colo demo --lora-rank R`` with colo's own engine (issue 43): only a PEFT adapter trains and
each step's adapter is staged into the engine process, verified (its digest, the engine's
logits with the staged adapter against the trainer's PEFT model, and once per engine the base
weights' digest), then activated. The engine's base weights never move. (vLLM:
tests/vllm/test_lora_demo.py.)"""

from __future__ import annotations

import re
import subprocess

import pytest

pytest.importorskip("peft")

from colo.apps.demo import DemoConfig, run  # noqa: E402
from tests.apps.test_demo import replay_clean  # noqa: E402
from tests.docs.blocks import README_LORA, REPO, command_env, scratch  # noqa: E402
from tests.leaks import named_after  # noqa: E402


def test_thirty_adapter_syncs_into_colos_engine_learn_with_every_one_verified(tmp_path):
    """The README's LoRA command exactly as written (``README_LORA``, as the README's block test
    would run it: in a scratch directory, through bash, the trace at its default path), so the
    block test leaves that line to this test instead of running thirty syncs twice."""
    assert README_LORA in (REPO / "README.md").read_text().splitlines()
    cwd = scratch(tmp_path)
    proc = subprocess.Popen(["bash", "-c", README_LORA], cwd=cwd, env=command_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=1800)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out[-2000:] + err[-3000:]
    m = re.search(r"mean reward: first 5 steps ([0-9.]+), last 5 steps ([0-9.]+) \(chance 0\.125\)", out)
    assert m is not None, out
    first, last = float(m[1]), float(m[2])
    assert last >= first + 0.2, (first, last)  # the margin (0.129 -> 0.693 here, seed 0)
    events = replay_clean(cwd / "traces" / "demo-offload-first.jsonl")  # the default plan's default path
    syncs = [e for e in events if e["event"] == "sync.finished"]
    assert len(syncs) == 30 and len({s["digest"] for s in syncs}) == 30
    # every sync verified: the digest, and the engine's logits with the staged adapter (probed
    # every sync: an adapter's digest is of what arrived, not of what the forward reads)
    assert all(s["target"] == "adapter" and s["verify_parts"]["probe_s"] is not None for s in syncs)
    lora = events[0]["config"]["lora"]
    # one request out of the trainer's own adapter buffer (the packed transport's one-copy sync)
    assert all(s["bytes"] == 4 * lora["adapter_params"] and s["buckets"] == 1 for s in syncs)
    paused = {(e["owner"], e["tag"]) for e in events if e["event"] == "memory.paused"}
    assert ("engine", "kv_cache") in paused and ("engine", "weights") not in paused
    # the run's segments and dirs went with it (bash runs the one command in its own process)
    assert named_after([proc.pid]) == []


async def test_a_killed_engine_is_replaced_from_the_base_which_is_checked_then_the_adapter_restaged(tmp_path):
    """The engine process is killed after the first bucket of a stage: a new one starts from the
    base weights (not empty: an adapter sync brings no base), its base digest is checked at its
    first verified sync, and the recovery stages the adapter as a new version."""
    free = await run(DemoConfig(lora_rank=8, steps=3, bucket_mib=0.1, trace=str(tmp_path / "free.jsonl")),
                     progress=False)
    out = await run(DemoConfig(lora_rank=8, steps=3, bucket_mib=0.1, fault="kill-engine@sync",
                               trace=str(tmp_path / "t.jsonl")), progress=False)
    assert free.error is None and out.error is None, out.error
    [rec] = out.recoveries
    assert rec.engine_replaced and rec.recovered and rec.old_engine_pid != rec.new_engine_pid
    events = replay_clean(out.trace_path)
    digests = {e["weight_version"]: e["digest"] for e in events if e["event"] == "sync.finished"}
    want = {e["weight_version"]: e["digest"] for e in replay_clean(free.trace_path) if e["event"] == "sync.finished"}
    assert digests == want and out.rewards == free.rewards
    names = [e["event"] for e in events]
    assert names.count("adapter.staging") == names.count("adapter.activated") + 1
