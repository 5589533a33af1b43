"""Typer options shared by every command that loads a model (`offline`, `voices`, `serve`...).

Use them as parameter annotations so `--model` and the per-file overrides read the same in
every command:

    def serve(model: ModelOpt = DEFAULT_MODEL, moshi_weight: MoshiWeightOpt = None, ...):
        build_engine(model, **source_overrides(moshi_weight, mimi_weight, tokenizer, voice_prompt_dir))

(`source_overrides` and the other helpers that turn these values into engine keywords live in
`personaplex_voice.engine.options`.)
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from personaplex_voice.model.sources import DEFAULT_REPO

DEFAULT_MODEL = DEFAULT_REPO

ModelOpt = Annotated[
    str,
    typer.Option(
        "--model",
        help="'demo' (tiny random model, babbles), a model directory, or a Hugging Face repo id.",
    ),
]
MoshiWeightOpt = Annotated[
    Path | None, typer.Option("--moshi-weight", help="Local LM weights file (replaces the model's).")
]
MimiWeightOpt = Annotated[
    Path | None, typer.Option("--mimi-weight", help="Local Mimi weights file (replaces the model's).")
]
TokenizerOpt = Annotated[
    Path | None, typer.Option("--tokenizer", help="Local SentencePiece tokenizer (replaces the model's).")
]
VoiceDirOpt = Annotated[
    Path | None,
    typer.Option("--voice-prompt-dir", help="Directory of voice prompts (replaces the model's voices)."),
]
DeviceOpt = Annotated[
    str, typer.Option("--device", help="auto (cuda when available, else cpu), cpu, cuda, cuda:1...")
]
DtypeOpt = Annotated[
    str,
    typer.Option("--dtype", help="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16 or float16."),
]


class PrefillMode(StrEnum):
    parallel = "parallel"
    stepwise = "stepwise"


class QuantizeMode(StrEnum):
    none = "none"
    int8 = "int8"


class KvDtype(StrEnum):
    auto = "auto"
    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"
    float8 = "float8"


PrefillOpt = Annotated[
    PrefillMode,
    typer.Option(
        "--prefill",
        help="How the system prompt is run: parallel (fast, the default) or stepwise (step by step "
        "as published: reproduces the published bfloat16 run bit for bit).",
    ),
]
QuantizeOpt = Annotated[
    QuantizeMode,
    typer.Option(
        "--quantize", help="int8: the LM's linear weights as int8 rows (about half the memory of bfloat16)."
    ),
]
KvDtypeOpt = Annotated[
    KvDtype,
    typer.Option(
        "--kv-dtype",
        help="The LM's KV cache: auto (the LM dtype), bfloat16, float16, float32, or float8 (half of "
        "bfloat16: twice the calls in the same memory).",
    ),
]
CudaGraphsOpt = Annotated[
    bool,
    typer.Option(
        "--cuda-graphs/--no-cuda-graphs",
        help="On a GPU, run every tick as one captured CUDA graph (the default; a capture that "
        "fails stops the start). --no-cuda-graphs runs eagerly: same output, far slower per tick.",
    ),
]
ThreadsOpt = Annotated[
    int,
    typer.Option(
        "--threads",
        help="CPU threads for torch; 0 = auto (1 for tiny models like demo, torch's default otherwise).",
    ),
]
