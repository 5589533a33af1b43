"""Typer options shared by every command that loads a model (`offline`, `voices`, `serve`...).

Use them as parameter annotations so `--model` and the per-file overrides read the same in
every command:

    def serve(model: ModelOpt = DEFAULT_MODEL, moshi_weight: MoshiWeightOpt = None, ...):
        build_engine(model, **source_overrides(moshi_weight, mimi_weight, tokenizer, voice_prompt_dir))
"""

from __future__ import annotations

from enum import Enum, StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer

from personaplex_voice.errors import UserError
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
# Below this LM width a model's matrices are too small to split between threads: more threads
# only add synchronisation (and, on a busy machine, spinning), so auto uses one.
TINY_LM_DIM = 1024


def source_overrides(
    moshi_weight: Path | None = None,
    mimi_weight: Path | None = None,
    tokenizer: Path | None = None,
    voice_prompt_dir: Path | None = None,
) -> dict[str, Any]:
    """The per-file overrides as `build_engine` / `resolve_model` keywords."""
    return {
        "moshi_weight": moshi_weight,
        "mimi_weight": mimi_weight,
        "tokenizer": tokenizer,
        "voice_prompt_dir": voice_prompt_dir,
    }


def parse_dtype(name: str | None) -> Any:
    """`--dtype` to a torch dtype; None for auto (the engine picks per device)."""
    if name is None or name == "auto":
        return None
    import torch

    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in table:
        raise UserError(f"--dtype {name}: choose one of auto, {', '.join(table)}")
    return table[name]


def parse_kv_dtype(name: str | None) -> Any:
    """`--kv-dtype` to a torch dtype; None for auto (the LM's own dtype)."""
    if name is None or name == "auto":
        return None
    import torch

    table = {
        "float32": torch.float32,
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
        "float8": torch.float8_e4m3fn,
    }
    if name not in table:
        raise UserError(f"--kv-dtype {name}: choose one of auto, {', '.join(table)}")
    return table[name]


def engine_options(
    prefill: str | Enum, quantize: str | Enum, kv_dtype: str | Enum, cuda_graphs: bool = True
) -> dict[str, Any]:
    """`--prefill`, `--quantize`, `--kv-dtype` and `--no-cuda-graphs` as `build_engine` keywords."""

    def value(option: str | Enum) -> str:
        return str(option.value if isinstance(option, Enum) else option)

    return {
        "prefill": value(prefill),
        "quantize": None if value(quantize) == "none" else value(quantize),
        "kv_dtype": parse_kv_dtype(value(kv_dtype)),
        # None: the engine's default (graphs on CUDA); False: eager, asked for.
        "cuda_graphs": None if cuda_graphs else False,
    }


def configure_threads(threads: int, engine: Any) -> None:
    """Apply `--threads` once the engine (and so the model size and device) is known."""
    import torch

    if threads < 0:
        raise UserError(f"--threads {threads}: must be 0 (auto) or more")
    if threads > 0:
        torch.set_num_threads(threads)
        return
    cfg = getattr(engine, "cfg", None)
    dim = getattr(getattr(cfg, "lm", None), "dim", None)
    device = str(getattr(engine, "device", "cpu"))
    if device.startswith("cpu") and dim is not None and dim < TINY_LM_DIM:
        torch.set_num_threads(1)
