"""The Python and platform an offline bundle is made for, as pip options and marker values.

pip can download wheels for another interpreter (`--python-version`, `--platform`, `--abi`,
`--implementation`), but two things need help:
- a PEP 600 platform (`manylinux_2_28_x86_64`) is matched literally, not as "this glibc or
  older", so every older manylinux tag is listed too (a wheel tagged only `manylinux2014` runs on
  a glibc 2.28 host);
- environment markers (`; python_version >= "3.13"`) are evaluated against the interpreter
  running pip, not the target, so `pip_command` runs pip with the target's marker values.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass

from personaplex_voice.errors import UserError

DEFAULT_PYTHON = "3.12"
DEFAULT_PLATFORM = "manylinux_2_28_x86_64"
_MANYLINUX = re.compile(r"^manylinux_2_(\d+)_(x86_64|aarch64)$")
# The legacy names of the PEP 600 tags they equal (PEP 600, "Legacy manylinux tags").
_LEGACY = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
_DEBIAN_ARCH = {"x86_64": "amd64", "aarch64": "arm64"}

# Runs pip with the target's marker values (see the module docstring). pip's vendored
# `packaging` evaluates every marker through its module-level `default_environment()`.
_PIP_WITH_TARGET_MARKERS = """
import json, sys
try:
    from pip._vendor.packaging import markers
except ImportError:  # a pip without that layout: markers stay the running interpreter's
    markers = None
if markers is not None:
    target = json.loads(sys.argv[1])
    running = markers.default_environment
    markers.default_environment = lambda: {**running(), **target}
from pip._internal.cli.main import main
sys.exit(main(sys.argv[2:]))
"""


@dataclass(frozen=True)
class Target:
    """CPython `python_version` ("3.12") on `platform` (a `manylinux_2_N_<arch>` tag)."""

    python_version: str = DEFAULT_PYTHON
    platform: str = DEFAULT_PLATFORM

    def __post_init__(self) -> None:
        if not re.fullmatch(r"3\.\d{1,2}", self.python_version):
            raise UserError(f"--python-version {self.python_version}: give major.minor, e.g. 3.12")
        if not _MANYLINUX.match(self.platform):
            raise UserError(
                f"--platform {self.platform}: give a manylinux tag such as manylinux_2_28_x86_64 "
                "(the target's glibc version; `ldd --version` on it)"
            )

    @classmethod
    def local(cls) -> Target:
        """This interpreter, on a platform as old as the default (for bundles tested here)."""
        return cls(f"{sys.version_info.major}.{sys.version_info.minor}")

    @property
    def abi(self) -> str:
        return "cp" + self.python_version.replace(".", "")

    @property
    def arch(self) -> str:
        match = _MANYLINUX.match(self.platform)
        assert match is not None
        return match.group(2)

    @property
    def debian_arch(self) -> str:
        return _DEBIAN_ARCH[self.arch]

    def platform_tags(self) -> list[str]:
        """The target's platform tag and every older one a wheel may carry instead."""
        match = _MANYLINUX.match(self.platform)
        assert match is not None
        newest, arch = int(match.group(1)), match.group(2)
        tags = [f"manylinux_2_{minor}_{arch}" for minor in range(newest, 4, -1)]
        tags += [f"{name}_{arch}" for minor, name in _LEGACY.items() if minor <= newest]
        return tags

    def pip_options(self) -> list[str]:
        """pip options that pick wheels for the target only (never a source build)."""
        options = ["--only-binary=:all:", "--python-version", self.python_version]
        options += ["--implementation", "cp", "--abi", self.abi, "--abi", "abi3", "--abi", "none"]
        for tag in self.platform_tags():
            options += ["--platform", tag]
        return options

    def markers(self) -> dict[str, str]:
        """PEP 508 marker values of the target interpreter."""
        full = f"{self.python_version}.0"
        return {
            "python_version": self.python_version,
            "python_full_version": full,
            "implementation_name": "cpython",
            "implementation_version": full,
            "platform_python_implementation": "CPython",
            "sys_platform": "linux",
            "platform_system": "Linux",
            "platform_machine": self.arch,
            "os_name": "posix",
        }

    def pip_command(self, python: str = sys.executable) -> list[str]:
        """`python -m pip` with markers evaluated for the target; append pip's arguments."""
        return [python, "-c", _PIP_WITH_TARGET_MARKERS, json.dumps(self.markers())]

    def describe(self) -> str:
        return f"CPython {self.python_version} on {self.platform}"
