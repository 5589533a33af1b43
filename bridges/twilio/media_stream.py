"""One phone call on the `/twilio/media-stream` WebSocket, bridged to one engine session.

Twilio sends JSON text messages: `connected`, `start` (once), `media` (20 ms of base64 μ-law
at 8 kHz), `mark` (echo of ours, once the audio before it has played), `dtmf`, `stop`. We send
`media`, `mark` and `clear`. Per call run: the receive loop (`run`: parsing, inbound audio), a
watchdog (idle and duration limits), the session opener, then a frame reader (session frames ->
20 ms payloads in a bounded outbox) and the pacer (outbox -> `media`/`mark` at real time, see
pacing.py). Whatever ends the call (`stop`, a limit, the session ending on the server, a DTMF
hang-up digit) goes through `_finish`: close the session, `clear` Twilio's buffer, hang up via
REST when the call is still up, close the socket.

Anything malformed closes this call's socket and frees its slot; nothing here can block another
call (every wait is bounded, every queue is bounded).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from personaplex_voice.audio.budget import TokenBucket
from personaplex_voice.engine.base import SAMPLE_RATE, CapacityError
from personaplex_voice.sessions import TicketError

from .audio_path import CHUNK_BYTES, TWILIO_RATE, InboundAudio, OutboundAudio
from .pacing import CHUNK_S, FRAME_S, FrameJitter, MarkTracker, PlaybackClock, percentile

if TYPE_CHECKING:
    from .bridge import TwilioBridge

log = logging.getLogger(__name__)

SILENCE_CHUNK = b"\xff" * CHUNK_BYTES  # μ-law zero

# WebSocket close codes (RFC 6455)
CLOSE_NORMAL = 1000
CLOSE_INVALID_DATA = 1007
CLOSE_POLICY = 1008
CLOSE_TOO_BIG = 1009
CLOSE_ERROR = 1011


class ProtocolError(Exception):
    """The peer broke the Media Streams protocol; `code` is the WebSocket close code to use."""

    def __init__(self, message: str, code: int = CLOSE_POLICY):
        super().__init__(message)
        self.code = code


class CallEnded(Exception):
    """The call ends for a reason we decided (limits, hang-up digit, session end)."""

    def __init__(self, reason: str, hang_up: bool):
        super().__init__(reason)
        self.reason = reason
        self.hang_up = hang_up


def session_close_reason(call_end: str) -> str:
    """The session layer's (bounded) close reason for why a call ended; the full text goes to
    the call record and the log."""
    if call_end.startswith(("protocol error", "bridge error")):
        return "transport_error"
    if call_end == "max duration":
        return "max_duration"
    if call_end in ("idle timeout", "no start message"):
        return "idle"
    return "client"


def parse_message(raw: dict[str, Any], max_bytes: int) -> dict[str, Any]:
    """An ASGI websocket.receive message -> the JSON object Twilio sent."""
    text = raw.get("text")
    if text is None:
        data = raw.get("bytes") or b""
        if len(data) > max_bytes:
            raise ProtocolError(f"message of {len(data)} bytes exceeds {max_bytes}", CLOSE_TOO_BIG)
        raise ProtocolError("binary frames are not part of Media Streams", CLOSE_INVALID_DATA)
    if len(text) > max_bytes:
        raise ProtocolError(f"message of {len(text)} bytes exceeds {max_bytes}", CLOSE_TOO_BIG)
    try:
        message = json.loads(text)
    except ValueError:
        raise ProtocolError("message is not valid JSON", CLOSE_INVALID_DATA) from None
    if not isinstance(message, dict) or not isinstance(message.get("event"), str):
        raise ProtocolError("message is not a JSON object with an `event`", CLOSE_INVALID_DATA)
    return message


def _section(message: dict[str, Any], key: str) -> dict[str, Any]:
    value = message.get(key)
    if not isinstance(value, dict):
        raise ProtocolError(f"`{message['event']}` message without a `{key}` object", CLOSE_INVALID_DATA)
    return value


class OutboundMessages:
    """Our `media` and `mark` messages for one stream, formatted from templates: the same JSON
    as `json.dumps` of the dicts, at a fraction of the cost (with hundreds of calls, building
    and encoding a dict per 20 ms message was a visible share of the server's CPU)."""

    def __init__(self, stream_sid: str):
        sid = json.dumps(stream_sid)
        self._media_head = '{"event":"media","streamSid":' + sid + ',"media":{"payload":"'
        self._mark_head = '{"event":"mark","streamSid":' + sid + ',"mark":{"name":'

    def media(self, ulaw: bytes) -> str:
        # base64 text never needs JSON escaping
        return self._media_head + base64.b64encode(ulaw).decode("ascii") + '"}}'

    def mark(self, name: str) -> str:
        return self._mark_head + json.dumps(name) + "}}"


class MediaStreamCall:
    def __init__(self, ws: WebSocket, bridge: TwilioBridge, ticket: str):
        self.ws = ws
        self.bridge = bridge
        self.ticket = ticket  # the reservation our webhook made for this call (Stream URL path)
        self.settings = bridge.settings
        self.stream_sid = ""
        self.call_sid = ""
        self.session: Any = None
        self.session_ready = False
        self.record: Any = None
        self.inbound = InboundAudio()
        # Twilio sends 8,000 μ-law bytes a second; allow 1.5x that, and a 10 s burst after a stall.
        self._inbound_pace = TokenBucket(1.5 * TWILIO_RATE, 10 * TWILIO_RATE)
        self.outbound = OutboundAudio()
        self.clock = PlaybackClock(
            max_queued_s=self.settings.max_queued_ms / 1000,
            target_s=(round(self.settings.playout_cushion_ms / 1000 / CHUNK_S) + 1) * CHUNK_S,
        )
        self.marks = MarkTracker()
        self.jitter = FrameJitter()
        self.frames_in = 0
        self.frames_out = 0
        self.inbound_dropped = 0  # media before the session was ready
        self.inbound_gaps = 0  # chunks Twilio numbered but we never got
        self.last_chunk = 0
        self.dtmf: list[str] = []
        self.started_at = time.monotonic()
        self._messages = OutboundMessages("")  # set by `start`
        self._sender: asyncio.Task[None] | None = None
        self._main: asyncio.Task[Any] | None = None
        self._receiving = False
        self._last_media = time.monotonic()  # Twilio sends caller audio every 20 ms, silence included
        self._opener: asyncio.Task[None] | None = None
        self._ended: CallEnded | None = None
        self._cushioned = False
        # Outbound audio not yet sent: 160-byte payloads, and mark names (str) after each frame.
        self._outbox: deque[bytes | str] = deque()
        self._outbox_ready = asyncio.Event()
        self._frames_done = False
        self._outbox_chunks = 0  # payloads (not marks) in the outbox
        self._cushion_chunks = round(self.settings.playout_cushion_ms / 1000 / CHUNK_S)
        self._max_cushion_chunks = max(
            self._cushion_chunks, round(self.settings.max_queued_ms / 1000 / CHUNK_S) - 1
        )
        self.out_dropped = 0
        self.max_send_gap_s = 0.0  # longest wait between two of our media messages
        self._last_send = 0.0

    # --- the receive loop ---------------------------------------------------------------
    async def run(self) -> None:
        reason, hang_up, close_code = "stop", False, CLOSE_NORMAL
        self._main = asyncio.current_task()
        watchdog = asyncio.create_task(self._watch_limits())
        try:
            await self._receive_loop()
        except ProtocolError as exc:
            log.warning("twilio %s: protocol error: %s", self.stream_sid or "(no stream)", exc)
            reason, close_code = f"protocol error: {exc}", exc.code
        except CallEnded as exc:
            reason, hang_up = exc.reason, exc.hang_up
        except WebSocketDisconnect:
            reason = "socket closed"
        except asyncio.CancelledError:
            if self._ended is None:  # the server is shutting down: not ours to swallow
                raise
            uncancel = getattr(self._main, "uncancel", None)
            if uncancel is not None:
                uncancel()
            reason, hang_up = self._ended.reason, self._ended.hang_up
        except Exception:
            log.exception("twilio %s: bridge failure", self.stream_sid)
            reason, hang_up, close_code = "bridge error", True, CLOSE_ERROR
        finally:
            self._receiving = False
            watchdog.cancel()
            await self._finish(reason, hang_up, close_code)

    async def _watch_limits(self) -> None:
        """Ends the call past its limits: no caller audio for `idle_timeout_s` (or no `start` within
        `stream_connect_timeout_s`), or `max_call_s` in all."""
        while True:
            now = time.monotonic()
            idle_limit = (
                self.settings.idle_timeout_s if self.stream_sid else self.settings.stream_connect_timeout_s
            )
            if now - self.started_at >= self.settings.max_call_s:
                self._end("max duration", hang_up=True)
                return
            if now - self._last_media >= idle_limit:
                self._end("idle timeout" if self.stream_sid else "no start message", hang_up=True)
                return
            await asyncio.sleep(min(0.5, idle_limit / 4))

    async def _receive_loop(self) -> None:
        # One plain `receive` per message (no timer task each time): limits and a session that
        # ends on the server interrupt it through `_end`.
        self._receiving = True
        while True:
            if self._ended is not None:
                raise self._ended
            raw = await self.ws.receive()
            if raw["type"] == "websocket.disconnect":
                raise WebSocketDisconnect(raw.get("code", CLOSE_NORMAL))
            message = parse_message(raw, self.settings.max_message_bytes)
            if await self._handle(message):
                return

    async def _handle(self, message: dict[str, Any]) -> bool:
        """Dispatch one message; True when the stream is over (`stop`)."""
        event = message["event"]
        if event == "connected":
            return False
        if event == "start":
            await self._on_start(message)
            return False
        if not self.stream_sid:
            raise ProtocolError(f"`{event}` before `start`")
        if message.get("streamSid") != self.stream_sid:
            raise ProtocolError(f"`{event}` for another stream ({message.get('streamSid')!r})")
        if event == "media":
            self._on_media(_section(message, "media"))
        elif event == "mark":
            name = _section(message, "mark").get("name")
            if isinstance(name, str):
                self.marks.echo(name, self.clock.sent_s)
        elif event == "dtmf":
            await self._on_dtmf(_section(message, "dtmf"))
        elif event == "stop":
            return True
        else:
            log.debug("twilio %s: ignoring event %r", self.stream_sid, event)
        return False

    async def _on_start(self, message: dict[str, Any]) -> None:
        if self.stream_sid:
            raise ProtocolError("a second `start` on one stream")
        start = _section(message, "start")
        stream_sid = start.get("streamSid") or message.get("streamSid")
        call_sid = start.get("callSid")
        if not isinstance(stream_sid, str) or not stream_sid or not isinstance(call_sid, str):
            raise ProtocolError("`start` without streamSid/callSid", CLOSE_INVALID_DATA)
        media_format = start.get("mediaFormat") or {}
        if (
            isinstance(media_format, dict)
            and media_format.get("encoding", "audio/x-mulaw") != "audio/x-mulaw"
        ):
            raise ProtocolError(f"unsupported media format {media_format!r}", CLOSE_INVALID_DATA)
        params = start.get("customParameters") or {}
        if not isinstance(params, dict):
            raise ProtocolError("customParameters must be an object", CLOSE_INVALID_DATA)
        persona_name = self.bridge.stream_persona_name(self.ticket, params, call_sid)
        self.stream_sid, self.call_sid = stream_sid, call_sid
        self._messages = OutboundMessages(stream_sid)
        self._last_media = time.monotonic()
        self.record = self.bridge.registry.status(call_sid, "stream-started", persona=persona_name)
        self.record.stream_sid = stream_sid
        self.bridge.registry.live[stream_sid] = self
        # Open the session without holding up the receive loop: prefill can take a while.
        self._opener = asyncio.create_task(self._open_session())

    async def _open_session(self) -> None:
        manager = self.bridge.manager
        try:
            # The persona is the one our webhook reserved the slot for, carried by the ticket.
            self.session = await manager.open(None, ticket=self.ticket)
            await asyncio.wait_for(self.session.ready(), self.settings.ready_timeout_s)
        except TicketError:
            log.warning("twilio %s: the stream's ticket is unknown, used or expired", self.stream_sid)
            self._end("ticket refused", hang_up=True)
            return
        except CapacityError:
            self._end("no free slot", hang_up=True)
            return
        except Exception as exc:  # PersonaError, a prefill timeout or a bug: only this call ends
            log.warning("twilio %s: session could not start: %s", self.stream_sid, exc)
            self._end(f"session failed: {exc}", hang_up=True)
            return
        if self.record is not None:
            self.record.session_id = str(getattr(self.session, "id", ""))
        self.session_ready = True
        self._sender = asyncio.create_task(self._send_loop())

    def _end(self, reason: str, hang_up: bool) -> None:
        """Ends the call for `reason`; from another task this interrupts the receive loop."""
        if self._ended is not None:
            return
        self._ended = CallEnded(reason, hang_up)
        if self._receiving and self._main is not None and asyncio.current_task() is not self._main:
            self._main.cancel()

    def _on_media(self, media: dict[str, Any]) -> None:
        track = media.get("track", "inbound")
        if track not in ("inbound", "inbound_track"):
            return  # only the caller's audio goes to the agent
        payload = media.get("payload")
        if not isinstance(payload, str):
            raise ProtocolError("`media` without a payload", CLOSE_INVALID_DATA)
        try:
            ulaw = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ProtocolError("`media` payload is not valid base64", CLOSE_INVALID_DATA) from None
        if not self._inbound_pace.take(len(ulaw)):  # decoding and resampling are the server's CPU
            raise ProtocolError("caller audio arrives much faster than real time")
        self.frames_in += 1
        self._last_media = time.monotonic()
        chunk = media.get("chunk")
        if isinstance(chunk, str) and chunk.isdigit():
            number = int(chunk)
            if self.last_chunk and number > self.last_chunk + 1:
                self.inbound_gaps += number - self.last_chunk - 1
            self.last_chunk = max(self.last_chunk, number)
        if not self.session_ready:
            self.inbound_dropped += 1
            return
        if not self._cushioned:
            self._cushioned = True
            self.session.push(self.inbound.lead(self._cushion_samples(self.session.seconds_to_next_tick())))
        pcm = self.inbound.feed(ulaw)
        if pcm is not None:
            self.session.push(pcm)

    def _cushion_samples(self, to_tick_s: float | None) -> int:
        """Silence to push ahead of the caller's first message so that, just before each engine
        tick, the session holds one full frame plus `inbound_slack_ms` of audio.

        Messages bring 20 ms each; the ticks come every 80 ms, the next one in `to_tick_s`.
        Before it, this message and floor(to_tick / 20 ms) more will have come. With the
        engine's clock idle (None) this session's first full frame starts it at once, so the
        ticks fall on this message's phase: before each later one the session holds the
        cushion plus the three messages since the last.
        """
        frame_ms, chunk_ms = FRAME_S * 1000, CHUNK_S * 1000
        slack_ms = self.settings.inbound_slack_ms
        if to_tick_s is None:
            cushion_ms = frame_ms + slack_ms
        else:
            to_tick_ms = (to_tick_s * 1000) % frame_ms
            arriving_ms = chunk_ms + chunk_ms * (to_tick_ms // chunk_ms)
            cushion_ms = (frame_ms + slack_ms - arriving_ms) % frame_ms
        return round(cushion_ms * SAMPLE_RATE / 1000)

    async def _on_dtmf(self, dtmf: dict[str, Any]) -> None:
        digit = dtmf.get("digit")
        if not isinstance(digit, str) or len(digit) != 1:
            given = "no `digit`" if digit is None else f"`digit` {json.dumps(digit)[:40]}"
            raise ProtocolError(f"`dtmf` needs one digit, got {given}", CLOSE_INVALID_DATA)
        self.dtmf.append(digit)
        if self.record is not None:
            self.record.events.append((time.time(), f"dtmf:{digit}"))
        log.info("twilio %s: DTMF %s", self.stream_sid, digit)
        if digit in self.settings.hangup_digits:
            raise CallEnded(f"hang-up digit {digit}", hang_up=True)

    # --- the sender -----------------------------------------------------------------------
    async def _send_json(self, message: dict[str, Any]) -> None:
        await self._send_text(json.dumps(message, separators=(",", ":")))

    async def _send_text(self, text: str) -> None:
        # No lock: one task writes at a time (the pacer; `_finish` sends `clear` only after it
        # has cancelled the pacer and waited for it), and uvicorn sends each message whole.
        await self.ws.send_text(text)

    async def _send_chunk(self, chunk: bytes) -> None:
        now = time.monotonic()
        wait = self.clock.wait_before_send(now)
        if wait > 0:
            await asyncio.sleep(wait)
            now = time.monotonic()
        await self._send_text(self._messages.media(chunk))
        self.clock.sent(now, CHUNK_S)
        if self.frames_out:
            self.max_send_gap_s = max(self.max_send_gap_s, now - self._last_send)
        self._last_send = now
        self.frames_out += 1

    async def _read_frames(self) -> None:
        """Session frames -> 20 ms payloads (and a mark per frame) in the local outbound buffer.

        Takes each frame the moment the engine delivers it; the pacer sends from the buffer at
        real time. A buffer grown past
        `max_buffered_ms` (the engine ran ahead) loses its oldest audio: latency stays bounded."""
        session = self.session
        limit = max(1, round(self.settings.max_buffered_ms / 1000 / CHUNK_S))
        try:
            async for out in session.frames():
                self.jitter.frame(time.monotonic())
                chunks = self.outbound.convert(out.pcm)
                self._outbox.extend(chunks)
                self._outbox_chunks += len(chunks)
                self._outbox.append(str(out.index))  # a mark after the frame
                while self._outbox_chunks > limit:
                    if isinstance(self._outbox.popleft(), bytes):
                        self._outbox_chunks -= 1
                        self.out_dropped += 1
                self._outbox_ready.set()
        finally:
            self._frames_done = True
            self._outbox_ready.set()

    async def _send_loop(self) -> None:
        """Paces the local buffer out: a 20 ms message whenever Twilio's buffer has room under the
        target, marks as they come. An empty Twilio buffer is first refilled with the cushion."""
        reader = asyncio.create_task(self._read_frames())
        try:
            while True:
                if not self._outbox:
                    if self._frames_done:
                        break
                    self._outbox_ready.clear()
                    await self._outbox_ready.wait()
                    continue
                item = self._outbox.popleft()
                if isinstance(item, bytes):
                    self._outbox_chunks -= 1
                else:
                    await self._send_text(self._messages.mark(item))
                    self.marks.add(item, self.clock.sent_s)
                    continue
                if self.clock.needs_prime(time.monotonic()):
                    if self.clock.started:
                        # Twilio ran dry: this call's engine frames come later than the cushion
                        # covers. Grow it by a message (up to the limit), like a jitter buffer.
                        self._cushion_chunks = min(self._cushion_chunks + 1, self._max_cushion_chunks)
                        self.clock.target_s = (self._cushion_chunks + 1) * CHUNK_S
                    for _ in range(self._cushion_chunks):
                        await self._send_chunk(SILENCE_CHUNK)
                await self._send_chunk(item)
        except (WebSocketDisconnect, RuntimeError, OSError) as exc:
            # The socket went away under us; the receive loop notices and ends the call.
            self._end(f"socket closed while sending ({type(exc).__name__})", hang_up=False)
            return
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
        reason = getattr(self.session, "close_reason", None) or "session ended"
        self._end(f"session ended: {reason}", hang_up=True)

    # --- the end ---------------------------------------------------------------------------
    async def _finish(self, reason: str, hang_up: bool, close_code: int) -> None:
        for task in (self._opener, self._sender):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if self.session is not None:
            with contextlib.suppress(Exception):
                await self.session.close(reason=session_close_reason(reason))
        connected = self.ws.client_state == WebSocketState.CONNECTED
        if connected and self.stream_sid:
            # Drop whatever Twilio still holds of ours, then hang up before the socket goes.
            with contextlib.suppress(Exception):
                await self._send_json({"event": "clear", "streamSid": self.stream_sid})
                self.clock.cleared(time.monotonic())
                self.marks.drop_all()
        if hang_up and self.call_sid:
            await self.bridge.calls.hang_up_async(self.call_sid)
        if connected:
            with contextlib.suppress(Exception):
                await self.ws.close(code=close_code, reason=reason[:100])
        self.bridge.registry.live.pop(self.stream_sid, None)
        if self.record is not None:
            self.record.end_reason = reason
            self.record.metrics = self.metrics()
            self.bridge.registry.status(self.call_sid, "stream-ended")
        log.info(
            "twilio %s: call %s ended (%s) call_metrics=%s",
            self.stream_sid,
            self.call_sid,
            reason,
            json.dumps(self.metrics(), default=str),
        )

    def metrics(self) -> dict[str, Any]:
        queued_ms = [q * 1000 for q in self.marks.queued_at_ack_s]
        stats = getattr(self.session, "stats", None) if self.session is not None else None
        return {
            "duration_s": round(time.monotonic() - self.started_at, 3),
            "frames_in": self.frames_in,
            "frames_out": self.frames_out,
            "inbound_dropped_before_ready": self.inbound_dropped,
            "inbound_gaps": self.inbound_gaps,
            "late_frames": self.clock.underruns,
            "max_send_gap_ms": round(self.max_send_gap_s * 1000, 1),
            "outbound_dropped": self.out_dropped,
            "playout_cushion_ms": round(self._cushion_chunks * CHUNK_S * 1000),
            "jitter_p50_ms": round(self.jitter.p50_ms(), 2),
            "jitter_p99_ms": round(self.jitter.p99_ms(), 2),
            "max_queued_ms_model": round(self.clock.max_seen_queue_s * 1000, 1),
            "queued_ms_marks_p50": round(percentile(queued_ms, 50), 1),
            "queued_ms_marks_max": round(max(queued_ms, default=0.0), 1),
            "marks_sent": self.marks.sent,
            "marks_acked": self.marks.acked,
            "dtmf": "".join(self.dtmf),
            "session": dict(stats) if isinstance(stats, dict) else None,
        }
