"""Hostile input on every line, against `personaplex-voice serve --engine echo` with every carrier
(and Asterisk's AudioSocket listener) under uvicorn, the carriers' REST APIs faked by a recording
local server (support_phone):

- a stream whose ticket is made up, already used or expired, and whose start names a live call
  (its call id; on Telnyx its call-control id too), is closed 1008 and does nothing to that
  call: no request to the carrier's API, no status or end in its record, its audio going on;
- table-driven hostile input per carrier (webhook bodies nested at the depth limit and beyond,
  numbers of 400 digits, non-ASCII digits, NaN and infinity, bodies that stop half way or are
  too large, clients that leave half way; the same in stream messages, signature headers and
  the Asterisk sockets): each gets the expected refusal (a 4xx, or the WebSocket close code
  its protocol uses), and the server's log has no ERROR line and no traceback;
- a stream that fails before its start gives its call's reservation back (the host's count,
  polled; the bound only detects a hang), while a replay of the answer webhook still gets the
  same answer and no second slot; a `stop` before `start` is a clean close (1000).

bench/abuse.py measures how many such cases a second the server refuses beside good calls.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import re
import struct
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import jwt
import numpy as np
import pytest
from personaplex_asterisk import audiosocket as asock
from personaplex_phone.simulator import HttpRequest, PhoneSimulator, StreamOffer
from personaplex_phone.urls import websocket_base
from support_phone import (
    CARRIERS,
    PUBLIC_URL,
    VONAGE_SECRET,
    FakeCarrierApis,
    calls_state,
    carrier_env,
    carrier_side,
    record_of,
    speechlike,
    wait_idle,
)
from support_server import ServerProcess, free_port, running_server

pytestmark = pytest.mark.timeout(300)

CONNECT_TIMEOUT_S = 3.0  # the server's PERSONAPLEX_PHONE_STREAM_CONNECT_TIMEOUT_S: tickets expire fast
BODY_TIMEOUT_S = 2.0  # its PERSONAPLEX_HTTP_REQUEST_TIMEOUT_S: a webhook body stalled this long: 408
HANG_S = 15.0  # a bound that only detects a hang (every wait below ends far sooner)
PERSONAS = "default: desk\npersonas:\n  desk: {text_prompt: 'You answer for Acme.'}\n"
WS_CARRIERS = (*CARRIERS, "jambonz")  # an answer webhook, then a ticketed media WebSocket
JSON_STREAMS = ("twilio", "telnyx", "plivo", "exotel")  # the Twilio-style JSON streams
DEEP = 50_000  # `[`s: far beyond the depth limit (32)
LIMIT = 32  # untrusted.JsonLimits().max_depth
HUGE = int("1" + "0" * 400)  # a number of 401 digits
CLOSE_NORMAL, CLOSE_INVALID, CLOSE_POLICY = 1000, 1007, 1008


@pytest.fixture(scope="module")
def apis() -> Iterator[FakeCarrierApis]:
    fake = FakeCarrierApis().start()
    yield fake
    fake.stop()


@pytest.fixture(scope="module")
def audiosocket() -> tuple[str, int]:
    return "127.0.0.1", free_port()


@pytest.fixture(scope="module")
def server(tmp_path_factory, apis, audiosocket) -> Iterator[ServerProcess]:
    personas = tmp_path_factory.mktemp("hostile") / "personas.yaml"
    personas.write_text(PERSONAS)
    env = {
        **carrier_env(apis.url, str(personas)),
        "PERSONAPLEX_PHONE_STREAM_CONNECT_TIMEOUT_S": str(CONNECT_TIMEOUT_S),
        "PERSONAPLEX_HTTP_REQUEST_TIMEOUT_S": str(BODY_TIMEOUT_S),
    }
    carriers = ",".join((*CARRIERS, "asterisk", "jambonz", "genesys"))
    listen = f"{audiosocket[0]}:{audiosocket[1]}"
    args = ("--carriers", carriers, "--audiosocket", listen, "--max-sessions", "4")
    with running_server(*args, env=env) as proc:
        yield proc


def simulator(server: ServerProcess, carrier: str) -> PhoneSimulator:
    return PhoneSimulator(carrier_side(carrier), server.url, public_url=PUBLIC_URL)


def assert_clean_log(text: str) -> None:
    """No ERROR line and no traceback: a peer's bad input is one WARNING (or INFO) line."""
    bad = [line for line in text.splitlines() if " ERROR " in line or "Traceback" in line]
    assert not bad, "\n".join(bad[:10])


async def settled_log(server: ServerProcess, mark: int) -> str:
    await asyncio.sleep(0.3)  # the last refusals' lines
    return server.log()[mark:]


def with_ticket(offer: StreamOffer, ticket: str) -> StreamOffer:
    """The offer with another ticket in its stream URL (a made-up, used or expired one)."""
    parts = urlsplit(offer.url)
    if "ticket=" in parts.query:  # Asterisk's `?ticket=UUID`
        return replace(offer, url=urlunsplit(parts._replace(query=f"ticket={ticket}")))
    path = parts.path.rsplit("/", 1)[0] + "/" + ticket
    return replace(offer, url=urlunsplit(parts._replace(path=path)))


def ticket_of(offer: StreamOffer) -> str:
    parts = urlsplit(offer.url)
    return parts.query.partition("ticket=")[2] if "ticket=" in parts.query else parts.path.rsplit("/", 1)[1]


MADE_UP = "bm90LWEtdGlja2V0LW9mLW91cnM"  # the shape of ours, issued by nobody


async def reserved(server: ServerProcess) -> int:
    return (await asyncio.to_thread(calls_state, server))["reserved"]


async def until_reserved(server: ServerProcess, count: int) -> None:
    """Polls the host's reservations down to `count` (the bound only detects a hang)."""
    deadline = time.monotonic() + HANG_S
    while (now := await reserved(server)) != count:
        assert time.monotonic() < deadline, f"{now} reservation(s) kept, not {count}"
        await asyncio.sleep(0.05)


async def end_call(sim: PhoneSimulator, offer: StreamOffer) -> None:
    """The carrier says the call is over: a reservation it still holds goes (Asterisk's, which
    has no status webhook, expires)."""
    if sim.side.name not in ("asterisk", "genesys"):
        assert await sim.status(offer.call_id, "completed") == 204


# --- raw clients: a stream, an HTTP request, an AudioSocket connection ------------------------------


def server_url(server: ServerProcess, public: str) -> str:
    base = websocket_base(PUBLIC_URL)
    return websocket_base(server.url) + public[len(base) :] if public.startswith(base) else public


async def ws_case(
    server: ServerProcess, side: Any, offer: StreamOffer, messages: list[str | bytes], leave: bool = False
) -> int | None:
    """Opens `offer`'s stream as its carrier would (`side`'s upgrade headers), sends `messages`
    as they are, reads until the server closes (`leave`: closes first, as carriers that hang up
    by closing do); the close code, or an HTTP status for a refused upgrade."""
    url, headers = side.upgrade(offer, PUBLIC_URL)
    protocols = tuple(getattr(side, "subprotocols", ()))
    async with aiohttp.ClientSession() as session:
        try:
            ws = await session.ws_connect(
                server_url(server, url), headers=headers, protocols=protocols, max_msg_size=0
            )
        except aiohttp.WSServerHandshakeError as exc:
            return exc.status
        async with ws:
            for message in messages:
                with contextlib.suppress(ConnectionError, RuntimeError):
                    await (ws.send_bytes(message) if isinstance(message, bytes) else ws.send_str(message))
            if leave:
                await ws.close()
                return ws.close_code

            async def drain() -> None:
                async for _ in ws:
                    pass

            await asyncio.wait_for(drain(), HANG_S)
            return ws.close_code


async def raw_upgrade(server: ServerProcess, sim: PhoneSimulator, offer: StreamOffer) -> asyncio.StreamWriter:
    """The stream's upgrade by hand (to misbehave below the WebSocket layer); after the 101."""
    url, headers = sim.side.upgrade(offer, PUBLIC_URL)
    parts = urlsplit(server_url(server, url))
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    lines = [
        f"GET {parts.path}{'?' + parts.query if parts.query else ''} HTTP/1.1",
        f"Host: 127.0.0.1:{server.port}",
        "Upgrade: websocket",
        "Connection: Upgrade",
        f"Sec-WebSocket-Key: {base64.b64encode(os.urandom(16)).decode()}",
        "Sec-WebSocket-Version: 13",
        *(f"{k}: {v}" for k, v in headers.items()),
        *(f"Sec-WebSocket-Protocol: {p}" for p in getattr(sim.side, "subprotocols", ())),
    ]
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HANG_S)
    assert head.startswith(b"HTTP/1.1 101"), head[:80]
    return writer


async def left_after_upgrade(server: ServerProcess, sim: PhoneSimulator, offer: StreamOffer) -> None:
    writer = await raw_upgrade(server, sim, offer)
    writer.transport.abort()  # gone: no close frame, no FIN


async def truncated_frame(server: ServerProcess, sim: PhoneSimulator, offer: StreamOffer) -> None:
    """A text frame that announces 1,000 bytes, 10 of them sent, then the socket closes."""
    writer = await raw_upgrade(server, sim, offer)
    mask = os.urandom(4)
    payload = bytes(b ^ mask[i % 4] for i, b in enumerate(b'{"event":"'))
    writer.write(bytes([0x81, 0x80 | 126]) + struct.pack(">H", 1000) + mask + payload)
    await writer.drain()
    writer.close()


async def http_case(
    server: ServerProcess,
    request: HttpRequest,
    *,
    body: bytes | None = None,
    declared: int | None = None,
    leave: bool = False,
    chunked: bool = False,
) -> int | None:
    """`request` sent by hand: `body` instead of its own, `declared` as its Content-Length (more
    than is sent: the rest never comes), or `chunked` (no length said); `leave` hangs up before
    any answer. The status."""
    body = request.body if body is None else body
    headers = {k: v for k, v in request.headers.items() if k.lower() != "content-length"}
    head = [f"{request.method} {request.path} HTTP/1.1", f"Host: 127.0.0.1:{server.port}"]
    head += [f"{k}: {v}" for k, v in headers.items()] + ["Connection: close"]
    if chunked:
        head.append("Transfer-Encoding: chunked")
        body = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
    else:
        head.append(f"Content-Length: {len(body) if declared is None else declared}")
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        await writer.drain()
        if leave:
            await asyncio.sleep(0.2)  # the server is reading the body when the client goes
            return None
        status = await asyncio.wait_for(reader.readline(), HANG_S)
        return int(status.split()[1])
    finally:
        writer.close()


async def audiosocket_case(where: tuple[str, int], data: bytes) -> bytes:
    """Sends `data` on a new AudioSocket connection; what the server said before closing it."""
    reader, writer = await asyncio.open_connection(*where)
    writer.write(data)
    await writer.drain()
    writer.write_eof()  # all it says
    said = await asyncio.wait_for(reader.read(), HANG_S)
    writer.close()
    return said


# --- hostile stream messages --------------------------------------------------------------------------


def nested(depth: int) -> Any:
    value: Any = []
    for _ in range(depth - 1):
        value = [value]
    return value


def opening_of(
    sim: PhoneSimulator, offer: StreamOffer, stream_id: str = "SS0123456789abcdef"
) -> tuple[list[str | bytes], dict[str, Any]]:
    """The carrier's opening messages, the last (its start) decoded, for a case to spoil."""
    messages = sim.side.opening(offer, stream_id)
    return messages[:-1], json.loads(messages[-1])


def with_raw(start: dict[str, Any], key: str, literal: str) -> str:
    """The start message as JSON with `"key": <literal>` added (text JSON encoders never write)."""
    text = json.dumps(start)
    return text[:-1] + f', "{key}": {literal}' + "}"


def spoil_rate(carrier: str, start: dict[str, Any], value: str) -> dict[str, Any]:
    """The start with its audio rate (where it has one) replaced by `value`."""
    start = json.loads(json.dumps(start))
    if carrier in ("telnyx", "exotel"):
        start["start"]["media_format"]["sample_rate"] = value
    elif carrier in ("plivo", "twilio"):
        start["start"]["mediaFormat"]["sampleRate"] = value
    elif carrier == "vonage":
        start["content-type"] = f"audio/l16;rate={value}"
    elif carrier == "jambonz":
        start["sampleRate"] = value
    return start


@dataclass(frozen=True)
class StreamCase:
    name: str
    messages: list[str | bytes]
    expect: int | None  # the close code


def stream_cases(carrier: str, sim: PhoneSimulator, offer: StreamOffer) -> list[StreamCase]:
    """Hostile first messages of a stream presenting a made-up ticket (checked at its start, so
    every message before is parsed unauthenticated)."""
    before, start = opening_of(sim, offer)
    # A start the ticket check would see: refused for its ticket (1008), after a clean parse.
    at_limit = {**start, "x": nested(LIMIT - 1)}
    # Twilio's start names no rate; Plivo's content type says it when `sampleRate` does not.
    rate_expect = CLOSE_POLICY if carrier in ("twilio", "plivo") else CLOSE_INVALID
    cases = [
        StreamCase("deep", ["[" * DEEP], CLOSE_INVALID),
        StreamCase("at the depth limit", [*before, json.dumps(at_limit)], CLOSE_POLICY),
        StreamCase(
            "past the depth limit", [*before, json.dumps({**start, "x": nested(LIMIT)})], CLOSE_INVALID
        ),
        StreamCase("400 digits", [*before, with_raw(start, "n", str(HUGE))], CLOSE_INVALID),
        StreamCase("NaN", [*before, with_raw(start, "n", "NaN")], CLOSE_INVALID),
        StreamCase("Infinity", [*before, with_raw(start, "n", "-Infinity")], CLOSE_INVALID),
        StreamCase("1e999", [*before, with_raw(start, "n", "1e999")], CLOSE_INVALID),
        StreamCase("rate ²", [*before, json.dumps(spoil_rate(carrier, start, "²"))], rate_expect),
        StreamCase(
            "rate of 400 digits", [*before, json.dumps(spoil_rate(carrier, start, str(HUGE)))], rate_expect
        ),
    ]
    if carrier in JSON_STREAMS:
        cases.append(StreamCase("binary", [b"\x00" * 64], CLOSE_INVALID))
    else:
        cases.append(StreamCase("audio first", [b"\x00" * 640], CLOSE_POLICY))
    return cases


# --- hostile webhooks -----------------------------------------------------------------------------------


def json_post(carrier: str) -> tuple[str, dict[str, str]]:
    """Where the carrier posts JSON to us, and the request's headers (unsigned, or Asterisk's key
    missing: a body that parses is refused for its signature, 403)."""
    return {
        "vonage": ("/vonage/event", {}),
        "exotel": ("/exotel/answer", {}),
        "jambonz": ("/jambonz/call", {}),
        "asterisk": ("/asterisk/calls", {}),
        "twilio": ("/twilio/voice", {}),  # a form webhook: a JSON body is just no form of Twilio's
        "telnyx": ("/telnyx/voice", {}),
        "plivo": ("/plivo/answer", {}),
    }[carrier]


JSON_BODIES = ("vonage", "exotel", "jambonz", "asterisk")


def body_cases(carrier: str) -> list[tuple[str, bytes, int]]:
    """(name, JSON body, the status it gets): 400 for a JSON webhook's unreadable body, 403
    where the body is a form's (it reads as no field) or parses but is unsigned."""
    bad = 400 if carrier in JSON_BODIES else 403
    facts = '{"call_sid": "c1", "uuid": "u1", "CallSid": "c1", "call_status": "completed"'
    return [
        ("deep", b"[" * DEEP, bad),
        ("at the depth limit", json.dumps({"call_sid": "c1", "x": nested(LIMIT - 1)}).encode(), 403),
        ("past the depth limit", json.dumps({"call_sid": "c1", "x": nested(LIMIT)}).encode(), bad),
        ("400 digits", (facts + f', "n": {HUGE}}}').encode(), bad),
        ("NaN", (facts + ', "n": NaN}').encode(), bad),
        ("Infinity", (facts + ', "n": Infinity}').encode(), bad),
        ("1e999", (facts + ', "n": 1e999}').encode(), bad),
        ("not UTF-8", b'{"call_sid": "\xff\xfe"}', bad),
    ]


def signature_cases(carrier: str, sim: PhoneSimulator) -> list[tuple[str, HttpRequest]]:
    """Signed answer webhooks whose signature carries a number that does not fit, or isn't one:
    each refused (403), never a 500."""
    good = sim.side.answer_request(PUBLIC_URL, sim.new_call_id(), "+15550100001", "+15550100002")

    def header(name: str, value: str) -> HttpRequest:
        kept = {k: v for k, v in good.headers.items() if k.lower() != name.lower()}
        return replace(good, headers={**kept, name: value})

    if carrier == "telnyx":
        return [(f"timestamp {v[:8]}", header("telnyx-timestamp", v)) for v in ("1" + "0" * 400, "²", "1e3")]
    if carrier == "jambonz":
        return [
            (f"t={v[:8]}", header("Jambonz-Signature", f"t={v},v1=" + "ab" * 32))
            for v in ("1" + "0" * 400, "²")
        ]
    if carrier == "vonage":
        now = int(time.time())
        tokens = {
            "iat of 401 digits": jwt.encode({"iat": HUGE}, VONAGE_SECRET, algorithm="HS256"),
            "iat 1e308": jwt.encode({"iat": 1e308}, VONAGE_SECRET, algorithm="HS256"),
            "iat true": jwt.encode({"iat": True}, VONAGE_SECRET, algorithm="HS256"),
            "deep header": ".".join(
                base64.urlsafe_b64encode(part).decode().rstrip("=")
                for part in (b"[" * 6000, json.dumps({"iat": now}).encode(), b"sig")
            ),
        }
        return [(name, header("Authorization", f"Bearer {token}")) for name, token in tokens.items()]
    if carrier == "twilio":
        return [("signature ²", header("X-Twilio-Signature", "²"))]
    if carrier == "plivo":
        return [("nonce ²", header("X-Plivo-Signature-V3-Nonce", "²"))]
    if carrier == "exotel":
        return [("Basic ²", header("Authorization", "Basic ²"))]
    if carrier == "asterisk":
        return [("key ²", header("Authorization", "Bearer ²"))]
    return []


async def webhook_table(server: ServerProcess, carrier: str, sim: PhoneSimulator) -> list[str]:
    """Every hostile webhook of `carrier`; the mismatches (case, status, expected)."""
    path, headers = json_post(carrier)
    post = HttpRequest("POST", path, {**headers, "Content-Type": "application/json"}, b"{}")
    wrong: list[str] = []
    for name, body, expect in body_cases(carrier):
        status = await http_case(server, post, body=body)
        if status != expect:
            wrong.append(f"body {name}: {status}, not {expect}")
    for name, request in signature_cases(carrier, sim):
        status = await http_case(server, request)
        if status != 403:
            wrong.append(f"signature {name}: {status}, not 403")
    # Bodies that do not arrive as they should, all at once (two of them wait out the timeout).
    small = replace(post, body=b'{"a"')
    outcomes = await asyncio.gather(
        http_case(server, small, declared=100_000),  # declared over the limit: at once
        http_case(server, small, declared=1000),  # 4 of 1,000 bytes, then nothing
        http_case(server, post, body=b"{" + b" " * 70_000 + b"}", chunked=True),  # no length said
        http_case(server, small, declared=1000, leave=True),  # the client leaves half way
    )
    for name, status, expect in zip(
        ("declared too large", "stalled", "too large", "left half way"),
        outcomes,
        (413, 408, 413, None),
        strict=True,
    ):
        if status != expect:
            wrong.append(f"body {name}: {status}, not {expect}")
    return wrong


# --- the tests -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("carrier", WS_CARRIERS)
async def test_a_stream_with_a_made_up_used_or_expired_ticket_does_nothing_to_the_call_it_names(
    server, apis, carrier
) -> None:
    await wait_idle(server)
    mark = len(server.log())
    sim = simulator(server, carrier)
    victim = await sim.answer()
    late = await sim.answer()  # another call, whose ticket expires unused
    rate = victim.inbound.rate
    async with sim.stream(victim) as call:
        await call.answered()
        await asyncio.sleep(CONNECT_TIMEOUT_S + 0.5)  # `late`'s ticket expires meanwhile
        await call.play(np.zeros(rate // 10, np.float32))
        before = len(apis.requests_for(carrier))
        heard = len(call.played)
        tickets = {"made up": MADE_UP, "used": ticket_of(victim), "expired": ticket_of(late)}
        for what, ticket in tickets.items():
            # The carrier's own opening, naming the live call (Telnyx: its call-control id too).
            async with sim.stream(with_ticket(victim, ticket), hang_up=False) as hostile:
                await asyncio.wait_for(hostile.closed.wait(), HANG_S)
            assert hostile.close_code == CLOSE_POLICY, (what, hostile.close_code)
            assert not hostile.played, what
        # The live call goes on: its audio still echoes, it is still the one live call.
        await call.play(speechlike(1.0, rate))
        assert len(call.played) > heard
        live = (await asyncio.to_thread(calls_state, server))["live"]
        assert [c["call_sid"] for c in live] == [victim.call_id]
        await asyncio.sleep(0.5)  # a request the refusals might have made would have come by now
        assert apis.requests_for(carrier)[before:] == []  # nothing asked of the carrier's API
    await wait_idle(server)
    record = await asyncio.to_thread(record_of, server, victim.call_id)
    assert record["end_reason"] == "stop", record["end_reason"]
    assert [s["status"] for s in record["statuses"]].count("stream-started") == 1
    assert record["actions"] == []
    await end_call(sim, late)
    text = await settled_log(server, mark)
    assert_clean_log(text)
    refusals = [line for line in text.splitlines() if " WARNING " in line and "ticket refused" in line]
    assert len(refusals) == len(tickets), text[-3000:]  # one WARNING line each, and nothing more


@pytest.mark.parametrize("carrier", (*WS_CARRIERS, "asterisk"))
@pytest.mark.parametrize("how", ["unreadable", "left", "stop"])
async def test_a_stream_that_fails_before_its_start_gives_its_reservation_back(server, carrier, how) -> None:
    if how == "stop" and carrier not in JSON_STREAMS:
        pytest.skip("only the Twilio-style JSON streams have a stop message of their own")
    await wait_idle(server)
    mark = len(server.log())
    sim = simulator(server, carrier)
    call_id = sim.new_call_id()
    answer = sim.side.answer_request(PUBLIC_URL, call_id, "+15550100001", "+15550100002")
    status, body = await sim.request(answer)
    offer = sim.side.parse_answer(call_id, status, body)
    assert offer is not None and await reserved(server) == 1
    if how == "unreadable":
        assert await ws_case(server, sim.side, offer, ["[" * DEEP]) == CLOSE_INVALID
    elif how == "left":
        await left_after_upgrade(server, sim, offer)
    else:
        # The caller hangs up while the stream connects: the carrier's greeting (where it has
        # one), then its stop.
        opening = sim.side.opening(offer, "SS0123456789abcdef")
        stop = json.dumps({"event": "stop", "sequenceNumber": "2", "stop": {"callSid": call_id}})
        assert await ws_case(server, sim.side, offer, [*opening[:-1], stop]) == CLOSE_NORMAL
    await until_reserved(server, 0)  # free again at once
    if carrier != "asterisk":  # the dialplan's request is no carrier's webhook: each is a new call
        # The answer webhook again (a replay, the carrier retrying): the same answer, no slot.
        again = await sim.request(answer)
        assert sim.side.parse_answer(call_id, *again).url == offer.url
        assert await reserved(server) == 0
        await end_call(sim, offer)
    assert_clean_log(await settled_log(server, mark))


@pytest.mark.parametrize("carrier", WS_CARRIERS)
async def test_hostile_input_is_refused_and_logged_without_an_error(server, carrier) -> None:
    await wait_idle(server)
    mark = len(server.log())
    sim = simulator(server, carrier)
    offer = await sim.answer()  # a real call's stream URL: its ticket swapped for a made-up one
    hostile = with_ticket(offer, MADE_UP)
    wrong: list[str] = []
    for case in stream_cases(carrier, sim, hostile):
        code = await ws_case(server, sim.side, hostile, case.messages)
        if code != case.expect:
            wrong.append(f"stream {case.name}: closed {code}, not {case.expect}")
    await left_after_upgrade(server, sim, hostile)
    await truncated_frame(server, sim, hostile)
    if carrier in JSON_STREAMS:
        # Its own ticket, then chunk numbers that are not numbers: a chunk of "²" or of 401
        # digits is no chunk (was a 1011 with a traceback on Twilio), and the call goes on.
        stream_id = "SS0123456789abcdef"
        messages = list(sim.side.opening(offer, stream_id))
        for chunk in ("²", "1" + "0" * 400):
            media = json.loads(sim.side.media(offer, stream_id, b"\x00" * 320, 1, 20))
            media["media"]["chunk"] = chunk
            messages.append(json.dumps(media))
        stop = sim.side.stop(offer, stream_id)
        code = await ws_case(server, sim.side, offer, [*messages, *([stop] if stop else [])], leave=not stop)
        if code != CLOSE_NORMAL:
            wrong.append(f"a call's chunk numbers that are not: closed {code}, not 1000")
    else:
        await end_call(sim, offer)
    wrong += await webhook_table(server, carrier, sim)
    assert not wrong, "\n".join(wrong)
    await wait_idle(server)
    assert_clean_log(await settled_log(server, mark))


async def test_hostile_input_on_asterisk_is_refused_and_logged_without_an_error(server, audiosocket) -> None:
    """The dialplan's requests, chan_websocket's events (plain text and JSON) and AudioSocket's
    binary messages."""
    await wait_idle(server)
    mark = len(server.log())
    sim = simulator(server, "asterisk")
    wrong = await webhook_table(server, "asterisk", sim)

    async def media_case(messages: list[str | bytes], expect: int | None, name: str) -> None:
        offer = await sim.answer()
        code = await ws_case(server, sim.side, offer, messages)
        if code != expect:
            wrong.append(f"chan_websocket {name}: closed {code}, not {expect}")

    start = {
        "event": "MEDIA_START",
        "connection_id": "c1",
        "channel_id": "ch1",
        "format": "slin16",
        "ptime": 20,
    }
    json_start = json.dumps(start)[:-1]
    await media_case(
        [json_start + ', "optimal_frame_size": 1e999}'], CLOSE_INVALID, "optimal_frame_size 1e999"
    )
    await media_case(
        [json_start + f', "optimal_frame_size": {HUGE}}}'], CLOSE_INVALID, "a size of 401 digits"
    )
    await media_case([json.dumps({**start, "x": nested(LIMIT)})], CLOSE_INVALID, "nested past the limit")
    await media_case(["[" * DEEP], CLOSE_INVALID, "deep")
    # Plain text: a size that is no number is no size; the leg then goes on until Asterisk hangs up.
    await media_case(
        ["MEDIA_START connection_id:c1 channel_id:ch1 format:slin16 optimal_frame_size:² ptime:20", "HANGUP"],
        CLOSE_NORMAL,
        "optimal_frame_size ²",
    )
    # A made-up UUID is refused before the upgrade is accepted.
    status = await ws_case(server, sim.side, with_ticket(await sim.answer(), str(uuid.uuid4())), [])
    if status != 403:
        wrong.append(f"chan_websocket with a made-up UUID: {status}, not 403")
    # AudioSocket: no UUID first, a made-up one, a real one then audio of half a sample, nothing.
    hangup = asock.HANGUP
    for name, data in (
        ("no UUID first", asock.encode(asock.KIND_SLIN, b"\x00" * 320)),
        ("a made-up UUID", asock.uuid_message(uuid.uuid4())),
        ("a header cut short", b"\x01\x00"),
    ):
        said = await audiosocket_case(audiosocket, data)
        if said != hangup:
            wrong.append(f"audiosocket {name}: {said[:12]!r}, not a hang-up")
    offer = await sim.answer()
    said = await audiosocket_case(
        audiosocket, asock.uuid_message(ticket_of(offer)) + asock.encode(asock.KIND_SLIN, b"\x00" * 321)
    )
    if not said.endswith(hangup):
        wrong.append(f"audiosocket odd audio: {said[-12:]!r}, not a hang-up")
    assert not wrong, "\n".join(wrong)
    await until_reserved(server, 0)  # every leg above failed before its start: no slot kept
    await wait_idle(server)
    text = await settled_log(server, mark)
    assert_clean_log(text)


async def test_hostile_input_on_genesys_is_refused_and_logged_without_an_error(server) -> None:
    """Genesys opens the session itself (its upgrade signed): its first messages are parsed
    before any admission, and the signature's own numbers before anything."""
    await wait_idle(server)
    mark = len(server.log())
    sim = simulator(server, "genesys")
    wrong: list[str] = []
    offer = await sim.answer()
    _, open_message = opening_of(sim, offer)
    for name, messages, expect in (
        ("deep", ["[" * DEEP], CLOSE_INVALID),
        ("past the depth limit", [json.dumps({**open_message, "x": nested(LIMIT)})], CLOSE_INVALID),
        ("NaN", [with_raw(open_message, "n", "NaN")], CLOSE_INVALID),
        ("seq of 401 digits", [json.dumps({**open_message, "seq": HUGE})], CLOSE_INVALID),
        ("audio first", [b"\xff" * 160], CLOSE_POLICY),
    ):
        code = await ws_case(server, sim.side, await sim.answer(), messages)
        if code != expect:
            wrong.append(f"{name}: closed {code}, not {expect}")
    # The right key, a signature whose `created` is no number (RFC 8941's digits are ASCII).
    for created in ("²", "1" + "0" * 400):
        spoiled = await sim.answer()
        url, headers = sim.side.upgrade(spoiled, PUBLIC_URL)
        headers["Signature-Input"] = re.sub(r"created=\d+", f"created={created}", headers["Signature-Input"])
        status = await ws_case(server, _FixedSide(sim.side, url, headers), spoiled, [])
        if status != 403:
            wrong.append(f"created={created[:8]}: {status}, not 403")
    assert not wrong, "\n".join(wrong)
    await wait_idle(server)
    assert_clean_log(await settled_log(server, mark))


class _FixedSide:
    """A carrier's side that upgrades with given headers (a spoiled signature)."""

    def __init__(self, side: Any, url: str, headers: dict[str, str]):
        self._side, self._url, self._headers = side, url, headers

    def upgrade(self, offer: StreamOffer, public_url: str) -> tuple[str, dict[str, str]]:
        return self._url, self._headers

    def __getattr__(self, name: str) -> Any:
        return getattr(self._side, name)
