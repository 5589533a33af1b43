"""Plivo's side of a call, for `personaplex_phone.simulator` (`phone simulate`, the tests).

Callbacks are form POSTs with V3 signatures (the auth token, a fresh nonce each); the stream is
unsigned (its ticket is in the URL) and speaks Plivo's JSON: `start` with `mediaFormat`, base64
media in the stream's content type, `checkpoint` answered with `playedStream` once played (and
forgotten after `clearAudio`, which is answered with `clearedAudio`). The caller hangs up by
closing the socket.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import xml.etree.ElementTree as ET

from personaplex_phone.sim_sides import SideDefaults, form_post, secret, with_query
from personaplex_phone.simulator import HttpRequest, Ours, StreamOffer

from .signatures import NONCE_HEADER, SIGNATURE_HEADER, signature
from .wire import audio_format, content_type_of, extra_headers


class PlivoSide(SideDefaults):
    name = "plivo"

    def __init__(self, auth_id: str, auth_token: str):
        self.auth_id = auth_id
        self.auth_token = auth_token
        self._seq = 0

    def _signed(self, public_url: str, path: str, form: dict[str, str]) -> HttpRequest:
        nonce = secrets.token_hex(10)
        digest = signature(self.auth_token, "POST", public_url + path, nonce, list(form.items()))
        return form_post(path, form, {SIGNATURE_HEADER: digest, NONCE_HEADER: nonce})

    def answer_request(
        self, public_url: str, call_id: str, to: str, from_: str, query: str = ""
    ) -> HttpRequest:
        form = {
            "CallUUID": call_id,
            "From": from_,
            "To": to,
            "Direction": "inbound",
            "CallStatus": "in-progress",
            "Event": "StartApp",
        }
        return self._signed(public_url, with_query("/plivo/answer", query), form)

    def parse_answer(self, call_id: str, status: int, body: bytes) -> StreamOffer | None:
        if status != 200:
            return None
        stream = ET.fromstring(body).find("./Stream")
        if stream is None or stream.get("bidirectional") != "true":
            return None
        fmt = audio_format(stream.get("contentType", "audio/x-l16;rate=8000"))
        params = extra_headers(stream.get("extraHeaders", ""))
        return StreamOffer(call_id, (stream.text or "").strip(), params, fmt, fmt)

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    def opening(self, offer: StreamOffer, stream_id: str) -> list[str | bytes]:
        fmt = offer.inbound
        start = {
            "callId": offer.call_id,
            "streamId": stream_id,
            "accountId": self.auth_id,
            "tracks": ["inbound"],
            "mediaFormat": {"encoding": content_type_of(fmt), "sampleRate": fmt.rate},
        }
        message = {
            "sequenceNumber": 0,
            "event": "start",
            "start": start,
            "extra_headers": json.dumps(dict(offer.params)),
        }
        return [json.dumps(message)]

    def media(self, offer: StreamOffer, stream_id: str, payload: bytes, chunk: int, ms: int) -> str:
        media = {
            "track": "inbound",
            "timestamp": str(ms),
            "chunk": chunk,
            "payload": base64.b64encode(payload).decode(),
        }
        return json.dumps(
            {"sequenceNumber": self._next(), "streamId": stream_id, "event": "media", "media": media}
        )

    def dtmf(self, offer: StreamOffer, stream_id: str, digit: str) -> str:
        return json.dumps({"event": "dtmf", "streamId": stream_id, "dtmf": {"digit": digit}})

    def read_text(self, message: str) -> Ours:
        data = json.loads(message)
        event = data.get("event")
        if event == "playAudio":
            return Ours("media", base64.b64decode(data["media"]["payload"]))
        if event == "checkpoint":
            return Ours("mark", name=data["name"])
        if event == "clearAudio":
            return Ours("clear")
        return Ours("other", name=str(event))

    def mark_played(self, offer: StreamOffer, stream_id: str, name: str) -> str:
        return json.dumps({"event": "playedStream", "streamId": stream_id, "name": name})

    def cleared(self, offer: StreamOffer, stream_id: str) -> str:
        return json.dumps({"event": "clearedAudio", "streamId": stream_id})

    def status_request(self, public_url: str, call_id: str, status: str) -> HttpRequest:
        form = {"CallUUID": call_id, "CallStatus": status, "Event": "Hangup", "Duration": "1"}
        return self._signed(public_url, "/plivo/hangup", form)


def side(auth_id: str | None = None, auth_token: str | None = None) -> PlivoSide:
    auth_id = auth_id or os.environ.get("PLIVO_AUTH_ID", "MA" + "0" * 18)
    why = "the Plivo simulator signs like Plivo: set PLIVO_AUTH_TOKEN (the server's)"
    return PlivoSide(auth_id, secret(auth_token, "PLIVO_AUTH_TOKEN", why))
