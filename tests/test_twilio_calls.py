"""Call control: outbound calls (endpoint and CLI), hang-ups when a session ends on the server,
DTMF, status callbacks. Twilio's REST cloud is the one thing faked, at its HTTP boundary
(support_twilio.FakeTwilioCloud). The server is the real app under a real uvicorn, in this
process so the fake can be handed to it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from urllib.parse import parse_qs, urlsplit

import httpx
import numpy as np
import pytest
from support_twilio import ACCOUNT_SID, BridgeHarness, FakeTwilioCloud, bridge_harness, parse_stream_twiml

AUTH_TOKEN = "calls-test-auth-token"
API_TOKEN = "calls-test-api-token"
API = f"https://api.twilio.com/2010-04-01/Accounts/{ACCOUNT_SID}/Calls"


@pytest.fixture
def harness(tmp_path) -> Iterator[BridgeHarness]:
    personas = (
        "default: desk\npersonas:\n  desk: {text_prompt: 'Front desk.'}\n  sales: {text_prompt: 'Sales.'}\n"
    )
    # The manager ends sessions after 1.5 s of audio: a server-side end the bridge must act on.
    with bridge_harness(
        personas,
        tmp_path,
        manager_options={"max_call_s": 1.5},
        auth_token=AUTH_TOKEN,
        api_token=API_TOKEN,
        hangup_digits="#",
    ) as h:
        yield h


Harness = BridgeHarness


def calls_state(h: Harness) -> dict:
    response = httpx.get(h.url + "/twilio/calls", headers={"Authorization": f"Bearer {API_TOKEN}"})
    assert response.status_code == 200
    return response.json()


async def wait_for(predicate, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")


def test_outbound_call_endpoint_builds_the_rest_request(harness: Harness) -> None:
    response = httpx.post(
        harness.url + "/twilio/call",
        json={"to": "+15550001111", "from": "+15550002222", "persona": "sales"},
        headers={"Authorization": f"Bearer {API_TOKEN}"},
    )
    assert response.status_code == 201, response.text
    (sent,) = harness.cloud.requests
    assert (sent.method, sent.url) == ("POST", API + ".json")
    assert sent.auth == (ACCOUNT_SID, AUTH_TOKEN)
    assert sent.data["To"] == "+15550001111" and sent.data["From"] == "+15550002222"
    assert sent.data["Url"] == harness.url + "/twilio/voice?persona=sales"
    assert sent.data["Method"] == "POST"
    assert sent.data["StatusCallback"] == harness.url + "/twilio/status"
    assert sent.data["StatusCallbackEvent"] == ["initiated", "ringing", "answered", "completed"]
    assert int(sent.data["TimeLimit"]) == 900
    assert response.json()["call_sid"] == "CA" + f"{1:032x}"


def test_outbound_call_with_a_one_off_persona_is_answered_with_it(harness: Harness) -> None:
    response = httpx.post(
        harness.url + "/twilio/call",
        json={"to": "+15550001111", "from": "+15550002222", "text_prompt": "You sell anvils."},
        headers={"Authorization": f"Bearer {API_TOKEN}"},
    )
    assert response.status_code == 201, response.text
    url = harness.cloud.requests[0].data["Url"]
    query = parse_qs(urlsplit(url).query)
    assert set(query) == {"outbound"}  # the prompt stays on the server; only a one-time token travels
    # The callee answers: Twilio fetches that URL, signed over it (query string included).
    form = {"AccountSid": ACCOUNT_SID, "CallSid": response.json()["call_sid"], "To": "+15550001111"}
    answer = harness.sim.post_webhook("/twilio/voice?" + urlsplit(url).query, form)
    assert answer.status_code == 200 and "<Stream" in answer.text
    stream_url, params = parse_stream_twiml(answer.text)

    async def stream() -> str:
        async with harness.sim.media_stream(stream_url, params, call_sid=form["CallSid"]):
            await wait_for(lambda: harness.manager.sessions)
            return harness.manager.sessions[0].persona.text_prompt

    assert asyncio.run(stream()) == "You sell anvils."  # the ticket carried the one-off persona
    # The token is single-use.
    again = harness.sim.post_webhook("/twilio/voice?" + urlsplit(url).query, form)
    assert "<Stream" not in again.text and "<Hangup" in again.text


def test_outbound_call_endpoint_refuses_without_the_token_or_a_known_persona(harness: Harness) -> None:
    body = {"to": "+15550001111", "from": "+15550002222"}
    assert httpx.post(harness.url + "/twilio/call", json=body).status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    assert httpx.post(harness.url + "/twilio/call", json=body, headers=wrong).status_code == 401
    good = {"Authorization": f"Bearer {API_TOKEN}"}
    response = httpx.post(harness.url + "/twilio/call", json={**body, "persona": "ghost"}, headers=good)
    assert response.status_code == 400 and "ghost" in response.json()["error"]
    assert httpx.post(harness.url + "/twilio/call", content=b"{", headers=good).status_code == 400
    assert harness.cloud.requests == []


def test_call_command_builds_the_rest_request(monkeypatch, capsys) -> None:
    import personaplex_twilio.cli as twilio_cli

    from personaplex_voice.cli import main

    cloud = FakeTwilioCloud()
    monkeypatch.setattr(twilio_cli, "make_http_client", lambda: cloud)
    monkeypatch.setenv("TWILIO_ACCOUNT_SID", ACCOUNT_SID)
    monkeypatch.setenv("TWILIO_AUTH_TOKEN", AUTH_TOKEN)
    monkeypatch.setenv("PUBLIC_URL", "https://voice.example.test")
    main(
        ["call", "--to", "+15550003333", "--from", "+15550004444", "--persona", "sales", "--time-limit", "60"]
    )
    (sent,) = cloud.requests
    assert (sent.method, sent.url) == ("POST", API + ".json")
    assert sent.data["To"] == "+15550003333" and sent.data["From"] == "+15550004444"
    assert sent.data["Url"] == "https://voice.example.test/twilio/voice?persona=sales"
    assert sent.data["StatusCallback"] == "https://voice.example.test/twilio/status"
    assert sent.data["TimeLimit"] == 60
    assert capsys.readouterr().out.strip() == "CA" + f"{1:032x}"


def test_call_command_without_credentials_is_a_one_line_error(monkeypatch, capsys) -> None:
    from personaplex_voice.cli import main

    for name in ("TWILIO_ACCOUNT_SID", "TWILIO_AUTH_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PUBLIC_URL", "https://voice.example.test")
    with pytest.raises(SystemExit) as info:
        main(["call", "--to", "+15550003333", "--from", "+15550004444"])
    assert info.value.code == 2
    assert "TWILIO_ACCOUNT_SID" in capsys.readouterr().err


async def test_server_side_end_hangs_the_call_up(harness: Harness) -> None:
    call_sid, url, params = await asyncio.to_thread(harness.sim.answer)
    async with harness.sim.media_stream(url, params, call_sid=call_sid) as call:
        # Keep talking: the manager's 1.5 s limit ends the session, not silence.
        talker = asyncio.create_task(call.play(np.zeros(8000 * 4, np.float32)))
        await asyncio.wait_for(call.closed.wait(), 10)
        talker.cancel()
    assert harness.cloud.hangups() == [call_sid]
    assert call.clears == 1  # what Twilio still held of ours was dropped first
    state = await asyncio.to_thread(calls_state, harness)
    record = next(c for c in state["calls"] if c["call_sid"] == call_sid)
    assert "max_duration" in record["end_reason"]
    assert state["active_sessions"] == 0


async def test_hangup_digit_ends_the_call_and_digits_are_logged(harness: Harness) -> None:
    call_sid, url, params = await asyncio.to_thread(harness.sim.answer)
    async with harness.sim.media_stream(url, params, call_sid=call_sid) as call:
        await call.play(np.zeros(1600, np.float32))
        await call.dtmf("4")
        await call.dtmf("2")
        await asyncio.sleep(0.1)
        assert not call.closed.is_set()
        await call.dtmf("#")
        await asyncio.wait_for(call.closed.wait(), 10)
    assert harness.cloud.hangups() == [call_sid]
    state = await asyncio.to_thread(calls_state, harness)
    record = next(c for c in state["calls"] if c["call_sid"] == call_sid)
    assert [e["event"] for e in record["events"]] == ["dtmf:4", "dtmf:2", "dtmf:#"]
    assert record["end_reason"] == "hang-up digit #"
    assert record["metrics"]["dtmf"] == "42#"


async def test_caller_hanging_up_ends_the_session_without_a_rest_call(harness: Harness) -> None:
    call_sid, url, params = await asyncio.to_thread(harness.sim.answer)
    async with harness.sim.media_stream(url, params, call_sid=call_sid) as call:
        await call.play(np.zeros(1600, np.float32))
    # `stop` came from Twilio: the call is already over, nothing to hang up.
    await wait_for(lambda: harness.manager.active_count == 0)
    assert harness.cloud.hangups() == []
    status = harness.sim.status_callback(call_sid, "completed", CallDuration="1")
    assert status.status_code == 204
    record = next(c for c in calls_state(harness)["calls"] if c["call_sid"] == call_sid)
    assert [s["status"] for s in record["statuses"]][-1] == "completed"
    assert record["end_reason"] == "stop"


async def test_a_silent_stream_hits_the_idle_limit_and_is_hung_up(harness: Harness) -> None:
    harness.app.state.twilio.settings.idle_timeout_s = 0.5  # Twilio stopped sending anything
    call_sid, url, params = await asyncio.to_thread(harness.sim.answer)
    async with harness.sim.media_stream(url, params, call_sid=call_sid) as call:
        await asyncio.wait_for(call.closed.wait(), 10)
    assert harness.cloud.hangups() == [call_sid]
    record = next(c for c in calls_state(harness)["calls"] if c["call_sid"] == call_sid)
    assert record["end_reason"] == "idle timeout"
    await wait_for(lambda: harness.manager.active_count == 0)


async def test_media_far_faster_than_real_time_ends_only_that_call(harness: Harness) -> None:
    """A stream sending seconds of audio per message (64 KiB messages, the bridge's limit) is
    refused once past a 10 s burst at 1.5x real time, before its decoding costs the others."""
    call_sid, url, params = await asyncio.to_thread(harness.sim.answer)
    async with harness.sim.media_stream(url, params, call_sid=call_sid) as call:
        six_seconds = b"\xff" * 48_000  # 64 KiB of JSON once base64-encoded
        for _ in range(10):
            if call.closed.is_set():
                break
            await call.send_media(six_seconds)
        await asyncio.wait_for(call.closed.wait(), 10)
    state = await asyncio.to_thread(calls_state, harness)
    record = next(c for c in state["calls"] if c["call_sid"] == call_sid)
    assert record["end_reason"] == "protocol error: caller audio arrives much faster than real time"
    assert state["active_sessions"] == 0


async def test_a_dtmf_message_with_two_digits_is_refused_saying_what_came(harness: Harness) -> None:
    call_sid, url, params = await asyncio.to_thread(harness.sim.answer)
    async with harness.sim.media_stream(url, params, call_sid=call_sid) as call:
        await call.play(np.zeros(1600, np.float32))
        await call.dtmf("12")
        await asyncio.wait_for(call.closed.wait(), 10)
    state = await asyncio.to_thread(calls_state, harness)
    record = next(c for c in state["calls"] if c["call_sid"] == call_sid)
    assert record["end_reason"] == 'protocol error: `dtmf` needs one digit, got `digit` "12"'


def test_outbound_calls_carry_template_variables_in_the_signed_webhook_url(monkeypatch, tmp_path) -> None:
    import personaplex_twilio.cli as twilio_cli

    from personaplex_voice.cli import main

    personas = tmp_path / "p.yaml"
    personas.write_text(
        "personas:\n  default: {text_prompt: 'Hi {customer_name}.', variables: {customer_name: there}}\n"
    )
    cloud = FakeTwilioCloud()
    monkeypatch.setattr(twilio_cli, "make_http_client", lambda: cloud)
    monkeypatch.setenv("TWILIO_ACCOUNT_SID", ACCOUNT_SID)
    monkeypatch.setenv("TWILIO_AUTH_TOKEN", AUTH_TOKEN)
    monkeypatch.setenv("PUBLIC_URL", "https://voice.example.test")
    monkeypatch.setenv("PERSONAPLEX_TWILIO_PERSONAS_FILE", str(personas))
    main(["call", "--to", "+15550003333", "--from", "+15550004444", "--var", "customer_name=Omar Torres"])
    (sent,) = cloud.requests
    assert parse_qs(urlsplit(sent.data["Url"]).query) == {"customer_name": ["Omar Torres"]}
    with pytest.raises(SystemExit):
        main(["call", "--to", "+15550003333", "--from", "+15550004444", "--var", "account=1"])


def test_the_outbound_endpoint_refuses_undeclared_variables(harness: Harness) -> None:
    good = {"Authorization": f"Bearer {API_TOKEN}"}
    body = {"to": "+15550001111", "from": "+15550002222", "variables": {"account": "1"}}
    response = httpx.post(harness.url + "/twilio/call", json=body, headers=good)
    assert response.status_code == 400 and "account" in response.json()["error"]
    assert harness.cloud.requests == []
