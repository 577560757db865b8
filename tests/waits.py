"""How long a test waits for something it is about (a killed process gone, a dir removed):
the waits end when the thing happens, and the ceiling only catches a hang. It is far above
what a busy two-core machine takes (issue 40: a 10 s ceiling for an orphan's clean-up was
missed under load), so no verdict depends on the machine's speed."""

from __future__ import annotations

import time
from collections.abc import Callable

#: seconds: a hang guard, never a measure of speed
CEILING_S = 120.0


def wait_until(done: Callable[[], bool], ceiling_s: float = CEILING_S, poll_s: float = 0.1) -> bool:
    """Poll ``done`` until it is true or the ceiling passes; whether it became true."""
    deadline = time.monotonic() + ceiling_s
    while not done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True
