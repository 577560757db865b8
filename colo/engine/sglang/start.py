"""How a run starts SGLang: the registry's ``sglang`` entry (:data:`colo.engine.ENGINES`).

An in-process ``sglang.Engine`` on a Hugging Face model directory (``build["checkpoint"]``),
TP=1, with its memory saver on (else ``release_memory_occupation`` frees nothing), behind
:class:`~colo.engine.sglang.engine.SglangEngine`; its weights travel through colo's sender
for it, the transport ``sglang``. Written against SGLang 0.5.23 (``colo-rl[sglang]``): the
keywords :func:`engine_kwargs` gives are fields of that release's ``ServerArgs``
(``tests/sglang/`` reads them from its wheel). **Not run against a live SGLang** (it needs
torch 2.14.1 and a CUDA ``sgl_kernel``): see ``docs/sglang.md``.
Importing this module imports no SGLang.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from colo.core.errors import BadInput
from colo.engine.sglang.engine import SGLANG_VERSION


def engine_kwargs(build: dict, *, seed: int = 0, batch: int = 8) -> dict:
    """``sglang.Engine``'s keywords (``ServerArgs`` fields) for ``build``."""
    return {"model_path": build["checkpoint"], "dtype": build["dtype"], "tp_size": 1,
            "mem_fraction_static": float(build["mem_fraction_static"]), "enable_memory_saver": True,
            "skip_tokenizer_init": True, "random_seed": int(seed), "max_running_requests": max(8, int(batch)),
            "log_level": "error"}


def check_version(version: str) -> None:
    """Refuse an SGLang other than the release this adapter was written against, naming both."""
    if str(version) != SGLANG_VERSION:
        raise BadInput(f"SGLang {version} is not supported: colo's SGLang engine is written against "
                       f"{SGLANG_VERSION} (its weight-update requests change between releases); "
                       f"pip install 'colo-rl[sglang]'")


async def start(build: dict, *, task: Any = None, env: Mapping[str, str] | None = None,
                options: Mapping[str, Any] | None = None, seed: int = 0, batch: int = 8) -> Any:
    import anyio.to_thread

    from colo.engine.sglang.engine import SglangEngine
    from colo.models.checkpoint import inspect

    try:
        import sglang
    except ImportError as e:
        raise BadInput(f"SGLang is not installed ({e}); colo's SGLang engine needs it: "
                       f"pip install 'colo-rl[sglang]'") from None
    check_version(getattr(sglang, "__version__", "?"))
    # a directory that is missing, not a Hugging Face checkpoint, or of an architecture colo's
    # table lacks: refused in one line, before SGLang starts
    config = inspect(build["checkpoint"]).config  # config.json as read: what SglangModel checks against
    kwargs = engine_kwargs(build, seed=seed, batch=batch)
    engine = await anyio.to_thread.run_sync(lambda: sglang.Engine(**kwargs))
    try:
        return SglangEngine.attach(engine, config, tp_size=1, dtype=build["dtype"], memory_saver=True, task=task,
                                   owned=True)
    except BaseException:
        engine.shutdown()
        raise


__all__ = ["check_version", "engine_kwargs", "start"]
