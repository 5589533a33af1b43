"""LiveKit bridge load: N concurrent DuplexSessions against `serve --engine echo`, beside N plain
`/api/chat` clients.

    .venv/bin/python bench/livekit_load.py [--sessions 4 8] [--seconds 10]

Starts `personaplex-voice serve --engine echo` (a subprocess, so this process's CPU is the
clients' alone). Each round runs N callers at once for `--seconds` of speech, twice:
- `livekit`: `personaplex_livekit.DuplexModel` sessions, as LiveKit drives them: 48 kHz 10 ms
  `rtc.AudioFrame`s pushed in real time (a room's input), the output stream read as LiveKit's
  adapter reads it (no AgentSession: its VAD and playout are LiveKit's costs, not the bridge's);
- `plain`: the same audio at 24 kHz in 20 ms pieces through `personaplex_backends.RemoteSession`
  (the same Ogg-Opus client, no LiveKit layer).
Per round: sessions carried in real time (every 80 ms frame of the call came back and no two
arrived more than 250 ms apart), the worst gap, and this process's CPU time per session-second
of call; then the livekit / plain ratio. Last line: one JSON object. Not asserted anywhere.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from livekit import rtc
from personaplex_backends import RemoteBackend
from personaplex_livekit import DuplexModel
from support_server import running_server

from personaplex_voice.audio.resample import resample
from personaplex_voice.engine.base import Persona

SR = 24000
FRAME_S = 0.08
MAX_GAP_S = 0.25


def speech(seconds: float) -> np.ndarray:
    """Speech-like test audio: a few voiced harmonics, gated into syllables (no espeak needed)."""
    t = np.arange(int(seconds * SR)) / SR
    f0 = 140 + 30 * np.sin(2 * np.pi * 0.7 * t)
    voiced = sum(np.sin(2 * np.pi * k * np.cumsum(f0) / SR) / k for k in range(1, 6))
    gate = (np.sin(2 * np.pi * 3.0 * t) > -0.3).astype(np.float32)
    return (0.1 * voiced * gate).astype(np.float32)


def summary(arrivals: list[float], seconds: float) -> tuple[bool, float]:
    expected = int(seconds / FRAME_S) - 2
    gaps = np.diff(arrivals) if len(arrivals) > 1 else np.array([seconds])
    worst = float(gaps.max()) if len(gaps) else seconds
    return len(arrivals) >= expected and worst <= MAX_GAP_S, worst


async def livekit_caller(url: str, audio48: np.ndarray, seconds: float) -> tuple[bool, float]:
    model = DuplexModel(url)
    session = model.session()
    await session._update_session(instructions="You are an echo.")  # what LiveKit's adapter does
    arrivals: list[float] = []

    async def read() -> None:
        async for _frame in session.audio_stream:
            arrivals.append(time.monotonic())

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
    arrivals_until = start + seconds
    await asyncio.sleep(0.3)
    await session.aclose()
    reader.cancel()
    await model.aclose()
    return summary([t for t in arrivals if t <= arrivals_until + 0.3], seconds)


async def plain_caller(url: str, audio: np.ndarray, seconds: float) -> tuple[bool, float]:
    session = await RemoteBackend(url).open(Persona(text_prompt="You are an echo."))
    arrivals: list[float] = []

    async def read() -> None:
        async for out in session.frames():
            if out.pcm is not None:
                arrivals.append(time.monotonic())

    reader = asyncio.create_task(read())
    size = 480  # 20 ms at 24 kHz
    start = time.monotonic()
    for i in range(0, len(audio) - size + 1, size):
        session.push(audio[i : i + size])
        await asyncio.sleep(max(0.0, start + (i + size) / SR - time.monotonic()))
    await asyncio.sleep(0.3)
    await session.close()
    reader.cancel()
    return summary([t for t in arrivals if t <= start + seconds + 0.3], seconds)


async def round_of(kind: str, url: str, n: int, seconds: float) -> dict[str, float]:
    audio = speech(seconds)
    audio48 = resample(audio, SR, 48000)
    cpu0, wall0 = time.process_time(), time.monotonic()
    if kind == "livekit":
        results = await asyncio.gather(*(livekit_caller(url, audio48, seconds) for _ in range(n)))
    else:
        results = await asyncio.gather(*(plain_caller(url, audio, seconds) for _ in range(n)))
    cpu = time.process_time() - cpu0
    return {
        "carried": sum(ok for ok, _ in results),
        "worst_gap_ms": 1000 * max(gap for _, gap in results),
        "client_cpu_ms_per_session_s": 1000 * cpu / (n * seconds),
        "wall_s": time.monotonic() - wall0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    rounds: dict[str, dict] = {}
    with running_server("--max-sessions", str(max(args.sessions))) as server:
        url = server.ws_url + "/api/chat"
        for n in args.sessions:
            for kind in ("plain", "livekit"):
                row = asyncio.run(round_of(kind, url, n, args.seconds))
                rounds[f"{kind} x{n}"] = row
                print(f"{kind:8s} x{n:<3d} " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()), flush=True)
            ratio = rounds[f"livekit x{n}"]["client_cpu_ms_per_session_s"] / max(
                rounds[f"plain x{n}"]["client_cpu_ms_per_session_s"], 1e-9
            )
            rounds[f"cpu ratio livekit/plain x{n}"] = {"ratio": ratio}
            print(f"client CPU livekit / plain at {n}: {ratio:.2f}", flush=True)
    print(json.dumps({"seconds": args.seconds, "rounds": rounds}))


if __name__ == "__main__":
    main()
