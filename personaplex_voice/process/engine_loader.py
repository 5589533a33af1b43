"""Build the server's engine from its settings. Runs in a worker thread during startup.

Both engines come from the engine factory: `--engine echo` (the LoopbackEngine, torch never
imported) and the real model (`demo`, a model dir or a Hugging Face repo).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from personaplex_voice.process.settings import ServerSettings

Progress = Callable[[str], None]

# What the echo engine "says": the browser transcript and the protocol tests need text pieces.
ECHO_TEXT = (" Hello", " from", " the", " echo", " engine.", " I", " repeat", " what", " you", " say.")


def load_engine(settings: ServerSettings, progress: Progress) -> Any:
    from personaplex_voice.engine.factory import build_engine, resolve_device

    if settings.engine == "echo":  # the factory builds it without importing torch
        progress(f"starting the echo engine ({settings.max_sessions} slots)")
        return build_engine(engine="echo", num_slots=settings.max_sessions, text_pieces=ECHO_TEXT)

    from personaplex_voice.engine.options import (
        configure_threads,
        engine_options,
        parse_dtype,
        source_overrides,
    )

    device = resolve_device(settings.device)
    if settings.threads:  # before loading too: the load itself runs torch ops
        configure_threads(settings.threads, None)
    progress(f"loading model {settings.model} on {device} ({settings.max_sessions} slots)")
    overrides = source_overrides(
        settings.moshi_weight, settings.mimi_weight, settings.tokenizer, settings.voice_dir
    )
    engine = build_engine(
        settings.model,
        engine="model",
        num_slots=settings.max_sessions,
        device=device,
        dtype=parse_dtype(settings.dtype),
        **engine_options(settings.prefill, settings.quantize, settings.kv_dtype, settings.cuda_graphs),
        **{k: v for k, v in overrides.items() if v is not None},
        **offload_options(settings),
    )
    configure_threads(settings.threads, engine)  # auto needs the model's size and device
    return engine


def offload_options(settings: ServerSettings) -> dict[str, Any]:
    """`--cpu-offload` as `build_engine` keywords (the persona cache is part of its plan)."""
    if not settings.cpu_offload:
        return {}
    return {"cpu_offload": True, "persona_cache_bytes": round(settings.persona_cache_mb * (1 << 20))}


def warm_engine(engine: Any) -> None:
    """Run the engine's warm-up (a prefill and ticks: kernel selection, allocator growth, CUDA graph
    capture) before the server says ready, so the first caller's first frame costs what later
    ones do. An engine without one (the echo engine) has nothing to warm."""
    warmup = getattr(engine, "warmup", None)
    if callable(warmup):
        warmup()
