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
    EarlyAudio,
    SessionLost,
    SessionRefused,
)

from livekit import rtc
from livekit.agents import APIConnectionError, APIStatusError, llm, utils
from livekit.agents.types import NOT_GIVEN, NotGivenOr
from personaplex_voice.engine.base import FRAME_SIZE, SAMPLE_RATE, Persona

from .audio import InputAudio, output_frame
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
        self._instructions = duplex_model.default_instructions
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
        self.stats: dict[str, int] = {
            "sessions": 0,
            "frames": 0,
            "text_pieces": 0,
            "tool_calls": 0,
            "input_samples_dropped": 0,  # caller audio past the bound while no session was ready
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
        if self._closing:
            return
        pcm = self._input.convert(frame)
        if not len(pcm):
            return
        session = self._backend_session
        if session is None:  # opening or reopening: kept for it, in order
            self._early.add(pcm)
            self.stats["input_samples_dropped"] = self._early.dropped_samples
            return
        session.push(pcm)

    async def aclose(self) -> None:
        await super().aclose()
        for handle in self._calls:
            handle.cancel()
        self._calls.clear()
        session = self._backend_session
        if session is not None:
            await session.close()  # the engine slot (or the socket) is free at once
        await utils.aio.cancel_and_wait(self._main)
        self._audio_ch.close()

    async def _update_instructions(self, instructions: str) -> None:
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
            text_prompt=self._instructions or "", voice=model.voice, sampling=model.sampling, seed=model.seed
        )

    async def _run(self) -> None:
        try:
            await self._configured.wait()  # instructions and tools from the agent first
            await self._sessions()
        finally:
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
            if persona.text_prompt != (self._instructions or ""):  # changed while it opened
                await session.close()
                continue
            self._report_connection_acquired(time.perf_counter() - started)
            if self.stats["sessions"]:
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
            if self._restart:
                self._restart = False
                log.info("the agent's instructions changed: a new PersonaPlex session")

    def _attach(self, session: BackendSession) -> None:
        early = self._early.take()
        if len(early):
            session.push(early)  # the caller's words from before, ahead of the live audio
        self._backend_session = session

    def _on_agent_frame(self, out: AgentFrame) -> None:
        if out.text:
            self.stats["text_pieces"] += 1
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
        self._audio_ch.send_nowait(
            llm.DuplexAudioFrame(frame=output_frame(out.pcm), start_ms=self._timeline_ms)
        )
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

    def _error(self, exc: Exception, *, recoverable: bool) -> None:
        error: Any
        if isinstance(exc, SessionRefused):
            error = APIStatusError(str(exc), body={"kind": exc.kind}, retryable=recoverable)
        else:
            error = APIConnectionError(str(exc), retryable=recoverable)
        if not recoverable:
            log.error("PersonaPlex session ended: %s", exc)
        self.emit(
            "error",
            llm.RealtimeModelError(
                timestamp=time.time(), label=self._model.label, error=error, recoverable=recoverable
            ),
        )
