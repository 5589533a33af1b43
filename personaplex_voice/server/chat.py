"""`/api/chat`: one WebSocket ↔ one Session (see `protocol.py` for the message kinds).

Life of a connection:
1. before the upgrade: check Origin, API key, that the engine is loaded, the query values, and
   open the session (`host.open(persona)`: the persona is validated, a slot taken or a queue
   place). A refusal that retrying cannot fix (origin, key, query, persona, a failed model) is
   the upgrade's HTTP answer, with the reason as plain text; so is a server without real-time
   headroom left (`saturated`: 503 with Retry-After, so a client or proxy tries another server);
   a passing one (server full, model still loading) is a 0x05 message and a 1013 close after
   the upgrade, which WebSocket clients take as "try again later";
2. accept; send 0x04 metadata (with the queue position while waiting, sent again whenever it
   changes); from here on every input message goes to the session in order, before the
   handshake too (the session keeps it until it runs: docs/sessions.md);
3. once `session.ready()` (system prompt in the slot), send the 0x00 handshake;
4. two tasks run until either ends: *receive* (0x01 Ogg-Opus → PCM → `session.push`, unknown
   kinds ignored) and *send* (`session.frames()` → 0x02 text + 0x01 Ogg-Opus, one page per 20 ms
   packet);
5. the session is closed (slot freed at once). Every close the server decides on is preceded by
   a 0x05 error message saying why, in words.

A slow client only hurts itself: the session drops the frames it does not take in time, and a
client that stops reading for `send_timeout_s` is disconnected. A client's input costs bounded
work: audio is decoded against its `DecodeBudget` (audio per wall second, CPU per message and
per second, damage charged as the costliest audio), message bytes against a byte budget; the
first breach refuses that client (0x05, close) before the rest of its message is decoded.

No exception outlives the connection in a reference cycle: the two loops' exceptions are
re-raised as fresh copies (re-raising a task's own exception would put this frame, which holds
the task, into that exception's traceback), so a refused client's message and decoder state are
freed at once by reference counting, even with the garbage collector off.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.websockets import WebSocket, WebSocketDisconnect

from personaplex_voice.audio.budget import DecodeBudget, DecodeBudgetExceeded, TokenBucket
from personaplex_voice.audio.opus import OggOpusReader, OggOpusWriter
from personaplex_voice.engine.base import (
    SAMPLE_RATE,
    CapacityError,
    EngineError,
    PersonaError,
    SaturatedError,
)
from personaplex_voice.process.settings import ServerSettings
from personaplex_voice.server import access, info, protocol
from personaplex_voice.server.metrics import ServerMetrics
from personaplex_voice.server.protocol import ChatParams, Kind, QueryError
from personaplex_voice.session_api import CallSession, MediaMeter, SessionHost, slips_warning

log = logging.getLogger("personaplex_voice.server.chat")

# WebSocket close codes (RFC 6455 §7.4.1).
CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001
CLOSE_INVALID_DATA = 1007
CLOSE_POLICY = 1008
CLOSE_TOO_BIG = 1009
CLOSE_INTERNAL = 1011
CLOSE_TRY_LATER = 1013
# What `why_refused` answers for a refusal that is a 1013 close on the socket (full, loading).
CLOSE_TO_HTTP_RETRY = 503

QUEUE_POLL_S = 0.25
# Message bytes a client may send (all kinds, text frames included), per second and at once: far
# above any Opus stream (a 128 kbit/s one is 16 KB/s) and far below what costs the server time.
BYTES_PER_S = 128 * 1024
BYTES_BURST = 2 * 1024 * 1024


class Refusal(Exception):
    """Ends the connection with a 0x05 error. `kind` labels the error metric. `http_status`:
    before the upgrade, a refusal that retrying cannot fix is answered with this HTTP status
    instead (None: a 0x05 after the upgrade, even then)."""

    def __init__(
        self,
        kind: str,
        message: str,
        code: int,
        http_status: int | None = None,
        retry_after_s: float | None = None,
    ):
        super().__init__(message)
        self.kind, self.message, self.code, self.http_status = kind, message, code, http_status
        self.retry_after_s = retry_after_s


# A refusal's kind -> the session's close reason (the fixed set of personaplex_voice.metrics):
# whatever the server refused the client for is "refused"; these are the others.
_CLOSE_REASONS = {
    "client": "client",
    "shutdown": "shutdown",
    "slow_client": "slow_client",
    "internal": "transport_error",
}


def session_close_reason(kind: str) -> str:
    return _CLOSE_REASONS.get(kind, "refused")


class ClientGone(Exception):
    """The client closed the socket or the connection broke."""


class ChatConnection:
    def __init__(self, ws: WebSocket, settings: ServerSettings, metrics: ServerMetrics, state: Any):
        self.ws = ws
        self.settings = settings
        self.metrics = metrics
        self.state = state  # app.state: host, model_name, load status
        self.session: CallSession | None = None
        self.params: ChatParams | None = None
        self._send_lock = asyncio.Lock()
        self._reader = OggOpusReader(sample_rate=SAMPLE_RATE)
        self._budget = DecodeBudget(SAMPLE_RATE)
        self._bytes = TokenBucket(BYTES_PER_S, BYTES_BURST)
        self._media: MediaMeter | None = None  # this call's media-path time (decode, encode)

    # -- entry point ---------------------------------------------------------------------------

    async def run(self) -> None:
        try:
            await self._before_upgrade()
        except Refusal as refusal:
            if refusal.http_status is not None and await self._deny(refusal):
                return
            await self._accept_and_refuse(refusal)
            return
        except BaseException:
            await self._close_unaccepted("shutdown")
            raise
        try:
            await self.ws.accept()
        except BaseException:  # the client left during the upgrade (uvicorn wants its exception)
            await self._close_unaccepted("client")
            raise
        self.metrics.connections.inc()
        self.metrics.open_connections.set(self.metrics.open_connections.value + 1)
        close_reason = "client"
        try:
            await self._converse()
        except Refusal as refusal:
            close_reason = refusal.kind
            await self._refuse(refusal)
        except ClientGone:
            log.debug("chat client left")
        except asyncio.CancelledError:
            close_reason = "shutdown"
            raise
        except Exception:
            log.exception("internal error on /api/chat")
            close_reason = "internal"
            await self._refuse(Refusal("internal", "internal server error", CLOSE_INTERNAL))
        finally:
            if self.session is not None:
                await self.session.close(reason=session_close_reason(close_reason))
                self._log_end(close_reason)
            self.metrics.open_connections.set(self.metrics.open_connections.value - 1)

    async def _before_upgrade(self) -> None:
        """Everything that can refuse a caller before its WebSocket opens (see the module
        docstring), then the session: opened here so that its persona is checked before the
        upgrade, and its slot is taken as early as can be."""
        self.params = check_request(self.state, self.settings, self.ws.headers, self.ws.query_params)
        host: SessionHost = self.state.host
        try:
            await host.headroom.arrivals.turn(offer=True)  # behind the calls in progress
            self.session = await host.open(self.params.persona())
        except SaturatedError as exc:
            raise saturated_refusal(exc) from None
        except CapacityError as exc:
            retry = f"; retry in about {exc.retry_after_s:.0f} s" if exc.retry_after_s else ""
            raise Refusal(
                "capacity", f"the server is full ({host.capacity} sessions){retry}", CLOSE_TRY_LATER
            ) from None
        except PersonaError as exc:
            raise Refusal("persona", str(exc), CLOSE_POLICY, http_status=400) from None
        except EngineError as exc:  # the host is shutting down (a deploy): another server may take it
            raise Refusal(
                "unavailable", f"the server is not taking calls ({exc})", CLOSE_GOING_AWAY
            ) from None
        self._media = host.headroom.meter()
        log.info("session %s opened (voice=%s)", self.session.id, self.params.voice_prompt or "default")

    def _log_end(self, close_reason: str) -> None:
        """One INFO line per session; one WARNING more when it lost audio, or had silence put in,
        to keep the frame clock (never silently: docs/capacity.md)."""
        assert self.session is not None
        stats = self.session.stats
        media = self._media.summary(stats["duration_s"]) if self._media is not None else {}
        log.info(
            "session %s closed (%s): %.1f s of audio, %d late frames, %d dropped output frames, "
            "media path %.2f ms per second",
            self.session.id,
            self.session.close_reason or close_reason,
            stats["duration_s"],
            stats["late_frames"],
            stats["dropped_output_frames"],
            media.get("media_ms_per_s", 0.0),
        )
        warning = slips_warning(stats.get("dropped_ms") or {}, stats.get("inserted_ms") or {})
        if warning:
            log.warning("session %s %s", self.session.id, warning)

    async def _deny(self, refusal: Refusal) -> bool:
        """The upgrade's HTTP answer: `refusal.http_status`, its message as plain text and its kind
        in `X-PersonaPlex-Error`. One log line. False when the server cannot send one (an ASGI
        server without the WebSocket denial extension): then it is refused after the upgrade."""
        if "websocket.http.response" not in self.ws.scope.get("extensions", {}):
            return False
        assert refusal.http_status is not None
        self.metrics.errors.inc(label=refusal.kind)
        client = self.ws.client
        log.info(
            "refused an /api/chat upgrade from %s: %d %s (%s)",
            f"{client.host}:{client.port}" if client else "unknown client",
            refusal.http_status,
            refusal.message,
            refusal.kind,
        )
        headers = refusal_headers(refusal)
        response = PlainTextResponse(refusal.message + "\n", refusal.http_status, headers=headers)
        # A client already gone raises the server's own ClientDisconnected, which it expects back.
        await self.ws.send_denial_response(response)
        return True

    async def _accept_and_refuse(self, refusal: Refusal) -> None:
        """A refusal after the upgrade although nothing was opened (see `_before_upgrade`)."""
        try:
            await self.ws.accept()
        except BaseException:  # the client left (see `run`)
            await self._close_unaccepted("client")
            raise
        self.metrics.connections.inc()
        await self._close_unaccepted(session_close_reason(refusal.kind))
        await self._refuse(refusal)

    async def _close_unaccepted(self, reason: str) -> None:
        if self.session is not None:
            await self.session.close(reason=reason)

    async def _converse(self) -> None:
        assert self.params is not None and self.session is not None
        await self._send(protocol.encode_metadata(self._metadata()))

        receiving = asyncio.create_task(self._receive_loop(), name="chat-receive")
        sending: asyncio.Task[None] | None = None
        reason = "client"
        try:
            await self._wait_until_ready(receiving)
            await self._send(protocol.encode_handshake())
            sending = asyncio.create_task(self._send_loop(), name="chat-send")
            done, _ = await asyncio.wait({receiving, sending}, return_when=asyncio.FIRST_COMPLETED)
            finished = receiving if receiving in done else sending
            _raise_outcome(finished)  # Refusal / ClientGone
            if finished is sending:  # the session ended on the server's side
                reason = self.session.close_reason or "ended"
                code = CLOSE_GOING_AWAY if reason == "shutdown" else CLOSE_NORMAL
                raise Refusal("session_ended", f"the session ended on the server ({reason})", code)
        except Refusal as refusal:
            reason = refusal.kind
            raise
        except asyncio.CancelledError:
            reason = "shutdown"
            raise
        except ClientGone:
            raise
        except Exception:
            reason = "internal"
            raise
        finally:
            # Close first (frees the slot at once); the send task then leaves session.frames().
            await self.session.close(reason=session_close_reason(reason))
            for task in (receiving, sending):
                if task is not None and not task.done():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task
                if task is not None:
                    _retrieve(task)  # both may have failed (a client gone mid-send): no "never retrieved"

    # -- waiting for a slot --------------------------------------------------------------------

    async def _wait_until_ready(self, receiving: asyncio.Task[None]) -> None:
        ready = asyncio.ensure_future(self.session.ready())
        position = self.session.queue_position
        try:
            while True:
                done, _ = await asyncio.wait({ready, receiving}, timeout=QUEUE_POLL_S)
                if ready in done:
                    try:
                        ready.result()
                    except PersonaError as exc:
                        raise Refusal("persona", str(exc), CLOSE_POLICY) from None
                    except SaturatedError as exc:  # shed from the queue: another server may take it
                        raise Refusal("saturated", str(exc), CLOSE_TRY_LATER) from None
                    except Exception as exc:  # SessionClosed: shutdown or engine failure
                        reason = self.session.close_reason or type(exc).__name__
                        raise Refusal(
                            "session_ended", f"the session could not start ({reason})", CLOSE_INTERNAL
                        ) from None
                    if position:  # it waited in the queue: tell it that it is in now
                        await self._send(protocol.encode_metadata(self._metadata()))
                    return
                if receiving in done:
                    _raise_outcome(receiving)  # Refusal or ClientGone
                    raise ClientGone
                if self.session.queue_position != position:
                    position = self.session.queue_position
                    await self._send(protocol.encode_metadata(self._metadata()))
        finally:
            if not ready.done():
                ready.cancel()
            _retrieve(ready)

    def _metadata(self) -> dict[str, Any]:
        assert self.params is not None and self.session is not None
        return session_metadata(self.state, self.settings, self.params, self.session)

    # -- the two loops -------------------------------------------------------------------------

    async def _receive_loop(self) -> None:
        cap = self.settings.max_message_bytes
        while True:
            message = await self.ws.receive()
            if message["type"] == "websocket.disconnect":
                raise ClientGone
            data = message.get("bytes")
            if data is None:  # a text frame: not part of the protocol, ignored like unknown kinds
                size = len(message.get("text") or "")
                self.metrics.messages_in.inc(label="text_frame")
                self._check_size(size, cap)
                continue
            self.metrics.bytes_in.inc(len(data))
            self._check_size(len(data), cap)
            decoded = protocol.decode(data)
            if decoded is None:
                continue
            kind = Kind(decoded.kind).name.lower() if decoded.known else "unknown"
            self.metrics.messages_in.inc(label=kind)
            if decoded.kind == Kind.AUDIO:
                self._accept_audio(decoded.payload)
            # Control, ping and unknown kinds are ignored (the reference server ignores them too).

    def _check_size(self, size: int, cap: int) -> None:
        if size > cap:
            raise Refusal("oversize", f"message of {size} bytes exceeds the {cap} byte limit", CLOSE_TOO_BIG)
        if not self._bytes.take(size):
            raise Refusal(
                "too_fast",
                f"the client sends far more data than a voice call needs (over {BYTES_PER_S // 1024} KiB/s)",
                CLOSE_POLICY,
            )

    def _accept_audio(self, pages: bytes) -> None:
        """Decodes against this client's budget: the reader stops at the first breach, so a
        message of hours of audio (or of packets libopus rejects) costs a few ms, not seconds."""
        started = time.perf_counter()
        try:
            self._decode_and_push(pages)
        finally:
            if self._media is not None:
                self._media.add(time.perf_counter() - started)

    def _decode_and_push(self, pages: bytes) -> None:
        try:
            chunks = self._reader.feed(pages, self._budget)
        except DecodeBudgetExceeded as exc:
            raise Refusal(exc.reason, str(exc), CLOSE_POLICY) from None
        except ValueError as exc:  # OggError
            raise Refusal("malformed_audio", f"malformed Ogg-Opus audio: {exc}", CLOSE_INVALID_DATA) from None
        # Every byte after the upgrade counts, the handshake's time included: the session keeps
        # what comes before it runs, in order (bounded; docs/sessions.md).
        for pcm in chunks:
            if len(pcm):
                self.session.push(pcm)

    async def _send_loop(self) -> None:
        writer = OggOpusWriter(sample_rate=SAMPLE_RATE, frame_ms=20)
        media = self._media
        async for out in self.session.frames():
            if out.text:
                await self._send(protocol.encode_text(out.text))
            started = time.perf_counter()
            pages = writer.write(out.pcm)
            if media is not None:
                media.add(time.perf_counter() - started)
            if pages:
                await self._send(protocol.encode_audio(pages))

    # -- sending -------------------------------------------------------------------------------

    async def _send(self, data: bytes) -> None:
        # Not asyncio.wait_for: before Python 3.12 it can swallow a cancellation that arrives as
        # the send completes, which would leave this connection's send task running forever.
        async with self._send_lock:
            sending = asyncio.ensure_future(self.ws.send_bytes(data))
            try:
                done, _ = await asyncio.wait({sending}, timeout=self.settings.send_timeout_s)
            except asyncio.CancelledError:
                sending.cancel()
                raise
            if not done:
                sending.cancel()
                raise Refusal("slow_client", "the client stopped reading audio", CLOSE_POLICY)
        error = sending.exception()
        if isinstance(error, WebSocketDisconnect | RuntimeError | OSError):
            raise ClientGone from None
        if error is not None:
            raise error
        self.metrics.bytes_out.inc(len(data))

    async def _refuse(self, refusal: Refusal) -> None:
        """0x05 with the reason, then close. Best effort: the client may already be gone."""
        self.metrics.errors.inc(label=refusal.kind)
        if refusal.kind not in ("session_ended",):
            log.info("chat refused (%s): %s", refusal.kind, refusal.message)
        with contextlib.suppress(Exception):
            async with self._send_lock:
                await asyncio.wait_for(
                    self.ws.send_bytes(protocol.encode_error(refusal.message)), timeout=2.0
                )
            self.metrics.bytes_out.inc(1 + len(refusal.message.encode()))
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.ws.close(code=refusal.code, reason=refusal.kind[:120]), timeout=2.0)


def session_metadata(
    state: Any, settings: ServerSettings, params: ChatParams, session: CallSession
) -> dict[str, Any]:
    """The 0x04 metadata of a session (docs/server.md): what it runs, where it waits, and the
    fields NVIDIA's PersonaPlex client validates. The WebRTC endpoint sends the same object."""
    sampling = params.sampling()
    return {
        "session_id": session.id,
        "model": info.public_model_name(state.model_name),
        "voice": params.voice_prompt or "default",
        "sample_rate": SAMPLE_RATE,
        "frame_ms": 80,
        "queue_position": session.queue_position or 0,
        "max_sessions": state.host.capacity,
        "text_temperature": sampling.text_temperature,
        "text_topk": sampling.text_topk,
        "audio_temperature": sampling.audio_temperature,
        "audio_topk": sampling.audio_topk,
        "greedy": sampling.greedy,
        "seed": params.seed if params.seed is not None else -1,
        # What NVIDIA's PersonaPlex client validates (its server-info panel) and shows.
        **info.reference_client_fields(settings, state.model_name),
    }


def saturated_refusal(exc: SaturatedError) -> Refusal:
    """No real-time headroom left: 503 on the upgrade (with Retry-After), 1013 after it."""
    return Refusal("saturated", str(exc), CLOSE_TRY_LATER, http_status=503, retry_after_s=exc.retry_after_s)


def refusal_headers(refusal: Refusal) -> dict[str, str]:
    """The headers of a refusal's HTTP answer: its kind, and what a client needs to act on it."""
    headers = {"x-personaplex-error": refusal.kind, "cache-control": "no-store"}
    if refusal.kind == "auth":
        headers["www-authenticate"] = 'Bearer realm="personaplex"'
    if refusal.retry_after_s:
        headers["retry-after"] = str(max(1, round(refusal.retry_after_s)))
    return headers


def _retrieve(task: asyncio.Future[Any]) -> None:
    """Marks a finished task's exception as seen (asyncio logs "Task exception was never
    retrieved" at ERROR, with a traceback, for one that nobody looked at)."""
    if task.done() and not task.cancelled():
        task.exception()


def _raise_outcome(task: asyncio.Task[None]) -> None:
    """Re-raises how a finished loop ended as a fresh exception (see the module docstring): our
    own endings are copied; anything else is a bug, raised as it is for its traceback."""
    if task.cancelled():
        raise ClientGone
    error = task.exception()
    if isinstance(error, Refusal):
        raise Refusal(error.kind, error.message, error.code)
    if isinstance(error, ClientGone):
        raise ClientGone
    if error is not None:
        raise error


def check_request(state: Any, settings: ServerSettings, headers: Any, query: Any) -> ChatParams:
    """What /api/chat checks before it opens a session, for the WebSocket and for a plain GET
    that asks why an upgrade was refused. Raises `Refusal` (with the HTTP status of refusals
    that retrying cannot fix)."""
    if not access.origin_ok(settings, headers):
        raise Refusal(
            "origin", f"origin {headers.get('origin')!r} is not allowed", CLOSE_POLICY, http_status=403
        )
    if not access.key_ok(settings, headers, query):
        raise Refusal("auth", "missing or wrong API key (pass ?token=KEY)", CLOSE_POLICY, http_status=401)
    if state.host is None:
        status = state.load_status
        if status.get("state") == "failed":
            raise Refusal(
                "unavailable",
                f"the model failed to load: {status.get('detail')}",
                CLOSE_INTERNAL,
                http_status=500,
            )
        raise Refusal("loading", "the model is still loading; retry in a few seconds", CLOSE_TRY_LATER)
    try:
        return ChatParams.from_query(
            query, max_prompt_chars=settings.max_prompt_chars, text_prompt=_stored_prompt(state, query)
        )
    except QueryError as exc:
        raise Refusal("bad_query", str(exc), CLOSE_POLICY, http_status=400) from None


def _stored_prompt(state: Any, query: Any) -> str | None:
    """The text of `?prompt_id=` (stored with POST /api/prompts), None without one."""
    prompt_id = query.get("prompt_id")
    if not prompt_id:
        return None
    if query.get("text_prompt"):
        raise QueryError("give text_prompt or prompt_id, not both")
    text = state.prompts.get(prompt_id)
    if text is None:
        ttl = state.prompts.ttl_s
        raise QueryError(
            f"prompt_id {prompt_id[:40]!r} is unknown or expired (stored prompts last {ttl:g} s): "
            "store the prompt again with POST /api/prompts"
        )
    return text


async def why_refused(request: Request) -> PlainTextResponse:
    """`GET /api/chat?QUERY` (plain HTTP): what an upgrade with this query and these headers
    would be refused for, for clients that cannot read an upgrade's HTTP answer (a browser's
    WebSocket shows a refused upgrade only as a close). 426 when the checks pass. The voice is
    checked against the engine's voice list, not by opening a session; nothing is counted."""
    state = request.app.state
    try:
        params = check_request(state, state.settings, request.headers, request.query_params)
        _check_voice_listed(state, params.voice_prompt)
        try:
            state.host.headroom.check()
        except SaturatedError as exc:
            raise saturated_refusal(exc) from None
    except Refusal as refusal:
        status = refusal.http_status or CLOSE_TO_HTTP_RETRY
        return PlainTextResponse(refusal.message + "\n", status, headers=refusal_headers(refusal))
    return PlainTextResponse(
        "nothing to refuse: connect with a WebSocket upgrade\n", 426, headers={"upgrade": "websocket"}
    )


def _check_voice_listed(state: Any, voice: str | None) -> None:
    host: SessionHost | None = state.host
    if voice is None or host is None:
        return
    stem = voice.rsplit(".", 1)[0] if "." in voice else voice
    names = {v.name.rsplit(".", 1)[0] if "." in v.name else v.name for v in host.voices()}
    if stem not in names:
        raise Refusal("persona", f"unknown voice {voice!r} (see /api/voices)", CLOSE_POLICY, http_status=400)


async def chat_endpoint(ws: WebSocket) -> None:
    app = ws.app
    await ChatConnection(ws, app.state.settings, app.state.server_metrics, app.state).run()
