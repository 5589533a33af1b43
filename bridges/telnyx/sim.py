"""Telnyx's side of a call, for `personaplex_phone.simulator` (`phone simulate`, the tests).

Written from Telnyx's published material, not from the bridge (nothing here imports it):

- webhook signatures (developers.telnyx.com, "Receiving webhooks"; the official `telnyx` package's
  `lib/webhook_verification.py` checks the same): Ed25519 over `<telnyx-timestamp>|<raw body>`,
  base64 in `telnyx-signature-ed25519`; the simulator holds the private half of the server's
  TELNYX_PUBLIC_KEY (`personaplex-voice phone keypair` makes a pair). The tests check what it
  signs with the official package's `verify_webhook_signature`;
- TeXML `<Stream>` (developers.telnyx.com/docs/voice/programmable-voice/texml-verbs/stream):
  `codec` is the streamed audio's codec (the call's own when not set, or when Telnyx cannot
  transcode: it transcodes between PCMU and PCMA only), `bidirectionalCodec` PCMU, PCMA, G722,
  OPUS or AMR-WB (PCMU by default), `bidirectionalSamplingRate` 8000, 16000 or 24000. A leg's
  own codec is the side's `inbound_codec`: PCMU or PCMA as on the phone network, L16 for a
  wideband leg, G722 for an HD leg; the stream carries what `codec` asked for where Telnyx could
  transcode to it, else the leg's;
- the media stream (developers.telnyx.com/api-reference/websockets/stream-call-media-over-websocket):
  unsigned (its ticket is in the URL); `connected`, `start` (top-level `stream_id`,
  `start.call_control_id`, `media_format` {encoding, sample_rate, channels},
  `custom_parameters`), `media` with base64 RTP payloads (no RTP header; L16 is RTP's,
  big-endian), `dtmf`, marks echoed after playback and at once after a `clear`, `stop`.
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
from personaplex_phone.carrier import AudioFormat
from personaplex_phone.simulator import HttpRequest, StreamOffer

ACCOUNT_SID = "ac0f3e52-0000-4000-8000-000000000000"
TRANSCODES = {"PCMU", "PCMA"}  # Telnyx transcodes a stream between these two only


def line_format(codec: str, rate: int) -> AudioFormat:
    """An RTP codec as the simulator plays it: G.711 at 8 kHz, L16 (RTP's: big-endian)."""
    name = codec.upper()
    if name in ("PCMU", "PCMA"):
        return AudioFormat(name.lower(), 8000)  # type: ignore[arg-type]
    if name == "L16":
        return AudioFormat("l16", rate, big_endian=True)
    raise ValueError(f"the simulator cannot play {codec}")


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
        self.leg_codec = inbound_codec.upper()  # the caller's leg
        self.leg_rate = inbound_rate
        self._control_ids: dict[str, str] = {}
        self._streamed: dict[str, tuple[str, int]] = {}  # call id -> what its stream carries

    @staticmethod
    def new_call_id() -> str:
        return "v3:" + secrets.token_urlsafe(24)

    def sign(self, body: bytes, timestamp: int | None = None) -> dict[str, str]:
        stamp = str(int(time.time()) if timestamp is None else timestamp)
        signature = self.key.sign(stamp.encode() + b"|" + body)
        return {"telnyx-signature-ed25519": base64.b64encode(signature).decode(), "telnyx-timestamp": stamp}

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
        if stream.get("bidirectionalMode") != "rtp":
            return None  # mp3 mode plays files, not a live stream
        outbound = line_format(
            stream.get("bidirectionalCodec", "PCMU"), int(stream.get("bidirectionalSamplingRate", 8000))
        )
        asked = (stream.get("codec") or "default").upper()
        if asked in TRANSCODES and self.leg_codec in TRANSCODES:
            streamed = (asked, 8000)
        else:
            streamed = (self.leg_codec, self.leg_rate)  # the call's own codec
        self._streamed[call_id] = streamed
        inbound = line_format(*streamed) if streamed[0] in ("PCMU", "PCMA", "L16") else outbound
        return StreamOffer(call_id, stream.get("url", ""), params, inbound, outbound)

    def control_id(self, call_id: str) -> str:
        return self._control_ids.get(call_id, "")

    def start_section(self, offer: StreamOffer, stream_id: str) -> dict[str, Any]:
        control_id = self._control_ids.setdefault(offer.call_id, "v3:" + secrets.token_urlsafe(24))
        codec, rate = self._streamed.get(offer.call_id, (self.leg_codec, self.leg_rate))
        return {
            "user_id": USER_ID,
            "call_control_id": control_id,
            "call_session_id": secrets.token_hex(8),
            "from": "+15550100002",
            "to": "+15550100001",
            "media_format": {"encoding": codec, "sample_rate": rate, "channels": 1},
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
