"""What a `DuplexSession` reports as LiveKit metrics: LiveKit's own `RealtimeModelMetrics`.

LiveKit collects a realtime model's `metrics_collected` events into the `AgentSession`'s usage
(livekit/agents/metrics/usage_collector.py: `session_duration`, input and output audio and text
tokens add up per model) and its telemetry, and re-emits each as the session's own
`metrics_collected` (voice/agent_activity.py, `_on_metrics_collected`). What each event here is:

- **connection** (`request_id` = the server's session id), when a backend session is ready:
  `acquire_time` = connecting, queueing and the prompt load, from asking to ready (what LiveKit's
  `DuplexSession._report_connection_acquired` reports, with the session named);
- **agent burst** (`request_id` = `<session id>-<n>`), when a stretch of the agent's audible
  speech ends: `ttft` = time to its first audio from when the agent's turn came (the caller
  stopped talking, or the connection became ready), -1 when the agent started while the caller
  was still talking (a back-channel, an overlap: no turn to time); `duration` = the burst;
- **connection usage** (`request_id` = the session id), when the backend session ends:
  `session_duration` (ready to end, as xAI-style session billing reports it), `ttft` = ready to
  the first audible agent audio, and the audio as tokens, one per 80 ms model frame (12.5 a
  second): `input_token_details.audio_tokens` the caller's audio the model heard,
  `output_token_details.audio_tokens` the frames it made (silence included),
  `output_token_details.text_tokens` its text pieces.

A burst is what LiveKit's `DuplexRealtimeAdapter` makes a generation of: the same gate
(`DuplexModel.audio_gate()`, a fixed level) decides it, on the same frames.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from livekit import rtc
from livekit.agents import llm
from livekit.agents.metrics import RealtimeModelMetrics
from livekit.agents.metrics.base import Metadata
from personaplex_voice.engine.base import FRAME_SIZE, SAMPLE_RATE

FRAME_S = FRAME_SIZE / SAMPLE_RATE  # one model frame: one audio token here


@dataclass
class _Connection:
    request_id: str
    ready_at: float
    input_samples: int = 0
    frames_out: int = 0
    text_pieces: int = 0
    first_audio_at: float | None = None
    bursts: int = 0


@dataclass
class _Burst:
    request_id: str
    started_at: float
    ttft: float


class SessionMeter:
    """One DuplexSession's connection and burst timing, as `RealtimeModelMetrics`."""

    def __init__(
        self,
        *,
        label: str,
        metadata: Metadata,
        gate: llm.AudioGate,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._label = label
        self._metadata = metadata
        self._gate = gate
        self._clock = clock
        self._connection: _Connection | None = None
        self._burst: _Burst | None = None
        # since when the agent's answer is due (the caller stopped, or the connection is new);
        # None while the caller talks or once the agent answered
        self._due_since: float | None = None
        self._caller_speaking = False

    def opened(self, request_id: str, acquire_s: float) -> RealtimeModelMetrics:
        now = self._clock()
        self._connection = _Connection(request_id, now)
        self._burst = None
        self._gate.deactivate()
        if not self._caller_speaking:
            self._due_since = now
        return self._metrics(request_id, now, acquire_time=acquire_s)

    def caller_started(self) -> None:
        self._caller_speaking = True
        self._due_since = None

    def caller_stopped(self, speech_ended_at: float) -> None:
        """The VAD confirmed the caller stopped, `stop_s` after they did: a burst that began in
        between (PersonaPlex often answers sooner) answered them, and is timed from then."""
        self._caller_speaking = False
        burst = self._burst
        if burst is None:
            self._due_since = speech_ended_at
        elif burst.ttft < 0 and burst.started_at >= speech_ended_at:
            burst.ttft = burst.started_at - speech_ended_at

    def heard(self, samples: int) -> None:
        """Caller audio handed to the model."""
        if self._connection is not None:
            self._connection.input_samples += samples

    def text_piece(self) -> None:
        if self._connection is not None:
            self._connection.text_pieces += 1

    def agent_frame(self, frame: rtc.AudioFrame) -> RealtimeModelMetrics | None:
        """One output frame; the burst it ended, if it ended one."""
        connection = self._connection
        if connection is None:
            return None
        connection.frames_out += 1
        now = self._clock()
        if self._gate.update(frame):
            if self._burst is None:
                connection.bursts += 1
                due, self._due_since = self._due_since, None
                ttft = now - due if due is not None else -1.0
                self._burst = _Burst(f"{connection.request_id}-{connection.bursts}", now, ttft)
                if connection.first_audio_at is None:
                    connection.first_audio_at = now
            return None
        return self._end_burst(now)

    def closed(self) -> list[RealtimeModelMetrics]:
        """The backend session ended: its open burst, then its usage."""
        connection = self._connection
        if connection is None:
            return []
        now = self._clock()
        out = [m for m in (self._end_burst(now),) if m is not None]
        self._connection = None
        seconds = max(0.0, now - connection.ready_at)
        frames_in = connection.input_samples // FRAME_SIZE
        first = connection.first_audio_at
        out.append(
            self._metrics(
                connection.request_id,
                connection.ready_at,
                duration=seconds,
                session_duration=seconds,
                ttft=first - connection.ready_at if first is not None else -1.0,
                tokens_per_second=connection.frames_out / seconds if seconds > 0 else 0.0,
                input_frames=frames_in,
                output_frames=connection.frames_out,
                text_pieces=connection.text_pieces,
            )
        )
        return out

    def _end_burst(self, now: float) -> RealtimeModelMetrics | None:
        burst, self._burst = self._burst, None
        if burst is None:
            return None
        self._gate.deactivate()
        return self._metrics(
            burst.request_id, burst.started_at, ttft=burst.ttft, duration=max(0.0, now - burst.started_at)
        )

    def _metrics(
        self,
        request_id: str,
        timestamp: float,
        *,
        input_frames: int = 0,
        output_frames: int = 0,
        text_pieces: int = 0,
        **timing: float,
    ) -> RealtimeModelMetrics:
        output_tokens = output_frames + text_pieces
        return RealtimeModelMetrics(
            label=self._label,
            request_id=request_id,
            timestamp=timestamp,
            connection_reused=False,
            input_tokens=input_frames,
            output_tokens=output_tokens,
            total_tokens=input_frames + output_tokens,
            input_token_details=RealtimeModelMetrics.InputTokenDetails(audio_tokens=input_frames),
            output_token_details=RealtimeModelMetrics.OutputTokenDetails(
                audio_tokens=output_frames, text_tokens=text_pieces
            ),
            metadata=self._metadata,
            **timing,
        )
