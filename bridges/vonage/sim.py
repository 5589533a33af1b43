"""Vonage's side of a call, for `personaplex_phone.simulator` (`phone simulate`, the tests).

The answer webhook is a GET whose `Authorization: Bearer` JWT is signed HS256 with the
signature secret (`iat` now; events, which have a body, also carry its `payload_hash`); the
WebSocket is unsigned (its ticket is in the URL): `websocket:connected` with our headers, then
binary L16 little-endian (640 bytes per 20 ms at 16 kHz), `notify` answered with
`websocket:notify` once played, `clear` with `websocket:cleared`. The caller hangs up by closing
the socket.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from urllib.parse import urlencode

import jwt
from personaplex_phone.sim_sides import SideDefaults, secret, with_query
from personaplex_phone.simulator import HttpRequest, Ours, StreamOffer

from .wire import audio_format


class VonageSide(SideDefaults):
    name = "vonage"

    def __init__(self, signature_secret: str, api_key: str = "abcd1234"):
        self.secret = signature_secret
        self.api_key = api_key

    def token(self, body: bytes = b"") -> str:
        claims = {
            "iat": int(time.time()),
            "jti": secrets.token_hex(8),
            "iss": "Vonage",
            "api_key": self.api_key,
        }
        if body:
            claims["payload_hash"] = hashlib.sha256(body).hexdigest()
        return jwt.encode(claims, self.secret, algorithm="HS256")

    def answer_request(
        self, public_url: str, call_id: str, to: str, from_: str, query: str = ""
    ) -> HttpRequest:
        values = {
            "to": to.removeprefix("+"),
            "from": from_.removeprefix("+"),
            "uuid": call_id,
            "conversation_uuid": "CON-" + call_id,
        }
        path = with_query("/vonage/answer?" + urlencode(values), query, "&")
        return HttpRequest("GET", path, {"Authorization": f"Bearer {self.token()}"})

    def parse_answer(self, call_id: str, status: int, body: bytes) -> StreamOffer | None:
        if status != 200:
            return None
        actions = json.loads(body)
        connect = next((a for a in actions if a.get("action") == "connect"), None)
        if connect is None:
            return None
        endpoint = connect["endpoint"][0]
        fmt = audio_format(endpoint["content-type"])
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
        body = json.dumps(
            {"status": status, "uuid": call_id, "conversation_uuid": "CON-" + call_id, "duration": "1"}
        ).encode()
        headers = {"Authorization": f"Bearer {self.token(body)}", "Content-Type": "application/json"}
        return HttpRequest("POST", "/vonage/event", headers, body)


def side(signature_secret: str | None = None) -> VonageSide:
    why = "the Vonage simulator signs like Vonage: set VONAGE_SIGNATURE_SECRET (the server's)"
    return VonageSide(secret(signature_secret, "VONAGE_SIGNATURE_SECRET", why))
