"""The Ray cluster a run is told to join (``--address``): its form, and whether anything
answers there, checked before ``ray.init`` is asked to connect.

Why before: ``ray.init(address=...)`` has no time limit of its own. Against a port where no
GCS listens it retries 20 rounds of about 30 s each (seen: ``--address 127.0.0.1:1``
waited ten minutes and more), and a malformed address ends in Ray's own ValueError
traceback. A refused or silent TCP connect names the address in seconds. This module
imports neither Ray nor torch: the command line's config checks the form with it.
"""

from __future__ import annotations

import re
import socket

from colo.core.errors import ClusterUnreachable

#: the forms ``ray.init`` takes that need no check here: find a running cluster, or start one
KEYWORDS = ("auto", "local")
#: HOST:PORT, optionally ray:// (Ray client); HOST a name, an IPv4 address or a bracketed IPv6 one
_FORM = re.compile(r"(?P<scheme>ray://)?(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?)"
                   r":(?P<port>[0-9]{1,5})")
#: how long the TCP connect to the address may take: a host that drops packets is "not there"
CONNECT_TIMEOUT_S = 10.0


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


def check_reachable(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Raise :class:`~colo.core.errors.ClusterUnreachable` naming ``address`` when nothing
    accepts a TCP connection there within ``timeout_s`` (nothing to check for auto, local)."""
    where = parse_address(address)
    if where is None:
        return
    try:
        with socket.create_connection(where, timeout=timeout_s):
            pass
    except TimeoutError:
        raise ClusterUnreachable(f"no Ray cluster at {address}: nothing answered a TCP connect within "
                                 f"{timeout_s:g} s") from None
    except OSError as e:
        raise ClusterUnreachable(f"no Ray cluster at {address}: {e.strerror or e}") from None


__all__ = ["CONNECT_TIMEOUT_S", "KEYWORDS", "check_reachable", "parse_address"]
