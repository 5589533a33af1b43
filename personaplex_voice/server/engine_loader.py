"""Build the server's engine from its settings. Runs in a worker thread during startup.

`--engine echo` builds the LoopbackEngine directly so that torch is never imported; the real
model comes from the engine factory (which resolves `demo`, a model dir or a Hugging Face repo).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from personaplex_voice.server.config import ServerSettings

Progress = Callable[[str], None]

# What the echo engine "says": the browser transcript and the protocol tests need text pieces.
ECHO_TEXT = (" Hello", " from", " the", " echo", " engine.", " I", " repeat", " what", " you", " say.")


def load_engine(settings: ServerSettings, progress: Progress) -> Any:
    if settings.engine == "echo":
        from personaplex_voice.engine.loopback import LoopbackEngine

        progress(f"starting the echo engine ({settings.max_sessions} slots)")
        return LoopbackEngine(num_slots=settings.max_sessions, text_pieces=ECHO_TEXT)

    from personaplex_voice.engine.factory import build_engine

    device = resolve_device(settings.device)
    progress(f"loading model {settings.model} on {device} ({settings.max_sessions} slots)")
    overrides: dict[str, Any] = {}
    if settings.voice_dir is not None:
        overrides["voice_prompt_dir"] = settings.voice_dir
    return build_engine(
        settings.model, engine="model", num_slots=settings.max_sessions, device=device, **overrides
    )


def resolve_device(device: str) -> str:
    """`auto` is the first CUDA device when there is one, else the CPU."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def warm_engine(engine: Any) -> None:
    """Run the engine's own warm-up (kernel selection, CUDA graph capture) when it has one."""
    warmup = getattr(engine, "warmup", None)
    if callable(warmup):
        warmup()
