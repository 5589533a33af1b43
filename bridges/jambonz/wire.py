"""The jambonz `listen` WebSocket (subprotocol `audio.jambonz.org`): its messages, both ways.

jambonz opens the socket our `listen` verb names and sends **one JSON text frame first**: the
call's attributes (`callSid`, `from`, `to`, `direction`, `accountSid`, ...), `sampleRate`,
`mixType`, and the verb's `metadata` merged in (ours is one key, `personaplex`: the persona's
name and the flow's values). Then the caller's audio comes as **binary** frames: 16-bit linear
PCM, **little-endian**, mono, at `sampleRate`, any length. With `passDtmf` a key comes as text,
`{"event": "dtmf", "dtmf": "5", "duration": …}`; a mark of ours comes back as `{"type": "mark",
"data": {"name": …, "event": "playout"}}` once the audio before it has played (`"cleared"`
when a `killAudio` dropped it).

We send binary L16 at the rate our verb set as `bidirectionalAudio.sampleRate` (jambonz has no
default for it), one 20 ms message at a time, `{"type": "mark", "data": {"name": …}}` after each
engine frame and `{"type": "killAudio"}` to drop what jambonz still holds of ours. jambonz ends
the stream by closing the socket (the caller hung up); closing ours ends the `listen` verb, and
jambonz asks the verb's `actionHook` what next (control.py).
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Any

from personaplex_phone import wire_json as j
from personaplex_phone.carrier import (
    CLOSE_INVALID_DATA,
    AudioFormat,
    CallFacts,
    Digit,
    MarkPlayed,
    ProtocolError,
    StreamEvent,
    StreamStart,
)

SUBPROTOCOL = "audio.jambonz.org"
METADATA_KEY = "personaplex"  # our part of the first frame (the listen verb's `metadata`)
RATES = (8000, 16000, 24000)
KILL_AUDIO = '{"type":"killAudio"}'


def l16(rate: int) -> AudioFormat:
    return AudioFormat("l16", rate, big_endian=False)


class JambonzWire:
    def __init__(self) -> None:
        self.started = False
        self.format = l16(8000)

    def parse(self, raw: Mapping[str, Any]) -> StreamEvent | None:
        media = j.binary_l16(raw, self.started, "audio before jambonz's first (call facts) frame")
        if media is not None:
            return media
        text = raw.get("text")
        if text is None:
            return None
        message = j.json_value(text)
        if not isinstance(message, dict):
            raise ProtocolError("a text frame that is not a JSON object", CLOSE_INVALID_DATA)
        if not self.started:
            return self._start(message)
        kind = message.get("event") or message.get("type")
        if kind == "dtmf":
            return Digit(j.digit(message.get("dtmf", message.get("digit"))))
        if kind == "mark":
            data = message.get("data")
            if isinstance(data, dict) and data.get("event", "playout") == "playout":
                name = data.get("name")
                return MarkPlayed(name) if isinstance(name, str) else None
        return None  # marks dropped by a killAudio, playDone, and anything new

    def _start(self, facts: dict[str, Any]) -> StreamStart:
        call_id = facts.get("callSid")
        if not isinstance(call_id, str) or not call_id:
            raise ProtocolError("jambonz's first frame has no `callSid`", CLOSE_INVALID_DATA)
        rate = j.number(facts.get("sampleRate"))
        if rate not in RATES:
            raise ProtocolError(
                f"sampleRate {facts.get('sampleRate')!r}: our listen verb asks for one of {RATES}",
                CLOSE_INVALID_DATA,
            )
        if facts.get("mixType", "mono") != "mono":
            raise ProtocolError(f"mixType {facts.get('mixType')!r}: the agent hears one voice (mono)")
        ours = facts.get(METADATA_KEY)
        self.format = l16(rate)
        self.started = True
        return StreamStart(
            "LS" + secrets.token_hex(10),  # jambonz has no stream id; a call may have several
            call_id,
            self.format,
            self.format,
            params=j.string_map(ours),
            account=str(facts.get("accountSid", "")),
            facts=CallFacts(
                call_id,
                from_=str(facts.get("from", "")),
                to=str(facts.get("to", "")),
                direction=str(facts.get("direction", "inbound")),
                account=str(facts.get("accountSid", "")),
            ),
        )

    def media(self, payload: bytes) -> bytes:
        return payload

    def mark(self, name: str) -> str:
        return j.dumps({"type": "mark", "data": {"name": name}})

    def clear(self) -> str:
        return KILL_AUDIO
