"""How a sync is verified, whatever the engine: the digest and the probe.

After every verified sync the engine reports a digest of exactly the HF-named tensors it
holds (:mod:`colo.digest`), which must equal the trainer's, and answers a fixed probe batch:
colo's engine with logits, vLLM with logprobs, which must match the trainer's own within a
stated tolerance. :func:`make_verifier` gives the scheduler its ``verify`` and ``probe``::

    verify, probe = colo.verifier(trainer, engine, model_config)
    Scheduler(trainer, engine, memory, transport, verify=verify, probe=probe)

A mismatch raises :class:`~colo.core.errors.VerificationError`: the sync fails, the engine
is stale, the trainer's weights are untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from colo.core.errors import VerificationError

#: vLLM's logprobs on the probe batch against the trainer's (both fp32), absolute
LOGPROB_TOLERANCE = 1e-4
#: Largest |engine − trainer| logit difference accepted on the probe batch,
#: relative to the largest trainer logit (bf16 engine against fp32 trainer).
LOGIT_TOLERANCE = 0.03


def probe_batch(vocab_size: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed ^ 0xBEEF)
    return torch.randint(0, vocab_size, (2, 16), generator=g).tolist()


#: vocabulary ids the logits probe compares (with the batch's own tokens): the whole vocabulary of
#: a Qwen2 is 151936 columns, 4.9 M numbers for the probe batch, seconds to carry as JSON
PROBE_COLUMNS = 512


def probe_columns(vocab_size: int, tokens: list[list[int]], seed: int) -> list[int]:
    """The probe batch's own tokens and a seeded sample of the rest of the vocabulary, sorted."""
    g = torch.Generator().manual_seed(seed ^ 0xC01)
    sample = torch.randperm(vocab_size, generator=g)[:PROBE_COLUMNS].tolist()
    return sorted(set(sample) | {t for row in tokens for t in row})


def trainer_digest(trainer: Any, dtype: str, fresh: bool = True) -> str:
    """What every engine must report after a sync of ``trainer``'s weights (:mod:`colo.digest`):
    its HF-named tensors in its spec order, in the engine's dtype, checksummed where they lie.
    Not ``fresh``: the trainer's digest from when it offloaded them, where it has one (the
    verifier's; a check that the weights survived a failure reads them again)."""
    from colo.digest import expected_weights_digest

    if hasattr(trainer, "sent_digest") and getattr(trainer, "engine_dtype", None) == dtype:
        return trainer.sent_digest(fresh=fresh)

    return expected_weights_digest(trainer.hf_state(), [s.name for s in trainer.param_specs()],
                                   getattr(torch, dtype))


async def ask_probe(engine: Any, kind: str, batch: list[list[int]], columns: list[int]) -> Any:
    """The engine's answer to the probe batch, as its probe (``kind``) gives it: logprobs of the
    batch's tokens, or the logits of ``columns``."""
    if kind == "logprobs":
        return await engine.logprobs(batch)
    return await engine.logits(batch, columns=columns)


def check_probe(kind: str, ref: Any, answer: Any, batch: list[list[int]], columns: list[int],
                tolerance: float = LOGIT_TOLERANCE, who: str = "engine") -> None:
    """The engine's answer (:func:`ask_probe`) against the trainer's logits ``ref`` on the batch
    (``[batch, seq, vocab]``): logprobs within :data:`LOGPROB_TOLERANCE`, logits within
    ``tolerance`` of the largest; a ``VerificationError`` naming ``who`` otherwise."""
    ref = torch.as_tensor(ref).float()
    got = torch.tensor(answer)
    if kind == "logprobs":
        logp = torch.log_softmax(ref, dim=-1)
        want = torch.stack([logp[b, torch.arange(len(s) - 1), torch.tensor(s[1:])] for b, s in enumerate(batch)])
        err, bound = float((got - want).abs().max()), LOGPROB_TOLERANCE
    else:
        want = ref[..., columns]
        err, bound = float((got - want).abs().max()), tolerance * float(want.abs().max())
    if not err <= bound:
        raise VerificationError(f"{who} {kind} differ from the trainer's by {err:.4g} on the probe "
                                f"batch (bound {bound:.4g})")


def make_verifier(trainer: Any, engine: Any, model_config: Any, dtype: str | None = None, seed: int = 0,
                  tolerance: float = LOGIT_TOLERANCE) -> tuple[Callable, Callable]:
    """``(verify, probe)`` for the scheduler: ``verify(digests)`` checks each engine rank's
    digest against the trainer's; ``probe()`` the engine's answer to a fixed batch against the
    trainer's own: logits within ``tolerance`` of the largest (colo's bf16 engine), or
    logprobs within :data:`LOGPROB_TOLERANCE` (vLLM, fp32). ``engine`` is the engine or a
    zero-argument callable returning the current one (the demo replaces an engine that died).
    ``dtype``: the engine's, by default the trainer's ``engine_dtype``."""
    if dtype is None:
        dtype = trainer.engine_dtype
    batch = probe_batch(model_config.vocab_size, seed)
    columns = probe_columns(model_config.vocab_size, batch, seed)
    current = engine if callable(engine) else (lambda: engine)
    takes_reference = hasattr(trainer, "probe_logits")
    if takes_reference:
        trainer.probe_tokens = batch  # its reference is then taken as it offloads, on the device

    async def verify(digests: list[str]) -> None:
        want = trainer_digest(trainer, dtype, fresh=False)
        for rank, digest in enumerate(digests):
            if digest != want:
                raise VerificationError(f"engine rank {rank} digest {digest[:16]} != trainer digest {want[:16]} "
                                        "after sync")

    async def probe() -> None:
        eng = current()
        # looked up here, not when the verifier is made: a trainer that only syncs (and is only
        # ever digest-checked) has no logits to offer
        ref = (getattr(trainer, "probe_logits", None) or trainer.logits)(batch)
        answer = await ask_probe(eng, eng.capabilities.probe, batch, columns)
        check_probe(eng.capabilities.probe, ref, answer, batch, columns, tolerance)

    def want_reference(wanted: bool) -> None:
        """Whether the trainer's next offload takes the probe's reference logits (a forward of
        the batch on the device and its logits to the host). The scheduler says so before each
        offload (:meth:`colo.scheduler.Scheduler._want_probe_reference`): only where a probe
        may read them while the weights are paused. Taken at every verified offload, nothing
        read them after a ``sync-first`` sync, whose probe ran on the resident weights."""
        if takes_reference:
            trainer.probe_tokens = batch if wanted else None

    # beside the call, so (verify, probe) stays what make_verifier returns
    probe.want_reference = want_reference  # type: ignore[attr-defined]
    return verify, probe


__all__ = ["LOGIT_TOLERANCE", "LOGPROB_TOLERANCE", "PROBE_COLUMNS", "ask_probe", "check_probe", "make_verifier",
           "probe_batch", "probe_columns", "trainer_digest"]
