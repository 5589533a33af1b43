"""The event loop's own headroom, measured on the loop: `LoopMonitor`.

A task wakes every `interval_s` and reports to the process's `Headroom` (engine/headroom.py) how
late its timer fired (lag: what every call's pacing timer suffers too) and what share of the
interval the loop's thread wanted the CPU: the time it ran, plus (on Linux) the time it waited
for a CPU while runnable (`/proc/thread-self/schedstat`). The second part is what a busy machine
takes from the loop: a loop that runs 50 % of the time and waits 20 % more for its turn has 30 %
left, whatever its own CPU says. Read on the loop's own thread: the inference thread and worker
threads are not counted. Every `evaluate_every` samples it has the headroom re-evaluated, so
saturation starts and ends with nobody asking.

One per process and loop: the server's lifespan starts it on the loop that serves the calls
(`server/app.py`), an engine worker on its protocol loop (`cluster/worker.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time

from personaplex_voice.engine.headroom import Headroom

log = logging.getLogger(__name__)

INTERVAL_S = 0.05
SCHEDSTAT = "/proc/thread-self/schedstat"


class ThreadTime:
    """The calling thread's time on the CPU and waiting for one, in seconds (made on the thread
    it measures). Without Linux's schedstat: its CPU time only."""

    def __init__(self) -> None:
        self._fd: int | None = None
        with contextlib.suppress(OSError):
            self._fd = os.open(SCHEDSTAT, os.O_RDONLY)  # bound to this thread's task

    def read(self) -> tuple[float, float]:
        if self._fd is not None:
            try:
                running, waiting = os.pread(self._fd, 128, 0).split()[:2]
                return int(running) / 1e9, int(waiting) / 1e9
            except (OSError, ValueError):
                self.close()
        return time.thread_time(), 0.0

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


class LoopMonitor:
    def __init__(self, headroom: Headroom, interval_s: float = INTERVAL_S, evaluate_every: int = 5):
        self.headroom = headroom
        self.interval_s = interval_s
        self.evaluate_every = max(1, evaluate_every)
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        """Start sampling on the running loop (idempotent; nothing when the headroom is off)."""
        if self.running or not self.headroom.enabled:
            return
        self._task = asyncio.get_running_loop().create_task(self._run(), name="loop-monitor")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        headroom, interval = self.headroom, self.interval_s
        clock = ThreadTime()
        then = loop.time()
        ran_then, waited_then = clock.read()
        samples = 0
        try:
            while True:
                await asyncio.sleep(interval)
                now = loop.time()
                ran, waited = clock.read()
                elapsed = now - then
                if elapsed > 0:
                    wanted = (ran - ran_then) + (waited - waited_then)
                    headroom.note_loop(max(0.0, elapsed - interval), wanted / elapsed)
                then, ran_then, waited_then = now, ran, waited
                samples += 1
                if samples % self.evaluate_every == 0:
                    try:
                        headroom.evaluate()
                    except Exception:  # never let a bug here stop the measuring
                        log.exception("evaluating the headroom failed")
        finally:
            clock.close()
