"""Local file in, file out: a Pipecat pipeline around PersonaPlex, no transport and no network.

The input file plays into the pipeline as 16 kHz `InputAudioRawFrame`s at real-time pace (what a
microphone would do); the agent's audio is written to the output WAV on the same timeline, so the
two files line up when played side by side. The agent's text goes to stdout.

    # the tiny random `demo` model (babbles), in this process:
    python examples/pipecat_file_pipeline.py question.wav answer.wav --model demo
    # the real model on a GPU, in this process:
    python examples/pipecat_file_pipeline.py question.wav answer.wav \
        --model nvidia/personaplex-7b-v1 --device cuda --voice NATF2 --text-prompt "You are helpful."
    # a running personaplex-voice server:
    python examples/pipecat_file_pipeline.py question.wav answer.wav --url ws://localhost:8998/api/chat

Needs `pip install "personaplex-voice[pipecat]"`.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import numpy as np
from personaplex_pipecat import Backend, InProcessBackend, PersonaPlexLLMService, RemoteBackend
from pipecat.frames.frames import (
    EndFrame,
    Frame,
    InputAudioRawFrame,
    TTSAudioRawFrame,
    TTSStartedFrame,
    TTSTextFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.workers.runner import WorkerRunner

from personaplex_voice.audio.io import read_audio, write_wav
from personaplex_voice.engine.base import Sampling

IN_RATE = 16_000
OUT_RATE = 24_000
CHUNK_S = 0.02


class AgentTrack(FrameProcessor):
    """Lays the agent's audio out on the call's timeline and prints its text as it comes."""

    def __init__(self, rate: int, echo_text: bool = True):
        super().__init__()
        self.rate = rate
        self.t0: float | None = None  # set when the first input chunk is sent
        self._pieces: list[tuple[int, np.ndarray]] = []
        self._cursor = 0
        self._new_utterance = True
        self._echo_text = echo_text
        self.text: list[str] = []

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        if isinstance(frame, TTSStartedFrame):
            self._new_utterance = True
        elif isinstance(frame, TTSAudioRawFrame) and self.t0 is not None:
            pcm = np.frombuffer(frame.audio, "<i2").astype(np.float32) / 32768.0
            # an utterance starts where it arrived; its frames follow each other without gaps
            start = self._cursor
            if self._new_utterance:
                start = max(start, round((time.monotonic() - self.t0) * self.rate))
                self._new_utterance = False
            self._pieces.append((start, pcm))
            self._cursor = start + len(pcm)
        elif isinstance(frame, TTSTextFrame):
            self.text.append(frame.text)
            if self._echo_text:
                print(frame.text, end="", flush=True)
        await self.push_frame(frame, direction)

    def audio(self, min_samples: int = 0) -> np.ndarray:
        out = np.zeros(max(self._cursor, min_samples), np.float32)
        for start, pcm in self._pieces:
            out[start : start + len(pcm)] = pcm
        return out


async def process_file(
    service: PersonaPlexLLMService, audio_16k: np.ndarray, *, tail_s: float = 1.0, echo_text: bool = True
) -> tuple[np.ndarray, str]:
    """Play `audio_16k` through `service` in real time; returns (agent audio at 24 kHz, agent text)."""
    track = AgentTrack(OUT_RATE, echo_text=echo_text)
    worker = PipelineWorker(
        Pipeline([service, track]),
        params=PipelineParams(audio_in_sample_rate=IN_RATE, audio_out_sample_rate=OUT_RATE),
        enable_rtvi=False,
        idle_timeout_secs=None,
    )
    errors: list[str] = []
    started = asyncio.Event()

    @worker.event_handler("on_pipeline_started")
    async def on_started(_worker, _frame):
        started.set()

    @worker.event_handler("on_pipeline_error")
    async def on_error(_worker, frame):
        errors.append(frame.error)

    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    run = asyncio.create_task(runner.run())
    await started.wait()
    # The model hears the call from the moment its session is ready; wait for it so that the
    # beginning of the file is not lost (a live call would simply start talking a bit later).
    while service.session is None and not errors and not run.done():
        await asyncio.sleep(0.02)
    if errors:
        await worker.cancel()
        await run
        raise RuntimeError(errors[0])

    chunk = round(IN_RATE * CHUNK_S)
    padded = np.concatenate([audio_16k, np.zeros(round(tail_s * IN_RATE), np.float32)])
    track.t0 = t0 = time.monotonic()
    for i, start in enumerate(range(0, len(padded), chunk)):
        pcm16 = (np.clip(padded[start : start + chunk], -1, 1) * 32767).astype("<i2").tobytes()
        await worker.queue_frame(InputAudioRawFrame(audio=pcm16, sample_rate=IN_RATE, num_channels=1))
        await asyncio.sleep(max(0.0, t0 + (i + 1) * CHUNK_S - time.monotonic()))
    await worker.queue_frame(EndFrame())
    await run
    return track.audio(round(len(padded) / IN_RATE * OUT_RATE)), "".join(track.text)


def make_backend(args: argparse.Namespace) -> Backend:
    if args.url:
        return RemoteBackend(args.url, api_key=args.api_key)
    return InProcessBackend(model=args.model, engine_kind=args.engine, device=args.device)


async def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("input", type=Path, help="the user's side of the call (any common audio format)")
    parser.add_argument("output", type=Path, help="WAV file for the agent's side (24 kHz)")
    parser.add_argument("--url", help="ws[s]://host:port/api/chat of a personaplex-voice server")
    parser.add_argument("--api-key", help="the server's API key")
    parser.add_argument("--model", default="demo", help="in-process model: demo, a model dir or a hub id")
    parser.add_argument(
        "--engine", default="model", choices=["model", "echo"], help="echo: no model, for wiring"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--text-prompt", default="You enjoy having a good conversation.")
    parser.add_argument("--voice", default=None, help="voice prompt name, e.g. NATF2")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--greedy", action="store_true", help="argmax sampling (repeatable)")
    args = parser.parse_args(argv)

    audio = read_audio(args.input, sample_rate=IN_RATE)
    backend = make_backend(args)
    service = PersonaPlexLLMService(
        backend=backend,
        text_prompt=args.text_prompt,
        voice=args.voice,
        sampling=Sampling(greedy=args.greedy),
        seed=args.seed,
    )
    try:
        await backend.prepare()
        agent, _text = await process_file(service, audio)
    finally:
        await backend.aclose()
    print()
    write_wav(args.output, agent, OUT_RATE)
    print(f"wrote {args.output} ({len(agent) / OUT_RATE:.1f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
