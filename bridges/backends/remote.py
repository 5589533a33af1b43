"""Remote backend: a personaplex-voice server's `/api/chat` (the native protocol, Ogg-Opus audio).

One WebSocket per session. The server sends 0x04 metadata (again while the caller waits in its
queue), 0x00 once the system prompt is in the slot, then 0x01 Ogg-Opus pages and 0x02 text
pieces. A refusal that retrying cannot fix (key, persona, query) is the upgrade's HTTP answer,
its reason the body and its kind the `X-PersonaPlex-Error` header; any later refusal is a 0x05
message with the reason, then a close whose reason is the kind. Connecting is retried with
exponential backoff when the server cannot be reached or asks to try again later (HTTP 5xx, a
1013 close before the handshake); a refusal is not retried, nor is a server without real-time
headroom (503 `saturated`): that is a `SessionRefused` of kind "saturated" at once, so the
application can send the call elsewhere (LiveKit's DuplexModel retries it with its backoff).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import numpy as np
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI

from personaplex_voice.audio.opus import OggOpusReader, OggOpusWriter
from personaplex_voice.engine.base import FRAME_SIZE, SAMPLE_RATE, Persona
from personaplex_voice.server import protocol
from personaplex_voice.server.protocol import ChatParams, Kind

from .base import AgentFrame, BackendUnavailable, SessionLost, SessionRefused

log = logging.getLogger("personaplex_backends.remote")

# User audio waiting to be encoded and sent; past this the oldest is dropped (a stalled socket
# must not turn into seconds of latency once it recovers). The first push, the caller's audio a
# bridge held while the session opened, is exempt: the server keeps and catches it up.
MAX_SEND_BACKLOG_S = 1.0
# Why a server ends a running session without it being this client's fault (its shutdown or
# restart, an engine failure, its own limits): the session is lost, not refused.
ENDED_ON_THE_SERVER = frozenset({"session_ended", "internal"})
# A connect URL longer than this (a long persona, percent-encoded) goes the server's long-prompt
# way: the prompt is stored with POST /api/prompts and the URL names it by `prompt_id` (servers
# refuse request lines past 16 KiB by default; proxies often stop at 8 KiB).
MAX_URL_BYTES = 6000


@dataclass(frozen=True)
class Backoff:
    """Delays between connection attempts: `initial_s`, doubling, capped at `max_s`."""

    attempts: int = 5
    initial_s: float = 0.5
    max_s: float = 8.0

    def delays(self) -> list[float]:
        return [min(self.max_s, self.initial_s * 2**i) for i in range(max(0, self.attempts - 1))]


class RemoteSession:
    def __init__(self, ws: ClientConnection, url: str, metadata: dict[str, Any]):
        self._ws = ws
        self._url = url
        self.metadata = metadata
        self._writer = OggOpusWriter(sample_rate=SAMPLE_RATE, frame_ms=20)
        self._reader = OggOpusReader(sample_rate=SAMPLE_RATE)
        self._pending: collections.deque[np.ndarray] = collections.deque()
        self._pending_samples = 0
        self._wakeup = asyncio.Event()
        self._closing = False
        self._sender = asyncio.create_task(self._send_loop(), name="personaplex-remote-send")
        self._held_start = 0  # samples of the first push while it waits (see MAX_SEND_BACKLOG_S)
        self._pushed_any = False
        self.dropped_samples = 0

    @property
    def session_id(self) -> str:
        return str(self.metadata.get("session_id", ""))

    @property
    def description(self) -> str:
        return f"remote session {self.session_id or '?'} at {self._url.split('?')[0]}"

    @property
    def closed(self) -> bool:
        """True once the WebSocket's closing handshake is over (or the connection is gone)."""
        return self._ws.close_code is not None

    def push(self, pcm: np.ndarray) -> None:
        if self._closing or not len(pcm):
            return
        if not self._pushed_any:
            self._pushed_any = True
            self._held_start = len(pcm)
        self._pending.append(np.asarray(pcm, np.float32))
        self._pending_samples += len(pcm)
        bound = MAX_SEND_BACKLOG_S * SAMPLE_RATE + self._held_start
        while self._pending_samples > bound and len(self._pending) > 1:
            old = self._pending.popleft()
            self._pending_samples -= len(old)
            self.dropped_samples += len(old)
            self._held_start = 0
        self._wakeup.set()

    async def _send_loop(self) -> None:
        try:
            while True:
                await self._wakeup.wait()
                self._wakeup.clear()
                while self._pending:
                    pcm = self._pending.popleft()
                    self._pending_samples -= len(pcm)
                    self._held_start = 0
                    pages = self._writer.write(pcm)
                    if pages:
                        await self._ws.send(protocol.encode_audio(pages))
        except ConnectionClosed:
            pass  # the receive side reports why

    async def frames(self) -> AsyncIterator[AgentFrame]:
        pending = np.zeros(0, np.float32)
        try:
            async for data in self._ws:
                message = protocol.decode(data) if isinstance(data, bytes) else None
                if message is None:
                    continue
                if message.kind == Kind.AUDIO:
                    pcm = self._reader.feed(message.payload)
                    if pcm:
                        pending = np.concatenate([pending, *pcm])
                    while len(pending) >= FRAME_SIZE:
                        yield AgentFrame(pcm=pending[:FRAME_SIZE])
                        pending = pending[FRAME_SIZE:]
                elif message.kind == Kind.TEXT:
                    yield AgentFrame(text=message.text())
                elif message.kind == Kind.ERROR:
                    kind = await _refusal_kind(self._ws)
                    if kind in ENDED_ON_THE_SERVER:  # not this client's doing: a new session may work
                        raise SessionLost(f"server ended the session: {message.text()}")
                    raise SessionRefused(f"server ended the session: {message.text()}", kind=kind)
                # metadata, ping and unknown kinds carry nothing for the pipeline
        except ConnectionClosed:
            pass
        if not self._closing:
            why = _close_text(self._ws) or "connection lost"
            raise SessionLost(f"the server closed the session ({why})")

    async def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._sender.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._sender
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._ws.close(), timeout=2.0)


class RemoteBackend:
    """Sessions on a personaplex-voice server.

    `url`: `ws://host:port/api/chat` or `wss://...`. `api_key`: sent as `Authorization: Bearer`.
    `ready_timeout_s`: how long to wait for the system prompt (queueing included) before giving up.
    """

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        backoff: Backoff | None = None,
        open_timeout_s: float = 10.0,
        ready_timeout_s: float = 60.0,
        model_name: str = "personaplex (remote)",
    ):
        if not url.startswith(("ws://", "wss://")):
            raise ValueError(f"url must start with ws:// or wss://, got {url!r}")
        self.url = url
        self._api_key = api_key
        self.backoff = backoff or Backoff()
        self._open_timeout_s = open_timeout_s
        self._ready_timeout_s = ready_timeout_s
        self._model_name = model_name

    @property
    def model_name(self) -> str:
        return self._model_name

    async def prepare(self) -> None:
        return None

    async def aclose(self) -> None:
        return None

    async def open(self, persona: Persona) -> RemoteSession:
        params = ChatParams.from_persona(persona)
        url = params.url(self.url)
        if len(url.encode()) > MAX_URL_BYTES:
            prompt_id = await asyncio.to_thread(self._store_prompt, persona.text_prompt)
            url = replace(params, text_prompt="").url(self.url, prompt_id=prompt_id)
        delays = self.backoff.delays()
        for attempt in range(len(delays) + 1):
            try:
                return await self._open_once(url)
            except BackendUnavailable as exc:
                if attempt == len(delays):
                    raise BackendUnavailable(f"{exc} (gave up after {attempt + 1} attempts)") from exc
                log.warning("%s; retrying in %.1f s", exc, delays[attempt])
                await asyncio.sleep(delays[attempt])
        raise AssertionError("unreachable")

    def _store_prompt(self, text: str) -> str:
        """POST /api/prompts on the server of `self.url`; the id to connect with."""
        parts = urlsplit(self.url)
        scheme = "https" if parts.scheme == "wss" else "http"
        endpoint = urlunsplit((scheme, parts.netloc, parts.path.rsplit("/", 1)[0] + "/prompts", "", ""))
        headers = {"Content-Type": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        body = json.dumps({"text_prompt": text}, ensure_ascii=False).encode("utf-8")
        request = urllib.request.Request(endpoint, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self._open_timeout_s) as response:
                return str(json.loads(response.read())["prompt_id"])
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:300].decode("utf-8", "replace")
            kind = "auth" if exc.code in (401, 403) else "persona"
            message = f"{endpoint} refused the prompt (HTTP {exc.code}): {detail}"
            raise SessionRefused(message, kind=kind) from exc
        except (OSError, ValueError, KeyError) as exc:
            raise BackendUnavailable(f"cannot store the prompt at {endpoint}: {exc}") from exc

    async def _open_once(self, url: str) -> RemoteSession:
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else None
        where = self.url
        try:
            ws = await connect(
                url,
                additional_headers=headers,
                open_timeout=self._open_timeout_s,
                max_size=4 * 1024 * 1024,
                compression=None,
            )
        except InvalidStatus as exc:
            raise _http_refusal(where, exc) from exc
        except InvalidURI as exc:
            raise SessionRefused(f"bad server url {where}: {exc}", kind="bad_url") from exc
        except (OSError, TimeoutError, InvalidHandshake) as exc:
            raise BackendUnavailable(f"cannot connect to {where}: {exc or type(exc).__name__}") from exc
        try:
            metadata = await asyncio.wait_for(self._await_handshake(ws), timeout=self._ready_timeout_s)
        except BaseException as exc:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(ws.close(), timeout=2.0)
            if isinstance(exc, TimeoutError):
                raise BackendUnavailable(
                    f"{where} did not get the session ready within {self._ready_timeout_s:.0f} s"
                ) from exc
            raise
        return RemoteSession(ws, url, metadata)

    async def _await_handshake(self, ws: ClientConnection) -> dict[str, Any]:
        metadata: dict[str, Any] = {}
        try:
            async for data in ws:
                message = protocol.decode(data) if isinstance(data, bytes) else None
                if message is None:
                    continue
                if message.kind == Kind.HANDSHAKE:
                    return metadata
                if message.kind == Kind.ERROR:
                    kind = await _refusal_kind(ws)
                    raise SessionRefused(f"{self.url} refused the session: {message.text()}", kind=kind)
                if message.kind == Kind.METADATA:
                    with contextlib.suppress(ValueError):
                        metadata = dict(message.json())
                    if metadata.get("queue_position"):
                        log.info(
                            "waiting for a slot at %s (position %s)", self.url, metadata["queue_position"]
                        )
        except ConnectionClosed:
            pass
        why = _close_text(ws)
        raise BackendUnavailable(f"{self.url} closed the connection before the session was ready ({why})")


def _http_refusal(where: str, exc: InvalidStatus) -> SessionRefused | BackendUnavailable:
    """The upgrade's HTTP answer as a refusal (4xx, or a server error the server named) or as
    worth retrying (any other 5xx: a proxy, a restart)."""
    response = exc.response
    status = response.status_code
    kind = response.headers.get("x-personaplex-error")
    reason = (response.body or b"").decode("utf-8", "replace").strip()[:500]
    said = f": {reason}" if reason else ""
    if kind == "saturated":
        retry = response.headers.get("retry-after")
        later = f"; retry in {retry} s or use another server" if retry else ""
        return SessionRefused(
            f"{where} has no real-time headroom for another call (HTTP {status}){said}{later}", kind=kind
        )
    if 400 <= status < 500 or kind is not None:
        if kind is None:
            kind = {401: "auth", 403: "auth", 404: "not_found"}.get(status, "refused")
        return SessionRefused(f"{where} refused the connection (HTTP {status}){said}", kind=kind)
    return BackendUnavailable(f"{where} answered HTTP {status}{said}")


async def _refusal_kind(ws: ClientConnection) -> str:
    """The server closes right after a 0x05 message, with the refusal's kind as close reason."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(ws.wait_closed(), timeout=2.0)
    return ws.close_reason or "refused"


def _close_text(ws: ClientConnection) -> str:
    code, reason = ws.close_code, ws.close_reason
    if code is None:
        return ""
    return f"code {code} {reason or ''}".strip()


__all__ = ["Backoff", "RemoteBackend", "RemoteSession"]
