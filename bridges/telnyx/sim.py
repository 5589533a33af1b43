"""Telnyx's side of a call, for `personaplex_phone.simulator` (`phone simulate`, the tests).

TeXML webhooks are form POSTs signed Ed25519 over `timestamp|body` (the simulator holds the
private half of the server's TELNYX_PUBLIC_KEY: `personaplex-voice phone keypair` makes a pair);
the stream is unsigned (its ticket is in the URL) and speaks Telnyx's JSON: `start` with
`media_format` (the caller's codec: PCMU 8 kHz as on the phone network, or L16 16 kHz for a
wideband leg), base64 RTP payloads, marks echoed after playback.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import time
import xml.etree.ElementTree as ET
from urllib.parse import urlencode

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from personaplex_phone.simulator import HttpRequest, Ours, StreamOffer

from .signatures import SIGNATURE_HEADER, TIMESTAMP_HEADER, signed_message
from .wire import audio_format

ACCOUNT_SID = "ac0f3e52-0000-4000-8000-000000000000"


def keypair() -> tuple[str, str]:
    """A new (private seed, public key), both base64, for the simulator and TELNYX_PUBLIC_KEY."""
    key = Ed25519PrivateKey.generate()
    seed = key.private_bytes_raw()
    public = key.public_key().public_bytes_raw()
    return base64.b64encode(seed).decode(), base64.b64encode(public).decode()


class TelnyxSide:
    name = "telnyx"
    chunk_ms = 20
    marks_on_clear = True
    ends_by_close = False

    def __init__(self, private_key: str, inbound_codec: str = "PCMU", inbound_rate: int = 8000):
        self.key = Ed25519PrivateKey.from_private_bytes(base64.b64decode(private_key))
        self.inbound = audio_format(inbound_codec, inbound_rate)
        self.inbound_name = inbound_codec.upper()
        self._seq = 0
        self._control_ids: dict[str, str] = {}

    @staticmethod
    def new_call_id() -> str:
        return "v3:" + secrets.token_urlsafe(24)

    def sign(self, body: bytes, timestamp: int | None = None) -> dict[str, str]:
        stamp = str(int(time.time()) if timestamp is None else timestamp)
        signature = self.key.sign(signed_message(stamp, body))
        return {SIGNATURE_HEADER: base64.b64encode(signature).decode(), TIMESTAMP_HEADER: stamp}

    def _signed(self, path: str, form: dict[str, str]) -> HttpRequest:
        body = urlencode(form).encode()
        headers = {**self.sign(body), "Content-Type": "application/x-www-form-urlencoded"}
        return HttpRequest("POST", path, headers, body)

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
        }
        return self._signed("/telnyx/voice" + (f"?{query}" if query else ""), form)

    def parse_answer(self, call_id: str, status: int, body: bytes) -> StreamOffer | None:
        if status != 200:
            return None
        stream = ET.fromstring(body).find("./Connect/Stream")
        if stream is None:
            return None
        params = {p.get("name", ""): p.get("value", "") for p in stream.findall("Parameter")}
        outbound = audio_format(
            stream.get("bidirectionalCodec", "PCMU"), int(stream.get("bidirectionalSamplingRate", 8000))
        )
        return StreamOffer(call_id, stream.get("url", ""), params, self.inbound, outbound)

    def upgrade(self, offer: StreamOffer, public_url: str) -> tuple[str, dict[str, str]]:
        return offer.url, {}

    def _next(self) -> str:
        self._seq += 1
        return str(self._seq)

    def opening(self, offer: StreamOffer, stream_id: str) -> list[str | bytes]:
        control_id = self._control_ids.setdefault(offer.call_id, "v3:" + secrets.token_urlsafe(24))
        start = {
            "user_id": "00000000-0000-4000-8000-000000000001",
            "call_control_id": control_id,
            "call_session_id": secrets.token_hex(8),
            "from": "+15550100002",
            "to": "+15550100001",
            "media_format": {"encoding": self.inbound_name, "sample_rate": self.inbound.rate, "channels": 1},
            "custom_parameters": dict(offer.params),
        }
        return [
            json.dumps({"event": "connected", "version": "1.0.0"}),
            json.dumps(
                {"event": "start", "sequence_number": self._next(), "start": start, "stream_id": stream_id}
            ),
        ]

    def control_id(self, call_id: str) -> str:
        return self._control_ids.get(call_id, "")

    def media(self, offer: StreamOffer, stream_id: str, payload: bytes, chunk: int, ms: int) -> str:
        media = {
            "track": "inbound",
            "chunk": str(chunk),
            "timestamp": str(ms),
            "payload": base64.b64encode(payload).decode(),
        }
        return json.dumps(
            {"event": "media", "sequence_number": self._next(), "media": media, "stream_id": stream_id}
        )

    def dtmf(self, offer: StreamOffer, stream_id: str, digit: str) -> str:
        return json.dumps(
            {
                "event": "dtmf",
                "stream_id": stream_id,
                "sequence_number": self._next(),
                "dtmf": {"digit": digit},
            }
        )

    def stop(self, offer: StreamOffer, stream_id: str) -> str:
        stop = {
            "user_id": "00000000-0000-4000-8000-000000000001",
            "call_control_id": self.control_id(offer.call_id),
        }
        return json.dumps(
            {"event": "stop", "sequence_number": self._next(), "stop": stop, "stream_id": stream_id}
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
            {"event": "mark", "sequence_number": self._next(), "stream_id": stream_id, "mark": {"name": name}}
        )

    def cleared(self, offer: StreamOffer, stream_id: str) -> None:
        return None

    def status_request(self, public_url: str, call_id: str, status: str) -> HttpRequest:
        return self._signed(
            "/telnyx/status", {"AccountSid": ACCOUNT_SID, "CallSid": call_id, "CallStatus": status}
        )


def side(private_key: str | None = None, inbound_codec: str = "PCMU", inbound_rate: int = 8000) -> TelnyxSide:
    key = private_key or os.environ.get("TELNYX_PRIVATE_KEY", "")
    if not key:
        raise ValueError(
            "the Telnyx simulator signs like Telnyx: set TELNYX_PRIVATE_KEY to the private half of the "
            "server's TELNYX_PUBLIC_KEY (make a pair with `personaplex-voice phone keypair`)"
        )
    return TelnyxSide(key, inbound_codec, inbound_rate)
