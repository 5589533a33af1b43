"""Small process-level helpers shared by the cluster's processes (no torch, no asyncio)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
from collections import deque
from pathlib import Path

import numpy as np


def host_identity() -> str:
    """Same value in every process of one boot of one machine: lets two peers know that their
    `time.monotonic()` clocks are the same clock (Linux: CLOCK_MONOTONIC is system-wide)."""
    boot = ""
    with contextlib.suppress(OSError):
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return f"{socket.gethostname()}/{boot or os.getpid()}"


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc); 0.0 where it cannot be read."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def die_with_parent(signum: int = signal.SIGTERM) -> None:
    """Ask for `signum` when the process that started us dies (so a supervisor killed with
    SIGKILL leaves no engine worker or front-end behind). Linux: prctl(PR_SET_PDEATHSIG);
    elsewhere a thread watches the parent pid."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            pr_set_pdeathsig = 1
            if libc.prctl(pr_set_pdeathsig, signum, 0, 0, 0) == 0:
                if os.getppid() != parent:  # it died before the call took effect
                    os.kill(os.getpid(), signum)
                return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os.kill(os.getpid(), signum)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


class HopSamples:
    """The last `size` one-way delays of frames crossing a connection (seconds) with when they
    were taken, for p50/p99 over a recent window. Appended from one thread (the event loop that
    receives), read anywhere."""

    def __init__(self, size: int = 20_000):
        self._values: deque[tuple[float, float]] = deque(maxlen=size)

    def add(self, seconds: float) -> None:
        self._values.append((time.monotonic(), seconds))

    def clear(self) -> None:
        self._values.clear()

    def __len__(self) -> int:
        return len(self._values)

    def summary_ms(self, window_s: float = 10.0) -> dict[str, float | int | None]:
        """Count, p50, p99 and max (ms) of the samples of the last `window_s` seconds."""
        since = time.monotonic() - window_s
        values = np.array([v for t, v in list(self._values) if t >= since], np.float64)
        if not len(values):
            return {"count": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}
        p50, p99 = np.percentile(values, [50, 99]) * 1000
        return {
            "count": len(values),
            "p50_ms": round(float(p50), 3),
            "p99_ms": round(float(p99), 3),
            "max_ms": round(float(values.max() * 1000), 3),
        }
