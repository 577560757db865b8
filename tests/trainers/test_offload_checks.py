"""A verified offload's checks (the weights' digest, the probe's reference) run beside the pause of
the tags before the weights, which are paused last (issue 44: the probe's forward before that pause
made every verified offload-first offload 57-122 ms longer than a plain pause at Qwen2-1.5B).

The trainer is a real one on the CPU; its memory backend records what it is asked, in order, and
holds the first pause until the checks are done: an offload that ran them after it would hang."""

from __future__ import annotations

import anyio
import pytest

from colo.trainers import build
from colo.trainers.models import demo_config
from tests.conftest import SMALL_CFG
from tests.waits import CEILING_S


class _Backend:
    """Pauses and resumes nothing, says what it was asked; holds the pause of ``hold`` until
    ``released`` is set."""

    def __init__(self, trainer, hold: str):
        self.trainer, self.hold = trainer, hold
        self.calls: list[tuple[str, list[str], bool]] = []
        self.resident_tags = {"weights", "optimizer"}
        self.released = anyio.Event()

    def resident(self, tag: str) -> bool:
        return tag in self.resident_tags

    async def pause(self, owner: str, tags):
        # whether the checks had taken the weights' digest when this pause began
        self.calls.append(("pause", list(tags), self.trainer._offloaded_digest is not None))
        if self.hold in tags:
            with anyio.fail_after(CEILING_S):  # a hang guard: the checks run beside this pause
                await self.released.wait()
        self.resident_tags -= set(tags)

    async def resume(self, owner: str, tags):
        self.calls.append(("resume", list(tags), False))
        self.resident_tags |= set(tags)


@pytest.fixture
def trainer():
    t, _ = build("hf", model_config=demo_config(**SMALL_CFG), seed=0, engine_dtype="float32", device="cpu")
    yield t
    t.close()


def _checks_release(trainer, backend, fail: bool = False):
    """The trainer's checks, which release the held pause once they are done (or fail)."""
    real = trainer._offload_checks

    async def checks(ready=None):
        try:
            if fail:
                raise RuntimeError("the digest failed, injected")
            await real(ready)
        finally:
            backend.released.set()

    trainer._offload_checks = checks


async def test_the_checks_run_beside_the_optimizer_states_pause_and_the_weights_go_last(trainer):
    backend = _Backend(trainer, hold="optimizer")
    trainer._memory_backend = backend
    trainer.probe_tokens = [[1, 2, 3, 4], [5, 6, 7, 8]]
    _checks_release(trainer, backend)
    await trainer.offload(["optimizer", "weights"])
    # the optimizer state's pause began before the digest was taken (beside it); the weights' after
    assert backend.calls == [("pause", ["optimizer"], False), ("pause", ["weights"], True)]
    assert trainer._offloaded_digest == trainer.sent_digest(fresh=True)
    assert trainer._offloaded_logits is not None and tuple(trainer._offloaded_logits.shape[:2]) == (2, 4)


async def test_weights_not_paused_last_keep_the_checks_before_every_pause(trainer):
    backend = _Backend(trainer, hold="none")
    trainer._memory_backend = backend
    await trainer.offload(["weights", "optimizer"])
    assert backend.calls == [("pause", ["weights", "optimizer"], True)]


async def test_failed_checks_bring_back_what_was_paused_beside_them_and_raise_themselves(trainer):
    backend = _Backend(trainer, hold="optimizer")
    trainer._memory_backend = backend
    _checks_release(trainer, backend, fail=True)
    with pytest.raises(RuntimeError, match="the digest failed, injected"):
        await trainer.offload(["optimizer", "weights"])
    # nothing offloaded: the optimizer state resumed, the weights never paused
    assert backend.calls == [("pause", ["optimizer"], False), ("resume", ["optimizer"], False)]
    assert backend.resident_tags == {"weights", "optimizer"}
