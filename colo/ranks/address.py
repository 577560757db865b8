"""The Ray cluster a run is told to join (``--address``): its form, checked before
``ray.init`` is asked to connect.

Why before: a malformed address ends in Ray's own ValueError traceback, or is taken for a
host name ray.init then waits on. This module imports neither Ray nor torch: the command
line's config checks the form with it.
"""

from __future__ import annotations

import re

#: the forms ``ray.init`` takes that need no check here: find a running cluster, or start one
KEYWORDS = ("auto", "local")
#: HOST:PORT, optionally ray:// (Ray client); HOST a name, an IPv4 address or a bracketed IPv6 one
_FORM = re.compile(r"(?P<scheme>ray://)?(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?)"
                   r":(?P<port>[0-9]{1,5})")


def parse_address(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of a ``[ray://]HOST:PORT`` address, None for ``auto`` and ``local``;
    a ``ValueError`` naming the address for anything else."""
    if address in KEYWORDS:
        return None
    m = _FORM.fullmatch(address) if isinstance(address, str) else None
    if m is None or not 1 <= int(m["port"]) <= 65535:
        raise ValueError(f"--address {address!r} is not a Ray cluster address: expected HOST:PORT (the head "
                         f"node's address, as `ray start --head` prints it), ray://HOST:PORT, auto or local")
    return m["host"].strip("[]"), int(m["port"])


__all__ = ["KEYWORDS", "parse_address"]
