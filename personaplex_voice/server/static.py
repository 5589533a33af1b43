"""Where the browser client (`web/`) lives at runtime.

A wheel installs it as the package `personaplex_voice.web` (pyproject maps `web/` there); an
editable install does not, so fall back to the checkout's `web/` folder.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path

_CHECKOUT_WEB = Path(__file__).resolve().parents[2] / "web"


def web_root() -> Path | None:
    try:
        packaged = Path(str(importlib.resources.files("personaplex_voice.web")))
    except (ModuleNotFoundError, TypeError):
        packaged = None
    for candidate in (packaged, _CHECKOUT_WEB):
        if candidate is not None and (candidate / "index.html").is_file():
            return candidate
    return None
