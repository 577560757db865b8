"""The path vLLM's worker extension had before each engine had a folder of its own.

``worker_extension_cls="colo.engine.vllm_worker.ColoWorkerExtension"`` (a saved config, a
server started that way) still names colo's extension: this re-exports
:mod:`colo.engine.vllm.worker`, which registers the backend ``colo`` as it is imported.
New code names ``colo.engine.vllm.EXTENSION``. Like the worker module, this imports vLLM.
"""

from colo.engine.vllm.worker import BACKEND, ColoWeightTransfer, ColoWorkerExtension  # noqa: F401

__all__ = ["BACKEND", "ColoWeightTransfer", "ColoWorkerExtension"]
