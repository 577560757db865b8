"""The one forwarding of engine verbs (:mod:`colo.engine.forward`): every declared verb crosses
and comes back as it left, the serving side takes only what is declared, and neither colo's
engine client nor a rank's proxy forwards a verb of its own."""

from __future__ import annotations

import anyio
import pytest
import torch

from colo.core.interfaces import ENGINE_VERBS, EngineLifecycle, EngineProbe, EngineSide, RolloutResult
from colo.engine.forward import ForwardedEngine, answer
from colo.tasks import RolloutData


class Served:
    """An engine in 'another process': what the serving side calls."""

    def __init__(self):
        self.calls = []
        self.version = 3

    async def release(self, tags):
        self.calls.append(("release", tags))

    async def resume(self, tags):
        self.calls.append(("resume", tags))

    async def flush_cache(self):
        self.calls.append(("flush_cache",))

    async def set_weight_version(self, version):
        self.version = version

    async def digest(self):
        return "ab" * 16

    async def generate(self, step):
        return RolloutResult(0.25, 4, RolloutData([[1, 2]], [[3, 4]], [0.25]))

    async def drop_handles(self):
        self.calls.append(("drop_handles",))

    async def logits(self, tokens, columns=None):
        out = torch.arange(2 * 3 * 5, dtype=torch.float32).reshape(2, 3, 5) / 7
        return out if columns is None else out[..., columns]

    async def logprobs(self, tokens):
        return [[-0.5, -1.25]]

    async def reported_version(self):
        return self.version


class Asking(ForwardedEngine):
    """The asking side, its requests going through JSON and ``answer`` on the served engine."""

    def __init__(self, served):
        self.served = served

    async def _forward(self, verb, **args):
        import json

        reply = await answer(self.served, verb, json.loads(json.dumps(args)))
        return json.loads(json.dumps(reply))  # what crosses is plain JSON


def test_every_declared_verb_crosses_and_comes_back_as_it_left():
    served = Served()
    engine = Asking(served)

    async def main():
        await engine.release(("kv_cache", "weights"))
        await engine.resume(["weights"])
        await engine.flush_cache()
        await engine.drop_handles()
        await engine.set_weight_version(7)
        assert engine.weight_version == 7 and await engine.reported_version() == 7
        assert await engine.digest() == "ab" * 16
        r = await engine.generate(0)
        assert (r.reward, r.tokens, r.data.prompts, r.data.completions) == (0.25, 4, [[1, 2]], [[3, 4]])
        full = await served.logits(None)
        assert await engine.logits([[1, 2, 3]] * 2) == full.tolist()  # float32 bytes: the very numbers
        assert await engine.logits([[1, 2, 3]] * 2, columns=[0, 4]) == full[..., [0, 4]].tolist()
        assert await engine.logprobs([[1, 2, 3]]) == [[-0.5, -1.25]]

    anyio.run(main)
    assert served.calls == [("release", ["kv_cache", "weights"]), ("resume", ["weights"]), ("flush_cache",),
                            ("drop_handles",)]
    assert set(ENGINE_VERBS) == {"release", "resume", "flush_cache", "set_weight_version", "digest", "generate",
                                 "drop_handles", "logits", "logprobs", "reported_version"}


def test_the_serving_side_takes_only_declared_verbs_and_arguments():
    served = Served()
    with pytest.raises(ValueError, match="unknown engine verb 'kill'; expected one of release, resume"):
        anyio.run(lambda: answer(served, "kill", {}))
    with pytest.raises(ValueError, match="engine verb digest takes order, not path"):
        anyio.run(lambda: answer(served, "digest", {"path": "/etc/passwd"}))
    with pytest.raises(ValueError, match="engine verb release takes tags, not force"):
        anyio.run(lambda: answer(served, "release", {"tags": [], "force": True}))


def test_colos_client_and_a_ranks_proxy_forward_no_verb_of_their_own():
    """One forwarding, not two: the verbs are ForwardedEngine's; colo's client keeps only its
    rollout (the task lives on the client's side) and its digest (the load's end may have
    answered it), and the proxy none."""
    from colo.engine.reference.client import EngineClient
    from colo.ranks.proxy import RemoteEngine

    # (colo's client's digest answers from the load's end where it can, else forwards: EngineClient.digest)
    for cls, own in ((EngineClient, {"generate", "digest"}), (RemoteEngine, set())):
        assert issubclass(cls, ForwardedEngine)
        assert {v for v in ENGINE_VERBS if v in vars(cls)} == own, cls
    # and they are what the declared protocols say, lifecycle and probe included
    assert {"release", "resume", "flush_cache", "generate", "digest", "set_weight_version"} <= set(vars(EngineSide))
    assert {"alive", "pid", "kill", "aclose", "reported_version"} <= set(vars(EngineLifecycle))
    assert {"logits", "logprobs"} <= set(vars(EngineProbe))
