"""A real LiveKit `AgentSession` without a room, as LiveKit's own tests run it: the caller's audio
comes from an array at real-time pace (an `AudioInput`), what the agent says goes to an
`AudioOutput` that plays it out in real time and records it, its transcript to a `TextOutput`.

    result = await run_agent(AgentSession(llm=model), Agent(instructions="..."), speech, 24000)
    result.played()          # the agent's audio as played (float32 at the output's rate)
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from livekit import rtc
from livekit.agents import Agent, AgentSession
from livekit.agents.voice.io import AudioInput, AudioOutput, AudioOutputCapabilities, TextOutput


class ArrayAudioInput(AudioInput):
    """`pcm` (float32, or int16 handed over as it is; at `rate`, `channels` interleaved) in
    `frame_ms` frames, paced in real time from the first one asked for (once `start_when()` is
    true), then silence until the session ends."""

    def __init__(
        self, pcm: np.ndarray, rate: int, frame_ms: int = 20, start_when: Any = None, channels: int = 1
    ) -> None:
        super().__init__(label="ArrayAudioInput")
        self._channels = channels
        self._start_when = start_when  # a test may hold the caller back until this says go
        if pcm.dtype == np.int16:  # a 16-bit file's own samples: handed over exactly
            self._pcm = pcm
        else:
            self._pcm = np.clip(np.round(pcm * 32768.0), -32768, 32767).astype(np.int16)
        self._rate = rate
        self._size = rate * frame_ms // 1000 * channels
        self._sent = 0
        self._start: float | None = None
        self.done = asyncio.Event()  # the whole array was handed over

    async def __anext__(self) -> rtc.AudioFrame:
        if self._start is None:
            while self._start_when is not None and not self._start_when():
                await asyncio.sleep(0.01)
            self._start = time.monotonic()
        due = self._start + self._sent / self._channels / self._rate
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        piece = self._pcm[self._sent : self._sent + self._size]
        if len(piece) < self._size:
            self.done.set()
            piece = np.concatenate([piece, np.zeros(self._size - len(piece), np.int16)])
        self._sent += self._size
        return rtc.AudioFrame(
            data=piece.tobytes(),
            sample_rate=self._rate,
            num_channels=self._channels,
            samples_per_channel=self._size // self._channels,
        )


@dataclass
class Segment:
    """One stretch of agent audio the session played (a generation), frames as they came."""

    started_at: float
    frames: list[rtc.AudioFrame] = field(default_factory=list)

    def pcm(self) -> np.ndarray:
        if not self.frames:
            return np.zeros(0, np.float32)
        return (
            np.concatenate([np.frombuffer(f.data, np.int16) for f in self.frames]).astype(np.float32) / 32768
        )


class PlayedAudioOutput(AudioOutput):
    """Plays each segment out in real time (reports playback like a room's output does) and
    keeps what it played."""

    def __init__(self) -> None:
        super().__init__(label="PlayedAudioOutput", capabilities=AudioOutputCapabilities(pause=False))
        self.segments: list[Segment] = []
        self._current: Segment | None = None
        self._pushed_s = 0.0
        self._started_at = 0.0
        self._finish: asyncio.TimerHandle | None = None

    async def capture_frame(self, frame: rtc.AudioFrame) -> None:
        await super().capture_frame(frame)
        if self._current is None:
            self._current = Segment(time.monotonic())
            self.segments.append(self._current)
            self._started_at = time.time()
            self._pushed_s = 0.0
            self.on_playback_started(created_at=self._started_at)
        self._current.frames.append(frame)
        self._pushed_s += frame.duration

    def flush(self) -> None:
        super().flush()
        if self._current is None:
            return
        self._current = None
        pushed = self._pushed_s

        def finished() -> None:
            self.on_playback_finished(playback_position=pushed, interrupted=False)

        remaining = pushed - (time.time() - self._started_at)
        self._finish = asyncio.get_running_loop().call_later(max(0.0, remaining), finished)

    def clear_buffer(self) -> None:
        if self._current is None:
            return
        self._current = None
        played = min(self._pushed_s, time.time() - self._started_at)
        self.on_playback_finished(playback_position=played, interrupted=True)


class RecordedTextOutput(TextOutput):
    def __init__(self) -> None:
        super().__init__(label="RecordedTextOutput", next_in_chain=None)
        self.text = ""

    async def capture_text(self, text: str) -> None:
        self.text += text

    def flush(self) -> None:
        pass


@dataclass
class AgentRun:
    audio_out: PlayedAudioOutput
    text_out: RecordedTextOutput
    session: AgentSession
    errors: list[Any] = field(default_factory=list)
    metrics: list[Any] = field(default_factory=list)  # what the session reported, in order
    user_states: list[tuple[float, str]] = field(default_factory=list)  # (monotonic time, state)
    closed: list[Any] = field(default_factory=list)  # the session's close event

    def played(self) -> np.ndarray:
        """Every segment's audio, back to back (the gaps between them are not kept)."""
        parts = [s.pcm() for s in self.audio_out.segments]
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)


async def run_agent(
    session: AgentSession,
    agent: Agent,
    pcm: np.ndarray,
    rate: int,
    *,
    tail_s: float = 1.5,
    frame_ms: int = 20,
    until: Any = None,
    max_s: float = 60.0,
    before_close: Any = None,
    channels: int = 1,
) -> AgentRun:
    """Start `session` with `agent` on `pcm` (`channels` interleaved), fed in real time; after
    the input and `tail_s` of silence (and `until()` when given), close the session (after
    `await before_close()`)."""
    audio_in = ArrayAudioInput(pcm, rate, frame_ms, channels=channels)
    run = AgentRun(PlayedAudioOutput(), RecordedTextOutput(), session)
    session.input.audio = audio_in
    session.output.audio = run.audio_out
    session.output.transcription = run.text_out
    closed = asyncio.Event()
    session.on("error", run.errors.append)
    session.on("metrics_collected", lambda ev: run.metrics.append(ev.metrics))
    session.on("user_state_changed", lambda ev: run.user_states.append((time.monotonic(), ev.new_state)))
    session.on("close", run.closed.append)
    session.on("close", lambda _ev: closed.set())
    await session.start(agent)
    deadline = time.monotonic() + max_s
    fed = asyncio.ensure_future(audio_in.done.wait())
    ended = asyncio.ensure_future(closed.wait())
    await asyncio.wait({fed, ended}, timeout=max_s, return_when=asyncio.FIRST_COMPLETED)
    fed.cancel()
    ended.cancel()
    if not closed.is_set():
        await asyncio.sleep(tail_s)
    while until is not None and not until() and not closed.is_set() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if before_close is not None:
        await before_close()
    await session.aclose()
    return run
