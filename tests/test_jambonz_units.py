"""jambonz's parts on their own, against its published protocol: the listen socket's messages
(first frame, binary L16 little-endian, DTMF, marks), our verbs, the webhook signature (HMAC of
`t.body`, stale timestamps refused), call control through the listen's actionHook."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json

import numpy as np
import pytest
from personaplex_jambonz import signatures, verbs
from personaplex_jambonz.carrier import JambonzCarrier, http_base
from personaplex_jambonz.config import JambonzSettings
from personaplex_jambonz.control import JambonzControl
from personaplex_jambonz.wire import JambonzWire
from personaplex_phone import carrier as phone
from personaplex_phone.audio_path import OutboundAudio
from personaplex_phone.carrier import CallerMedia, CallHandle, Digit, MarkPlayed, ProtocolError, StreamStart

from personaplex_voice.errors import UserError

FIRST = {
    "callSid": "b1c3e5f6-0000-4a4b-8c8d-000000000001",
    "direction": "inbound",
    "from": "+15550100002",
    "to": "+15550100001",
    "accountSid": "acct-1",
    "sampleRate": 16000,
    "mixType": "mono",
    "personaplex": {"persona": "desk", "customer_name": "Omar"},
}


def text(message: dict) -> dict:
    return {"type": "websocket.receive", "text": json.dumps(message)}


def binary(data: bytes) -> dict:
    return {"type": "websocket.receive", "bytes": data}


def started_wire() -> tuple[JambonzWire, StreamStart]:
    wire = JambonzWire()
    start = wire.parse(text(FIRST))
    assert isinstance(start, StreamStart)
    return wire, start


# --- the listen socket -----------------------------------------------------------------------------


def test_the_first_frame_is_the_calls_facts_and_our_metadata() -> None:
    _, start = started_wire()
    assert start.call_id == FIRST["callSid"] and start.account == "acct-1"
    assert start.inbound == start.outbound == phone.AudioFormat("l16", 16000, big_endian=False)
    assert start.params == {"persona": "desk", "customer_name": "Omar"}
    assert (start.facts.from_, start.facts.to, start.facts.direction) == (
        "+15550100002",
        "+15550100001",
        "inbound",
    )


def test_audio_is_little_endian_l16_both_ways() -> None:
    wire, start = started_wire()
    samples = np.array([1000, -2], "<i2").tobytes()
    assert wire.parse(binary(samples)) == CallerMedia(samples)
    out = OutboundAudio(start.outbound)
    chunks = out.convert(np.full(1920, 0.5, np.float32))  # 80 ms at 24 kHz -> 16 kHz
    assert all(len(c) == 640 for c in chunks)  # 20 ms messages
    assert abs(int(np.frombuffer(chunks[-1], "<i2")[-1]) - 16384) < 100  # little-endian on the wire
    assert wire.media(chunks[0]) == chunks[0]


def test_dtmf_marks_and_our_messages() -> None:
    wire, _ = started_wire()
    assert wire.parse(text({"event": "dtmf", "dtmf": "5", "duration": 1280})) == Digit("5")
    assert wire.parse(text({"type": "dtmf", "dtmf": "#"})) == Digit("#")
    played = {"type": "mark", "data": {"name": "12", "event": "playout"}}
    assert wire.parse(text(played)) == MarkPlayed("12")
    assert wire.parse(text({"type": "mark", "data": {"name": "13", "event": "cleared"}})) is None
    assert wire.parse(text({"type": "playDone"})) is None
    assert json.loads(wire.mark("7")) == {"type": "mark", "data": {"name": "7"}}
    assert json.loads(wire.clear()) == {"type": "killAudio"}


@pytest.mark.parametrize(
    ("message", "problem"),
    [
        (binary(b"\x00\x01"), "before jambonz's first"),
        ({"type": "websocket.receive", "text": "not json"}, "not valid JSON"),
        (text({**FIRST, "callSid": ""}), "callSid"),
        (text({**FIRST, "sampleRate": 44100}), "sampleRate"),
        (text({**FIRST, "mixType": "stereo"}), "mono"),
    ],
)
def test_a_broken_start_is_refused(message, problem) -> None:
    with pytest.raises(ProtocolError, match=problem):
        JambonzWire().parse(message)


def test_odd_audio_and_bad_keys_are_refused() -> None:
    wire, _ = started_wire()
    with pytest.raises(ProtocolError, match="whole 2-byte"):
        wire.parse(binary(b"\x00\x01\x02"))
    with pytest.raises(ProtocolError, match="one key"):
        wire.parse(text({"event": "dtmf", "dtmf": "55"}))


# --- verbs -------------------------------------------------------------------------------------------


def test_the_answer_is_a_listen_with_its_rate_always_set() -> None:
    carrier = JambonzCarrier(JambonzSettings(webhook_secret="s", sample_rate=16000), lambda r, b: "", True)
    reply = carrier.answer_stream(
        "wss://voice.example.test/p/jambonz/media-stream/TICKET", {"persona": "desk"}, phone.CallFacts("c")
    )
    (listen,) = json.loads(reply.body)
    assert listen["verb"] == "listen" and listen["url"].endswith("/jambonz/media-stream/TICKET")
    assert listen["sampleRate"] == listen["bidirectionalAudio"]["sampleRate"] == 16000
    assert listen["bidirectionalAudio"]["streaming"] is True and listen["passDtmf"] is True
    assert listen["metadata"] == {"personaplex": {"persona": "desk"}}
    assert listen["actionHook"] == "https://voice.example.test/p/jambonz/action"
    assert http_base("ws://h:8/jambonz/media-stream/x") == "http://h:8"
    refusal = json.loads(carrier.answer_refusal("busy", busy=True).body)
    assert [v["verb"] for v in refusal] == ["say", "hangup"]


def test_steps_become_verbs() -> None:
    published = []
    control = JambonzControl(
        lambda reply, base: published.append(reply) or f"{base}/jambonz/instructions/T", 24000
    )
    call = CallHandle("call-1", public_base="https://voice.example.test")
    steps = [phone.Say("One moment."), phone.Dial("sip:agents@pbx.example.test", "+15550009999", "A caller")]
    document = control.document(call, steps)
    assert document[0] == {"verb": "say", "text": "One moment."}
    dial = document[1]
    assert dial["target"] == [
        {
            "type": "sip",
            "sipUri": "sip:agents@pbx.example.test",
            "confirmHook": "https://voice.example.test/jambonz/instructions/T",
        }
    ]
    assert dial["callerId"] == "+15550009999"
    assert json.loads(published[0].body) == [{"verb": "say", "text": "A caller"}]
    back = control.document(call, [phone.Say("Hours are nine to five."), phone.Resume("TOKEN", "desk")])
    assert (
        back[1]["verb"] == "listen"
        and back[1]["url"] == "wss://voice.example.test/jambonz/media-stream/TOKEN"
    )
    assert verbs.render([phone.Hangup()], whisper_url=lambda d: None, resume=lambda r: {}) == [
        {"verb": "hangup"}
    ]
    with pytest.raises(ValueError):
        verbs.render([phone.Markup('{"verb": "x"}')], whisper_url=lambda d: None, resume=lambda r: {})


def test_instructions_wait_for_the_actionhook_once() -> None:
    control = JambonzControl(lambda reply, base: "", 24000)
    call = CallHandle("call-2", public_base="https://h")
    assert asyncio.run(control.instruct(call, [phone.Dial("+15551230099")])).ok
    assert control.next_verbs("call-2")[0]["verb"] == "dial"
    assert control.next_verbs("call-2") == [{"verb": "hangup"}]  # taken once; then: hang up
    bad = asyncio.run(control.instruct(call, [phone.Markup("not json")]))
    assert not bad.ok and "jambonz" in bad.detail


# --- signatures --------------------------------------------------------------------------------------


def test_signatures_are_hmac_of_the_timestamp_and_body() -> None:
    body, secret, t = b'{"call_sid":"x"}', "wh-secret", 1_700_000_000
    digest = hmac.new(secret.encode(), b"1700000000." + body, hashlib.sha256).hexdigest()
    header = {"jambonz-signature": f"t={t},v1={digest}"}
    assert signatures.sign(secret, body, t) == header["jambonz-signature"]
    assert signatures.verify(secret, header, body, 300, now=t + 10)
    assert not signatures.verify(secret, header, body + b" ", 300, now=t + 10)  # another body
    assert not signatures.verify("other", header, body, 300, now=t + 10)
    assert not signatures.verify(secret, header, body, 300, now=t + 301)  # stale: a replay
    assert not signatures.verify(secret, header, body, 300, now=t - 301)  # from the future
    assert not signatures.verify(secret, {}, body, 300, now=t)
    rotated = {"jambonz-signature": f"t={t},v1={'0' * 64},v1={digest}"}
    assert signatures.verify(secret, rotated, body, 300, now=t)


def test_phone_simulate_finds_the_jambonz_side() -> None:
    from personaplex_jambonz.sim import JambonzSide
    from personaplex_phone.simulator import load_side

    assert isinstance(load_side("jambonz", webhook_secret="s"), JambonzSide)


def test_a_server_without_the_secret_does_not_start() -> None:
    with pytest.raises(UserError, match="JAMBONZ_WEBHOOK_SECRET"):
        JambonzSettings(webhook_secret="").check(validate=True)
    JambonzSettings(webhook_secret="", dev_skip_signature=True).check(validate=True)
