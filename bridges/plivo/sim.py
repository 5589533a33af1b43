"""Plivo's side of a call, for `personaplex_phone.simulator` (`phone simulate`, the tests).

Written from Plivo's published material, not from the bridge (nothing here imports it):

- V3 signatures (plivo.com/docs/voice/concepts/signature-validation): HMAC-SHA256 keyed by the
  auth token over the URL without its query, `?`, the query's pairs sorted (`k=v` joined by `&`)
  and a `.` when there is one, then the POST's parameters sorted by name, each written `namevalue`,
  then `.` and the `X-Plivo-Signature-V3-Nonce`; base64 in `X-Plivo-Signature-V3`. The tests check
  what this side signs against the official `plivo` package's `validate_v3_signature`;
- the `<Stream>` element (docs.plivo.com/docs/voice/xml/audiostream): the WebSocket URL is the
  element's text, `contentType` one of `audio/x-l16;rate=8000|16000` or `audio/x-mulaw;rate=8000`,
  `extraHeaders` `key=value` pairs joined by `,`, only letters and digits, at most 512 bytes (a
  simulated Plivo refuses an answer that breaks that rule, as a real one may);
- the stream (plivo.com/docs/voice-agents/audio-streaming/concepts/audio-streaming-reference):
  unsigned (its ticket is in the URL); `start` with `callId`, `streamId`, `accountId`, `tracks`,
  `mediaFormat` {encoding, sampleRate} and `extra_headers`, our attribute's pairs joined by `;`
  as the reference's example shows them; `media` with base64 audio in the stream's content type,
  `dtmf`; our `playAudio`, `checkpoint` (answered `playedStream` once played, forgotten after a
  `clearAudio`, which is answered `clearedAudio`). The caller hangs up by closing the socket.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import re
import secrets
import xml.etree.ElementTree as ET
from urllib.parse import parse_qsl, urlsplit, urlunsplit

from personaplex_phone.carrier import AudioFormat
from personaplex_phone.sim_sides import SideDefaults, form_post, secret, with_query
from personaplex_phone.simulator import HttpRequest, Ours, StreamOffer

EXTRA_HEADERS = re.compile(r"[A-Za-z0-9]+=[A-Za-z0-9]*(,[A-Za-z0-9]+=[A-Za-z0-9]*)*")


def v3_signature(auth_token: str, url: str, form: dict[str, str], nonce: str) -> str:
    """Plivo's V3 signature of a form POST to `url`."""
    parts = urlsplit(url)
    signed = urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))
    query = sorted(parse_qsl(parts.query, keep_blank_values=True))
    signed += "?" + ("&".join(f"{k}={v}" for k, v in query) + "." if query else "")
    signed += "".join(f"{k}{v}" for k, v in sorted(form.items()))
    digest = hmac.new(auth_token.encode(), f"{signed}.{nonce}".encode(), hashlib.sha256).digest()
    return base64.b64encode(digest).decode()


def line_format(content_type: str) -> AudioFormat:
    kind, _, rate = content_type.partition(";")
    rate_hz = int(rate.strip().removeprefix("rate=") or 8000)
    if kind == "audio/x-l16" and rate_hz in (8000, 16000):
        return AudioFormat("l16", rate_hz, big_endian=False)  # Plivo's L16 is little-endian
    if kind == "audio/x-mulaw" and rate_hz == 8000:
        return AudioFormat("pcmu", 8000)
    raise ValueError(f"Plivo has no contentType {content_type!r}")


class PlivoSide(SideDefaults):
    name = "plivo"

    def __init__(self, auth_id: str, auth_token: str):
        self.auth_id = auth_id
        self.auth_token = auth_token
        self._seq = 0

    def _signed(self, public_url: str, path: str, form: dict[str, str]) -> HttpRequest:
        nonce = secrets.token_hex(10)
        digest = v3_signature(self.auth_token, public_url + path, form, nonce)
        return form_post(path, form, {"X-Plivo-Signature-V3": digest, "X-Plivo-Signature-V3-Nonce": nonce})

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
        fmt = line_format(stream.get("contentType", "audio/x-l16;rate=8000"))
        headers = stream.get("extraHeaders", "")
        if headers and (len(headers.encode()) > 512 or not EXTRA_HEADERS.fullmatch(headers)):
            raise ValueError(f"Plivo takes only [A-Za-z0-9] pairs in extraHeaders, got {headers[:80]!r}")
        pairs = dict(item.partition("=")[::2] for item in headers.split(",")) if headers else {}
        return StreamOffer(call_id, (stream.text or "").strip(), pairs, fmt, fmt)

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    def opening(self, offer: StreamOffer, stream_id: str) -> list[str | bytes]:
        fmt = offer.inbound
        encoding = "audio/x-mulaw" if fmt.codec == "pcmu" else "audio/x-l16"
        start = {
            "callId": offer.call_id,
            "streamId": stream_id,
            "accountId": self.auth_id,
            "tracks": ["inbound"],
            "mediaFormat": {"encoding": encoding, "sampleRate": fmt.rate},
        }
        extra = ";".join(f"{k}={v}" for k, v in offer.params.items())
        message = {"event": "start", "sequenceNumber": self._next(), "start": start, "extra_headers": extra}
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
        return json.dumps(
            {"event": "dtmf", "streamId": stream_id, "dtmf": {"digit": digit, "track": "inbound"}}
        )

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
