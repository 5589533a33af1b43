"""`serve` with `--workers` / `--engine-workers` / `--gpus` / `--ray`: the supervisor process.

It starts and watches the cluster's processes on this host, and never imports torch itself:
- one engine worker per GPU (`--gpus 0,1`: `CUDA_VISIBLE_DEVICES` set per worker) or
  `--engine-workers N` on the CPU / `--device`, each on a Unix socket in a private runtime
  directory (0700); with `--ray` the engine workers are Ray actors instead (created when
  `--engine-workers`/`--gpus` is given, otherwise only found);
- `--workers N` front-end processes (default 1) on the one port.

A child that dies is started again after a back-off (0.5 s, doubling to 30 s; a child that ran
a minute starts the count over); an engine worker that fails before it ever listened stops the
cluster with its error (a bad model path should not be retried forever). SIGTERM (or SIGINT)
drains: the front-ends stop admitting and wait for their calls (`--drain-s`), then the engine
workers stop; a second signal hurries every child along.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from personaplex_voice.errors import UserError

log = logging.getLogger("personaplex_voice.cluster")

RUN_STATE_POLL_S = 0.1


@dataclass
class Backoff:
    """Delay before restarting a child that died: `initial`, doubling up to `maximum`; a child
    that stayed up `reset_after` seconds starts over at `initial`."""

    initial: float = 0.5
    maximum: float = 30.0
    reset_after: float = 60.0
    _next: float = field(default=0.0, init=False)

    def delay(self, ran_for: float) -> float:
        if ran_for >= self.reset_after or self._next == 0.0:
            self._next = self.initial
        delay = self._next
        self._next = min(self.maximum, self._next * 2)
        return delay


@dataclass
class Child:
    """One supervised process: how to start it, and its current incarnation."""

    name: str
    kind: str  # "engine" or "frontend"
    argv: Any  # Callable[[int], list[str]]: the command for a given generation
    env: dict[str, str]
    ready_path: Path | None = None  # exists once it ever got ready (engine workers: their socket)
    process: subprocess.Popen[bytes] | None = None
    generation: int = 0
    started_at: float = 0.0
    restart_at: float | None = None
    ever_ready: bool = False
    backoff: Backoff = field(default_factory=Backoff)

    def start(self) -> None:
        self.process = subprocess.Popen(self.argv(self.generation), env=self.env, start_new_session=True)
        self.started_at = time.monotonic()
        self.restart_at = None
        log.info("%s started (pid %d, generation %d)", self.name, self.process.pid, self.generation)

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def signal(self, signum: int) -> None:
        if self.alive:
            assert self.process is not None
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signum)


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def settings_values(settings: Any) -> dict[str, Any]:
    """The settings as plain JSON values (secrets included: the file is private to the cluster)."""
    values = json.loads(settings.model_dump_json())
    if settings.api_key is not None:
        values["api_key"] = settings.api_key.get_secret_value()
    return values


class Supervisor:
    def __init__(self, settings: Any):
        self.settings = settings
        self.children: list[Child] = []
        self.stop_signal: int | None = None
        self.hurry = False
        self.runtime_dir = Path(tempfile.mkdtemp(prefix="personaplex-cluster-"))
        self.secret = secrets.token_urlsafe(32)
        self.port = settings.port or free_port(settings.host)

    # -- the plan ---------------------------------------------------------------------------------

    def plan(self) -> None:
        settings = self.settings
        settings_file = self.runtime_dir / "settings.json"
        settings_file.write_text(json.dumps(settings_values(settings)))
        settings_file.chmod(0o600)
        env = {**os.environ, "PERSONAPLEX_CLUSTER_SECRET": self.secret, "PYTHONUNBUFFERED": "1"}
        workers: list[str] = []
        if not settings.ray:
            gpus = settings.gpu_list
            devices: list[tuple[str | None, dict[str, str]]]
            if gpus:
                devices = [("cuda", {"CUDA_VISIBLE_DEVICES": str(g)}) for g in gpus]
            else:
                devices = [(None, {})] * (settings.engine_workers or 1)
            for i, (device, extra) in enumerate(devices):
                worker_id = f"w{i}"
                sock = self.runtime_dir / f"{worker_id}.sock"
                workers.append(f"{worker_id}=unix:{sock}")

                def engine_argv(
                    generation: int, worker_id: str = worker_id, sock: Path = sock, device=device
                ):
                    argv = [
                        sys.executable,
                        "-m",
                        "personaplex_voice.cluster.worker",
                        "--settings",
                        str(settings_file),
                    ]
                    argv += ["--listen", f"unix:{sock}", "--id", worker_id, "--generation", str(generation)]
                    return argv + (["--device", device] if device else [])

                self.children.append(
                    Child(worker_id, "engine", engine_argv, {**env, **extra}, ready_path=sock)
                )
        for i in range(settings.workers or 1):

            def frontend_argv(generation: int, index: int = i) -> list[str]:
                argv = [
                    sys.executable,
                    "-m",
                    "personaplex_voice.cluster.frontend",
                    "--settings",
                    str(settings_file),
                ]
                argv += ["--index", str(index), "--port", str(self.port)]
                for spec in workers:
                    argv += ["--worker", spec]
                return argv + (["--ray", settings.ray] if settings.ray else [])

            self.children.append(Child(f"fe{i}", "frontend", frontend_argv, env))

    # -- running ----------------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.stop_signal is None:
            self.stop_signal = signum
        else:
            self.hurry = True

    def run(self) -> None:
        self.plan()
        if self.settings.ray and (self.settings.engine_workers or self.settings.gpus):
            from personaplex_voice.cluster.ray_actors import ensure_engine_actors

            ensure_engine_actors(self.settings.ray, settings_values(self.settings), self.settings)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        log.info(
            "cluster: %d front-end(s) on %s://%s:%d/, %s",
            sum(c.kind == "frontend" for c in self.children),
            self.settings.scheme,
            self.settings.host,
            self.port,
            f"engine workers in Ray at {self.settings.ray}"
            if self.settings.ray
            else f"{sum(c.kind == 'engine' for c in self.children)} engine worker(s)",
        )
        try:
            for child in self.children:
                child.start()
            failure = self._watch()
            self._stop_all()
        finally:
            for child in self.children:  # nothing is left behind, whatever happened
                if child.alive:
                    assert child.process is not None
                    child.process.kill()
                    child.process.wait()
            shutil.rmtree(self.runtime_dir, ignore_errors=True)
        if failure:
            raise UserError(failure)

    def _watch(self) -> str | None:
        """Until a stop signal; returns an error when the cluster cannot run."""
        while self.stop_signal is None:
            now = time.monotonic()
            for child in self.children:
                if child.ready_path is not None and not child.ever_ready and child.ready_path.exists():
                    child.ever_ready = True
                if child.alive:
                    continue
                if child.restart_at is None:
                    assert child.process is not None
                    code = child.process.returncode
                    if child.kind == "engine" and not child.ever_ready:
                        return f"engine worker {child.name} could not start (exit code {code}; see its log)"
                    delay = child.backoff.delay(now - child.started_at)
                    child.restart_at = now + delay
                    log.warning(
                        "%s (pid %d) exited with %s: restarting in %.1f s",
                        child.name,
                        child.process.pid,
                        code,
                        delay,
                    )
                elif now >= child.restart_at:
                    child.generation += 1
                    child.start()
            time.sleep(RUN_STATE_POLL_S)
        return None

    def _stop_all(self) -> None:
        """Front-ends drain first (their calls end or the drain deadline passes), then engines."""
        log.info("stopping: front-ends drain for up to %.0f s", self.settings.drain_s)
        frontends = [c for c in self.children if c.kind == "frontend"]
        engines = [c for c in self.children if c.kind == "engine"]
        self._stop(frontends, self.settings.drain_s + 15.0)
        self._stop(engines, 15.0)
        log.info("cluster stopped")

    def _stop(self, children: list[Child], timeout: float) -> None:
        for child in children:
            child.signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        hurried = False
        while any(c.alive for c in children) and time.monotonic() < deadline:
            if self.hurry and not hurried:
                hurried = True
                for child in children:
                    child.signal(signal.SIGTERM)  # a second SIGTERM: a front-end stops draining
            time.sleep(RUN_STATE_POLL_S)
        for child in children:
            if child.alive:
                log.warning("%s did not stop in time: killed", child.name)
                assert child.process is not None
                child.process.kill()
                child.process.wait()


def run_cluster(settings: Any) -> None:
    """Entry point of `serve` in cluster mode (blocks until stopped)."""
    from personaplex_voice.process.checks import check_files
    from personaplex_voice.process.logs import configure_logging

    check_files(settings)
    configure_logging(settings, "%(asctime)s %(levelname)s supervisor %(name)s: %(message)s")
    if settings.workers == 0 and not settings.engine_workers and not settings.gpus and not settings.ray:
        raise UserError("cluster mode needs --workers, --engine-workers, --gpus or --ray")
    from personaplex_voice.process import tls

    tls.prepare(settings)  # --ssl: found and checked, or made, before any front-end loads it
    Supervisor(settings).run()
