"""One media stream (`/<carrier>/media-stream/<ticket>`, or a carrier's own socket such as
Asterisk's AudioSocket): the life cycle of a call's stream, whatever carries it (link.py).

Per stream run: the receive loop (`run`: the carrier's StreamWire turns each message into an
event; caller audio goes through caller_audio.py), a watchdog (idle and duration limits), the
session opener, then the playout (playout.py: session frames -> paced media and marks). The call
around the stream (its journal, recording, action rules) is a `PhoneCall`. DTMF and the agent's
text go through the call's rules; an action that fires runs in its own task (the carrier's REST
API), never on the audio path.

Whatever ends the stream (the carrier's stop, a limit, the session ending on the server, a DTMF
hang-up digit, an action) goes through `_finish`: close the session (or park it, for a `play`
that resumes), clear the carrier's buffer of ours, give the call its last instructions via REST
when it is still up (hang up, a goodbye, an apology when the engine was lost), say the wire's
farewell where its protocol has one (then let the carrier close its side), close the socket,
finish the call.

Barge-in (where the carrier or PERSONAPLEX_PHONE_BARGE_IN turns it on): each caller message
also goes to the barge-in detector (barge_in.py); a talk spurt that starts while the agent can
still be heard makes the playout drop what it holds. Two different pauses: `FlowControl` (the
carrier asks us to hold OUR audio: Asterisk's MEDIA_XOFF) pauses the playout; `LinePaused` (the
carrier stopped the CALLER's audio on purpose: a hold) suspends the idle limit.

Where no answer webhook comes first (`Carrier.answers_in_stream`: Genesys), the stream's start
is the call's arrival: it is admitted then (`CallServices.admit`: persona, context, a ticket)
and the wire tells the carrier yes or no (`accept` / `refuse`). Wires whose protocol answers
messages (a pong) leave them in `wire.replies`, sent after each message. All of it goes over the
stream's link (link.py), never a socket of its own.

A stream is bound to its call only by its ticket (`_bind`): at its start the ticket in its URL
must be one our answer issued for the call the start names, unredeemed and unexpired (or a parked
call's one-time resume token), and it is redeemed then, before anything is done for that call.
Until then nothing the stream says (call ids, stream ids, parameters) reaches a journal, a
record, the carrier's REST API or an action: a stream refused there is closed (1008) and logged,
nothing more. A stream that ends before its start gives its call's reservation back at once.

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
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from personaplex_voice.engine.base import CapacityError, Persona
from personaplex_voice.session_api import CallSession, MediaMeter, SessionHost, TicketError, slips_warning

from .actions import ActionRule
from .barge_in import BargeIn
from .caller_audio import CallerAudio
from .carrier import (
    CHUNK_MS,
    CLOSE_ERROR,
    CLOSE_INVALID_DATA,
    CLOSE_NORMAL,
    CLOSE_POLICY,
    CLOSE_TOO_BIG,
    CallerMedia,
    CallHandle,
    CallOutcome,
    Carrier,
    Dial,
    Digit,
    FlowControl,
    Hangup,
    LinePaused,
    MarkPlayed,
    Outcome,
    Outgoing,
    Play,
    ProtocolError,
    Redirect,
    Refused,
    Resume,
    Say,
    Step,
    StreamStart,
    StreamStop,
    StreamWire,
)
from .config import PhoneSettings
from .link import LinkClosed, StreamLink
from .metrics import PhoneMetrics
from .personas import DEFAULT_NAME, PersonaBook, PersonaSpec, plain_spec
from .phone_call import CallOutputs, Parking, PhoneCall
from .playout import Playout, SendFailed
from .registry import CallRegistry, StreamTicket

log = logging.getLogger(__name__)

FAREWELL_WAIT_S = 5.0  # after our farewell, how long the carrier may take to close its side
AGENT_SAID_CHARS = 2000  # of the agent's words, what a farewell may carry (the latest)


class CallEnded(Exception):
    """The stream ends for a reason we decided (limits, hang-up digit, session end, an action).

    `hang_up`: end the call via REST; `steps`: give it these instructions instead (a goodbye, an
    apology, a fallback) and hang up only if the carrier refuses them."""

    def __init__(self, reason: str, hang_up: bool, steps: Sequence[Step] | None = None):
        super().__init__(reason)
        self.reason = reason
        self.hang_up = hang_up
        self.steps = list(steps or ())


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
class _Binding:
    """What binding a stream to its call found: the call itself when it comes back from a
    message (parked), else what our answer issued for it (None: another front-end's answer) and
    its session, opened with the ticket (None and `failure` when that failed)."""

    parked: PhoneCall | None = None
    issued: StreamTicket | None = None
    session: CallSession | None = None
    failure: str = ""


@dataclass
class CallServices:
    """What a stream uses of the phone service, and nothing more."""

    settings: PhoneSettings
    manager: Callable[[], SessionHost | None]  # the server's session host (None while the engine loads)
    registry: CallRegistry
    book: PersonaBook
    outputs: CallOutputs
    parking: Parking
    # Streams that are the call's arrival (no answer webhook): admit the call at its start and
    # return its ticket, or raise Refused.
    admit: Callable[[Carrier, StreamStart], Awaitable[str]] | None = None
    metrics: PhoneMetrics | None = None  # the phone call's /metrics (dropped and inserted audio)


def level_db(pcm: np.ndarray | None) -> float:
    """RMS level in dBFS (for the calls page's meters), -90 for silence."""
    if pcm is None or not len(pcm):
        return -90.0
    rms = float(np.sqrt(np.mean(np.square(pcm, dtype=np.float64))))
    return round(max(-90.0, 20 * math.log10(rms)) if rms > 0 else -90.0, 1)


def steps_for(rule: ActionRule, persona: str, resume_token: str | None) -> list[Step]:
    """What a fired rule asks of the carrier (hang-up without words is `CallControl.hang_up`)."""
    if rule.kind == "transfer":
        dial = Dial(rule.to or "", caller_id=rule.caller_id, whisper=rule.whisper, rule=(persona, rule.index))
        return [Say(rule.announce), dial] if rule.announce else [dial]
    if rule.kind == "hangup":
        return [Say(rule.say), Hangup()] if rule.say else [Hangup()]
    if rule.kind == "play":
        steps: list[Step] = []
        if rule.say:
            steps.append(Say(rule.say))
        if rule.play_url:
            steps.append(Play(rule.play_url))
        steps.append(Resume(resume_token, persona) if resume_token else Hangup())
        return steps
    return [Redirect(rule.url or "")]


class PhoneStream:
    def __init__(
        self,
        link: StreamLink,
        ticket: str,
        services: CallServices,
        carrier: Carrier,
        public_base: str,
        wire: StreamWire | None = None,
    ):
        self.link = link
        self.ticket = ticket  # our answer's reservation (or a resume token): the stream URL's last segment
        self.services = services
        self.carrier = carrier
        self.settings = settings = services.settings
        self.public_base = public_base
        self.wire = wire if wire is not None else carrier.new_wire()
        # A carrier that plays our audio on arrival holds nothing: we keep only one message ahead
        # (sending each at its time, give or take the event loop's timer slop).
        on_arrival = bool(getattr(self.wire, "plays_on_arrival", False))
        self.stream_sid = ""
        self.call_sid = ""
        self.handle = CallHandle("")
        self.call: PhoneCall | None = None
        self.session: CallSession | None = None
        self.session_ready = False
        self.caller = CallerAudio(settings.inbound_slack_ms)
        # This call's media-path time (each caller message handled, each agent frame converted),
        # added to the process's headroom (docs/capacity.md).
        host = services.manager()
        self.media = host.headroom.meter() if host is not None else MediaMeter(None)
        self.playout = Playout(
            self._send,
            max_queued_ms=settings.max_queued_ms,
            playout_cushion_ms=CHUNK_MS if on_arrival else settings.playout_cushion_ms,
            max_buffered_ms=settings.max_buffered_ms,
            on_frame=self._on_agent_frame,
            on_sent=self._on_agent_sent,
            meter=self.media,
            on_slip=self._on_slip,
        )
        barge_in = settings.barge_in
        if barge_in is None:
            barge_in = bool(getattr(carrier, "barge_in", False))
        self.barge = BargeIn(settings.barge_in_db) if barge_in else None
        self.dtmf: list[str] = []
        self.started_at = time.monotonic()
        self.last_agent_pcm: np.ndarray | None = None
        self._sender: asyncio.Task[None] | None = None
        self._main: asyncio.Task[Any] | None = None
        self._receiving = False
        self._started = False
        self._opener: asyncio.Task[None] | None = None  # waits for the session's prompt
        self._ended: CallEnded | None = None
        self._actions: set[asyncio.Task[None]] = set()
        self._park_token: str | None = None  # set by a `play … then: resume` that went through
        self._live_key = ""
        self._replies: list[Outgoing] | None = getattr(self.wire, "replies", None)
        self._line_paused = False  # the carrier said it stopped sending the caller's audio
        self._refused = False  # an in-stream admission said no (the wire told the carrier)
        self._start_refused = False  # a start came whose ticket did not bind it to its call

    @property
    def record(self) -> Any:
        return self.call.record if self.call is not None else None

    @property
    def name(self) -> str:
        return self.carrier.name

    # --- the receive loop ---------------------------------------------------------------------
    async def run(self) -> None:
        reason, hang_up, close_code, steps = "stop", False, CLOSE_NORMAL, []
        self._main = asyncio.current_task()
        watchdog = asyncio.create_task(self._watch_limits())
        try:
            await self._receive_loop()
        except ProtocolError as exc:
            log.warning("%s %s: protocol error: %s", self.name, self.stream_sid or "(no stream)", exc)
            reason, close_code = f"protocol error: {exc}", exc.code
        except CallEnded as exc:
            reason, hang_up, steps = exc.reason, exc.hang_up, exc.steps
        except LinkClosed:
            # Carriers that end a stream by closing it (Plivo, Vonage, Asterisk) end the call this way.
            reason = "stop" if self._started and self.carrier.stream_ends_on_close else "socket closed"
        except asyncio.CancelledError:
            if self._ended is None:  # the server is shutting down: not ours to swallow
                raise
            uncancel = getattr(self._main, "uncancel", None)
            if uncancel is not None:
                uncancel()
            ended = self._ended
            reason, hang_up, steps = ended.reason, ended.hang_up, ended.steps
        except Exception:
            log.exception("%s %s: bridge failure", self.name, self.stream_sid)
            reason, hang_up, close_code = "bridge error", True, CLOSE_ERROR
        finally:
            self._receiving = False
            watchdog.cancel()
            await self._finish(reason, hang_up, close_code, steps)

    def _max_call_s(self) -> float:
        spec_limit = self.call.spec.max_call_s if self.call is not None else None
        return min(self.settings.max_call_s, spec_limit or math.inf)

    async def _watch_limits(self) -> None:
        """Ends the call past its limits: no caller audio for `idle_timeout_s` (or no start within
        `stream_connect_timeout_s`), or its length limit in all (then with the persona's goodbye)."""
        while True:
            now = time.monotonic()
            idle_limit = (
                self.settings.idle_timeout_s if self._started else self.settings.stream_connect_timeout_s
            )
            started = self.call.started_at if self.call is not None else self.started_at
            if now - started >= self._max_call_s():
                goodbye = self.call.spec.goodbye if self.call is not None else None
                self._end("max duration", hang_up=True, steps=[Say(goodbye), Hangup()] if goodbye else None)
                return
            if not self._line_paused and now - self.caller.last_media >= idle_limit:
                self._end("idle timeout" if self._started else "no start message", hang_up=True)
                return
            await asyncio.sleep(min(0.5, idle_limit / 4))

    async def _receive_loop(self) -> None:
        # One plain `receive` per message (no timer task each time): limits and a session that
        # ends on the server interrupt it through `_end`.
        self._receiving = True
        limit = self.settings.max_message_bytes
        meter = self.media
        while True:
            if self._ended is not None:
                raise self._ended
            raw = await self.link.receive()
            started = time.perf_counter()  # the media path's time: parsing and handling, no awaits
            size = len(raw.get("text") or raw.get("bytes") or b"")
            if size > limit:
                raise ProtocolError(f"message of {size} bytes exceeds {limit}", CLOSE_TOO_BIG)
            event = self._parse(raw)
            spent = time.perf_counter() - started
            if self._replies:
                await self._send_replies()
            if event is None:
                meter.add(spent)
                continue
            if isinstance(event, StreamStart):
                if self._started:
                    raise ProtocolError("a second start on one stream")
                if not self.ticket:
                    await self._admit(event)
                binding = await self._bind(event)
                if binding.session is not None:
                    self.session = binding.session  # closed by `_finish` whatever happens next
                started = time.perf_counter()
                self._on_start(event, binding)
                meter.add(spent + time.perf_counter() - started)
                continue
            started = time.perf_counter()
            done = self._handle(event)
            meter.add(spent + time.perf_counter() - started)
            if done:
                return

    def _parse(self, raw: Any) -> Any:
        """The wire's event for one message. Input a wire could not read (a number that does not
        fit, text that is not what it claims) is the peer's fault: a ProtocolError (1007), one
        WARNING line, never a traceback."""
        try:
            return self.wire.parse(raw)
        except ProtocolError:
            raise
        except (ValueError, OverflowError, RecursionError) as exc:
            detail = f"{type(exc).__name__}: {str(exc)[:120]}"
            raise ProtocolError(f"unreadable message ({detail})", CLOSE_INVALID_DATA) from None

    async def _send_replies(self) -> None:
        replies = self._replies
        while replies:
            await self._answer(replies.pop(0))

    async def _answer(self, message: Outgoing) -> None:
        """A protocol answer from the receive loop; a socket gone meanwhile is the carrier leaving."""
        try:
            await self._send(message)
        except (LinkClosed, RuntimeError, OSError) as exc:
            raise LinkClosed(CLOSE_NORMAL) from exc

    async def _admit(self, start: StreamStart) -> None:
        """The stream is the call's arrival: admit it now (a ticket), or tell the carrier no."""
        admit = self.services.admit
        if admit is None or not getattr(self.carrier, "answers_in_stream", False):
            raise ProtocolError("a stream without its ticket")
        try:
            self.ticket = await admit(self.carrier, start)
        except Refused as refusal:
            self._refused = True
            refuse = getattr(self.wire, "refuse", None)
            if refuse is not None:
                await self._answer(refuse(refusal.message, refusal.busy))
            raise CallEnded(f"refused: {refusal.message}", hang_up=False) from None
        accept = getattr(self.wire, "accept", None)
        if accept is not None:
            try:
                await self._answer(accept())
            except (LinkClosed, asyncio.CancelledError):
                manager = self.services.manager()  # gone before it heard yes: the slot goes back
                if manager is not None:
                    manager.cancel(self.ticket)
                raise

    def _handle(self, event: Any) -> bool:
        """Dispatch one event (a start is `_bind` and `_on_start`); True when the stream is over."""
        if isinstance(event, StreamStop):
            return True  # before its start too: the caller hung up while it was connecting
        if not self._started:
            raise ProtocolError(f"{type(event).__name__} before the stream started")
        if isinstance(event, CallerMedia):
            self._on_media(event)
        elif isinstance(event, MarkPlayed):
            self.playout.mark_echoed(event.name)
        elif isinstance(event, Digit):
            self._on_dtmf(event.digit)
        elif isinstance(event, FlowControl):
            self.playout.pause(event.paused)  # ours: the carrier asks us to hold off sending
        elif isinstance(event, LinePaused):
            self._on_pause(event.paused)  # the caller's: on hold, the idle limit waits
        return False

    def _on_pause(self, paused: bool) -> None:
        if paused == self._line_paused:
            return
        self._line_paused = paused
        self.caller.last_media = time.monotonic()  # the idle limit counts again from the resume
        log.info("%s %s: the line is %s", self.name, self.stream_sid, "paused" if paused else "resumed")
        self.services.registry.status(self.call_sid, self.name, "paused" if paused else "resumed")

    async def _bind(self, start: StreamStart) -> _Binding:
        """Binds the stream to the call its start names, by its ticket; raises ProtocolError (1008)
        for a ticket that is not one we issued for that call, unredeemed and unexpired: then
        nothing at all is done for the call it names (no record, no REST request, no action).

        A ticket our answer issued in this process for this very call binds the stream even when
        its session then fails to open (the call is ours: it is told goodbye); one issued
        elsewhere (another front-end) binds it only once its session has opened with it."""
        services = self.services
        parked = services.parking.take(self.ticket, start.call_id)
        if parked is not None:  # the same call back from a `play … then: resume`
            return _Binding(parked=parked)
        try:
            issued = services.registry.claim(self.ticket, start.call_id)
        except LookupError:
            self._start_refused = True  # the ticket stays its own call's
            raise ProtocolError("ticket refused: it was issued for another call", CLOSE_POLICY) from None
        manager = services.manager()
        try:
            if manager is None:
                raise TicketError("the engine is not loaded")
            await manager.headroom.arrivals.turn()  # behind the calls in progress (engine/arrivals.py)
            # The persona (its prompt rendered for this call) is the one our answer reserved the
            # slot for, carried by the ticket; the prompt itself goes in while the call starts.
            session = await manager.open(None, ticket=self.ticket)
        except Exception as exc:  # TicketError, CapacityError, PersonaError, EngineError
            if issued is None:
                self._start_refused = True
                why = "unknown, used or expired" if isinstance(exc, TicketError) else f"no session ({exc})"
                raise ProtocolError(f"ticket refused: {why}", CLOSE_POLICY) from None
            if isinstance(exc, TicketError):
                failure = "ticket refused"  # e.g. the worker holding it found itself full meanwhile
            elif isinstance(exc, CapacityError):
                failure = "no free slot"
            else:
                failure = f"session failed: {exc}"
            return _Binding(issued=issued, failure=failure)
        return _Binding(issued=issued, session=session)

    def _on_start(self, start: StreamStart, binding: _Binding) -> None:
        """The stream is bound (`_bind`): the call is set up, its session started."""
        services = self.services
        registry = services.registry
        issued = binding.issued
        call = binding.parked
        if call is not None:
            call.new_stream(start.stream_id)
            registry.status(start.call_id, self.name, "stream-resumed")
        else:
            params = dict(start.params)
            persona_name = issued.persona_name if issued is not None else params.get("persona", "")
            journal = registry.status(start.call_id, self.name, "stream-started", persona=persona_name)
            # Which values filled the prompt: known here when our answer ran in this process,
            # else the flow's own (carried as parameters; a context lookup's are in the prompt).
            variables = (
                issued.variables
                if issued is not None
                else {k: v for k, v in params.items() if k != "persona"}
            )
            call = PhoneCall(
                self._spec(persona_name),
                journal,
                services.outputs,
                self.public_base,
                stream_id=start.stream_id,
                variables=variables,
                caller_rate=start.inbound.rate,
                agent_rate=start.outbound.rate,
            )
        self.call = call
        self._started = True
        self.stream_sid, self.call_sid = start.stream_id, start.call_id
        facts = issued.facts if issued is not None else None
        self.handle = CallHandle(
            start.call_id,
            control_id=start.control_id,
            account=start.account or getattr(facts, "account", ""),
            public_base=self.public_base,
        )
        call.handle = self.handle
        self.caller.set_format(start.inbound)
        self.playout.start_stream(self.wire, start.outbound)
        self.caller.last_media = time.monotonic()
        call.journal.set_metrics(
            {"audio_in": start.inbound.describe(), "audio_out": start.outbound.describe()}
        )
        self._live_key = start.stream_id or self.ticket
        registry.live[self._live_key] = self
        if call.session is not None:
            self.session, self.session_ready = call.session, True
            self._sender = asyncio.create_task(self._send_loop())
        elif binding.failure:
            log.warning("%s %s: %s", self.name, self.stream_sid, binding.failure)
            self._end(binding.failure, hang_up=True)
        else:
            # The prompt goes in without holding up the receive loop: prefill can take a while.
            self._opener = asyncio.create_task(self._until_ready())

    def _spec(self, persona_name: str) -> PersonaSpec:
        spec = self.services.book.specs.get(persona_name)
        if spec is None:  # a one-off persona, or a personas file another front-end has
            spec = plain_spec(persona_name or DEFAULT_NAME, Persona())
        return spec

    async def _until_ready(self) -> None:
        session = self.session
        assert session is not None
        try:
            await asyncio.wait_for(session.ready(), self.settings.ready_timeout_s)
        except Exception as exc:  # PersonaError, a prefill timeout or a bug: only this call ends
            log.warning("%s %s: session could not start: %s", self.name, self.stream_sid, exc)
            self._end(f"session failed: {exc}", hang_up=True)
            return
        if self.call is not None:
            self.call.session_started(session)
        self.session_ready = True
        self._sender = asyncio.create_task(self._send_loop())

    def _end(self, reason: str, hang_up: bool, steps: Sequence[Step] | None = None) -> None:
        """Ends the stream for `reason`; from another task this interrupts the receive loop."""
        if self._ended is not None:
            return
        self._ended = CallEnded(reason, hang_up, steps)
        if self._receiving and self._main is not None and asyncio.current_task() is not self._main:
            self._main.cancel()

    def _on_media(self, media: CallerMedia) -> None:
        self.caller.feed(media.payload, media.chunk, self.session if self.session_ready else None)
        call = self.call
        barge = self.barge if self.session_ready else None
        pcm = None
        if barge is not None or (call is not None and call.records_audio):
            pcm = self.caller.inbound.decode(media.payload)
        if barge is not None and pcm is not None:
            seconds = len(pcm) / self.caller.format.rate
            if barge.feed(pcm, seconds) and self.playout.audible(self.caller.last_media):
                barge.fired()
                self.playout.barge_in()
                log.info("%s %s: barge-in: the caller talks over the agent", self.name, self.stream_sid)
        if call is not None:
            call.caller_media(pcm if call.records_audio else None, media.chunk, self.caller.last_media)

    def _on_dtmf(self, digit: str) -> None:
        self.dtmf.append(digit)
        log.info("%s %s: DTMF %s", self.name, self.stream_sid, digit)
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

    def _on_slip(self, dropped: bool, reason: str, seconds: float) -> None:
        metrics = self.services.metrics
        if metrics is not None:
            (metrics.audio_dropped if dropped else metrics.audio_inserted).inc(seconds, label=reason)

    def _on_agent_sent(self, chunk: bytes, plays_at: float) -> None:
        if self.call is not None and self.call.records_audio:
            self.call.agent_sent(self.playout.outbound.decode(chunk), plays_at)

    async def _send(self, message: Outgoing) -> None:
        # No lock: one task writes at a time (the pacer; `_finish` sends `clear` only after it
        # has cancelled the pacer and waited for it), and each link sends a message whole.
        await self.link.send(message)

    async def _send_loop(self) -> None:
        try:
            await self.playout.run(self.session)
        except SendFailed as exc:
            # The socket went away under us; the receive loop notices and ends the call.
            self._end(f"socket closed while sending ({exc})", hang_up=False)
            return
        reason = getattr(self.session, "close_reason", None) or "session ended"
        if reason == "engine_lost":
            # The engine serving this call is gone: an apology (or the carrier's fallback).
            steps = self.carrier.engine_lost(self.settings.engine_lost_message)
            self._end("session ended: engine_lost", hang_up=True, steps=steps)
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
        control = self.carrier.control
        resume_token = Parking.new_token() if rule.kind == "play" and rule.then == "resume" else None
        if rule.kind == "hangup" and not rule.say:
            outcome = await control.hang_up(self.handle)
        else:
            outcome = await control.instruct(self.handle, steps_for(rule, call.spec.name, resume_token))
        call.log_action(rule, trigger, outcome.ok, outcome.detail)
        if self._ended is not None:
            return
        if outcome.ok or rule.kind == "hangup":
            # The carrier follows the new instructions (this stream stops); a hang-up that it
            # refused still ends the call: with our stream gone, it has nothing left.
            self._park_token = resume_token if outcome.ok else None
            self._end(f"action {rule.describe()} ({trigger})", hang_up=False)

    # --- the end ---------------------------------------------------------------------------
    async def _finish(self, reason: str, hang_up: bool, close_code: int, steps: list[Step]) -> None:
        for task in (self._opener, self._sender, *self._actions):
            if task is not None and not task.done() and task is not asyncio.current_task():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        call = self.call
        if call is None:
            await self._finish_unbound(reason, close_code)
            return
        parked = False
        if self._park_token and self.session_ready and not self.session.closed:
            self.services.parking.park(self._park_token, call)  # the session waits for the caller
            parked = True
        elif self.session is not None:
            with contextlib.suppress(Exception):
                await self.session.close(reason=session_close_reason(reason))
        connected = self.link.open
        if connected and self._started:
            # Drop whatever the carrier still holds of ours, then hang up before the socket goes.
            with contextlib.suppress(Exception):
                clear = self.wire.clear()
                if clear is not None:
                    await self._send(clear)
                    self.playout.cleared()
        # The call's last instructions: only ever for the call the ticket bound this stream to.
        control = self.carrier.control
        if self.call_sid and steps:
            outcome: Outcome = await control.instruct(self.handle, steps)
            if not outcome.ok and hang_up:
                await control.hang_up(self.handle)
        elif hang_up and self.call_sid:
            await control.hang_up(self.handle)
        if connected:
            await self._farewell(reason)
        self.services.registry.live.pop(self._live_key, None)
        metrics = self.metrics()
        # Before the socket closes: whoever saw the call end finds its record.
        call.journal.set_metrics(metrics)
        self.services.registry.status(self.call_sid, self.name, "stream-ended")
        if not parked:
            await call.finish(reason, metrics)
        if connected:
            await self.link.close(close_code, reason)
        log.info(
            "%s %s: call %s ended (%s) call_metrics=%s",
            self.name,
            self.stream_sid,
            self.call_sid,
            reason,
            json.dumps(metrics, default=str),
        )
        warning = slips_warning(metrics["dropped_ms"], metrics["inserted_ms"])
        if warning:
            log.warning("%s %s: call %s %s", self.name, self.stream_sid, self.call_sid, warning)

    async def _finish_unbound(self, reason: str, close_code: int) -> None:
        """The end of a stream that never bound to a call: nothing was done for any call and
        nothing is now (no REST request, no record). Its ticket's reservation goes back at once
        (the carrier retries or gives up; a replayed answer webhook still gets the same answer
        while the ticket lasts), unless a start was refused: that ticket is not its to give back."""
        if self.session is not None:  # its call could not be set up: the session must not outlive it
            with contextlib.suppress(Exception):
                await self.session.close(reason=session_close_reason(reason))
        if self.ticket and not self._start_refused:
            manager = self.services.manager()
            released = manager is not None and manager.cancel(self.ticket)
            self.services.registry.spend(self.ticket)
            if released:
                log.info(
                    "%s: a stream ended before its start: its call's reservation is free again", self.name
                )
        if self.link.open:
            await self._farewell(reason)
            await self.link.close(close_code, reason)
        log.info("%s: a stream ended before its start (%s)", self.name, reason)

    async def _farewell(self, reason: str) -> None:
        """The wire's last words, where its protocol has them (Genesys's `disconnect`), then what
        the carrier says until it closes its side (its `close`, answered), a few seconds at most."""
        farewell = getattr(self.wire, "farewell", None)
        if farewell is None or not (self._started or self._refused):
            return
        with contextlib.suppress(Exception):
            messages = farewell(CallOutcome(reason, self._agent_said())) if self._started else []
            for message in messages:
                await self._send(message)
            if messages or self._refused:
                await asyncio.wait_for(self._until_carrier_closes(), FAREWELL_WAIT_S)

    async def _until_carrier_closes(self) -> None:
        limit = self.settings.max_message_bytes
        while True:
            try:
                raw = await self.link.receive()
            except LinkClosed:
                return
            if len(raw.get("text") or raw.get("bytes") or b"") > limit:
                return
            event = self._parse(raw)
            if self._replies:
                await self._send_replies()
            if isinstance(event, StreamStop):
                return

    def _agent_said(self) -> str:
        record = self.record
        if record is None:
            return ""
        pieces = [str(p.get("text", "")) for p in record.transcript[-1000:]]
        return " ".join("".join(pieces).split())[-AGENT_SAID_CHARS:]

    # --- what the call list and the calls page show ----------------------------------------
    def metrics(self) -> dict[str, Any]:
        stats = getattr(self.session, "stats", None) if self.session is not None else None
        duration = time.monotonic() - self.started_at
        dropped, inserted = self.slips(stats if isinstance(stats, dict) else None)
        return {
            "duration_s": round(duration, 3),
            **self.caller.metrics(),
            **self.playout.metrics(),
            **self.media.summary(duration),
            "dropped_ms": dropped,
            "inserted_ms": inserted,
            "dtmf": "".join(self.dtmf),
            "session": dict(stats) if isinstance(stats, dict) else None,
        }

    def slips(self, stats: dict[str, Any] | None) -> tuple[dict[str, float], dict[str, float]]:
        """Audio this call lost, and silence put in it, to keep the clock (ms by reason): the
        session's (engine side) and this stream's (its playout; caller audio past the early bound)."""
        dropped = {k: float(v) for k, v in ((stats or {}).get("dropped_ms") or {}).items()}
        inserted = {k: float(v) for k, v in ((stats or {}).get("inserted_ms") or {}).items()}
        dropped["playout_overflow"] = self.playout.dropped_ms
        dropped["early_audio"] = float(self.caller.dropped * CHUNK_MS)
        inserted["playout_underrun"] = self.playout.inserted_ms
        return dropped, inserted

    def live_view(self) -> dict[str, Any]:
        record = self.record
        started = self.call.started_at if self.call is not None else self.started_at
        return {
            "call_sid": self.call_sid,
            "carrier": self.name,
            "stream_sid": self.stream_sid,
            "persona": getattr(record, "persona", ""),
            "from": getattr(record, "from_", ""),
            "to": getattr(record, "to", ""),
            "audio": self.caller.format.describe(),
            "duration_s": round(time.monotonic() - started, 1),
            "caller_level_db": level_db(self.caller.last_pcm),
            "agent_level_db": level_db(self.last_agent_pcm),
            "transcript_pieces": len(record.transcript) if record is not None else 0,
            "actions": len(record.actions) if record is not None else 0,
            "recording": bool(getattr(record, "recording", False)),
            **self._slip_totals(),
            **self.media.summary(time.monotonic() - self.started_at),
        }

    def _slip_totals(self) -> dict[str, float]:
        stats = getattr(self.session, "stats", None) if self.session is not None else None
        dropped, inserted = self.slips(stats if isinstance(stats, dict) else None)
        return {
            "dropped_ms": round(sum(dropped.values()), 1),
            "inserted_ms": round(sum(inserted.values()), 1),
        }
