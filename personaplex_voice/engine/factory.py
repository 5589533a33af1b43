"""Build the engine a command asked for: the real model from any source, or the echo engine.

The server, the Pipecat bridge and the offline CLI all call `build_engine`, so `--model` means
the same everywhere.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from personaplex_voice.engine.base import Engine
from personaplex_voice.errors import UserError

log = logging.getLogger(__name__)

ENGINE_KINDS = ("model", "echo")
# resolve_model's keyword arguments; everything else in **overrides goes to the engine.
_SOURCE_OPTIONS = ("moshi_weight", "mimi_weight", "tokenizer", "voice_prompt_dir", "hf_repo")


def build_engine(
    model: str | os.PathLike[str] | None = "demo",
    *,
    engine: str = "model",
    num_slots: int = 1,
    device: str = "cpu",
    dtype: Any = None,
    **overrides: Any,
) -> Engine:
    """An `Engine` with `num_slots` batch slots.

    `model`: "demo", a model directory or a hub repo id (see `model/sources.py`).
    `device`: a torch device, or "auto" (cuda when available, else cpu).
    `engine`: "model" (PersonaPlexEngine) or "echo" (LoopbackEngine: numpy only, torch never
    imported, `model` unused; `overrides` go to LoopbackEngine, e.g. `text_pieces`).
    `overrides`: per-file paths (`moshi_weight`, `mimi_weight`, `tokenizer`, `voice_prompt_dir`,
    `hf_repo`); `cpu_offload` (with `persona_cache_bytes`, what the plan leaves the persona
    cache): plan the card's memory as engine/offload.py says, a one-line no-op on the CPU; any
    other keyword is passed on to `PersonaPlexEngine`.
    Raises `UserError` for anything the user can fix.
    """
    if num_slots < 1:
        raise UserError(f"num_slots must be at least 1, got {num_slots}")
    if engine == "echo":
        from personaplex_voice.engine.loopback import LoopbackEngine

        try:
            return LoopbackEngine(num_slots=num_slots, **overrides)
        except TypeError as exc:
            raise UserError(f"the echo engine does not take these options: {exc}") from None
    if engine != "model":
        raise UserError(f"unknown engine {engine!r}: choose one of {', '.join(ENGINE_KINDS)}")

    from personaplex_voice.model.sources import resolve_model

    device = resolve_device(device)
    source_options = {k: overrides.pop(k) for k in _SOURCE_OPTIONS if k in overrides}
    files = resolve_model(model, **source_options)

    from personaplex_voice.engine.generator import PersonaPlexEngine

    if files.is_demo:
        from personaplex_voice.model.demo import DEMO_NOTICE

        log.warning(DEMO_NOTICE)
    offloaded = None
    cpu_offload = overrides.pop("cpu_offload", False)
    persona_cache_bytes = overrides.pop("persona_cache_bytes", 2**30)
    if cpu_offload and not str(device).startswith("cuda"):
        from personaplex_voice.engine.offload import CPU_NOTICE

        log.warning(CPU_NOTICE)
    elif cpu_offload:  # plan for the card, load that way (engine/offload.py)
        from personaplex_voice.engine.offload import OffloadedModel

        offloaded = OffloadedModel.load(
            files,
            device,
            dtype,
            num_slots=num_slots,
            quantize=overrides.pop("quantize", None),
            kv_dtype=overrides.get("kv_dtype"),
            persona_cache_bytes=persona_cache_bytes,
        )
        overrides.update(models=(offloaded.mimi, offloaded.lm), kv_dtype=offloaded.kv_dtype)
    try:
        built = PersonaPlexEngine(files, num_slots=num_slots, device=device, dtype=dtype, **overrides)
    except (ValueError, TypeError) as exc:
        # The engine refuses a config or an option (other frame rate, unknown keyword...).
        raise UserError(f"cannot run model {files.name}: {exc}") from None
    if offloaded is not None:
        built.offload = offloaded
        built.load_stats = offloaded.stats
    if files.is_demo:
        from personaplex_voice.engine.demo_voices import ensure_demo_voices

        ensure_demo_voices(built)
    return built


def resolve_device(device: str) -> str:
    """`auto` becomes cuda when torch sees a GPU, else cpu; anything else is checked as given."""
    import torch

    if device == "auto":  # the GPU when there is one
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError):
        raise UserError(f"--device {device}: not a torch device (try cpu or cuda)") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {device}: CUDA is not available on this machine (use --device cpu)")
    return device
