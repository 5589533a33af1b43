"""Batched tick time and time-to-ready of a session, one CPU thread.

    .venv/bin/python bench/engine_batch.py --model ../shared/golden

Measures:
- `tick_ms[N]`: one batched `engine.step` with N slots all active (the tick the SessionManager
  runs every 80 ms), median over the timed frames, for N = 1, 4, 16, 32;
- `ready_ms_parallel` / `ready_ms_stepwise`: `manager.open(persona)` until `session.ready()`
  returns, persona cache off, with the engine's parallel prompt prefill and with the stepwise
  (published) path; the `pt_voice` persona (TINYF0.pt + "You enjoy having a good
  conversation.", 60 prompt steps);
- `ready_ms_cached`: the same with the persona already in the persona cache (a restore).
`ready_ms_*` include `engine.prepare` (voice load, prompt planning); `prefill_ms_*` and
`restore_ms` are the engine part alone (the manager's prefill / restore histograms);
`*_cpu_*` are the same in CPU time (steadier on a shared machine); `manager_overhead_ms_64`
is the manager's own CPU per tick (not `engine.step`) with 64 LoopbackEngine sessions,
consumers included.
Targets: tick_ms["16"] <= 3 x tick_ms["1"], ready_ms_cached within one tick, parallel >= 10x
faster than stepwise. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from personaplex_voice.engine.base import FRAME_SIZE, Persona, Sampling  # noqa: E402
from personaplex_voice.engine.factory import build_engine  # noqa: E402
from personaplex_voice.sessions import SessionManager  # noqa: E402

PERSONA = Persona(
    text_prompt="You enjoy having a good conversation.", voice="TINYF0.pt", sampling=Sampling(greedy=True)
)
REFERENCE_PREFILL_MS = 890.0  # the published code, stepwise, same prompt, this machine (lead's figure)


def tick_ms(model: str, slots: int, frames: int, warmup: int) -> tuple[float, float]:
    """(median wall ms, median CPU ms) of one batched step with every slot active."""
    engine = build_engine(model, num_slots=slots)
    prepared = engine.prepare(PERSONA)
    engine.start(0, prepared)
    snapshot = engine.snapshot(0)
    for slot in range(1, slots):
        engine.restore(slot, snapshot, prepared)
    rng = np.random.default_rng(0)
    active = np.ones(slots, dtype=bool)
    times, cpu = [], []
    for i in range(warmup + frames):
        pcm = (0.05 * rng.standard_normal((slots, FRAME_SIZE))).astype(np.float32)
        t0, c0 = time.perf_counter(), time.thread_time()  # one torch thread: this one
        engine.step(pcm, active)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
    return statistics.median(times) * 1000.0, statistics.median(cpu) * 1000.0


async def ready_times(model: str, prefill: str, cached: bool, runs: int) -> tuple[float, float, float]:
    """(median open->ready wall ms, its process CPU ms, mean engine prefill-or-restore ms)
    through a SessionManager."""
    engine = build_engine(model, num_slots=2, prefill=prefill)
    manager = SessionManager(engine, realtime=False, cache_bytes=(1 << 30) if cached else 0)
    await manager.start()
    try:
        if cached:  # prime the cache
            session = await manager.open(PERSONA)
            await session.ready()
            await session.close()
        times, cpu = [], []
        for _ in range(runs):
            t0, c0 = time.perf_counter(), time.process_time()
            session = await manager.open(PERSONA)
            await session.ready()
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            await session.close()
        hist = manager.metrics.restore_seconds if cached else manager.metrics.prefill_seconds
        engine_ms = hist.sum / hist.count * 1000.0 if hist.count else float("nan")
        if cached:
            assert manager.metrics.cache_hits.value == runs
        return statistics.median(times) * 1000.0, statistics.median(cpu) * 1000.0, engine_ms
    finally:
        await manager.shutdown()


async def manager_overhead_ms(slots: int, frames: int = 50) -> float:
    """CPU ms per tick spent outside `engine.step` (scheduler, framing, frame hand-over to the
    consumers' loop) with `slots` LoopbackEngine sessions: the manager's own cost per tick."""
    from personaplex_voice.engine.loopback import LoopbackEngine

    manager = SessionManager(LoopbackEngine(num_slots=slots), realtime=False, output_frames=frames + 8)
    await manager.start()
    try:
        sessions = [await manager.open(Persona()) for _ in range(slots)]
        for session in sessions:
            await session.ready()

        async def drain(session) -> None:
            async for _ in session.frames():
                pass

        cpu0 = time.process_time()
        for session in sessions:
            session.push(np.zeros(frames * FRAME_SIZE, np.float32))
            session.end_input()
        await asyncio.gather(*(drain(s) for s in sessions))
        cpu = time.process_time() - cpu0 - manager.metrics.tick_seconds.sum
        return cpu / manager.metrics.ticks.value * 1000.0
    finally:
        await manager.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="../shared/golden")
    parser.add_argument("--slots", default="1,4,16,32", help="comma-separated slot counts")
    parser.add_argument("--frames", type=int, default=12, help="timed steps per slot count")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--runs", type=int, default=5, help="opens per ready measurement")
    args = parser.parse_args()
    torch.set_num_threads(1)

    ticks, tick_cpu = {}, {}
    for n in (int(s) for s in args.slots.split(",")):
        wall, cpu = tick_ms(args.model, n, args.frames, args.warmup)
        ticks[str(n)], tick_cpu[str(n)] = round(wall, 2), round(cpu, 2)
        print(f"tick with {n:>2} slots: {wall:8.2f} ms ({cpu:.2f} ms CPU)", flush=True)
    cached, cached_cpu, restore_ms = asyncio.run(ready_times(args.model, "parallel", True, args.runs))
    parallel, parallel_cpu, prefill_parallel = asyncio.run(
        ready_times(args.model, "parallel", False, args.runs)
    )
    stepwise, stepwise_cpu, prefill_stepwise = asyncio.run(
        ready_times(args.model, "stepwise", False, max(2, args.runs // 2))
    )
    overhead = asyncio.run(manager_overhead_ms(64))
    print(f"manager overhead per tick with 64 loopback sessions: {overhead:.2f} ms CPU")
    print(f"ready: cached {cached:.1f} ms, parallel {parallel:.1f} ms, stepwise {stepwise:.1f} ms")
    print(
        f"engine only: restore {restore_ms:.2f} ms, parallel prefill {prefill_parallel:.1f} ms, "
        f"stepwise prefill {prefill_stepwise:.1f} ms"
    )
    result = {
        "tick_ms": ticks,
        "ready_ms_cached": round(cached, 2),
        "ready_ms_parallel": round(parallel, 2),
        "ready_ms_stepwise": round(stepwise, 2),
        "tick_cpu_ms": tick_cpu,
        "ready_cpu_ms_cached": round(cached_cpu, 2),
        "ready_cpu_ms_parallel": round(parallel_cpu, 2),
        "ready_cpu_ms_stepwise": round(stepwise_cpu, 2),
        "restore_ms": round(restore_ms, 3),
        "prefill_ms_parallel": round(prefill_parallel, 2),
        "prefill_ms_stepwise": round(prefill_stepwise, 2),
        "manager_overhead_ms_64": round(overhead, 2),
    }
    if "1" in ticks:
        result["ratios"] = {
            **{f"tick_{n}_vs_1": round(ticks[n] / ticks["1"], 2) for n in ticks if n != "1"},
            **{f"tick_cpu_{n}_vs_1": round(tick_cpu[n] / tick_cpu["1"], 2) for n in tick_cpu if n != "1"},
            "cached_ready_in_ticks_1": round(cached / ticks["1"], 2),
            "cached_ready_cpu_in_ticks_1": round(cached_cpu / tick_cpu["1"], 2),
            "prefill_stepwise_vs_parallel": round(prefill_stepwise / prefill_parallel, 1),
            "ready_stepwise_vs_parallel": round(stepwise / parallel, 1),
            "prefill_parallel_vs_reference_stepwise": round(REFERENCE_PREFILL_MS / prefill_parallel, 1),
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
