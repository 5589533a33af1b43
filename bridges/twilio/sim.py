"""Twilio's side of a call, for `personaplex_phone.simulator` (`phone simulate`, the tests).

Webhooks are form POSTs signed with `X-Twilio-Signature` over the public URL; the Media Streams
upgrade is signed over the Stream URL; the stream speaks the documented JSON (string
`sequenceNumber`/`chunk`/`timestamp`, base64 μ-law 8 kHz); marks are echoed after playback and,
after a `clear`, at once.

Sources: twilio.com/docs/voice/media-streams/websocket-messages (the messages),
twilio.com/docs/usage/security (the signature), and the official `twilio` package, whose
RequestValidator signs here; nothing of the bridge is imported.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Any, ClassVar

from personaplex_phone import sim_sides as kit
from personaplex_phone.carrier import MULAW_8K
from personaplex_phone.simulator import HttpRequest, StreamOffer

from twilio.request_validator import RequestValidator

ACCOUNT_SID = "AC" + "0" * 32


class TwilioSide(kit.JsonMediaSide):
    name = "twilio"
    stream_key = "streamSid"
    seq_key = "sequenceNumber"
    connected: ClassVar[Mapping[str, str]] = {"protocol": "Call", "version": "1.0.0"}

    def __init__(self, auth_token: str):
        super().__init__()
        self.validator = RequestValidator(auth_token)

    @staticmethod
    def new_call_id() -> str:
        return "CA" + secrets.token_hex(16)

    def _signed(self, public_url: str, path: str, form: dict[str, str]) -> HttpRequest:
        signature = self.validator.compute_signature(public_url + path, form)
        return kit.form_post(path, form, {"X-Twilio-Signature": signature})

    def answer_request(
        self, public_url: str, call_id: str, to: str, from_: str, query: str = ""
    ) -> HttpRequest:
        form = {**kit.twiml_call(ACCOUNT_SID, call_id, to, from_), "ApiVersion": "2010-04-01"}
        return self._signed(public_url, kit.with_query("/twilio/voice", query), form)

    def parse_answer(self, call_id: str, status: int, body: bytes) -> StreamOffer | None:
        found = kit.connect_stream(status, body)
        if found is None:
            return None
        stream, params = found
        return StreamOffer(call_id, stream.get("url", ""), params, MULAW_8K, MULAW_8K)

    def upgrade(self, offer: StreamOffer, public_url: str) -> tuple[str, dict[str, str]]:
        return offer.url, {"X-Twilio-Signature": self.validator.compute_signature(offer.url, {})}

    def start_section(self, offer: StreamOffer, stream_id: str) -> dict[str, Any]:
        return {
            "accountSid": ACCOUNT_SID,
            "streamSid": stream_id,
            "callSid": offer.call_id,
            "tracks": ["inbound"],
            "customParameters": dict(offer.params),
            "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1},
        }

    def dtmf_section(self, digit: str) -> dict[str, Any]:
        return {"track": "inbound_track", "digit": digit}

    def stop_section(self, offer: StreamOffer) -> dict[str, Any]:
        return {"accountSid": ACCOUNT_SID, "callSid": offer.call_id}

    def status_request(self, public_url: str, call_id: str, status: str) -> HttpRequest:
        form = {"AccountSid": ACCOUNT_SID, "CallSid": call_id, "CallStatus": status}
        return self._signed(public_url, "/twilio/status", form)


def side(auth_token: str | None = None) -> TwilioSide:
    why = "the Twilio simulator signs like Twilio: set TWILIO_AUTH_TOKEN (the server's)"
    return TwilioSide(kit.secret(auth_token, "TWILIO_AUTH_TOKEN", why))
