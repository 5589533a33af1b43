"""The Twilio bridge's parts on their own: settings, personas file, TwiML, signatures, pacing,
audio path, message parsing. No server, no sockets."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import numpy as np
import pytest
from personaplex_phone.audio_path import CHUNK_BYTES, InboundAudio, OutboundAudio
from personaplex_phone.personas import PersonaBook, normalize_number
from personaplex_phone.playback_buffer import CHUNK_S, MarkTracker, PlaybackClock
from personaplex_twilio import twiml
from personaplex_twilio.config import TwilioSettings
from personaplex_twilio.signatures import SignatureChecker, public_url_of
from personaplex_twilio.wire import ProtocolError, parse_message
from starlette.requests import Request
from support_twilio import sine_fit_snr_db, tone
from twilio.request_validator import RequestValidator

from personaplex_voice.engine.base import Persona
from personaplex_voice.errors import UserError

TOKEN = "unit-auth-token"


# --- settings -------------------------------------------------------------------------------------


def test_settings_read_twilios_standard_variables(monkeypatch) -> None:
    monkeypatch.setenv("TWILIO_ACCOUNT_SID", "AC123")
    monkeypatch.setenv("TWILIO_AUTH_TOKEN", "tok-3f9a1c")
    monkeypatch.setenv("PUBLIC_URL", "https://abc.example.test/")
    monkeypatch.setenv("PERSONAPLEX_TWILIO_MAX_CALL_S", "60")
    settings = TwilioSettings()
    assert settings.account_sid == "AC123"
    assert settings.auth_token.get_secret_value() == "tok-3f9a1c"
    assert settings.public_url == "https://abc.example.test"
    assert settings.max_call_s == 60
    assert settings.validate_signatures
    assert "tok-3f9a1c" not in repr(settings)


def test_signatures_are_required_unless_the_dev_flag_is_set(monkeypatch) -> None:
    monkeypatch.delenv("TWILIO_AUTH_TOKEN", raising=False)
    with pytest.raises(UserError, match="TWILIO_AUTH_TOKEN"):
        TwilioSettings().check()
    monkeypatch.setenv("PERSONAPLEX_TWILIO_DEV_SKIP_SIGNATURE", "1")
    settings = TwilioSettings()
    settings.check()
    assert not settings.validate_signatures


def test_public_url_with_a_query_is_rejected() -> None:
    with pytest.raises(ValueError, match="PUBLIC_URL"):
        TwilioSettings(public_url="https://x.test/?a=1")
    with pytest.raises(ValueError, match="PUBLIC_URL"):
        TwilioSettings(public_url="ftp://x.test")


# --- personas -----------------------------------------------------------------------------------


def test_personas_file_maps_numbers_with_a_default(tmp_path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(
        "default: desk\n"
        "personas:\n"
        "  desk: {text_prompt: 'Front desk.', voice: NATF2}\n"
        "  sales: {text_prompt: 'Sales.', seed: 3, sampling: {text_temperature: 0.5, audio_topk: 100}}\n"
        "numbers:\n"
        "  '+1 (555) 010-0009': sales\n"
    )
    book = PersonaBook.load(path)
    assert book.for_number("+15550100009") == "sales"
    assert book.for_number("+15550100010") == "desk"
    sales = book.get("sales")
    assert sales.seed == 3 and sales.sampling.text_temperature == 0.5 and sales.sampling.audio_topk == 100
    assert book.get("desk") == Persona(text_prompt="Front desk.", voice="NATF2")
    json_path = tmp_path / "p.json"
    json_path.write_text(json.dumps({"personas": {"default": {"text_prompt": "Hi."}}}))
    assert PersonaBook.load(json_path).for_number("+1") == "default"


def test_no_personas_file_means_one_default_persona() -> None:
    book = PersonaBook.load(None)
    assert book.get(book.for_number("+15550000000")) == Persona()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("personas: [1, 2]", "must map names"),
        ("personas:\n  a: {text_prompt: x, colour: red}", "unknown keys"),
        ("default: b\npersonas:\n  a: {}", "default persona 'b'"),
        ("default: a\npersonas:\n  a: {}\nnumbers:\n  '+1': ghost", "ghost"),
        ("personas:\n  a: {}", "default persona 'default'"),
        ("personas:\n  a: {sampling: {text_temperature: 99}}", "text_temperature"),
        ("personas:\n  '../x': {}", "bad persona name"),
        ("personas: {a: {", "not valid YAML"),
    ],
)
def test_bad_personas_files_name_the_file_and_the_problem(tmp_path, text, message) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(UserError, match=message) as info:
        PersonaBook.load(path)
    assert str(path) in str(info.value)


def test_missing_personas_file_is_a_user_error(tmp_path) -> None:
    with pytest.raises(UserError, match=r"nope\.yaml"):
        PersonaBook.load(tmp_path / "nope.yaml")


def test_numbers_are_normalized() -> None:
    assert normalize_number(" +1 (555) 010-0009 ") == "+15550100009"
    assert normalize_number("sip:alice@example.test") == "sip:alice@example.test"


# --- TwiML ----------------------------------------------------------------------------------------


def test_connect_stream_twiml_carries_parameters_not_a_query() -> None:
    xml = twiml.connect_stream("wss://x.test/twilio/media-stream", {"token": "a&b", "persona": 'say "hi"'})
    stream = ET.fromstring(xml).find("./Connect/Stream")
    assert stream is not None and stream.get("url") == "wss://x.test/twilio/media-stream"
    assert {p.get("name"): p.get("value") for p in stream} == {"token": "a&b", "persona": 'say "hi"'}
    with pytest.raises(ValueError, match="query"):
        twiml.connect_stream("wss://x.test/s?token=1", {})


def test_busy_twiml_says_and_hangs_up() -> None:
    root = ET.fromstring(twiml.say_and_hang_up("All agents <busy>."))
    assert [child.tag for child in root] == ["Say", "Hangup"]
    assert root.find("Say").text == "All agents <busy>."


# --- signatures -----------------------------------------------------------------------------------


def _request(
    path: str, query: str = "", host: str = "127.0.0.1:8998", signature: str | None = None
) -> Request:
    headers = [(b"host", host.encode())]
    if signature is not None:
        headers.append((b"x-twilio-signature", signature.encode()))
    scope = {
        "type": "http",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "query_string": query.encode(),
        "headers": headers,
        "server": ("127.0.0.1", 8998),
        "root_path": "",
    }
    return Request(scope)


def test_webhook_signature_is_checked_against_public_url() -> None:
    settings = TwilioSettings(auth_token=TOKEN, public_url="https://voice.example.test")
    form = {"CallSid": "CA1", "To": "+1555", "From": "+1666"}
    good = RequestValidator(TOKEN).compute_signature(
        "https://voice.example.test/twilio/voice?persona=a", form
    )
    checker = SignatureChecker(settings)
    assert checker.check_webhook(_request("/twilio/voice", "persona=a", signature=good), form)
    assert not checker.check_webhook(_request("/twilio/voice", "persona=b", signature=good), form)
    assert not checker.check_webhook(
        _request("/twilio/voice", "persona=a", signature=good), {**form, "To": "+1"}
    )
    assert not checker.check_webhook(_request("/twilio/voice", "persona=a"), form)
    assert (
        public_url_of(settings, _request("/twilio/voice", "x=1"))
        == "https://voice.example.test/twilio/voice?x=1"
    )


def test_without_public_url_the_host_header_is_used() -> None:
    settings = TwilioSettings(auth_token=TOKEN)
    url = public_url_of(settings, _request("/twilio/status", host="tunnel.test:8080"))
    assert url == "http://tunnel.test:8080/twilio/status"


def test_dev_flag_accepts_unsigned_requests() -> None:
    checker = SignatureChecker(TwilioSettings(dev_skip_signature=True))
    assert checker.check_webhook(_request("/twilio/voice"), {"CallSid": "CA1"})


# --- pacing ---------------------------------------------------------------------------------------


def test_playback_clock_paces_under_the_target_and_the_limit() -> None:
    clock = PlaybackClock(max_queued_s=0.100, target_s=0.060)
    now = 10.0
    for _ in range(3):
        assert clock.wait_before_send(now) == 0.0
        clock.sent(now)
    assert abs(clock.wait_before_send(now) - CHUNK_S) < 1e-9  # 60 ms queued: the next waits 20 ms
    assert PlaybackClock(max_queued_s=0.040, target_s=0.500).wait_before_send(now) == 0.0
    capped = PlaybackClock(max_queued_s=0.040, target_s=0.500)
    capped.sent(now)
    capped.sent(now)
    assert abs(capped.wait_before_send(now) - CHUNK_S) < 1e-9  # the limit wins over the target


def test_playback_clock_never_lets_twilio_hold_more_than_the_limit() -> None:
    clock = PlaybackClock(max_queued_s=0.100, target_s=0.100)
    now = 10.0
    waits = []
    for _ in range(40):  # a burst: two seconds of audio offered at once
        wait = clock.wait_before_send(now)
        waits.append(wait)
        now += wait
        clock.sent(now)
        assert clock.queued(now) <= 0.100 + 1e-9
    assert waits[:5] == [0.0] * 5 and all(abs(w - CHUNK_S) < 1e-9 for w in waits[5:])
    assert clock.underruns == 0
    clock.sent(now + 1.0)  # a second of nothing: Twilio ran dry before this one
    assert clock.underruns == 1


def test_mark_echo_measures_what_twilio_holds() -> None:
    marks = MarkTracker()
    marks.add("1", 0.08)
    marks.add("2", 0.16)
    assert marks.echo("1", total_sent_s=0.16)
    assert not marks.echo("1", total_sent_s=0.16)  # echoed once
    assert not marks.echo("ghost", total_sent_s=0.16)
    assert marks.acked == 1 and abs(marks.queued_at_ack_s[0] - 0.08) < 1e-9


# --- audio path -----------------------------------------------------------------------------------


def test_audio_path_round_trip_keeps_a_tone_clean() -> None:
    inbound, outbound = InboundAudio(), OutboundAudio()
    from personaplex_voice.audio.mulaw import ulaw_encode

    sent = tone(1000.0, 1.0)
    data = ulaw_encode(sent)
    up = np.concatenate(
        [inbound.convert(data[i : i + CHUNK_BYTES]) for i in range(0, len(data), CHUNK_BYTES)]
    )
    assert len(up) == 3 * len(sent)
    chunks = []
    for i in range(0, len(up), 1920):
        chunks += outbound.convert(up[i : i + 1920])
    assert all(len(c) == CHUNK_BYTES for c in chunks) and len(chunks) == len(data) // CHUNK_BYTES
    from personaplex_voice.audio.mulaw import ulaw_decode

    back = ulaw_decode(b"".join(chunks))
    assert sine_fit_snr_db(back[400:-400], 1000.0) >= 30.0


# --- message parsing ------------------------------------------------------------------------------


def test_outbound_messages_are_the_documented_json() -> None:
    import base64
    import json

    from personaplex_twilio.wire import OutboundMessages

    for stream_sid in ("MZ" + "0" * 32, 'MZ"odd\\sid\u00e9'):
        messages = OutboundMessages(stream_sid)
        chunk = bytes(range(160))
        assert json.loads(messages.media(chunk)) == {
            "event": "media",
            "streamSid": stream_sid,
            "media": {"payload": base64.b64encode(chunk).decode("ascii")},
        }
        assert json.loads(messages.mark("17")) == {
            "event": "mark",
            "streamSid": stream_sid,
            "mark": {"name": "17"},
        }


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        ({"type": "websocket.receive", "text": "{nope"}, 1007),
        ({"type": "websocket.receive", "text": "[1, 2]"}, 1007),
        ({"type": "websocket.receive", "text": '{"no_event": 1}'}, 1007),
        ({"type": "websocket.receive", "bytes": b"\x00\x01"}, 1007),
        ({"type": "websocket.receive", "text": "x" * 70_000}, 1009),
    ],
)
def test_malformed_messages_are_protocol_errors(raw, code) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_message(raw, 65536)
    assert info.value.code == code


def test_documented_messages_parse() -> None:
    message = parse_message(
        {"type": "websocket.receive", "text": '{"event": "connected", "protocol": "Call"}'}, 1024
    )
    assert message["event"] == "connected"


def test_the_wire_format_module_imports_nothing_of_the_bridge() -> None:
    import ast
    import inspect

    from personaplex_twilio import wire

    tree = ast.parse(inspect.getsource(wire))
    imported = [
        (node.level, getattr(node, "module", None) or "")
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
    ] + [(0, alias.name) for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    assert all(level == 0 for level, _ in imported)  # no relative import: nothing of the bridge
    ours = [name for _, name in imported if name.startswith(("personaplex", "starlette", "fastapi"))]
    # Only the bounded JSON reader every peer's input goes through.
    assert ours == ["personaplex_voice"]
    assert "from personaplex_voice import untrusted\n" in inspect.getsource(wire)


def test_a_prompt_template_renders_declared_values_and_literal_braces() -> None:
    from personaplex_phone.context import PromptTemplate, clean_value

    template = PromptTemplate.parse("Hi {name}, {{not a field}} from {From}.")
    assert template.fields == {"name", "From"}
    assert template.render({"name": "Omar", "From": "+1555"}) == "Hi Omar, {not a field} from +1555."
    assert clean_value("two\nlines\x00") == "two lines" and clean_value(True) == "yes"
    assert clean_value({"a": 1}) is None


def test_twilio_gets_40_ms_messages_with_a_mark_after_every_frame_and_holds_at_most_80_ms() -> None:
    """The outbound message size (PERSONAPLEX_TWILIO_MESSAGE_MS, 40 by default: half the
    WebSocket messages of 20 ms ones): each `media` carries 320 μ-law bytes, a `mark` still
    follows every 80 ms engine frame, and what Twilio may hold of ours (the cushion and one
    message) stays within the 100 ms a barge-in lets through; 20 ms messages remain a choice."""
    import asyncio
    import base64

    from personaplex_phone.playout import Playout
    from personaplex_twilio.carrier import TwilioWire
    from personaplex_twilio.config import TwilioSettings

    assert TwilioSettings(auth_token="t").message_ms == 40
    wire = TwilioWire(64 * 1024, message_ms=40)
    start = {
        "event": "start",
        "start": {"streamSid": "MZ1", "callSid": "CA1", "customParameters": {}},
        "streamSid": "MZ1",
    }
    event = wire.parse({"text": json.dumps(start)})
    assert event.outbound.message_ms == 40 and event.inbound.message_ms == 20

    sent: list[str] = []

    async def send(message: str) -> None:
        sent.append(message)

    class Frames:
        async def frames(self):
            for index in range(6):
                pcm = (0.3 * np.sin(np.arange(1920) / 3)).astype(np.float32)
                yield type("Out", (), {"pcm": pcm, "index": index, "text": None})()

    playout = Playout(send, max_queued_ms=100, playout_cushion_ms=40, max_buffered_ms=400)
    playout.start_stream(wire, event.outbound)
    assert (playout.clock.target_s, playout.clock.max_queued_s) == pytest.approx((0.08, 0.08))
    asyncio.run(playout.run(Frames()))
    messages = [json.loads(m) for m in sent]
    media = [m for m in messages if m["event"] == "media"]
    assert {len(base64.b64decode(m["media"]["payload"])) for m in media} == {320}
    assert [m["mark"]["name"] for m in messages if m["event"] == "mark"] == [str(i) for i in range(6)]
    assert playout.clock.max_seen_queue_s <= 0.080 + 1e-9
    assert TwilioWire(64 * 1024, message_ms=20).outbound.message_ms == 20
