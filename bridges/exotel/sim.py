"""Exotel's side of a call, for `personaplex_phone.simulator` (`phone simulate`, the tests).

The Voicebot applet's dynamic URL is fetched with GET and HTTP Basic (API key and token); the
`wss://KEY:TOKEN@…` URL it answers is opened with the same Basic credentials, and the stream
speaks Exotel's JSON: `start` with `media_format` (raw 16-bit PCM at the URL's `sample-rate`),
base64 media in chunks of about 100 ms, marks echoed after playback.
"""

from __future__ import annotations

import json
import secrets
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from personaplex_phone.carrier import AudioFormat
from personaplex_phone.sim_sides import JsonMediaSide, form_post, secret, with_query
from personaplex_phone.simulator import HttpRequest, StreamOffer

from .signatures import basic


class ExotelSide(JsonMediaSide):
    name = "exotel"
    chunk_ms = 100  # Exotel sends the caller's audio about every 100 ms
    stream_key = "stream_sid"
    seq_key = "sequence_number"
    media_track = None

    def __init__(self, api_key: str, api_token: str, account_sid: str = "exotel-test"):
        super().__init__()
        self.auth = basic(api_key, api_token)
        self.account_sid = account_sid

    @staticmethod
    def new_call_id() -> str:
        return secrets.token_hex(16)

    def answer_request(
        self, public_url: str, call_id: str, to: str, from_: str, query: str = ""
    ) -> HttpRequest:
        values = {"CallSid": call_id, "CallFrom": from_, "CallTo": to, "Direction": "incoming"}
        path = with_query("/exotel/answer?" + urlencode(values), query, "&")
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

    def start_section(self, offer: StreamOffer, stream_id: str) -> dict[str, Any]:
        return {
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

    def dtmf_section(self, digit: str) -> dict[str, Any]:
        return {"digit": digit, "duration": "100"}

    def stop_section(self, offer: StreamOffer) -> dict[str, Any]:
        return {"call_sid": offer.call_id, "account_sid": self.account_sid, "reason": "callended"}

    def status_request(self, public_url: str, call_id: str, status: str) -> HttpRequest:
        form = {"CallSid": call_id, "Status": status}
        return form_post("/exotel/status", form, {"Authorization": self.auth})


def side(api_key: str | None = None, api_token: str | None = None) -> ExotelSide:
    why = "the Exotel simulator authenticates like Exotel: set EXOTEL_API_KEY and EXOTEL_API_TOKEN"
    return ExotelSide(secret(api_key, "EXOTEL_API_KEY", why), secret(api_token, "EXOTEL_API_TOKEN", why))
