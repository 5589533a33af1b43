"""jambonz and Genesys Cloud end to end: each platform's simulated side (its `sim.py` in
personaplex_phone.simulator, written from the published protocols) against `personaplex-voice
serve --engine echo --carriers jambonz,genesys` under uvicorn, 127.0.0.1 only.

Per platform: a call without its ticket / API key / signature is refused; a good call's audio
comes back (echo similarity ≥ 0.8 at the platform's rate: L16 24 kHz on jambonz, PCMU 8 kHz on
Genesys); an interruption drops what the platform still held of ours (jambonz `killAudio`,
Genesys a `barge_in` event); a DTMF key fires the persona's transfer through the platform's own
control path (jambonz: the listen's actionHook answers a `dial`; Genesys: our `disconnect` and
then `closed` carry it as output variables); hanging up or closing frees the slot; the record
and the post-call webhook carry the platform's call id.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Iterator

import aiohttp
import httpx
import numpy as np
import pytest
from personaplex_genesys.sim import GenesysSide
from personaplex_jambonz import signatures
from personaplex_phone.simulator import PhoneSimulator
from support_audio import espeak_speech
from support_phone import (
    API_TOKEN,
    GENESYS_KEY,
    GENESYS_SECRET,
    JAMBONZ_SECRET,
    PUBLIC_URL,
    calls_state,
    carrier_env,
    carrier_side,
    wait_ended,
    wait_for,
    wait_idle,
    wrong_side,
)
from support_server import ServerProcess, echo_similarity, running_server
from support_twilio import HttpSink

from personaplex_voice.audio.resample import resample

pytestmark = pytest.mark.timeout(300)

PUBLIC_WS = "wss://voice.example.test"
TRANSFER_TO = "+15551230099"
IDLE_S = 5  # the server's idle limit: a line without caller audio this long is hung up
PERSONAS = """
default: desk
personas:
  desk:
    text_prompt: "You answer for Acme. The caller is {customer_name}."
    variables: {customer_name: "unknown"}
    webhook_url: SINK
    actions:
      - on_dtmf: "0"
        do: transfer
        to: "+15551230099"
        announce: "Connecting you to a colleague."
"""


@pytest.fixture(scope="module")
def sink() -> Iterator[HttpSink]:
    with HttpSink() as received:
        yield received


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, sink: HttpSink) -> Iterator[ServerProcess]:
    personas = tmp_path_factory.mktemp("platforms") / "personas.yaml"
    personas.write_text(PERSONAS.replace("SINK", sink.url + "/calls"))
    env = {**carrier_env(None, str(personas)), "PERSONAPLEX_PHONE_IDLE_TIMEOUT_S": str(IDLE_S)}
    with running_server("--carriers", "jambonz,genesys", "--max-sessions", "2", env=env) as proc:
        yield proc


@pytest.fixture(scope="module")
def speech(tmp_path_factory: pytest.TempPathFactory) -> tuple[np.ndarray, int]:
    pcm, rate = espeak_speech(tmp_path_factory.mktemp("speech"))
    return pcm[: rate * 3], rate


def jambonz(server: ServerProcess) -> PhoneSimulator:
    return PhoneSimulator(carrier_side("jambonz"), server.url, public_url=PUBLIC_URL)


def genesys(server: ServerProcess, key: str = GENESYS_KEY, secret: str = GENESYS_SECRET) -> PhoneSimulator:
    return PhoneSimulator(GenesysSide(key, secret), server.url, public_url=PUBLIC_URL)


def at(signal: tuple[np.ndarray, int], rate: int) -> np.ndarray:
    pcm, source = signal
    return resample(pcm, source, rate).astype(np.float32)


def similarity(sent: np.ndarray, heard: np.ndarray, rate: int) -> float:
    return echo_similarity(resample(sent, rate, 24000), resample(heard, rate, 24000))


def texts(call, kind: str) -> list[dict]:
    return [json.loads(o.payload) for o in call.others if o.name == kind]


# --- refused -----------------------------------------------------------------------------------------


async def test_jambonz_refuses_unsigned_wrongly_signed_stale_webhooks_and_streams_without_ticket(
    server,
) -> None:
    sim = jambonz(server)
    good = sim.side.answer_request(PUBLIC_URL, sim.new_call_id(), "+15550100001", "+15550100002")
    unsigned = good.__class__(good.method, good.path, {"Content-Type": "application/json"}, good.body)
    assert (await sim.request(unsigned))[0] == 403
    forged = wrong_side("jambonz").answer_request(PUBLIC_URL, "c1", "+1", "+2")
    assert (await sim.request(forged))[0] == 403
    stale_header = signatures.sign(JAMBONZ_SECRET, good.body, timestamp=1_600_000_000)
    stale = good.__class__(
        good.method, good.path, {**good.headers, "Jambonz-Signature": stale_header}, good.body
    )
    assert (await sim.request(stale))[0] == 403
    # A stream needs its ticket: the bare URL is refused at the upgrade; a ticket no answer
    # issued opens no session, and the socket is closed.
    async with aiohttp.ClientSession() as session:
        with pytest.raises(aiohttp.WSServerHandshakeError) as bare:
            await session.ws_connect(
                server.ws_url + "/jambonz/media-stream", protocols=("audio.jambonz.org",)
            )
        assert bare.value.status == 403
        ws = await session.ws_connect(
            server.ws_url + "/jambonz/media-stream/not-a-ticket", protocols=("audio.jambonz.org",)
        )
        await ws.send_str(json.dumps({"callSid": "c2", "sampleRate": 24000, "mixType": "mono"}))
        while (await ws.receive()).type not in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED):
            pass
        assert ws.closed
    state = await asyncio.to_thread(calls_state, server)
    assert state["reserved"] == 0 and state["active_sessions"] == 0


async def test_genesys_refuses_connections_without_the_key_or_a_valid_signature(server) -> None:
    good = genesys(server)
    cases = {
        "no API key": genesys(server, key="").side,
        "another API key": genesys(server, key="not-the-key").side,
        "no signature": genesys(server, secret="").side,
        "another client secret": genesys(server, secret=base64.b64encode(b"x" * 32).decode()).side,
    }
    async with aiohttp.ClientSession() as session:
        for what, side in cases.items():
            offer = side.offer(PUBLIC_URL, side.new_call_id())
            url, headers = side.upgrade(offer, PUBLIC_URL)
            headers = {k: v for k, v in headers.items() if v}
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await session.ws_connect(url.replace(PUBLIC_WS, server.ws_url), headers=headers)
            assert refused.value.status == 403, what
        # A signed upgrade seen once cannot be replayed.
        offer = good.side.offer(PUBLIC_URL, good.new_call_id())
        url, headers = good.side.upgrade(offer, PUBLIC_URL)
        first = await session.ws_connect(url.replace(PUBLIC_WS, server.ws_url), headers=headers)
        await first.close()
        with pytest.raises(aiohttp.WSServerHandshakeError) as replayed:
            await session.ws_connect(url.replace(PUBLIC_WS, server.ws_url), headers=headers)
        assert replayed.value.status == 403
    await wait_idle(server)


async def test_a_busy_genesys_call_is_told_so_and_the_flow_takes_over(server) -> None:
    """Both slots reserved (two jambonz calls answered): the session gets `disconnect` (error,
    action busy), answers `close`, gets `closed`; nothing is held."""
    await wait_idle(server)
    sim_j = jambonz(server)
    offers = [await sim_j.answer() for _ in range(2)]
    assert (await asyncio.to_thread(calls_state, server))["reserved"] == 2
    sim = genesys(server)
    offer = await sim.answer()
    async with sim.stream(offer, hang_up=False) as call:
        await asyncio.wait_for(call.closed.wait(), 15)
    (disconnect,) = texts(call, "disconnect")
    assert disconnect["parameters"]["reason"] == "error"
    assert disconnect["parameters"]["outputVariables"]["action"] == "busy"
    assert [m["type"] for m in texts(call, "closed")] == ["closed"]  # the close handshake, answered
    for o in offers:
        assert await sim_j.status(o.call_id, "completed") == 204
    await wait_idle(server)


# --- a call ------------------------------------------------------------------------------------------


async def test_a_jambonz_call_echoes_at_24_khz_and_hanging_up_frees_the_slot(server, sink, speech) -> None:
    await wait_idle(server)
    sim = jambonz(server)
    offer = await sim.answer(query="customer_name=Omar%20Torres")
    assert offer.inbound == offer.outbound and offer.inbound.rate == 24000 and offer.inbound.codec == "l16"
    said = at(speech, 24000)
    async with sim.stream(offer) as call:
        assert call.ws.protocol == "audio.jambonz.org"  # the subprotocol jambonz offers, accepted
        primed = await call.answered()
        await call.play(said)
        await call.play(np.zeros(24000 * 6 // 10, np.float32))
        assert (await asyncio.to_thread(calls_state, server))["active_sessions"] == 1
    score = similarity(said, call.heard()[primed:], 24000)
    print(f"jambonz: L16 24 kHz, echo similarity {score:.3f}")
    assert score >= 0.8
    # Paced: jambonz never holds more than ~100 ms of ours, and marks came back as it played.
    assert call.max_queued_s <= 0.105 and len(call.marks_echoed) >= 20
    await wait_idle(server)  # the caller hung up (the socket closed): the slot is free
    record = await wait_ended(server, offer.call_id)
    assert record["carrier"] == "jambonz" and record["end_reason"] == "stop"
    assert record["metrics"]["audio_in"] == "L16 24 kHz little-endian"
    assert "Omar Torres" in record["prompt"] and record["from"] == "+15550100002"
    await wait_for(
        lambda: any(json.loads(r.body)["call_sid"] == offer.call_id for r in sink.received), "webhook"
    )


async def test_a_jambonz_dtmf_key_transfers_through_the_listens_actionhook(server, speech) -> None:
    await wait_idle(server)
    sim = jambonz(server)
    offer = await sim.answer()
    async with sim.stream(offer, hang_up=False) as call:
        await call.answered()
        talking = asyncio.create_task(call.play(at(speech, 24000)))
        await asyncio.sleep(1.0)  # the agent is talking (the echo) when the caller presses 0
        await call.dtmf("0")
        await asyncio.wait_for(call.closed.wait(), 10)  # our listen ends: jambonz asks what next
        talking.cancel()
    # The interruption: killAudio dropped what jambonz still held of ours, at most ~100 ms.
    assert call.clears == 1 and call.dropped_by_clear_s[0] <= 0.105
    status, body = await sim.request(sim.side.action_request(PUBLIC_URL, offer.call_id))
    assert status == 200
    say, dial = json.loads(body)
    assert say == {"verb": "say", "text": "Connecting you to a colleague."}
    assert dial["verb"] == "dial" and dial["target"] == [{"type": "phone", "number": TRANSFER_TO}]
    # Asked again (or for a call with nothing to do): hang up.
    assert json.loads((await sim.request(sim.side.action_request(PUBLIC_URL, offer.call_id)))[1]) == [
        {"verb": "hangup"}
    ]
    record = await wait_ended(server, offer.call_id)
    (action,) = record["actions"]
    assert action["ok"] and action["trigger"] == "dtmf 0" and action["action"] == "transfer"
    assert record["end_reason"] == f"action transfer to {TRANSFER_TO} (dtmf 0)"
    assert record["metrics"]["marks_acked"] >= 1
    await wait_idle(server)


async def test_a_genesys_call_echoes_in_pcmu_and_closing_frees_the_slot(server, sink, speech) -> None:
    await wait_idle(server)
    sim = genesys(server)
    offer = await sim.answer(query="customer_name=Ada%20Lovelace")
    said = at(speech, 8000)
    async with sim.stream(offer) as call:
        primed = await call.answered()
        (opened,) = texts(call, "opened")
        assert opened["seq"] == 1 and opened["clientseq"] == 1
        assert opened["parameters"]["media"] == [
            {"type": "audio", "format": "PCMU", "channels": ["external"], "rate": 8000}
        ]
        await call.send(sim.side.ping(offer))
        await call.play(said)
        await call.play(np.zeros(8000 * 6 // 10, np.float32))
        assert (await asyncio.to_thread(calls_state, server))["active_sessions"] == 1
        (pong,) = texts(call, "pong")
    score = similarity(said, call.heard()[primed:], 8000)
    print(f"genesys: PCMU 8 kHz, echo similarity {score:.3f}")
    assert score >= 0.8
    (closed,) = texts(call, "closed")  # our answer to Genesys's `close`
    ours = [opened, pong, closed]
    assert [m["seq"] for m in ours] == [1, 2, 3] and all("clientseq" in m for m in ours)
    assert pong["clientseq"] == 2 and closed["parameters"]["outputVariables"]["action"] == "completed"
    await wait_idle(server)
    record = await wait_ended(server, offer.call_id)
    assert record["carrier"] == "genesys" and record["end_reason"] == "stop"
    assert record["from"] == "+15550100002" and record["to"] == "+15550100001"
    assert "Ada Lovelace" in record["prompt"]  # the flow's input variable filled the template
    await wait_for(
        lambda: any(json.loads(r.body)["call_sid"] == offer.call_id for r in sink.received), "webhook"
    )


async def test_a_genesys_dtmf_key_hands_the_transfer_to_the_flow(server, speech) -> None:
    await wait_idle(server)
    sim = genesys(server)
    offer = await sim.answer()
    async with sim.stream(offer, hang_up=False) as call:
        await call.answered()
        talking = asyncio.create_task(call.play(at(speech, 8000)))
        await asyncio.sleep(1.0)
        await call.dtmf("0")
        await asyncio.wait_for(call.closed.wait(), 10)
        talking.cancel()
    # Barge-in as the protocol says: an event with a barge_in entity; it dropped what Genesys held.
    assert call.clears == 1 and call.dropped_by_clear_s[0] <= 0.21  # two 100 ms messages at most
    (disconnect,) = texts(call, "disconnect")
    (closed,) = texts(call, "closed")
    outputs = disconnect["parameters"]["outputVariables"]
    assert disconnect["parameters"]["reason"] == "completed"
    assert outputs["action"] == "transfer" and outputs["target"] == TRANSFER_TO
    assert outputs["say"] == "Connecting you to a colleague." and outputs["dtmf"] == "0"
    assert closed["parameters"]["outputVariables"] == outputs  # what the action set, on `closed`
    record = await wait_ended(server, offer.call_id)
    (action,) = record["actions"]
    assert action["ok"] and action["trigger"] == "dtmf 0"
    assert record["end_reason"] == f"action transfer to {TRANSFER_TO} (dtmf 0)"
    await wait_idle(server)


async def test_a_genesys_hold_is_not_an_idle_line(server, speech) -> None:
    """`paused`: Genesys stops the caller's audio on purpose (a hold); the call outlives the
    idle limit without it, and goes on after `resumed`."""
    await wait_idle(server)
    sim = genesys(server)
    offer = await sim.answer()
    hold_s = IDLE_S + 1.5
    async with sim.stream(offer) as call:
        await call.answered()
        await call.send(sim.side.paused(offer))
        await asyncio.sleep(hold_s)  # no caller audio, longer than the idle limit
        assert not call.closed.is_set(), "the held call was hung up as idle"
        await call.send(sim.side.paused(offer, paused=False))
        call.t0 += hold_s  # the caller's audio goes on from now, at real time
        heard_before = len(call.played)
        await call.play(at(speech, 8000)[: 8000 * 2])
        assert len(call.played) > heard_before and not call.closed.is_set()
    record = await wait_ended(server, offer.call_id)
    assert record["end_reason"] == "stop"
    statuses = [s[1] if isinstance(s, list) else s.get("status") for s in record["statuses"]]
    assert statuses.index("paused") < statuses.index("resumed")
    await wait_idle(server)


async def test_a_broken_stream_ends_alone_and_frees_its_slot(server) -> None:
    """Odd-length L16 on a jambonz stream, an out-of-order seq on a Genesys session: each closes
    that stream with the protocol's close code and frees its slot; the server logs no traceback."""
    await wait_idle(server)
    sim_j = jambonz(server)
    async with sim_j.stream(await sim_j.answer(), hang_up=False) as call:
        await call.answered()
        await call.send(b"\x00\x01\x02")
        await asyncio.wait_for(call.closed.wait(), 10)
    assert call.close_code == 1007
    sim_g = genesys(server)
    offer = await sim_g.answer()
    async with sim_g.stream(offer, hang_up=False) as call:
        await call.answered()
        broken = json.loads(sim_g.side.ping(offer))
        await call.send(json.dumps({**broken, "seq": broken["seq"] + 5}))
        await asyncio.wait_for(call.closed.wait(), 10)
    assert call.close_code == 1008
    (disconnect,) = texts(call, "disconnect")  # the session told why, then was closed
    assert disconnect["parameters"]["reason"] == "error"
    assert disconnect["parameters"]["outputVariables"]["action"] == "error"
    await wait_idle(server)
    assert "Traceback" not in server.log()


def test_the_call_list_shows_both_platforms(server) -> None:
    state = calls_state(server)
    assert {"jambonz", "genesys"} <= set(state["carriers"])
    for prefix in ("/jambonz", "/genesys"):  # under each platform's prefix too
        listed = httpx.get(f"{server.url}{prefix}/calls", headers={"Authorization": f"Bearer {API_TOKEN}"})
        assert listed.status_code == 200 and listed.json()["carriers"] == state["carriers"]
