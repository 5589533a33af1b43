"""Genesys Cloud's side of a call, for `personaplex_phone.simulator` (`phone simulate`, the tests).

Written from Genesys's published material, not from the bridge (nothing here imports it):

- the Audio Connector (help.mypurecloud.com, "About the Audio Connector integration";
  developer.genesys.cloud, AudioHook protocol): no answer webhook; an Architect flow's Call Audio
  Connector action opens the WebSocket itself, at the integration's base URI plus the action's
  connector id (`offer`). The upgrade carries `Audiohook-Organization-Id`,
  `Audiohook-Session-Id`, `Audiohook-Correlation-Id`, `X-API-KEY` and, with a client secret,
  `Signature-Input`/`Signature`: an HTTP message signature (RFC 9421) over `@request-target`,
  `@authority` and those headers, `keyid` the API key, `alg` hmac-sha256, `created`,
  `expires`, a 24-character nonce, keyed by the base64-decoded client secret; built here from
  the RFC's rules (`signature_headers`);
- the AudioHook protocol as a client (message types as in Genesys's reference implementation,
  github.com/purecloudlabs/audiohook-reference-implementation, protocol/message.ts): `open` (the
  organization, the call's facts, the media offered, the flow's input variables), binary PCMU
  8 kHz, `dtmf`, `ping`, `update` (a language change, answered `updated`), `paused`/`resumed`,
  and `close` to hang up; our `disconnect` is answered with `close`. Every message counts its
  `seq` up from 1 and carries the last `serverseq` seen.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from personaplex_phone.carrier import AudioFormat
from personaplex_phone.sim_sides import SideDefaults, secret
from personaplex_phone.simulator import HttpRequest, Ours, StreamOffer
from personaplex_phone.urls import websocket_base

MEDIA_PATH = "/genesys/audio-connector"  # the integration's base URI, as our docs give it
ORGANIZATION = "c0ffee00-0000-4000-8000-000000000001"
COVERED = (
    "@request-target",
    "@authority",
    "audiohook-organization-id",
    "audiohook-session-id",
    "audiohook-correlation-id",
    "x-api-key",
)


def dialled_authority(url: str) -> str:
    """The host and port a URL dials, the port left out where it is the scheme's default."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    default = {"wss": 443, "https": 443, "ws": 80, "http": 80}.get(parts.scheme)
    return host if parts.port in (None, default) else f"{host}:{parts.port}"


def signature_headers(
    key: bytes,
    api_key: str,
    url: str,
    headers: dict[str, str],
    nonce: str,
    created: int,
    lifetime_s: int = 30,
) -> dict[str, str]:
    """`Signature-Input` and `Signature` for an upgrade to `url` (RFC 9421, HMAC-SHA256)."""
    parts = urlsplit(url)
    lower = {k.lower(): " ".join(v.split()) for k, v in headers.items()} | {"x-api-key": api_key}
    values = {
        "@request-target": parts.path + (f"?{parts.query}" if parts.query else ""),
        "@authority": dialled_authority(url),
        **lower,
    }
    components = " ".join(f'"{name}"' for name in COVERED)
    params = f'({components});keyid="{api_key}";nonce="{nonce}";alg="hmac-sha256"'
    params += f";created={created};expires={created + lifetime_s}"
    base = "\n".join([*(f'"{name}": {values[name]}' for name in COVERED), f'"@signature-params": {params}'])
    digest = base64.b64encode(hmac.new(key, base.encode(), hashlib.sha256).digest()).decode()
    return {"Signature-Input": f"sig1={params}", "Signature": f"sig1=:{digest}:"}


SESSION_HEADER = "Audiohook-Session-Id"
PCMU_8K = AudioFormat("pcmu", 8000)


@dataclass
class _Session:
    seq: int = 0
    serverseq: int = 0
    ani: str = ""
    dnis: str = ""
    t0: float = field(default_factory=time.monotonic)


class GenesysSide(SideDefaults):
    name = "genesys"
    ends_by_close = False  # Genesys says `close`, and waits for our `closed`

    def __init__(self, api_key: str, client_secret: str = "", connector_id: str = "personaplex"):
        self.api_key = api_key
        self.key = base64.b64decode(client_secret) if client_secret else b""
        self.connector_id = connector_id
        self._sessions: dict[str, _Session] = {}

    # --- the connection --------------------------------------------------------------------------
    def offer(
        self,
        public_url: str,
        call_id: str,
        to: str = "+15550100001",
        from_: str = "+15550100002",
        query: str = "",
    ) -> StreamOffer:
        """The Call Audio Connector action: `query` (`a=1&b=2`) are the flow's input variables."""
        session = str(uuid.uuid4())
        headers = {
            "Audiohook-Organization-Id": ORGANIZATION,
            SESSION_HEADER: session,
            "Audiohook-Correlation-Id": str(uuid.uuid4()),
        }
        self._sessions[session] = _Session(ani=from_, dnis=to)
        url = f"{websocket_base(public_url)}{MEDIA_PATH}/{self.connector_id}"
        return StreamOffer(call_id, url, dict(parse_qsl(query)), PCMU_8K, PCMU_8K, headers)

    def answer_request(
        self, public_url: str, call_id: str, to: str, from_: str, query: str = ""
    ) -> HttpRequest:
        raise ValueError("Genesys sends no answer webhook: the Audio Connector opens the session (offer)")

    def parse_answer(self, call_id: str, status: int, body: bytes) -> StreamOffer | None:
        return None

    def upgrade(self, offer: StreamOffer, public_url: str) -> tuple[str, dict[str, str]]:
        headers = {**offer.headers, "X-API-KEY": self.api_key}
        if self.key:
            nonce = base64.b64encode(secrets.token_bytes(18)).decode()
            headers |= signature_headers(self.key, self.api_key, offer.url, headers, nonce, int(time.time()))
        return offer.url, headers

    # --- the AudioHook client ----------------------------------------------------------------------
    def _message(self, offer: StreamOffer, kind: str, parameters: dict[str, Any]) -> str:
        session_id = offer.headers[SESSION_HEADER]
        session = self._sessions.setdefault(session_id, _Session())
        session.seq += 1
        return json.dumps(
            {
                "version": "2",
                "type": kind,
                "seq": session.seq,
                "serverseq": session.serverseq,
                "id": session_id,
                "position": f"PT{time.monotonic() - session.t0:.2f}S",
                "parameters": parameters,
            }
        )

    def opening(self, offer: StreamOffer, stream_id: str) -> list[str | bytes]:
        session = self._sessions.setdefault(offer.headers[SESSION_HEADER], _Session())
        parameters = {
            "organizationId": ORGANIZATION,
            "conversationId": offer.call_id,
            "participant": {
                "id": str(uuid.uuid4()),
                "ani": f"tel:{session.ani}",
                "aniName": "A Caller",
                "dnis": f"tel:{session.dnis}",
            },
            "media": [
                {"type": "audio", "format": "PCMU", "channels": ["external", "internal"], "rate": 8000},
                {"type": "audio", "format": "PCMU", "channels": ["external"], "rate": 8000},
            ],
            "language": "en-US",
            "inputVariables": dict(offer.params),
        }
        return [self._message(offer, "open", parameters)]

    def dtmf(self, offer: StreamOffer, stream_id: str, digit: str) -> str:
        return self._message(offer, "dtmf", {"digit": digit})

    def ping(self, offer: StreamOffer) -> str:
        return self._message(offer, "ping", {})

    def paused(self, offer: StreamOffer, paused: bool = True) -> str:
        return self._message(offer, "paused" if paused else "resumed", {})

    def stop(self, offer: StreamOffer, stream_id: str) -> str:
        return self._message(offer, "close", {"reason": "end"})

    def read_text(self, message: str) -> Ours:
        data = json.loads(message)
        session = self._sessions.setdefault(str(data.get("id")), _Session())
        session.serverseq = max(session.serverseq, int(data.get("seq", 0)))
        kind = str(data.get("type"))
        entities = (data.get("parameters") or {}).get("entities") or []
        if kind == "event" and any(e.get("type") == "barge_in" for e in entities):
            return Ours("clear", message.encode())
        return Ours("other", message.encode(), name=kind)

    def respond(self, offer: StreamOffer, stream_id: str, ours: Ours) -> list[str | bytes]:
        """Our `disconnect` is answered with `close` (then Genesys waits for `closed`)."""
        if ours.name == "disconnect":
            return [self._message(offer, "close", {"reason": "disconnect"})]
        return []

    def mark_played(self, offer: StreamOffer, stream_id: str, name: str) -> str:
        raise ValueError("the AudioHook protocol has no marks")

    def status_request(self, public_url: str, call_id: str, status: str) -> HttpRequest:
        raise ValueError("Genesys sends no status webhook: the session's `close` ends it")


def side(api_key: str | None = None, client_secret: str | None = None) -> GenesysSide:
    why = "the Genesys simulator connects like Genesys: set GENESYS_API_KEY (the server's)"
    key = secret(api_key, "GENESYS_API_KEY", why)
    if client_secret is None:
        client_secret = os.environ.get("GENESYS_CLIENT_SECRET", "")
    return GenesysSide(key, client_secret)
