"""Per-frame engine cost and persona prefill time, one CPU thread.

    .venv/bin/python bench/engine_step.py --model ../shared/golden

Measures, through the Engine protocol (what the session manager calls):
- `frame_ms_b1` / `frame_ms_b8`: one `step` (Mimi encode + LM temporal and depth transformers +
  Mimi decode) with 1 and 8 active slots, median over the timed frames;
- `prefill_ms`: `start` of the golden `pt_voice` persona (TINYF0.pt + "You enjoy having a good
  conversation.", 60 prompt steps), median of a few runs;
- `load_s`, `load_peak_rss_mb`: building the batch-1 engine (weights read, state allocated) and
  the process's peak resident memory meanwhile (Linux: counted from just before the build);
- `first_step_ms`: the first `step` of a call on an engine after `warmup()` (what a server's first
  caller pays), `first_step_cold_ms` the same on an engine without warm-up; compare with
  `frame_ms_b1`.
The published code takes about 21 ms per frame and 0.89 s for that prompt on this machine's CPU
with one thread (measured once by the lead; it cannot run in this venv). Ratios against those
numbers are printed with the results. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
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
from personaplex_voice.model.loaders import host_peak_rss_mb, reset_host_peak  # noqa: E402

REFERENCE_FRAME_MS = 21.0
REFERENCE_PREFILL_MS = 890.0
PT_VOICE_PROMPT = "You enjoy having a good conversation."


def user_frames(model: str, n: int) -> np.ndarray:
    """The golden user audio when the model dir has it, else seeded noise at speech level."""
    wav = Path(model) / "user.wav"
    if wav.is_file():
        from personaplex_voice.audio.io import read_audio

        pcm = read_audio(wav)
    else:
        pcm = (0.05 * np.random.default_rng(0).standard_normal(n * FRAME_SIZE)).astype(np.float32)
    pcm = np.resize(pcm, n * FRAME_SIZE)  # repeat if the file is shorter than the run
    return pcm.reshape(n, FRAME_SIZE)


def time_steps(engine, frames: np.ndarray, warmup: int) -> tuple[float, float]:
    """Median wall and CPU (this thread) milliseconds per `step`. On a shared machine the CPU time
    is the better estimate of the uncontended wall time."""
    slots = engine.num_slots
    active = np.ones(slots, dtype=bool)
    wall, cpu = [], []
    for i, frame in enumerate(frames):
        batch = np.repeat(frame[None], slots, axis=0)
        t0, c0 = time.perf_counter(), time.thread_time()
        engine.step(batch, active)
        if i >= warmup:
            wall.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
    return 1000.0 * statistics.median(wall), 1000.0 * statistics.median(cpu)


def first_step(engine, prepared, frame: np.ndarray) -> float:
    """Milliseconds of the first `step` of a call started in slot 0 (the others idle)."""
    engine.start(0, prepared)
    batch = np.zeros((engine.num_slots, FRAME_SIZE), np.float32)
    batch[0] = frame
    active = np.zeros(engine.num_slots, dtype=bool)
    active[0] = True
    t0 = time.perf_counter()
    engine.step(batch, active)
    ms = 1000.0 * (time.perf_counter() - t0)
    engine.release(0)
    return ms


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=str(ROOT.parent / "shared" / "golden"))
    parser.add_argument("--voice", default="TINYF0.pt", help="voice of the prefill persona ('' = default)")
    parser.add_argument("--frames", type=int, default=40, help="timed frames per batch size")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--prefill-runs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    persona = Persona(
        text_prompt=PT_VOICE_PROMPT, voice=args.voice or None, sampling=Sampling(greedy=True), seed=0
    )
    frames = user_frames(args.model, args.frames + args.warmup)

    reset_host_peak()
    t0 = time.perf_counter()
    engine = build_engine(args.model, num_slots=1, device=args.device)
    load_s = time.perf_counter() - t0
    load_peak_rss_mb = host_peak_rss_mb()
    engine.warmup()
    prepared = engine.prepare(persona)
    first_step_ms = first_step(engine, prepared, frames[0])
    prefill, prefill_cpu = [], []
    for _ in range(args.prefill_runs + 1):  # the first run warms up
        t0, c0 = time.perf_counter(), time.thread_time()
        engine.start(0, prepared)
        prefill.append(time.perf_counter() - t0)
        prefill_cpu.append(time.thread_time() - c0)
    prefill_ms = 1000.0 * statistics.median(prefill[1:])
    prefill_cpu_ms = 1000.0 * statistics.median(prefill_cpu[1:])
    frame_ms_b1, frame_cpu_b1 = time_steps(engine, frames, args.warmup)
    print(
        f"batch 1: {frame_ms_b1:.2f} ms/frame (cpu {frame_cpu_b1:.2f}), "
        f"prefill {prefill_ms:.1f} ms (cpu {prefill_cpu_ms:.1f}, {prepared.prompt_steps} steps)"
    )
    del engine

    engine = build_engine(args.model, num_slots=args.batch, device=args.device)
    first_step_cold_ms = first_step(engine, prepared, frames[0])
    for slot in range(args.batch):
        engine.start(slot, prepared)
    frame_ms_b8, frame_cpu_b8 = time_steps(engine, frames, args.warmup)
    print(
        f"batch {args.batch}: {frame_ms_b8:.2f} ms/frame (cpu {frame_cpu_b8:.2f}), "
        f"{frame_ms_b8 / args.batch:.2f} ms per slot"
    )

    result = {
        "frame_ms_b1": round(frame_ms_b1, 3),
        "frame_ms_b8": round(frame_ms_b8, 3),
        "prefill_ms": round(prefill_ms, 2),
        "frame_cpu_ms_b1": round(frame_cpu_b1, 3),
        "frame_cpu_ms_b8": round(frame_cpu_b8, 3),
        "prefill_cpu_ms": round(prefill_cpu_ms, 2),
        "prompt_steps": prepared.prompt_steps,
        "load_s": round(load_s, 3),
        "load_peak_rss_mb": round(load_peak_rss_mb, 1),
        "first_step_ms": round(first_step_ms, 3),
        "first_step_cold_ms": round(first_step_cold_ms, 3),
        "threads": args.threads,
        "reference_frame_ms": REFERENCE_FRAME_MS,
        "reference_prefill_ms": REFERENCE_PREFILL_MS,
        "speedup_frame_b1": round(REFERENCE_FRAME_MS / frame_ms_b1, 2),
        "speedup_prefill": round(REFERENCE_PREFILL_MS / prefill_ms, 2),
        # On a shared machine wall time includes waiting for a core; CPU time does not.
        "speedup_frame_b1_cpu": round(REFERENCE_FRAME_MS / frame_cpu_b1, 2),
        "b8_vs_8x_b1": round(frame_ms_b8 / (args.batch * frame_ms_b1), 3),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
