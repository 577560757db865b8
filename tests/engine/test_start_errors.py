"""Issue 32, item 5: an engine that cannot start says why. The engine checks the build it
was sent before it builds anything (before memory is allocated, a group joined or a file
read) and answers the client's hello with the reason; the client raises
``EngineRefused`` (exit 2) for a build that is wrong, ``EngineDied`` naming the cause
(exit 1) for a start that failed at run time. Before the fix each of these was "engine
process exited with code 1 while starting"."""

import os

import pytest

from colo.core.errors import EngineDied, EngineRefused, exit_code
from colo.engine.reference.client import EngineClient
from colo.trainers.models import demo_config

from tests.conftest import SMALL_CFG

def _build(tmp_path, **config_overrides):
    config = demo_config(**SMALL_CFG).to_dict()
    config.update(config_overrides)
    return {"config": config, "dtype": "float32", "device": "cpu", "total_bytes": 64 << 20,
            "mem_fraction_static": 0.5, "checkpoint": None, "log_path": str(tmp_path / "engine.log")}


def _ram() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


MALFORMED = [
    ("zero heads", dict(config={"num_attention_heads": 0}),
     "num_attention_heads must be a positive integer, got 0"),
    ("kv heads not dividing heads", dict(config={"num_key_value_heads": 3}),
     "num_attention_heads (4) must be a multiple of num_key_value_heads (3)"),
    ("string vocabulary", dict(config={"vocab_size": "many"}), "vocab_size must be a positive integer, got 'many'"),
    ("10^12 vocabulary", dict(config={"vocab_size": 10**12}), "no room for a KV pool"),
    ("negative hidden size", dict(config={"hidden_size": -64}), "hidden_size must be a positive integer, got -64"),
    ("a config that is not a dict", dict(build={"config": [1, 2]}), "config must be a dict"),
    ("a config without its layers", dict(drop="num_hidden_layers"), "config lacks num_hidden_layers"),
    ("an integer engine dtype", dict(build={"dtype": "int8"}), "engine dtype must be a floating point dtype, got int8"),
    ("an unknown dtype", dict(build={"dtype": "float7"}), "dtype 'float7' is not allowed"),
    ("an unknown device", dict(build={"device": "tpu"}), "device must be cpu or cuda[:N], got 'tpu'"),
    ("no threads", dict(build={"threads": 0}), "threads must be a positive integer or None, got 0"),
    ("a fraction above 1", dict(build={"mem_fraction_static": 1.5}), "mem_fraction_static must be in (0, 1], got 1.5"),
    ("a string device size", dict(build={"total_bytes": "64M"}), "total_bytes must be a positive integer, got '64M'"),
    ("a device larger than this machine's memory", dict(build={"total_bytes": 1 << 50}),
     "more than this machine's"),
    ("a TP size that does not divide the heads",
     dict(build={"tp": {"rank": 0, "size": 3, "init_method": "tcp://127.0.0.1:9", "backend": "gloo"}}),
     "tensor-parallel size 3 does not divide num_attention_heads 4"),
]


@pytest.mark.parametrize("what,change,reason", MALFORMED, ids=[m[0] for m in MALFORMED])
async def test_a_malformed_build_is_refused_by_the_engine_naming_the_reason(tmp_path, what, change, reason):
    build = _build(tmp_path, **change.get("config", {}))
    build.update(change.get("build", {}))
    if "drop" in change:
        del build["config"][change["drop"]]
    # the refusal is the engine's own answer, not the start-up's timeout (that would be
    # EngineDied: no hello within start_timeout_s), however long the machine took to get there
    with pytest.raises(EngineRefused) as ei:
        await EngineClient.spawn(build, start_timeout_s=120)
    assert str(ei.value).startswith("engine refused its build: ")
    assert reason in str(ei.value)
    assert "\n" not in str(ei.value)
    assert exit_code(ei.value) == 2
    # the engine said so in its own log too, and nothing of it is left
    assert "engine.build_refused" in (tmp_path / "engine.log").read_text()


async def test_the_refusal_of_a_device_larger_than_memory_names_both_sizes(tmp_path):
    build = _build(tmp_path)
    build["total_bytes"] = 1 << 50
    with pytest.raises(EngineRefused) as ei:
        await EngineClient.spawn(build, start_timeout_s=120)
    gib = _ram() / (1 << 30)
    assert f"this machine's {gib:.1f} GiB of memory" in str(ei.value)
    assert "524288.00 GiB" in str(ei.value)  # half (the fraction) of the 1 PiB device


async def test_a_start_that_fails_at_run_time_is_engine_died_naming_the_cause_exit_1(tmp_path):
    # a disk-transport checkpoint directory without its manifest: a run-time state, not a
    # malformed build (the build is well formed; the directory is not yet committed)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    build = _build(tmp_path)
    build["checkpoint"] = str(ckpt)
    with pytest.raises(EngineDied) as ei:
        await EngineClient.spawn(build, start_timeout_s=120)
    assert not isinstance(ei.value, EngineRefused)
    assert str(ei.value).startswith("engine failed while starting: IncompleteCheckpoint: ")
    assert str(ckpt) in str(ei.value)
    assert exit_code(ei.value) == 1
