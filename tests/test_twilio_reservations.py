"""A Twilio webhook's reservation is a real slot for every transport, redeemed only by its ticket.

One real server (`--max-sessions 1`, echo engine, the bridge mounted), Twilio simulated at its
edge: while a webhook's reservation is outstanding `/readyz` says full and `/api/chat` is
refused; the stream with the call's ticket is served; the bare stream URL and a stream with a
made-up ticket get no session; an unredeemed ticket frees the slot after its TTL.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest
from support_server import ServerProcess, running_server
from support_twilio import TwilioSimulator
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

pytestmark = pytest.mark.timeout(120)

AUTH_TOKEN = "reservations-test-token"
PUBLIC_URL = "https://voice.example.test"
TTL_S = 1.5


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    personas = tmp_path_factory.mktemp("twilio") / "personas.yaml"
    personas.write_text("default: desk\npersonas:\n  desk: {text_prompt: 'You answer the phone.'}\n")
    env = {
        "TWILIO_AUTH_TOKEN": AUTH_TOKEN,
        "TWILIO_ACCOUNT_SID": "",
        "PUBLIC_URL": PUBLIC_URL,
        "PERSONAPLEX_TWILIO_PERSONAS_FILE": str(personas),
        "PERSONAPLEX_TWILIO_STREAM_CONNECT_TIMEOUT_S": str(TTL_S),
    }
    with running_server("--twilio", "--max-sessions", "1", env=env) as proc:
        yield proc


def readyz(server: ServerProcess) -> httpx.Response:
    return httpx.get(server.url + "/readyz", timeout=5)


async def chat_refusal(server: ServerProcess) -> str:
    """What /api/chat says to a browser caller now (its 0x05 text, or "" if it got in)."""
    async with connect(server.ws_url + "/api/chat?text_prompt=hi", proxy=None, open_timeout=10) as ws:
        while True:
            message = await asyncio.wait_for(ws.recv(), 10)
            if isinstance(message, bytes) and message[:1] == b"\x05":
                return message[1:].decode()
            if isinstance(message, bytes) and message[:1] == b"\x00":
                return ""


async def test_a_webhook_reservation_holds_the_only_slot_for_its_own_stream(server) -> None:
    sim = TwilioSimulator(server.url, AUTH_TOKEN, public_url=PUBLIC_URL)
    assert readyz(server).status_code == 200
    call_sid, url, params = await asyncio.to_thread(sim.answer)

    # The reservation is a slot taken, for everybody.
    ready = readyz(server)
    assert ready.status_code == 503 and ready.json()["reserved"] == 1, ready.text
    assert "full" in await chat_refusal(server)
    busy = await asyncio.to_thread(sim.voice_webhook)
    assert "<Stream" not in busy.text and "busy" in busy.text

    # The bare stream URL is refused at the upgrade; a made-up ticket opens no session.
    bare = url.rsplit("/", 1)[0]
    with pytest.raises(InvalidStatus) as refused:
        async with sim.media_stream(bare, params, call_sid=call_sid):
            pass
    assert refused.value.response.status_code == 403
    async with sim.media_stream(bare + "/not-the-ticket-000000000", params, call_sid=call_sid) as fake:
        await asyncio.wait_for(fake.closed.wait(), 10)
    assert not fake.played
    assert readyz(server).json()["reserved"] == 1  # the real ticket is still outstanding

    # The stream that presents the call's ticket gets the slot and the agent's audio.
    async with sim.media_stream(url, params, call_sid=call_sid) as call:
        await call.answered()
        assert readyz(server).json()["active"] == 1
    await asyncio.to_thread(sim.status_callback, call_sid, "completed")
    deadline = time.monotonic() + 10
    while readyz(server).status_code != 200:
        assert time.monotonic() < deadline, readyz(server).text
        await asyncio.sleep(0.05)


async def test_an_unredeemed_ticket_frees_the_slot_after_its_ttl(server) -> None:
    sim = TwilioSimulator(server.url, AUTH_TOKEN, public_url=PUBLIC_URL)
    deadline = time.monotonic() + 10
    while readyz(server).status_code != 200:  # the other test's call may still be winding down
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    await asyncio.to_thread(sim.answer)  # Twilio never connects the stream, never calls back
    issued = time.monotonic()
    assert readyz(server).status_code == 503
    while readyz(server).status_code != 200:
        assert time.monotonic() - issued < TTL_S + 2.0, readyz(server).text
        await asyncio.sleep(0.05)
    assert time.monotonic() - issued >= TTL_S - 0.1
    assert await chat_refusal(server) == ""  # a browser caller gets in again
