"""Vonage's side of a call, for `personaplex_phone.simulator` (`phone simulate`, the tests).

Written from Vonage's published material, not from the bridge (nothing here imports it):

- signed webhooks (developer.vonage.com/en/getting-started/concepts/webhooks, "Decoding signed
  webhooks"): `Authorization: Bearer` a JWT, HS256 with the account's signature secret, claims
  `iat`, `jti`, `iss`, `api_key` and `payload_hash`;
- `payload_hash` (api.support.vonage.com, article 19033783342876, "How do I verify that the Voice
  API Webhook request and its payload has not been tampered during transit?"): SHA-256 hex of the
  query parameters for a GET, or of the body for a POST, as a JSON object in the parameters'
  order with no whitespace. The answer webhook is a GET (the application's default answer
  method), so its hash covers its query;
- the WebSocket endpoint (developer.vonage.com/en/voice/voice-api/concepts/websockets): unsigned
  (its ticket is in the URL); `websocket:connected` first, with the endpoint's `content-type`
  and the NCCO's `headers`; then binary 16-bit linear PCM, little-endian, at the content-type's
  rate (640 bytes per 20 ms at 16 kHz) both ways; `notify` answered with `websocket:notify` once
  played, `clear` with `websocket:cleared`; the caller hangs up by closing the socket.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from urllib.parse import parse_qsl, urlencode, urlsplit

import jwt
from personaplex_phone.carrier import AudioFormat
from personaplex_phone.sim_sides import SideDefaults, secret, with_query
from personaplex_phone.simulator import HttpRequest, Ours, StreamOffer


def payload_hash(payload: dict[str, object]) -> str:
    """SHA-256 hex of the payload as a JSON object, in order, with no whitespace."""
    text = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def line_format(content_type: str) -> AudioFormat:
    """`audio/l16;rate=16000` as the line's audio (Vonage's L16 is little-endian)."""
    kind, _, rate = content_type.partition(";")
    if kind.strip().lower() != "audio/l16":
        raise ValueError(f"Vonage streams audio/l16, not {content_type!r}")
    return AudioFormat("l16", int(rate.strip().removeprefix("rate=") or 8000), big_endian=False)


class VonageSide(SideDefaults):
    name = "vonage"

    def __init__(self, signature_secret: str, api_key: str = "abcd1234"):
        self.secret = signature_secret
        self.api_key = api_key

    def token(self, payload: dict[str, object] | None = None) -> str:
        claims: dict[str, object] = {
            "iat": int(time.time()),
            "jti": secrets.token_hex(8),
            "iss": "Vonage",
            "api_key": self.api_key,
        }
        if payload is not None:
            claims["payload_hash"] = payload_hash(payload)
        return jwt.encode(claims, self.secret, algorithm="HS256")

    def signed_get(self, path: str) -> HttpRequest:
        """A GET signed over its query parameters, in order (a name given twice keeps its first
        place and its last value, as a JavaScript object would)."""
        payload: dict[str, object] = {}
        for key, value in parse_qsl(urlsplit(path).query, keep_blank_values=True):
            payload[key] = value
        return HttpRequest("GET", path, {"Authorization": f"Bearer {self.token(payload)}"})

    def answer_request(
        self, public_url: str, call_id: str, to: str, from_: str, query: str = ""
    ) -> HttpRequest:
        values = {
            "to": to.removeprefix("+"),
            "from": from_.removeprefix("+"),
            "uuid": call_id,
            "conversation_uuid": "CON-" + call_id,
        }
        return self.signed_get(with_query("/vonage/answer?" + urlencode(values), query, "&"))

    def parse_answer(self, call_id: str, status: int, body: bytes) -> StreamOffer | None:
        if status != 200:
            return None
        actions = json.loads(body)
        connect = next((a for a in actions if a.get("action") == "connect"), None)
        if connect is None:
            return None
        endpoint = connect["endpoint"][0]
        fmt = line_format(endpoint["content-type"])
        headers = {k: str(v) for k, v in endpoint.get("headers", {}).items()}
        return StreamOffer(call_id, endpoint["uri"], headers, fmt, fmt)

    def opening(self, offer: StreamOffer, stream_id: str) -> list[str | bytes]:
        rate = offer.inbound.rate
        return [
            json.dumps(
                {"event": "websocket:connected", "content-type": f"audio/l16;rate={rate}", **offer.params}
            )
        ]

    def dtmf(self, offer: StreamOffer, stream_id: str, digit: str) -> str:
        return json.dumps({"event": "websocket:dtmf", "digit": digit, "duration": 260})

    def read_text(self, message: str) -> Ours:
        data = json.loads(message)
        action = data.get("action")
        if action == "notify":
            return Ours("mark", name=str((data.get("payload") or {}).get("name")))
        if action == "clear":
            return Ours("clear")
        return Ours("other", name=str(action))

    def mark_played(self, offer: StreamOffer, stream_id: str, name: str) -> str:
        return json.dumps({"event": "websocket:notify", "payload": {"name": name}})

    def cleared(self, offer: StreamOffer, stream_id: str) -> str:
        return json.dumps({"event": "websocket:cleared"})

    def status_request(self, public_url: str, call_id: str, status: str) -> HttpRequest:
        event = {"status": status, "uuid": call_id, "conversation_uuid": "CON-" + call_id, "duration": "1"}
        body = json.dumps(event, separators=(",", ":")).encode()
        headers = {"Authorization": f"Bearer {self.token(event)}", "Content-Type": "application/json"}
        return HttpRequest("POST", "/vonage/event", headers, body)


def side(signature_secret: str | None = None) -> VonageSide:
    why = "the Vonage simulator signs like Vonage: set VONAGE_SIGNATURE_SECRET (the server's)"
    return VonageSide(secret(signature_secret, "VONAGE_SIGNATURE_SECRET", why))
