"""Late input on a realtime SessionManager: does it add lasting latency?

    .venv/bin/python bench/session_jitter.py [--sessions 8] [--seconds 8] [--stall-ms 250]
        [--jitter-ms 0] [--lead-ms none] [--cpu-hogs 0]

Loopback sessions (echo, no delay) each push one numbered 80 ms frame every 80 ms, at a random
phase against the tick (or `--lead-ms` before it), delayed by exponential jitter of mean
`--jitter-ms`, and stall once for `--stall-ms` 3 s into the call (the stalled frames then come
at once, as after a network hiccup). The echo's lag (frames pushed minus the frame echoed, in
ms) over the last 3 s shows whether the stall's delay stayed. Run for the manager before the
jitter buffer (10 ms late wait, no trimming) and now. Last line: one JSON object, with the lag
ratio now / before.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import time

import numpy as np

from personaplex_voice.engine.base import FRAME_SIZE, Persona
from personaplex_voice.engine.loopback import LoopbackEngine
from personaplex_voice.sessions import SessionManager

FRAME_S = 0.08
POLICIES = {
    "before": {"late_wait_s": 0.010, "input_slack_s": 1e9, "input_settle_s": None},
    "now": {},  # the SessionManager's defaults
}


async def one_call(manager: SessionManager, args: argparse.Namespace, seed: int) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    session = await manager.open(Persona())
    await session.ready()
    frames = session.frames()
    if args.lead_ms is None:
        phase = rng.uniform(0, FRAME_S)
    else:
        await frames.__anext__()  # a lead-in frame: a tick just ran
        phase = FRAME_S - args.lead_ms / 1000
    sent, lags = 0, []

    async def read() -> None:
        async for out in frames:
            if np.any(out.pcm):
                echoed = round(float(out.pcm[0]) * 1000)
                lags.append((time.monotonic(), (sent - echoed) % 1000))

    reader = asyncio.create_task(read())
    start = time.monotonic() + phase - FRAME_S
    at = start
    for k in range(1, int(args.seconds / FRAME_S) + 1):
        jitter = rng.exponential(args.jitter_ms / 1000) if args.jitter_ms else 0.0
        at = max(at, start + k * FRAME_S + jitter)
        if k == int(3.0 / FRAME_S):
            at += args.stall_ms / 1000
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        sent = k
        session.push(np.full(FRAME_SIZE, (k % 1000) / 1000, np.float32))
    stats = session.stats
    await session.close()
    await reader
    end = time.monotonic()
    tail = [lag for t, lag in lags if t > end - 3.0]
    return {
        "late_frames": stats["late_frames"],
        "jitter_dropped_frames": stats["jitter_dropped_frames"],
        "end_lag_ms": FRAME_S * 1000 * float(np.mean(tail)) if tail else float("nan"),
    }


async def run(policy: dict, args: argparse.Namespace) -> dict[str, float]:
    engine = LoopbackEngine(num_slots=args.sessions, delay_frames=0)
    manager = SessionManager(engine, realtime=True, idle_timeout_s=None, **policy)
    await manager.start()
    try:
        calls = await asyncio.gather(*(one_call(manager, args, seed) for seed in range(args.sessions)))
    finally:
        await manager.shutdown()
    return {
        "late_frames": sum(c["late_frames"] for c in calls),
        "jitter_dropped_frames": sum(c["jitter_dropped_frames"] for c in calls),
        "end_lag_ms": round(float(np.mean([c["end_lag_ms"] for c in calls])), 1),
    }


def _spin() -> None:
    while True:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--stall-ms", type=float, default=250.0)
    parser.add_argument("--jitter-ms", type=float, default=0.0)
    parser.add_argument("--lead-ms", type=float, default=None, help="push each frame this long before a tick")
    parser.add_argument("--cpu-hogs", type=int, default=0, help="busy processes beside the manager")
    args = parser.parse_args()
    hogs = [mp.Process(target=_spin, daemon=True) for _ in range(args.cpu_hogs)]
    for hog in hogs:
        hog.start()
    try:
        results = {}
        for name, policy in POLICIES.items():
            results[name] = asyncio.run(run(policy, args))
            print(name, results[name], flush=True)
    finally:
        for hog in hogs:
            hog.terminate()
    before, now = results["before"]["end_lag_ms"], results["now"]["end_lag_ms"]
    summary = {
        "config": vars(args),
        **{f"{k}_{name}": v for name, r in results.items() for k, v in r.items()},
        "end_lag_ratio_now_vs_before": round(now / before, 3) if before else None,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
