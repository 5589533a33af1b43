"""An asyncio event loop on a virtual clock, for tests of what shares one event loop.

    loop = VirtualLoop()
    loop.run_until_complete(main())     # timers fire in virtual time; no real waiting

Time moves only two ways: when the loop has nothing ready it jumps to its next timer (a real loop
would sleep until then), and when a callback says it worked (`loop.spend(0.012)`: 12 ms of CPU
on the loop's thread, during which every timer that falls due is simply late, as on a real
loop). So "a burst of set-ups costs the loop 700 ms while eight calls talk" runs in a
fraction of a real second and gives the same answer every time, whatever the machine's load.

Nothing here knows what is tested; `loop.time()` is the only clock code under test may read
(`asyncio.sleep`, `call_later` and anything given `now=loop.time`).
"""

from __future__ import annotations

import asyncio
import selectors
from typing import Any


class _JumpingSelector(selectors.DefaultSelector):
    """Polls without blocking; where a real select would wait for the next timer, the virtual
    clock jumps there instead."""

    def __init__(self, loop: VirtualLoop):
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None) -> list[Any]:
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:
            raise RuntimeError("the virtual loop has nothing scheduled and would wait forever")
        self._loop.advance(timeout)
        return ready


class VirtualLoop(asyncio.SelectorEventLoop):
    def __init__(self, start: float = 1000.0):
        self._now = start
        super().__init__(selector=_JumpingSelector(self))

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += max(0.0, seconds)

    def spend(self, seconds: float) -> None:
        """The running callback works `seconds` on the loop's thread."""
        self.advance(seconds)
