"""What the phone benchmarks share: simulated callers in worker processes, their real-time send
clock, and a server's CPU.

The simulators share the machine with the server they measure, so they run outside its process
(spawned workers, each its own event loop and GIL); each worker gets its share of the calls and
puts its rows on a queue. `bench/twilio_load.py` and `bench/phone_load.py` use this.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

from personaplex_voice.cluster.procs import cpu_seconds

__all__ = ["cpu_seconds", "deal", "paced", "rss_mib", "run_workers"]


def deal(items: Sequence[Any], processes: int) -> list[list[Any]]:
    """`items` dealt round-robin to `processes` workers (empty shares left out)."""
    return [share for share in (list(items[i::processes]) for i in range(processes)) if share]


def run_workers(
    target: Callable[..., None], shares: list[list[Any]], *args: Any, timeout: float
) -> list[dict]:
    """Run `target(*args, share, queue)` in one spawned process per share; each puts one list of
    rows on the queue. Returns every row (a worker that failed puts `[{"error": ...}]`)."""
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, share, results)) for share in shares]
    for proc in procs:
        proc.start()
    rows: list[dict] = []
    try:
        for _ in procs:
            rows += results.get(timeout=timeout)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    return rows


async def paced(
    start: float, period_s: float, stop: Callable[[], bool], count: int | None = None
) -> AsyncIterator[tuple[int, float]]:
    """A simulated caller's send clock: tick n falls `n * period_s` after `start` (monotonic), on
    a fixed grid, so one late send does not shift the rest. Yields (n, seconds the tick came
    late, 0 when on time) until `count` ticks or `stop()`, checked before each tick."""
    n = 0
    while (count is None or n < count) and not stop():
        delay = start + n * period_s - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        yield n, max(0.0, -delay)
        n += 1


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0
