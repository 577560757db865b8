"""Shared by the transport tests: a trainer that is only its extractor side."""

import torch

from colo.extractors.plain import PlainExtractor


class StateTrainer:
    """A real ``PlainExtractor`` over ``source`` (a state dict or a module), for syncs of
    weights that are not trained: what a transport asks of a trainer, and nothing else."""

    def __init__(self, source, dtype=torch.float32):
        self._extractor = PlainExtractor(source, dtype=dtype)

    def extractor(self):
        return self._extractor


def calls_of(monkeypatch, obj, attr, arg):
    """Spy on ``obj.attr`` (an instance's method, still called): the list of each call's
    positional argument ``arg``, as the calls happen."""
    seen = []
    real = getattr(obj, attr)

    def spy(*args):
        seen.append(args[arg])
        return real(*args)

    monkeypatch.setattr(obj, attr, spy)
    return seen
