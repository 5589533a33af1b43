"""Every call of a run as batched sessions of one `SessionManager`, on an offline clock.

The manager runs non-realtime: a tick happens as soon as every running session has its next
frame, so the calls advance together, as fast as the engine steps, whatever the wall clock says.
Each call keeps `LOOKAHEAD` frames in flight: the caller's frame k+1 is made once the agent's
frame k-1 is in, so the caller can react to the agent (a barge-in) while the engine never waits
for Python. That is deterministic: a call's input never depends on timing, so a call gives the
same tokens batched with others as alone with the same seed.

The calls that get a slot at once start together once all their prompts are in (so they share
ticks from their first frame); calls beyond the slots queue and start when a slot frees.
Only the session API is used (`open`, `ready`, `push`, `end_input`, `frames`, `close`, `stats`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from personaplex_voice.engine.base import Engine, EngineError
from personaplex_voice.metrics import values_of
from personaplex_voice.sessions import Session, SessionManager

from .call import CallDriver, CallPlan, CallTrace
from .speech import ClipBook

LOOKAHEAD = 1  # frames pushed beyond the last agent frame received

OnFrame = Callable[[], None]
OnCall = Callable[[CallTrace], Awaitable[None]]


async def run_batched(
    engine: Engine,
    plans: Sequence[CallPlan],
    clips: ClipBook,
    *,
    on_frame: OnFrame = lambda: None,
    on_call: OnCall | None = None,
) -> tuple[list[CallTrace], dict[str, Any]]:
    """Run every plan through one manager on `engine`; (traces in plan order, run stats)."""
    manager = SessionManager(
        engine,
        realtime=False,
        max_queue=len(plans),
        max_call_s=None,
        idle_timeout_s=None,
    )
    started = time.perf_counter()
    await manager.start()
    try:
        sessions: list[Session | BaseException] = []
        for plan in plans:
            try:
                sessions.append(await manager.open(plan.persona))
            except EngineError as exc:
                sessions.append(exc)
        first_wave = [s for s in sessions if isinstance(s, Session) and s.queue_position is None]
        gate = asyncio.ensure_future(asyncio.gather(*(s.ready() for s in first_wave), return_exceptions=True))
        traces = await asyncio.gather(
            *(
                _one_call(plan, session, clips, gate if session in first_wave else None, on_frame, on_call)
                for plan, session in zip(plans, sessions, strict=True)
            )
        )
        metrics = values_of(manager.metrics.snapshot())
    finally:
        await manager.shutdown()
    wall = time.perf_counter() - started
    audio_s = sum(t.duration_s for t in traces)
    ticks = metrics.get("ticks_total", 0)
    tick_seconds = metrics.get("tick_seconds") or {}
    return list(traces), {
        "mode": "batched",
        "slots": engine.num_slots,
        "calls": len(traces),
        "audio_s": round(audio_s, 3),
        "wall_s": round(wall, 3),
        "x_realtime": round(audio_s / wall, 3) if wall > 0 else None,
        "ticks": int(ticks),
        "engine_s": round(float(tick_seconds.get("sum", 0.0)), 3),
    }


async def _one_call(
    plan: CallPlan,
    session: Session | BaseException,
    clips: ClipBook,
    gate: Awaitable[Any] | None,
    on_frame: OnFrame,
    on_call: OnCall | None,
) -> CallTrace:
    driver = CallDriver(plan, clips)
    if isinstance(session, BaseException):
        trace = driver.trace(error=str(session))
    else:
        try:
            trace = await _drive(session, driver, gate, on_frame)
        finally:
            await session.close()
    if on_call is not None:
        await on_call(trace)
    return trace


async def _drive(
    session: Session, driver: CallDriver, gate: Awaitable[Any] | None, on_frame: OnFrame
) -> CallTrace:
    try:
        await session.ready()
    except EngineError as exc:
        return driver.trace(error=f"the session did not start: {exc}")
    if gate is not None:
        await asyncio.shield(gate)
    frames = session.frames()
    pushed = received = 0
    ended_input = False
    try:
        while True:
            while not driver.input_done and pushed - received <= LOOKAHEAD:
                frame = driver.next_engine_frame()
                if frame is None:
                    break
                session.push(frame)
                pushed += 1
            if driver.input_done and not ended_input:
                session.end_input()
                ended_input = True
            if received >= pushed:
                break
            try:
                out = await anext(frames)
            except StopAsyncIteration:
                reason = session.close_reason or "closed"
                return driver.trace(error=f"the session ended early ({reason})", session=session.stats)
            driver.on_agent_frame(out.pcm, out.text, out.tokens)
            received += 1
            on_frame()
    finally:
        with contextlib.suppress(Exception):
            await frames.aclose()
    return driver.trace(session=session.stats)
