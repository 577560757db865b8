"""The parts of colo's vLLM engine that need no vLLM: the supported versions, the
server command, the demo's refusals (tests/vllm/ runs the rest against a real vLLM)."""

from __future__ import annotations

import pytest

from colo.apps.demo_setup import DemoConfig
from colo.core.errors import BadInput
from colo.engine.vllm import EXTENSION, check_version, server_command


@pytest.mark.parametrize("version", ["0.32.0", "0.32.7"])
def test_supported_versions_pass(version):
    check_version(version)


@pytest.mark.parametrize("version", ["0.31.2", "0.33.0", "1.0.0", "nightly"])
def test_a_vllm_outside_the_supported_range_is_refused_naming_both(version):
    with pytest.raises(BadInput, match=rf"{version}.*0\.32\.x"):
        check_version(version)


def test_the_server_command_carries_colos_extension_and_backend():
    cmd = server_command("/models/qwen", port=8000, python="py", skip_tokenizer_init=True, dtype="float32",
                         enforce_eager=False)
    assert cmd[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--worker-extension-cls") + 1] == EXTENSION
    assert cmd[cmd.index("--weight-transfer-config") + 1] == '{"backend": "colo"}'
    assert "--skip-tokenizer-init" in cmd and cmd[cmd.index("--dtype") + 1] == "float32"
    assert "--enforce-eager" not in cmd


@pytest.mark.parametrize("kw, why", [
    (dict(engine_dtype="bfloat16"), "--engine vllm on cpu runs float32 .vLLM's bfloat16 CPU kernels hit an illegal "
                                    "instruction on short prompts., got engine dtype bfloat16"),
    (dict(gpus=2, launcher="ray", engine_layout="tp"), "--engine vllm starts the tp layout under --launcher "
                                                       "process, got --launcher ray"),
    (dict(transport="disk"), "--engine vllm takes its weights through packed or ipc .handles vLLM's worker maps., "
                             "got --transport disk"),
    (dict(fault="kill-engine@sync"), "a fault kill-engine@... with --engine vllm needs --vllm-processes .an "
                                     "in-process vLLM cannot be killed without the trainer."),
    (dict(engine_visible_devices="0"), "--engine-visible-devices sets the environment of an engine in a process "
                                       "of its own; --engine vllm has none"),
    (dict(engine="sglang"), "--engine sglang runs on cuda .SGLang's CPU path needs a CPU build of sgl_kernel"),
    (dict(engine="sglang", device="cuda", transport="packed"), "--engine sglang takes its weights through sglang "
                                                               ".SGLang reads only its own flattened buckets., "
                                                               "got --transport packed"),
    (dict(engine="tgi"), "--engine must be one of colo, vllm, sglang, got 'tgi'"),
    (dict(engine="colo", vllm_processes=True), "--vllm-processes is for --engine vllm, got --engine colo"),
    (dict(engine="colo", transport="sglang"), "--engine colo takes its weights through packed or ipc or broadcast "
                                              "or disk or rdt, got --transport sglang"),
])
def test_the_demo_refuses_what_an_engine_cannot_do_naming_the_flag(kw, why):
    """Each refusal is the engine's registry entry's declared limit, checked once by DemoConfig."""
    with pytest.raises(ValueError, match=why):
        DemoConfig(**{"engine": "vllm", **kw})


def test_vllm_on_n_ranks_is_a_replica_per_rank_in_processes_of_its_own():
    """``--gpus 2 --engine vllm`` is taken (the replicas layout), and a kill fault with it needs no
    --vllm-processes: every engine rank of N runs in processes of its own (its rank_options)."""
    cfg = DemoConfig(engine="vllm", gpus=2, fault="kill-engine@sync")
    assert cfg.engine_entry.layout(cfg.engine_layout) == "replicas" and not cfg.vllm_processes


@pytest.mark.parametrize("kw, why", [
    (dict(engine="vllm", gpus=2, engine_layout="tp", fault="kill-engine@sync"),
     "--engine vllm in the tp layout cannot be killed on its own"),
    (dict(engine="colo", gpus=2, engine_layout="replicas"), "--engine colo takes the layout.s. tp"),
    (dict(engine="vllm", engine_layout="tp"), "--engine-layout says how an engine spans --gpus N ranks"),
])
def test_an_engine_layout_is_checked_against_the_engines_entry(kw, why):
    with pytest.raises(ValueError, match=why):
        DemoConfig(**kw)
    assert DemoConfig(engine="vllm", gpus=2, engine_layout="tp").engine_layout == "tp"


def test_vllm_on_a_cpu_runs_float32_on_a_device_that_holds_its_kv_cache():
    cfg = DemoConfig(engine="vllm")
    assert cfg.engine_dtype == "float32" and cfg.device_mem_gib == 2.0 and cfg.transport == "packed"
    assert DemoConfig().engine_dtype == "float32"  # colo's engine on a CPU too (bfloat16 is slow there)


@pytest.mark.parametrize("hello, why", [
    ({"model_type": "gpt2", "layout_problem": None}, "the model vLLM serves: model_type 'gpt2' is not an "
                                                     "architecture colo supports; supported: qwen2, qwen3, llama"),
    ({"model_type": "llama", "layout_problem": "the checkpoint vLLM loaded is not what colo's llama table gives "
                                               "for its config: missing model.norm.weight"}, "missing model.norm"),
])
def test_a_vllm_whose_model_the_architecture_table_does_not_describe_is_refused(hello, why):
    """What vLLM's worker reports at hello (attach, connect): its model_type and how its
    checkpoint differs from colo's table; the driver refuses either as bad input."""
    from colo.engine.vllm import _check_layout

    with pytest.raises(BadInput, match=why):
        _check_layout(hello)
    _check_layout({"model_type": "qwen3", "layout_problem": None})  # described: accepted
