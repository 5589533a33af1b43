"""libopus, through opuslib, loaded at first use.

opuslib loads libopus when it is imported and raises a bare `Exception` ("Could not find Opus
library") when there is none, so importing it at module level would make every command need
libopus, `offline` and `voices` included, which never touch Opus. `opuslib` below stands for
the module and imports it at the first attribute used; `require_opus()` checks up front (the
server, before it starts). A machine without libopus gets `OpusUnavailableError`: one line
naming the package to install.

Where libopus comes from, first found wins:
1. `$PERSONAPLEX_LIBOPUS`, a path to the shared library (an error if it names no file);
2. the project's own directory in the running environment, `<sys.prefix>/lib/personaplex-voice/`
   (where the offline bundle's `install.sh` puts Debian's libopus on a host that has none;
   docs/deploy.md): a library placed there belongs to this environment only, no system path is
   touched;
3. the system's, as opuslib itself finds it (`ctypes.util.find_library("opus")`).
opuslib asks `ctypes.util.find_library` once, at import; for 1 and 2 that one question is
answered with our path while opuslib imports.
"""

from __future__ import annotations

import contextlib
import ctypes.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from ..errors import UserError

MISSING_OPUS = (
    "the Opus codec library libopus is not installed (needed for /api/chat audio): "
    "on Debian/Ubuntu `sudo apt-get install libopus0`, on macOS `brew install opus`, on a host "
    "without network an offline bundle's install.sh (docs/deploy.md)"
)
LIBOPUS_ENV = "PERSONAPLEX_LIBOPUS"
# Under sys.prefix: the environment's own library directory for this project (install.sh's target).
PROJECT_LIB_DIR = Path("lib") / "personaplex-voice"
LIBOPUS_NAMES = ("libopus.so.0", "libopus.so", "libopus.0.dylib", "libopus.dylib")
_module: ModuleType | None = None


class OpusUnavailableError(UserError):
    """libopus (or the opuslib package) cannot be loaded on this machine."""


def require_opus() -> ModuleType:
    """The opuslib module, imported now if it was not yet; `OpusUnavailableError` if it cannot be."""
    global _module
    if _module is None:
        given = project_libopus()
        try:
            with _find_library_answers("opus", given):
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
        except Exception as exc:  # what opuslib raises when it finds no libopus (or cannot load it)
            if given is not None:
                raise OpusUnavailableError(f"libopus at {given} does not load: {exc}") from None
            raise OpusUnavailableError(MISSING_OPUS) from None
        _module = opuslib
    return _module


def project_lib_dir(prefix: str | os.PathLike[str] | None = None) -> Path:
    """The directory of this environment (`sys.prefix`, or `prefix`) where the project's own
    shared libraries live (the offline bundle's install.sh puts libopus there)."""
    return Path(prefix if prefix is not None else sys.prefix) / PROJECT_LIB_DIR


def project_libopus() -> str | None:
    """The libopus the project was given (`$PERSONAPLEX_LIBOPUS`, then the environment's project
    directory), or None: then the system's is used."""
    explicit = os.environ.get(LIBOPUS_ENV, "")
    if explicit:
        if not Path(explicit).is_file():
            raise OpusUnavailableError(f"${LIBOPUS_ENV}={explicit}: no such file")
        return str(Path(explicit).resolve())
    for name in LIBOPUS_NAMES:
        candidate = project_lib_dir() / name
        if candidate.is_file():
            return str(candidate)
    return None


@contextlib.contextmanager
def _find_library_answers(name: str, path: str | None) -> Iterator[None]:
    """While the block runs, `ctypes.util.find_library(name)` answers `path` (when one is given)."""
    if path is None:
        yield
        return
    original = ctypes.util.find_library

    def find_library(wanted: str) -> str | None:
        return path if wanted == name else original(wanted)

    ctypes.util.find_library = find_library
    try:
        yield
    finally:
        ctypes.util.find_library = original


def libopus_version() -> str:
    """The loaded libopus's own version string (e.g. "libopus 1.3.1"): proves it loads and answers."""
    opus = require_opus()
    version = opus.api.libopus.opus_get_version_string
    version.restype = ctypes.c_char_p
    return version().decode()


class _LazyOpuslib:
    def __getattr__(self, name: str) -> Any:
        return getattr(require_opus(), name)


opuslib: Any = _LazyOpuslib()
