"""Late input and joining callers on a realtime SessionManager: do they cost a running call?

    .venv/bin/python bench/session_jitter.py [--sessions 8] [--seconds 8] [--stall-ms 250]
        [--jitter-ms 0] [--lead-ms none] [--cpu-hogs 0]
    .venv/bin/python bench/session_jitter.py --prefill-storm [--model ../shared/golden] [--joins 8]

`--prefill-storm`: on the golden tiny model (one CPU thread), one call streams 6 s in real time,
alone and then while `--joins` callers with distinct ~4,000-character personas (over a thousand
prompt positions each) join; printed: the call's output frame gap p50/p99/max in both runs, the
p99 ratio storm / alone (goal: at most 1.5), the joins' total time and the tick overruns. The
policy itself (prefill chunks only where they fit before the next tick) is tested exactly on
fake time in tests/test_scheduler_policies.py.

Without `--prefill-storm`:
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


STORM_STREAM_S = 6.0


async def storm_call(manager: SessionManager, frames: np.ndarray, persona: Persona, joins: int) -> dict:
    """Stream `STORM_STREAM_S` of `frames` into one session in real time; from 0.5 s on,
    `joins` callers with distinct long personas join (and leave once ready). Returns the call's
    output frame gaps after a second of warm-up and how long the joins took."""
    session = await manager.open(persona)
    await asyncio.wait_for(session.ready(), 10)
    n_frames = round(STORM_STREAM_S / FRAME_S)
    t0 = time.monotonic() + 0.05

    async def push() -> None:
        for k in range(n_frames):
            await asyncio.sleep(max(0.0, t0 + k * FRAME_S - time.monotonic()))
            session.push(frames[k % len(frames)])

    async def join_storm() -> float:
        from support_engine import SERVICE_PROMPT

        await asyncio.sleep(max(0.0, t0 + 0.5 - time.monotonic()))
        started = time.monotonic()
        prompts = [(f"Caller number {i}. " + " ".join([SERVICE_PROMPT] * 30))[:4000] for i in range(joins)]
        joiners = [await manager.open(Persona(text_prompt=p, voice=persona.voice)) for p in prompts]
        await asyncio.wait_for(asyncio.gather(*(j.ready() for j in joiners)), 60)
        took = time.monotonic() - started
        for joiner in joiners:
            await joiner.close()
        return took

    pusher = asyncio.create_task(push())
    storm = asyncio.create_task(join_storm()) if joins else None
    arrivals = []
    frames_out = session.frames()
    for _ in range(n_frames - 2):
        await asyncio.wait_for(frames_out.__anext__(), 10)
        arrivals.append(time.monotonic())
    await pusher
    took = await storm if storm is not None else 0.0
    await session.close()
    gaps = np.diff(arrivals)[round(1.0 / FRAME_S) :]
    return {"gaps": gaps, "joins_s": took}


def prefill_storm(args: argparse.Namespace) -> dict:
    import sys
    from pathlib import Path

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from support_engine import user_frames

    from personaplex_voice.engine.base import Sampling
    from personaplex_voice.engine.generator import PersonaPlexEngine, golden_like_files

    torch.set_num_threads(1)
    model = Path(args.model)
    engine = PersonaPlexEngine(golden_like_files(model), num_slots=args.joins + 1)
    persona = Persona(text_prompt="Hello.", voice="TINYF0.pt", sampling=Sampling(greedy=True))

    async def both() -> tuple[dict, dict, float]:
        manager = SessionManager(engine, realtime=True, idle_timeout_s=None)
        try:
            alone = await storm_call(manager, user_frames(model), persona, joins=0)
            stormy = await storm_call(manager, user_frames(model), persona, joins=args.joins)
        finally:
            await manager.shutdown()
        return alone, stormy, manager.metrics.tick_overruns.value

    alone, stormy, overruns = asyncio.run(both())

    def row(gaps: np.ndarray) -> dict:
        return {f"gap_{q}_ms": round(float(np.percentile(gaps, q)) * 1000, 1) for q in (50, 99)} | {
            "gap_max_ms": round(float(gaps.max()) * 1000, 1)
        }

    summary = {
        "alone": row(alone["gaps"]),
        f"with_{args.joins}_long_joins": row(stormy["gaps"]),
        "joins_took_s": round(stormy["joins_s"], 2),
        "tick_overruns": overruns,
        "p99_ratio_storm_vs_alone": round(
            float(np.percentile(stormy["gaps"], 99) / np.percentile(alone["gaps"], 99)), 3
        ),
    }
    return summary


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
    parser.add_argument("--prefill-storm", action="store_true", help="long-persona joins beside a call")
    parser.add_argument("--model", default="../shared/golden", help="--prefill-storm: the golden model dir")
    parser.add_argument("--joins", type=int, default=8, help="--prefill-storm: joining callers")
    args = parser.parse_args()
    if args.prefill_storm:
        print(json.dumps(prefill_storm(args)))
        return
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
