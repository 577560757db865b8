"""Transfer strategies, one file per transport, chosen by name."""

from __future__ import annotations

import importlib
from typing import Any

#: name -> "module:class"; a transport's module is imported only when chosen.
REGISTRY = {
    "packed": "colo.transports.packed:PackedTransport",
}


def make_transport(name: str, **options: Any) -> Any:
    try:
        target = REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown transport {name!r}; expected one of {', '.join(REGISTRY)}") from None
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)(**options)
