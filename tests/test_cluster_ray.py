"""Engine workers as Ray actors on a local 2-node Ray cluster (CPU, loopback only): the echo
engine on one node, the golden model on the other; `serve --ray ADDRESS` finds both, sessions
from its front-end land on both, and removing a node ends only that node's sessions, in words."""

from __future__ import annotations

import os

# Before Ray is imported anywhere in this process: every Ray process (GCS, raylets, workers,
# drivers; the server started below inherits it) binds 127.0.0.1 instead of the external interface.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import asyncio
import time
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import soundfile as sf
from support_cluster import cluster_state, wait_for
from support_server import chat, echo_similarity, running_server

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from personaplex_voice.cluster.ray_actors import NAME_PREFIX, NAMESPACE, start_engine_actor  # noqa: E402

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

SR = 24000
ECHO, GOLDEN = NAME_PREFIX + "echo", NAME_PREFIX + "golden"


@pytest.fixture
def ray_cluster(golden_dir) -> Iterator[tuple[Cluster, object]]:
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "resources": {"echo_node": 1}, "include_dashboard": False},
    )
    try:
        golden_node = cluster.add_node(num_cpus=1, resources={"golden_node": 1})
        ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
        common = {"max_sessions": 2, "tune_runtime": False, "idle_timeout_s": 0, "log_level": "warning"}
        model = {"engine": "model", "model": str(golden_dir), "device": "cpu", "threads": 1}
        actors = [
            start_engine_actor(
                ECHO, {**common, "engine": "echo"}, resources={"echo_node": 1}, detached=False, max_restarts=0
            ),
            start_engine_actor(
                GOLDEN, {**common, **model}, resources={"golden_node": 1}, detached=False, max_restarts=0
            ),
        ]
        endpoints = ray.get([a.endpoint.remote() for a in actors], timeout=120)
        assert all(e["address"].startswith("tcp:127.0.0.1:") for e in endpoints)
        yield cluster, golden_node
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_sessions_from_one_front_end_use_both_nodes_and_a_lost_node_ends_only_its_own(
    ray_cluster, golden_dir
):
    cluster, golden_node = ray_cluster
    nodes = ray.nodes()
    assert len(nodes) == 2 and {n["NodeManagerAddress"] for n in nodes} == {"127.0.0.1"}
    user = sf.read(golden_dir / "user.wav", dtype="float32")[0]
    audio = np.tile(user, 2)[: 8 * SR]
    with running_server("--ray", cluster.address, "--workers", "1", "--max-sessions", "2") as server:

        def both_up() -> bool:
            state = cluster_state(server.url)
            return sorted(w["id"] for w in state["workers"] if w["up"]) == [ECHO, GOLDEN]

        wait_for(both_up, timeout=60, what="both engine actors found")
        state = cluster_state(server.url)
        assert {w["node"] for w in state["workers"]} == {"127.0.0.1"} and not state["frontend"][
            "torch_loaded"
        ]
        assert {w["id"]: w["engine"] for w in state["workers"]}[ECHO] == "loopback"

        async def scenario():
            url = str(httpx.URL(server.ws_url + "/api/chat", params={"text_prompt": "Hello there."}))
            calls = [asyncio.create_task(chat(url, audio, max_tail_s=5)) for _ in range(2)]
            placed: dict = {}

            def both_placed() -> bool:
                nonlocal placed
                placed = cluster_state(server.url)["frontend"]["session_workers"]
                return len(placed) == 2

            await asyncio.to_thread(wait_for, both_placed, 30)
            await asyncio.sleep(1.5)
            removed_at = time.monotonic()
            await asyncio.to_thread(cluster.remove_node, golden_node)
            results = await asyncio.gather(*calls)
            return placed, removed_at, results

        placed, removed_at, results = asyncio.run(scenario())
        assert sorted(placed.values()) == [ECHO, GOLDEN]  # one session on each node
        ended = [r for r in results if r.errors]
        went_on = [r for r in results if not r.errors]
        assert len(ended) == 1 and len(went_on) == 1
        assert ended[0].errors == ["the session ended on the server (engine_lost)"]
        assert ended[0].handshake and len(ended[0].pcm) < len(audio)  # it stopped mid-call
        assert went_on[0].close_code == 1000 and echo_similarity(audio, went_on[0].pcm) >= 0.8

        def golden_gone() -> bool:
            workers = {w["id"]: w for w in cluster_state(server.url)["workers"]}
            return not workers.get(GOLDEN, {"up": False})["up"]

        wait_for(golden_gone, timeout=30, what="the golden worker shown down")
        assert time.monotonic() - removed_at < 60
        with httpx.Client() as client:
            assert client.get(server.url + "/readyz").status_code == 200  # the echo node still serves
