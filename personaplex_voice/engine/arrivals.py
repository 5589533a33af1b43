"""Call set-up paced behind the calls in progress: `ArrivalGate`.

One event loop carries every call of a process: each call in progress needs it every 20-40 ms
(its caller's messages read and framed for the engine, its agent's messages paced out), and
each arriving call needs it too, for its set-up (the webhook: signature, persona, reservation,
markup; the stream's start; the session's open; the call's record). Set-up costs the loop far
more than a second of a call does (~10-20 ms against ~10 ms per call-second here), in slices
of a few ms. Run as they come, a burst of arrivals (a campaign, a queue released at once) puts
more work on the loop than a second holds; the backlog is heard by every call in progress at
the same moment: their carriers' buffers of our audio run dry, their callers' audio is framed
too late for the engine's tick.

So set-up work takes turns. A transport awaits `turn()` before each slice of a call's set-up;
the gate grants turns one at a time, each only when

- `spacing_s` has passed since the previous turn (an upper bound on set-up's share of the loop), and
- a probe timer, armed for that moment, fired at most `late_ok_s` late: the loop has no backlog,
  so whatever the calls in progress had due ran first (their timers are due before the probe's,
  or fire in the same iteration, ahead of the turn's own first step, which the next iteration runs).

A loop that is never on time (a machine whose cores are taken by others) still grants a turn
after the head of the line waited `max_defer_s` for one: set-up slows down, never stops.
Steps of calls already admitted (a ticket's stream opening its session) go ahead of new offers;
a new offer that waits longer than `max_wait_s`, or finds `max_waiting` offers ahead of it, is
refused (`SaturatedError`: the carrier's busy answer, a 503) where refusals are on (the
process's saturation policy); a step of an admitted call always waits for its turn.

One gate per process, owned by its `Headroom` (engine/headroom.py) and used on the loop that
carries the calls; the turn's waits show in /metrics (`arrival_wait_seconds`, `arrivals_waiting`).
Time is the loop's (`loop.time()`), so a loop on a virtual clock tests the whole of it exactly.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from personaplex_voice.engine.base import SaturatedError
from personaplex_voice.metrics import Gauge, Histogram

# Seconds an arriving call's set-up step waited for its turn.
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


@dataclass(frozen=True)
class ArrivalConfig:
    """The gate's knobs (seconds)."""

    enabled: bool = True  # False: every turn is granted at once (a non-realtime host)
    # Between two turns at least: a set-up slice of a few ms then leaves the loop this long for
    # the calls in progress (at most ~250 set-up slices a second, whatever the loop's state).
    spacing_s: float = 0.004
    # A probe that fires at most this late says the loop is on time: a quarter of what a phone
    # call's playout rides out (its 40 ms cushion), well above uvloop's 1 ms timer resolution and
    # a busy machine's scheduling noise (a turn is one slice anyway: the loop runs whatever else
    # is due between two).
    late_ok_s: float = 0.010
    retry_s: float = 0.002  # after a late probe, look again this soon
    max_defer_s: float = 0.05  # the head of the line waits for an on-time loop at most this long
    max_wait_s: float = 4.0  # a new offer waiting longer than this is refused (refusals on)
    max_waiting: int = 256  # new offers beyond this many waiting are refused at once

    def __post_init__(self) -> None:
        if min(self.spacing_s, self.late_ok_s, self.retry_s, self.max_defer_s, self.max_wait_s) < 0:
            raise ValueError("the arrival gate's times must be >= 0")
        if self.max_waiting < 1:
            raise ValueError("max_waiting must be >= 1")


@dataclass(eq=False)  # one waiter is itself only (the lines remove it by identity)
class _Waiter:
    future: asyncio.Future[None]
    since: float
    offer: bool
    expiry: asyncio.TimerHandle | None = None
    granted: bool = False


class ArrivalGate:
    """Turns for set-up work on one event loop (see the module docstring).

    `refusing()` says whether new offers may be refused for waiting too long (the process's
    saturation policy is on); `wait` and `waiting` are the /metrics instruments it reports to.
    """

    def __init__(
        self,
        config: ArrivalConfig | None = None,
        *,
        refusing: Callable[[], bool] = lambda: True,
        wait: Histogram | None = None,
        waiting: Gauge | None = None,
        retry_after_s: float = 5.0,
    ):
        self.config = config if config is not None else ArrivalConfig()
        self._refusing = refusing
        self._wait = wait
        self._waiting_gauge = waiting
        self.retry_after_s = retry_after_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._admitted: deque[_Waiter] = deque()  # steps of calls already admitted: first
        self._offers: deque[_Waiter] = deque()  # new calls
        self._probe: asyncio.TimerHandle | None = None
        self._last_grant = -math.inf
        self.granted = 0
        self.refused = 0
        self.deferred = 0  # probes that found the loop late
        self.max_wait_s = 0.0  # the longest a granted turn waited

    @property
    def waiting(self) -> int:
        return len(self._admitted) + len(self._offers)

    async def turn(self, *, offer: bool = False) -> None:
        """Wait for one slice of set-up work's turn on the running loop. `offer`: a new call
        (behind every admitted call's step; refused with `SaturatedError` when it waits too
        long or too many wait, while refusals are on). Cancellation leaves the line cleanly."""
        config = self.config
        if not config.enabled:
            return
        loop = asyncio.get_running_loop()
        self._bind(loop)
        if offer and len(self._offers) >= config.max_waiting:
            self.refused += 1
            raise self._refusal(f"{len(self._offers)} calls are already waiting to be set up")
        waiter = _Waiter(loop.create_future(), loop.time(), offer)
        (self._offers if offer else self._admitted).append(waiter)
        if offer and self._refusing():
            waiter.expiry = loop.call_later(config.max_wait_s, self._expire, waiter)
        self._publish()
        self._arm(loop)
        try:
            await waiter.future
        finally:
            if waiter.expiry is not None:
                waiter.expiry.cancel()
            if not waiter.granted:  # cancelled or refused while waiting: out of the line
                self._forget(waiter)

    # ---- internals (all on the bound loop) ----------------------------------------------------

    def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """The gate serves the loop it is used on; a new loop (the old one closed: tests, a
        restarted server) starts a fresh line."""
        if self._loop is loop:
            return
        if self._probe is not None:
            self._probe.cancel()
        self._loop, self._probe = loop, None
        self._admitted.clear()
        self._offers.clear()
        self._last_grant = -math.inf

    def _head(self) -> _Waiter | None:
        for line in (self._admitted, self._offers):
            while line and line[0].future.done():
                line.popleft()
            if line:
                return line[0]
        return None

    def _arm(self, loop: asyncio.AbstractEventLoop, retry: bool = False) -> None:
        if self._probe is not None or self._head() is None:
            return
        now = loop.time()
        due = now + self.config.retry_s if retry else max(now, self._last_grant + self.config.spacing_s)
        self._probe = loop.call_at(due, self._probed, due)

    def _probed(self, due: float) -> None:
        self._probe = None
        loop = self._loop
        head = self._head()
        if loop is None or head is None:
            return
        now = loop.time()
        config = self.config
        on_time = now - due <= config.late_ok_s
        if not on_time:
            self.deferred += 1
        # The head has waited since it came, or since the previous turn when it came before it.
        waited = now - max(head.since, self._last_grant)
        if on_time or waited >= config.max_defer_s:
            self._grant(head, now)
            self._arm(loop)
        else:
            self._arm(loop, retry=True)

    def _grant(self, waiter: _Waiter, now: float) -> None:
        line = self._admitted if not waiter.offer else self._offers
        line.popleft()
        waiter.granted = True
        self._last_grant = now
        waited = now - waiter.since
        self.granted += 1
        self.max_wait_s = max(self.max_wait_s, waited)
        if self._wait is not None:
            self._wait.observe(waited)
        waiter.future.set_result(None)
        self._publish()

    def _expire(self, waiter: _Waiter) -> None:
        """A new offer waited `max_wait_s` without its turn: refused (its caller hears busy)."""
        if waiter.future.done():
            return
        self.refused += 1
        waiter.future.set_exception(
            self._refusal(f"its set-up waited {self.config.max_wait_s:g} s for the calls in progress")
        )
        self._forget(waiter)

    def _forget(self, waiter: _Waiter) -> None:
        line = self._offers if waiter.offer else self._admitted
        with contextlib.suppress(ValueError):
            line.remove(waiter)
        if not waiter.future.done():
            waiter.future.cancel()
        self._publish()

    def _refusal(self, why: str) -> SaturatedError:
        return SaturatedError(
            f"this server cannot set up another call now: {why}; retry in {self.retry_after_s:g} s "
            "or elsewhere",
            retry_after_s=self.retry_after_s,
        )

    def _publish(self) -> None:
        if self._waiting_gauge is not None:
            self._waiting_gauge.set(self.waiting)


def wait_histogram(prefix: str = "") -> Histogram:
    return Histogram(
        prefix + "arrival_wait_seconds",
        "How long a call set-up step waited for its turn on the event loop",
        WAIT_BUCKETS,
    )
