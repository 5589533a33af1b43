"""jambonz's side of a call, for `personaplex_phone.simulator` (`phone simulate`, the tests).

Written from jambonz's published material, not from the bridge (nothing here imports it):
webhook signing as jambonz documents it (docs.jambonz.org, "Securing webhooks", and its
@jambonz/node-client's `WebhookResponse.verifyJambonzSignature`, restated: HMAC-SHA256 of
`<t>.<raw body>` with the webhook secret, hex, `Jambonz-Signature: t=<t>,v1=<hex>`); the
`listen` verb and its WebSocket (docs.jambonz.org, "listen": the `audio.jambonz.org`
subprotocol, the first text frame the call's attributes with `sampleRate`, `mixType` and the
verb's `metadata` merged in, then binary L16).

The calling webhook is a JSON POST (snake_case call attributes) signed `Jambonz-Signature:
t=…,v1=…` with the account's webhook secret; our `listen` verb names the WebSocket, opened with
the `audio.jambonz.org` subprotocol and no signature (its ticket is in the URL); the first text
frame is the call's attributes in camelCase with `sampleRate`, `mixType` and the verb's
`metadata` merged in; then binary L16 little-endian at `sampleRate`, keys as `{"event": "dtmf"}`,
our marks answered `{"type": "mark", "data": {"name": …, "event": "playout"}}` once played. The
caller hangs up by closing the socket; when the listen has ended, jambonz POSTs its
`actionHook` (`action_request`) and runs the verbs it gets.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from typing import Any

from personaplex_phone.carrier import AudioFormat
from personaplex_phone.sim_sides import SideDefaults, secret, with_query
from personaplex_phone.simulator import HttpRequest, Ours, StreamOffer

SUBPROTOCOL = "audio.jambonz.org"


def jambonz_signature(secret_: str, body: bytes, timestamp: int | None = None) -> str:
    """The `Jambonz-Signature` value for `body`, signed now (or at `timestamp`)."""
    t = int(time.time()) if timestamp is None else timestamp
    digest = hmac.new(secret_.encode(), f"{t}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={t},v1={digest}"


ACCOUNT_SID = "9d9f5f77-0000-4000-8000-0000000000a1"
APPLICATION_SID = "9d9f5f77-0000-4000-8000-0000000000b2"


class JambonzSide(SideDefaults):
    name = "jambonz"
    marks_on_clear = False  # jambonz reports a killed mark as `"event": "cleared"`, never played
    subprotocols = (SUBPROTOCOL,)

    def __init__(self, webhook_secret: str):
        self.secret = webhook_secret
        self._calls: dict[str, dict[str, str]] = {}  # call id -> its numbers, for the first frame
        self._metadata: dict[str, dict[str, Any]] = {}  # call id -> its listen verb's metadata

    def _signed(self, path: str, payload: dict[str, Any]) -> HttpRequest:
        body = json.dumps(payload).encode()
        headers = {
            "Content-Type": "application/json",
            "Jambonz-Signature": jambonz_signature(self.secret, body),
        }
        return HttpRequest("POST", path, headers, body)

    def _call(self, call_id: str, status: str) -> dict[str, Any]:
        numbers = self._calls.get(call_id, {"from": "", "to": ""})
        return {
            "call_sid": call_id,
            "direction": "inbound",
            "from": numbers["from"],
            "to": numbers["to"],
            "call_id": f"{call_id}@sip.example.test",
            "sip_status": 200 if status == "in-progress" else 100,
            "call_status": status,
            "account_sid": ACCOUNT_SID,
            "application_sid": APPLICATION_SID,
            "originating_sip_ip": "192.0.2.10",
        }

    def answer_request(
        self, public_url: str, call_id: str, to: str, from_: str, query: str = ""
    ) -> HttpRequest:
        self._calls[call_id] = {"from": from_, "to": to}
        return self._signed(with_query("/jambonz/call", query), self._call(call_id, "trying"))

    def parse_answer(self, call_id: str, status: int, body: bytes) -> StreamOffer | None:
        if status != 200:
            return None
        verbs = json.loads(body)
        listen = next((v for v in verbs if v.get("verb") == "listen"), None)
        if listen is None:
            return None
        if listen["bidirectionalAudio"]["sampleRate"] != listen["sampleRate"]:
            raise AssertionError("the listen verb sends and takes audio at two rates")
        fmt = AudioFormat("l16", int(listen["sampleRate"]), big_endian=False)
        metadata = listen.get("metadata") or {}
        self._metadata[call_id] = metadata
        params = {k: json.dumps(v) if isinstance(v, dict | list) else str(v) for k, v in metadata.items()}
        return StreamOffer(call_id, listen["url"], params, fmt, fmt)

    def opening(self, offer: StreamOffer, stream_id: str) -> list[str | bytes]:
        numbers = self._calls.get(offer.call_id, {"from": "", "to": ""})
        facts = {
            "callSid": offer.call_id,
            "direction": "inbound",
            "from": numbers["from"],
            "to": numbers["to"],
            "callId": f"{offer.call_id}@sip.example.test",
            "sipStatus": 200,
            "callStatus": "in-progress",
            "accountSid": ACCOUNT_SID,
            "applicationSid": APPLICATION_SID,
            "sampleRate": offer.inbound.rate,
            "mixType": "mono",
            **self._metadata.get(offer.call_id, {}),  # the verb's metadata, merged in
        }
        return [json.dumps(facts)]

    def dtmf(self, offer: StreamOffer, stream_id: str, digit: str) -> str:
        return json.dumps({"event": "dtmf", "dtmf": digit, "duration": 1280})

    def read_text(self, message: str) -> Ours:
        data = json.loads(message)
        kind = data.get("type")
        if kind == "mark":
            return Ours("mark", name=str((data.get("data") or {}).get("name")))
        if kind == "killAudio":
            return Ours("clear")
        return Ours("other", message.encode(), name=str(kind))

    def mark_played(self, offer: StreamOffer, stream_id: str, name: str) -> str:
        return json.dumps({"type": "mark", "data": {"name": name, "event": "playout"}})

    def status_request(self, public_url: str, call_id: str, status: str) -> HttpRequest:
        return self._signed("/jambonz/status", self._call(call_id, status))

    def action_request(self, public_url: str, call_id: str) -> HttpRequest:
        """The listen verb's actionHook, as jambonz POSTs it once the listen has ended."""
        return self._signed(
            "/jambonz/action", {**self._call(call_id, "in-progress"), "listen_status": "ended"}
        )


def side(webhook_secret: str | None = None) -> JambonzSide:
    why = "the jambonz simulator signs like jambonz: set JAMBONZ_WEBHOOK_SECRET (the server's)"
    return JambonzSide(secret(webhook_secret, "JAMBONZ_WEBHOOK_SECRET", why))
