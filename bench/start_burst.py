"""A start burst on a realtime SessionManager: kept and caught up, or trimmed?

    .venv/bin/python bench/start_burst.py [--sessions 4] [--burst-s 0.7] [--seconds 6]
        [--step-ms 0 10 30 50]

Loopback sessions (echo, one frame late) whose system prompt takes 0.5 s each push
`--burst-s` of numbered 80 ms frames at once, right after `open` (what a client flushing its
queue, or a caller talking through the prefill, gives the session), then one frame every 80 ms.
The loopback's step is made to take `--step-ms` (a bigger engine: a 7B step on a GPU is 40-60 ms
of the 80). For the policy before issue 16 (`trim`: no start-burst allowance, the jitter buffer
drops the spare frames) and now (`catch-up`), per session: the frames the model never heard,
the catch-up frames, the echo's lag over the last 2 s (latency the burst left behind; one frame
of it is the loopback's own), and how long after ready the lag came down to that. Last line: one
JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import numpy as np

from personaplex_voice.engine.base import FRAME_SIZE, Persona
from personaplex_voice.engine.loopback import LoopbackEngine
from personaplex_voice.sessions import SessionManager

FRAME_S = 0.08
POLICIES = {"trim": {"start_burst_s": 0.0}, "catch-up": {}}


class SteppingEcho(LoopbackEngine):
    """A loopback whose batched step takes `step_s` (sleeping: the GIL is free meanwhile)."""

    def __init__(self, step_s: float, **kwargs):
        super().__init__(**kwargs)
        self.step_s = step_s

    def step(self, pcm, active):
        if self.step_s:
            time.sleep(self.step_s)
        return super().step(pcm, active)


def frame_of(k: int) -> np.ndarray:
    """Frame number k, loud enough to be delivered from a catch-up step (0.1 + k / 1000)."""
    return np.full(FRAME_SIZE, 0.1 + k / 1000.0, np.float32)


async def one_call(manager: SessionManager, args: argparse.Namespace) -> dict[str, float]:
    session = await manager.open(Persona())
    burst = round(args.burst_s / FRAME_S)
    for k in range(1, burst + 1):
        session.push(frame_of(k))
    sent = burst
    heard: set[int] = set()
    lags: list[tuple[float, int]] = []

    async def read() -> None:
        async for out in session.frames():
            if np.any(out.pcm):
                k = round(float(out.pcm[0]) * 1000) - 100
                heard.add(k)
                lags.append((time.monotonic(), sent - k))

    reader = asyncio.create_task(read())
    await session.ready()
    ready_at = time.monotonic()
    for k in range(burst + 1, burst + 1 + int(args.seconds / FRAME_S)):
        await asyncio.sleep(max(0.0, ready_at + (k - burst) * FRAME_S - time.monotonic()))
        session.push(frame_of(k))
        sent = k
    await asyncio.sleep(0.3 + args.burst_s)  # a burst kept as latency echoes this much later
    stats = session.stats
    await session.close()
    await reader
    tail = [lag for t, lag in lags if t >= ready_at + args.seconds - 2.0]
    final = float(np.median(tail)) if tail else float("nan")
    settled = next((t - ready_at for t, lag in lags if lag <= final and t > ready_at), float("nan"))
    echoable = sent - 4  # the last frames may still be on their way when the call ends
    return {
        "dropped_at_push": stats["dropped_input_samples"] // FRAME_SIZE - stats["jitter_dropped_frames"],
        "lost_frames": sum(1 for k in range(1, echoable + 1) if k not in heard),
        "catchup_frames": stats["catchup_frames"],
        "jitter_dropped": stats["jitter_dropped_frames"],
        "lag_ms_end": FRAME_S * 1000 * final,
        "s_to_final_lag": settled,
    }


async def run(policy: str, step_s: float, args: argparse.Namespace) -> dict[str, float]:
    # the 0.5 s prompt in 12 chunks between ticks, as a real prefill is spread (docs/sessions.md)
    engine = SteppingEcho(step_s, num_slots=args.sessions, prefill_s=0.5, prefill_chunk=1)
    manager = SessionManager(engine, cache_bytes=0, **POLICIES[policy])
    try:
        calls = await asyncio.gather(*(one_call(manager, args) for _ in range(args.sessions)))
    finally:
        await manager.shutdown()
    return {key: float(np.mean([c[key] for c in calls])) for key in calls[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--burst-s", type=float, default=0.7)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--step-ms", type=float, nargs="+", default=[0.0, 10.0, 30.0, 50.0])
    args = parser.parse_args()
    results: dict[str, dict[str, float]] = {}
    for step_ms in args.step_ms:
        for policy in POLICIES:
            row = asyncio.run(run(policy, step_ms / 1000, args))
            results[f"{policy} step={step_ms:g}ms"] = row
            print(f"{policy:9s} step {step_ms:4.0f} ms: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()))
    print(json.dumps({"sessions": args.sessions, "burst_s": args.burst_s, "results": results}))


if __name__ == "__main__":
    main()
