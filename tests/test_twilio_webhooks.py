"""Post-call webhooks: each ended call's record reaches the persona's webhook URL (a real local
HTTP sink here), signed with HMAC-SHA256 over the body; a sink that is down is retried with
back-off, off the call's path (the call itself is unaffected)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time

import numpy as np
from support_twilio import HttpSink, bridge_harness

SECRET = "post-call-shared-secret"
PERSONAS = """
default: desk
personas:
  desk:
    text_prompt: "You answer for Acme."
    webhook_url: URL
"""


def verify(secret: str, body: bytes, header: str) -> bool:
    """The three lines a receiver needs (docs/contact-center.md)."""
    expected = "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected, header)


async def one_call(h, seconds: float = 1.0):
    call_sid, url, params = await asyncio.to_thread(h.sim.answer)
    async with h.sim.media_stream(url, params, call_sid=call_sid) as call:
        await call.answered()
        await call.play(np.zeros(round(8000 * seconds), np.float32))
    return call_sid, call


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


async def test_the_record_reaches_the_sink_signed(tmp_path) -> None:
    with (
        HttpSink() as sink,
        bridge_harness(PERSONAS.replace("URL", sink.url + "/calls"), tmp_path, webhook_secret=SECRET) as h,
    ):
        call_sid, _ = await one_call(h)
        await asyncio.to_thread(sink.got.wait, 10)
        (request,) = sink.received
        await asyncio.to_thread(wait_for, lambda: h.record(call_sid)["webhook"] is not None)
        record = await asyncio.to_thread(h.record, call_sid)
    assert request.path == "/calls"
    assert verify(SECRET, request.body, request.headers["x-personaplex-signature"])
    assert not verify("another secret", request.body, request.headers["x-personaplex-signature"])
    assert request.headers["x-personaplex-event"] == "call.ended"
    body = json.loads(request.body)
    assert body["call_sid"] == call_sid and body["end_reason"] == "stop" and body["live"] is False
    assert body["prompt"] == "You answer for Acme." and body["transcript"] == record["transcript"]
    assert record["webhook"] == {"url": sink.url + "/calls", "delivered": True, "attempts": 1, "status": 200}


async def test_a_sink_that_is_down_is_retried_and_the_call_is_unaffected(tmp_path) -> None:
    # Down (503) for the first two attempts, then up.
    with (
        HttpSink(lambda n: (503, {}) if n <= 2 else (200, {})) as sink,
        bridge_harness(
            PERSONAS.replace("URL", sink.url), tmp_path, webhook_secret=SECRET, webhook_backoff_s=0.2
        ) as h,
    ):
        call_sid, call = await one_call(h, seconds=2.0)
        record = await asyncio.to_thread(h.record, call_sid)
        assert record["end_reason"] == "stop" and record["metrics"]["late_frames"] == 0
        heard_s = sum(len(p.payload) for p in call.played) / 8000  # μ-law: a byte a sample
        assert call.close_code == 1000 and heard_s >= 1.8  # two seconds of agent audio
        await asyncio.to_thread(wait_for, lambda: len(sink.received) >= 3)
        await asyncio.to_thread(wait_for, lambda: (h.record(call_sid)["webhook"] or {}).get("delivered"))
        record = await asyncio.to_thread(h.record, call_sid)
    assert record["webhook"]["attempts"] == 3
    deliveries = {r.headers["x-personaplex-delivery"] for r in sink.received}
    assert len(deliveries) == 1  # one id for every retry: the receiver deduplicates on it
    assert len({r.body for r in sink.received}) == 1


async def test_a_sink_that_never_comes_back_is_given_up_after_the_retry_window(tmp_path) -> None:
    with (
        HttpSink(lambda n: (500, {})) as sink,
        bridge_harness(
            PERSONAS.replace("URL", sink.url),
            tmp_path,
            webhook_secret=SECRET,
            webhook_backoff_s=0.1,
            webhook_retry_s=0.5,
        ) as h,
    ):
        call_sid, _ = await one_call(h, seconds=0.3)
        await asyncio.to_thread(wait_for, lambda: h.record(call_sid)["webhook"] is not None)
        outcome = (await asyncio.to_thread(h.record, call_sid))["webhook"]
    assert outcome["delivered"] is False and outcome["status"] == 500 and 2 <= outcome["attempts"] <= 4


def test_a_webhook_without_a_secret_is_refused_at_start(tmp_path) -> None:
    import pytest

    from personaplex_voice.errors import UserError

    with (
        pytest.raises(UserError, match="PERSONAPLEX_TWILIO_WEBHOOK_SECRET"),
        bridge_harness(PERSONAS.replace("URL", "https://crm.example.test/calls"), tmp_path),
    ):
        pass
