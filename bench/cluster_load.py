"""Cluster load: calls carried by 1 and 2 front-end processes over 2 engine workers, and the hop's cost.

    .venv/bin/python bench/cluster_load.py --engine echo [--twilio-levels 10,25,50,100,150]
        [--chat-levels 8,16,32,48] [--seconds 4] [--ramp-ms 10] [--ray] [--frontends 1,2]

For each front-end count (1, then 2), `personaplex-voice serve --workers F --engine-workers 2
--engine echo --twilio` runs (the supervisor, F front-ends, 2 engine workers: separate
processes); the simulators run in processes of their own:
- Twilio: bench/twilio_load.py's simulated calls (2 processes on uvloop), level by level; a level
  passes when no engine tick missed a caller's audio (the workers' late_frames_total), no bridge
  pacer found Twilio's buffer of ours dry (the front-ends' call records), no call closed early.
- /api/chat: bench/server_load.py's sphn Ogg-Opus clients (in one process of their own), real
  time; a level passes when every caller got its whole echo, at most one late input frame per
  caller, no dropped output frame and no clock overrun.
The maximum counts only the levels below the first failure.

CPU: user + system time of every front-end and every engine worker (/proc), per call-second,
at the largest passing Twilio level with 2 front-ends. The hop, at that level too: each frame's
one-way time from the worker's delivery to the front-end's receipt and from the front-end's send
to the worker's session, stamped on the shared monotonic clock (`/api/cluster` reports both over
the last 10 s); `hop_added_ms_*` is the sum of the two directions' p50 (p99): what the split adds
to a round trip.

`--ray`: the same levels once more with the engine workers as Ray actors (`serve --ray ADDRESS
--engine-workers 2 --workers 2` on a local 2-node Ray cluster with token authentication,
tests/support_ray.py), beside the process-worker rows of the same run: calls carried, hop added,
front-end and engine-worker CPU per call-second (`ray_*` in the last line).

First, the engine worker alone (`--isolated-sessions`, 64: one worker, one client in this
process, no simulators): its CPU per call-second and the hop, without CPU contention.

Last line: {"twilio_calls_1_frontend", "twilio_calls_2_frontends", "chat_sessions_1_frontend",
"chat_sessions_2_frontends", "hop_added_ms_p50", "hop_added_ms_p99",
"frontend_cpu_ms_per_call_s", "engine_worker_cpu_ms_per_call_s", ...}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import re
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

import twilio_load  # noqa: E402
from support_server import running_server  # noqa: E402

from personaplex_voice.cluster.procs import cpu_seconds  # noqa: E402

API_TOKEN = twilio_load.API_TOKEN
SR = 24000
WORKER_COUNTERS = ("late_frames_total", "dropped_output_frames_total", "tick_overruns_total")


def worker_counters(base_url: str) -> dict[str, float]:
    """Sums over engine workers of the counters a level is judged by (one front-end's /metrics
    shows every worker)."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    out = {}
    for name in WORKER_COUNTERS:
        out[name] = sum(
            float(v) for v in re.findall(rf"^personaplex_{name}{{worker=[^}}]*}} (\S+)$", text, re.M)
        )
    return out


def cluster(base_url: str, frontends: int) -> dict:
    """/api/cluster as every front-end answers it (new connections land on either)."""
    seen: dict[str, dict] = {}
    for _ in range(50):
        state = httpx.get(base_url + "/api/cluster", timeout=10).json()
        seen[state["frontend"]["id"]] = state
        if len(seen) >= frontends:
            break
    return seen


def pids(base_url: str, frontends: int) -> tuple[list[int], list[int]]:
    states = cluster(base_url, frontends)
    any_state = next(iter(states.values()))
    workers = [w["pid"] for w in any_state["workers"]]
    fes = sorted({pid for w in any_state["workers"] for pid in w["frontend_pids"].values()})
    return fes, workers


def wait_up(base_url: str, frontends: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = httpx.get(base_url + "/api/cluster", timeout=5).json()
            if len(state["workers"]) == 2 and all(
                w["up"] and len(w["frontend_pids"]) == frontends for w in state["workers"]
            ):
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.2)
    raise RuntimeError("the cluster did not come up")


def bridge_records(base_url: str, calls: int, frontends: int) -> list[dict]:
    """The last `calls` finished calls, from every front-end's Twilio call history."""
    records: dict[str, dict] = {}
    for seen in range(1, 61):
        state = httpx.get(
            base_url + "/twilio/calls", headers={"Authorization": f"Bearer {API_TOKEN}"}, timeout=10
        ).json()
        for record in state["calls"]:
            if record.get("metrics"):
                records[record["call_sid"]] = record
        if seen >= 4 * frontends and len(records) >= calls:
            break
    ordered = sorted(records.values(), key=lambda r: r["statuses"][0]["t"] if r["statuses"] else 0.0)
    return ordered[-calls:]


def hop_now(base_url: str, frontends: int) -> dict[str, float | None]:
    """The hop both ways over the last 10 s, as the worst front-end / worker saw it: the sum of
    the two directions' p50 (p99) is what the split adds to a round trip."""
    states = cluster(base_url, frontends)
    out = [s["frontend"]["output_hop"] for s in states.values()]
    into = [w["input_hop"] for s in states.values() for w in s["workers"]]

    def worst(hops: list, key: str) -> float:
        return max((h[key] for h in hops if h and h.get(key) is not None), default=0.0)

    return {
        "added_ms_p50": round(worst(out, "p50_ms") + worst(into, "p50_ms"), 3),
        "added_ms_p99": round(worst(out, "p99_ms") + worst(into, "p99_ms"), 3),
        "output_ms_p50": worst(out, "p50_ms"),
        "input_ms_p50": worst(into, "p50_ms"),
    }


def wait_idle(base_url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = httpx.get(base_url + "/api/cluster", timeout=5).json()
        if state["active"] == 0 and state["reserved"] == 0:
            return
        time.sleep(0.2)


def measured(base_url: str, frontends: int, run) -> tuple[dict, dict]:
    """Runs `run()`; returns its row and the CPU / counters around it."""
    fe_pids, worker_pids = pids(base_url, frontends)
    before = worker_counters(base_url)
    fe0, w0 = [cpu_seconds(p) for p in fe_pids], [cpu_seconds(p) for p in worker_pids]
    wall0 = time.monotonic()
    row = run()
    wall = time.monotonic() - wall0
    fe_cpu = [cpu_seconds(p) - c for p, c in zip(fe_pids, fe0, strict=True)]
    w_cpu = [cpu_seconds(p) - c for p, c in zip(worker_pids, w0, strict=True)]
    after = worker_counters(base_url)
    return row, {
        "frontend_cpu_s": [round(c, 2) for c in fe_cpu],
        "engine_worker_cpu_s": [round(c, 2) for c in w_cpu],
        "wall_s": round(wall, 1),
        **{name: after[name] - before[name] for name in WORKER_COUNTERS},
    }


# -- /api/chat clients in a process of their own ----------------------------------------------------


def chat_process(ws_url: str, clients: int, seconds: float, results: mp.Queue) -> None:
    import numpy as np
    import server_load

    try:
        audio = server_load.speech(seconds)
        url = ws_url + "/api/chat?text_prompt=bench"
        offsets = [i * 7 * server_load.FRAME for i in range(clients)]

        async def main() -> list[dict]:
            return await asyncio.gather(*(server_load.one_client(url, audio, o) for o in offsets))

        rows = asyncio.run(main())
        delays, complete = [], True
        for client in rows:
            d, ok = server_load.frame_delays(client)
            delays += d
            complete &= ok
        p99 = float(np.percentile(delays, 99) * 1000) if delays else None
        results.put({"complete": complete, "p99_frame_delay_ms": p99})
    except Exception as exc:
        results.put({"complete": False, "error": repr(exc)})


def run_chat_level(base_url: str, ws_url: str, clients: int, seconds: float) -> dict:
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    proc = ctx.Process(target=chat_process, args=(ws_url, clients, seconds, results))
    proc.start()
    row = results.get(timeout=seconds + 180)
    proc.join(timeout=30)
    return {"clients": clients, **row}


# -- the engine worker alone ------------------------------------------------------------------------


def isolated_worker_cost(sessions: int, seconds: float) -> dict:
    """One echo engine worker process and, in this process, one ClusterClient with `sessions`
    sessions pushing 20 ms of audio each every 20 ms (at spread phases, as real callers): the
    worker's CPU per call-second and the hop both ways, with no simulators, transports or second
    front-end competing for the CPU."""
    import json as _json
    import subprocess
    import tempfile

    import numpy as np

    from personaplex_voice.cluster.client import ClusterClient
    from personaplex_voice.engine.base import Persona

    tmp = Path(tempfile.mkdtemp(prefix="cluster-load-"))
    settings = {"engine": "echo", "max_sessions": sessions, "log_level": "warning", "idle_timeout_s": 0}
    (tmp / "settings.json").write_text(_json.dumps(settings))
    sock = tmp / "w0.sock"
    cmd = [sys.executable, "-m", "personaplex_voice.cluster.worker", "--settings", str(tmp / "settings.json")]
    env = {**os.environ, "PERSONAPLEX_CLUSTER_SECRET": "bench", "PERSONAPLEX_SATURATION": "0"}
    worker = subprocess.Popen([*cmd, "--listen", f"unix:{sock}"], env=env)
    result: dict = {}

    async def main() -> None:
        client = ClusterClient(frontend_id="bench")
        client.add_static_worker("w0", f"unix:{sock}", "bench")
        await client.start()
        await client.wait_for_workers(1, timeout=60)
        await asyncio.sleep(0.5)
        calls = [await client.open(Persona(text_prompt="bench")) for _ in range(sessions)]
        await asyncio.gather(*(c.ready() for c in calls))
        chunk = (0.1 * np.random.default_rng(0).standard_normal(480)).astype(np.float32)

        async def consume(session) -> None:
            async for _ in session.frames():
                pass

        readers = [asyncio.create_task(consume(c)) for c in calls]
        # Callers are not in step: 16 groups, their 20 ms messages spread over the period.
        groups = [calls[g::16] for g in range(16)]
        cpu0, t0, k = cpu_seconds(worker.pid), time.monotonic(), 0
        while time.monotonic() - t0 < seconds:
            for session in groups[k % 16]:
                session.push(chunk)
            k += 1
            await asyncio.sleep(max(0.0, t0 + k * 0.020 / 16 - time.monotonic()))
        cpu = cpu_seconds(worker.pid) - cpu0
        await asyncio.sleep(1.2)  # the worker's next metrics beat carries its input hop
        status = client.describe()
        out, into = status["frontend"]["output_hop"], status["workers"][0]["input_hop"] or {}
        result.update(
            sessions=sessions,
            worker_cpu_ms_per_call_s=round(1000 * cpu / (sessions * seconds), 3),
            hop_added_ms_p50=round((out["p50_ms"] or 0) + (into.get("p50_ms") or 0), 3),
            hop_added_ms_p99=round((out["p99_ms"] or 0) + (into.get("p99_ms") or 0), 3),
        )
        for session in calls:
            await session.close()
        await asyncio.gather(*readers)
        await client.shutdown()

    try:
        asyncio.run(main())
    finally:
        worker.terminate()
        worker.wait(timeout=30)
    return result


# -- one configuration ------------------------------------------------------------------------------


def run_config(frontends: int, args: argparse.Namespace, ray: object | None = None) -> dict:
    """One server configuration through every level; `ray`: a support_ray.RayCluster whose
    actors are the engine workers (else engine-worker processes of the supervisor)."""
    levels_twilio = [int(v) for v in args.twilio_levels.split(",")]
    levels_chat = [int(v) for v in args.chat_levels.split(",")]
    env = {
        "TWILIO_AUTH_TOKEN": twilio_load.AUTH_TOKEN,
        "TWILIO_ACCOUNT_SID": "",
        "PUBLIC_URL": "",
        "PERSONAPLEX_TWILIO_API_TOKEN": API_TOKEN,
        "PERSONAPLEX_LOG_LEVEL": "warning",
        "PERSONAPLEX_SATURATION": "0",  # every call of a level at once: raw capacity, no admission control
    }
    slots = max(max(levels_twilio), max(levels_chat)) // 2 + 8
    cmd = ("--workers", str(frontends), "--engine-workers", "2", "--max-sessions", str(slots), "--twilio")
    mode = "ray" if ray is not None else "process"
    if ray is not None:
        cmd = ("--ray", ray.address, *cmd)  # type: ignore[attr-defined]
        env = {**ray.env, **env}  # type: ignore[attr-defined]
    result: dict = {"frontends": frontends, "mode": mode, "twilio_rows": [], "chat_rows": []}
    with running_server(*cmd, "--log-level", "warning", env=env, timeout=240) as server:
        wait_up(server.url, frontends)
        best, best_cost = 0, None
        for calls in levels_twilio:

            def run(calls: int = calls) -> dict:
                return twilio_load.run_level(server.url, calls, args.seconds, 2, args.ramp_ms / 1000)

            row, around = measured(server.url, frontends, run)
            row["hop"] = hop_now(server.url, frontends)  # over the last 10 s: this level's calls
            records = bridge_records(server.url, calls, frontends)
            row.update(around)
            row["bridge_late_frames"] = sum(r["metrics"].get("late_frames", 0) for r in records)
            call_s = calls * args.seconds
            row["frontend_cpu_ms_per_call_s"] = round(1000 * sum(around["frontend_cpu_s"]) / call_s, 2)
            row["engine_worker_cpu_ms_per_call_s"] = round(
                1000 * sum(around["engine_worker_cpu_s"]) / call_s, 2
            )
            print(json.dumps({"mode": mode, "frontends": frontends, "twilio": row}), flush=True)
            result["twilio_rows"].append(row)
            wait_idle(server.url)
            ok = not (
                row["late_frames_total"] or row["bridge_late_frames"] or row["closed_early"] or row["errors"]
            )
            if not ok:
                break
            best = calls
            best_cost = row
        result["twilio_calls"] = best
        result["cost_row"] = best_cost
        best_chat = 0
        for clients in levels_chat:

            def run(clients: int = clients) -> dict:
                return run_chat_level(server.url, server.ws_url, clients, args.seconds)

            row, around = measured(server.url, frontends, run)
            row.update(around)
            call_s = clients * args.seconds
            row["frontend_cpu_ms_per_call_s"] = round(1000 * sum(around["frontend_cpu_s"]) / call_s, 2)
            print(json.dumps({"mode": mode, "frontends": frontends, "chat": row}), flush=True)
            result["chat_rows"].append(row)
            wait_idle(server.url)
            ok = (
                row["complete"]
                and row["late_frames_total"] <= clients
                and not row["dropped_output_frames_total"]
                and not row["tick_overruns_total"]
            )
            if not ok:
                break
            best_chat = clients
        result["chat_sessions"] = best_chat
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engine", default="echo", choices=["echo"])
    parser.add_argument("--twilio-levels", default="10,25,50,100,150")
    parser.add_argument("--chat-levels", default="8,16,32,48")
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--ramp-ms", type=float, default=10.0)
    parser.add_argument("--isolated-sessions", type=int, default=64)
    parser.add_argument("--ray", action="store_true", help="also the engine workers as Ray actors")
    parser.add_argument("--frontends", default="1,2", help="process-worker configurations to run")
    args = parser.parse_args()
    isolated = isolated_worker_cost(args.isolated_sessions, 8.0)
    print(json.dumps({"isolated_worker": isolated}), flush=True)
    counts = [int(v) for v in args.frontends.split(",") if v]
    empty = {"twilio_calls": None, "chat_sessions": None, "cost_row": None}
    one = run_config(1, args) if 1 in counts else empty
    two = run_config(2, args) if 2 in counts else empty
    ray_summary = {}
    if args.ray:
        ray_summary = ray_mode(args)
    cost = two["cost_row"] or one["cost_row"] or {}
    hop = cost.get("hop") or {}
    summary = {
        "twilio_calls_1_frontend": one["twilio_calls"],
        "twilio_calls_2_frontends": two["twilio_calls"],
        "chat_sessions_1_frontend": one["chat_sessions"],
        "chat_sessions_2_frontends": two["chat_sessions"],
        "hop_added_ms_p50": hop.get("added_ms_p50"),
        "hop_added_ms_p99": hop.get("added_ms_p99"),
        "frontend_cpu_ms_per_call_s": cost.get("frontend_cpu_ms_per_call_s"),
        "engine_worker_cpu_ms_per_call_s": cost.get("engine_worker_cpu_ms_per_call_s"),
        "cost_measured_at_calls": cost.get("calls"),
        "cost_frontend_cpu_s": cost.get("frontend_cpu_s"),
        "cost_engine_worker_cpu_s": cost.get("engine_worker_cpu_s"),
        "cost_simulator_cpu_ms_per_call_s": cost.get("simulator_cpu_ms_per_call_second"),
        "frontend_cpu_ms_per_call_s_1_frontend": (one["cost_row"] or {}).get("frontend_cpu_ms_per_call_s"),
        "isolated_worker_cpu_ms_per_call_s": isolated["worker_cpu_ms_per_call_s"],
        "isolated_hop_added_ms_p50": isolated["hop_added_ms_p50"],
        "isolated_hop_added_ms_p99": isolated["hop_added_ms_p99"],
        **ray_summary,
        "seconds_per_level": args.seconds,
        "cpu_count": os.cpu_count(),
    }
    print(json.dumps(summary))


def ray_mode(args: argparse.Namespace) -> dict:
    """The levels with 2 front-ends over 2 engine actors on a local 2-node Ray cluster."""
    import subprocess

    from support_ray import ray_cluster

    with ray_cluster(nodes=2) as ray:
        try:
            result = run_config(2, args, ray)
        finally:  # the actors are detached: remove them before the cluster goes
            code = (
                "import sys; from personaplex_voice.cluster.ray_actors import stop_engine_actors as s; "
                "s(sys.argv[1])"
            )
            subprocess.run([sys.executable, "-c", code, ray.address], cwd=ROOT, env=ray.env, timeout=120)
    cost = result["cost_row"] or {}
    hop = cost.get("hop") or {}
    return {
        "ray_twilio_calls_2_frontends": result["twilio_calls"],
        "ray_chat_sessions_2_frontends": result["chat_sessions"],
        "ray_hop_added_ms_p50": hop.get("added_ms_p50"),
        "ray_hop_added_ms_p99": hop.get("added_ms_p99"),
        "ray_frontend_cpu_ms_per_call_s": cost.get("frontend_cpu_ms_per_call_s"),
        "ray_engine_worker_cpu_ms_per_call_s": cost.get("engine_worker_cpu_ms_per_call_s"),
        "ray_cost_measured_at_calls": cost.get("calls"),
    }


if __name__ == "__main__":
    main()
