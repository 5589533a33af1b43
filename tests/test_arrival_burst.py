"""A burst of arriving calls on a real server leaves the calls already talking whole.

`personaplex-voice serve --engine echo --twilio` in its own process (admission by slots only, as
every test server: conftest.py; the set-up gate is on, as served). Eight simulated Twilio calls
talk, each its own speech; then sixteen more calls arrive within 200 ms, each with its signed
webhook, its Media Stream (upgrade, `start`, the session's open) and a moment of line audio.
Judged on what the eight callers heard and on the server's own counters, never on wall-clock
sums: no silence of over 100 ms in any live call's audio, the echo's delay unchanged across the
burst (silence put in would push it later), and every live call's record counting no silence
put in (late input or playout underrun) and no audio dropped.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
from dataclasses import dataclass, field

import httpx
import numpy as np
import pytest
from support_server import running_server
from support_twilio import (
    ACCOUNT_SID,
    SimulatedCall,
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


@dataclass
class Talker:
    """A caller talking its own speech on a 20 ms grid until told to stop."""

    call: SimulatedCall
    call_sid: str
    seed: int
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    late_sends: int = 0  # sends this simulator itself made over 30 ms late (the test machine)

    async def talk(self) -> None:
        speech = ulaw_encode(speechlike(10.0, self.seed))
        payloads = [base64.b64encode(speech[i : i + 160]).decode() for i in range(0, len(speech), 160)]
        self.call.keep_sent = True
        start, n = time.monotonic(), 0
        while not self.stop.is_set() and not self.call.closed.is_set():
            delay = start + n * 0.020 - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            elif delay < -0.030:
                self.late_sends += 1
            await self.call.send_media(payloads[n % len(payloads)])
            n += 1


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


async def arrive(sim: TwilioSimulator, client: httpx.AsyncClient, at: float) -> bool:
    """One arriving call: offered at `at` (monotonic), streamed half a second, hung up."""
    await asyncio.sleep(max(0.0, at - time.monotonic()))
    call_sid = sid("CA")
    url, params = parse_stream_twiml(await answer(sim, client, call_sid))
    async with sim.media_stream(url, params, call_sid=call_sid) as call:
        silence = np.zeros(160, np.float32)
        for _ in range(25):
            await call.play(silence)
        return bool(call.played) or not call.closed.is_set()


async def test_a_burst_of_arrivals_leaves_the_calls_in_progress_whole():
    with running_server("--twilio", "--max-sessions", str(LIVE + ARRIVALS), env=ENV) as server:
        sim = TwilioSimulator(server.url, AUTH_TOKEN)
        auth = {"Authorization": f"Bearer {API_TOKEN}"}
        limits = httpx.Limits(max_keepalive_connections=0)
        async with (
            httpx.AsyncClient(base_url=server.url, timeout=30, limits=limits) as client,
            contextlib.AsyncExitStack() as stack,
        ):
            talkers: list[Talker] = []
            for seed in range(LIVE):
                call_sid = sid("CA")
                url, params = parse_stream_twiml(await answer(sim, client, call_sid))
                call = await stack.enter_async_context(sim.media_stream(url, params, call_sid=call_sid))
                talkers.append(Talker(call, call_sid, seed))
            talking = [asyncio.create_task(t.talk()) for t in talkers]
            await asyncio.sleep(BEFORE_S)
            assert all(t.call.played for t in talkers), "a live call got no audio back"

            burst_at = time.monotonic() + 0.05
            offers = [arrive(sim, client, burst_at + k * ARRIVAL_SPAN_S / ARRIVALS) for k in range(ARRIVALS)]
            arrived = await asyncio.gather(*offers)
            assert all(arrived), arrived
            await asyncio.sleep(AFTER_S)
            for talker in talkers:
                talker.stop.set()
            await asyncio.gather(*talking)
            for talker in talkers:
                await talker.call.stop()
                await asyncio.wait_for(talker.call.closed.wait(), 10)

        for talker in talkers:
            call = talker.call
            # What the caller heard: no silence of over 100 ms after our first message.
            gaps = [(round(p.arrival - burst_at, 2), round(p.gap_s, 3)) for p in call.played if p.gap_s]
            worst = max((gap for _, gap in gaps), default=0.0)
            assert worst <= MAX_GAP_S, (talker.call_sid, gaps, talker.late_sends)
            # The echo of every second came back at one delay: nothing was put in it.
            quality = echo_quality(ulaw_decode(bytes(call.sent)), call.played_audio())
            assert len(quality.correlations) >= BEFORE_S + AFTER_S - 1, quality
            assert quality.clean() and quality.delay_growth_s < 0.040, (talker.call_sid, quality)

        for talker in talkers:  # the server's own count for each live call
            record = await asyncio.to_thread(_record, server.url, talker.call_sid, auth)
            metrics = record["metrics"]
            inserted = {k: v for k, v in metrics["inserted_ms"].items() if v}
            dropped = {k: v for k, v in metrics["dropped_ms"].items() if v}
            assert not inserted and not dropped, (talker.call_sid, inserted, dropped, talker.late_sends)


def _record(url: str, call_sid: str, auth: dict[str, str]) -> dict:
    deadline = time.monotonic() + 20
    while True:
        record = httpx.get(f"{url}/twilio/calls/{call_sid}", headers=auth, timeout=10).json()
        if not record.get("live") and record.get("metrics", {}).get("inserted_ms") is not None:
            return record
        if time.monotonic() > deadline:
            raise AssertionError(f"{call_sid}: no final record: {record}")
        time.sleep(0.2)
