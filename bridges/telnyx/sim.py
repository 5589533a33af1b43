"""Telnyx's side of a call, for `personaplex_phone.simulator` (`phone simulate`, the tests).

TeXML webhooks are form POSTs signed Ed25519 over `timestamp|body` (the simulator holds the
private half of the server's TELNYX_PUBLIC_KEY: `personaplex-voice phone keypair` makes a pair);
the stream is unsigned (its ticket is in the URL) and speaks Telnyx's JSON: `start` with
`media_format` (the caller's codec: PCMU 8 kHz as on the phone network, or L16 16 kHz for a
wideband leg), base64 RTP payloads, marks echoed after playback.
"""

from __future__ import annotations

import base64
import secrets
import time
from collections.abc import Mapping
from typing import Any, ClassVar
from urllib.parse import urlencode

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from personaplex_phone import sim_sides as kit
from personaplex_phone.simulator import HttpRequest, StreamOffer

from .signatures import SIGNATURE_HEADER, TIMESTAMP_HEADER, signed_message
from .wire import audio_format

ACCOUNT_SID = "ac0f3e52-0000-4000-8000-000000000000"
USER_ID = "00000000-0000-4000-8000-000000000001"


def keypair() -> tuple[str, str]:
    """A new (private seed, public key), both base64, for the simulator and TELNYX_PUBLIC_KEY."""
    key = Ed25519PrivateKey.generate()
    seed = key.private_bytes_raw()
    public = key.public_key().public_bytes_raw()
    return base64.b64encode(seed).decode(), base64.b64encode(public).decode()


class TelnyxSide(kit.JsonMediaSide):
    name = "telnyx"
    stream_key = "stream_id"
    seq_key = "sequence_number"
    connected: ClassVar[Mapping[str, str]] = {"version": "1.0.0"}

    def __init__(self, private_key: str, inbound_codec: str = "PCMU", inbound_rate: int = 8000):
        super().__init__()
        self.key = Ed25519PrivateKey.from_private_bytes(base64.b64decode(private_key))
        self.inbound = audio_format(inbound_codec, inbound_rate)
        self.inbound_name = inbound_codec.upper()
        self._control_ids: dict[str, str] = {}

    @staticmethod
    def new_call_id() -> str:
        return "v3:" + secrets.token_urlsafe(24)

    def sign(self, body: bytes, timestamp: int | None = None) -> dict[str, str]:
        stamp = str(int(time.time()) if timestamp is None else timestamp)
        signature = self.key.sign(signed_message(stamp, body))
        return {SIGNATURE_HEADER: base64.b64encode(signature).decode(), TIMESTAMP_HEADER: stamp}

    def _signed(self, path: str, form: dict[str, str]) -> HttpRequest:
        return kit.form_post(path, form, self.sign(urlencode(form).encode()))

    def answer_request(
        self, public_url: str, call_id: str, to: str, from_: str, query: str = ""
    ) -> HttpRequest:
        return self._signed(
            kit.with_query("/telnyx/voice", query), kit.twiml_call(ACCOUNT_SID, call_id, to, from_)
        )

    def parse_answer(self, call_id: str, status: int, body: bytes) -> StreamOffer | None:
        found = kit.connect_stream(status, body)
        if found is None:
            return None
        stream, params = found
        outbound = audio_format(
            stream.get("bidirectionalCodec", "PCMU"), int(stream.get("bidirectionalSamplingRate", 8000))
        )
        return StreamOffer(call_id, stream.get("url", ""), params, self.inbound, outbound)

    def control_id(self, call_id: str) -> str:
        return self._control_ids.get(call_id, "")

    def start_section(self, offer: StreamOffer, stream_id: str) -> dict[str, Any]:
        control_id = self._control_ids.setdefault(offer.call_id, "v3:" + secrets.token_urlsafe(24))
        return {
            "user_id": USER_ID,
            "call_control_id": control_id,
            "call_session_id": secrets.token_hex(8),
            "from": "+15550100002",
            "to": "+15550100001",
            "media_format": {"encoding": self.inbound_name, "sample_rate": self.inbound.rate, "channels": 1},
            "custom_parameters": dict(offer.params),
        }

    def stop_section(self, offer: StreamOffer) -> dict[str, Any]:
        return {"user_id": USER_ID, "call_control_id": self.control_id(offer.call_id)}

    def status_request(self, public_url: str, call_id: str, status: str) -> HttpRequest:
        return self._signed(
            "/telnyx/status", {"AccountSid": ACCOUNT_SID, "CallSid": call_id, "CallStatus": status}
        )


def side(private_key: str | None = None, inbound_codec: str = "PCMU", inbound_rate: int = 8000) -> TelnyxSide:
    why = (
        "the Telnyx simulator signs like Telnyx: set TELNYX_PRIVATE_KEY to the private half of the "
        "server's TELNYX_PUBLIC_KEY (make a pair with `personaplex-voice phone keypair`)"
    )
    return TelnyxSide(kit.secret(private_key, "TELNYX_PRIVATE_KEY", why), inbound_codec, inbound_rate)
