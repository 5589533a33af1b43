"""`DuplexSession`: one LiveKit conversation with PersonaPlex, on a backend session.

LiveKit's `DuplexRealtimeAdapter` runs it inside an `AgentSession`: it pushes the caller's audio
(`push_audio`), reads the model's output as one continuous stream (`audio_stream`: every 80 ms
frame, the model's own silence included, stamped on the model's timeline) and listens for
`transcript_delta` (each text piece, its span on the same timeline), `function_call` (a persona
action rule fired: see tool_rules.py), `session_reconnected`, `metrics_collected` and `error`.

The backend session is opened once the adapter has configured this one (the agent's
instructions are the persona's text prompt): from then on the caller's audio goes to it; before
that, and while a lost session is reopened, it waits in an `EarlyAudio` (bounded) and follows
in order, so the caller's first words reach the model. A session lost mid-call is reopened with
backoff (a new persona prompt: the conversation so far is lost, as `session_reconnected` says);
a refusal that retrying cannot fix ends it with an unrecoverable error (LiveKit closes the
`AgentSession`); a full or loading server is retried with the same backoff.

Anything else that goes wrong (a bug, a backend that raises what it should not) is reported
once as an unrecoverable `error` naming the cause, as LiveKit's own realtime plugins do
(livekit/plugins/nvidia/experimental/realtime/realtime_model.py turns its connection task's
exceptions into a `RealtimeModelError`): the `AgentSession` then closes
(voice/agent_session.py, `_on_error`) instead of staying up with a mute agent.

The caller's speech is watched by silero-vad (`personaplex_backends.CallerSpeech`) and reported
as `input_speech_started` / `input_speech_stopped`: with its default VAD, LiveKit takes the
caller's `user_state` from these events alone (voice/agent_activity.py,
`_on_input_speech_started`), so a caller who talks is "speaking", not "away". They never
interrupt the agent: the adapter declares overlapping speech, and the model takes its own turns.

Timing and usage go out as LiveKit's `RealtimeModelMetrics` (metrics.py).

`personaplex_frame` (`AgentFrameEvent`) carries each frame's index, timeline position, float
PCM, text and tokens (in process, on the real model), for apps and tests that want them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from personaplex_backends import (
    AgentFrame,
    BackendSession,
    BackendUnavailable,
    CallerSpeech,
    EarlyAudio,
    SessionLost,
    SessionRefused,
)

from livekit import rtc
from livekit.agents import APIConnectionError, APIError, APIStatusError, llm, utils
from livekit.agents.metrics.base import Metadata
from livekit.agents.types import NOT_GIVEN, NotGivenOr
from personaplex_voice.engine.base import FRAME_SIZE, SAMPLE_RATE, Persona

from .audio import InputAudio, output_frame
from .metrics import SessionMeter
from .tool_rules import ToolCall, ToolRules

if TYPE_CHECKING:
    from .model import DuplexModel

log = logging.getLogger("personaplex_livekit")

FRAME_MS = FRAME_SIZE * 1000 // SAMPLE_RATE  # 80
# Refusals that say "later", not "no": retried with the model's backoff.
TRANSIENT_REFUSALS = frozenset({"capacity", "queue_full", "saturated", "loading"})
# A session that lived this long before it was lost starts the backoff over.
STABLE_S = 30.0


@dataclass(frozen=True)
class AgentFrameEvent:
    """One 80 ms frame of the model's output (the `personaplex_frame` event)."""

    index: int  # 0, 1, 2... over the whole LiveKit session, reconnects included
    start_ms: int  # on the model timeline the audio stream and transcript deltas are stamped on
    pcm: np.ndarray  # float32 [1920] at 24 kHz, as the model made it
    text: str | None
    tokens: np.ndarray | None  # the frame's text and audio tokens, when the backend sees them


class DuplexSession(llm.DuplexSession[Literal["personaplex_frame"]]):
    def __init__(self, duplex_model: DuplexModel) -> None:
        super().__init__(duplex_model)
        self._model = duplex_model
        # the persona's text prompt: the model's `instructions=` until the agent gives its own
        self._instructions = duplex_model.default_instructions or ""
        self._tools = llm.ToolContext.empty()
        self._rules = ToolRules(duplex_model.actions, duplex_model.tool_names)
        self._audio_ch = utils.aio.Chan[llm.DuplexAudioFrame]()
        self._input = InputAudio()
        self._early = EarlyAudio()
        self._backend_session: BackendSession | None = None
        self._restart = False  # the open backend session ends because the persona changed
        self._timeline_ms = 0
        self._frames = 0
        self._text: str | None = None  # a piece that came ahead of its frame's audio (remote)
        self._calls: set[asyncio.TimerHandle] = set()
        self._missing_tools: set[str] = set()
        self._speech = CallerSpeech() if duplex_model.caller_vad else None
        self._meter = SessionMeter(
            label=duplex_model.label,
            metadata=Metadata(model_name=duplex_model.model, model_provider=duplex_model.provider),
            gate=duplex_model.audio_gate(),  # the adapter's own gate decides its generations
        )
        self._ended = False  # an unrecoverable error was reported: nothing more will work
        self.stats: dict[str, int] = {
            "sessions": 0,
            "reconnects": 0,  # sessions reopened after one was lost
            "refusals": 0,  # times the server said "later" (full, loading, saturated)
            "frames": 0,
            "text_pieces": 0,
            "tool_calls": 0,
            "input_samples": 0,  # caller audio handed to the model (24 kHz)
            "input_samples_dropped": 0,  # caller audio past the bound while no session was ready
            "caller_speech": 0,  # stretches of caller speech the VAD found
        }
        self._main = asyncio.create_task(self._run(), name="personaplex-livekit-session")

    # -- what the adapter uses -------------------------------------------------------------------

    @property
    def audio_stream(self) -> utils.aio.Chan[llm.DuplexAudioFrame]:
        return self._audio_ch

    @property
    def tools(self) -> llm.ToolContext:
        return self._tools

    @property
    def backend_session(self) -> BackendSession | None:
        """The open backend session (None while opening or reopening)."""
        return self._backend_session

    def push_audio(self, frame: rtc.AudioFrame) -> None:
        if self._closing or self._ended:
            return
        # Called from AgentSession's audio forwarding task: an exception here would end that task
        # and leave the model deaf for the rest of the call, so it ends the session, said once.
        try:
            pcm = self._input.convert(frame)
            if not len(pcm):
                return
            if self._speech is not None:
                self._watch_caller(pcm)
            session = self._backend_session
            if session is None:  # opening or reopening: kept for it, in order
                self._early.add(pcm)
                self.stats["input_samples_dropped"] = self._early.dropped_samples
                return
            session.push(pcm)
            self._heard(len(pcm))
        except Exception as exc:
            self._fail(exc)

    async def aclose(self) -> None:
        await super().aclose()
        for handle in self._calls:
            handle.cancel()
        self._calls.clear()
        session = self._backend_session
        if session is not None:
            await session.close()  # the engine slot (or the socket) is free at once
        await utils.aio.cancel_and_wait(self._main)
        self._report_usage()  # LiveKit still listens while its session closes (agent_activity.py)
        self._audio_ch.close()

    async def _update_instructions(self, instructions: str) -> None:
        # AgentActivity hands the agent's instructions over on every start, "" when the agent
        # has none (`_update_session(instructions=self._render_realtime_instructions(...))`):
        # then the model's own `instructions=` are the persona. The agent's, when given, win.
        instructions = instructions if instructions.strip() else self._model.default_instructions or ""
        if instructions == self._instructions:
            return
        self._instructions = instructions
        session = self._backend_session
        if session is not None:  # a persona is fixed for a session's life: open a new one
            self._restart = True
            self._backend_session = None  # the caller's audio waits for the new one meanwhile
            await session.close()

    async def _append_items(self, items: list[llm.ChatItem]) -> None:
        # PersonaPlex takes no text context: it heard the conversation itself. Tool results too
        # stay the app's (the model goes on speaking by itself).
        if items:
            log.debug("%d chat item(s) not sent: PersonaPlex takes no text context", len(items))

    async def _update_tools(self, tools: list[llm.Tool]) -> None:
        self._tools = llm.ToolContext(tools)
        self._missing_tools.clear()

    def _update_options(self, *, tool_choice: NotGivenOr[llm.ToolChoice | None] = NOT_GIVEN) -> None:
        pass  # the model never picks tools: the persona's rules do

    def _generate_reply(
        self,
        *,
        instructions: NotGivenOr[str] = NOT_GIVEN,
        tool_choice: NotGivenOr[llm.ToolChoice] = NOT_GIVEN,
        tools: NotGivenOr[list[llm.Tool]] = NOT_GIVEN,
    ) -> None:
        # The model speaks when it decides to (a greeting comes by itself); the adapter takes its
        # next speech as the reply. Instructions cannot steer it mid-call.
        if instructions:
            log.debug("generate_reply instructions are not used: PersonaPlex takes no text mid-call")

    # -- the session's life ----------------------------------------------------------------------

    def _persona(self) -> Persona:
        model = self._model
        return Persona(
            text_prompt=self._instructions, voice=model.voice, sampling=model.sampling, seed=model.seed
        )

    async def _run(self) -> None:
        try:
            await self._configured.wait()  # instructions and tools from the agent first
            await self._sessions()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug or a backend failing as it should not: say so, once
            self._fail(exc)
        finally:
            session, self._backend_session = self._backend_session, None
            if session is not None:
                await session.close()
            self._audio_ch.close()

    async def _sessions(self) -> None:
        delays = self._model.backoff.delays()
        refused = lost = 0  # transient refusals / quick losses in a row
        while not self._closing:
            started = time.perf_counter()
            persona = self._persona()
            try:
                await self._model.backend.prepare()
                session = await self._model.backend.open(persona)
            except SessionRefused as exc:
                if exc.kind in TRANSIENT_REFUSALS and refused < len(delays):
                    self.stats["refusals"] += 1
                    self._error(exc, recoverable=True)
                    await asyncio.sleep(delays[refused])
                    refused += 1
                    continue
                self._error(exc, recoverable=False)
                return
            except BackendUnavailable as exc:  # the backend's own backoff gave up
                self._error(exc, recoverable=False)
                return
            refused = 0
            if self._closing:
                await session.close()
                return
            if persona.text_prompt != self._instructions:  # changed while it opened
                await session.close()
                continue
            acquired = self._meter.opened(session.session_id, time.perf_counter() - started)
            self.emit("metrics_collected", acquired)
            if self.stats["sessions"]:
                self.stats["reconnects"] += 1
                self.emit("session_reconnected", llm.RealtimeSessionReconnectedEvent())
            self.stats["sessions"] += 1
            opened_at = time.monotonic()
            self._attach(session)
            try:
                async for out in session.frames():
                    self._on_agent_frame(out)
            except SessionRefused as exc:
                self._error(exc, recoverable=False)
                return
            except SessionLost as exc:
                if self._closing:
                    return
                lost = 0 if time.monotonic() - opened_at >= STABLE_S else lost + 1
                if lost > len(delays):
                    self._error(exc, recoverable=False)
                    return
                self._error(exc, recoverable=True)
                log.warning("%s lost (%s); reopening", session.description, exc)
                if lost:
                    await asyncio.sleep(delays[lost - 1])
            finally:
                self._backend_session = None
                await session.close()
                self._report_usage()
            if self._restart:
                self._restart = False
                log.info("the agent's instructions changed: a new PersonaPlex session")

    def _attach(self, session: BackendSession) -> None:
        early = self._early.take()
        if len(early):
            session.push(early)  # the caller's words from before, ahead of the live audio
            self._heard(len(early))
        self._backend_session = session

    def _heard(self, samples: int) -> None:
        self.stats["input_samples"] += samples
        self._meter.heard(samples)

    def _watch_caller(self, pcm: np.ndarray) -> None:
        assert self._speech is not None
        for edge in self._speech.update(pcm):
            if edge.kind == "started":
                self.stats["caller_speech"] += 1
                self._meter.caller_started()
                self.emit("input_speech_started", llm.InputSpeechStartedEvent())
            else:
                # when the caller went quiet, on the wall clock (the VAD confirmed it later)
                ended_at = time.time() - (self._speech.position_s - edge.at_s)
                self._meter.caller_stopped(ended_at)
                stopped = llm.InputSpeechStoppedEvent(user_transcription_enabled=False)
                self.emit("input_speech_stopped", stopped)

    def _report_usage(self) -> None:
        for metrics in self._meter.closed():
            self.emit("metrics_collected", metrics)

    def _on_agent_frame(self, out: AgentFrame) -> None:
        if out.text:
            self.stats["text_pieces"] += 1
            self._meter.text_piece()
            self.emit(
                "transcript_delta",
                llm.DuplexOutputTranscriptDelta(
                    text=out.text, start_ms=self._timeline_ms, end_ms=self._timeline_ms + FRAME_MS
                ),
            )
            self._text = out.text
            for call in self._rules.on_agent_text(out.text):
                self._schedule(call)
        if out.pcm is None:
            return
        frame = output_frame(out.pcm)
        self._audio_ch.send_nowait(llm.DuplexAudioFrame(frame=frame, start_ms=self._timeline_ms))
        burst = self._meter.agent_frame(frame)
        if burst is not None:
            self.emit("metrics_collected", burst)
        self.emit(
            "personaplex_frame",
            AgentFrameEvent(self._frames, self._timeline_ms, out.pcm, self._text, out.tokens),
        )
        self._text = None
        self._timeline_ms += FRAME_MS
        self._frames += 1
        self.stats["frames"] = self._frames

    # -- rules -> function calls -----------------------------------------------------------------

    def _schedule(self, call: ToolCall) -> None:
        if self._tools.get_function_tool(call.name) is None:
            if call.name not in self._missing_tools:
                self._missing_tools.add(call.name)
                log.warning(
                    "action rule %d fired on %r, but the agent has no tool named %r to call",
                    call.rule,
                    call.phrase,
                    call.name,
                )
            return
        if call.after_s <= 0:
            self._call(call)
            return
        handle: asyncio.TimerHandle

        def due() -> None:
            self._calls.discard(handle)
            self._call(call)

        handle = asyncio.get_running_loop().call_later(call.after_s, due)
        self._calls.add(handle)

    def _call(self, call: ToolCall) -> None:
        if self._closing:
            return
        self.stats["tool_calls"] += 1
        log.info(
            "action rule %d fired on %r: calling %s(%s)", call.rule, call.phrase, call.name, call.arguments
        )
        self.emit(
            "function_call",
            llm.FunctionCall(
                call_id=utils.shortuuid("personaplex_"), name=call.name, arguments=call.arguments
            ),
        )

    # -- errors ----------------------------------------------------------------------------------

    def _fail(self, exc: Exception) -> None:
        """Something that should not happen: one unrecoverable error naming it, and the session
        ends (LiveKit closes the AgentSession) instead of staying up mute."""
        if self._ended or self._closing:
            return
        log.exception("PersonaPlex session failed", exc_info=exc)
        error = APIError(f"PersonaPlex session failed: {type(exc).__name__}: {exc}", retryable=False)
        error.__cause__ = exc
        self._error(error, recoverable=False)
        if asyncio.current_task() is not self._main:
            self._main.cancel()  # its `finally` frees the backend session and ends the audio

    def _error(self, exc: Exception, *, recoverable: bool) -> None:
        if self._ended:
            return
        error: Any
        if isinstance(exc, APIError):
            error = exc
        elif isinstance(exc, SessionRefused):
            error = APIStatusError(str(exc), body={"kind": exc.kind}, retryable=recoverable)
        else:
            error = APIConnectionError(str(exc), retryable=recoverable)
        if not recoverable:
            self._ended = True
            if not isinstance(exc, APIError):
                log.error("PersonaPlex session ended: %s", exc)
        self.emit(
            "error",
            llm.RealtimeModelError(
                timestamp=time.time(), label=self._model.label, error=error, recoverable=recoverable
            ),
        )
