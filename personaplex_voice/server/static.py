"""Where the browser client (`web/`) lives at runtime.

A wheel installs it as the package `personaplex_voice.web` (pyproject maps `web/` there); an
editable install does not, so fall back to the checkout's `web/` folder.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path

_CHECKOUT_WEB = Path(__file__).resolve().parents[2] / "web"


def _packaged_web() -> Path | None:
    try:
        # `web/` has no __init__.py: a namespace package, whose `files()` is a MultiplexedPath
        # (not a filesystem path itself); joining a file name gives a real path.
        index = importlib.resources.files("personaplex_voice.web").joinpath("index.html")
    except (ModuleNotFoundError, TypeError, ValueError, AttributeError):
        return None
    return index.parent if isinstance(index, Path) else None


def web_root() -> Path | None:
    for candidate in (_packaged_web(), _CHECKOUT_WEB):
        if candidate is not None and (candidate / "index.html").is_file():
            return candidate
    return None
