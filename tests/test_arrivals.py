"""A burst of arriving calls never stalls the calls already talking (engine/arrivals.py), shown
on a virtual clock (support_virtual_loop.py), so exactly and whatever the machine's load.

Eight live calls share one event loop with a burst of arrivals, as a phone server's calls do:
each live call's real `Playout` paces its agent's audio to a carrier that plays it at real
time (the test's own model of the carrier's buffer: a message that comes after the buffer ran
dry is a gap the caller hears), the engine delivers each call a frame every 80 ms, and the
caller's 20 ms messages must be read within the inbound slack of their arrival to make the
engine's tick. The loop's work is virtual CPU (`loop.spend`): per call-second about 28 ms,
per arriving call's set-up 3 slices of 10 ms, 24 arrivals 10 ms apart: 720 ms of set-up offered
within a quarter of a second, nine frames' worth.

Without the gate the live calls go silent (the test's scenario is a real stall); with it no live
call hears a gap, no frame of theirs is dropped or inserted, every caller message is read in
time, and the burst's callers wait for their turns or, past their wait limit, are refused.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import pytest
from personaplex_phone.config import PhoneSettings
from personaplex_phone.playout import Playout
from support_virtual_loop import VirtualLoop

from personaplex_voice.engine.arrivals import ArrivalConfig, ArrivalGate
from personaplex_voice.engine.base import FRAME_SIZE, SAMPLE_RATE, SaturatedError
from personaplex_voice.session_api import OutFrame

LIVE_CALLS = 8
CALL_S = 4.0
FRAME_S = 0.080
MESSAGE_S = 0.020
# The loop's work (virtual CPU), per call: what a phone call costs here, rounded up.
CONVERT_S = 0.0006  # an 80 ms frame converted to the carrier's messages
SEND_S = 0.0001  # one message written to the socket
INBOUND_S = 0.0003  # one caller message parsed, decoded, resampled and pushed
# The burst: each arrival's set-up (webhook, stream start, session open, record) in slices.
ARRIVALS = 24
ARRIVAL_GAP_S = 0.010
BURST_AT_S = 1.0
SLICES = 3
SLICE_S = 0.010
SETTINGS = PhoneSettings()
T = TypeVar("T")
INBOUND_BUDGET_S = SETTINGS.inbound_slack_ms / 1000  # read later than this: the frame is late


class PlainWire:
    """A carrier's messages reduced to what the playout sends: media only (no marks)."""

    def media(self, payload: bytes) -> bytes:
        return payload

    def mark(self, name: str) -> None:
        return None

    def clear(self) -> None:
        return None


@dataclass
class CarrierSide:
    """The carrier's buffer of one call's agent audio: plays at real time what arrives."""

    loop: VirtualLoop
    play_end: float | None = None
    gaps: list[float] = field(default_factory=list)  # silence heard before a message, seconds
    messages: int = 0

    async def send(self, message: bytes) -> None:
        self.loop.spend(SEND_S)
        now = self.loop.time()
        if self.play_end is not None and now > self.play_end + 1e-6:
            self.gaps.append(now - self.play_end)
        self.play_end = max(now, self.play_end or now) + MESSAGE_S
        self.messages += 1


@dataclass
class EngineFrames:
    """A session's output: the engine's frame k ready at the tick after its input (80 ms apart)."""

    loop: VirtualLoop
    start: float
    count: int

    async def frames(self) -> AsyncIterator[OutFrame]:
        t = np.arange(FRAME_SIZE) / SAMPLE_RATE
        for k in range(self.count):
            due = self.start + (k + 1) * FRAME_S
            if self.loop.time() < due:
                await asyncio.sleep(due - self.loop.time())
            self.loop.spend(CONVERT_S)
            pcm = (0.3 * np.sin(2 * np.pi * 440 * (t + k * FRAME_S))).astype(np.float32)
            yield OutFrame(pcm=pcm, text=None, index=k)


@dataclass
class LiveCall:
    carrier: CarrierSide
    playout: Playout
    inbound_delays: list[float] = field(default_factory=list)


@dataclass
class Burst:
    ready_after: list[float] = field(default_factory=list)  # set-up done, seconds after arriving
    refused: int = 0


def scenario(gate_config: ArrivalConfig) -> tuple[list[LiveCall], Burst, ArrivalGate]:
    loop = VirtualLoop()
    gate = ArrivalGate(gate_config, refusing=lambda: True)
    burst = Burst()

    async def live_call(call: LiveCall, start: float) -> None:
        frames = round(CALL_S / FRAME_S)
        for j in range(frames * 4):  # the caller's messages, read when the loop gets to them
            loop.call_at(start + j * MESSAGE_S, caller_message, call, start + j * MESSAGE_S)
        call.playout.start_stream(PlainWire(), call.playout.outbound.format)  # type: ignore[arg-type]
        await call.playout.run(EngineFrames(loop, start, frames))

    def caller_message(call: LiveCall, arrived: float) -> None:
        call.inbound_delays.append(loop.time() - arrived)
        loop.spend(INBOUND_S)

    async def set_up(arrived: float) -> None:
        try:
            for i in range(SLICES):
                await gate.turn(offer=i == 0)
                loop.spend(SLICE_S)
                await asyncio.sleep(0)  # the set-up's own I/O between its slices
        except SaturatedError:
            burst.refused += 1
            return
        burst.ready_after.append(loop.time() - arrived)

    async def main() -> list[LiveCall]:
        t0 = loop.time()
        calls = []
        for _ in range(LIVE_CALLS):
            carrier = CarrierSide(loop)
            playout = Playout(
                carrier.send,
                max_queued_ms=SETTINGS.max_queued_ms,
                playout_cushion_ms=SETTINGS.playout_cushion_ms,
                max_buffered_ms=SETTINGS.max_buffered_ms,
                now=loop.time,
            )
            calls.append(LiveCall(carrier, playout))
        talking = [asyncio.ensure_future(live_call(c, t0 + 0.001 * i)) for i, c in enumerate(calls)]
        setups = []
        for j in range(ARRIVALS):
            await asyncio.sleep(t0 + BURST_AT_S + j * ARRIVAL_GAP_S - loop.time())
            setups.append(asyncio.ensure_future(set_up(loop.time())))
        await asyncio.gather(*talking, *setups)
        return calls

    try:
        calls = loop.run_until_complete(main())
    finally:
        loop.close()
    return calls, burst, gate


def test_without_turns_the_burst_stalls_every_live_call():
    """The scenario is a real stall: set-up run as it comes silences the live calls."""
    calls, burst, _ = scenario(ArrivalConfig(enabled=False))
    assert len(burst.ready_after) == ARRIVALS
    for call in calls:
        assert sum(call.carrier.gaps) > 0.2, call.carrier.gaps  # the caller heard the stall
        assert call.playout.inserted_ms > 0
        assert max(call.inbound_delays) > INBOUND_BUDGET_S


@pytest.mark.parametrize("max_wait_s", [4.0, 0.3])
def test_a_burst_of_set_ups_leaves_every_live_call_clean_and_its_callers_wait_or_are_refused(max_wait_s):
    calls, burst, gate = scenario(ArrivalConfig(max_wait_s=max_wait_s))
    frames = round(CALL_S / FRAME_S)
    for call in calls:
        playout = call.playout
        assert call.carrier.gaps == [], call.carrier.gaps  # no silence heard mid-call
        assert playout.inserted_ms == 0 and playout.dropped_ms == 0 and playout.clock.underruns == 0
        assert playout.frames_out == call.carrier.messages == frames * 4 + 2  # + the opening cushion
        # Every caller message read within the inbound slack: the engine's ticks got their frames.
        assert max(call.inbound_delays) <= INBOUND_BUDGET_S, max(call.inbound_delays)
    # The burst's callers: none set up at once; each waited for its turns, or was refused.
    assert len(burst.ready_after) + burst.refused == ARRIVALS
    assert min(burst.ready_after) >= SLICES * SLICE_S
    if max_wait_s >= 4.0:
        assert burst.refused == 0 and gate.refused == 0
        # They waited their turns: on average far longer than their own set-up work.
        assert float(np.mean(burst.ready_after)) > 3 * SLICES * SLICE_S and gate.max_wait_s > 0.1
    else:  # waited past their limit: busy, and the ones admitted still set up
        assert burst.refused > 0 and gate.refused == burst.refused
        assert len(burst.ready_after) > 0
    assert gate.waiting == 0


# -- the gate's own rules, on the same virtual clock -------------------------------------------------


def run_on(loop: VirtualLoop, main: Callable[[], Awaitable[T]]) -> T:
    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()


def test_admitted_calls_steps_go_before_new_offers_and_turns_are_spaced():
    loop = VirtualLoop()
    gate = ArrivalGate(ArrivalConfig(spacing_s=0.004), refusing=lambda: True)
    order: list[tuple[str, float]] = []

    async def step(name: str, offer: bool) -> None:
        await gate.turn(offer=offer)
        order.append((name, loop.time()))

    async def main() -> None:
        await asyncio.gather(step("offer1", True), step("offer2", True), step("admitted", False))

    run_on(loop, main)
    assert [name for name, _ in order] == ["admitted", "offer1", "offer2"]
    times = [t for _, t in order]
    assert all(b - a >= 0.004 - 1e-9 for a, b in itertools.pairwise(times))


def test_a_loop_never_on_time_still_grants_a_turn_every_max_defer():
    """Every probe finds the loop late (its CPU taken: here, a neighbour task that keeps it
    busy); set-up slows down to a turn per `max_defer_s`, never stops."""
    loop = VirtualLoop()
    config = ArrivalConfig(max_defer_s=0.05)
    gate = ArrivalGate(config, refusing=lambda: True)
    granted: list[float] = []
    busy = {"on": True}

    async def neighbour() -> None:
        while busy["on"]:
            loop.spend(0.025)  # 25 ms of work, every iteration: timers are always late
            await asyncio.sleep(0)

    async def main() -> None:
        hog = asyncio.ensure_future(neighbour())
        for _ in range(5):
            await gate.turn()
            granted.append(loop.time())
        busy["on"] = False
        await hog

    run_on(loop, main)
    gaps = np.diff(granted)
    assert gate.deferred > 0
    # (a turn's probe can only fire between two of the neighbour's 25 ms slices)
    assert all(config.max_defer_s - 0.001 <= g <= config.max_defer_s + 0.06 for g in gaps), gaps


@pytest.mark.parametrize("refusing", [True, False])
def test_offers_are_refused_past_their_wait_or_the_line_bound_only_while_refusals_are_on(refusing):
    loop = VirtualLoop()
    config = ArrivalConfig(max_wait_s=0.5, max_waiting=3, max_defer_s=10.0)
    gate = ArrivalGate(config, refusing=lambda: refusing)
    outcomes: list[str] = []

    async def neighbour() -> None:  # keeps the loop late for 2 s: no turn on time
        start = loop.time()
        while loop.time() - start < 2.0:
            loop.spend(0.025)
            await asyncio.sleep(0)

    async def offer() -> None:
        try:
            await gate.turn(offer=True)
            outcomes.append("turn")
        except SaturatedError:
            outcomes.append("refused")

    async def main() -> None:
        hog = asyncio.ensure_future(neighbour())
        await asyncio.gather(*(offer() for _ in range(4)))
        await hog

    run_on(loop, main)
    # The 4th found 3 waiting: refused at once (a bounded line, whatever the policy). The 3
    # others waited past 0.5 s: refused while refusals are on, else their turns came.
    expected = ["refused"] * 4 if refusing else ["refused", "turn", "turn", "turn"]
    assert outcomes == expected
    assert gate.waiting == 0


def test_a_cancelled_wait_leaves_the_line_and_a_disabled_gate_waits_for_nothing():
    loop = VirtualLoop()
    gate = ArrivalGate(ArrivalConfig(max_defer_s=10.0), refusing=lambda: True)

    async def main() -> float:
        loop.spend(0.1)  # the loop is late: the first probe will not grant
        waiter = asyncio.ensure_future(gate.turn(offer=True))
        await asyncio.sleep(0)
        assert gate.waiting == 1
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert gate.waiting == 0
        off = ArrivalGate(ArrivalConfig(enabled=False))
        before = loop.time()
        await off.turn(offer=True)
        return loop.time() - before

    assert run_on(loop, main) == 0.0
