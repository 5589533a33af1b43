"""How the engine-building options every command shares become `build_engine` keywords and torch
settings: dtypes, prefill and quantisation modes, the KV cache dtype, threads, per-file model
overrides. (The command-line spellings of these options are `cli_options`'.)"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Any

from personaplex_voice.errors import UserError

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
