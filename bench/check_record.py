"""What bench/gpu_check.py keeps as it goes, so that a run stopped at any point has lost only
the part it was in.

- `CheckRecord`: beside the summary JSON (`OUT`, rewritten after every part), every row and part
  is appended to `OUT` with `.jsonl` as soon as it finishes (one JSON line each, flushed and
  synced), and every log line, whole, to `OUT` with `.log` (bench/gpu_check.sh writes its own
  lines there too).
- `stop_on_signals`: SIGTERM / SIGINT / SIGHUP (a timeout, a kill, a closed terminal) raise
  `Stopped` in the main thread: the check unwinds through its `finally` blocks (children ended,
  large files deleted) and writes what it has.
- `Children`: the subprocesses the check starts, each in a process group of its own, ended
  together (SIGTERM to the group, SIGKILL after a grace period) on the way out.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

GRACE_S = 10.0


class Stopped(BaseException):
    """The check was told to stop (a BaseException: no part's `except Exception` swallows it)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signal_name = signal.Signals(signum).name


def stop_on_signals() -> None:
    def stop(signum: int, frame: Any) -> None:
        raise Stopped(signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, stop)


def ignore_signals() -> None:
    """While the check writes its last words and cleans up: a second signal must not cut that."""
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)


class CheckRecord:
    def __init__(self, out: Path, started: float | None = None):
        self.out = out
        self.rows = out.with_suffix(".jsonl")
        self.log = out.with_suffix(".log")
        self.started = time.monotonic() if started is None else started
        out.parent.mkdir(parents=True, exist_ok=True)
        self.rows.write_text("")  # this run's rows only

    def say(self, message: str) -> None:
        line = f"[gpu_check {time.strftime('%H:%M:%S')}] {message}"
        print(line, file=sys.stderr, flush=True)
        self._append(self.log, line + "\n")

    def row(self, part: str, value: Any) -> None:
        """One finished row or part, appended now (it survives whatever comes next)."""
        record = {"part": part, "elapsed_s": round(time.monotonic() - self.started, 1)}
        record.update(value if isinstance(value, dict) else {"value": value})
        line = json.dumps(record, default=str)
        self._append(self.rows, line + "\n", sync=True)
        self._append(self.log, f"row {line}\n")

    def summary(self, result: dict[str, Any]) -> str:
        line = json.dumps(result, default=str)
        with contextlib.suppress(OSError):
            self.out.write_text(line + "\n")
        return line

    @staticmethod
    def _append(path: Path, text: str, sync: bool = False) -> None:
        with contextlib.suppress(OSError), open(path, "a", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            if sync:
                os.fsync(f.fileno())


class Children:
    """The check's subprocesses, each the leader of a process group of its own."""

    def __init__(self) -> None:
        self._running: list[subprocess.Popen] = []

    def start(self, command: list[str], **options: Any) -> subprocess.Popen:
        proc = subprocess.Popen(command, start_new_session=True, **options)
        self._running.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen) -> None:
        """SIGTERM to its whole group, SIGKILL after the grace period (anything it started too)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(GRACE_S)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # the group may outlive its leader
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(GRACE_S)
        if proc in self._running:
            self._running.remove(proc)

    def stop_all(self) -> None:
        for proc in list(self._running):
            self.stop(proc)
