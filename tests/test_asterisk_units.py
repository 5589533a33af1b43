"""Asterisk's pieces on their own: the AudioSocket framing and both numberings of its rate kinds,
chan_websocket's events and commands in plain text and JSON, both wires as the phone call's
events, the dialplan's next steps and ARI, the body of `POST /asterisk/calls`; the phone call's
barge-in detector and playout (barge-in, flow control). No server, no sockets."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid

import numpy as np
import pytest
from personaplex_asterisk import audiosocket as asock
from personaplex_asterisk import media_ws
from personaplex_asterisk.carrier import AsteriskCarrier, flatten, safe_call_id
from personaplex_asterisk.config import AsteriskSettings, parse_listen
from personaplex_asterisk.control import AsteriskControl, next_step
from personaplex_asterisk.tickets import AsteriskTicket, NextSteps, TicketBook
from personaplex_asterisk.wire import AudioSocketWire, MediaWebSocketWire
from personaplex_phone import carrier as phone
from personaplex_phone.barge_in import BargeIn
from personaplex_phone.carrier import (
    AudioFormat,
    CallerMedia,
    CallHandle,
    Digit,
    FlowControl,
    MarkPlayed,
    ProtocolError,
    RestAnswer,
    StreamStart,
    StreamStop,
    Webhook,
)
from personaplex_phone.playout import Playout

from personaplex_voice.errors import UserError

CALL_UUID = "5bd9b4b4-9d6a-4b87-9f5e-2c0f0b5e8a11"


def entry(call_id: str = "1712345678.42") -> AsteriskTicket:
    return AsteriskTicket(CALL_UUID, "manager-ticket", 1e18, call_id=call_id, persona="desk")


# --- AudioSocket: the framing ----------------------------------------------------------------------


def test_audiosocket_messages_are_kind_length_payload() -> None:
    assert asock.HANGUP == b"\x00\x00\x00"
    message = asock.uuid_message(CALL_UUID)
    assert message[:3] == b"\x01\x00\x10" and message[3:] == uuid.UUID(CALL_UUID).bytes
    audio = asock.encode(0x12, b"\x01\x02" * 320)
    assert audio[:3] == bytes([0x12, 0x02, 0x80])  # 640, big-endian
    messages, rest = asock.decode_all(message + audio + b"\x03\x00")
    assert [(m.kind, len(m.payload)) for m in messages] == [(0x01, 16), (0x12, 640)] and rest == b"\x03\x00"
    assert asock.parse_uuid(messages[0].payload) == CALL_UUID
    assert asock.parse_dtmf(b"#") == "#"
    with pytest.raises(asock.FrameError):
        asock.parse_dtmf(b"x")
    with pytest.raises(asock.FrameError):
        asock.parse_uuid(b"short")
    assert "calling party hung up" in asock.describe_error(b"\x01")


@pytest.mark.parametrize(
    ("kind", "length", "rate", "numbering"),
    [
        (0x10, 320, 8000, "original"),
        (0x12, 640, 16000, "asterisk"),  # Asterisk's numbering: 0x12 is 16 kHz
        (0x11, 480, 12000, "asterisk"),  # ...and 0x11 12 kHz: 20 ms is 480 bytes
        (0x11, 640, 16000, "first"),  # the first proposal's 0x11 = 16 kHz: 20 ms is 640 bytes
        (0x11, 320, 16000, "first"),  # 10 ms at 16 kHz
        (0x11, 960, 12000, "asterisk"),  # fits both (30 ms at 16 kHz, 40 ms at 12 kHz): Asterisk's
        (0x13, 960, 24000, "asterisk"),
        (0x16, 1920, 48000, "asterisk"),
    ],
)
def test_both_numberings_of_the_rate_kinds(kind, length, rate, numbering) -> None:
    got_rate, got_numbering = asock.audio_rate(kind, length)
    assert got_rate == rate and numbering in got_numbering


def test_the_0x11_reading_can_be_forced() -> None:
    assert asock.audio_rate(0x11, 640, rate_0x11=12000)[0] == 12000
    assert asock.audio_rate(0x11, 480, rate_0x11=16000)[0] == 16000
    assert AsteriskSettings(audiosocket_0x11="slin16").rate_0x11 == 16000
    assert AsteriskSettings().rate_0x11 is None


def test_listen_addresses() -> None:
    assert parse_listen("10.0.0.5:9092") == ("10.0.0.5", 9092)
    assert parse_listen("[::1]:9092") == ("::1", 9092)
    for bad in ("9092", "host:", "host:port", ":9092"):
        with pytest.raises(UserError):
            parse_listen(bad)


# --- AudioSocket: the wire -------------------------------------------------------------------------


def feed(wire, kind: int, payload: bytes = b""):
    return wire.parse({"kind": kind, "bytes": payload})


def test_audiosocket_starts_at_the_first_audio_and_answers_in_its_kind(caplog) -> None:
    wire = AudioSocketWire(entry())
    assert wire.plays_on_arrival
    assert feed(wire, asock.KIND_UUID, uuid.UUID(CALL_UUID).bytes) is None
    assert feed(wire, asock.KIND_DTMF, b"5") is None  # before the audio: no stream to act on yet
    with caplog.at_level(logging.INFO, logger="personaplex_asterisk.wire"):
        start = feed(wire, 0x11, bytes(640))  # 0x11 in 640-byte messages: the first numbering
    assert isinstance(start, StreamStart)
    assert start.call_id == "1712345678.42" and start.stream_id == CALL_UUID
    assert start.inbound == start.outbound == AudioFormat("l16", 16000)
    assert start.params == {"persona": "desk"}
    assert "0x11 = 16000 Hz" in caplog.text and "first proposal" in caplog.text
    assert feed(wire, 0x11, b"\x01\x00" * 320) == CallerMedia(b"\x01\x00" * 320)
    assert wire.media(b"\x00\x00" * 320)[:3] == bytes([0x11, 0x02, 0x80])  # back in the same kind
    assert wire.mark("1") is None and wire.clear() is None
    assert feed(wire, asock.KIND_DTMF, b"#") == Digit("#")
    assert isinstance(feed(wire, asock.KIND_HANGUP), StreamStop)


def test_asterisk_numbering_at_16k_and_8k() -> None:
    for kind, rate in ((0x12, 16000), (0x10, 8000)):
        wire = AudioSocketWire(entry())
        feed(wire, asock.KIND_UUID, uuid.UUID(CALL_UUID).bytes)
        start = feed(wire, kind, bytes(rate // 50 * 2))
        assert start.inbound.rate == rate and wire.media(b"\x00\x00")[0] == kind


@pytest.mark.parametrize(
    ("messages", "error"),
    [
        ([(0x10, bytes(320))], "before the UUID"),
        ([(0x01, uuid.UUID(CALL_UUID).bytes), (0x01, uuid.UUID(CALL_UUID).bytes)], "second UUID"),
        ([(0x01, uuid.UUID(CALL_UUID).bytes), (0x42, b"")], "unknown AudioSocket message kind"),
        ([(0x01, uuid.UUID(CALL_UUID).bytes), (0x10, bytes(3))], "whole 16-bit samples"),
        ([(0x01, uuid.UUID(CALL_UUID).bytes), (0x10, bytes(320)), (0x12, bytes(640))], "kind changed"),
        ([(0x01, uuid.UUID(CALL_UUID).bytes), (0x17, bytes(3840))], "96000 Hz"),
        ([(0x01, b"short")], "16 bytes"),
    ],
)
def test_audiosocket_protocol_errors(messages, error) -> None:
    wire = AudioSocketWire(entry())
    with pytest.raises(ProtocolError, match=error):
        for kind, payload in messages:
            feed(wire, kind, payload)


def test_an_asterisk_error_ends_the_stream(caplog) -> None:
    wire = AudioSocketWire(entry())
    feed(wire, asock.KIND_UUID, uuid.UUID(CALL_UUID).bytes)
    with caplog.at_level(logging.INFO, logger="personaplex_asterisk.wire"):
        assert isinstance(feed(wire, asock.KIND_ERROR, b"\x02"), StreamStop)
    assert "frame forwarding error" in wire.error and "WARNING" in caplog.text


# --- chan_websocket ---------------------------------------------------------------------------------

PLAIN_START = (
    "MEDIA_START connection_id:e226e283-c90a-4ea9-9e37-389000b9ef47 channel:WebSocket/conn/0x7f01 "
    "channel_id:pbx1-1712345678.77 format:slin16 optimal_frame_size:640 ptime:20"
)
JSON_START = json.dumps(
    {
        "event": "MEDIA_START",
        "connection_id": "e226e283-c90a-4ea9-9e37-389000b9ef47",
        "channel": "WebSocket/conn/0x7f01",
        "channel_id": "pbx1-1712345678.77",
        "format": "slin16",
        "optimal_frame_size": 640,
        "ptime": 20,
        "channel_variables": {"CALLERID(num)": "+15550100002"},
    }
)


def text(wire, value: str):
    return wire.parse({"type": "websocket.receive", "text": value})


@pytest.mark.parametrize(("start", "fmt"), [(PLAIN_START, media_ws.PLAIN), (JSON_START, media_ws.JSON)])
def test_chan_websocket_events_in_both_formats_and_commands_in_kind(start, fmt) -> None:
    wire = MediaWebSocketWire(entry())
    started = text(wire, start)
    assert isinstance(started, StreamStart) and started.call_id == "1712345678.42"
    assert started.stream_id == "pbx1-1712345678.77"
    assert started.inbound == AudioFormat("l16", 16000) and wire.format == fmt
    assert wire.optimal_frame_size == 640
    assert wire.parse({"bytes": b"\x00\x01" * 320}) == CallerMedia(b"\x00\x01" * 320)
    dtmf = (
        '{"event":"DTMF_END","channel_id":"x","digit":"7"}'
        if fmt == media_ws.JSON
        else "DTMF_END digit:7 channel_id:x"
    )
    assert text(wire, dtmf) == Digit("7")
    mark = (
        '{"event":"MEDIA_MARK_PROCESSED","channel_id":"x","correlation_id":"12"}'
        if fmt == media_ws.JSON
        else "MEDIA_MARK_PROCESSED 12"
    )
    assert text(wire, mark) == MarkPlayed("12")
    xoff = '{"event":"MEDIA_XOFF","channel_id":"x"}' if fmt == media_ws.JSON else "MEDIA_XOFF"
    assert text(wire, xoff) == FlowControl(paused=True)
    assert text(wire, xoff.replace("XOFF", "XON")) == FlowControl(paused=False)
    assert text(wire, "STATUS queue_length:3 xon_level:800") is None
    if fmt == media_ws.JSON:
        assert json.loads(wire.mark("12")) == {"command": "MARK_MEDIA", "correlation_id": "12"}
        assert json.loads(wire.clear()) == {"command": "FLUSH_MEDIA"}
        assert json.loads(wire.hangup()) == {"command": "HANGUP"}
    else:
        assert (wire.mark("12"), wire.clear(), wire.hangup()) == ("MARK_MEDIA 12", "FLUSH_MEDIA", "HANGUP")
    assert wire.media(b"\x01\x02") == b"\x01\x02"
    assert isinstance(text(wire, "HANGUP"), StreamStop)


@pytest.mark.parametrize(
    ("fmt", "codec", "rate"),
    [("ulaw", "pcmu", 8000), ("alaw", "pcma", 8000), ("slin", "l16", 8000), ("slin24", "l16", 24000)],
)
def test_chan_websocket_formats(fmt, codec, rate) -> None:
    wire = MediaWebSocketWire(entry())
    start = text(
        wire, f"MEDIA_START connection_id:c channel:WebSocket/c/1 channel_id:u format:{fmt} ptime:20"
    )
    assert start.inbound == AudioFormat(codec, rate)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("messages", "error"),
    [
        ([{"bytes": b"\x00\x00"}], "media before MEDIA_START"),
        ([{"text": "MEDIA_START format:opus optimal_frame_size:0"}], "opus"),
        ([{"text": PLAIN_START}, {"text": PLAIN_START}], "second MEDIA_START"),
        ([{"text": "{not json"}], "not valid JSON"),
        ([{"text": '{"no_event": 1}'}], "without an `event`"),
        ([{"text": PLAIN_START}, {"text": "DTMF_END digit:xyz"}], "DTMF_END"),
        ([{"text": "X" * 9000}], "characters"),
    ],
)
def test_chan_websocket_protocol_errors(messages, error) -> None:
    wire = MediaWebSocketWire(entry())
    with pytest.raises(ProtocolError, match=error):
        for message in messages:
            wire.parse(message)


def test_plain_text_events_as_asterisk_writes_them() -> None:
    event = media_ws.parse_event("DTMF_END digit:5 channel_id:pbx1-1.2")
    assert (event.name, event.fields, event.format) == (
        "DTMF_END",
        {"digit": "5", "channel_id": "pbx1-1.2"},
        "plain-text",
    )
    assert media_ws.correlation_id(media_ws.parse_event("MEDIA_MARK_PROCESSED abc")) == "abc"
    assert media_ws.parse_command("MARK_MEDIA 7", media_ws.PLAIN) == ("MARK_MEDIA", "7")
    assert media_ws.parse_command('{"command":"FLUSH_MEDIA"}', media_ws.JSON) == ("FLUSH_MEDIA", "")


# --- tickets, next steps, ARI -----------------------------------------------------------------------


def test_a_uuid_opens_one_stream_once() -> None:
    book = TicketBook()
    issued = book.issue("manager-ticket", 20.0)
    assert str(uuid.UUID(issued.uuid)) == issued.uuid
    assert book.find(issued.uuid.upper()) is issued  # Asterisk may print it in either case
    assert book.take(issued.uuid) is issued and book.take(issued.uuid) is None
    assert book.find("not-a-uuid") is None
    expired = book.issue("t", -1.0)
    assert book.find(expired.uuid) is None


def handle() -> CallHandle:
    return CallHandle("1712345678.42", public_base="https://voice.example.test")


def test_next_steps_for_each_kind_of_action() -> None:
    resumed: list[str] = []

    def mint(call, resume):
        resumed.append(resume.token)
        return "new-uuid"

    dial = phone.Dial("+15551230099", caller_id="+15550001", whisper="A caller")
    assert next_step([phone.Say("Connecting you."), dial], mint, handle()) == {
        "action": "transfer",
        "target": "+15551230099",
        "caller_id": "+15550001",
        "whisper": "A caller",
        "say": "Connecting you.",
    }
    assert next_step([phone.Say("Bye."), phone.Hangup()], mint, handle()) == {
        "action": "hangup",
        "say": "Bye.",
    }
    steps = [phone.Say("One moment."), phone.Play("https://x/hold.wav"), phone.Resume("tok", "desk")]
    assert next_step(steps, mint, handle()) == {
        "action": "agent",
        "uuid": "new-uuid",
        "play": "https://x/hold.wav",
        "say": "One moment.",
    } and resumed == ["tok"]
    assert next_step([phone.Markup("fallback,s,1")], mint, handle()) == {
        "action": "goto",
        "goto": "fallback,s,1",
    }
    assert next_step([phone.Redirect("https://x/twiml")], mint, handle()) is None


async def test_without_ari_the_dialplan_gets_the_step() -> None:
    sent: list = []

    async def send(request):
        sent.append(request)
        return RestAnswer(200)

    steps = NextSteps()
    control = AsteriskControl(AsteriskSettings(), steps, send, lambda c, r: "u")
    outcome = await control.instruct(handle(), [phone.Dial("+15551230099")])
    assert outcome.ok and "action=transfer" in outcome.detail and not sent
    assert steps.get("1712345678.42") == {"action": "transfer", "target": "+15551230099"}
    refused = await control.instruct(handle(), [phone.Redirect("https://x")])
    assert not refused.ok and "not supported on asterisk" in refused.detail
    assert (await control.hang_up(handle())).ok and steps.get("1712345678.42") == {"action": "hangup"}


async def test_with_ari_the_channel_gets_variables_then_continues() -> None:
    sent: list = []
    answers = iter([RestAnswer(204), RestAnswer(204), RestAnswer(204), RestAnswer(409)])

    async def send(request):
        sent.append(request)
        return next(answers)

    settings = AsteriskSettings(ari_url="http://pbx:8088/ari/", ari_username="ai", ari_password="pw")
    control = AsteriskControl(settings, NextSteps(), send, lambda c, r: "u")
    outcome = await control.instruct(handle(), [phone.Dial("+15551230099")])
    assert outcome.ok, outcome
    assert [r.method for r in sent] == ["POST", "POST", "POST"]
    assert (
        sent[0].url
        == "http://pbx:8088/ari/channels/1712345678.42/variable?variable=PERSONAPLEX_ACTION&value=transfer"
    )
    assert "variable=PERSONAPLEX_TARGET&value=%2B15551230099" in sent[1].url
    assert sent[2].url.endswith("/continue?context=personaplex-next&extension=transfer&priority=1")
    assert sent[0].headers["Authorization"] == "Basic YWk6cHc="
    refused = await control.hang_up(handle())  # 409: not ours to hang up (ARI said no)
    assert not refused.ok and "409" in refused.detail and sent[-1].method == "DELETE"


# --- POST /asterisk/calls: the body --------------------------------------------------------------


class FakeService:
    def __init__(self):
        from personaplex_phone.config import PhoneSettings

        self.settings = PhoneSettings(api_token="phone-key")
        self.app = type("App", (), {"state": type("State", (), {"settings": None})()})()
        self.rest = type("Rest", (), {"send": None})()
        self.manager = None


def test_the_body_json_or_form_gives_facts_and_flow_values() -> None:
    carrier = AsteriskCarrier(FakeService(), AsteriskSettings())
    body = {
        "persona": "sales",
        "from": "+1555",
        "to": "100",
        "call_id": "1712345678.42",
        "variables": {"customer_name": "Omar"},
    }
    fields = carrier.fields("POST", {}, json.dumps(body).encode(), "application/json")
    webhook = Webhook("POST", "https://x/asterisk/calls", {}, {}, b"", fields)
    facts = carrier.facts(webhook)
    assert (facts.call_id, facts.from_, facts.to) == ("1712345678.42", "+1555", "100")
    assert carrier.flow_values(webhook) == {"customer_name": "Omar", "persona": "sales"}
    form = carrier.fields("POST", {}, b"persona=sales&call_id=1712345678.42&customer_name=Omar+T", "")
    assert carrier.flow_values(Webhook("POST", "", {}, {}, b"", form)) == {
        "customer_name": "Omar T",
        "persona": "sales",
    }
    with pytest.raises(ValueError):
        carrier.fields("POST", {}, b"[1, 2]", "application/json")
    assert flatten({"n": 1, "nested": {"x": 1}, "variables": {"a": "b", "deep": {}}}) == {
        "n": "1",
        "variables.a": "b",
    }
    assert safe_call_id("pbx1-1712345678.42") == "pbx1-1712345678.42"
    assert safe_call_id("../../etc") == "-..-etc" and safe_call_id("") == ""
    assert carrier.facts(Webhook("POST", "", {}, {}, b"", {})).call_id.startswith("ast-")


def test_the_api_key_is_checked() -> None:
    carrier = AsteriskCarrier(FakeService(), AsteriskSettings())
    assert carrier.authorized({"authorization": "Bearer phone-key"})
    assert carrier.authorized({"x-api-key": "phone-key"})
    assert not carrier.authorized({"authorization": "Bearer wrong"}) and not carrier.authorized({})


# --- the phone call: barge-in and flow control ---------------------------------------------------------


def loud(n: int = 320) -> np.ndarray:
    return (0.3 * np.sin(np.arange(n) / 3)).astype(np.float32)


def test_barge_in_fires_when_a_talk_spurt_starts_and_rearms_after_a_pause() -> None:
    detector = BargeIn(-35.0)
    quiet, voice = np.zeros(320, np.float32), loud()
    assert not detector.feed(voice, 0.02)  # 20 ms is not yet talking
    assert detector.feed(voice, 0.02)  # 40 ms: a talk spurt starts
    assert not any(detector.feed(voice, 0.02) for _ in range(20))  # the same spurt goes on
    detector.fired()
    detector.feed(quiet, 0.02)
    detector.feed(quiet, 0.02)
    assert not (detector.feed(voice, 0.02) or detector.feed(voice, 0.02))  # a syllable later: not again
    for _ in range(15):  # 300 ms of quiet: a pause between sentences
        detector.feed(quiet, 0.02)
    detector.feed(voice, 0.02)
    assert detector.feed(voice, 0.02)
    # A click (one loud message) is not talking and does not end the quiet before it.
    clicks = BargeIn(-35.0)
    assert not clicks.feed(voice, 0.02) and not clicks.feed(quiet, 0.02) and clicks.spurts == 0


class FrameSession:
    """A session whose engine says `pcm` in 80 ms frames, in real time."""

    def __init__(self, count: int, level: float = 0.3):
        self.count = count
        self.level = level

    async def frames(self):
        for index in range(self.count):
            pcm = np.full(1920, self.level, np.float32)
            yield type("Out", (), {"pcm": pcm, "index": index, "text": None})()
            await asyncio.sleep(0.08)


class Recorder:
    def __init__(self):
        self.sent: list = []

    async def __call__(self, message) -> None:
        self.sent.append(message)


def playout(recorder: Recorder) -> Playout:
    out = Playout(recorder, max_queued_ms=100, playout_cushion_ms=40, max_buffered_ms=400)
    wire = MediaWebSocketWire(entry())
    text(wire, PLAIN_START)
    out.start_stream(wire, AudioFormat("l16", 16000))
    return out


async def test_a_barge_in_clears_before_anything_else_is_sent() -> None:
    recorder = Recorder()
    out = playout(recorder)
    task = asyncio.create_task(out.run(FrameSession(30)))
    while out.frames_out < 8:
        await asyncio.sleep(0.01)
    assert out.audible(time.monotonic())
    asked_at = len(recorder.sent)
    out.barge_in()
    while out.barge_ins == 0:
        await asyncio.sleep(0.005)
    after = recorder.sent[asked_at:]
    flush = after.index("FLUSH_MEDIA")
    assert sum(isinstance(m, bytes) for m in after[:flush]) <= 1  # at most the one on its way
    assert out.barge_sent_after <= 1 and out.metrics()["barge_ins"] == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_flow_control_pauses_and_resumes_sending() -> None:
    recorder = Recorder()
    out = playout(recorder)
    task = asyncio.create_task(out.run(FrameSession(40)))
    while out.frames_out < 5:
        await asyncio.sleep(0.01)
    out.pause(True)
    paused_at = out.frames_out
    await asyncio.sleep(0.3)
    assert out.frames_out == paused_at  # nothing sent while paused
    out.pause(False)
    while out.frames_out < paused_at + 5:
        await asyncio.sleep(0.01)
    metrics = out.metrics()
    assert metrics["flow_pauses"] == 1 and metrics["flow_paused_ms"] >= 300
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_media_credentials_when_configured() -> None:
    open_carrier = AsteriskCarrier(FakeService(), AsteriskSettings())
    assert open_carrier.media_credentials_ok({})  # none configured: the UUID alone
    carrier = AsteriskCarrier(FakeService(), AsteriskSettings(media_username="ast", media_password="pw"))
    assert carrier.media_credentials_ok({"authorization": "Basic YXN0OnB3"})
    assert not carrier.media_credentials_ok({"authorization": "Basic YXN0Ond4"})
    assert not carrier.media_credentials_ok({})


def test_the_wire_formats_import_nothing_of_ours_and_no_carrier_imports_another() -> None:
    import ast
    from pathlib import Path

    import personaplex_asterisk

    folder = Path(personaplex_asterisk.__file__).parent
    for path in sorted(folder.glob("*.py")):
        tree = ast.parse(path.read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level}
        ours = {n for n in names if n.startswith("personaplex")}
        others = {n for n in ours if n.split(".")[0] not in ("personaplex_phone", "personaplex_voice")}
        assert not others, f"{path.name} imports {others}"
        if path.name in ("audiosocket.py", "media_ws.py"):
            # Only the bounded JSON reader every peer's input goes through.
            relative = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level]
            shared = [
                (n.module, [a.name for a in n.names])
                for n in ast.walk(tree)
                if isinstance(n, ast.ImportFrom) and n.module == "personaplex_voice"
            ]
            assert shared in ([], [("personaplex_voice", ["untrusted"])]), shared
            ours.discard("personaplex_voice")
            assert not ours and not relative, f"{path.name} imports {ours or 'the package'}"
