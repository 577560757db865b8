"""Transfer strategies, one file per transport, chosen by name.

Each module holds its init info, request type, sender, receiver and a
``STRATEGY`` that builds them (see ``colo.transports.base``). ``REGISTRY``
names the sender the scheduler drives; ``STRATEGIES`` is the engine kit's
allow-list: a receiver is built only for a name listed here.

A sender whose receiving half is an engine's own (SGLang reads its flattened buckets
in its own ranks) is registered like any other, beside its engine's folder, and listed
in ``ENGINE_OWN``: no engine kit builds a receiver for it, and only that engine takes it
(its entry's ``transports``, :data:`colo.engine.ENGINES`).
"""

from __future__ import annotations

import importlib
from typing import Any

#: name -> "module:class"; a transport's module is imported only when chosen.
REGISTRY = {
    "packed": "colo.transports.packed:PackedTransport",
    "ipc": "colo.transports.ipc:IpcTransport",
    "broadcast": "colo.transports.broadcast:BroadcastTransport",
    "disk": "colo.transports.disk:DiskTransport",
    "rdt": "colo.transports.rdt:RdtTransport",
    "sglang": "colo.engine.sglang.transport:SglangTransport",
}

#: senders whose receiver is an engine's own, not the engine kit's: transport -> that engine
ENGINE_OWN = {"sglang": "sglang"}

#: name -> "module:attribute" of the strategy (the factory of both halves), for every
#: transport the engine kit receives.
STRATEGIES = {name: target.split(":")[0] + ":STRATEGY" for name, target in REGISTRY.items()
              if name not in ENGINE_OWN}


#: name -> (the launcher its ranks must run under, why), for a transport that needs more of
#: the run than its module: ``rdt`` moves each bucket between a rank's two Ray actors
LAUNCHERS = {"rdt": ("ray", "it hands each bucket from a trainer rank's Ray actor to its engine actor "
                            "through Ray Direct Transport")}


def launcher_refusal(name: str, launcher: str | None) -> str | None:
    """The one line refusing transport ``name`` under ``launcher`` (None: one process, no
    ranks), or None where it may run."""
    need = LAUNCHERS.get(name)
    if need is None or need[0] == launcher:
        return None
    return f"--transport {name} needs --launcher {need[0]} (and --gpus N >= 2): {need[1]}"


def _load(table: dict[str, str], name: str, what: str) -> Any:
    try:
        target = table[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown {what} {name!r}; expected one of {', '.join(table)}") from None
    module, attr = target.split(":")
    return getattr(importlib.import_module(module), attr)


def make_transport(name: str, **options: Any) -> Any:
    """The trainer-side sender of transport ``name`` (what the scheduler drives)."""
    return _load(REGISTRY, name, "transport")(**options)


def get_strategy(name: str) -> Any:
    """The strategy of transport ``name``: ``create_init_info/sender/receiver``, ``request_type``."""
    return _load(STRATEGIES, name, "transport")
