"""A local multi-node Ray cluster in a process of its own, for tests of `serve --ray`.

    with ray_cluster(nodes=2, token="...") as cluster:   # every Ray process on 127.0.0.1
        cluster.address, cluster.raylet_pids, cluster.env  # env: what a Ray client needs (token)

The cluster (`ray.cluster_utils.Cluster`, one CPU per node) lives in a child process: the test
process never imports Ray, so no Ray state (its cached configuration, its connection) leaks
between tests or modules. Token authentication is on, as operators run it (docs/cluster.md):
`RAY_AUTH_MODE=token` and the token in `RAY_AUTH_TOKEN` for every Ray process and every client.
Run as a script it is that child: it prints one JSON line, then holds the cluster until its
standard input closes.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

RAY_ENV = {
    # every Ray process (GCS, raylets, workers, drivers) binds 127.0.0.1, not the external interface
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "token",
    "RAY_USAGE_STATS_ENABLED": "0",
}


@dataclass
class RayCluster:
    address: str
    raylet_pids: list[int]
    env: dict[str, str]
    process: subprocess.Popen[str] = field(repr=False)


def ray_env(token: str) -> dict[str, str]:
    return {**os.environ, **RAY_ENV, "RAY_AUTH_TOKEN": token}


@contextlib.contextmanager
def ray_cluster(nodes: int = 2, token: str | None = None, timeout: float = 180.0) -> Iterator[RayCluster]:
    env = ray_env(token or secrets.token_hex(16))
    process = subprocess.Popen(
        [sys.executable, str(Path(__file__)), str(nodes)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()  # the child prints once the cluster is up (or exits)
        if not line:
            raise RuntimeError(f"the Ray cluster did not start (exit code {process.wait(timeout)})")
        info = json.loads(line)
        yield RayCluster(info["address"], info["raylet_pids"], env, process)
    finally:
        with contextlib.suppress(Exception):
            assert process.stdin is not None
            process.stdin.close()  # the child shuts the cluster down
        try:
            process.wait(timeout=90)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def parent_pid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _serve(nodes: int) -> None:
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        for _ in range(nodes - 1):
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        raylets = [
            node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid
            for node in cluster.list_all_nodes()
        ]
        print(json.dumps({"address": cluster.address, "raylet_pids": raylets}), flush=True)
        sys.stdin.read()  # until the test closes our standard input
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
