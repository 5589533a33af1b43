"""Hostile input for every carrier, as data and as the clients that send it: for
tests/test_phone_hostile.py (each case's expected refusal asserted) and bench/abuse.py (how many
a second a server refuses beside good calls).

    outcomes = await carrier_round(server, "telnyx", sim, template)   # streams with a made-up ticket
    outcomes += await webhook_round(server, "telnyx", sim)            # bodies, signatures, delivery
    outcomes += await asterisk_round(server, sim, audiosocket)        # the dialplan, both legs
    outcomes += await genesys_round(server, sim)                      # a signed session's messages
    [o for o in outcomes if not o.ok]                                 # what was not refused as expected

The classes of input: JSON nested at the depth limit (parsed, then refused for what it is: an
unsigned webhook's 403, a made-up ticket's 1008) and past it, 50,000 `[`, numbers of 401 digits,
non-ASCII digits (`²`), NaN, infinity and `1e999`, bodies too large or stalled or left half way,
frames cut short, sockets dropped without a word, signatures whose numbers are none. The raw
clients go below what the simulators do (a Content-Length that lies, a WebSocket frame cut in
two); each returns what the server answered: an HTTP status or a WebSocket close code.
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
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import jwt
from personaplex_asterisk import audiosocket as asock
from personaplex_phone.simulator import HttpRequest, PhoneSimulator, StreamOffer
from personaplex_phone.urls import websocket_base
from support_phone import CARRIERS, PUBLIC_URL, VONAGE_SECRET

HANG_S = 15.0  # a bound that only detects a hang (every wait ends far sooner)
WS_CARRIERS = (*CARRIERS, "jambonz")  # an answer webhook, then a ticketed media WebSocket
JSON_STREAMS = ("twilio", "telnyx", "plivo", "exotel")  # the Twilio-style JSON streams
DEEP = 50_000  # `[`s: far beyond the depth limit
LIMIT = 32  # untrusted.JsonLimits().max_depth
HUGE = int("1" + "0" * 400)  # a number of 401 digits
CLOSE_NORMAL, CLOSE_INVALID, CLOSE_POLICY = 1000, 1007, 1008
MADE_UP = "bm90LWEtdGlja2V0LW9mLW91cnM"  # the shape of our tickets, issued by nobody


@dataclass(frozen=True)
class Outcome:
    """One hostile case: what the server answered (a status, a close code; None: nothing, the
    client left) and what it should have."""

    case: str
    got: int | bytes | None
    expected: int | bytes | None

    @property
    def ok(self) -> bool:
        return self.got == self.expected

    def __str__(self) -> str:
        return f"{self.case}: {self.got!r}, not {self.expected!r}"


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


def server_url(server: Any, public: str) -> str:
    base = websocket_base(PUBLIC_URL)
    return websocket_base(server.url) + public[len(base) :] if public.startswith(base) else public


async def ws_case(
    server: Any, side: Any, offer: StreamOffer, messages: list[str | bytes], leave: bool = False
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


async def raw_upgrade(server: Any, sim: PhoneSimulator, offer: StreamOffer) -> asyncio.StreamWriter:
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


async def left_after_upgrade(server: Any, sim: PhoneSimulator, offer: StreamOffer) -> None:
    writer = await raw_upgrade(server, sim, offer)
    writer.transport.abort()  # gone: no close frame, no FIN


async def truncated_frame(server: Any, sim: PhoneSimulator, offer: StreamOffer) -> None:
    """A text frame that announces 1,000 bytes, 10 of them sent, then the socket closes."""
    writer = await raw_upgrade(server, sim, offer)
    mask = os.urandom(4)
    payload = bytes(b ^ mask[i % 4] for i, b in enumerate(b'{"event":"'))
    writer.write(bytes([0x81, 0x80 | 126]) + struct.pack(">H", 1000) + mask + payload)
    await writer.drain()
    writer.close()


async def http_case(
    server: Any,
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


def json_posts(carrier: str) -> list[str]:
    """Where the carrier posts to us (its answer and status webhooks; jambonz's actionHook too),
    unsigned (Asterisk: without the key): a body that parses is refused for its signature, 403."""
    return {
        "vonage": ["/vonage/event"],  # the answer is a GET
        "exotel": ["/exotel/answer", "/exotel/status"],
        "jambonz": ["/jambonz/call", "/jambonz/status", "/jambonz/action"],
        "asterisk": ["/asterisk/calls"],
        "twilio": ["/twilio/voice", "/twilio/status"],  # form webhooks: a JSON body reads as no field
        "telnyx": ["/telnyx/voice", "/telnyx/status"],
        "plivo": ["/plivo/answer", "/plivo/hangup"],
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
        # The dynamic URL is taken on its ?token= (or valid Basic credentials): a wrong token
        # and a Basic header that is not base64 are each refused.
        bare = replace(good, path=re.sub(r"([?&])token=[^&]*&?", r"\1", good.path))
        return [
            ("Basic ²", replace(bare, headers={"Authorization": "Basic ²"})),
            ("token ²", replace(bare, path=bare.path + "&token=%C2%B2", headers={})),
        ]
    if carrier == "asterisk":
        return [("key ²", header("Authorization", "Bearer ²"))]
    return []


async def webhook_round(server: Any, carrier: str, sim: PhoneSimulator, slow: bool = True) -> list[Outcome]:
    """Every hostile webhook of `carrier`. `slow`: also a body that stalls (answered after the
    server's body timeout) and one whose client leaves half way."""
    outcomes = []
    for path in json_posts(carrier):
        post = HttpRequest("POST", path, {"Content-Type": "application/json"}, b"{}")
        for name, body, expect in body_cases(carrier):
            outcomes.append(Outcome(f"{path} body {name}", await http_case(server, post, body=body), expect))
    for name, request in signature_cases(carrier, sim):
        outcomes.append(Outcome(f"{carrier} signature {name}", await http_case(server, request), 403))
    post = HttpRequest("POST", json_posts(carrier)[0], {"Content-Type": "application/json"}, b"{}")
    small = replace(post, body=b'{"a"')
    delivery = {
        "declared too large": (http_case(server, small, declared=100_000), 413),
        "too large, no length said": (
            http_case(server, post, body=b"{" + b" " * 70_000 + b"}", chunked=True),
            413,
        ),
    }
    if slow:
        delivery["stalled"] = (http_case(server, small, declared=1000), 408)  # 4 of 1,000 bytes
        delivery["left half way"] = (http_case(server, small, declared=1000, leave=True), None)
    answers = await asyncio.gather(*(call for call, _ in delivery.values()))
    for (name, (_, expect)), got in zip(delivery.items(), answers, strict=True):
        outcomes.append(Outcome(f"{carrier} body {name}", got, expect))
    return outcomes


async def carrier_round(
    server: Any, carrier: str, sim: PhoneSimulator, template: StreamOffer, own: StreamOffer | None = None
) -> list[Outcome]:
    """`carrier`'s hostile streams, each presenting a made-up ticket in `template`'s URL (so every
    message is parsed before anything is known of the stream), a socket dropped after the
    upgrade and a frame cut short. With `own` (a real call's offer, its ticket unused), on the
    Twilio-style JSON streams: that call's chunk numbers written as "²" and as 401 digits (no
    chunk, the call goes on), then its stop (1000)."""
    hostile = with_ticket(template, MADE_UP)
    outcomes = [
        Outcome(
            f"{carrier} stream {case.name}",
            await ws_case(server, sim.side, hostile, case.messages),
            case.expect,
        )
        for case in stream_cases(carrier, sim, hostile)
    ]
    await left_after_upgrade(server, sim, hostile)
    await truncated_frame(server, sim, hostile)
    if own is not None and carrier in JSON_STREAMS:
        stream_id = "SS0123456789abcdef"
        messages = list(sim.side.opening(own, stream_id))
        for chunk in ("²", "1" + "0" * 400):
            media = json.loads(sim.side.media(own, stream_id, b"\x00" * 320, 1, 20))
            media["media"]["chunk"] = chunk
            messages.append(json.dumps(media))
        stop = sim.side.stop(own, stream_id)
        code = await ws_case(server, sim.side, own, [*messages, *([stop] if stop else [])], leave=not stop)
        outcomes.append(Outcome(f"{carrier} a call's chunk numbers that are none", code, CLOSE_NORMAL))
    return outcomes


async def asterisk_round(server: Any, sim: PhoneSimulator, audiosocket: tuple[str, int]) -> list[Outcome]:
    """chan_websocket's events (plain text and JSON) on legs of real UUIDs (each fails before its
    start: its slot goes back at once), a made-up UUID, and AudioSocket's binary messages."""
    outcomes: list[Outcome] = []
    start = {"event": "MEDIA_START", "connection_id": "c1", "channel_id": "ch1", "format": "slin16"}
    size = json.dumps(start)[:-1] + ', "optimal_frame_size": '
    legs: list[tuple[str, list[str | bytes], int]] = [
        ("optimal_frame_size 1e999", [size + "1e999}"], CLOSE_INVALID),
        ("a size of 401 digits", [size + f"{HUGE}}}"], CLOSE_INVALID),
        ("nested past the limit", [json.dumps({**start, "x": nested(LIMIT)})], CLOSE_INVALID),
        ("deep", ["[" * DEEP], CLOSE_INVALID),
        # Plain text: a size that is no number is no size; the leg goes on until Asterisk hangs up.
        (
            "optimal_frame_size ²",
            ["MEDIA_START channel_id:ch1 format:slin16 optimal_frame_size:²", "HANGUP"],
            CLOSE_NORMAL,
        ),
    ]
    offer = None
    for name, messages, expect in legs:
        offer = await sim.answer()
        outcomes.append(
            Outcome(f"chan_websocket {name}", await ws_case(server, sim.side, offer, messages), expect)
        )
    assert offer is not None
    # A made-up UUID in a real leg's URL: refused before the upgrade is accepted.
    made_up = with_ticket(offer, str(uuid.uuid4()))
    outcomes.append(
        Outcome("chan_websocket a made-up UUID", await ws_case(server, sim.side, made_up, []), 403)
    )
    for name, data in (
        ("no UUID first", asock.encode(asock.KIND_SLIN, b"\x00" * 320)),
        ("a made-up UUID", asock.uuid_message(uuid.uuid4())),
        ("a header cut short", b"\x01\x00"),
    ):
        outcomes.append(
            Outcome(f"audiosocket {name}", await audiosocket_case(audiosocket, data), asock.HANGUP)
        )
    leg = await sim.answer()
    odd = asock.uuid_message(ticket_of(leg)) + asock.encode(asock.KIND_SLIN, b"\x00" * 321)
    said = await audiosocket_case(audiosocket, odd)
    outcomes.append(Outcome("audiosocket audio of half a sample", said[-3:], asock.HANGUP))
    return outcomes


async def genesys_round(server: Any, sim: PhoneSimulator) -> list[Outcome]:
    """Genesys opens the session itself (its upgrade signed): its first messages are parsed
    before any admission, and the signature's own numbers before anything."""
    outcomes: list[Outcome] = []
    _, open_message = opening_of(sim, await sim.answer())
    for name, messages, expect in (
        ("deep", ["[" * DEEP], CLOSE_INVALID),
        ("past the depth limit", [json.dumps({**open_message, "x": nested(LIMIT)})], CLOSE_INVALID),
        ("NaN", [with_raw(open_message, "n", "NaN")], CLOSE_INVALID),
        ("seq of 401 digits", [json.dumps({**open_message, "seq": HUGE})], CLOSE_INVALID),
        ("audio first", [b"\xff" * 160], CLOSE_POLICY),
    ):
        code = await ws_case(server, sim.side, await sim.answer(), messages)
        outcomes.append(Outcome(f"genesys {name}", code, expect))
    # The right key, a signature whose `created` is no number (RFC 8941's digits are ASCII).
    for created in ("²", "1" + "0" * 400):
        offer = await sim.answer()
        url, headers = sim.side.upgrade(offer, PUBLIC_URL)
        headers["Signature-Input"] = re.sub(r"created=\d+", f"created={created}", headers["Signature-Input"])
        status = await ws_case(server, FixedUpgrade(sim.side, url, headers), offer, [])
        outcomes.append(Outcome(f"genesys created={created[:8]}", status, 403))
    return outcomes


class FixedUpgrade:
    """A carrier's side that upgrades with given headers (a spoiled signature)."""

    def __init__(self, side: Any, url: str, headers: dict[str, str]):
        self._side, self._url, self._headers = side, url, headers

    def upgrade(self, offer: StreamOffer, public_url: str) -> tuple[str, dict[str, str]]:
        return self._url, self._headers

    def __getattr__(self, name: str) -> Any:
        return getattr(self._side, name)
