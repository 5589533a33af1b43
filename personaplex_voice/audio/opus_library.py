"""libopus, through opuslib, loaded at first use.

opuslib loads libopus when it is imported and raises a bare `Exception` ("Could not find Opus
library") when there is none, so importing it at module level would make every command need
libopus, `offline` and `voices` included, which never touch Opus. `opuslib` below stands for
the module and imports it at the first attribute used; `require_opus()` checks up front (the
server, before it starts). A machine without libopus gets `OpusUnavailableError`: one line
naming the package to install.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from ..errors import UserError

MISSING_OPUS = (
    "the Opus codec library libopus is not installed (needed for /api/chat audio): "
    "on Debian/Ubuntu `sudo apt-get install libopus0`, on macOS `brew install opus`"
)
_module: ModuleType | None = None


class OpusUnavailableError(UserError):
    """libopus (or the opuslib package) cannot be loaded on this machine."""


def require_opus() -> ModuleType:
    """The opuslib module, imported now if it was not yet; `OpusUnavailableError` if it cannot be."""
    global _module
    if _module is None:
        try:
            import opuslib
            import opuslib.api
            import opuslib.api.ctl
            import opuslib.api.decoder
            import opuslib.api.encoder
        except ImportError as exc:
            if exc.name == "opuslib":
                raise OpusUnavailableError(
                    "the Python package opuslib is not installed (pip install opuslib)"
                ) from None
            raise OpusUnavailableError(f"{MISSING_OPUS} ({exc})") from None
        except Exception:  # what opuslib raises when it finds no libopus (or cannot load it)
            raise OpusUnavailableError(MISSING_OPUS) from None
        _module = opuslib
    return _module


class _LazyOpuslib:
    def __getattr__(self, name: str) -> Any:
        return getattr(require_opus(), name)


opuslib: Any = _LazyOpuslib()
