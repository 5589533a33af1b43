"""Genesys Cloud Audio Connector's parts on their own, against the AudioHook protocol: the session
handshake and its sequence numbers, pings, pauses, DTMF, barge-in, the outcome in `disconnect`
and `closed`; call control as output variables; the upgrade's HTTP message signature (checked
against a signature base written out by hand, as the draft and Genesys's reference build it)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import weakref

import pytest
from personaplex_genesys import httpsig
from personaplex_genesys.config import GenesysSettings
from personaplex_genesys.control import GenesysControl, variables
from personaplex_genesys.wire import GenesysWire
from personaplex_phone import carrier as phone
from personaplex_phone.carrier import (
    CallerMedia,
    CallHandle,
    CallOutcome,
    Digit,
    LinePaused,
    ProtocolError,
    StreamStart,
    StreamStop,
)

from personaplex_voice.errors import UserError

SESSION = "e160e428-53e2-487c-977d-96989bf5c99d"
PCMU = {"type": "audio", "format": "PCMU", "channels": ["external"], "rate": 8000}


class Genesys:
    """Genesys's messages, each with the next seq and the last serverseq seen."""

    def __init__(self) -> None:
        self.seq = 0
        self.serverseq = 0

    def __call__(self, kind: str, parameters: dict | None = None, **extra) -> dict:
        self.seq += 1
        message = {
            "version": "2",
            "type": kind,
            "seq": self.seq,
            "serverseq": self.serverseq,
            "id": SESSION,
            "position": "PT1.2S",
            "parameters": parameters or {},
            **extra,
        }
        return {"type": "websocket.receive", "text": json.dumps(message)}

    def saw(self, ours: str) -> dict:
        message = json.loads(ours)
        self.serverseq = message["seq"]
        return message


def open_parameters(**extra) -> dict:
    return {
        "organizationId": "org-1",
        "conversationId": "conv-1",
        "participant": {
            "id": "p-1",
            "ani": "tel:+15550100002",
            "aniName": "Omar",
            "dnis": "tel:+15550100001",
        },
        "media": [{**PCMU, "channels": ["external", "internal"]}, PCMU],
        "inputVariables": {"customer_name": "Omar Torres", "persona": "desk"},
        **extra,
    }


def opened_session() -> tuple[GenesysWire, Genesys, dict, StreamStart]:
    live: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
    wire, genesys = GenesysWire(live, message_ms=100), Genesys()
    start = wire.parse(genesys("open", open_parameters()))
    assert isinstance(start, StreamStart)
    return wire, genesys, live, start


def test_open_is_the_calls_arrival_and_opened_takes_pcmu() -> None:
    wire, genesys, live, start = opened_session()
    assert start.call_id == "conv-1" and start.stream_id == start.control_id == SESSION
    assert start.inbound == phone.AudioFormat("pcmu", 8000)
    assert start.outbound.codec == "pcmu" and start.outbound.message_ms == 100
    assert start.outbound.chunk_bytes == 800  # 100 ms a message: Genesys limits messages a second
    assert start.params == {"customer_name": "Omar Torres", "persona": "desk"}
    assert (start.facts.from_, start.facts.to) == ("+15550100002", "+15550100001")
    assert live[SESSION] is wire
    opened = genesys.saw(wire.accept())
    assert opened["type"] == "opened" and opened["seq"] == 1 and opened["clientseq"] == 1
    assert opened["id"] == SESSION and opened["parameters"]["media"] == [PCMU]
    assert wire.parse({"type": "websocket.receive", "bytes": b"\xff" * 160}) == CallerMedia(b"\xff" * 160)


def test_pings_pauses_and_keys() -> None:
    wire, genesys, _, _ = opened_session()
    genesys.saw(wire.accept())
    assert wire.parse(genesys("ping", {"rtt": "PT0.05S"})) is None
    pong = genesys.saw(wire.replies.pop())
    assert pong["type"] == "pong" and pong["seq"] == 2 and pong["clientseq"] == 2
    assert wire.parse(genesys("paused")) == LinePaused(True)
    assert wire.parse(genesys("resumed")) == LinePaused(False)
    assert wire.parse(genesys("dtmf", {"digit": "0"})) == Digit("0")
    assert wire.parse(genesys("playback_completed")) is None and wire.parse(genesys("update")) is None
    with pytest.raises(ProtocolError, match="one key"):
        wire.parse(genesys("dtmf", {"digit": "x"}))


@pytest.mark.parametrize(
    ("mangle", "problem"),
    [
        (lambda g: g("ping", seq=9), "seq 9, not 2"),
        (lambda g: g("ping", id="another"), "another session"),
        (lambda g: g("ping", serverseq=7), "ahead of ours"),
        (lambda g: g("ping", version="1"), "version"),
        (lambda g: {"type": "websocket.receive", "text": "[1]"}, "JSON object"),
    ],
)
def test_what_breaks_the_protocol_ends_the_session(mangle, problem) -> None:
    wire, genesys, _, _ = opened_session()
    genesys.saw(wire.accept())
    with pytest.raises(ProtocolError, match=problem):
        wire.parse(mangle(genesys))


def test_nothing_before_open_and_no_media_we_take_is_a_disconnect() -> None:
    with pytest.raises(ProtocolError, match="before `open`"):
        GenesysWire({}).parse(Genesys()("ping"))
    wire = GenesysWire({})
    assert wire.parse(Genesys()("open", open_parameters(media=[{**PCMU, "format": "L16"}]))) is None
    disconnect = json.loads(wire.replies.pop())
    assert disconnect["type"] == "disconnect" and disconnect["parameters"]["reason"] == "error"


def test_barge_in_then_our_disconnect_then_closed_carry_the_outcome() -> None:
    wire, genesys, live, _ = opened_session()
    genesys.saw(wire.accept())
    control = GenesysControl(live)
    call = CallHandle("conv-1", control_id=SESSION)
    assert asyncio.run(control.instruct(call, [phone.Say("Connecting you."), phone.Dial("+15551230099")])).ok
    wire.parse(genesys("dtmf", {"digit": "0"}))
    barge_in = genesys.saw(wire.clear())
    assert barge_in["type"] == "event" and barge_in["parameters"]["entities"] == [
        {"type": "barge_in", "data": {}}
    ]
    (disconnect,) = wire.farewell(
        CallOutcome("action transfer to +15551230099 (dtmf 0)", "I will connect you.")
    )
    sent = genesys.saw(disconnect)
    outputs = sent["parameters"]["outputVariables"]
    assert sent["type"] == "disconnect" and sent["parameters"]["reason"] == "completed"
    assert outputs["action"] == "transfer" and outputs["target"] == "+15551230099"
    assert outputs["say"] == "Connecting you." and outputs["dtmf"] == "0"
    assert outputs["summary"] == "I will connect you." and outputs["reason"].startswith("action transfer")
    assert all(isinstance(v, str) for v in outputs.values())  # a string map, as Architect takes it
    assert wire.clear() is None and wire.farewell(CallOutcome("x")) == []  # said once
    assert isinstance(wire.parse(genesys("close", {"reason": "disconnect"})), StreamStop)
    closed = genesys.saw(wire.replies.pop())
    assert closed["type"] == "closed" and closed["parameters"]["outputVariables"] == outputs
    assert [barge_in["seq"], sent["seq"], closed["seq"]] == [2, 3, 4]  # counting up, one by one
    assert SESSION not in live
    assert not asyncio.run(control.hang_up(call)).ok  # the session is over


def test_when_genesys_closes_first_closed_says_what_was_decided() -> None:
    wire, genesys, live, _ = opened_session()
    genesys.saw(wire.accept())
    assert asyncio.run(GenesysControl(live).hang_up(CallHandle("conv-1", control_id=SESSION))).ok
    wire.parse(genesys("close", {"reason": "end"}))
    closed = json.loads(wire.replies.pop())
    assert closed["parameters"]["outputVariables"]["action"] == "hangup"
    assert wire.farewell(CallOutcome("stop")) == []


def test_a_refusal_and_a_lost_engine_tell_the_flow() -> None:
    wire, _, _, _ = opened_session()
    refusal = json.loads(wire.refuse("All our agents are busy.", busy=True))
    assert refusal["type"] == "disconnect" and refusal["parameters"]["reason"] == "error"
    assert refusal["parameters"]["outputVariables"] == {"action": "busy", "say": "All our agents are busy."}
    wire, genesys, _, _ = opened_session()
    genesys.saw(wire.accept())
    (lost,) = wire.farewell(CallOutcome("session ended: engine_lost"))
    lost = json.loads(lost)["parameters"]
    assert lost["reason"] == "error" and lost["outputVariables"]["action"] == "error"  # the failure path
    assert lost["info"] == "session ended: engine_lost"


def test_steps_as_output_variables() -> None:
    assert variables([phone.Hangup()]) == {"action": "hangup"}
    assert variables([phone.Redirect("queue:billing")]) == {"action": "redirect", "target": "queue:billing"}
    assert variables([phone.Dial("+1555", caller_id="+1444", whisper="A caller")]) == {
        "action": "transfer",
        "target": "+1555",
        "whisper": "A caller",
        "caller_id": "+1444",
    }
    assert variables([phone.Say("Hi"), phone.Resume("t", "desk")]) is None
    wire, _, live, _ = opened_session()  # (the index holds sessions weakly: keep it)
    assert live[SESSION] is wire
    outcome = asyncio.run(
        GenesysControl(live).instruct(CallHandle("c", control_id=SESSION), [phone.Markup("x")])
    )
    assert not outcome.ok and "not supported on genesys" in outcome.detail


# --- the signed upgrade -----------------------------------------------------------------------------

KEY = b"0123456789abcdef0123456789abcdef"
NONCE = "Zm9vYmFyYmF6cXV4cXV1eDEy"
HEADERS = {
    "audiohook-organization-id": "d7934305-0972-4844-938e-9060eef73d05",
    "audiohook-session-id": "30b0e395-84d3-4570-ac13-9a62d8f514c0",
    "audiohook-correlation-id": "e160e428-53e2-487c-977d-96989bf5c99d",
    "x-api-key": "SGVsbG8sIEkgYW0gdGhlIEFQSSBrZXkh",
}
TARGET, AUTHORITY, CREATED = "/genesys/audio-connector/bot1?lang=en", "voice.example.test", 1_700_000_000
PARAMS = (
    f'keyid="{HEADERS["x-api-key"]}";nonce="{NONCE}";alg="hmac-sha256";'
    f"created={CREATED};expires={CREATED + 30}"
)
COVERED = (
    '("@request-target" "@authority" "audiohook-organization-id" "audiohook-session-id" '
    '"audiohook-correlation-id" "x-api-key")'
)


def hand_signed() -> dict[str, str]:
    """Signature-Input and Signature built by hand from the draft's rules, not by httpsig."""
    base = "\n".join(
        [
            f'"@request-target": {TARGET}',
            f'"@authority": {AUTHORITY}',
            *(f'"{name}": {HEADERS[name]}' for name in list(HEADERS)[:4]),
            f'"@signature-params": {COVERED};{PARAMS}',
        ]
    )
    signature = base64.b64encode(hmac.new(KEY, base.encode(), hashlib.sha256).digest()).decode()
    return {"signature-input": f"sig1={COVERED};{PARAMS}", "signature": f"sig1=:{signature}:"}


def request(headers: dict[str, str] = HEADERS, target: str = TARGET) -> httpsig.Request:
    return httpsig.Request(target, AUTHORITY, lambda name: headers.get(name))


def test_a_signature_made_as_genesys_makes_it_is_verified() -> None:
    verifier = httpsig.SignatureVerifier(KEY, max_age_s=10)
    api_key = HEADERS["x-api-key"]
    assert verifier.verify(hand_signed(), api_key, request(), now=CREATED + 2) == ""
    ours = httpsig.signed_headers(KEY, api_key, TARGET, AUTHORITY, HEADERS, NONCE, created=CREATED)
    assert {k.lower(): v for k, v in ours.items()} == hand_signed()  # the simulator signs the same


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda h, r, now: (h, r, now + 60), "too old"),
        (lambda h, r, now: (h, r, now - 60), "future"),
        (lambda h, r, now: (h, request(target="/genesys/audio-connector/other"), now), "wrong signature"),
        (lambda h, r, now: (h, request({**HEADERS, "audiohook-session-id": "x"}), now), "wrong signature"),
        (lambda h, r, now: ({**h, "signature": "sig1=:AAAA:"}, r, now), "wrong signature"),
        (lambda h, r, now: ({}, r, now), "unsigned"),
        (lambda h, r, now: ({**h, "signature-input": 'sig1=("@authority");keyid="k"'}, r, now), "cover"),
        (lambda h, r, now: ({**h, "signature-input": 'sig1=("@authority'}, r, now), "unreadable"),
    ],
)
def test_a_signature_that_is_not_genesyss_is_refused(change, problem) -> None:
    verifier = httpsig.SignatureVerifier(KEY, max_age_s=10)
    headers, req, now = change(hand_signed(), request(), CREATED + 2)
    assert problem in verifier.verify(headers, HEADERS["x-api-key"], req, now=now)


def test_another_key_id_and_a_replayed_signature_are_refused() -> None:
    verifier = httpsig.SignatureVerifier(KEY, max_age_s=10)
    assert "keyid" in verifier.verify(hand_signed(), "another-key", request(), now=CREATED)
    assert verifier.verify(hand_signed(), HEADERS["x-api-key"], request(), now=CREATED) == ""
    assert "replay" in verifier.verify(hand_signed(), HEADERS["x-api-key"], request(), now=CREATED + 1)


def test_settings_need_the_api_key_and_a_base64_secret() -> None:
    with pytest.raises(UserError, match="GENESYS_API_KEY"):
        GenesysSettings(api_key="").check(validate=True)
    with pytest.raises(UserError, match="base64"):
        GenesysSettings(api_key="k", client_secret="not base64!").check(validate=True)
    assert GenesysSettings(api_key="k", client_secret=base64.b64encode(KEY).decode()).secret_key() == KEY


def test_phone_simulate_finds_the_genesys_side() -> None:
    from personaplex_genesys.sim import GenesysSide
    from personaplex_phone.simulator import load_side

    side = load_side("genesys", api_key="k", client_secret=base64.b64encode(KEY).decode())
    assert isinstance(side, GenesysSide) and side.key == KEY


# --- the phone call, pacing in Genesys's long messages --------------------------------------------


def test_the_pacer_keeps_one_long_message_of_cushion_and_sends_no_marks() -> None:
    import numpy as np
    from personaplex_phone.playout import Playout

    sent: list[str | bytes] = []

    async def send(message: str | bytes) -> None:
        sent.append(message)

    class Frames:
        async def frames(self):
            for index in range(4):
                yield type("Out", (), {"pcm": np.zeros(1920, np.float32), "index": index, "text": None})()

    playout = Playout(send, max_queued_ms=100, playout_cushion_ms=40, max_buffered_ms=400)
    assert (playout.clock.target_s, playout.clock.max_queued_s) == pytest.approx((0.06, 0.1))  # 20 ms
    wire = GenesysWire({}, message_ms=100)
    playout.start_stream(wire, phone.AudioFormat("pcmu", 8000, message_ms=100))
    # Messages of 100 ms: one of cushion, and up to two held (the next comes before this one ends).
    assert (playout.clock.target_s, playout.clock.max_queued_s) == pytest.approx((0.2, 0.2))
    asyncio.run(playout.run(Frames()))
    assert sent and all(isinstance(m, bytes) and len(m) == 800 for m in sent)  # no marks at all
    assert playout.marks.sent == 0 and playout.frames_out == len(sent)
