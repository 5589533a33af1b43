"""`PersonaPlexLLMService`: PersonaPlex as a Pipecat realtime speech-to-speech service.

It takes the place of `OpenAIRealtimeLLMService` / `GeminiLiveLLMService` in a pipeline:

    transport.input() -> PersonaPlexLLMService(...) -> transport.output()

User audio (`InputAudioRawFrame`, any rate) goes to the model continuously; the model is full
duplex and decides by itself when to talk, listen, back-channel or stop for a barge-in. Its
continuous 80 ms output frames are cut into utterances (see `utterance_playout.UtteranceTracker`),
each one sent as

    LLMFullResponseStartFrame, TTSStartedFrame,
    TTSAudioRawFrame (pipeline output rate) ... with LLMTextFrame + TTSTextFrame per text piece,
    TTSStoppedFrame, LLMFullResponseEndFrame

and at most one frame of audio is kept ahead of real-time playback (see
`utterance_playout.PlayoutGate`).

The caller's speech is watched by silero-vad (`personaplex_backends.CallerSpeech`) and announced
as Pipecat's VAD would: `VADUserStartedSpeakingFrame` + `UserStartedSpeakingFrame` when they
start, `VADUserStoppedSpeakingFrame` + `UserStoppedSpeakingFrame` when they stop, broadcast both
ways, never with an interruption (the model takes its own turns). A service that emits turn
frames itself owns the interruption logic, and an `ExternalUserTurnStartStrategy` adopts such a
turn without repeating it (pipecat/turns/user_start/external_user_turn_start_strategy.py). When
the pipeline has a VAD of its own (its frames reach this service), this one stays quiet.

Failures: a refusal or a lost connection that cannot be reopened is one `ErrorFrame` with its
category; anything unexpected is one `ErrorFrame` of category `UNKNOWN` naming the exception.
Either way the service marks itself unusable (`push_error(force_treat_as_permanent=True)`, what
Pipecat 1.8+ uses instead of `fatal=True`: pipecat/frames/frames.py, `ErrorFrame.fatal`) and the
worker's `ProcessorUnusablePolicy` decides whether the call ends.

Metrics (`enable_metrics` / `enable_usage_metrics`): TTFB = the caller's end of speech (the VAD's)
or the session becoming ready, to the agent's first audible audio after it; processing = the
same start to the end of that utterance; usage (`LLMUsageMetricsData`) when a session ends, its
audio as tokens, one per 80 ms model frame (`input_audio_tokens` heard, `output_audio_tokens`
made, so seconds = tokens x 0.08) and the text pieces as completion tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from loguru import logger
from personaplex_backends import (
    Backend,
    BackendSession,
    BackendUnavailable,
    CallerSpeech,
    EarlyAudio,
    SessionLost,
    SessionRefused,
    SpeechEdge,
)

from personaplex_voice.audio.resample import StreamingResampler
from personaplex_voice.engine.base import FRAME_SIZE, SAMPLE_RATE, Persona, Sampling
from personaplex_voice.session_api import SessionHost
from pipecat.audio.utils import create_stream_resampler
from pipecat.frames.frames import (
    CancelFrame,
    EndFrame,
    Frame,
    InputAudioRawFrame,
    InterruptionFrame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
    LLMServiceMetadataFrame,
    LLMTextFrame,
    StartFrame,
    TTSAudioRawFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
    TTSTextFrame,
    UserStartedSpeakingFrame,
    UserStoppedSpeakingFrame,
    VADUserStartedSpeakingFrame,
    VADUserStoppedSpeakingFrame,
)
from pipecat.metrics.metrics import LLMTokenUsage
from pipecat.processors.frame_processor import FrameDirection
from pipecat.services.llm_service import LLMService
from pipecat.services.settings import LLMSettings
from pipecat.turns.user_turn_strategies import ExternalUserTurnStrategies
from pipecat.utils.errors import ErrorCategory
from pipecat.utils.text.base_text_aggregator import TextType
from pipecat.utils.types import NOT_GIVEN, NotGiven, is_given

from .utterance_playout import Edge, PlayoutGate, UtteranceTracker

FRAME_S = FRAME_SIZE / SAMPLE_RATE  # 0.08

# Refusal kinds (server close reasons, backend kinds) as Pipecat error categories.
_REFUSAL_CATEGORIES = {
    "auth": ErrorCategory.AUTHENTICATION,
    "origin": ErrorCategory.AUTHORIZATION,
    "capacity": ErrorCategory.RATE_LIMIT,
    "queue_full": ErrorCategory.RATE_LIMIT,
    "saturated": ErrorCategory.RATE_LIMIT,  # slots free, but no real-time headroom for one more call
    "loading": ErrorCategory.SERVER,
    "unavailable": ErrorCategory.SERVER,
    "internal": ErrorCategory.SERVER,
    "persona": ErrorCategory.INVALID_REQUEST,
    "bad_query": ErrorCategory.INVALID_REQUEST,
    "bad_url": ErrorCategory.INVALID_REQUEST,
    "not_found": ErrorCategory.INVALID_REQUEST,
}


@dataclass
class PersonaPlexLLMSettings(LLMSettings):
    """Runtime-updatable settings of `PersonaPlexLLMService`.

    `system_instruction` is PersonaPlex's text prompt and `seed` its sampling seed (both
    inherited from `LLMSettings`); `voice` names a voice prompt known to the model (e.g.
    "NATF2"), None for the default; `sampling` holds temperatures and top-k for text and audio.
    A persona is fixed for the life of a session: changes apply from the next session.
    """

    voice: str | NotGiven | None = field(default_factory=lambda: NOT_GIVEN)
    sampling: Sampling | NotGiven = field(default_factory=lambda: NOT_GIVEN)


class PersonaPlexLLMService(LLMService):
    """NVIDIA PersonaPlex full-duplex speech-to-speech, in-process or on a personaplex-voice server.

    Pick where the model runs with exactly one of:
      `backend`: an `InProcessBackend` / `RemoteBackend` (share one across calls; you close it);
      `url` (+ `api_key`): a server's `ws[s]://host:port/api/chat`;
      `manager`: a session host in this process (a `SessionManager`, or the server's host);
      `model`: build the model in this process on first use (`"demo"`, a model dir, a hub id;
        `engine_options` go to `build_engine`, e.g. `device="cuda"`).

    Args:
        text_prompt: the persona's system prompt (PersonaPlex "text prompt").
        voice: a voice prompt name known to the model ("NATF2"), None for the default voice.
        sampling: temperatures / top-k (`personaplex_voice.engine.base.Sampling`).
        seed: sampling seed; None picks one per session.
        speech_threshold_db: agent audio at or above this RMS level (dBFS) counts as speech.
        hangover_s: quiet agent audio that ends an utterance (rounded to 80 ms frames).
        max_audio_ahead_s: audio allowed to wait downstream ahead of real-time playback when a
            frame is pushed (one 80 ms frame); later frames of a burst are dropped. None turns the
            gate off (pipelines that do not play audio in real time).
        playout_lead_s: silence sent ahead of each utterance. Output transports send audio
            just in time (Pipecat's WebSocket transports pace it at real time), so without a
            little lead every few milliseconds of delivery jitter would be a gap in the
            caller's ear (an underrun at Twilio); the lead absorbs it, at that cost in latency.
        reconnect_attempts: how many times a session lost mid-call (dropped connection) is
            reopened before giving up with an ErrorFrame. Refusals are never retried.
        caller_vad: watch the caller with silero-vad and announce their speech (user speaking
            frames, TTFB from their end of speech); False: no user frames, TTFB only from the
            session becoming ready.
    """

    Settings = PersonaPlexLLMSettings
    _settings: PersonaPlexLLMSettings

    def __init__(
        self,
        *,
        backend: Backend | None = None,
        url: str | None = None,
        api_key: str | None = None,
        manager: SessionHost | None = None,
        model: str | None = None,
        engine_options: dict[str, Any] | None = None,
        text_prompt: str = "",
        voice: str | None = None,
        sampling: Sampling | None = None,
        seed: int | None = None,
        settings: PersonaPlexLLMSettings | None = None,
        speech_threshold_db: float = -45.0,
        hangover_s: float = 0.48,
        max_audio_ahead_s: float | None = FRAME_S,
        playout_lead_s: float = 0.04,
        reconnect_attempts: int = 2,
        caller_vad: bool = True,
        **kwargs: Any,
    ):
        chosen = [
            name
            for name, v in (("backend", backend), ("url", url), ("manager", manager), ("model", model))
            if v is not None
        ]
        if len(chosen) != 1:
            raise ValueError(f"pass exactly one of backend, url, manager or model (got {chosen or 'none'})")
        self._owns_backend = backend is None
        if backend is None:
            backend = _backend_from(
                url=url, api_key=api_key, manager=manager, model=model, options=engine_options
            )
        self._backend: Backend = backend

        default_settings = self.Settings(
            model=backend.model_name,
            system_instruction=text_prompt,
            temperature=None,
            max_tokens=None,
            top_p=None,
            top_k=None,
            frequency_penalty=None,
            presence_penalty=None,
            seed=seed,
            filter_incomplete_user_turns=False,
            user_turn_completion_config=None,
            voice=voice,
            sampling=sampling or Sampling(),
        )
        if settings is not None:
            default_settings.apply_update(settings)
        super().__init__(settings=default_settings, **kwargs)

        self._tracker = UtteranceTracker(speech_threshold_db, max(1, round(hangover_s / FRAME_S)))
        self._gate = PlayoutGate(max_audio_ahead_s)
        self._caller_vad = caller_vad
        self._speech: CallerSpeech | None = None  # one per call, made at start
        self._pipeline_vad = False  # the pipeline announces the caller's speech itself
        self._utterance_started_at = 0.0
        self._timed_utterance = False  # the current utterance's TTFB was measured
        self._failed = False  # one ErrorFrame was pushed: the service cannot go on
        self._usage = {"samples_in": 0, "frames_out": 0, "text_pieces": 0}  # the open session's
        self._reconnect_attempts = reconnect_attempts
        self._playout_lead_s = playout_lead_s

        self._session: BackendSession | None = None
        # The caller's audio while a session opens (or reopens): handed over once it is ready.
        self._early = EarlyAudio()
        self._session_task: asyncio.Task | None = None
        self._stopping = False
        self._out_rate = SAMPLE_RATE
        self._out_resampler: StreamingResampler | None = None
        self._in_resamplers: dict[int, Any] = {}
        # Pipecat's soxr stream resamplers, for rate pairs ours does not stream (44.1 kHz)
        self._pipecat_in_resampler = create_stream_resampler()
        self._pipecat_out_resampler = create_stream_resampler()
        self._output_lock = asyncio.Lock()
        self._processing = False  # a processing-time measurement is running
        self.stats: dict[str, int] = {
            "sessions": 0,
            "reconnects": 0,
            "caller_speech": 0,  # stretches of caller speech the VAD found
            "utterances": 0,
            "frames_pushed": 0,
            "frames_dropped": 0,
            "text_pieces": 0,
            "input_samples_dropped": 0,
        }

    # -- Pipecat service surface ---------------------------------------------------------------

    def can_generate_metrics(self) -> bool:
        return True

    def service_metadata_frame(self) -> LLMServiceMetadataFrame:
        """Realtime service. The model takes turns by itself: recommend turn strategies that never
        broadcast interruptions, so a context aggregator's VAD cannot cut the agent's audio."""
        return LLMServiceMetadataFrame(
            service_name=self.name,
            is_realtime_service=True,
            user_turn_strategies=ExternalUserTurnStrategies(enable_interruptions=False),
        )

    @property
    def backend(self) -> Backend:
        return self._backend

    @property
    def session(self) -> BackendSession | None:
        """The open session (None before it is ready and after the call)."""
        return self._session

    def persona(self) -> Persona:
        s = self._settings
        sampling = s.sampling if is_given(s.sampling) else Sampling()
        return Persona(
            text_prompt=str(s.system_instruction or "") if is_given(s.system_instruction) else "",
            voice=s.voice if is_given(s.voice) else None,
            sampling=sampling,
            seed=s.seed if is_given(s.seed) else None,
        )

    async def _update_settings(self, delta: LLMSettings) -> dict[str, Any]:
        changed = await super()._update_settings(delta)
        persona_fields = {"system_instruction", "voice", "sampling", "seed"} & set(changed)
        if persona_fields and self._session is not None:
            logger.info(
                f"{self}: {sorted(persona_fields)} apply from the next session (a persona is fixed per call)"
            )
        return changed

    async def start(self, frame: StartFrame) -> None:
        await super().start(frame)
        self._stopping = False
        if self._caller_vad:
            self._speech = CallerSpeech()
        self._out_rate = self.processor_setup.audio_out_sample_rate
        self._out_resampler = None
        # a rate that is not a small-integer ratio of 24 kHz (44.1 kHz) goes through Pipecat's
        with contextlib.suppress(ValueError):
            if self._out_rate != SAMPLE_RATE:
                self._out_resampler = StreamingResampler(SAMPLE_RATE, self._out_rate)
        self._session_task = self.create_task(self._run_sessions(), name="personaplex-session")

    async def stop(self, frame: EndFrame) -> None:
        await super().stop(frame)
        await self._end_session()
        await self._close_utterance()

    async def cancel(self, frame: CancelFrame) -> None:
        await super().cancel(frame)
        await self._end_session()

    async def cleanup(self) -> None:
        await super().cleanup()
        await self._end_session()
        if self._owns_backend:
            await self._backend.aclose()

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, InputAudioRawFrame):
            if not self._failed:
                try:
                    await self._send_user_audio(frame)
                except Exception as exc:  # one ErrorFrame, not one per audio frame
                    await self._fail(exc)
        elif isinstance(frame, InterruptionFrame):
            await self._handle_interruption()
        elif (
            isinstance(frame, (VADUserStartedSpeakingFrame, UserStartedSpeakingFrame))
            and direction == FrameDirection.DOWNSTREAM
            and not self._pipeline_vad
        ):
            logger.info(f"{self}: the pipeline detects the caller's speech itself; not announcing it")
            self._pipeline_vad = True
        await self.push_frame(frame, direction)

    # -- session life ------------------------------------------------------------------------

    async def _run_sessions(self) -> None:
        try:
            await self._session_loop()
        except Exception as exc:  # a bug or an engine failure: say so instead of going silent
            await self._fail(exc)

    async def _fail(self, exc: Exception) -> None:
        """Something that should not happen: one ErrorFrame naming it, and the service stops
        (marked unusable: the worker's ProcessorUnusablePolicy decides about the call)."""
        if self._failed:
            return
        self._failed = True
        logger.opt(exception=exc).error(f"{self}: PersonaPlex failed")
        await self.push_error(
            f"PersonaPlex: {type(exc).__name__}: {exc}",
            exception=exc,
            category=ErrorCategory.UNKNOWN,
            force_treat_as_permanent=True,
        )
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def _session_loop(self) -> None:
        """Open a session, stream its output; reopen it if it is lost mid-call (not if refused)."""
        reconnects = 0
        while not self._stopping:
            try:
                await self._backend.prepare()
                session = await self._backend.open(self.persona())
            except (SessionRefused, BackendUnavailable) as exc:
                await self._report(exc)
                return
            if self._stopping:  # ended while the session was opening
                await session.close()
                return
            self._session = session
            early = self._early.take()
            if len(early):
                session.push(early)  # the caller's first words, in order, before the live audio
                self._usage["samples_in"] += len(early)
            self.stats["sessions"] += 1
            logger.info(f"{self}: {session.description} ready")
            if self._speech is None or not self._speech.speaking:
                await self._turn_due(time.time())  # the agent may speak first
            try:
                async for out in session.frames():
                    await self._handle_agent_frame(out.pcm, out.text)
                return
            except SessionRefused as exc:
                await self._report(exc)
                return
            except SessionLost as exc:
                if self._stopping:
                    return
                if reconnects >= self._reconnect_attempts:
                    await self._report(exc)
                    return
                reconnects += 1
                self.stats["reconnects"] += 1
                logger.warning(
                    f"{self}: {exc}; opening a new session ({reconnects}/{self._reconnect_attempts})"
                )
                await self._close_utterance()
            finally:
                self._session = None
                await session.close()
                await self._report_usage()

    async def _report_usage(self) -> None:
        """The ended session's audio, as usage metrics (tokens: 80 ms model frames)."""
        usage, self._usage = self._usage, {"samples_in": 0, "frames_out": 0, "text_pieces": 0}
        frames_in = usage["samples_in"] // FRAME_SIZE
        if not frames_in and not usage["frames_out"]:
            return
        completion = usage["frames_out"] + usage["text_pieces"]
        await self.start_llm_usage_metrics(
            LLMTokenUsage(
                prompt_tokens=frames_in,
                completion_tokens=completion,
                total_tokens=frames_in + completion,
                input_audio_tokens=frames_in,
                output_audio_tokens=usage["frames_out"],
            )
        )

    async def _report(self, exc: Exception) -> None:
        """One ErrorFrame upstream; the service cannot work without a session, so it also marks
        itself unusable (the worker's `processor_unusable_policy` decides whether the call ends)."""
        if self._failed:
            return
        self._failed = True
        if isinstance(exc, SessionRefused):
            category = _REFUSAL_CATEGORIES.get(exc.kind, ErrorCategory.UNKNOWN)
        else:
            category = ErrorCategory.CONNECTIVITY
        await self.push_error(
            f"PersonaPlex: {exc}", exception=exc, category=category, force_treat_as_permanent=True
        )

    async def _end_session(self) -> None:
        """Free the engine slot / close the socket now, then stop the output task."""
        self._stopping = True
        session, self._session = self._session, None
        if session is not None:
            await session.close()
        task, self._session_task = self._session_task, None
        if task is not None:
            await self.cancel_task(task, timeout=2.0)
        await self._report_usage()  # when the task was cancelled before it could

    # -- user audio in -----------------------------------------------------------------------

    async def _send_user_audio(self, frame: InputAudioRawFrame) -> None:
        pcm = _pcm16_to_float(frame.audio, frame.num_channels)
        if frame.sample_rate != SAMPLE_RATE:
            pcm = await self._resample_input(pcm, frame.audio, frame.sample_rate, frame.num_channels)
        if self._speech is not None:
            for edge in self._speech.update(pcm):
                await self._on_caller_speech(edge)
        session = self._session
        if session is None:  # not ready yet: kept for it (the server catches the backlog up)
            self._early.add(pcm)
            self.stats["input_samples_dropped"] = self._early.dropped_samples
            return
        session.push(pcm)
        self._usage["samples_in"] += len(pcm)

    async def _on_caller_speech(self, edge: SpeechEdge) -> None:
        assert self._speech is not None
        # when it happened on the wall clock (the VAD is sure of it `confirmed_s` later)
        at = time.time() - (self._speech.position_s - edge.at_s)
        if edge.kind == "started":
            self.stats["caller_speech"] += 1
            if not self._tracker.speaking:  # the agent's turn is not due while the caller talks
                await self.cancel_ttfb_metrics()
                self._processing = False
            if not self._pipeline_vad:
                await self.broadcast_frame(
                    VADUserStartedSpeakingFrame, start_secs=edge.confirmed_s, timestamp=at
                )
                await self.broadcast_frame(UserStartedSpeakingFrame)
            return
        if not self._pipeline_vad:
            stopped = {"stop_secs": edge.confirmed_s, "timestamp": at}
            await self.broadcast_frame(VADUserStoppedSpeakingFrame, **stopped)
            await self.broadcast_frame(UserStoppedSpeakingFrame)
        if not self._tracker.speaking:
            await self._turn_due(at)  # the caller stopped and the agent is silent: time its answer
        elif not self._timed_utterance and self._utterance_started_at >= at:
            # the agent answered before the VAD was sure the caller had stopped (PersonaPlex
            # often does): its answer is timed from the caller's end of speech all the same
            await self.start_ttfb_metrics(start_time=at)
            await self.stop_ttfb_metrics(end_time=self._utterance_started_at)
            self._timed_utterance = True
            if not self._processing:
                await self.start_processing_metrics(start_time=at)
                self._processing = True

    async def _turn_due(self, since: float) -> None:
        """The agent's turn came at `since`: TTFB and processing run from then."""
        await self.start_ttfb_metrics(start_time=since)
        await self.start_processing_metrics(start_time=since)
        self._processing = True

    async def _resample_input(self, pcm: np.ndarray, raw: bytes, rate: int, channels: int) -> np.ndarray:
        resampler = self._in_resamplers.get(rate)
        if resampler is None:
            try:
                resampler = StreamingResampler(rate, SAMPLE_RATE)
            except ValueError:  # e.g. 44.1 kHz: fall back to Pipecat's soxr stream resampler
                resampler = "pipecat"
            self._in_resamplers[rate] = resampler
        if isinstance(resampler, StreamingResampler):
            return resampler.process(pcm)
        mono = _float_to_pcm16(pcm)
        out = await self._pipecat_in_resampler.resample(mono, rate, SAMPLE_RATE)
        return _pcm16_to_float(out, 1)

    async def _resample_output(self, pcm: np.ndarray) -> np.ndarray:
        if self._out_rate == SAMPLE_RATE:
            return pcm
        if self._out_resampler is not None:
            return self._out_resampler.process(pcm)
        out = await self._pipecat_out_resampler.resample(_float_to_pcm16(pcm), SAMPLE_RATE, self._out_rate)
        return _pcm16_to_float(out, 1)

    # -- agent audio and text out --------------------------------------------------------------

    async def _handle_agent_frame(self, pcm: np.ndarray | None, text: str | None) -> None:
        text = text or None
        async with self._output_lock:
            edge = self._tracker.update(pcm, text)
            if edge is Edge.STARTED:
                await self._open_utterance()
            if text is not None:  # a text piece always keeps (or starts) an utterance
                await self._push_text(text)
            if pcm is not None:
                self._usage["frames_out"] += 1
                audio = await self._resample_output(pcm)
                if edge is not Edge.NONE:
                    await self._push_audio(audio)
            if edge is Edge.ENDED:
                await self._close_utterance_locked()

    async def _open_utterance(self) -> None:
        self.stats["utterances"] += 1
        self._utterance_started_at = time.time()
        # a measurement started when the agent's turn came ends here (no-op when none runs)
        self._timed_utterance = self._processing
        await self.stop_ttfb_metrics(end_time=self._utterance_started_at)
        if not self._processing:
            await self.start_processing_metrics()
            self._processing = True
        await self.push_frame(LLMFullResponseStartFrame())
        await self.push_frame(TTSStartedFrame())
        lead = round(self._playout_lead_s * self._out_rate)
        if lead > 0 and self._gate.backlog_s() < self._playout_lead_s:
            await self._push_audio(np.zeros(lead, np.float32))

    async def _push_text(self, text: str) -> None:
        self.stats["text_pieces"] += 1
        self._usage["text_pieces"] += 1
        # Like OpenAI Realtime: LLMTextFrame for RTVI's bot-llm-text (kept out of the context),
        # TTSTextFrame for what the bot says (the assistant aggregator records that one).
        llm_text = LLMTextFrame(text)
        llm_text.append_to_context = False
        await self.push_frame(llm_text)
        spoken = TTSTextFrame(text, text_type=TextType.TOKEN)
        spoken.includes_inter_frame_spaces = True
        await self.push_frame(spoken)

    async def _push_audio(self, audio: np.ndarray) -> None:
        if not len(audio):
            return
        if not self._gate.admit(len(audio) / self._out_rate):
            self.stats["frames_dropped"] += 1
            return
        self.stats["frames_pushed"] += 1
        await self.push_frame(
            TTSAudioRawFrame(audio=_float_to_pcm16(audio), sample_rate=self._out_rate, num_channels=1)
        )

    async def _close_utterance(self) -> None:
        async with self._output_lock:
            if self._tracker.speaking:
                self._tracker.reset()
                await self._close_utterance_locked()

    async def _close_utterance_locked(self) -> None:
        await self.push_frame(TTSStoppedFrame())
        await self.push_frame(LLMFullResponseEndFrame())
        if self._processing:
            await self.stop_processing_metrics()
            self._processing = False

    async def _handle_interruption(self) -> None:
        """Someone broadcast an interruption (a VAD-driven turn strategy, an RTVI client...).

        The output transport has just dropped its queued audio; end the current utterance so the
        frames stay paired. The model is not told: it heard the user and stops by itself.
        """
        self._gate.reset()
        await self._close_utterance()


def _backend_from(
    *,
    url: str | None,
    api_key: str | None,
    manager: SessionHost | None,
    model: str | None,
    options: dict[str, Any] | None,
) -> Backend:
    if url is not None:
        from personaplex_backends import RemoteBackend

        return RemoteBackend(url, api_key=api_key)
    from personaplex_backends import InProcessBackend

    if manager is not None:
        return InProcessBackend(manager)
    return InProcessBackend(model=str(model), **(options or {}))


def _pcm16_to_float(data: bytes, channels: int) -> np.ndarray:
    pcm = np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0
    if channels > 1:
        pcm = pcm[: len(pcm) // channels * channels].reshape(-1, channels).mean(axis=1)
    return pcm


def _float_to_pcm16(pcm: np.ndarray) -> bytes:
    return (np.clip(pcm, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()
