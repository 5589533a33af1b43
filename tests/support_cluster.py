"""Helpers for the cluster tests: a real engine-worker process, `/api/cluster` and process checks.

with running_worker(tmp_path, {"engine": "echo", "max_sessions": 2}) as worker:
    client.add_static_worker("w0", worker.address, worker.secret)
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
SECRET = "cluster-test-secret"


@dataclass
class WorkerProcess:
    address: str
    secret: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextlib.contextmanager
def running_worker(
    tmp_path: Path, settings: Mapping[str, Any], *, realtime: bool = True, timeout: float = 120.0
) -> Iterator[WorkerProcess]:
    """`python -m personaplex_voice.cluster.worker` on a Unix socket, until the block ends."""
    settings_file = tmp_path / "worker-settings.json"
    settings_file.write_text(json.dumps({"tune_runtime": False, **settings}))
    sock = tmp_path / "w0.sock"
    log_path = tmp_path / "worker.log"
    cmd = [sys.executable, "-m", "personaplex_voice.cluster.worker", "--settings", str(settings_file)]
    cmd += ["--listen", f"unix:{sock}", "--id", "w0"] + ([] if realtime else ["--no-realtime"])
    env = {**os.environ, "PERSONAPLEX_CLUSTER_SECRET": SECRET, "PYTHONUNBUFFERED": "1"}
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    worker = WorkerProcess(f"unix:{sock}", SECRET, process, log_path)
    try:
        deadline = time.monotonic() + timeout
        while not sock.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"engine worker did not start:\n{worker.log()[-4000:]}")
            time.sleep(0.05)
        yield worker
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def cluster_state(base_url: str, **headers: str) -> dict[str, Any]:
    response = httpx.get(base_url + "/api/cluster", headers=headers, timeout=5)
    assert response.status_code == 200, response.text
    return response.json()


def worker_by_id(state: dict[str, Any], worker_id: str) -> dict[str, Any]:
    return next(w for w in state["workers"] if w["id"] == worker_id)


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.05, what: str = "condition") -> float:
    """Polls `predicate` until true; returns the seconds it took."""
    start = time.monotonic()
    while True:
        if predicate():
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what} not reached in {timeout:.0f} s")
        time.sleep(interval)


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    with contextlib.suppress(OSError):
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    return True
