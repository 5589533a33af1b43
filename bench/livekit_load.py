"""Framework bridge load: N concurrent LiveKit DuplexSessions, N Pipecat pipelines, and N plain
`/api/chat` clients against `serve --engine echo`, in one run.

    .venv/bin/python bench/livekit_load.py [--sessions 4 8] [--seconds 10]

Starts `personaplex-voice serve --engine echo` (a subprocess, so this process's CPU is the
clients' alone; its headroom refusals off). Each round runs N callers at once for `--seconds`
of speech, three times:
- `plain`: 24 kHz in 20 ms pieces through `personaplex_backends.RemoteSession` (the Ogg-Opus
  client the bridges use, no framework);
- `livekit`: `personaplex_livekit.DuplexModel` sessions as LiveKit drives them: 48 kHz 10 ms
  `rtc.AudioFrame`s pushed in real time (a room's input), the output stream read as LiveKit's
  adapter reads it, the caller's VAD on (no AgentSession: its own VAD, playout and events are
  LiveKit's costs, not the bridge's);
- `pipecat`: a real Pipecat pipeline per caller (`PipelineWorker`, the service and a sink) fed
  16 kHz 20 ms `InputAudioRawFrame`s in real time, its output at 16 kHz, the caller's VAD on.
Per round: the sessions carried in real time (plain and livekit: every 80 ms frame came back and
no two arrived more than 250 ms apart; pipecat plays only the agent's utterances, so: no
utterance frame dropped by its playout gate, which drops what comes in a burst: their count is
`frames_dropped`), the worst gap, the time to first agent audio (from
the caller's first audio to the first audible frame of the echo, median and worst over the
sessions), and this process's CPU time per session-second of call; then each bridge's CPU over
the plain client's. Last line: one JSON object. Not asserted anywhere.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from livekit import rtc
from personaplex_backends import RemoteBackend
from personaplex_livekit import DuplexModel
from personaplex_pipecat import PersonaPlexLLMService
from pipecat.frames.frames import EndFrame, Frame, InputAudioRawFrame, TTSAudioRawFrame
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.workers.runner import WorkerRunner
from support_server import running_server

from personaplex_voice.audio.resample import resample
from personaplex_voice.engine.base import Persona

SR = 24000
FRAME_S = 0.08
MAX_GAP_S = 0.25
AUDIBLE_RMS = 10 ** (-45 / 20)  # the bridges' own speech level


@dataclass
class Result:
    carried: bool
    worst_gap_s: float
    first_audio_s: float  # the caller's first audio to the first audible frame back (inf: none)
    dropped: int = 0  # pipecat: agent frames its playout gate dropped (they came in a burst)


def audible(pcm: np.ndarray) -> bool:
    return float(np.sqrt(np.mean(np.square(pcm, dtype=np.float64)))) >= AUDIBLE_RMS


def speech(seconds: float) -> np.ndarray:
    """Speech-like test audio: a few voiced harmonics, gated into syllables (no espeak needed)."""
    t = np.arange(int(seconds * SR)) / SR
    f0 = 140 + 30 * np.sin(2 * np.pi * 0.7 * t)
    voiced = sum(np.sin(2 * np.pi * k * np.cumsum(f0) / SR) / k for k in range(1, 6))
    gate = (np.sin(2 * np.pi * 3.0 * t) > -0.3).astype(np.float32)
    return (0.1 * voiced * gate).astype(np.float32)


def summary(arrivals: list[float], seconds: float, start: float, first: float | None) -> Result:
    expected = int(seconds / FRAME_S) - 2
    gaps = np.diff(arrivals) if len(arrivals) > 1 else np.array([seconds])
    worst = float(gaps.max()) if len(gaps) else seconds
    ok = len(arrivals) >= expected and worst <= MAX_GAP_S
    return Result(ok, worst, first - start if first is not None else float("inf"))


async def livekit_caller(url: str, audio48: np.ndarray, seconds: float) -> Result:
    model = DuplexModel(url)
    session = model.session()
    await session._update_session(instructions="You are an echo.")  # what LiveKit's adapter does
    arrivals: list[float] = []
    first: list[float] = []

    async def read() -> None:
        async for frame in session.audio_stream:
            arrivals.append(time.monotonic())
            if not first and audible(np.frombuffer(frame.frame.data, np.int16) / 32768.0):
                first.append(arrivals[-1])

    reader = asyncio.create_task(read())
    while session.backend_session is None:
        await asyncio.sleep(0.01)
    size = 480  # 10 ms at 48 kHz
    start = time.monotonic()
    for i in range(0, len(audio48) - size + 1, size):
        data = (audio48[i : i + size] * 32767).astype(np.int16).tobytes()
        session.push_audio(
            rtc.AudioFrame(data=data, sample_rate=48000, num_channels=1, samples_per_channel=size)
        )
        await asyncio.sleep(max(0.0, start + (i + size) / 48000 - time.monotonic()))
    await asyncio.sleep(0.3)
    await session.aclose()
    reader.cancel()
    await model.aclose()
    kept = [t for t in arrivals if t <= start + seconds + 0.3]
    return summary(kept, seconds, start, first[0] if first else None)


async def plain_caller(url: str, audio: np.ndarray, seconds: float) -> Result:
    session = await RemoteBackend(url).open(Persona(text_prompt="You are an echo."))
    arrivals: list[float] = []
    first: list[float] = []

    async def read() -> None:
        async for out in session.frames():
            if out.pcm is not None:
                arrivals.append(time.monotonic())
                if not first and audible(out.pcm):
                    first.append(arrivals[-1])

    reader = asyncio.create_task(read())
    size = 480  # 20 ms at 24 kHz
    start = time.monotonic()
    for i in range(0, len(audio) - size + 1, size):
        session.push(audio[i : i + size])
        await asyncio.sleep(max(0.0, start + (i + size) / SR - time.monotonic()))
    await asyncio.sleep(0.3)
    await session.close()
    reader.cancel()
    kept = [t for t in arrivals if t <= start + seconds + 0.3]
    return summary(kept, seconds, start, first[0] if first else None)


class AgentAudioSink(FrameProcessor):
    """The end of a Pipecat pipeline: when the agent's audio frames arrive."""

    def __init__(self) -> None:
        super().__init__()
        self.arrivals: list[float] = []
        self.first: float | None = None

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, TTSAudioRawFrame):
            self.arrivals.append(time.monotonic())
            pcm = np.frombuffer(frame.audio, "<i2") / 32768.0
            if self.first is None and audible(pcm):
                self.first = self.arrivals[-1]
        await self.push_frame(frame, direction)


async def pipecat_caller(url: str, audio16: np.ndarray, seconds: float) -> Result:
    service = PersonaPlexLLMService(url=url, text_prompt="You are an echo.")
    sink = AgentAudioSink()
    worker = PipelineWorker(
        Pipeline([service, sink]),
        params=PipelineParams(audio_in_sample_rate=16000, audio_out_sample_rate=16000),
        enable_rtvi=False,
        enable_turn_tracking=False,
        idle_timeout_secs=None,
    )
    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    run = asyncio.create_task(runner.run())
    while service.session is None:
        if run.done() or not service.is_usable:  # refused: reported as not carried
            await worker.cancel(reason="refused")
            return Result(False, seconds, float("inf"))
        await asyncio.sleep(0.01)
    size = 320  # 20 ms at 16 kHz
    start = time.monotonic()
    for i in range(0, len(audio16) - size + 1, size):
        data = (audio16[i : i + size] * 32767).astype(np.int16).tobytes()
        await worker.queue_frame(InputAudioRawFrame(audio=data, sample_rate=16000, num_channels=1))
        await asyncio.sleep(max(0.0, start + (i + size) / 16000 - time.monotonic()))
    await asyncio.sleep(0.3)
    await worker.queue_frame(EndFrame())
    await asyncio.wait_for(run, 10)
    gaps = np.diff(sink.arrivals) if len(sink.arrivals) > 1 else np.array([seconds])
    first = sink.first - start if sink.first is not None else float("inf")
    dropped = service.stats["frames_dropped"]
    return Result(dropped == 0, float(gaps.max()), first, dropped)


async def round_of(kind: str, url: str, n: int, seconds: float) -> dict[str, float]:
    audio = speech(seconds)
    cpu0, wall0 = time.process_time(), time.monotonic()
    if kind == "livekit":
        audio48 = resample(audio, SR, 48000)
        results = await asyncio.gather(*(livekit_caller(url, audio48, seconds) for _ in range(n)))
    elif kind == "pipecat":
        audio16 = resample(audio, SR, 16000)
        results = await asyncio.gather(*(pipecat_caller(url, audio16, seconds) for _ in range(n)))
    else:
        results = await asyncio.gather(*(plain_caller(url, audio, seconds) for _ in range(n)))
    cpu = time.process_time() - cpu0
    first = sorted(r.first_audio_s for r in results)
    return {
        "carried": sum(r.carried for r in results),
        "frames_dropped": sum(r.dropped for r in results),
        "worst_gap_ms": 1000 * max(r.worst_gap_s for r in results),
        "first_audio_ms_median": 1000 * first[len(first) // 2],
        "first_audio_ms_worst": 1000 * first[-1],
        "client_cpu_ms_per_session_s": 1000 * cpu / (n * seconds),
        "wall_s": time.monotonic() - wall0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    rounds: dict[str, dict] = {}
    # The server's headroom policy (docs/capacity.md) would refuse callers on a busy machine:
    # off, so that every round measures its N clients.
    no_saturation = {"PERSONAPLEX_SATURATION": "0"}
    with running_server("--max-sessions", str(max(args.sessions)), env=no_saturation) as server:
        url = server.ws_url + "/api/chat"
        for n in args.sessions:
            for kind in ("plain", "livekit", "pipecat"):
                row = asyncio.run(round_of(kind, url, n, args.seconds))
                rounds[f"{kind} x{n}"] = row
                print(f"{kind:8s} x{n:<3d} " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()), flush=True)
            plain = max(rounds[f"plain x{n}"]["client_cpu_ms_per_session_s"], 1e-9)
            for kind in ("livekit", "pipecat"):
                ratio = rounds[f"{kind} x{n}"]["client_cpu_ms_per_session_s"] / plain
                rounds[f"cpu ratio {kind}/plain x{n}"] = {"ratio": ratio}
                print(f"client CPU {kind} / plain at {n}: {ratio:.2f}", flush=True)
    print(json.dumps({"seconds": args.seconds, "rounds": rounds}))


if __name__ == "__main__":
    main()
