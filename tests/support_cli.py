"""Running the real `personaplex-voice` command in a subprocess, for the CLI tests."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVICE_PROMPT = (
    "You work for CitySan Services which is a waste management and your name is Ayelen Lucero. "
    "Information: Verify customer name Omar Torres. Current schedule: every other week."
)


def cli_command() -> list[str]:
    """The installed console script when there is one, else the module (same `main`)."""
    script = Path(sys.executable).parent / "personaplex-voice"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "personaplex_voice.cli"]


def run_cli(
    *args: str | Path, cache: Path | None = None, timeout: float = 180
) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"  # the suite shares two cores between workers
    env.pop("PERSONAPLEX_DEBUG", None)
    if cache is not None:
        env["PERSONAPLEX_CACHE"] = str(cache)
    return subprocess.run(
        [*cli_command(), *map(str, args)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def call_cli(*args: str | Path) -> subprocess.CompletedProcess:
    """The same `main` in this process (no interpreter + torch start-up): for the many error cases.

    The main paths run as real subprocesses (`run_cli`); this is the same code after argv.
    """
    import torch

    from personaplex_voice.cli import main

    torch.set_num_threads(1)
    argv = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with redirect_stdout(out), redirect_stderr(err):
        try:
            main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    """The command failed with exit 2 and one `error:` line (no traceback) holding every fragment."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]
