"""The event loop's own headroom, measured on the loop: `LoopMonitor`.

A task wakes every `interval_s` and reports to the process's `Headroom` (engine/headroom.py) how
late its timer fired (lag: what every call's pacing timer suffers too) and what share of the
interval the loop's thread spent on the CPU (`time.thread_time`, read on the loop's own thread:
the inference thread and worker threads are not counted). Every `evaluate_every` samples it has
the headroom re-evaluated, so saturation starts and ends with nobody asking.

One per process and loop: the server's lifespan starts it on the loop that serves the calls
(`server/app.py`), an engine worker on its protocol loop (`cluster/worker.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from personaplex_voice.engine.headroom import Headroom

log = logging.getLogger(__name__)

INTERVAL_S = 0.05


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
        then, cpu_then = loop.time(), time.thread_time()
        samples = 0
        while True:
            await asyncio.sleep(interval)
            now, cpu_now = loop.time(), time.thread_time()
            elapsed = now - then
            if elapsed > 0:
                headroom.note_loop(max(0.0, elapsed - interval), (cpu_now - cpu_then) / elapsed)
            then, cpu_then = now, cpu_now
            samples += 1
            if samples % self.evaluate_every == 0:
                try:
                    headroom.evaluate()
                except Exception:  # never let a bug here stop the measuring
                    log.exception("evaluating the headroom failed")
