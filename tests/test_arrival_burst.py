"""A burst of arriving calls on a real server leaves the calls already talking whole.

`personaplex-voice serve --engine echo --twilio` in its own process (admission by slots only, as
every test server: conftest.py; the set-up turns on, as served). Eight simulated Twilio calls
talk, each its own speech; then sixteen more calls arrive within 200 ms, each with its signed
webhook, its Media Stream (upgrade, `start`, the session's open) and a moment of line audio.
The eight live callers run in a process of their own and the burst in another, at a lower
priority, so that the burst's client side (sixteen webhooks and WebSocket handshakes at once)
can make neither the live callers nor the server late: whatever the live callers hear is the
server's doing. Judged on what they heard and on the server's own counters, never on
wall-clock sums: no silence of over 100 ms in any live call's audio, the echo's delay unchanged
across the burst (silence put in would push it later), and every live call's record counting
no silence put in of the server's making: no playout underrun, and no late input beyond what
the caller's own late sends explain (on a machine kept busy, the simulated caller itself can
be late; that is its loss, as with any caller).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import multiprocessing as mp
import os
import time
from typing import Any

import httpx
import numpy as np
import pytest
from support_server import running_server
from support_twilio import (
    ACCOUNT_SID,
    TwilioSimulator,
    echo_quality,
    parse_stream_twiml,
    sid,
    speechlike,
)

from personaplex_voice.audio.mulaw import ulaw_decode, ulaw_encode

pytestmark = pytest.mark.timeout(180)

AUTH_TOKEN = "burst-auth-token"
API_TOKEN = "burst-api-token"
ENV = {
    "TWILIO_AUTH_TOKEN": AUTH_TOKEN,
    "TWILIO_ACCOUNT_SID": "",
    "PUBLIC_URL": "",
    "PERSONAPLEX_TWILIO_API_TOKEN": API_TOKEN,
}
LIVE = 8
ARRIVALS = 16
ARRIVAL_SPAN_S = 0.2
BEFORE_S = 2.0  # the live calls talk this long before the burst
AFTER_S = 3.0  # and this long after it
MAX_GAP_S = 0.100
FRAME_MS = 80.0


def voice_form(call_sid: str) -> dict[str, str]:
    return {
        "AccountSid": ACCOUNT_SID,
        "CallSid": call_sid,
        "From": "+15550100002",
        "To": "+15550100001",
        "CallStatus": "ringing",
        "Direction": "inbound",
        "ApiVersion": "2010-04-01",
    }


async def answer(sim: TwilioSimulator, client: httpx.AsyncClient, call_sid: str) -> str:
    form = voice_form(call_sid)
    signature = sim.sign(sim.public_url + "/twilio/voice", form)
    response = await client.post("/twilio/voice", data=form, headers={"X-Twilio-Signature": signature})
    assert response.status_code == 200 and "<Stream" in response.text, response.text
    return response.text


# --- the live callers (a process of their own) -------------------------------------------------


def live_callers(url: str, talking: Any, stop: Any, results: Any) -> None:
    """Eight calls, each talking its own speech on a 20 ms grid from its stream's start until
    `stop`; `talking` is set once every call has its echo coming back. Puts one row per call:
    (call sid, [(monotonic time, silence heard before it)] of each late message, the echo's
    per-second correlations and delays, sends this process itself made over 30 ms late)."""

    async def main() -> list[tuple]:
        sim = TwilioSimulator(url, AUTH_TOKEN)
        limits = httpx.Limits(max_keepalive_connections=0)
        async with (
            httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client,
            contextlib.AsyncExitStack() as stack,
        ):
            calls = []
            for seed in range(LIVE):
                call_sid = sid("CA")
                stream_url, params = parse_stream_twiml(await answer(sim, client, call_sid))
                call = await stack.enter_async_context(
                    sim.media_stream(stream_url, params, call_sid=call_sid)
                )
                call.keep_sent = True
                calls.append((call_sid, call, seed))
            late_sends = [0] * LIVE
            senders = [asyncio.create_task(talk(call, seed, late_sends)) for _, call, seed in calls]
            while not all(call.played for _, call, _ in calls):
                await asyncio.sleep(0.05)
            talking.set()
            while not stop.is_set():
                await asyncio.sleep(0.05)
            for task in senders:
                task.cancel()
            await asyncio.gather(*senders, return_exceptions=True)
            rows = []
            for (call_sid, call, _), late in zip(calls, late_sends, strict=True):
                await call.stop()
                await asyncio.wait_for(call.closed.wait(), 10)
                quality = echo_quality(ulaw_decode(bytes(call.sent)), call.played_audio())
                gaps = [(p.arrival, p.gap_s) for p in call.played if p.gap_s]
                rows.append((call_sid, gaps, quality.correlations, quality.delays_s, late))
            return rows

    async def talk(call: Any, seed: int, late_sends: list[int]) -> None:
        speech = ulaw_encode(speechlike(10.0, seed))
        payloads = [base64.b64encode(speech[i : i + 160]).decode() for i in range(0, len(speech), 160)]
        start, n = time.monotonic(), 0
        while not call.closed.is_set():
            delay = start + n * 0.020 - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            elif delay < -0.030:
                late_sends[seed] += 1
            await call.send_media(payloads[n % len(payloads)])
            n += 1

    try:
        results.put(asyncio.run(main()))
    except BaseException as exc:
        results.put(repr(exc))
        raise


# --- the burst (a process of its own, behind the others) -----------------------------------------


def burst_client(url: str, burst_at: float, results: Any) -> None:
    """Sixteen calls arriving from `burst_at` (monotonic) on, within 200 ms: each its signed
    webhook, its stream, half a second of line audio, its stop. Puts whether each got its stream.
    At a lower priority than the server and the live callers: the burst's own client side (its
    handshakes) is load of the test's, not of the server's, and must not take their CPU."""
    os.nice(10)

    async def arrive(sim: TwilioSimulator, client: httpx.AsyncClient, at: float) -> bool:
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        call_sid = sid("CA")
        stream_url, params = parse_stream_twiml(await answer(sim, client, call_sid))
        async with sim.media_stream(stream_url, params, call_sid=call_sid) as call:
            silence = np.zeros(160, np.float32)
            for _ in range(25):
                await call.play(silence)
            return not call.closed.is_set()

    async def main() -> list[bool]:
        sim = TwilioSimulator(url, AUTH_TOKEN)
        limits = httpx.Limits(max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:
            offsets = [k * ARRIVAL_SPAN_S / ARRIVALS for k in range(ARRIVALS)]
            return list(await asyncio.gather(*(arrive(sim, client, burst_at + o) for o in offsets)))

    try:
        results.put(asyncio.run(main()))
    except BaseException as exc:
        results.put(repr(exc))
        raise


async def test_a_burst_of_arrivals_leaves_the_calls_in_progress_whole():
    ctx = mp.get_context("spawn")
    talking, stop, results, arrivals = ctx.Event(), ctx.Event(), ctx.Queue(), ctx.Queue()
    with running_server("--twilio", "--max-sessions", str(LIVE + ARRIVALS), env=ENV) as server:
        callers = ctx.Process(target=live_callers, args=(server.url, talking, stop, results), daemon=True)
        callers.start()
        burst = None
        try:
            assert await asyncio.to_thread(talking.wait, 60), "the live calls did not get going"
            burst_at = time.monotonic() + BEFORE_S  # the burst's process starts in well under that
            burst = ctx.Process(target=burst_client, args=(server.url, burst_at, arrivals), daemon=True)
            burst.start()
            arrived = await asyncio.to_thread(arrivals.get, True, 60)
            assert arrived == [True] * ARRIVALS, arrived
            await asyncio.sleep(max(0.0, burst_at + ARRIVAL_SPAN_S + AFTER_S - time.monotonic()))
            stop.set()
            rows = await asyncio.to_thread(results.get, True, 60)
        finally:
            stop.set()
            for process in (callers, burst):
                if process is not None:
                    process.join(30)
                    if process.is_alive():
                        process.kill()
        assert isinstance(rows, list), rows

        auth = {"Authorization": f"Bearer {API_TOKEN}"}
        for call_sid, gaps, correlations, delays, late_sends in rows:
            # The server's own count: no silence put in, no audio dropped.
            metrics = (await asyncio.to_thread(final_record, server.url, call_sid, auth))["metrics"]
            inserted = {k: v for k, v in metrics["inserted_ms"].items() if v}
            dropped = {k: v for k, v in metrics["dropped_ms"].items() if v}
            why = (call_sid, inserted, dropped, "late sends of the callers' own:", late_sends)
            # What the caller heard: no silence of over 100 ms after our first message.
            heard = sorted(((round(gap, 3), round(at - burst_at, 2)) for at, gap in gaps), reverse=True)[:5]
            assert max((gap for _, gap in gaps), default=0.0) <= MAX_GAP_S, (heard, *why)
            # Every second of its speech found in the echo at one delay: no silence was put in
            # (unless the caller itself sent late: then a frame of its own may be).
            assert len(delays) >= BEFORE_S + AFTER_S - 1, (correlations, *why)
            if not late_sends:
                assert max(delays) - min(delays) < 0.040, (delays, correlations, *why)
            # The server put no silence in of its own making: none for its own lateness (the
            # playout), and none for input late at a tick but what the caller's own late sends
            # explain (a machine that starves the simulated caller makes it late; that is the
            # caller's loss, counted on its call, one frame at most per late send).
            assert not inserted.get("playout_underrun"), why
            assert inserted.get("late_input", 0.0) <= FRAME_MS * late_sends, why
            assert set(inserted) <= {"playout_underrun", "late_input"}, why


def final_record(url: str, call_sid: str, auth: dict[str, str]) -> dict:
    deadline = time.monotonic() + 20
    while True:
        record = httpx.get(f"{url}/twilio/calls/{call_sid}", headers=auth, timeout=10).json()
        if not record.get("live") and record.get("metrics", {}).get("inserted_ms") is not None:
            return record
        if time.monotonic() > deadline:
            raise AssertionError(f"{call_sid}: no final record: {record}")
        time.sleep(0.2)
