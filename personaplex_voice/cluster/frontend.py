"""A front-end process: every transport of the server on the shared port, sessions on engine workers.

The app is the one `create_app` builds for the embedded server, given a `ClusterClient` as its
manager, so `/api/chat`, the web client, Twilio and `/metrics` run unchanged. The process never
imports torch (`/api/cluster` reports `torch_loaded` so tests check it).

Several front-ends serve one port: each binds its own listening socket with SO_REUSEPORT and the
kernel spreads new connections over them (Linux, BSD). SIGTERM drains: `/readyz` answers 503
"draining", new sessions are refused (a retryable "full"), running ones go on until they end or
`drain_s` passes; then the process ends the rest in words and exits. A second SIGTERM (or SIGINT)
exits at once.

`python -m personaplex_voice.cluster.frontend --settings FILE --index N
    (--worker ID=ADDRESS ... | --ray ADDRESS)` (the supervisor runs this).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import time
from typing import Any

from personaplex_voice.cluster.client import ClusterClient
from personaplex_voice.cluster.procs import die_with_parent
from personaplex_voice.process.settings import ServerSettings, settings_from_file

log = logging.getLogger("personaplex_voice.cluster.frontend")


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP listening socket on host:port shared with the other front-ends (SO_REUSEPORT)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if hasattr(socket, "SO_REUSEPORT"):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def build_client(settings: ServerSettings, index: int, workers: list[str], secret: str) -> ClusterClient:
    client = ClusterClient(
        frontend_id=f"fe{index}",
        max_queue=settings.max_queue,
        realtime=True,
        fallback_name=settings.model if settings.engine == "model" else "echo",
        arrivals=settings.arrival_config(),
    )
    for spec in workers:
        worker_id, _, address = spec.partition("=")
        client.add_static_worker(worker_id, address, secret)
    return client


def draining_server_class(drain_s: float) -> Any:
    from personaplex_voice.process.uvicorn_setup import server_class

    class DrainingServer(server_class()):  # type: ignore[misc]
        """The first SIGTERM starts a drain instead of exiting (see the module docstring)."""

        def __init__(self, config: Any, before_close: Any, client: ClusterClient):
            super().__init__(config, before_close)
            self.client = client
            self.drain_deadline: float | None = None

        def handle_exit(self, sig: int, frame: Any) -> None:
            if sig == signal.SIGTERM and drain_s > 0 and self.drain_deadline is None and not self.should_exit:
                self.drain_deadline = time.monotonic() + drain_s  # on_tick acts on it, in the loop
                return
            super().handle_exit(sig, frame)

        async def on_tick(self, counter: int) -> bool:
            if self.drain_deadline is not None and not self.should_exit:
                if not self.client.draining:
                    self.client.drain()
                    log.info("SIGTERM: draining for up to %.0f s", drain_s)
                if not self.client.sessions:
                    log.info("drained: every call ended")
                    self.should_exit = True
                elif time.monotonic() >= self.drain_deadline:
                    log.info("drain deadline: ending %d call(s)", len(self.client.sessions))
                    self.should_exit = True
            return await super().on_tick(counter)

    return DrainingServer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="personaplex-voice front-end (started by the supervisor)")
    parser.add_argument("--settings", required=True)
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--port", type=int, default=None, help="overrides the settings' port")
    parser.add_argument("--worker", action="append", default=[], help="ID=unix:PATH or ID=tcp:HOST:PORT")
    parser.add_argument("--ray", default=None, help="find engine workers in this Ray cluster")
    args = parser.parse_args(argv)
    die_with_parent()
    settings = settings_from_file(args.settings, **({"port": args.port} if args.port is not None else {}))

    from personaplex_voice.process.logs import configure_logging
    from personaplex_voice.process.uvicorn_setup import uvicorn_config
    from personaplex_voice.server.app import create_app, end_all_calls

    configure_logging(settings, f"%(asctime)s %(levelname)s front-end[{args.index}] %(name)s: %(message)s")
    secret = os.environ.get("PERSONAPLEX_CLUSTER_SECRET", "")
    client = build_client(settings, args.index, args.worker, secret)
    if args.ray:
        from personaplex_voice.cluster.ray_actors import ray_discovery

        client.add_discovery(ray_discovery(args.ray))
    app = create_app(settings, host=client)
    config = uvicorn_config(settings, app)
    server = draining_server_class(settings.drain_s)(config, lambda: end_all_calls(app), client)
    sock = listening_socket(settings.host, settings.port)
    log.info("front-end %d (pid %d) serving on %s:%d", args.index, os.getpid(), settings.host, settings.port)
    server.run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
