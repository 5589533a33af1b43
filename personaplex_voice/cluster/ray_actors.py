"""Engine workers as Ray actors, and how front-ends find them (the `cluster` extra: `ray`).

Ray places the actors (`num_gpus=1` each, or CPU) on any node of the cluster, restarts them when
their process dies, and keeps their names; audio never goes through Ray. Each actor runs the same
`EngineWorker` as a local worker process, listening on TCP on its node's address (the one Ray
uses for the node) with a secret of its own; `endpoint()` tells both to whoever asks through Ray
(anyone who can reach Ray can run code on the cluster, so this is no weaker). Front-ends list the
actors named `personaplex-engine-*` in the `personaplex` namespace every second, connect to each,
and ask again for the address whenever a connection drops (a restarted actor listens elsewhere).

`serve --ray ADDRESS --engine-workers N` (one GPU each with `--device cuda`; or `--gpus 0,1,...`:
N = the list's length) creates the missing actors as detached, so they outlive the process that made them (a
front-end deploy must not reload a 16 GB model); `stop_engine_actors(address)` removes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import threading
from typing import Any

from personaplex_voice.cluster.client import ClusterClient
from personaplex_voice.cluster.worker_link import Endpoint

log = logging.getLogger("personaplex_voice.cluster.ray")

NAMESPACE = "personaplex"
NAME_PREFIX = "personaplex-engine-"
DISCOVERY_INTERVAL_S = 1.0
ENDPOINT_TIMEOUT_S = 5.0


# Ray 2.5x+: `ray start` turns token authentication on when a token exists, and a process that
# joins with an explicit address only sends one when told to (docs/cluster.md).
AUTH_HINT = (
    "a cluster with token authentication needs RAY_AUTH_MODE=token and the cluster's token "
    "(RAY_AUTH_TOKEN, or the file ~/.ray/auth_token) in this environment too: see docs/cluster.md"
)


def join_ray(ray: Any, address: str) -> None:
    """`ray.init` on the cluster at `address`; a failure is one line (with the token hint)."""
    try:
        ray.init(address=address, namespace=NAMESPACE, ignore_reinit_error=True, log_to_driver=False)
    except Exception as exc:  # Ray raises ConnectionError, AuthenticationError or RuntimeError
        from personaplex_voice.errors import UserError

        text = f"{exc}\n{exc.__cause__ or ''}"
        if "authentication" in text.lower() or "unauthenticated" in text.lower():
            detail = "it refused this process's authentication token: missing or not the cluster's"
        else:
            first = (str(exc.__cause__ or exc).strip().splitlines() or [type(exc).__name__])[0]
            detail = first.split(" Last connection error")[0][:300]
        raise UserError(f"--ray {address}: cannot join the Ray cluster ({detail}); {AUTH_HINT}") from None


def _ray() -> Any:
    # Ray's core worker installs a crash handler in every process that joins; it catches SIGTERM
    # too, and then arms a 3 s alarm that kills the process. Our processes drain on SIGTERM (a
    # front-end lets its calls finish), so it is off here; Ray reads this when it is imported.
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    try:
        import ray
    except ImportError:
        from personaplex_voice.errors import UserError

        raise UserError("--ray needs Ray: pip install 'personaplex-voice[cluster]'") from None
    return ray


class EngineActor:
    """The body of one engine-worker actor (wrapped by `ray.remote` at creation).

    The engine loads in `__init__` (Ray reports the actor ready when it returns); the worker's
    event loop runs in a thread of its own, beside the engine's inference thread.
    """

    def __init__(self, worker_id: str, settings_values: dict[str, Any], host: str | None = None):
        ray = _ray()
        from personaplex_voice.cluster.procs import host_identity
        from personaplex_voice.cluster.worker import EngineWorker, WorkerInfo, build_manager, engine_device
        from personaplex_voice.process.settings import ServerSettings

        logging.basicConfig(level=logging.INFO, format=f"%(levelname)s engine-actor[{worker_id}] %(message)s")
        settings = ServerSettings(**settings_values)
        manager = build_manager(settings)
        if settings.tune_runtime:
            from personaplex_voice.process import runtime

            runtime.tune_for_realtime()
        node = ray.util.get_node_ip_address()
        context = ray.get_runtime_context()
        info = WorkerInfo(
            worker_id=worker_id,
            device=engine_device(manager.engine, settings),
            node=node,
            generation=int(bool(context.was_current_actor_reconstructed)),
            pid=os.getpid(),
            host=host_identity(),
        )
        self._secret = secrets.token_urlsafe(32)
        self._worker = EngineWorker(manager, info, self._secret)
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="engine-worker-loop", daemon=True).start()
        listen = f"tcp:{host or node}:0"
        self._address = asyncio.run_coroutine_threadsafe(self._start(listen), self._loop).result(60)

    async def _start(self, listen: str) -> str:
        await self._worker.start()
        return await self._worker.listen(listen)

    def endpoint(self) -> dict[str, Any]:
        info = self._worker.info
        return {"address": self._address, "secret": self._secret, "pid": info.pid, "node": info.node}

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._worker.stop(), self._loop).result(30)


def start_engine_actor(
    name: str,
    settings_values: dict[str, Any],
    *,
    num_gpus: float = 0,
    num_cpus: float = 1,
    resources: dict[str, float] | None = None,
    detached: bool = True,
    max_restarts: int = -1,
    host: str | None = None,
) -> Any:
    """Create (or find, by name) one engine-worker actor; returns its handle. `ray.init` first."""
    ray = _ray()
    if not name.startswith(NAME_PREFIX) or "." in name:
        raise ValueError(f"engine actor names start with {NAME_PREFIX!r} and have no dots: {name!r}")
    options: dict[str, Any] = {
        "name": name,
        "namespace": NAMESPACE,
        "get_if_exists": True,
        "max_restarts": max_restarts,
        "num_gpus": num_gpus,
        "num_cpus": num_cpus,
    }
    if detached:
        options["lifetime"] = "detached"
    if resources:
        options["resources"] = resources
    return ray.remote(EngineActor).options(**options).remote(name, settings_values, host)


def ensure_engine_actors(address: str, settings_values: dict[str, Any], settings: Any) -> list[str]:
    """The supervisor's part with `--ray`: the N engine actors exist (missing ones created).

    N is `--engine-workers`, or the length of `--gpus` (Ray picks the GPUs: the indices do not
    matter there). Each actor takes one GPU with `--gpus` or a `cuda` `--device`, else one CPU."""
    ray = _ray()
    gpus = bool(settings.gpu_list) or str(settings.device).startswith("cuda")
    count = settings.engine_workers or len(settings.gpu_list)
    join_ray(ray, address)
    names = []
    try:
        for i in range(count):
            name = f"{NAME_PREFIX}{i}"
            values = {**settings_values, "device": "cuda"} if gpus else {**settings_values, "device": "cpu"}
            start_engine_actor(name, values, num_gpus=1 if gpus else 0, num_cpus=0 if gpus else 1)
            names.append(name)
        log.info("Ray: engine actors %s requested (they load in the background)", ", ".join(names))
    finally:
        ray.shutdown()
    return names


def stop_engine_actors(address: str) -> list[str]:
    """Kill every engine actor of the namespace (they are detached: nothing else ends them)."""
    ray = _ray()
    join_ray(ray, address)
    killed = []
    try:
        for name in _engine_names(ray):
            with contextlib.suppress(Exception):
                ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
                killed.append(name)
    finally:
        ray.shutdown()
    return killed


def _engine_names(ray: Any) -> list[str]:
    found = ray.util.list_named_actors(all_namespaces=True)
    return sorted(
        entry["name"]
        for entry in found
        if entry.get("namespace") == NAMESPACE and str(entry.get("name", "")).startswith(NAME_PREFIX)
    )


def ray_discovery(address: str, interval_s: float = DISCOVERY_INTERVAL_S) -> Any:
    """A discovery task for `ClusterClient.add_discovery`: joins Ray, adds every engine actor."""

    async def discover(client: ClusterClient) -> None:
        ray = _ray()
        await asyncio.to_thread(join_ray, ray, address)
        log.info("Ray: joined %s; looking for engine actors", address)
        known: set[str] = set()
        try:
            while True:
                try:
                    names = await asyncio.to_thread(_engine_names, ray)
                except Exception as exc:  # Ray unreachable for a moment: keep what we have
                    log.warning("Ray: cannot list engine actors: %s", exc)
                    names = sorted(known)
                for name in names:
                    if name not in known:
                        known.add(name)
                        client.add_worker(name, _resolver(ray, name))
                        log.info("Ray: found engine actor %s", name)
                for name in known - set(names):
                    known.discard(name)
                    await client.remove_worker(name)
                await asyncio.sleep(interval_s)
        finally:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(ray.shutdown)

    return discover


def _resolver(ray: Any, name: str) -> Any:
    async def resolve() -> Endpoint | None:
        def ask() -> Endpoint | None:
            try:
                handle = ray.get_actor(name, namespace=NAMESPACE)
                found = ray.get(handle.endpoint.remote(), timeout=ENDPOINT_TIMEOUT_S)
            except Exception as exc:  # not placed yet, restarting, or its node is gone
                log.debug("Ray: engine actor %s has no endpoint now: %s", name, exc)
                return None
            return Endpoint(str(found["address"]), str(found["secret"]))

        return await asyncio.to_thread(ask)

    return resolve
