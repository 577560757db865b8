"""The one forwarding of an engine's verbs to another process.

:data:`colo.core.interfaces.ENGINE_VERBS` declares every verb a run asks of an engine that
lives in another process (``EngineSide``'s, the probes, the engine's own record of its
weight version), with its arguments and the field its answer travels in. Both sides are
written once, here, from that table:

- :class:`ForwardedEngine` is the asking side: each verb is one ``_forward(verb, **args)``
  of a subclass, its answer decoded. colo's engine client forwards over the engine's
  channel (:class:`colo.engine.reference.client.EngineClient`), a rank's proxy over the
  rank's worker (:class:`colo.ranks.proxy.RemoteEngine`);
- :func:`answer` is the serving side: a declared verb with its declared arguments, called
  on the engine the process holds (a rank's worker), its result encoded as the asking side
  decodes it. colo's engine process answers the same fields itself (``server.py``).

Answers are plain JSON, never a pickle: a rollout as its fields, logits as float32 bytes
(base64 with their shape; formatting the probe's numbers as JSON was half of a probe).
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

from colo.core.interfaces import ENGINE_VERBS, RolloutResult


# -- what crosses --------------------------------------------------------------------------

def rollout_to_json(r: RolloutResult) -> dict:
    d = r.data
    return {"reward": r.reward, "tokens": r.tokens,
            "data": None if d is None else {"prompts": d.prompts, "completions": d.completions, "rewards": d.rewards}}


def rollout_from_json(d: dict) -> RolloutResult:
    from colo.tasks import RolloutData

    data = d.get("data")
    return RolloutResult(reward=float(d["reward"]), tokens=int(d["tokens"]),
                         data=None if data is None else RolloutData(data["prompts"], data["completions"],
                                                                    data["rewards"]))


def encode_f32(values: Any) -> dict:
    """A tensor (or nested lists) of numbers as float32 little-endian bytes, base64, with its shape."""
    import torch

    host = torch.as_tensor(values).detach().float().cpu().contiguous()
    return {"shape": list(host.shape), "f32le": base64.b64encode(host.numpy().astype("<f4").tobytes()).decode()}


def decode_f32(data: str, shape: list[int]) -> Any:
    """The float32 answer (base64 of little-endian bytes) as a tensor of ``shape``; a length
    that does not match the shape is refused, naming both."""
    import numpy as np
    import torch

    raw = base64.b64decode(data, validate=True)
    want = 4 * int(np.prod(shape, dtype=np.int64))
    if len(raw) != want:
        raise ValueError(f"engine answered {len(raw)} bytes of float32 logits for shape {shape} ({want} bytes)")
    return torch.from_numpy(np.frombuffer(raw, dtype="<f4").copy()).reshape(shape)


def encode(verb: str, value: Any) -> dict:
    """``verb``'s result as the fields of an answer."""
    spec = ENGINE_VERBS[verb]
    if spec.reply is None:
        return {}
    if spec.codec == "rollout":
        return {spec.reply: rollout_to_json(value)}
    if spec.codec == "f32":
        return encode_f32(value)
    return {spec.reply: value}


def decode(verb: str, reply: dict) -> Any:
    """``verb``'s result out of the fields of an answer."""
    spec = ENGINE_VERBS[verb]
    if spec.reply is None:
        return None
    if spec.codec == "rollout":
        return rollout_from_json(reply[spec.reply])
    if spec.codec == "f32":
        return decode_f32(reply[spec.reply], reply["shape"]).tolist()
    return reply[spec.reply]


# -- the serving side ----------------------------------------------------------------------

async def answer(engine: Any, verb: str, args: dict) -> dict:
    """Run declared ``verb`` with ``args`` on ``engine`` (in this process); its answer's fields."""
    spec = ENGINE_VERBS.get(verb) if isinstance(verb, str) else None
    if spec is None:
        raise ValueError(f"unknown engine verb {verb!r}; expected one of {', '.join(ENGINE_VERBS)}")
    extra = sorted(set(args) - set(spec.args))
    if extra:
        raise ValueError(f"engine verb {verb} takes {', '.join(spec.args) or 'no arguments'}, "
                         f"not {', '.join(extra)}")
    return encode(verb, await getattr(engine, verb)(**args))


# -- the asking side -----------------------------------------------------------------------

class ForwardedEngine:
    """An engine in another process: every verb of ``ENGINE_VERBS`` one request.

    A subclass gives :meth:`_forward` (one request, its answer's fields) and what it knows
    without asking (``capabilities``, ``tag_bytes``, ``pid``). ``weight_version`` is the
    version this side last told the engine it holds."""

    weight_version: int | None = 0

    async def _forward(self, verb: str, **args: Any) -> dict:
        raise NotImplementedError

    async def _ask(self, verb: str, **args: Any) -> Any:
        return decode(verb, await self._forward(verb, **args))

    # -- EngineSide ----------------------------------------------------------------------
    async def release(self, tags: Sequence[str]) -> None:
        await self._ask("release", tags=list(tags))

    async def resume(self, tags: Sequence[str]) -> None:
        await self._ask("resume", tags=list(tags))

    async def flush_cache(self) -> None:
        await self._ask("flush_cache")

    async def set_weight_version(self, version: int | None) -> None:
        await self._ask("set_weight_version", version=version)
        self.weight_version = version

    async def digest(self, order: Sequence[str] | None = None) -> str:
        """The digest of the weights the engine holds, in ``order`` (HF names) where given, else
        in the order of the spec list it last accepted (the trainer's)."""
        return str(await self._ask("digest", **({} if order is None else {"order": list(order)})))

    async def generate(self, step: int) -> RolloutResult:
        return await self._ask("generate", step=step)

    async def drop_handles(self) -> None:
        await self._ask("drop_handles")

    # -- the verification probes (as ``capabilities.probe`` says) --------------------------
    async def logits(self, tokens: list[list[int]], columns: list[int] | None = None, *,
                     adapter: int | None = None) -> list:
        """``[batch, seq, vocab]`` logits, or only the vocabulary ``columns`` of them (the probe's
        sample: a Qwen2's whole vocabulary is 4.9 M numbers for the probe batch), with LoRA
        adapter version ``adapter`` (None: the base model)."""
        args: dict[str, Any] = {} if columns is None else {"columns": [int(c) for c in columns]}
        if adapter is not None:
            args["adapter"] = int(adapter)
        return await self._ask("logits", tokens=tokens, **args)

    async def logprobs(self, tokens: list[list[int]]) -> list:
        """log p(token i | the tokens before it), i >= 1, per sequence."""
        return await self._ask("logprobs", tokens=tokens)

    # -- lifecycle -----------------------------------------------------------------------
    async def reported_version(self) -> int | None:
        """The weight version the engine itself holds (None: stale)."""
        return await self._ask("reported_version")


__all__ = ["ForwardedEngine", "answer", "decode", "decode_f32", "encode", "encode_f32", "rollout_from_json",
           "rollout_to_json"]
