"""The engines' registry (:data:`colo.engine.ENGINES`): every entry is whole, its limits are
checked once, and a new engine is one registry line: a toy engine registered from this module
runs ``colo demo`` with every sync verified and its trace replaying clean."""

from __future__ import annotations

import json

import pytest
import torch

from colo.cli import main
from colo.core.interfaces import RolloutResult
from colo.engine import ENGINES, LIFECYCLE, EngineEntry, engine_entry, load
from colo.engine.local import InProcessEngine
from colo.engine.kit import LoadSession

# -- every entry is whole --------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_every_entry_names_what_it_starts_and_what_it_takes(name):
    entry = ENGINES[name]
    assert entry.name == name
    # every "module:function" it names is there (no engine is imported by the registry itself:
    # vLLM's and SGLang's start modules import neither)
    for target in (entry.start, entry.begin, entry.tp_check, entry.shard_digest, entry.fits, *entry.rank_start.values()):
        if target is not None:
            assert callable(load(target)), target
    assert set(entry.lifecycle) <= set(LIFECYCLE)
    assert entry.takes_transports()
    from colo.transports import REGISTRY

    assert set(entry.takes_transports()) <= set(REGISTRY)
    assert entry.spans_ranks == ("tp" in entry.layouts)
    assert (entry.extra is None) == (entry.install_line == "")


def test_the_registry_says_what_each_engine_is():
    colo, vllm, sglang = ENGINES["colo"], ENGINES["vllm"], ENGINES["sglang"]
    assert colo.spans_ranks and colo.layouts == ("tp",) and set(colo.rank_start) == {"process", "ray"}
    # vLLM: a whole vLLM per rank in processes of its own (the default), or one vLLM of TP=N in
    # the ranks' workers; started by the process launcher
    assert vllm.layouts == ("replicas", "tp") and vllm.spans_ranks and set(vllm.rank_start) == {"process", "ray"}
    assert dict(vllm.launcher_layouts) == {"ray": ("replicas",)}
    assert {k: dict(v) for k, v in vllm.rank_options.items()} == {"replicas": {"processes": True},
                                                                   "tp": {"processes": False}}
    assert not sglang.layouts  # one rank, for now
    assert vllm.transports == ("packed", "ipc") and sglang.transports == ("sglang",)
    assert colo.takes_transports() == ("packed", "ipc", "broadcast", "disk", "rdt")  # the kit's receivers (rdt under --launcher ray)
    assert vllm.dtypes["cpu"] == ("float32",) and "cpu" not in sglang.dtypes
    assert (colo.probe, vllm.probe, sglang.probe) == ("logits", "logprobs", "logprobs")
    assert "kill" in vllm.lifecycle and vllm.kill_needs == "processes" and "kill" not in sglang.lifecycle
    assert sglang.install_line == "pip install 'colo-rl[sglang]'"


def test_an_entry_that_is_not_whole_is_refused_naming_the_field():
    base = dict(name="x", title="X", summary="x", start="m:f", dtypes={"cpu": ("float32",)})
    EngineEntry(**base)
    for change, why in [(dict(start="m.f"), "start must be 'module:function'"),
                        (dict(lifecycle=("alive", "reboot")), "unknown lifecycle verb.s. reboot"),
                        (dict(probe="vibes"), "probe must be one of logits, logprobs"),
                        (dict(dtypes={}), "dtypes must name each device"),
                        (dict(layouts=("pipeline",)), "unknown layout.s. pipeline"),
                        (dict(layouts=("tp",)), "a layout of N ranks needs a rank_start"),
                        (dict(kill_needs="processes"), "kill_needs 'processes' is not one of its options"),
                        (dict(rank_options={"processes": True}), "rank_options name layout.s. processes it does "
                                                                  "not take"),
                        (dict(layouts=("tp",), rank_start={"process": "m:f"}, rank_options={"tp": {"processes": True}}),
                         "rank_options processes are not among its options"),
                        (dict(layouts=("tp",), rank_start={"process": "m:f"}, launcher_layouts={"ray": ("tp",)}),
                         "launcher_layouts name a launcher without a rank_start or a layout it does not take: ray: tp"),
                        (dict(starts_from="s3"), "starts_from must be one of state, hf_dir")]:
        with pytest.raises(ValueError, match=why):
            EngineEntry(**{**base, **change})
    with pytest.raises(ValueError, match="unknown engine 'tgi'; expected one of colo, vllm, sglang"):
        engine_entry("tgi")


def test_the_limits_are_checked_once_naming_engine_limit_and_what_is_allowed():
    from colo.trainers.models import demo_model_config

    colo = ENGINES["colo"]
    colo.check(device="cpu", dtype="bfloat16", transport="disk", gpus=2, model_config=demo_model_config("demo"))
    # a TP size the heads cannot be split into: the engine's own check, through its entry
    with pytest.raises(ValueError, match="num_attention_heads"):
        colo.check(device="cpu", gpus=3, model_config=demo_model_config("demo"))
    with pytest.raises(ValueError, match="--engine sglang runs on cuda"):
        ENGINES["sglang"].check(device="cpu")
    with pytest.raises(ValueError, match="--engine sglang cannot be killed on its own"):
        ENGINES["sglang"].check(device="cuda", kill=True)
    with pytest.raises(ValueError, match="--engine sglang runs on one rank: it has no layout of N ranks"):
        ENGINES["sglang"].check(device="cuda", gpus=2)
    # vLLM under Ray: replicas as actors of their own; its tp layout lives in the rank workers
    ENGINES["vllm"].check(device="cpu", gpus=2, launcher="ray")
    with pytest.raises(ValueError, match="--engine vllm starts the tp layout under --launcher process, got --launcher ray"):
        ENGINES["vllm"].check(device="cpu", gpus=2, launcher="ray", layout="tp")
    with pytest.raises(ValueError, match="--engine sglang runs on one rank"):
        ENGINES["sglang"].check(device="cuda", gpus=2, launcher="ray")
    # a kill needs vLLM in processes of its own: on N ranks it always is (its rank_options),
    # on one rank only where --vllm-processes says so
    ENGINES["vllm"].check(device="cpu", gpus=2, kill=True, options={"processes": False})
    with pytest.raises(ValueError, match="needs --vllm-processes"):
        ENGINES["vllm"].check(device="cpu", gpus=1, kill=True, options={"processes": False})
    # in the tp layout vLLM's ranks run in the trainer's processes: no kill, whatever was asked
    with pytest.raises(ValueError, match="--engine vllm in the tp layout cannot be killed on its own"):
        ENGINES["vllm"].check(device="cpu", gpus=2, kill=True, layout="tp", options={"processes": True})
    # a layout the engine does not take, named with the ones it does
    with pytest.raises(ValueError, match="--engine colo takes the layout.s. tp, got --engine-layout replicas"):
        colo.check(device="cpu", gpus=2, layout="replicas")
    # vLLM's TP split: query heads and MLP rows n ways, KV heads n ways or replicated
    from colo.trainers.models import demo_config

    ENGINES["vllm"].check(device="cpu", gpus=2, layout="tp", model_config=demo_config())
    ENGINES["vllm"].check(device="cpu", gpus=4, layout="tp", model_config=demo_config())  # 2 KV heads, replicated
    with pytest.raises(ValueError, match="a vLLM of TP=3 splits num_attention_heads 3 ways: 4 is not a multiple"):
        ENGINES["vllm"].check(device="cpu", gpus=3, layout="tp", model_config=demo_config())
    with pytest.raises(ValueError, match="num_key_value_heads 4 ways or replicates them: 3 is neither"):
        ENGINES["vllm"].check(device="cpu", gpus=4, layout="tp",
                              model_config=demo_config(num_attention_heads=8, num_key_value_heads=3))
    # the replicas layout splits nothing: any number of ranks
    ENGINES["vllm"].check(device="cpu", gpus=3, model_config=demo_config())
    # a LoRA adapter goes only to an engine that stages adapters in memory; on N ranks a whole
    # engine per rank (each stages the whole adapter), started by colo's process launcher
    ENGINES["vllm"].check(device="cpu", lora=True)
    ENGINES["vllm"].check(device="cpu", gpus=2, lora=True)  # replicas, its default layout
    colo.check(device="cpu", lora=True)
    with pytest.raises(ValueError, match="--lora-rank syncs a LoRA adapter into an engine that stages adapters in "
                                         r"memory \(--engine colo or vllm\), got --engine sglang"):
        ENGINES["sglang"].check(device="cuda", lora=True)
    with pytest.raises(ValueError, match="--lora-rank on N ranks stages the whole adapter into a whole engine per "
                                         "rank \\(--engine-layout replicas\\); --engine colo in the tp layout would "
                                         "need each adapter's shard, got --gpus 2"):
        colo.check(device="cpu", gpus=2, lora=True)
    with pytest.raises(ValueError, match="--engine vllm in the tp layout would need each adapter's shard"):
        ENGINES["vllm"].check(device="cpu", gpus=2, layout="tp", lora=True)
    with pytest.raises(ValueError, match="--lora-rank on N ranks starts its ranks under --launcher process so far, "
                                         "got --launcher ray"):
        ENGINES["vllm"].check(device="cpu", gpus=2, launcher="ray", lora=True)


def test_a_missing_engine_is_one_line_with_its_install_line(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "sglang", None)
    assert ENGINES["sglang"].missing() == ("--engine sglang needs SGLang 0.5.23, an optional extra that is not "
                                           "installed: pip install 'colo-rl[sglang]'")
    assert ENGINES["colo"].missing() is None


# -- a new engine is one registry line -------------------------------------------------------

class ModuleSink:
    """The toy engine's parameters: a transformers model's, by HF name (the README's sink)."""

    device = torch.device("cpu")

    def __init__(self, model):
        self.params = dict(model.named_parameters())

    def preflight(self, specs):
        missing = set(self.params) - {s.name for s in specs}
        if missing:
            raise ValueError(f"this sync lacks {sorted(missing)}")

    def begin_load(self):
        self.session = LoadSession({n: tuple(p.shape) for n, p in self.params.items()})

    def load_weights(self, named):
        self.session.check(named)
        with torch.no_grad():
            for name, tensor in named:
                self.params[name].copy_(tensor)
        return sum(self.session.advance(name, tensor) for name, tensor in named)

    def end_load(self):
        return self.session.finish()

    def flush_cache(self):
        pass


#: the probe batches the toy engine answered
PROBED: list[int] = []


class ToyEngine(InProcessEngine):
    """A transformers model in the trainer's process: generation and the logits probe."""

    def __init__(self, model, task):
        self.model, self.task = model, task
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        super().__init__(ModuleSink(model), generate=self._rollout, tag_bytes={"weights": nbytes, "kv_cache": 0})

    async def _rollout(self, step: int) -> RolloutResult:
        from colo.tasks import RolloutData

        t = self.task
        prompts = t.prompts(step)
        torch.manual_seed(t.seed(step))
        with torch.no_grad():
            out = self.model.generate(torch.tensor(prompts), max_new_tokens=t.max_new_tokens,
                                      min_new_tokens=t.max_new_tokens, do_sample=True, pad_token_id=0)
        completions = out[:, len(prompts[0]):].tolist()
        rewards = t.rewards(prompts, completions)
        return RolloutResult(sum(rewards) / len(rewards), sum(map(len, completions)),
                             RolloutData(prompts, completions, rewards))

    async def logits(self, tokens, columns=None):
        PROBED.append(len(tokens))
        with torch.no_grad():
            out = self.model(torch.tensor(tokens)).logits.float()
        return (out if columns is None else out[..., columns]).tolist()


async def start(build, *, task=None, env=None, options=None, seed=0, batch=8):
    """The toy's start (its registry entry's ``start``): a model of the build's config, from
    the trainer's initial state (``starts_from="state"``) or empty."""
    from safetensors.torch import load_file

    from colo.trainers.models import build_trainer_model, config_from_dict

    model = build_trainer_model(config_from_dict(build["config"]), seed=seed + 1)  # not the trainer's weights
    if build.get("checkpoint"):
        model.load_state_dict(load_file(build["checkpoint"]), strict=False)
    return ToyEngine(model.eval(), task)


TOY = EngineEntry(name="toy", title="a toy engine", summary="toy (a transformers model in this process)",
                  start=f"{__name__}:start", starts_from="state", starts_empty=True,
                  lifecycle=("alive", "pid", "aclose", "reported_version"), probe="logits",
                  dtypes={"cpu": ("float32",)}, transports=("packed", "disk"))


def test_a_toy_engine_registered_here_runs_the_demo_with_every_sync_verified(tmp_path, monkeypatch, capsys):
    from colo.offline.replay import replay

    monkeypatch.setitem(ENGINES, "toy", TOY)
    PROBED.clear()
    trace = tmp_path / "toy.jsonl"
    assert main(["demo", "--engine", "toy", "--steps", "2", "--quiet", "--trace", str(trace)]) == 0, \
        capsys.readouterr().err
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    started = events[0]
    assert started["config"]["demo"]["engine"] == "toy" and started["config"]["demo"]["transport"] == "packed"
    assert started["config"]["demo"]["engine_dtype"] == "float32"
    syncs = [e for e in events if e["event"] == "sync.finished"]
    # the engine started from the trainer's initial state (version 0): one sync per cycle, each verified
    assert [s["weight_version"] for s in syncs] == [1, 2]
    assert all(s["verify_s"] is not None and s["digest"] for s in syncs)
    assert len({s["digest"] for s in syncs}) == 2  # every train changed the weights the engine received
    # the probe (the engine's logits against the trainer's on the probe batch) ran with each
    # verified sync, and passed: a mismatch fails the run
    assert len(PROBED) == len(syncs)
    assert len([e for e in events if e["event"] == "rollout.finished"]) == 2
    assert replay([str(trace)]).valid
    # the toy is a choice of the command line only while it is registered
    monkeypatch.delitem(ENGINES, "toy")
    with pytest.raises(SystemExit) as e:
        main(["demo", "--engine", "toy"])
    assert e.value.code == 2
