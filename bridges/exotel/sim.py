"""Exotel's side of a call, for `personaplex_phone.simulator` (`phone simulate`, the tests).

Written from Exotel's published material, not from the bridge (nothing here imports it):

- the Voicebot applet (developer.exotel.com/docs/agentstream/stream-voicebot-applet): its URL is
  a `wss://` endpoint or an HTTPS one that returns `{"url": "wss://…"}` (a dynamic URL), fetched
  with GET and the call's details in the query (CallSid, CallFrom, CallTo, Direction:
  support.exotel.com, "Working with Connect applet (dynamic URL)"). Exotel documents no
  credentials for that fetch: the side requests the URL the user configured, our answer token
  in its query (`PERSONAPLEX_EXOTEL_ANSWER_TOKEN`); without one it sends HTTP Basic, as a proxy
  might;
- authentication of the stream: `wss://KEY:TOKEN@host/…` reaches the server as
  `Authorization: Basic base64(KEY:TOKEN)`. The side takes the credentials from the URL our
  answer gave (not from its own settings): an answer without them gets an unauthenticated
  upgrade, as it would from Exotel;
- the stream (the same page, "WebSocket Message Protocol"): `connected`, `start` with
  `stream_sid` at the top and in `start`, `call_sid`, `account_sid`, `from`, `to`,
  `custom_parameters` and `media_format` {"encoding": "raw", "sample_rate": "8000", "bit_rate":
  "128"} as in the published example, base64 16-bit little-endian PCM every ~100 ms
  (developer.exotel.com/docs/agentstream/developer-guide), `dtmf`, marks echoed once played,
  `stop` with reason `callended`;
- the chunk rule for what the bot sends ("Chunk Size Requirements": at least 3.2 KB, at most
  100 KB, a multiple of 320 bytes): every media message of ours that breaks it is kept in
  `bad_chunks` (Exotel would play it with gaps or distortion).
"""

from __future__ import annotations

import base64
import json
import os
import secrets
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

from personaplex_phone.carrier import AudioFormat
from personaplex_phone.sim_sides import JsonMediaSide, form_post, secret, with_query
from personaplex_phone.simulator import HttpRequest, Ours, StreamOffer


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode("ascii")


def chunk_ok(size: int) -> bool:
    """Exotel's rule for a bot's media message (in bytes of audio)."""
    return 3200 <= size <= 100_000 and size % 320 == 0


class ExotelSide(JsonMediaSide):
    name = "exotel"
    chunk_ms = 100  # Exotel streams the caller's audio about every 100 ms
    stream_key = "stream_sid"
    seq_key = "sequence_number"
    media_track = None

    def __init__(
        self, api_key: str, api_token: str, answer_token: str = "", account_sid: str = "exotel-test"
    ):
        super().__init__()
        self.api_key = api_key
        self.api_token = api_token
        self.answer_token = answer_token
        self.account_sid = account_sid
        self.bad_chunks: list[int] = []  # sizes of our media messages that break Exotel's rule

    @staticmethod
    def new_call_id() -> str:
        return secrets.token_hex(16)

    def _fetch(self, path: str, values: dict[str, str], query: str = "") -> HttpRequest:
        if self.answer_token:
            values = {"token": self.answer_token, **values}
            return HttpRequest("GET", with_query(f"{path}?" + urlencode(values), query, "&"))
        url = with_query(f"{path}?" + urlencode(values), query, "&")
        return HttpRequest("GET", url, {"Authorization": basic(self.api_key, self.api_token)})

    def answer_request(
        self, public_url: str, call_id: str, to: str, from_: str, query: str = ""
    ) -> HttpRequest:
        values = {"CallSid": call_id, "CallFrom": from_, "CallTo": to, "Direction": "incoming"}
        return self._fetch("/exotel/answer", values, query)

    def parse_answer(self, call_id: str, status: int, body: bytes) -> StreamOffer | None:
        if status != 200:
            return None
        url = json.loads(body).get("url", "")
        query = dict(parse_qsl(urlsplit(url).query))
        rate = int(query.pop("sample-rate", 8000))
        fmt = AudioFormat("l16", rate)
        return StreamOffer(call_id, url, query, fmt, fmt)

    def upgrade(self, offer: StreamOffer, public_url: str) -> tuple[str, dict[str, str]]:
        parts = urlsplit(offer.url)
        netloc = parts.netloc.rpartition("@")[2]
        bare = urlunsplit((parts.scheme, netloc, parts.path, parts.query, ""))
        if parts.username is None:
            return bare, {}  # no credentials in the URL: Exotel sends none
        user, password = unquote(parts.username), unquote(parts.password or "")
        return bare, {"Authorization": basic(user, password)}

    def start_section(self, offer: StreamOffer, stream_id: str) -> dict[str, Any]:
        return {
            "stream_sid": stream_id,
            "call_sid": offer.call_id,
            "account_sid": self.account_sid,
            "from": "+919000000002",
            "to": "+919000000001",
            "custom_parameters": dict(offer.params),
            "media_format": {"encoding": "raw", "sample_rate": str(offer.inbound.rate), "bit_rate": "128"},
        }

    def dtmf_section(self, digit: str) -> dict[str, Any]:
        return {"duration": "200", "digit": digit}

    def stop_section(self, offer: StreamOffer) -> dict[str, Any]:
        return {"call_sid": offer.call_id, "account_sid": self.account_sid, "reason": "callended"}

    def read(self, message: str | bytes) -> Ours:
        ours = super().read(message)
        if ours.kind == "media" and not chunk_ok(len(ours.payload)):
            self.bad_chunks.append(len(ours.payload))
        return ours

    def status_request(self, public_url: str, call_id: str, status: str) -> HttpRequest:
        form = {"CallSid": call_id, "Status": status}
        if self.answer_token:
            return form_post("/exotel/status?" + urlencode({"token": self.answer_token}), form, {})
        return form_post("/exotel/status", form, {"Authorization": basic(self.api_key, self.api_token)})


def side(
    api_key: str | None = None, api_token: str | None = None, answer_token: str | None = None
) -> ExotelSide:
    why = "the Exotel simulator authenticates like Exotel: set EXOTEL_API_KEY and EXOTEL_API_TOKEN"
    token = answer_token
    if token is None:
        token = os.environ.get("PERSONAPLEX_EXOTEL_ANSWER_TOKEN", "")
    return ExotelSide(
        secret(api_key, "EXOTEL_API_KEY", why), secret(api_token, "EXOTEL_API_TOKEN", why), token
    )
