"""Waiting on real state with a deadline, never a bare sleep.

Owns :func:`wait_until`: call a probe until it returns something truthy or the deadline
passes, then fail with what was being waited for and the last value seen. Used by the
cluster's readiness checks and by integration tests that wait on API state.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

POLL_INTERVAL_S = 0.1


class DeadlineExceededError(TimeoutError):
    """The awaited state did not arrive in time."""


def wait_until(
    probe: Callable[[], T],
    timeout_s: float,
    waiting_for: str,
    *,
    interval_s: float = POLL_INTERVAL_S,
    describe_last: Callable[[], str] | None = None,
) -> T:
    """Return ``probe()``'s first truthy value; raise :class:`DeadlineExceededError` when
    ``timeout_s`` passes first. ``probe`` may raise to abort the wait (a crashed process).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() >= deadline:
            detail = describe_last() if describe_last else f"last value: {value!r}"
            raise DeadlineExceededError(
                f"timed out after {timeout_s:.0f} s waiting for {waiting_for} ({detail})"
            )
        time.sleep(interval_s)
