"""A process made short of time on purpose: it answers new calls busy before the calls it carries
degrade, says so on /readyz, and counts (and warns about) every frame it had to drop or insert
when a clean line could not be kept.

The server is a real app under uvicorn in this process (the echo engine, Twilio mounted, the
REST cloud faked: support_twilio.bridge_harness), with its default saturation policy. The
overload is the test's own: every caller message the phone call parses blocks the server's event
loop for a fixed time (`SlowMedia`), 5 ms here, 250 ms per call-second (a phone call costs the
real path 5-8 ms), so the load is the test's, not the machine's, and sleeping needs no CPU: a
busy machine changes little of it. Audio is judged by the per-second rule: every second of what
each caller said comes back (normalized correlation >= 0.8) and the echo's delay grows by at
most 200 ms. The test process runs as a served one does (no full collections mid-call, a 1 ms
GIL switch interval: process/runtime.py), restored afterwards: its simulated callers share the
process, and a collection of the whole test process's heap stalls every thread for 100-200 ms.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import re
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
import personaplex_phone
import pytest
from personaplex_backends import RemoteBackend, SessionRefused
from personaplex_backends.remote import Backoff
from personaplex_phone.carrier import CallerMedia
from personaplex_phone.simulator import PhoneSimulator
from support_phone import CARRIERS, carrier_env, carrier_side
from support_twilio import (
    RATE,
    BridgeHarness,
    SimulatedCall,
    bridge_harness,
    echo_quality,
    parse_stream_twiml,
    running_app,
    sid,
    speechlike,
)
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from personaplex_voice.audio.mulaw import ulaw_decode
from personaplex_voice.engine.base import Persona
from personaplex_voice.engine.headroom import HeadroomConfig
from personaplex_voice.engine.loopback import LoopbackEngine
from personaplex_voice.process.settings import ServerSettings
from personaplex_voice.server.app import create_app
from personaplex_voice.sessions import SessionManager

pytestmark = pytest.mark.timeout(120)

PERSONAS = "default: desk\npersonas:\n  desk: {text_prompt: 'You answer the phone.'}\n"
MEDIA_DELAY_S = 0.005  # per caller message: 250 ms of every second, per call
SETTLE_S = 2.2  # between two calls: the new one's load is measured (HeadroomConfig.settle_s)
WARNING_TEXT = "to keep the frame clock"
POLICY = {"headroom": HeadroomConfig()}  # the documented levels (the harness has none)


@pytest.fixture(autouse=True)
def realtime_process():
    """What `serve` does to its process (gc.freeze and a 1 ms switch interval), undone after."""
    interval, enabled = sys.getswitchinterval(), gc.isenabled()
    gc.collect()
    gc.disable()
    sys.setswitchinterval(0.001)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)
        if enabled:
            gc.enable()


class SlowWire:
    """A carrier's wire whose every caller message blocks the event loop for `knob.delay_s`."""

    def __init__(self, wire: Any, knob: SlowMedia):
        self._wire = wire
        self._knob = knob

    def parse(self, raw: Any) -> Any:
        event = self._wire.parse(raw)
        if isinstance(event, CallerMedia) and self._knob.delay_s:
            time.sleep(self._knob.delay_s)  # the loop's thread is held: no other call runs meanwhile
        return event

    def __getattr__(self, name: str) -> Any:
        return getattr(self._wire, name)


@dataclass
class SlowMedia:
    delay_s: float


def slow_media(harness: BridgeHarness, delay_s: float) -> SlowMedia:
    knob = SlowMedia(delay_s)
    carrier = harness.app.state.phone.carriers["twilio"]
    make = carrier.new_wire
    carrier.new_wire = lambda: SlowWire(make(), knob)
    return knob


@dataclass
class Caller:
    """One simulated caller talking (its own speech, 1 s at a time) until told to stop."""

    call_sid: str
    call: SimulatedCall
    seed: int
    speech_from_s: float = 0.0  # on the call's timeline
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None

    async def talk(self) -> None:
        """Line silence until the agent answers (as Twilio sends), then speech; hangs up (`stop`)
        the moment it stops talking, as a real line ends."""
        silence = await self.call.answered()
        self.speech_from_s = silence / RATE
        second = 0
        while not self.stop.is_set() and not self.call.closed.is_set():
            await self.call.play(speechlike(1.0, self.seed * 1000 + second))
            second += 1
        await self.call.stop()

    def quality(self) -> Any:
        sent = ulaw_decode(bytes(self.call.sent))
        return echo_quality(sent, self.call.played_audio(), start_s=self.speech_from_s)


async def offer(harness: BridgeHarness) -> tuple[str, httpx.Response]:
    call_sid = sid("CA")
    response = await asyncio.to_thread(harness.sim.voice_webhook, call_sid=call_sid)
    assert response.status_code == 200, response.text
    return call_sid, response


@contextlib.asynccontextmanager
async def talking(harness: BridgeHarness, call_sid: str, answer: str, seed: int) -> AsyncIterator[Caller]:
    url, params = parse_stream_twiml(answer)
    async with harness.sim.media_stream(url, params, call_sid=call_sid) as call:
        call.keep_sent = True
        caller = Caller(call_sid, call, seed)
        caller.task = asyncio.create_task(caller.talk())
        try:
            yield caller
        finally:
            caller.stop.set()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(caller.task, 5)


def readyz(harness: BridgeHarness) -> httpx.Response:
    return httpx.get(harness.url + "/readyz", timeout=10)


def metric(text: str, name: str, **labels: str) -> float:
    """The value of a Prometheus series in /metrics text (0 when absent)."""
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = re.escape(name) + (r"\{" + re.escape(wanted) + r"\}" if wanted else "") + r" ([0-9.e+-]+)"
    found = re.search(pattern, text)
    return float(found.group(1)) if found else 0.0


async def until(predicate: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = await asyncio.to_thread(predicate)
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f} s")
        await asyncio.sleep(0.2)


async def test_a_server_short_of_time_answers_new_calls_busy_and_its_calls_stay_clean(tmp_path):
    """Calls join one at a time, each costing the loop 25 % of the wall clock. Once one more
    would take the loop past its enter level (70 %), the next caller hears Twilio busy TwiML,
    /api/chat's upgrade gets 503 `saturated` (Retry-After), /readyz says `saturated`; every
    admitted call's audio comes back clean, second by second; once the calls end, /readyz is
    ready again."""
    with bridge_harness(
        PERSONAS, tmp_path, engine=LoopbackEngine(num_slots=8), manager_options=POLICY
    ) as harness:
        slow_media(harness, MEDIA_DELAY_S)
        async with contextlib.AsyncExitStack() as calls:
            callers: list[Caller] = []
            busy = None
            for seed in range(8):
                call_sid, response = await offer(harness)
                if "<Stream" not in response.text:
                    busy = response.text
                    break
                callers.append(
                    await calls.enter_async_context(talking(harness, call_sid, response.text, seed))
                )
                await asyncio.sleep(SETTLE_S)
            assert busy is not None, "8 calls of 25 % each were all admitted"
            assert "<Say>" in busy and "busy" in busy and "<Hangup" in busy
            # Two calls bring the loop to 0.50 (and a little for the rest of their path); a third
            # would take it to 0.75. One would leave room for two more at 0.25 each.
            assert len(callers) == 2, (await asyncio.to_thread(readyz, harness)).text

            ready = await asyncio.to_thread(readyz, harness)
            assert ready.status_code == 503 and ready.json()["status"] == "saturated", ready.text
            # Refused for the load (measured, or with one more call), not for anything else.
            assert set(ready.json()["headroom"]["reasons"]) <= {"loop_load", "loop_load (projected)"}, (
                ready.text
            )
            ws_url = harness.url.replace("http://", "ws://") + "/api/chat"
            with pytest.raises(InvalidStatus) as refused:
                async with connect(ws_url, open_timeout=10):
                    pass
            response = refused.value.response
            assert response.status_code == 503
            assert response.headers["x-personaplex-error"] == "saturated"
            assert int(response.headers["retry-after"]) >= 1
            assert b"real time" in response.body

            await asyncio.sleep(3.0)  # the admitted calls go on at this load
            for caller in callers:
                caller.stop.set()
            await asyncio.gather(*(c.task for c in callers if c.task is not None))
            for caller in callers:
                quality = caller.quality()
                assert len(quality.correlations) >= 3, caller.call_sid
                assert quality.clean(), (caller.call_sid, quality)

            text = (await asyncio.to_thread(httpx.get, harness.url + "/metrics", timeout=10)).text
            assert metric(text, "personaplex_phone_refusals_total", reason="saturated") >= 1
            assert metric(text, "personaplex_sessions_rejected_total", reason="saturated") >= 1
            assert metric(text, "personaplex_saturated") == 1.0

        # The calls are over: the loop has its time back, the server admits again.
        body = await until(
            lambda: readyz(harness).status_code == 200 and readyz(harness).json(), 20, "/readyz ready again"
        )
        assert body["status"] == "ready"
        call_sid, response = await offer(harness)
        assert "<Stream" in response.text


async def test_calls_that_could_not_keep_a_clean_line_are_counted_per_call_and_warned_about(tmp_path, caplog):
    """Two calls talk, then every message blocks the loop 25 ms (2.5 s of every second for two
    calls: far past what any admission can protect) for 2 s. The frames dropped and inserted to
    keep the clock are counted per call (its record, the /calls live view), in /metrics by
    reason, and each call logs one WARNING with the count when it ends."""
    caplog.set_level("INFO")
    with bridge_harness(
        PERSONAS, tmp_path, engine=LoopbackEngine(num_slots=4), manager_options=POLICY
    ) as harness:
        knob = slow_media(harness, 0.0)
        async with contextlib.AsyncExitStack() as calls:
            callers = []
            for seed in range(2):
                call_sid, response = await offer(harness)
                assert "<Stream" in response.text
                callers.append(
                    await calls.enter_async_context(talking(harness, call_sid, response.text, seed))
                )
            await asyncio.sleep(1.5)
            knob.delay_s = 0.025
            await asyncio.sleep(2.0)
            knob.delay_s = 0.0
            await asyncio.sleep(2.0)
            live = (await asyncio.to_thread(harness.get, "/twilio/calls")).json()["live"]
            views = {view["call_sid"]: view for view in live}
            for caller in callers:
                view = views[caller.call_sid]
                assert view["dropped_ms"] + view["inserted_ms"] > 0, view
                assert view["media_ms_per_s"] > 0
                assert not caller.quality().clean()  # what the counters say, the caller heard

        for caller in callers:
            await until(lambda c=caller: not harness.record(c.call_sid)["live"], 10, "the call's end")
            metrics = harness.record(caller.call_sid)["metrics"]
            dropped, inserted = metrics["dropped_ms"], metrics["inserted_ms"]
            assert sum(dropped.values()) + sum(inserted.values()) > 0, metrics
            assert set(dropped) >= {"jitter_buffer", "input_bound", "slow_consumer", "playout_overflow"}
            assert set(inserted) >= {"late_input", "playout_underrun"}
            warnings = [
                r.getMessage()
                for r in caplog.records
                if r.levelname == "WARNING"
                and WARNING_TEXT in r.getMessage()
                and caller.call_sid in r.getMessage()
            ]
            assert len(warnings) == 1, warnings
            assert re.search(r"(lost|had) \d+ ms", warnings[0])

        text = (await asyncio.to_thread(httpx.get, harness.url + "/metrics", timeout=10)).text
        engine_side = sum(
            metric(text, "personaplex_audio_inserted_seconds_total", reason=r) for r in ("late_input",)
        ) + sum(
            metric(text, "personaplex_audio_dropped_seconds_total", reason=r)
            for r in ("jitter_buffer", "input_bound", "slow_consumer")
        )
        phone_side = metric(
            text, "personaplex_phone_audio_inserted_seconds_total", reason="playout_underrun"
        ) + (metric(text, "personaplex_phone_audio_dropped_seconds_total", reason="playout_overflow"))
        assert engine_side + phone_side > 0, text[-2000:]
        expected = sum(
            sum(harness.record(c.call_sid)["metrics"]["dropped_ms"].values())
            + sum(harness.record(c.call_sid)["metrics"]["inserted_ms"].values())
            for c in callers
        )
        assert np.isclose(1000 * (engine_side + phone_side), expected, rtol=0.05, atol=1.0)


# Saturated by any work at all: the loop monitor's first second makes it so, and it stays.
ALWAYS_SATURATED = HeadroomConfig(loop_load_enter=1e-9, loop_load_exit=0.0, loop_load_hold_s=0.0)


async def test_every_transport_refuses_a_saturated_server_its_own_way(tmp_path, monkeypatch):
    """Slots free, no headroom: each carrier's webhook gets that carrier's busy answer (no
    stream), /api/chat's upgrade and its plain GET 503 `saturated`, the remote backend of the
    Pipecat and LiveKit bridges a SessionRefused of kind `saturated` at once (no retries),
    /readyz 503 `saturated`, /healthz says so; each refusal is counted by reason."""
    personas = tmp_path / "personas.yaml"
    personas.write_text(PERSONAS)
    for name, value in carrier_env("http://127.0.0.1:9", str(personas)).items():
        monkeypatch.setenv(name, value)
    manager = SessionManager(LoopbackEngine(num_slots=4), headroom=ALWAYS_SATURATED)
    app = create_app(ServerSettings(engine="echo", tune_runtime=False), host=manager)
    with running_app(app) as server:
        personaplex_phone.mount(app, CARRIERS)
        await until(lambda: readyz_of(server.url).status_code == 503, 10, "saturation")
        ready = readyz_of(server.url).json()
        assert ready["status"] == "saturated" and ready["available"] == 0 and ready["capacity"] == 4
        assert httpx.get(server.url + "/healthz").json()["saturated"] is True

        busy_message = personaplex_phone.PhoneSettings().busy_message
        for carrier in CARRIERS:
            sim = PhoneSimulator(
                carrier_side(carrier), server.url, public_url=carrier_env("", "")["PUBLIC_URL"]
            )
            call_id, status, body = await sim.webhook()
            assert sim.side.parse_answer(call_id, status, body) is None, (carrier, body[:300])
            assert busy_message.encode() in body, (carrier, status, body[:300])

        ws_url = server.url.replace("http://", "ws://") + "/api/chat"
        with pytest.raises(InvalidStatus) as refused:
            async with connect(ws_url, open_timeout=10):
                pass
        assert refused.value.response.status_code == 503
        plain = httpx.get(server.url + "/api/chat")
        assert plain.status_code == 503 and plain.headers["x-personaplex-error"] == "saturated"
        backend = RemoteBackend(ws_url, backoff=Backoff(attempts=3, initial_s=0.01))
        with pytest.raises(SessionRefused, match="no real-time headroom") as remote:
            await backend.open(Persona())
        assert remote.value.kind == "saturated"

        text = httpx.get(server.url + "/metrics").text
        assert metric(text, "personaplex_phone_refusals_total", reason="saturated") == len(CARRIERS)
        assert metric(text, "personaplex_chat_errors_total", kind="saturated") >= 2
        assert manager.active_count == 0 and manager.reserved_count == 0  # nothing was held


def readyz_of(url: str) -> httpx.Response:
    return httpx.get(url + "/readyz", timeout=10)
