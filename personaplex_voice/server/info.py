"""What the server says about itself to callers, without local paths.

* `public_model_name`: the model as `/healthz`, `/readyz` and the 0x04 metadata name it. A local
  model directory or weight file is named by its last path component, never its full path.
* `reference_client_fields`: the fields NVIDIA's PersonaPlex web client requires in the 0x04
  metadata (its server-info panel validates them with a schema and shows nothing, with a console
  error, when one is missing), with values true to this server: it applies no repetition
  penalty and no text padding multiplier, and it is a Python server, not the Rust one whose
  build the `build_info` fields were made for.
"""

from __future__ import annotations

import functools
import importlib.metadata
import platform
import re
import sys
from pathlib import Path
from typing import Any

from personaplex_voice.process.settings import ServerSettings

# A Hugging Face repo id (`owner/name`); anything else with a separator is taken as a path.
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_local_path(name: str) -> bool:
    if not name or name in ("demo", "echo", "loopback"):
        return False
    if _REPO_ID.match(name) and not Path(name).exists():
        return False
    return "/" in name or "\\" in name or Path(name).expanduser().exists()


def public_model_name(name: str) -> str:
    return Path(name).name or name if is_local_path(name) else name


def redact_paths(text: str, settings: ServerSettings) -> str:
    """`text` (a load status line) with the settings' local paths reduced to their last part."""
    for path in _local_paths(settings):
        text = text.replace(path, Path(path).name or path)
    return text


def _local_paths(settings: ServerSettings) -> list[str]:
    given = [
        settings.model,
        settings.moshi_weight,
        settings.mimi_weight,
        settings.tokenizer,
        settings.voice_dir,
    ]
    paths = [str(p) for p in given if p is not None and is_local_path(str(p))]
    return sorted(paths, key=len, reverse=True)  # longest first: a dir inside another is replaced whole


def lm_model_file(settings: ServerSettings, model_name: str) -> str:
    if settings.engine == "echo":
        return "none (echo engine)"
    if settings.moshi_weight is not None:
        return Path(settings.moshi_weight).name
    if settings.model == "demo":
        return "demo (random weights)"
    return f"{public_model_name(settings.model or model_name)}/model.safetensors"


def reference_client_fields(settings: ServerSettings, model_name: str) -> dict[str, Any]:
    return {
        "pad_mult": 0.0,
        "repetition_penalty_context": 0,
        "repetition_penalty": 1.0,
        "lm_model_file": lm_model_file(settings, model_name),
        "instance_name": settings.instance_name or platform.node() or "personaplex-voice",
        "build_info": build_info(),
    }


@functools.cache
def build_info() -> dict[str, str]:
    """The reference server's build-info keys, filled with what is true of this one."""
    try:
        version = importlib.metadata.version("personaplex-voice")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    python = f"CPython {platform.python_version()}"
    return {
        "build_timestamp": "unknown",
        "build_date": "unknown",
        "git_branch": "unknown",
        "git_timestamp": "unknown",
        "git_date": "unknown",
        "git_hash": "unknown",
        "git_describe": f"personaplex-voice {version}",
        "rustc_host_triple": "none (a Python server)",
        "rustc_version": f"none ({python})",
        "cargo_target_triple": f"{platform.machine() or 'unknown'}-{sys.platform}",
    }
