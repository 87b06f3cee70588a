"""Polling real state from a test on the event loop: the shared wait with a deadline."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any


async def until(what: str, probe: Callable[[], Any], timeout_s: float = 10.0) -> Any:
    """Polls `probe` on the event loop until it is truthy and returns its value; fails at
    the deadline, naming `what` it waited for."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")
        await asyncio.sleep(0.01)
