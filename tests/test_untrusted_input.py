"""The one bounded reader of a peer's input (personaplex_voice.untrusted), and each parse point of
the carriers that uses it: nested JSON at the depth limit and past it, numbers that do not fit,
digits that are not ASCII, NaN and infinity; every one a refusal (InputRefused, a ProtocolError
with its close code, a signature that does not verify), never a RecursionError, an
OverflowError, a TypeError or a ValueError from deeper down. The same input against a running
server: tests/test_phone_hostile.py."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from personaplex_asterisk import media_ws
from personaplex_genesys import httpsig
from personaplex_jambonz import signatures as jambonz_signatures
from personaplex_phone.carrier import ProtocolError, Reply, StreamStop
from personaplex_phone.carrier_kit import json_fields
from personaplex_phone.registry import CallRegistry, StreamTicket
from personaplex_phone.wire_json import number
from personaplex_plivo import signatures as plivo_signatures
from personaplex_telnyx import signatures as telnyx_signatures
from personaplex_telnyx.sim import keypair
from personaplex_telnyx.wire import TelnyxWire, audio_format
from personaplex_twilio.wire import ProtocolError as TwilioProtocolError
from personaplex_twilio.wire import media_chunk, parse_message
from personaplex_vonage import signatures as vonage_signatures

from personaplex_voice.cluster import wire as cluster_wire
from personaplex_voice.untrusted import (
    InputRefused,
    JsonLimits,
    ascii_int,
    ascii_int_or_none,
    finite_number,
    loads,
    loads_object,
    nesting_depth,
)

HUGE = "1" + "0" * 400
L16 = audio_format("L16", 16000)


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


# --- the reader ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        nested(32),  # at the limit
        '{"a": [1, 2.5, -3, true, null, "x"]}',
        '{"s": "' + "[" * 5000 + '"}',  # brackets in a string are text, not depth
        '{"s": "\\"[[[[\\""}',  # escaped quotes do not end a string early
        str(2**63 - 1),
        str(-(2**63)),
        "1e308",
        "-0.0",
        '"' + "é" * 100 + '"',
    ],
)
def test_what_is_within_bounds_reads_as_json_does(text) -> None:
    assert loads(text) == json.loads(text)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        (nested(33), "nested 33 deep"),
        ("[" * 50_000, "nested 50000 deep"),  # no RecursionError
        ("{" * 10_000, "nested"),
        ('{"a": ' * 40 + "1" + "}" * 40, "nested 40 deep"),
        (HUGE, "a number of 401 characters"),
        (str(2**63), "beyond 64 bits"),
        (str(-(2**63) - 1), "beyond 64 bits"),
        ("1e999", "out of range"),
        ("-1e999", "out of range"),
        ("NaN", "NaN is not a JSON number"),
        ("Infinity", "Infinity"),
        ('{"a": -Infinity}', "-Infinity"),
        ("0." + "0" * 60 + "1", "a number of 63 characters"),
        ("[1, 2", "not valid JSON"),
        ('"' + '\\"' * 20_000, "not valid JSON"),  # an unterminated string of escaped quotes: linear
        ("", "not valid JSON"),
        ("{} {}", "not valid JSON"),
    ],
)
def test_what_is_out_of_bounds_is_refused_saying_why(text, why) -> None:
    with pytest.raises(InputRefused, match=why):
        loads(text)


def test_size_is_bounded_in_bytes_and_bytes_must_be_utf8() -> None:
    limits = JsonLimits(max_bytes=16)
    assert loads(b'{"a": "\xc3\xa9"}', limits) == {"a": "é"}
    with pytest.raises(InputRefused, match="17 bytes"):
        loads(b'{"a": "12345678"}', limits)
    with pytest.raises(InputRefused, match="not UTF-8"):
        loads(b'{"a": "\xff"}')
    with pytest.raises(InputRefused, match="is not a JSON object"):
        loads_object("[1]", what="the body")
    assert issubclass(InputRefused, ValueError)  # callers that refuse a ValueError refuse it too


def test_the_depth_limit_and_nesting_depth_agree() -> None:
    assert nesting_depth('{"a": [[1]], "b": "]]]]]]]]"}') == 3
    assert nesting_depth("[]" * 1000) == 1
    assert loads(nested(4), JsonLimits(max_depth=4)) == [[[[]]]]
    with pytest.raises(InputRefused):
        loads(nested(5), JsonLimits(max_depth=4))


@pytest.mark.parametrize("text", ["0", "7", "1700000000", "000123"])
def test_ascii_int_reads_ascii_digits(text) -> None:
    assert ascii_int(text) == int(text)


@pytest.mark.parametrize(
    "text", ["", "²", "١٢٣", "１２", " 1", "1 ", "+1", "-1", "1_000", "0x10", "1e3", "1" * 19]
)
def test_ascii_int_refuses_anything_else(text) -> None:
    with pytest.raises(InputRefused):
        ascii_int(text)
    assert ascii_int_or_none(text) is None


def test_finite_number_takes_numbers_in_range_only() -> None:
    assert finite_number(1700000000, 0, 2**40) == 1700000000.0
    assert finite_number(1.5, 0, 2) == 1.5
    for value in (True, "1", None, float("nan"), float("inf"), 10**400, -1, [1]):
        assert finite_number(value, 0, 2**40) is None


# --- every parse point of a peer's input ----------------------------------------------------------------


def test_stream_messages_are_refused_1007_past_the_bounds() -> None:
    for text in ("[" * 60_000, '{"event": "connected", "n": 1e999}', '{"event": "connected", "n": NaN}'):
        with pytest.raises(ProtocolError) as refused:
            TelnyxWire(L16).parse({"text": text})
        assert refused.value.code == 1007
        with pytest.raises(TwilioProtocolError) as refused_twilio:
            parse_message({"text": text}, 65536)
        assert refused_twilio.value.code == 1007


def test_a_stop_before_the_start_is_the_end_of_the_stream() -> None:
    assert isinstance(TelnyxWire(L16).parse({"text": '{"event": "stop"}'}), StreamStop)


def test_counters_in_text_are_ascii_digits_or_nothing() -> None:
    assert number("42") == 42 and number(42) == 42
    assert number("²") is None and number(HUGE) is None and number(True) is None
    assert media_chunk({"chunk": "²"}) is None and media_chunk({"chunk": HUGE}) is None
    assert media_chunk({"chunk": "12"}) == 12


def test_json_webhook_bodies_out_of_bounds_are_refused() -> None:
    for body in (b"[" * 50_000, b'{"a": 1e999}', ('{"a": ' + HUGE + "}").encode(), b'{"a": "\xff"}', b"[1]"):
        with pytest.raises(ValueError):
            json_fields(body, "jambonz")


def test_telnyx_timestamps_that_are_no_time_do_not_verify() -> None:
    private, public = keypair()
    key = telnyx_signatures.load_public_key(public)
    body = b"CallSid=1"
    for stamp in (HUGE, "²", "1e3", " 1700000000", "-1"):
        signer = Ed25519PrivateKey.from_private_bytes(base64.b64decode(private))
        signature = base64.b64encode(signer.sign(telnyx_signatures.signed_message(stamp, body))).decode()
        assert not telnyx_signatures.verify(key, signature, stamp, body, 300)


def test_jambonz_signature_times_and_digests_that_are_no_such_thing_do_not_verify() -> None:
    secret = "s3cret"
    body = b"{}"
    now = int(time.time())
    for header in (f"t={HUGE},v1=ab", "t=²,v1=ab", f"t={now},v1=²", "t=,v1="):
        assert not jambonz_signatures.verify(secret, {"jambonz-signature": header}, body, 300)
    assert jambonz_signatures.verify(
        secret, {"jambonz-signature": jambonz_signatures.sign(secret, body)}, body, 300
    )


def test_plivo_signatures_with_non_ascii_characters_do_not_verify() -> None:
    headers = {"x-plivo-signature-v3": "²é", "x-plivo-signature-v3-nonce": "12345"}
    assert not plivo_signatures.verify("token", "POST", "https://x.test/plivo/answer", headers, [("a", "b")])


def test_vonage_tokens_with_claims_that_do_not_fit_do_not_verify() -> None:
    secret = "a-vonage-signature-secret-of-some-length"
    now = int(time.time())

    def bearer(token: str) -> dict[str, str]:
        return {"authorization": f"Bearer {token}"}

    assert vonage_signatures.verify(
        secret, bearer(jwt.encode({"iat": now}, secret, algorithm="HS256")), b"", 300
    )
    for claims in (
        {"iat": int(HUGE)},
        {"iat": 1e308},
        {"iat": True},
        {"iat": "²"},
        {"iat": now, "payload_hash": "é"},
    ):
        token = jwt.encode(claims, secret, algorithm="HS256")
        assert not vonage_signatures.verify(secret, bearer(token), b"body", 300), claims
    header = base64.urlsafe_b64encode(b"[" * 6000).decode().rstrip("=")
    payload = base64.urlsafe_b64encode(json.dumps({"iat": now}).encode()).decode().rstrip("=")
    signature = base64.urlsafe_b64encode(hmac.new(secret.encode(), b"x", hashlib.sha256).digest()).decode()
    assert not vonage_signatures.verify(secret, bearer(f"{header}.{payload}.{signature}"), b"", 300)


@pytest.mark.parametrize("created", ["²", "١", HUGE, "1e3", "-"])
def test_genesys_signature_fields_are_rfc_8941_ascii(created) -> None:
    field = f'sig1=("@authority");keyid="k";nonce="{"n" * 24}";alg="hmac-sha256";created={created}'
    with pytest.raises(httpsig.SfError):
        httpsig.parse_dictionary(field)
    verifier = httpsig.SignatureVerifier(b"key", 30)
    request = httpsig.Request("/genesys/audio-connector", "x.test", lambda name: None)
    problem = verifier.verify({"signature-input": field, "signature": "sig1=:AAAA:"}, "k", request)
    assert problem.startswith("unreadable signature fields"), problem


def test_chan_websocket_sizes_that_are_no_size() -> None:
    def size(text: str) -> int:
        return media_ws.optimal_frame_size(media_ws.parse_event(text))

    assert size("MEDIA_START format:slin16 optimal_frame_size:640") == 640
    assert size('{"event": "MEDIA_START", "optimal_frame_size": 640}') == 640
    for text in (
        "MEDIA_START optimal_frame_size:²",
        f"MEDIA_START optimal_frame_size:{HUGE}",
        "MEDIA_START optimal_frame_size:-5",
        '{"event": "MEDIA_START", "optimal_frame_size": 640.5}',
        '{"event": "MEDIA_START", "optimal_frame_size": 1000000000}',
        '{"event": "MEDIA_START", "optimal_frame_size": true}',
    ):
        assert size(text) == 0, text
    for text in (
        '{"event": "MEDIA_START", "optimal_frame_size": 1e999}',
        '{"event": "X", "a": ' + nested(9) + "}",
    ):
        with pytest.raises(media_ws.MessageError):
            media_ws.parse_event(text)


def test_a_cluster_peer_s_control_messages_are_read_bounded_before_its_secret_is_checked() -> None:
    with pytest.raises(cluster_wire.WireError, match="nested"):
        cluster_wire.parse_json(b"[" * 50_000)
    assert cluster_wire.parse_json(b'{"secret": "s"}') == {"secret": "s"}


# --- tickets -----------------------------------------------------------------------------------------------


def test_a_spent_ticket_opens_nothing_but_stays_the_calls_answer() -> None:
    registry = CallRegistry()
    answer = Reply("<Response/>", "text/xml")
    ticket = StreamTicket("t1", "telnyx", "desk", "call-1", time.monotonic() + 60, answer)
    registry.issued(ticket)
    with pytest.raises(LookupError):
        registry.claim("t1", "another-call")  # another call's: it stays
    registry.spend("t1")
    assert registry.claim("t1", "call-1") is None  # no longer proof of anything
    assert registry.outstanding("telnyx", "call-1") is ticket  # a replayed webhook: the same answer
    registry.issued(StreamTicket("t2", "telnyx", "desk", "call-2", time.monotonic() + 60, answer))
    assert registry.claim("t2", "call-2") is not None and registry.claim("t2", "call-2") is None  # once
