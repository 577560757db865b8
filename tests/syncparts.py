"""A spy the engine and extractor tests share. (The trainer that is only its extractor
side, once here, is :class:`colo.testing.trainers.StateTrainer`.)"""


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
