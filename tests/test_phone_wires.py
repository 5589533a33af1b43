"""Each carrier's own parts alone (no server, no socket): its stream messages as published, its
byte order, its markup, its signatures exactly as the carrier signs (Plivo's checked against the
official `plivo` package's validator)."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import time
import xml.etree.ElementTree as ET
from urllib.parse import parse_qsl, urlsplit

import jwt
import numpy as np
import pytest
from personaplex_exotel import signatures as exotel_signatures
from personaplex_exotel.carrier import ExotelCarrier
from personaplex_exotel.config import ExotelSettings
from personaplex_exotel.wire import ExotelWire
from personaplex_phone.carrier import (
    CallerMedia,
    CallFacts,
    Digit,
    MarkPlayed,
    ProtocolError,
    StreamStart,
    StreamStop,
)
from personaplex_plivo import plivoxml
from personaplex_plivo import signatures as plivo_signatures
from personaplex_plivo.wire import PlivoWire
from personaplex_plivo.wire import extra_headers as plivo_extra_headers
from personaplex_telnyx import signatures as telnyx_signatures
from personaplex_telnyx import texml
from personaplex_telnyx.sim import keypair
from personaplex_telnyx.wire import TelnyxWire, audio_format
from personaplex_vonage import signatures as vonage_signatures
from personaplex_vonage.wire import VonageWire

from personaplex_voice.audio.telephony import l16_decode


def text(message: dict) -> dict:
    return {"type": "websocket.receive", "text": json.dumps(message)}


def binary(data: bytes) -> dict:
    return {"type": "websocket.receive", "bytes": data}


# --- Telnyx -------------------------------------------------------------------------------------


def telnyx_start(encoding: str = "PCMU", rate: int = 8000) -> dict:
    return {
        "event": "start",
        "sequence_number": "1",
        "stream_id": "32de0dea-53cb",
        "start": {
            "call_control_id": "v3:ctl",
            "media_format": {"encoding": encoding, "sample_rate": rate, "channels": 1},
            "custom_parameters": {"call_id": "v3:texml-call", "persona": "desk"},
        },
    }


def test_telnyx_start_gives_the_calls_codec_in_and_l16_big_endian_out() -> None:
    wire = TelnyxWire(audio_format("L16", 16000))
    assert wire.parse(text({"event": "connected", "version": "1.0.0"})) is None
    start = wire.parse(text(telnyx_start()))
    assert isinstance(start, StreamStart)
    assert (start.call_id, start.control_id, start.params) == ("v3:texml-call", "v3:ctl", {"persona": "desk"})
    assert start.inbound.codec == "pcmu" and start.inbound.rate == 8000
    assert start.outbound.codec == "l16" and start.outbound.big_endian and start.outbound.rate == 16000
    media = wire.parse(
        text({"event": "media", "stream_id": "32de0dea-53cb", "media": {"chunk": "7", "payload": "AAE="}})
    )
    assert media == CallerMedia(b"\x00\x01", 7)
    assert wire.parse(text({"event": "mark", "mark": {"name": "3"}})) == MarkPlayed("3")
    assert wire.parse(text({"event": "dtmf", "dtmf": {"digit": "#"}})) == Digit("#")
    assert wire.parse(text({"event": "stop", "stop": {}})) == StreamStop()
    assert json.loads(wire.media(b"\x01\x02")) == {"event": "media", "media": {"payload": "AQI="}}
    assert json.loads(wire.clear()) == {"event": "clear"}
    # L16 here is RTP's: big-endian. 0x4000 is half scale.
    assert l16_decode(b"\x40\x00", big_endian=start.outbound.big_endian)[0] == 0.5


@pytest.mark.parametrize(
    ("message", "code"),
    [
        ({"event": "media", "media": {"payload": "AA=="}}, 1008),  # before start
        (telnyx_start("G722", 16000), 1007),
        (telnyx_start("PCMU", 16000), 1007),
        ({"event": "start", "stream_id": "x", "start": {}}, 1007),
    ],
)
def test_telnyx_refuses_what_it_cannot_serve(message, code) -> None:
    with pytest.raises(ProtocolError) as info:
        TelnyxWire(audio_format("L16", 16000)).parse(text(message))
    assert info.value.code == code


def test_telnyx_signatures_are_ed25519_over_timestamp_and_body_and_fresh() -> None:
    private, public = keypair()
    from personaplex_telnyx.sim import TelnyxSide

    key = telnyx_signatures.load_public_key(public)
    side = TelnyxSide(private)
    body = b"CallSid=v3%3Aabc&To=%2B15550001"
    headers = side.sign(body)
    check = lambda h, b=body, **kw: telnyx_signatures.verify(  # noqa: E731
        key, h.get("telnyx-signature-ed25519"), h.get("telnyx-timestamp"), b, 300, **kw
    )
    assert check(headers)
    assert not check(headers, b=body + b"&x=1")  # another body
    assert not check(side.sign(body, timestamp=int(time.time()) - 301))  # stale: a replay
    assert not check(side.sign(body, timestamp=int(time.time()) + 301))
    assert not check({**headers, "telnyx-timestamp": str(int(headers["telnyx-timestamp"]) + 1)})
    assert not check({"telnyx-timestamp": headers["telnyx-timestamp"]})
    with pytest.raises(ValueError, match="32-byte"):
        telnyx_signatures.load_public_key(base64.b64encode(b"short").decode())


def test_texml_connects_a_bidirectional_rtp_stream() -> None:
    document = texml.connect_stream("wss://x.test/telnyx/media-stream/T", {"persona": "a&b"}, "PCMU", 8000)
    stream = ET.fromstring(document).find("./Connect/Stream")
    assert stream.get("bidirectionalMode") == "rtp" and stream.get("bidirectionalCodec") == "PCMU"
    assert stream.get("bidirectionalSamplingRate") == "8000" and stream.get("url").endswith("/T")
    assert stream.get("codec") == "PCMU"  # the caller's audio asked in a codec we read
    assert {p.get("name"): p.get("value") for p in stream} == {"persona": "a&b"}
    # The L16 opt-in: wideband back, the caller's audio still asked as PCMU (TeXML's codecs)
    wide = ET.fromstring(texml.connect_stream("wss://x.test/T", {}, "L16", 16000)).find("./Connect/Stream")
    assert (wide.get("bidirectionalCodec"), wide.get("bidirectionalSamplingRate"), wide.get("codec")) == (
        "L16",
        "16000",
        "PCMU",
    )


# --- Plivo --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "url", "form"),
    [
        (
            "POST",
            "https://voice.example.test/plivo/answer",
            {"CallUUID": "c-1", "To": "+1555", "From": "+1666"},
        ),
        (
            "POST",
            "https://voice.example.test/plivo/answer?persona=desk&b=2",
            {"CallUUID": "c-1", "Event": "StartApp"},
        ),
        ("POST", "https://voice.example.test/plivo/answer?persona=desk", {}),
        ("GET", "https://voice.example.test/plivo/answer?CallUUID=c-1&To=%2B1555", {}),
    ],
)
def test_plivo_v3_signatures_match_the_official_validator(method, url, form) -> None:
    from plivo.utils.signature_v3 import validate_v3_signature

    token, nonce = "plivo-auth-token-0123", "12345678901234567890"
    ours = plivo_signatures.signature(token, method, url, nonce, list(form.items()))
    params = dict(form) if method == "POST" else dict(parse_qsl(urlsplit(url).query))
    assert validate_v3_signature(method, url, nonce, token, ours, params)
    # Several signatures (a token being rotated): one of them must be ours.
    headers = {"x-plivo-signature-v3": f"bm90IGl0,{ours}", "x-plivo-signature-v3-nonce": nonce}
    assert plivo_signatures.verify(token, method, url, headers, list(form.items()))
    assert not plivo_signatures.verify("another-token", method, url, headers, list(form.items()))
    assert not plivo_signatures.verify(
        token, method, url + "&x=1" if "?" in url else url + "?x=1", headers, list(form.items())
    )


def test_plivo_stream_messages_and_little_endian_l16() -> None:
    wire = PlivoWire()
    start = wire.parse(
        text(
            {
                "sequenceNumber": 0,
                "event": "start",
                "start": {
                    "callId": "c-1",
                    "streamId": "s-1",
                    "mediaFormat": {"encoding": "audio/x-l16", "sampleRate": 16000},
                },
                # Plivo hands our extraHeaders back `;`-separated (its published start example)
                "extra_headers": plivoxml.extra_headers({"persona": "desk", "customer_name": "O, T"}).replace(
                    ",", ";"
                ),
            }
        )
    )
    assert start.call_id == "c-1" and start.params == {"persona": "desk", "customer_name": "O, T"}
    assert start.inbound.codec == "l16" and not start.inbound.big_endian and start.inbound.rate == 16000
    assert l16_decode(b"\x00\x40", big_endian=start.inbound.big_endian)[0] == 0.5
    assert wire.parse(text({"event": "playedStream", "streamId": "s-1", "name": "9"})) == MarkPlayed("9")
    assert wire.parse(text({"event": "clearedAudio", "streamId": "s-1"})) is None
    assert wire.parse(text({"event": "dtmf", "streamId": "s-1", "dtmf": {"digit": "5"}})) == Digit("5")
    play = json.loads(wire.media(b"\x00\x01"))
    assert play == {
        "event": "playAudio",
        "streamId": "s-1",
        "media": {"contentType": "audio/x-l16", "sampleRate": 16000, "payload": "AAE="},
    }
    assert json.loads(wire.mark("4")) == {"event": "checkpoint", "streamId": "s-1", "name": "4"}
    assert json.loads(wire.clear()) == {"event": "clearAudio", "streamId": "s-1"}


def test_plivo_xml_streams_bidirectionally_and_keeps_the_call() -> None:
    document = plivoxml.stream(
        "wss://x.test/plivo/media-stream/T", {"persona": "a,b"}, "audio/x-l16;rate=16000"
    )
    stream = ET.fromstring(document).find("Stream")
    assert stream.text == "wss://x.test/plivo/media-stream/T"
    assert stream.get("bidirectional") == "true" and stream.get("keepCallAlive") == "true"
    assert stream.get("contentType") == "audio/x-l16;rate=16000"
    # Plivo's <Stream> takes only [A-Za-z0-9] in extraHeaders (`=` and `,` between the pairs)
    assert re.fullmatch(r"[A-Za-z0-9]+=[A-Za-z0-9]*(,[A-Za-z0-9]+=[A-Za-z0-9]*)*", stream.get("extraHeaders"))
    assert plivo_extra_headers(stream.get("extraHeaders")) == {"persona": "a,b"}


# --- Vonage -------------------------------------------------------------------------------------


def test_vonage_binary_l16_and_json_events() -> None:
    wire = VonageWire()
    with pytest.raises(ProtocolError):
        wire.parse(binary(b"\x00" * 640))  # audio before websocket:connected
    connected = {
        "event": "websocket:connected",
        "content-type": "audio/l16;rate=16000",
        "call_uuid": "u-1",
        "persona": "desk",
    }
    start = wire.parse(text(connected))
    assert start.call_id == "u-1" and start.params == {"persona": "desk"} and start.inbound.rate == 16000
    assert not start.inbound.big_endian and start.inbound.chunk_bytes == 640
    assert wire.parse(binary(b"\x01\x00" * 320)) == CallerMedia(b"\x01\x00" * 320)
    with pytest.raises(ProtocolError) as odd:
        wire.parse(binary(b"\x00" * 641))
    assert odd.value.code == 1007
    assert wire.parse(text({"event": "websocket:dtmf", "digit": "7", "duration": 260})) == Digit("7")
    assert wire.parse(text({"event": "websocket:notify", "payload": {"name": "12"}})) == MarkPlayed("12")
    assert wire.media(b"\x00\x01") == b"\x00\x01"  # binary both ways
    assert json.loads(wire.mark("12")) == {"action": "notify", "payload": {"name": "12"}}
    assert json.loads(wire.clear()) == {"action": "clear"}


def test_vonage_signed_webhooks_are_hs256_fresh_and_bound_to_the_body() -> None:
    secret = "vonage-signature-secret-0123456789abcdef"
    body = b'{"status":"completed","uuid":"u-1"}'

    def token(**claims) -> dict[str, str]:
        return {
            "authorization": "Bearer "
            + jwt.encode({"iat": int(time.time()), **claims}, secret, algorithm="HS256")
        }

    good = token(payload_hash=hashlib.sha256(body).hexdigest())
    assert vonage_signatures.verify(secret, good, body, 300)
    assert not vonage_signatures.verify(secret, good, body.replace(b"u-1", b"u-2"), 300)  # another body
    assert not vonage_signatures.verify(secret, token(), body, 300)  # a body without its hash
    assert vonage_signatures.verify(secret, token(), b"", 300, method="GET")  # nothing to bind
    stale = token(iat=int(time.time()) - 301, payload_hash=hashlib.sha256(body).hexdigest())
    assert not vonage_signatures.verify(secret, stale, body, 300)
    assert not vonage_signatures.verify(secret + "x", good, body, 300)
    assert not vonage_signatures.verify(secret, {}, body, 300)


def test_vonage_rest_calls_carry_an_application_jwt() -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    token = vonage_signatures.application_token("app-1", pem.decode())
    claims = jwt.decode(token, key.public_key(), algorithms=["RS256"])
    assert claims["application_id"] == "app-1" and claims["exp"] > claims["iat"]


# --- Exotel -------------------------------------------------------------------------------------


def test_exotel_stream_messages() -> None:
    wire = ExotelWire()
    start = wire.parse(
        text(
            {
                "event": "start",
                "stream_sid": "MZ1",
                "start": {
                    "stream_sid": "MZ1",
                    "call_sid": "CA1",
                    "custom_parameters": {"persona": "desk"},
                    "media_format": {"encoding": "audio/x-raw", "sample_rate": "8000", "bit_rate": "16"},
                },
            }
        )
    )
    assert start.call_id == "CA1" and start.inbound.codec == "l16" and not start.inbound.big_endian
    # Ours: at least 3.2 KB, a multiple of 320 bytes, as Exotel asks (200 ms at 8 kHz)
    assert start.outbound.chunk_bytes == 3200 and start.outbound.message_ms == 200
    media = {"event": "media", "stream_sid": "MZ1", "media": {"chunk": "2", "payload": "AAE="}}
    assert wire.parse(text(media)) == CallerMedia(b"\x00\x01", 2)
    assert wire.parse(text({"event": "dtmf", "stream_sid": "MZ1", "dtmf": {"digit": "1"}})) == Digit("1")
    with pytest.raises(ProtocolError):
        wire.parse(text({"event": "media", "stream_sid": "MZ2", "media": {"payload": "AAE="}}))
    assert json.loads(wire.clear()) == {"event": "clear", "stream_sid": "MZ1"}
    assert json.loads(wire.mark("3")) == {"event": "mark", "stream_sid": "MZ1", "mark": {"name": "3"}}


def test_exotel_answers_a_stream_url_with_its_credentials_rate_and_few_parameters() -> None:
    settings = ExotelSettings(api_key="key", api_token="to/ken", sample_rate=16000, answer_token="t0k")
    carrier = ExotelCarrier(settings, send=None, validate=True)
    url = carrier.stream_url("wss://voice.example.test/exotel/media-stream", "TICKET")
    reply = carrier.answer_stream(url, {"persona": "desk", "a": "1", "b": "2", "c": "3"}, CallFacts("CA1"))
    answered = json.loads(reply.body)["url"]
    parts = urlsplit(answered)
    assert parts.username == "key" and parts.password == "to%2Fken" and parts.path.endswith("/TICKET")
    query = dict(parse_qsl(parts.query))
    assert query == {"sample-rate": "16000", "persona": "desk", "a": "1", "b": "2"}  # at most three
    busy = carrier.answer_refusal("busy", busy=True)
    assert busy.status == 503 and "url" not in json.loads(busy.body)
    assert exotel_signatures.verify(
        "key", "to/ken", {"authorization": exotel_signatures.basic("key", "to/ken")}
    )
    assert not exotel_signatures.verify(
        "key", "to/ken", {"authorization": exotel_signatures.basic("key", "x")}
    )
    assert not exotel_signatures.verify("key", "to/ken", {})
    # Exotel's HTTPS fetches (documented without credentials) are taken on our token in the query
    assert exotel_signatures.verify_request("key", "to/ken", "t0k", {}, {"token": "t0k"})
    assert not exotel_signatures.verify_request("key", "to/ken", "t0k", {}, {"token": "t0"})
    assert not exotel_signatures.verify_request("key", "to/ken", "", {}, {"token": ""})


def test_sixteen_bit_byte_orders_differ_where_the_carriers_say() -> None:
    half = np.array([0.5], np.float32)
    from personaplex_voice.audio.telephony import l16_encode

    assert l16_encode(half, big_endian=audio_format("L16", 16000).big_endian) == b"\x40\x00"  # Telnyx: RTP
    for little in (PlivoWire().format, VonageWire().format):
        assert l16_encode(half, big_endian=little.big_endian) == b"\x00\x40"
