"""STUN and TURN servers (`--ice-servers`, PERSONAPLEX_WEBRTC_ICE_SERVERS): one list, three uses.

The server's own peer connections gather their candidates through them (aiortc's
`RTCConfiguration.iceServers`); browsers get the same list to gather theirs (`GET /api/webrtc`,
Pipecat's `/start` answer) and WHIP clients get it in `Link: <url>; rel="ice-server"` headers
of the 201 answer (RFC 9725 §4.6). The setting is a JSON list of WebRTC `RTCIceServer` objects
(`[{"urls": "turn:turn.example.com:3478", "username": "u", "credential": "p"}]`) or
comma-separated URLs, where a TURN URL may carry its credentials as `turn:user:pass@host:port`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

__all__ = ["IceServer", "IceServerError", "parse_ice_servers"]

_SCHEMES = ("stun", "stuns", "turn", "turns")


class IceServerError(ValueError):
    """The ICE server setting cannot be used; the message says which entry and why."""


@dataclass(frozen=True)
class IceServer:
    urls: tuple[str, ...]
    username: str | None = None
    credential: str | None = None

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"urls": list(self.urls)}
        if self.username is not None:
            out["username"] = self.username
        if self.credential is not None:
            out["credential"] = self.credential
        return out

    def link_headers(self) -> list[str]:
        """RFC 9725 §4.6: one `Link` value per URL."""
        out = []
        for url in self.urls:
            value = f'<{url}>; rel="ice-server"'
            if self.username is not None and self.credential is not None:
                value += (
                    f'; username="{_quoted(self.username)}"; credential="{_quoted(self.credential)}"'
                    '; credential-type="password"'
                )
            out.append(value)
        return out


def _quoted(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def _check_url(url: str) -> str:
    scheme = url.split(":", 1)[0].lower()
    if scheme not in _SCHEMES or ":" not in url or len(url) > 512:
        raise IceServerError(
            f"ICE server URL {url[:80]!r}: expected stun:, stuns:, turn: or turns:HOST[:PORT]"
        )
    return url


def _from_url(text: str) -> IceServer:
    """`turn:user:pass@host:3478?transport=udp` → the URL without credentials, and them."""
    scheme, _, rest = text.partition(":")
    if "@" in rest and scheme.lower() in ("turn", "turns"):
        userinfo, _, host = rest.rpartition("@")
        user, _, password = userinfo.partition(":")
        return IceServer((_check_url(f"{scheme}:{host}"),), unquote(user), unquote(password))
    return IceServer((_check_url(text),))


def parse_ice_servers(setting: str) -> list[IceServer]:
    text = setting.strip()
    if not text:
        return []
    if text.startswith("["):
        try:
            entries = json.loads(text)
        except ValueError as exc:
            raise IceServerError(f"ICE servers: not valid JSON ({exc})") from None
        servers = []
        for entry in entries:
            if not isinstance(entry, dict) or "urls" not in entry:
                raise IceServerError(f"ICE servers: each entry is an object with urls, got {entry!r}"[:200])
            urls = entry["urls"] if isinstance(entry["urls"], list) else [entry["urls"]]
            if not urls or not all(isinstance(u, str) for u in urls):
                raise IceServerError("ICE servers: urls must be a URL or a list of URLs")
            user, credential = entry.get("username"), entry.get("credential")
            if any(u.lower().startswith("turn") for u in urls) and (user is None or credential is None):
                raise IceServerError(
                    f"ICE servers: TURN server {urls[0]!r} needs a username and a credential"
                )
            servers.append(
                IceServer(
                    tuple(_check_url(u) for u in urls),
                    None if user is None else str(user),
                    None if credential is None else str(credential),
                )
            )
        return servers
    servers = [_from_url(part.strip()) for part in text.split(",") if part.strip()]
    for server in servers:
        if server.urls[0].lower().startswith("turn") and server.username is None:
            raise IceServerError(
                f"ICE servers: TURN server {server.urls[0]!r} needs turn:USER:PASS@HOST:PORT"
            )
    return servers
