"""`serve --ray ADDRESS --engine-workers 2 --engine echo --workers 2`, started as a user starts it
(a subprocess), on a local 2-node Ray cluster with token authentication (every process on
127.0.0.1): the supervisor creates the engine actors, Ray places one on each node (one CPU per
node, one per actor), and the front-ends find them. Sessions land on both actors; SIGKILL to one
actor's process ends only its calls and Ray restarts it, which the front-ends see come back;
SIGTERM to `serve` drains. A client without the cluster's token is told so in one line."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import soundfile as sf
from support_cluster import cluster_state, process_alive, wait_for, worker_by_id
from support_ray import RayCluster, parent_pid, ray_cluster
from support_server import ROOT, chat, echo_similarity, running_server

pytest.importorskip("ray")

pytestmark = [pytest.mark.timeout(420), pytest.mark.slow]

SR = 24000
ACTORS = ["personaplex-engine-0", "personaplex-engine-1"]


@pytest.fixture(scope="module")
def cluster() -> Iterator[RayCluster]:
    with ray_cluster(nodes=2) as running:
        yield running


@pytest.fixture
def ray_serve(cluster):
    """`serve --ray` on the cluster; afterwards its detached actors are removed (a next test
    starts from none)."""
    args = ("--ray", cluster.address, "--engine-workers", "2", "--workers", "2", "--max-sessions", "2")
    try:
        with running_server(*args, env=cluster.env, timeout=240) as server:
            yield server
    finally:
        code = (
            "import sys; from personaplex_voice.cluster.ray_actors import stop_engine_actors as s; "
            "print(s(sys.argv[1]))"
        )
        subprocess.run(
            [sys.executable, "-c", code, cluster.address], cwd=ROOT, env=cluster.env, timeout=120, check=False
        )


@pytest.fixture(scope="module")
def user_wav(golden_dir) -> np.ndarray:
    return sf.read(golden_dir / "user.wav", dtype="float32")[0][: 4 * SR]


def chat_url(server, seed: int = 0) -> str:
    params = {"text_prompt": "You enjoy having a good conversation.", "seed": str(seed)}
    return str(httpx.URL(server.ws_url + "/api/chat", params=params))


def wait_actors_up(server, frontends: int = 2) -> dict:
    state: dict = {}

    def up() -> bool:
        nonlocal state
        state = cluster_state(server.url)
        workers = state["workers"]
        return sorted(w["id"] for w in workers) == ACTORS and all(
            w["up"] and len(w["sessions_by_frontend"]) == frontends for w in workers
        )

    wait_for(up, timeout=120, what="both engine actors up, seen by both front-ends")
    return state


async def placed_calls(server, audio: np.ndarray, count: int) -> tuple[list, dict]:
    """`count` calls at once; returns their results and which actor each session was on."""
    calls = [asyncio.create_task(chat(chat_url(server, i), audio, max_tail_s=8)) for i in range(count)]
    seen: dict[str, int] = {}

    async def watch() -> None:
        while not all(c.done() for c in calls):
            state = await asyncio.to_thread(cluster_state, server.url)
            for worker in state["workers"]:
                seen[worker["id"]] = max(seen.get(worker["id"], 0), worker["slots"]["used"])
            await asyncio.sleep(0.1)

    watcher = asyncio.create_task(watch())
    results = await asyncio.gather(*calls)
    await watcher
    return results, seen


def test_serve_ray_puts_an_actor_on_each_node_and_sessions_use_both(cluster, ray_serve, user_wav):
    state = wait_actors_up(ray_serve)
    assert not state["frontend"]["torch_loaded"]
    pids = {w["id"]: w["pid"] for w in state["workers"]}
    # each actor's process was started by a different node's raylet: one actor per node
    assert sorted(parent_pid(pid) for pid in pids.values()) == sorted(cluster.raylet_pids)
    assert {w["engine"] for w in state["workers"]} == {"loopback"}
    results, used = asyncio.run(placed_calls(ray_serve, user_wav, 4))
    for result in results:
        assert result.errors == [] and result.handshake and result.close_code == 1000
        assert echo_similarity(user_wav, result.pcm) >= 0.8
    assert used == {ACTORS[0]: 2, ACTORS[1]: 2}  # 4 calls, 2 slots each: both actors full at once


def test_a_killed_actor_ends_only_its_calls_and_ray_restarts_it(cluster, ray_serve, user_wav):
    state = wait_actors_up(ray_serve)
    victim = worker_by_id(state, ACTORS[0])
    long = np.tile(user_wav, 2)  # 8 s: the kill lands mid-call

    async def timed(seed: int) -> tuple:
        result = await chat(chat_url(ray_serve, seed), long, max_tail_s=8)
        return result, time.monotonic()

    async def scenario():
        calls = [asyncio.create_task(timed(i)) for i in range(4)]
        # every call running on one actor or the other (2 slots each: 2 and 2)
        await asyncio.to_thread(
            wait_for,
            lambda: sum(w["slots"]["used"] for w in cluster_state(ray_serve.url)["workers"]) == 4,
            30,
            0.05,
            "all four calls placed",
        )
        await asyncio.sleep(1.5)
        killed_at = time.monotonic()
        os.kill(victim["pid"], signal.SIGKILL)
        results = await asyncio.gather(*calls)
        return killed_at, results

    killed_at, results = asyncio.run(scenario())
    lost = [(r, t) for r, t in results if r.errors]
    kept = [r for r, _ in results if not r.errors]
    assert len(lost) == 2 and len(kept) == 2, [r.errors for r, _ in results]
    for result, ended_at in lost:
        assert result.errors == ["the session ended on the server (engine_lost)"]
        assert result.handshake and len(result.pcm) < len(long)  # it stopped mid-call
        assert ended_at - killed_at < 5.0  # at once (well under 1 s on a quiet machine), not at the end
    for result in kept:  # the other actor's calls went on, whole
        assert result.close_code == 1000 and echo_similarity(long, result.pcm) >= 0.8

    def back() -> bool:
        worker = worker_by_id(cluster_state(ray_serve.url), ACTORS[0])
        return worker["up"] and worker["pid"] != victim["pid"] and worker["generation"] == 1

    wait_for(back, timeout=120, what="the killed actor restarted by Ray and found again")
    assert not process_alive(victim["pid"])
    restarted = worker_by_id(cluster_state(ray_serve.url), ACTORS[0])
    assert parent_pid(restarted["pid"]) in cluster.raylet_pids
    wait_actors_up(ray_serve)
    results, used = asyncio.run(placed_calls(ray_serve, user_wav[: 2 * SR], 4))
    assert all(r.errors == [] for r in results) and used == {ACTORS[0]: 2, ACTORS[1]: 2}


def test_sigterm_drains_new_sessions_refused_running_ones_finish(cluster, ray_serve, user_wav):
    wait_actors_up(ray_serve)
    audio = user_wav[: 3 * SR]

    async def scenario():
        running = asyncio.create_task(chat(chat_url(ray_serve), audio))
        await asyncio.to_thread(
            wait_for, lambda: cluster_state(ray_serve.url)["active"] == 1, 30, 0.05, "call running"
        )
        ray_serve.process.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.5)
        # off this loop, which streams the running call
        ready = [await asyncio.to_thread(httpx.get, ray_serve.url + "/readyz") for _ in range(4)]
        refused = await chat(chat_url(ray_serve, 1), audio[:SR])
        result = await running
        code = await asyncio.to_thread(ray_serve.process.wait, 60)
        return ready, refused, result, code

    ready, refused, result, code = asyncio.run(scenario())
    assert {r.status_code for r in ready} == {503} and {r.json()["status"] for r in ready} == {"draining"}
    assert not refused.handshake and refused.close_code == 1013 and "full" in refused.errors[0]
    assert result.errors == [] and result.close_code == 1000  # it finished on its own
    assert echo_similarity(audio, result.pcm) >= 0.8
    assert code == 0


def test_serve_ray_without_the_cluster_token_says_so_in_one_line(cluster):
    env = {**cluster.env, "RAY_AUTH_TOKEN": "not-the-cluster-token"}
    started = time.monotonic()
    run = subprocess.run(
        [
            *(sys.executable, "-m", "personaplex_voice.cli", "serve", "--engine", "echo", "--port", "0"),
            *("--ray", cluster.address, "--engine-workers", "1", "--workers", "1"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-2000:]
    error = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and f"--ray {cluster.address}: cannot join the Ray cluster" in error[0]
    assert "RAY_AUTH_MODE=token" in error[0] and "RAY_AUTH_TOKEN" in error[0]
    assert time.monotonic() - started < 150
