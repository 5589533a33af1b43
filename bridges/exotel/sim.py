"""Exotel's side of a call, for `personaplex_phone.simulator` (`phone simulate`, the tests).

The Voicebot applet's dynamic URL is fetched with GET and HTTP Basic (API key and token); the
`wss://KEY:TOKEN@…` URL it answers is opened with the same Basic credentials, and the stream
speaks Exotel's JSON: `start` with `media_format` (raw 16-bit PCM at the URL's `sample-rate`),
base64 media in chunks of about 100 ms, marks echoed after playback.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from personaplex_phone.carrier import AudioFormat
from personaplex_phone.simulator import HttpRequest, Ours, StreamOffer

from .signatures import basic


class ExotelSide:
    name = "exotel"
    chunk_ms = 100  # Exotel sends the caller's audio about every 100 ms
    marks_on_clear = True
    ends_by_close = False

    def __init__(self, api_key: str, api_token: str, account_sid: str = "exotel-test"):
        self.auth = basic(api_key, api_token)
        self.account_sid = account_sid
        self._seq = 0

    @staticmethod
    def new_call_id() -> str:
        return secrets.token_hex(16)

    def answer_request(
        self, public_url: str, call_id: str, to: str, from_: str, query: str = ""
    ) -> HttpRequest:
        values = {"CallSid": call_id, "CallFrom": from_, "CallTo": to, "Direction": "incoming"}
        path = "/exotel/answer?" + urlencode(values) + (f"&{query}" if query else "")
        return HttpRequest("GET", path, {"Authorization": self.auth})

    def parse_answer(self, call_id: str, status: int, body: bytes) -> StreamOffer | None:
        if status != 200:
            return None
        url = json.loads(body).get("url", "")
        parts = urlsplit(url)
        query = dict(parse_qsl(parts.query))
        rate = int(query.pop("sample-rate", 8000))
        fmt = AudioFormat("l16", rate)
        return StreamOffer(call_id, url, query, fmt, fmt)

    def upgrade(self, offer: StreamOffer, public_url: str) -> tuple[str, dict[str, str]]:
        parts = urlsplit(offer.url)
        netloc = parts.netloc.rpartition("@")[2]  # the credentials travel as Basic auth
        return urlunsplit((parts.scheme, netloc, parts.path, parts.query, "")), {"Authorization": self.auth}

    def _next(self) -> str:
        self._seq += 1
        return str(self._seq)

    def opening(self, offer: StreamOffer, stream_id: str) -> list[str | bytes]:
        start = {
            "stream_sid": stream_id,
            "call_sid": offer.call_id,
            "account_sid": self.account_sid,
            "from": "+919000000002",
            "to": "+919000000001",
            "custom_parameters": dict(offer.params),
            "media_format": {
                "encoding": "audio/x-raw",
                "sample_rate": str(offer.inbound.rate),
                "bit_rate": "16",
            },
        }
        return [
            json.dumps({"event": "connected"}),
            json.dumps(
                {"event": "start", "sequence_number": self._next(), "stream_sid": stream_id, "start": start}
            ),
        ]

    def media(self, offer: StreamOffer, stream_id: str, payload: bytes, chunk: int, ms: int) -> str:
        media = {"chunk": str(chunk), "timestamp": str(ms), "payload": base64.b64encode(payload).decode()}
        return json.dumps(
            {"event": "media", "sequence_number": self._next(), "stream_sid": stream_id, "media": media}
        )

    def dtmf(self, offer: StreamOffer, stream_id: str, digit: str) -> str:
        dtmf = {"digit": digit, "duration": "100"}
        return json.dumps(
            {"event": "dtmf", "sequence_number": self._next(), "stream_sid": stream_id, "dtmf": dtmf}
        )

    def stop(self, offer: StreamOffer, stream_id: str) -> str:
        stop = {"call_sid": offer.call_id, "account_sid": self.account_sid, "reason": "callended"}
        return json.dumps(
            {"event": "stop", "sequence_number": self._next(), "stream_sid": stream_id, "stop": stop}
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
            {
                "event": "mark",
                "sequence_number": self._next(),
                "stream_sid": stream_id,
                "mark": {"name": name},
            }
        )

    def cleared(self, offer: StreamOffer, stream_id: str) -> None:
        return None

    def status_request(self, public_url: str, call_id: str, status: str) -> HttpRequest:
        body = urlencode({"CallSid": call_id, "Status": status}).encode()
        headers = {"Authorization": self.auth, "Content-Type": "application/x-www-form-urlencoded"}
        return HttpRequest("POST", "/exotel/status", headers, body)


def side(api_key: str | None = None, api_token: str | None = None) -> ExotelSide:
    key = api_key or os.environ.get("EXOTEL_API_KEY", "")
    token = api_token or os.environ.get("EXOTEL_API_TOKEN", "")
    if not key or not token:
        raise ValueError(
            "the Exotel simulator authenticates like Exotel: set EXOTEL_API_KEY and EXOTEL_API_TOKEN"
        )
    return ExotelSide(key, token)
