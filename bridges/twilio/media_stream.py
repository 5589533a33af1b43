"""One Media Stream on `/twilio/media-stream/<ticket>`: the life cycle of a call's stream.

Per stream run: the receive loop (`run`: parsing with wire.py, caller audio with caller_audio.py),
a watchdog (idle and duration limits), the session opener, then the playout (playout.py: session
frames -> paced `media`/`mark`). The call around the stream (its record, recording, action rules)
is a `PhoneCall`. DTMF and the agent's text go through the call's rules; an action that fires
runs in its own task (a REST call update), never on the audio path.

Whatever ends the stream (`stop`, a limit, the session ending on the server, a DTMF hang-up
digit, an action) goes through `_finish`: close the session (or park it, for a `play` that
resumes), `clear` Twilio's buffer, give the call its last instructions via REST when it is still
up (hang up, a goodbye, an apology when the engine was lost), close the socket, finish the call.

Anything malformed closes this call's socket and frees its slot; nothing here can block another
call (every wait is bounded, every queue is bounded).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import numpy as np
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from personaplex_voice.engine.base import CapacityError, Persona
from personaplex_voice.session_api import CallSession, SessionHost, TicketError

from . import twiml
from .actions import ActionRule
from .caller_audio import CallerAudio
from .calls import WHISPER_PATH, CallControl, voice_webhook_url
from .config import TwilioSettings
from .personas import DEFAULT_NAME, PersonaBook, PersonaSpec, plain_spec
from .phone_call import CallOutputs, Parking, PhoneCall
from .playout import Playout, SendFailed
from .registry import CallRegistry
from .wire import (
    CLOSE_ERROR,
    CLOSE_NORMAL,
    ProtocolError,
    dtmf_digit,
    is_caller_track,
    mark_name,
    media_chunk,
    media_payload,
    parse_message,
    parse_start,
    section,
)

log = logging.getLogger(__name__)


class CallEnded(Exception):
    """The stream ends for a reason we decided (limits, hang-up digit, session end, an action).

    `hang_up`: end the call via REST; `twiml` / `url`: give it these instructions instead (a
    goodbye, an apology, a fallback) and hang up only if Twilio refuses them."""

    def __init__(self, reason: str, hang_up: bool, twiml: str | None = None, url: str | None = None):
        super().__init__(reason)
        self.reason = reason
        self.hang_up = hang_up
        self.twiml = twiml
        self.url = url


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


@dataclass
class CallServices:
    """What a stream uses of the bridge, and nothing more."""

    settings: TwilioSettings
    manager: Callable[[], SessionHost | None]  # the server's session host (None while the engine loads)
    registry: CallRegistry
    control: CallControl
    book: PersonaBook
    outputs: CallOutputs
    parking: Parking


def level_db(pcm: np.ndarray | None) -> float:
    """RMS level in dBFS (for the calls page's meters), -90 for silence."""
    if pcm is None or not len(pcm):
        return -90.0
    rms = float(np.sqrt(np.mean(np.square(pcm, dtype=np.float64))))
    return round(max(-90.0, 20 * math.log10(rms)) if rms > 0 else -90.0, 1)


class MediaStreamCall:
    def __init__(self, ws: WebSocket, ticket: str, services: CallServices, public_base: str):
        self.ws = ws
        self.ticket = ticket  # our webhook's reservation (or a resume token), the Stream URL's last segment
        self.services = services
        self.settings = settings = services.settings
        self.public_base = public_base
        self.stream_sid = ""
        self.call_sid = ""
        self.call: PhoneCall | None = None
        self.session: CallSession | None = None
        self.session_ready = False
        self.caller = CallerAudio(settings.inbound_slack_ms)
        self.playout = Playout(
            self._send_text,
            max_queued_ms=settings.max_queued_ms,
            playout_cushion_ms=settings.playout_cushion_ms,
            max_buffered_ms=settings.max_buffered_ms,
            on_frame=self._on_agent_frame,
            on_sent=self._on_agent_sent,
        )
        self.dtmf: list[str] = []
        self.started_at = time.monotonic()
        self.last_agent_pcm: np.ndarray | None = None
        self._sender: asyncio.Task[None] | None = None
        self._main: asyncio.Task[Any] | None = None
        self._receiving = False
        self._opener: asyncio.Task[None] | None = None
        self._ended: CallEnded | None = None
        self._actions: set[asyncio.Task[None]] = set()
        self._park_token: str | None = None  # set by a `play … then: resume` that went through

    @property
    def record(self) -> Any:
        return self.call.record if self.call is not None else None

    # --- the receive loop ---------------------------------------------------------------
    async def run(self) -> None:
        reason, hang_up, close_code = "stop", False, CLOSE_NORMAL
        twiml_text = url = None
        self._main = asyncio.current_task()
        watchdog = asyncio.create_task(self._watch_limits())
        try:
            await self._receive_loop()
        except ProtocolError as exc:
            log.warning("twilio %s: protocol error: %s", self.stream_sid or "(no stream)", exc)
            reason, close_code = f"protocol error: {exc}", exc.code
        except CallEnded as exc:
            reason, hang_up, twiml_text, url = exc.reason, exc.hang_up, exc.twiml, exc.url
        except WebSocketDisconnect:
            reason = "socket closed"
        except asyncio.CancelledError:
            if self._ended is None:  # the server is shutting down: not ours to swallow
                raise
            uncancel = getattr(self._main, "uncancel", None)
            if uncancel is not None:
                uncancel()
            ended = self._ended
            reason, hang_up, twiml_text, url = ended.reason, ended.hang_up, ended.twiml, ended.url
        except Exception:
            log.exception("twilio %s: bridge failure", self.stream_sid)
            reason, hang_up, close_code = "bridge error", True, CLOSE_ERROR
        finally:
            self._receiving = False
            watchdog.cancel()
            await self._finish(reason, hang_up, close_code, twiml_text, url)

    def _max_call_s(self) -> float:
        spec_limit = self.call.spec.max_call_s if self.call is not None else None
        return min(self.settings.max_call_s, spec_limit or math.inf)

    async def _watch_limits(self) -> None:
        """Ends the call past its limits: no caller audio for `idle_timeout_s` (or no `start` within
        `stream_connect_timeout_s`), or its length limit in all (then with the persona's goodbye)."""
        while True:
            now = time.monotonic()
            idle_limit = (
                self.settings.idle_timeout_s if self.stream_sid else self.settings.stream_connect_timeout_s
            )
            started = self.call.started_at if self.call is not None else self.started_at
            if now - started >= self._max_call_s():
                goodbye = self.call.spec.goodbye if self.call is not None else None
                self._end(
                    "max duration", hang_up=True, twiml=twiml.say_and_hang_up(goodbye) if goodbye else None
                )
                return
            if now - self.caller.last_media >= idle_limit:
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
            self._on_start(message)
            return False
        if not self.stream_sid:
            raise ProtocolError(f"`{event}` before `start`")
        if message.get("streamSid") != self.stream_sid:
            raise ProtocolError(f"`{event}` for another stream ({message.get('streamSid')!r})")
        if event == "media":
            self._on_media(section(message, "media"))
        elif event == "mark":
            name = mark_name(section(message, "mark"))
            if name is not None:
                self.playout.mark_echoed(name)
        elif event == "dtmf":
            self._on_dtmf(dtmf_digit(section(message, "dtmf")))
        elif event == "stop":
            return True
        else:
            log.debug("twilio %s: ignoring event %r", self.stream_sid, event)
        return False

    def _on_start(self, message: dict[str, Any]) -> None:
        if self.stream_sid:
            raise ProtocolError("a second `start` on one stream")
        start = parse_start(message)
        services = self.services
        call = services.parking.take(self.ticket, start.call_sid)
        if call is not None:  # the same call back from a `play … then: resume`
            call.new_stream()
            services.registry.status(start.call_sid, "stream-resumed")
        else:
            try:
                issued = services.registry.claim(self.ticket, start.call_sid)
            except LookupError:
                raise ProtocolError("the stream ticket belongs to another call") from None
            params = start.custom_parameters
            persona_name = issued.persona_name if issued is not None else params.get("persona", "")
            record = services.registry.status(start.call_sid, "stream-started", persona=persona_name)
            # Which values filled the prompt: known here when our webhook ran in this process,
            # else the flow's own (carried as <Parameter>s; a context lookup's are in the prompt).
            record.variables = (
                issued.variables
                if issued is not None
                else {k: v for k, v in params.items() if k != "persona"}
            )
            call = PhoneCall(self._spec(persona_name), record, services.outputs, self.public_base)
        self.call = call
        self.stream_sid, self.call_sid = start.stream_sid, start.call_sid
        self.playout.start_stream(start.stream_sid)
        self.caller.last_media = time.monotonic()
        call.record.stream_sid = start.stream_sid
        services.registry.live[start.stream_sid] = self
        if call.session is not None:
            self.session, self.session_ready = call.session, True
            self._sender = asyncio.create_task(self._send_loop())
        else:
            # Open the session without holding up the receive loop: prefill can take a while.
            self._opener = asyncio.create_task(self._open_session())

    def _spec(self, persona_name: str) -> PersonaSpec:
        spec = self.services.book.specs.get(persona_name)
        if spec is None:  # a one-off persona, or a personas file another front-end has
            spec = plain_spec(persona_name or DEFAULT_NAME, Persona())
        return spec

    async def _open_session(self) -> None:
        manager = self.services.manager()
        try:
            # The persona (its prompt rendered for this call) is the one our webhook reserved
            # the slot for, carried by the ticket.
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
        if self.call is not None:
            self.call.session_started(self.session)
        self.session_ready = True
        self._sender = asyncio.create_task(self._send_loop())

    def _end(self, reason: str, hang_up: bool, twiml: str | None = None, url: str | None = None) -> None:
        """Ends the stream for `reason`; from another task this interrupts the receive loop."""
        if self._ended is not None:
            return
        self._ended = CallEnded(reason, hang_up, twiml, url)
        if self._receiving and self._main is not None and asyncio.current_task() is not self._main:
            self._main.cancel()

    def _on_media(self, media: dict[str, Any]) -> None:
        if not is_caller_track(media):
            return  # only the caller's audio goes to the agent
        ulaw = media_payload(media)
        chunk = media_chunk(media)
        self.caller.feed(ulaw, chunk, self.session if self.session_ready else None)
        if self.call is not None:
            self.call.caller_media(ulaw, chunk, self.caller.last_media)

    def _on_dtmf(self, digit: str) -> None:
        self.dtmf.append(digit)
        log.info("twilio %s: DTMF %s", self.stream_sid, digit)
        rules = self.call.dtmf(digit) if self.call is not None else []
        if digit in self.settings.hangup_digits:
            raise CallEnded(f"hang-up digit {digit}", hang_up=True)
        for rule in rules:
            self._act(rule, f"dtmf {digit}")

    # --- the agent's side (called by the playout's tasks) ---------------------------------
    def _on_agent_frame(self, out: Any) -> None:
        self.last_agent_pcm = out.pcm
        if out.text and self.call is not None:
            for rule, phrase in self.call.agent_text(out.text, out.index, time.monotonic()):
                self._act(rule, f"agent said {phrase!r}")

    def _on_agent_sent(self, chunk: bytes, plays_at: float) -> None:
        if self.call is not None:
            self.call.agent_sent(chunk, plays_at)

    async def _send_text(self, text: str) -> None:
        # No lock: one task writes at a time (the pacer; `_finish` sends `clear` only after it
        # has cancelled the pacer and waited for it), and uvicorn sends each message whole.
        await self.ws.send_text(text)

    async def _send_loop(self) -> None:
        try:
            await self.playout.run(self.session)
        except SendFailed as exc:
            # The socket went away under us; the receive loop notices and ends the call.
            self._end(f"socket closed while sending ({exc})", hang_up=False)
            return
        reason = getattr(self.session, "close_reason", None) or "session ended"
        if reason == "engine_lost":
            # The engine serving this call is gone: an apology (or the configured fallback).
            fallback = self.settings.engine_lost_twiml
            if fallback.startswith(("http://", "https://")):
                self._end("session ended: engine_lost", hang_up=True, url=fallback)
            else:
                apology = fallback or twiml.say_and_hang_up(self.settings.engine_lost_message)
                self._end("session ended: engine_lost", hang_up=True, twiml=apology)
            return
        self._end(f"session ended: {reason}", hang_up=True)

    # --- actions ----------------------------------------------------------------------------
    def _act(self, rule: ActionRule, trigger: str) -> None:
        if self._ended is not None:
            return
        task = asyncio.get_running_loop().create_task(self._run_action(rule, trigger))
        self._actions.add(task)
        task.add_done_callback(self._actions.discard)

    async def _run_action(self, rule: ActionRule, trigger: str) -> None:
        if rule.after_s:
            await asyncio.sleep(rule.after_s)
        call = self.call
        if self._ended is not None or call is None:
            return
        control = self.services.control
        resume_token = None
        if rule.kind == "transfer":
            whisper_url = None
            if rule.whisper:
                query = urlencode({"persona": call.spec.name, "rule": rule.index})
                whisper_url = f"{self.public_base}{WHISPER_PATH}?{query}"
            instructions = twiml.transfer(
                rule.to or "", announce=rule.announce, whisper_url=whisper_url, caller_id=rule.caller_id
            )
            ok = await control.update_async(self.call_sid, twiml=instructions)
        elif rule.kind == "hangup":
            if rule.say:
                ok = await control.update_async(self.call_sid, twiml=twiml.say_and_hang_up(rule.say))
            else:
                ok = await control.hang_up_async(self.call_sid)
        elif rule.kind == "play":
            resume_url = None
            if rule.then == "resume":
                resume_token = Parking.new_token()
                resume_url = voice_webhook_url(self.public_base, call.spec.name, resume=resume_token)
            instructions = twiml.play_then(rule.say, rule.play_url, resume_url=resume_url)
            ok = await control.update_async(self.call_sid, twiml=instructions)
        else:  # redirect
            ok = await control.update_async(self.call_sid, url=rule.url)
        call.log_action(rule, trigger, ok)
        if self._ended is not None:
            return
        if ok or rule.kind == "hangup":
            # Twilio follows the new instructions (this stream stops); a hang-up that Twilio
            # refused still ends the call: with our stream gone, its TwiML has nothing left.
            self._park_token = resume_token if ok else None
            self._end(f"action {rule.describe()} ({trigger})", hang_up=False)

    # --- the end ---------------------------------------------------------------------------
    async def _finish(
        self, reason: str, hang_up: bool, close_code: int, twiml_text: str | None, url: str | None
    ) -> None:
        for task in (self._opener, self._sender, *self._actions):
            if task is not None and not task.done() and task is not asyncio.current_task():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        parked = False
        call = self.call
        if self._park_token and call is not None and self.session_ready and not self.session.closed:
            self.services.parking.park(self._park_token, call)  # the session waits for the caller
            parked = True
        elif self.session is not None:
            with contextlib.suppress(Exception):
                await self.session.close(reason=session_close_reason(reason))
        connected = self.ws.client_state == WebSocketState.CONNECTED
        if connected and self.stream_sid:
            # Drop whatever Twilio still holds of ours, then hang up before the socket goes.
            with contextlib.suppress(Exception):
                await self._send_text(self.playout.messages.clear())
                self.playout.cleared()
        control = self.services.control
        if self.call_sid and (twiml_text or url):
            if not await control.update_async(self.call_sid, twiml=twiml_text, url=url) and hang_up:
                await control.hang_up_async(self.call_sid)
        elif hang_up and self.call_sid:
            await control.hang_up_async(self.call_sid)
        self.services.registry.live.pop(self.stream_sid, None)
        metrics = self.metrics()
        if call is not None:  # before the socket closes: whoever saw the call end finds its record
            call.record.metrics = metrics
            self.services.registry.status(self.call_sid, "stream-ended")
            if not parked:
                await call.finish(reason, metrics)
        if connected:
            with contextlib.suppress(Exception):
                await self.ws.close(code=close_code, reason=reason[:100])
        log.info(
            "twilio %s: call %s ended (%s) call_metrics=%s",
            self.stream_sid,
            self.call_sid,
            reason,
            json.dumps(metrics, default=str),
        )

    # --- what the call list and the calls page show ----------------------------------------
    def metrics(self) -> dict[str, Any]:
        stats = getattr(self.session, "stats", None) if self.session is not None else None
        return {
            "duration_s": round(time.monotonic() - self.started_at, 3),
            **self.caller.metrics(),
            **self.playout.metrics(),
            "dtmf": "".join(self.dtmf),
            "session": dict(stats) if isinstance(stats, dict) else None,
        }

    def live_view(self) -> dict[str, Any]:
        record = self.record
        started = self.call.started_at if self.call is not None else self.started_at
        return {
            "call_sid": self.call_sid,
            "stream_sid": self.stream_sid,
            "persona": getattr(record, "persona", ""),
            "from": getattr(record, "from_", ""),
            "to": getattr(record, "to", ""),
            "duration_s": round(time.monotonic() - started, 1),
            "caller_level_db": level_db(self.caller.last_pcm),
            "agent_level_db": level_db(self.last_agent_pcm),
            "transcript_pieces": len(record.transcript) if record is not None else 0,
            "actions": len(record.actions) if record is not None else 0,
            "recording": bool(getattr(record, "recording", False)),
        }
