"""CUDA check of the full-size engine: random bf16 weights with the personaplex-7b-v1 architecture.

Prints, per slot count (1, 8, 16, 32, 48, 64 by default), the CUDA-graph tick time (Mimi encode +
LM + depth transformer + Mimi decode for every slot, host copies included) and the parallel
prefill time of one system prompt. The last line is one JSON object. Needs a CUDA GPU with
room for the weights (~16 GB) and 1.5 GB of KV cache per slot.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from types import SimpleNamespace

import numpy as np
import torch

import personaplex_voice.engine.generator as generator
from personaplex_voice.engine.base import FRAME_SIZE, Persona, Sampling
from personaplex_voice.model.config import ModelConfig
from personaplex_voice.model.loaders import load_lm, load_mimi

PROMPT = "You work for a waste management company and your name is Ayelen. Be helpful and concise."


class ByteTokenizer:
    """Stand-in for the SentencePiece model (not on the GPU box): only prompt lengths matter."""

    vocab_size = 256

    def __init__(self, path=None):
        pass

    def encode(self, text: str) -> list[int]:
        return [4 + b % 250 for b in text.encode()][: len(text.split()) * 2]

    def display_piece(self, token_id: int) -> str | None:
        return None


def time_engine(files, mimi, lm, n: int, graphs: bool, ticks: int, rng) -> tuple[float, float, int]:
    """(tick ms, prefill ms, prompt steps) of an engine with `n` slots, all active."""
    engine = generator.PersonaPlexEngine(
        files, num_slots=n, device="cuda", dtype=torch.bfloat16, cuda_graphs=graphs, models=(mimi, lm)
    )
    prepared = engine.prepare(Persona(text_prompt=PROMPT, sampling=Sampling(), seed=1))
    torch.cuda.synchronize()
    t = time.perf_counter()
    engine.start(0, prepared)
    torch.cuda.synchronize()
    prefill_ms = (time.perf_counter() - t) * 1000
    snap = engine.snapshot(0)
    for slot in range(1, n):
        engine.restore(slot, snap, prepared)
    active = np.ones(n, bool)
    pcm = (rng.standard_normal((n, FRAME_SIZE)) * 0.1).astype(np.float32)
    for _ in range(3):  # the first tick captures the graph
        engine.step(pcm, active)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(ticks):
        engine.step(pcm, active)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / ticks * 1000, prefill_ms, prepared.prompt_steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--slots", default="1,8,16,32,48,64")
    parser.add_argument("--ticks", type=int, default=30)
    parser.add_argument("--eager", action="store_true", help="also time the eager (non-graph) tick")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    torch.backends.cuda.matmul.allow_tf32 = True
    generator.TextTokenizer = ByteTokenizer  # type: ignore[misc, assignment]
    cfg = ModelConfig.personaplex_7b()
    files = SimpleNamespace(
        name="random-personaplex-7b",
        config=cfg,
        lm_weights=None,
        mimi_weights=None,
        tokenizer=None,
        voice_dirs=(),
        lm_dtype_in_file="bfloat16",
    )
    torch.manual_seed(0)
    t0 = time.perf_counter()
    mimi = load_mimi(cfg, None, "cuda")
    lm = load_lm(cfg, None, "cuda", torch.bfloat16)
    torch.cuda.synchronize()
    print(f"random weights on GPU in {time.perf_counter() - t0:.1f} s", flush=True)
    results: dict[str, float] = {}
    eager: dict[str, float] = {}
    prefill_ms = float("nan")
    rng = np.random.default_rng(0)
    for n in [int(x) for x in args.slots.split(",")]:
        for graphs in [True, False] if args.eager else [True]:
            try:
                tick, prefill_ms, steps = time_engine(files, mimi, lm, n, graphs, args.ticks, rng)
            except torch.cuda.OutOfMemoryError:
                print(f"{n} slots: out of GPU memory", flush=True)
                gc.collect()
                torch.cuda.empty_cache()
                continue
            (results if graphs else eager)[str(n)] = round(tick, 2)
            print(
                f"{n:3d} slots: {'graph' if graphs else 'eager'} tick {tick:7.2f} ms "
                f"(prefill of {steps} prompt steps {prefill_ms:.1f} ms, "
                f"GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB)",
                flush=True,
            )
            gc.collect()  # the graph runner and the engine reference each other
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    print(json.dumps({"tick_ms": results, "eager_tick_ms": eager, "prefill_ms": round(prefill_ms, 2)}))


if __name__ == "__main__":
    with torch.no_grad():
        main()
