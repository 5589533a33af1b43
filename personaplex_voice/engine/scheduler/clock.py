"""Where the scheduler gets its time: the monotonic clock in production, a fake one in tests
(tests/support_scheduler.py), so a policy's timing is tested without sleeping."""

from __future__ import annotations

import threading
import time
from typing import Protocol


class Clock(Protocol):
    """Where the scheduler gets its time and how it waits."""

    def now(self) -> float:
        """Seconds on a monotonic clock (deadlines, ticket expiry, idleness)."""

    def elapsed(self) -> float:
        """A high-resolution clock for durations (engine steps, prefill chunks)."""

    def wait(self, cond: threading.Condition, timeout: float | None) -> None:
        """Wait on `cond` (held by the caller) until notified or `timeout` seconds pass."""


class MonotonicClock:
    def now(self) -> float:
        return time.monotonic()

    def elapsed(self) -> float:
        return time.perf_counter()

    def wait(self, cond: threading.Condition, timeout: float | None) -> None:
        cond.wait(timeout)
