"""Twilio's side of a call, for `personaplex_phone.simulator` (`phone simulate`, the tests).

Webhooks are form POSTs signed with `X-Twilio-Signature` over the public URL; the Media Streams
upgrade is signed over the Stream URL; the stream speaks the documented JSON (string
`sequenceNumber`/`chunk`/`timestamp`, base64 μ-law 8 kHz); marks are echoed after playback and,
after a `clear`, at once.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import xml.etree.ElementTree as ET
from urllib.parse import urlencode

from personaplex_phone.carrier import MULAW_8K
from personaplex_phone.simulator import HttpRequest, Ours, StreamOffer

from twilio.request_validator import RequestValidator

ACCOUNT_SID = "AC" + "0" * 32


class TwilioSide:
    name = "twilio"
    chunk_ms = 20
    marks_on_clear = True
    ends_by_close = False

    def __init__(self, auth_token: str):
        self.validator = RequestValidator(auth_token)
        self._seq = 0

    @staticmethod
    def new_call_id() -> str:
        return "CA" + secrets.token_hex(16)

    def _signed(self, public_url: str, path: str, form: dict[str, str]) -> HttpRequest:
        signature = self.validator.compute_signature(public_url + path, form)
        headers = {"X-Twilio-Signature": signature, "Content-Type": "application/x-www-form-urlencoded"}
        return HttpRequest("POST", path, headers, urlencode(form).encode())

    def answer_request(
        self, public_url: str, call_id: str, to: str, from_: str, query: str = ""
    ) -> HttpRequest:
        form = {
            "AccountSid": ACCOUNT_SID,
            "CallSid": call_id,
            "From": from_,
            "To": to,
            "CallStatus": "ringing",
            "Direction": "inbound",
            "ApiVersion": "2010-04-01",
        }
        return self._signed(public_url, "/twilio/voice" + (f"?{query}" if query else ""), form)

    def parse_answer(self, call_id: str, status: int, body: bytes) -> StreamOffer | None:
        if status != 200:
            return None
        stream = ET.fromstring(body).find("./Connect/Stream")
        if stream is None:
            return None
        params = {p.get("name", ""): p.get("value", "") for p in stream.findall("Parameter")}
        return StreamOffer(call_id, stream.get("url", ""), params, MULAW_8K, MULAW_8K)

    def upgrade(self, offer: StreamOffer, public_url: str) -> tuple[str, dict[str, str]]:
        return offer.url, {"X-Twilio-Signature": self.validator.compute_signature(offer.url, {})}

    def _next(self) -> str:
        self._seq += 1
        return str(self._seq)

    def opening(self, offer: StreamOffer, stream_id: str) -> list[str | bytes]:
        start = {
            "accountSid": ACCOUNT_SID,
            "streamSid": stream_id,
            "callSid": offer.call_id,
            "tracks": ["inbound"],
            "customParameters": dict(offer.params),
            "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1},
        }
        return [
            json.dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"}),
            json.dumps(
                {"event": "start", "sequenceNumber": self._next(), "start": start, "streamSid": stream_id}
            ),
        ]

    def media(self, offer: StreamOffer, stream_id: str, payload: bytes, chunk: int, ms: int) -> str:
        media = {
            "track": "inbound",
            "chunk": str(chunk),
            "timestamp": str(ms),
            "payload": base64.b64encode(payload).decode(),
        }
        return json.dumps(
            {"event": "media", "sequenceNumber": self._next(), "media": media, "streamSid": stream_id}
        )

    def dtmf(self, offer: StreamOffer, stream_id: str, digit: str) -> str:
        dtmf = {"track": "inbound_track", "digit": digit}
        return json.dumps(
            {"event": "dtmf", "streamSid": stream_id, "sequenceNumber": self._next(), "dtmf": dtmf}
        )

    def stop(self, offer: StreamOffer, stream_id: str) -> str:
        stop = {"accountSid": ACCOUNT_SID, "callSid": offer.call_id}
        return json.dumps(
            {"event": "stop", "sequenceNumber": self._next(), "stop": stop, "streamSid": stream_id}
        )

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
        return json.dumps(
            {"event": "mark", "sequenceNumber": self._next(), "streamSid": stream_id, "mark": {"name": name}}
        )

    def cleared(self, offer: StreamOffer, stream_id: str) -> None:
        return None

    def status_request(self, public_url: str, call_id: str, status: str) -> HttpRequest:
        form = {"AccountSid": ACCOUNT_SID, "CallSid": call_id, "CallStatus": status}
        return self._signed(public_url, "/twilio/status", form)


def side(auth_token: str | None = None) -> TwilioSide:
    token = auth_token or os.environ.get("TWILIO_AUTH_TOKEN", "")
    if not token:
        raise ValueError("the Twilio simulator signs like Twilio: set TWILIO_AUTH_TOKEN (the server's)")
    return TwilioSide(token)
