"""Helpers for the Pipecat bridge tests: run a real Pipecat pipeline around a service and record it.

`run_call` builds `Pipeline([upstream_recorder, service, downstream_recorder])`, runs it with a
`PipelineWorker` (Pipecat 1.3+'s name for `PipelineTask`) under a `WorkerRunner` (formerly
`PipelineRunner`), feeds 16-bit PCM as `InputAudioRawFrame`s in 20 ms chunks at real-time pace,
then ends the call with an `EndFrame` or a `CancelFrame`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np
from pipecat.frames.frames import (
    EndFrame,
    ErrorFrame,
    Frame,
    InputAudioRawFrame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
    LLMTextFrame,
    TTSAudioRawFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
    TTSTextFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.workers.runner import WorkerRunner

CHUNK_S = 0.02


class Recorder(FrameProcessor):
    """Passes every frame on and remembers it with its arrival time (time.monotonic)."""

    def __init__(self, keep: FrameDirection, **kwargs):
        super().__init__(**kwargs)
        self._keep = keep
        self.frames: list[tuple[float, Frame]] = []

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        if direction == self._keep:
            self.frames.append((time.monotonic(), frame))
        await self.push_frame(frame, direction)


@dataclass
class CallResult:
    out_rate: int
    downstream: list[tuple[float, Frame]]
    upstream: list[tuple[float, Frame]]
    started_at: float  # monotonic time of the first input chunk
    input_s: float = 0.0
    wall_s: float = 0.0
    extra: dict = field(default_factory=dict)

    def of(self, cls: type, where: str = "down") -> list[Frame]:
        frames = self.downstream if where == "down" else self.upstream
        return [f for _, f in frames if isinstance(f, cls)]

    @property
    def errors(self) -> list[ErrorFrame]:
        return self.of(ErrorFrame, "up")

    @property
    def audio_frames(self) -> list[TTSAudioRawFrame]:
        return self.of(TTSAudioRawFrame)

    def text(self) -> str:
        return "".join(f.text for f in self.of(TTSTextFrame))

    def agent_timeline(self) -> np.ndarray:
        """The agent's audio (float32, out_rate) laid out in time: each utterance from the arrival
        time of its first frame, its frames back to back (as an output transport plays them)."""
        pieces: list[tuple[int, np.ndarray]] = []
        cursor = 0
        new_utterance = True
        for t, frame in self.downstream:
            if isinstance(frame, TTSStartedFrame):
                new_utterance = True
            if not isinstance(frame, TTSAudioRawFrame):
                continue
            pcm = np.frombuffer(frame.audio, "<i2").astype(np.float32) / 32768.0
            start = cursor
            if new_utterance:
                start = max(cursor, round((t - self.started_at) * self.out_rate))
                new_utterance = False
            pieces.append((start, pcm))
            cursor = start + len(pcm)
        out = np.zeros(cursor, np.float32)
        for start, pcm in pieces:
            out[start : start + len(pcm)] = pcm
        return out

    def sequence(self) -> list[str]:
        """Names of the utterance-structure frames in order (audio and text collapsed)."""
        kinds = (
            LLMFullResponseStartFrame,
            TTSStartedFrame,
            TTSStoppedFrame,
            LLMFullResponseEndFrame,
            TTSAudioRawFrame,
            LLMTextFrame,
        )
        names: list[str] = []
        for _, f in self.downstream:
            if isinstance(f, kinds):
                name = type(f).__name__
                if name in ("TTSAudioRawFrame", "LLMTextFrame"):
                    name = "content"
                if name != "content" or not names or names[-1] != "content":
                    names.append(name)
        return names


def to_pcm16(x: np.ndarray) -> bytes:
    return (np.clip(x, -1, 1) * 32767).astype("<i2").tobytes()


async def run_call(
    service: FrameProcessor,
    audio: np.ndarray,
    in_rate: int,
    *,
    channels: int = 1,
    out_rate: int = 24000,
    end: str = "end",
    feed_s: float | None = None,
    wait_ready: Callable[[], bool] | None = None,
    ready_timeout_s: float = 20.0,
    tail_s: float = 0.5,
    during: Callable[[CallResult], Awaitable[None]] | None = None,
    while_feeding: Callable[[], Awaitable[None]] | None = None,
    enable_metrics: bool = False,
    worker_options: dict | None = None,
) -> CallResult:
    """Run one call through a real pipeline.

    `audio` is interleaved when `channels` > 1.
    `wait_ready`: polled before feeding (e.g. "the service has a session") so that the whole
    input reaches the model. `feed_s`: stop feeding after this much audio (mid-call end).
    `end`: "end" queues an EndFrame after `tail_s`, "cancel" cancels the worker, "none" lets an
    error end it (the worker is cancelled after `ready_timeout_s`). `during` runs after feeding,
    before the end (to look at the live state); `while_feeding` runs alongside the feeding.
    `worker_options` go to the PipelineWorker (e.g. its `processor_unusable_policy`).
    """
    up = Recorder(FrameDirection.UPSTREAM, name="up-recorder")
    down = Recorder(FrameDirection.DOWNSTREAM, name="down-recorder")
    worker = PipelineWorker(
        Pipeline([up, service, down]),
        params=PipelineParams(
            audio_in_sample_rate=in_rate,
            audio_out_sample_rate=out_rate,
            enable_metrics=enable_metrics,
            enable_usage_metrics=enable_metrics,
        ),
        enable_rtvi=False,
        enable_turn_tracking=False,
        idle_timeout_secs=None,
        cancel_on_idle_timeout=False,
        **(worker_options or {}),
    )
    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    started = asyncio.Event()

    @worker.event_handler("on_pipeline_started")
    async def _on_started(_worker, _frame):
        started.set()

    result = CallResult(out_rate=out_rate, downstream=down.frames, upstream=up.frames, started_at=0.0)
    t_run = time.monotonic()
    run_task = asyncio.create_task(runner.run())
    try:
        await asyncio.wait_for(started.wait(), timeout=ready_timeout_s)
        if wait_ready is not None:
            deadline = time.monotonic() + ready_timeout_s
            while not wait_ready():
                if time.monotonic() > deadline or result.errors:
                    break
                await asyncio.sleep(0.01)
        side = asyncio.create_task(while_feeding()) if while_feeding is not None else None
        await _feed(worker, audio, in_rate, channels, feed_s, result)
        if side is not None:
            await side
        if during is not None:
            await during(result)
        if end == "end":
            await asyncio.sleep(tail_s)
            await worker.queue_frame(EndFrame())
        elif end == "cancel":
            await worker.cancel(reason="test")
        await asyncio.wait_for(asyncio.shield(run_task), timeout=ready_timeout_s)
    finally:
        if not run_task.done():
            await worker.cancel(reason="test teardown")
            await asyncio.wait_for(run_task, timeout=10)
    result.wall_s = time.monotonic() - t_run
    return result


async def _feed(
    worker: PipelineWorker,
    audio: np.ndarray,
    rate: int,
    channels: int,
    feed_s: float | None,
    result: CallResult,
):
    chunk = round(rate * CHUNK_S) * channels
    total = len(audio) if feed_s is None else min(len(audio), round(feed_s * rate) * channels)
    t0 = time.monotonic()
    result.started_at = t0
    for i, start in enumerate(range(0, total, chunk)):
        piece = to_pcm16(audio[start : start + chunk])
        await worker.queue_frame(InputAudioRawFrame(audio=piece, sample_rate=rate, num_channels=channels))
        delay = t0 + (i + 1) * CHUNK_S - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
    result.input_s = total / (rate * channels)


def aligned_logspec_correlation(
    out: np.ndarray, ref: np.ndarray, rate: int, max_lag_s: float = 1.5
) -> tuple[float, float]:
    """(similarity, lag_s): how recognisably `out` echoes `ref` (support_server.echo_similarity:
    log-spectrogram correlation per second, aligned per second, a busy machine's stalls costing
    only the seconds they hit), and the delay (0..max_lag_s) that best matches the waveforms."""
    from scipy.signal import correlate
    from support_server import echo_similarity

    xc = correlate(out, ref, mode="full", method="fft")
    lags = np.arange(-len(ref) + 1, len(out))
    window = (lags >= 0) & (lags <= max_lag_s * rate)
    lag = int(lags[window][np.argmax(xc[window])])
    return echo_similarity(ref, out, rate=rate), lag / rate


def tone_fraction(x: np.ndarray, freq: float, rate: int, width_hz: float = 40.0) -> float:
    """Share of the signal's energy within `width_hz` of `freq` (Welch spectrum). A clean tone is
    near 1; a few clicks from dropped or late frames lower it only a little, noise or the wrong
    signal brings it near 0."""
    from scipy.signal import welch

    f, p = welch(x, fs=rate, nperseg=min(len(x), 2048))
    return float(p[np.abs(f - freq) <= width_hz].sum() / max(p.sum(), 1e-20))
