"""What the carriers' simulator sides (`bridges/<name>/sim.py`) have in common, written once.

- `SideDefaults`: the members of `simulator.CarrierSide` most carriers answer alike (20 ms of
  caller audio a message, a UUID call id, an unsigned upgrade to the offered URL, audio as
  binary frames, the socket's closing as the hang-up, nothing said after a clear).
- `JsonMediaSide`: the Twilio-style JSON media stream (`connected`, `start`, `media` with base64
  payloads, `mark`, `dtmf`, `stop`, each with a running sequence number and the stream's id)
  that Twilio, Telnyx and Exotel speak, each with its own key names and sections.
- Helpers for a side's requests: a signed form POST, a path's query, the TwiML-style call form
  and `<Connect><Stream>` answer, the secret a side signs with.

Pure data like the sides themselves: the simulator (simulator.py) does the I/O.
"""

from __future__ import annotations

import base64
import json
import os
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from typing import Any, ClassVar
from urllib.parse import urlencode

from .simulator import HttpRequest, Ours, StreamOffer

FORM = "application/x-www-form-urlencoded"


def secret(given: str | None, variable: str, why: str) -> str:
    """`given`, else the environment's `variable`; a ValueError saying `why` when neither is set."""
    value = given or os.environ.get(variable, "")
    if not value:
        raise ValueError(why)
    return value


def with_query(path: str, query: str, joiner: str = "?") -> str:
    """`path` with `query` appended (`joiner`: `&` when the path has a query already)."""
    return path + (f"{joiner}{query}" if query else "")


def form_post(path: str, form: Mapping[str, str], headers: Mapping[str, str]) -> HttpRequest:
    """A form POST, the shape of most carriers' webhooks; `headers` carry its signature."""
    return HttpRequest("POST", path, {**headers, "Content-Type": FORM}, urlencode(form).encode())


def twiml_call(account: str, call_id: str, to: str, from_: str) -> dict[str, str]:
    """A TwiML-style answer webhook's form for a ringing inbound call (Twilio's; TeXML mirrors it)."""
    return {
        "AccountSid": account,
        "CallSid": call_id,
        "From": from_,
        "To": to,
        "CallStatus": "ringing",
        "Direction": "inbound",
    }


def connect_stream(status: int, body: bytes) -> tuple[ET.Element, dict[str, str]] | None:
    """A TwiML-style answer's `<Connect><Stream>` (Twilio, TeXML) and its `<Parameter>`s, or None
    when the answer offers no stream."""
    if status != 200:
        return None
    stream = ET.fromstring(body).find("./Connect/Stream")
    if stream is None:
        return None
    return stream, {p.get("name", ""): p.get("value", "") for p in stream.findall("Parameter")}


class SideDefaults:
    """The CarrierSide members most carriers answer alike; a side overrides what is its own."""

    chunk_ms: ClassVar[int] = 20
    marks_on_clear: ClassVar[bool] = False  # a clear drops the marks queued before it, unanswered
    ends_by_close: ClassVar[bool] = True  # the caller hangs up by closing the socket

    @staticmethod
    def new_call_id() -> str:
        return str(uuid.uuid4())

    def upgrade(self, offer: StreamOffer, public_url: str) -> tuple[str, dict[str, str]]:
        return offer.url, {}  # unsigned: the ticket in the URL is what the stream presents

    def media(self, offer: StreamOffer, stream_id: str, payload: bytes, chunk: int, ms: int) -> str | bytes:
        return payload  # a binary frame of the line's audio

    def stop(self, offer: StreamOffer, stream_id: str) -> str | bytes | None:
        return None  # no stop message: the socket's closing says it

    def cleared(self, offer: StreamOffer, stream_id: str) -> str | bytes | None:
        return None  # a clear is not answered

    def read(self, message: str | bytes) -> Ours:
        if isinstance(message, bytes):
            return Ours("media", message)
        return self.read_text(message)

    def read_text(self, message: str) -> Ours:
        """One of our text messages, as the carrier reads it."""
        raise NotImplementedError


class JsonMediaSide(SideDefaults):
    """A Twilio-style JSON media stream. Subclasses name their keys and fill the sections."""

    marks_on_clear = True  # after a `clear`, the marks it dropped are echoed at once
    ends_by_close = False  # the caller's hang-up is a `stop`
    stream_key: ClassVar[str]  # the stream's id on every message ("streamSid", "stream_id", …)
    seq_key: ClassVar[str]  # the running sequence number ("sequenceNumber", …)
    connected: ClassVar[Mapping[str, str]] = {}  # the `connected` message's other fields
    media_track: ClassVar[str | None] = "inbound"  # the `track` of caller media (None: not named)

    def __init__(self) -> None:
        self._seq = 0

    def event(self, name: str, stream_id: str, **sections: Any) -> str:
        self._seq += 1
        message = {"event": name, self.seq_key: str(self._seq), self.stream_key: stream_id}
        return json.dumps({**message, **sections})

    # --- what a carrier fills in ------------------------------------------------------------------
    def start_section(self, offer: StreamOffer, stream_id: str) -> dict[str, Any]:
        raise NotImplementedError

    def stop_section(self, offer: StreamOffer) -> dict[str, Any]:
        raise NotImplementedError

    def dtmf_section(self, digit: str) -> dict[str, Any]:
        return {"digit": digit}

    # --- the stream ---------------------------------------------------------------------------------
    def opening(self, offer: StreamOffer, stream_id: str) -> list[str | bytes]:
        return [
            json.dumps({"event": "connected", **self.connected}),
            self.event("start", stream_id, start=self.start_section(offer, stream_id)),
        ]

    def media(self, offer: StreamOffer, stream_id: str, payload: bytes, chunk: int, ms: int) -> str:
        media = {"track": self.media_track} if self.media_track else {}
        media |= {"chunk": str(chunk), "timestamp": str(ms), "payload": base64.b64encode(payload).decode()}
        return self.event("media", stream_id, media=media)

    def dtmf(self, offer: StreamOffer, stream_id: str, digit: str) -> str:
        return self.event("dtmf", stream_id, dtmf=self.dtmf_section(digit))

    def stop(self, offer: StreamOffer, stream_id: str) -> str:
        return self.event("stop", stream_id, stop=self.stop_section(offer))

    def read(self, message: str | bytes) -> Ours:
        data = json.loads(message)
        event = data.get("event")
        if event == "media":
            return Ours("media", base64.b64decode(data["media"]["payload"]))
        if event == "mark":
            return Ours("mark", name=data["mark"]["name"])
        if event == "clear":
            return Ours("clear")
        return Ours("other", name=str(event))

    def mark_played(self, offer: StreamOffer, stream_id: str, name: str) -> str:
        return self.event("mark", stream_id, mark={"name": name})
