"""A fresh machine: no libopus, mistyped options, `make serve` without its system library.

libopus is made unloadable for a subprocess the way a machine without it looks to opuslib: a
`sitecustomize` on its PYTHONPATH makes `ctypes.util.find_library("opus")` find nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support_cli import cli_command

ROOT = Path(__file__).resolve().parents[1]
HIDE_OPUS = """
import ctypes.util
_find = ctypes.util.find_library
ctypes.util.find_library = lambda name: None if name == "opus" else _find(name)
"""


@pytest.fixture
def no_opus_env(tmp_path: Path) -> dict[str, str]:
    shim = tmp_path / "no-opus"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(HIDE_OPUS)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(shim))
    env.pop("PERSONAPLEX_DEBUG", None)
    return env


def run(
    args: list[str], env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    env = env or {k: v for k, v in os.environ.items() if k != "PERSONAPLEX_DEBUG"}
    return subprocess.run(
        [*cli_command(), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_the_shim_really_hides_libopus(no_opus_env) -> None:
    probe = "import opuslib"
    proc = subprocess.run([sys.executable, "-c", probe], env=no_opus_env, capture_output=True, text=True)
    assert proc.returncode != 0 and "Could not find Opus library" in proc.stderr


def test_offline_works_without_libopus(golden_dir: Path, tmp_path: Path, no_opus_env) -> None:
    out_wav, out_json = tmp_path / "out.wav", tmp_path / "out.json"
    args = [
        "offline",
        "--model",
        str(golden_dir),
        "--device",
        "cpu",
        "--greedy",
        "--voice-prompt",
        "TINYF0.pt",
    ]
    args += ["--input-wav", str(golden_dir / "user.wav"), "--output-wav", str(out_wav)]
    proc = run([*args, "--output-text", str(out_json)], no_opus_env)
    assert proc.returncode == 0, proc.stderr
    assert out_wav.stat().st_size > 0 and len(json.loads(out_json.read_text(encoding="utf-8"))) == 70


def test_serve_without_libopus_is_one_line(no_opus_env) -> None:
    proc = run(["serve", "--engine", "echo", "--port", "0"], no_opus_env)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert "libopus0" in lines[0] and "brew install opus" in lines[0]


@pytest.mark.parametrize(
    "args",
    [
        ["serve", "--bogus"],
        ["serve", "--port", "eighty"],
        ["serve", "--prefill", "sideways"],
        ["offline", "--bogus"],
        ["offline", "--quantize", "int4", "--input-wav", "a", "--output-wav", "b", "--output-text", "c"],
        ["voices", "list", "--bogus"],
        ["voices", "make", "--bogus"],
        ["call", "--bogus"],
        ["bogus-command"],
    ],
    ids=lambda args: " ".join(args),
)
def test_a_usage_error_is_a_short_usage_message(args: list[str]) -> None:
    proc = run(args)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    assert "Usage: personaplex-voice" in proc.stderr
    assert len(proc.stderr.splitlines()) <= 12, proc.stderr


def test_make_serve_says_what_to_install_when_libopus_is_missing(no_opus_env, tmp_path: Path) -> None:
    """No libopus and no apt-get on PATH (a non-Debian machine): one line naming the package."""
    env = dict(no_opus_env, PATH=str(tmp_path))  # the recipe needs only its shell built-ins here
    proc = subprocess.run(
        ["/usr/bin/make", "-s", "--no-print-directory", "serve-deps", f"PY={sys.executable}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "libopus0" in proc.stdout and "brew install opus" in proc.stdout
    assert len(proc.stdout.strip().splitlines()) == 1, proc.stdout
