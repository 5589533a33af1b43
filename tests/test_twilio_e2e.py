"""Phone calls end to end: the Twilio simulator against `personaplex-voice serve --twilio` (uvicorn).

The server runs with the echo engine (a LoopbackEngine, 1 frame of delay) behind a pretend
public URL (`https://voice.example.test`, as behind a tunnel): the simulator signs for that URL
and dials the real port, so signatures are checked against PUBLIC_URL, not the Host header.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from support_server import ServerProcess, running_server
from support_twilio import (
    RATE,
    TwilioSimulator,
    blockwise_snr_db,
    tone,
)
from websockets.exceptions import InvalidStatus

AUTH_TOKEN = "test-auth-token-0123456789abcdef"
API_TOKEN = "test-api-token"
PUBLIC_URL = "https://voice.example.test"
SLOTS = 2
ENGINE_DELAY_FRAMES = 1  # the echo engine's delay line (LoopbackEngine default)
INBOUND_SLACK_S = 0.030  # TwilioSettings.inbound_slack_ms
PLAYOUT_CUSHION_S = 0.040  # TwilioSettings.playout_cushion_ms

PERSONAS = {
    "default": "front-desk",
    "personas": {
        "front-desk": {"text_prompt": "You answer the phone for Acme."},
        "sales": {"text_prompt": "You sell anvils.", "voice": "LOOPM0", "seed": 7},
    },
    "numbers": {"+1 (555) 010-0009": "sales"},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    personas = tmp_path_factory.mktemp("twilio") / "personas.json"
    personas.write_text(json.dumps(PERSONAS))
    env = {
        "TWILIO_AUTH_TOKEN": AUTH_TOKEN,
        "TWILIO_ACCOUNT_SID": "",  # no REST client: nothing may reach Twilio's cloud
        "PUBLIC_URL": PUBLIC_URL,
        "PERSONAPLEX_TWILIO_API_TOKEN": API_TOKEN,
        "PERSONAPLEX_TWILIO_PERSONAS_FILE": str(personas),
    }
    with running_server("--twilio", "--max-sessions", str(SLOTS), env=env) as proc:
        yield proc


@pytest.fixture
def sim(server: ServerProcess) -> TwilioSimulator:
    return TwilioSimulator(server.url, AUTH_TOKEN, public_url=PUBLIC_URL)


def bridge_state(server: ServerProcess) -> dict:
    response = httpx.get(server.url + "/twilio/calls", headers={"Authorization": f"Bearer {API_TOKEN}"})
    assert response.status_code == 200, response.text
    return response.json()


async def wait_idle(server: ServerProcess, timeout: float = 10.0, active: int = 0) -> dict:
    """Poll until the server holds `active` sessions and no reservation (the slots are freed)."""
    state: dict = {}
    for _ in range(int(timeout / 0.05)):
        state = await asyncio.to_thread(bridge_state, server)
        if state["active_sessions"] == active and state["reserved"] == 0:
            return state
        await asyncio.sleep(0.05)
    raise AssertionError(f"slots not freed: {state}")


async def wait_audio(call, timeout: float = 10.0) -> int:
    """Until the server streams to the call (its session is running); the caller's line sends
    silence meanwhile, as Twilio's does. Returns the samples of it sent."""
    return await call.answered(timeout)


def echo_delay_and_snr(played: np.ndarray, sent: np.ndarray, sent_at: int) -> tuple[float, np.ndarray]:
    """Where the tone came back (seconds after it was sent) and the SNR of each 100 ms of it.

    The onset is where the echo's 1 ms RMS first reaches half the tone's RMS (a pure tone is a poor
    correlation probe: it matches itself every period)."""
    period = RATE // 1000
    rms = np.sqrt(np.convolve(played**2, np.ones(period) / period, "valid"))
    above = np.nonzero(rms >= 0.5 * np.sqrt(np.mean(sent**2)))[0]
    assert len(above), "the tone never came back"
    onset = int(above[0])
    echo = played[onset : onset + len(sent)]
    trim = RATE // 20  # the onset and end are transitions, not steady tone
    return (onset - sent_at) / RATE, blockwise_snr_db(echo[trim:-trim], 1000.0)


def stalls(call, metrics: dict, before_s: float | None = None) -> tuple[int, float]:
    """What a starved machine did to a call, as the server and the simulator report them:
    (holes the echo may have, extra delay it may have gained).

    Each input frame the engine's clock found missing becomes an 80 ms hole (and 80 ms more delay);
    each time Twilio's buffer of ours ran dry the caller heard a hole of that length; audio
    dropped from an overfull outbound buffer is a hole too; a grown playout cushion is delay."""
    late_in = (metrics.get("session") or {}).get("late_frames", 0)
    # Twilio's buffer ran dry: as the server's pacer saw it, and as the simulator heard it (its
    # own process may be the one that stalled; then only it sees the gap).
    late_out = metrics["late_frames"] + call.late_frames + -(-metrics["outbound_dropped"] // 4)
    extra_delay = (
        0.080 * late_in
        + call.underrun_s(before_s)
        + (metrics["playout_cushion_ms"] / 1000 - PLAYOUT_CUSHION_S)
    )
    return late_in + late_out, extra_delay


def assert_clean(snr: np.ndarray, holes: int, what: str) -> None:
    """SNR >= 30 dB in the median and in every 100 ms block but those a reported hole touches
    (a hole spoils at most two blocks). On an idle machine there are no holes at all."""
    bad = int(np.sum(snr < 30.0))
    assert np.median(snr) >= 30.0 and bad <= 2 * holes, (
        f"{what}: median SNR {np.median(snr):.1f} dB, {bad} of {len(snr)} blocks < 30 dB, {holes} holes"
    )


# --- the webhook ------------------------------------------------------------------------------


def test_webhook_answers_a_signed_stream_with_the_numbers_persona(server, sim) -> None:
    sales_sid, url, params = sim.answer(to="+15550100009")
    # PUBLIC_URL https -> wss, no query; the call's one-time ticket is the last path segment.
    prefix = "wss://voice.example.test/twilio/media-stream/"
    assert url.startswith(prefix) and len(url) - len(prefix) >= 22
    assert params["persona"] == "sales"
    other_sid, other_url, params = sim.answer(to="+15550100077")  # not listed: the default persona
    assert params["persona"] == "front-desk"
    assert other_url != url
    assert bridge_state(server)["reserved"] == 2  # both calls hold a slot until their stream starts
    # The callers hang up before the streams connect: the status callback frees the slots.
    for call_sid in (sales_sid, other_sid):
        assert sim.status_callback(call_sid, "completed", CallDuration="0").status_code == 204
    state = bridge_state(server)
    assert state["reserved"] == 0
    record = next(c for c in state["calls"] if c["call_sid"] == sales_sid)
    assert [s["status"] for s in record["statuses"]] == ["webhook", "completed"]
    assert record["persona"] == "sales" and record["to"] == "+15550100009"
    assert sim.status_callback(sales_sid, "completed").status_code == 204
    unsigned = TwilioSimulator(server.url, "not-the-token", public_url=PUBLIC_URL)
    assert unsigned.status_callback(sales_sid, "completed").status_code == 403


@pytest.mark.parametrize("signature", [None, "bm90IGEgc2lnbmF0dXJl"])
def test_webhook_without_a_valid_signature_is_refused(server, sim, signature) -> None:
    before = bridge_state(server)
    response = sim.voice_webhook(signature=signature)
    assert response.status_code == 403
    assert "<Stream" not in response.text
    after = bridge_state(server)
    assert after["reserved"] == before["reserved"] == 0
    assert after["active_sessions"] == 0


def test_webhook_signed_for_another_url_is_refused(server) -> None:
    # Signed by the right token but over the Host-header URL, not PUBLIC_URL: a replay elsewhere.
    sim = TwilioSimulator(server.url, AUTH_TOKEN, public_url=server.url)
    assert sim.voice_webhook().status_code == 403


@pytest.mark.parametrize("signature", [None, "wrong", "sign-with-other-token"])
async def test_upgrade_without_a_valid_signature_is_refused(server, sim, signature) -> None:
    call_sid, url, params = sim.answer()
    if signature == "sign-with-other-token":
        signature = TwilioSimulator(server.url, "another-token", public_url=PUBLIC_URL).sign(url, {})
    with pytest.raises(InvalidStatus) as info:
        async with sim.media_stream(url, params, signature=signature):
            pass
    assert info.value.response.status_code == 403
    state = await asyncio.to_thread(bridge_state, server)
    assert state["active_sessions"] == 0 and not state["live_streams"]
    # Twilio gives up on the stream and ends the call: its status callback frees the reservation.
    await asyncio.to_thread(sim.status_callback, call_sid, "completed")
    await wait_idle(server)


# --- audio --------------------------------------------------------------------------------------


async def test_a_tone_comes_back_clean_at_the_expected_delay(server, sim) -> None:
    call_sid, url, params = sim.answer()
    # The lead is a whole number of engine frames (6 x 80 ms), so the tone starts a frame.
    lead, signal = np.zeros(6 * 640, np.float32), tone(1000.0, 1.5)
    async with sim.media_stream(url, params, call_sid=call_sid) as call:
        primed = await wait_audio(call)
        await call.play(lead)
        await call.play(signal)
        await call.play(np.zeros(RATE // 2, np.float32))
    delay, snr = echo_delay_and_snr(call.played_audio(), signal, primed + len(lead))
    state = await wait_idle(server)
    record = next(c for c in state["calls"] if c["call_sid"] == call_sid)
    metrics = record["metrics"]
    holes, extra = stalls(call, metrics, before_s=((primed + len(lead)) / RATE) + delay)
    print(f"echo delay {delay * 1000:.1f} ms, median SNR {np.median(snr):.1f} dB, holes {holes}")
    assert_clean(snr, holes, f"echo ({metrics})")
    # Mouth to ear: a sample waits for the rest of its 80 ms frame to arrive, then `slack` for
    # the engine's tick (the bridge phases the call against the frame clock so each frame is
    # complete that long before its tick), then the engine's delay line, the resamplers (~2 ms)
    # and the playout cushion Twilio holds before it. A sample's wait for its frame plus its
    # place in the output frame always add up to one frame.
    expected = 0.080 + INBOUND_SLACK_S + ENGINE_DELAY_FRAMES * 0.080 + 0.002 + PLAYOUT_CUSHION_S
    # A starved machine (CI runs tests in parallel) adds exactly what the stalls account for.
    top = expected + 0.020 + 0.100 + extra
    assert expected - 0.025 <= delay <= top, f"echo after {delay * 1000:.0f} ms ({metrics})"
    # Twilio never held more than ~100 ms of ours; marks came back; the server cleared at the end.
    assert call.max_queued_s <= 0.105
    assert len(call.marks_echoed) >= 20
    assert record["end_reason"] == "stop"
    assert metrics["frames_in"] == call.chunk
    assert metrics["frames_out"] >= len(call.played)
    assert metrics["marks_acked"] >= 20
    assert 0 < metrics["queued_ms_marks_p50"] <= 110


async def test_busy_when_every_slot_is_taken(server, sim) -> None:
    calls = [sim.answer() for _ in range(SLOTS)]
    async with (
        sim.media_stream(calls[0][1], calls[0][2], call_sid=calls[0][0]) as a,
        sim.media_stream(calls[1][1], calls[1][2], call_sid=calls[1][0]) as b,
    ):
        await wait_audio(a)
        await wait_audio(b)
        response = sim.voice_webhook()
        assert response.status_code == 200
        assert "<Stream" not in response.text and "<Hangup" in response.text and "<Say>" in response.text
        assert "busy" in response.text
    await wait_idle(server)
    call_sid, url, params = sim.answer()  # free again
    async with sim.media_stream(url, params, call_sid=call_sid) as call:
        await wait_audio(call)
    await wait_idle(server)


# --- garbage on the socket -------------------------------------------------------------------

ONE_MIB = "x" * (1 << 20)


async def _garbage_call(sim: TwilioSimulator, kind: str) -> int | None:
    call_sid, url, params = await asyncio.to_thread(sim.answer)  # never block the other call's loop
    async with sim.media_stream(
        url, params, call_sid=call_sid, send_start=kind != "media-before-start"
    ) as call:
        if kind == "media-before-start":
            await call.send_media(b"\xff" * 160)
        else:
            await wait_audio(call)
            if kind == "invalid-json":
                await call.send_raw("{not json")
            elif kind == "bad-base64":
                await call.send(
                    {
                        "event": "media",
                        "sequenceNumber": call._next_seq(),
                        "media": {
                            "track": "inbound",
                            "chunk": "1",
                            "timestamp": "0",
                            "payload": "@@@not-b64",
                        },
                        "streamSid": call.stream_sid,
                    }
                )
            elif kind == "wrong-stream-sid":
                call.stream_sid, real = "MZ" + "f" * 32, call.stream_sid
                call._sid_tail = ""  # the simulator caches the end of its media messages
                await call.send_media(b"\xff" * 160)
                call.stream_sid, call._sid_tail = real, ""
            elif kind == "one-mib-frame":
                await call.send_raw(ONE_MIB)
        await asyncio.wait_for(call.closed.wait(), 10)
    # Twilio ends a call whose stream failed; its status callback frees a reservation never claimed.
    await asyncio.to_thread(sim.status_callback, call_sid, "completed")
    return call.close_code


async def test_garbage_closes_only_that_call(server, sim) -> None:
    call_sid, url, params = sim.answer()
    signal = tone(1000.0, 3.0)
    tail = np.zeros(RATE // 2, np.float32)  # room for the echo to come back
    async with sim.media_stream(url, params, call_sid=call_sid) as good:
        await wait_audio(good)
        player = asyncio.create_task(good.play(np.concatenate([signal, tail])))
        codes = {}
        for kind in ("invalid-json", "bad-base64", "media-before-start", "wrong-stream-sid", "one-mib-frame"):
            codes[kind] = await _garbage_call(sim, kind)
            await wait_idle(server, active=1)  # that call's slot is free, the good call still holds its own
        await player
        assert not good.closed.is_set()
    assert all(code is not None and code != 1000 for code in codes.values()), codes
    assert codes["one-mib-frame"] == 1009
    assert codes["invalid-json"] == 1007
    _, snr = echo_delay_and_snr(good.played_audio(), signal, 0)
    state = await wait_idle(server)
    metrics = next(c for c in state["calls"] if c["call_sid"] == call_sid)["metrics"]
    assert_clean(snr, stalls(good, metrics)[0], f"the concurrent call ({metrics})")


def test_call_list_needs_the_api_token(server) -> None:
    assert httpx.get(server.url + "/twilio/calls").status_code == 401
    assert httpx.post(server.url + "/twilio/call", json={"to": "+1555", "from": "+1666"}).status_code == 401


def test_examples_personas_file_loads() -> None:
    from personaplex_phone.personas import PersonaBook

    root = Path(__file__).resolve().parents[1]
    book = PersonaBook.load(root / "examples" / "twilio_personas.yaml")
    assert book.default in book.personas
    center = book.spec(book.for_number("+15551230003"))  # the contact-center example
    assert center.variables and center.record and {r.kind for r in center.actions} >= {"transfer", "play"}
    assert "{" not in center.render({}).text_prompt


async def test_a_stream_token_only_opens_its_own_call(server, sim) -> None:
    call_sid, url, params = sim.answer()
    async with sim.media_stream(url, params, call_sid="CA" + "0" * 32) as call:  # another call's sid
        await asyncio.wait_for(call.closed.wait(), 10)
    assert call.close_code == 1008 and not call.played
    await asyncio.to_thread(sim.status_callback, call_sid, "completed")
    await wait_idle(server)
