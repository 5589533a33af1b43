"""Self-hosted switches and contact-center platforms under load: echo calls carried in real time
by one server process, and the server's CPU per call-second, for jambonz and Genesys Cloud
beside Twilio (the baseline, measured in the same run).

    .venv/bin/python bench/platform_load.py [--carriers twilio,jambonz,genesys] [--levels 1,5,10,20]
        [--seconds 5] [--ramp-ms 20] [--all-levels]

`personaplex-voice serve --engine echo --carriers twilio,jambonz,genesys` runs in its own process;
for each carrier, simulated calls (personaplex_phone.simulator with the carrier's `sim.py` side:
signed as the carrier signs, real-time audio in its codec and rate, our audio "played" by a model
of its buffer) ramp up level by level, one starting every `--ramp-ms`, each streaming `--seconds`
of audio. A level passes when the server counted no late frame in any of its calls: no engine
frame without its caller audio in time (`session.late_frames`), no message of ours reaching the
carrier after its buffer had run dry (`late_frames`). Printed per level: those counts, the
simulator's own count of late messages, and the server's CPU time per call-second (answering,
streams, the echo engine). The last line is a JSON summary: per carrier its most calls with no
late frame (below the first level that had one) and its CPU per call-second at the largest level
every carrier ran, with the ratio to Twilio's. Each carrier makes one unmeasured call first. The
simulated calls share one process (and, on a small machine, the server's cores): at the higher
levels a late frame may be the simulator's own, which `sim_late_messages` shows.

The parts another benchmark can take: `PLATFORMS[name]` (the server's environment for the
carrier and its simulator side), `run_level(base_url, carrier, calls, seconds, ramp_s)`.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

API_TOKEN = "bench-api-token"


@dataclass(frozen=True)
class Platform:
    env: dict[str, str]  # what the server needs for this carrier
    side: Callable[[], Any]  # the carrier's side, with the same secrets


def _twilio_side() -> Any:
    from personaplex_twilio.sim import side

    return side(auth_token="bench-twilio-token")


def _jambonz_side() -> Any:
    from personaplex_jambonz.sim import JambonzSide

    return JambonzSide("bench-jambonz-secret")


def _genesys_side() -> Any:
    from personaplex_genesys.sim import GenesysSide

    return GenesysSide("bench-genesys-key", GENESYS_SECRET)


GENESYS_SECRET = base64.b64encode(b"bench-genesys-client-secret-0001").decode()
PLATFORMS: dict[str, Platform] = {
    "twilio": Platform({"TWILIO_AUTH_TOKEN": "bench-twilio-token", "TWILIO_ACCOUNT_SID": ""}, _twilio_side),
    "jambonz": Platform({"JAMBONZ_WEBHOOK_SECRET": "bench-jambonz-secret"}, _jambonz_side),
    "genesys": Platform(
        {"GENESYS_API_KEY": "bench-genesys-key", "GENESYS_CLIENT_SECRET": GENESYS_SECRET}, _genesys_side
    ),
}


def caller_audio(seconds: float, rate: int) -> np.ndarray:
    """A voice-like test signal (a gliding harmonic series, syllable-rate envelope)."""
    t = np.arange(round(seconds * rate)) / rate
    f0 = 140 + 30 * np.sin(2 * np.pi * 0.5 * t)
    phase = 2 * np.pi * np.cumsum(f0) / rate
    voice = sum(np.sin(k * phase) / k for k in range(1, 12))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 3.0 * t)
    return (0.2 * voice * envelope).astype(np.float32)


async def _one_call(sim: Any, seconds: float, start_at: float) -> dict[str, Any]:
    await asyncio.sleep(max(0.0, start_at - time.monotonic()))
    try:
        offer = await sim.answer()
        async with sim.stream(offer) as call:
            await call.answered(timeout=30)
            await call.play(caller_audio(seconds, offer.inbound.rate))
        return {"call_id": offer.call_id, "sim_late_messages": call.late_messages}
    except Exception as exc:  # a refused or broken call is the level's failure, not the bench's
        return {"error": f"{type(exc).__name__}: {exc}"[:200]}


def _record(base_url: str, call_id: str) -> dict[str, Any]:
    import httpx

    headers = {"Authorization": f"Bearer {API_TOKEN}"}
    for _ in range(100):  # the record closes a moment after the caller hangs up
        record = httpx.get(f"{base_url}/phone/calls/{call_id}", headers=headers, timeout=10).json()
        if record.get("ended_at"):
            return record
        time.sleep(0.1)
    return record


def run_level(base_url: str, carrier: str, calls: int, seconds: float, ramp_s: float) -> dict[str, Any]:
    from personaplex_phone.simulator import PhoneSimulator

    sim = PhoneSimulator(PLATFORMS[carrier].side(), base_url, timeout_s=30)

    async def level() -> list[dict[str, Any]]:
        t0 = time.monotonic() + 0.2
        return await asyncio.gather(*(_one_call(sim, seconds, t0 + i * ramp_s) for i in range(calls)))

    rows = asyncio.run(level())
    errors = [r["error"] for r in rows if "error" in r]
    metrics = [(_record(base_url, r["call_id"]).get("metrics") or {}) for r in rows if "call_id" in r]
    late_out = sum(m.get("late_frames", 0) for m in metrics)
    late_in = sum((m.get("session") or {}).get("late_frames", 0) for m in metrics)
    return {
        "carrier": carrier,
        "calls": calls,
        "bridge_late_frames": late_out,
        "engine_late_input_frames": late_in,
        "sim_late_messages": sum(r.get("sim_late_messages", 0) for r in rows),
        "errors": errors[:3],
        "passed": not errors and late_out == 0 and late_in == 0,
    }


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_idle(base_url: str, timeout: float = 30.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = httpx.get(base_url + "/phone/calls", headers={"Authorization": f"Bearer {API_TOKEN}"}).json()
        if state["active_sessions"] == 0 and state["reserved"] == 0:
            return
        time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--carriers", default="twilio,jambonz,genesys")
    parser.add_argument("--levels", default="1,5,10,20")
    parser.add_argument("--seconds", type=float, default=5.0, help="call length at each level")
    parser.add_argument("--ramp-ms", type=float, default=20.0, help="one call starts every this many ms")
    parser.add_argument("--all-levels", action="store_true", help="go on after a level with late frames")
    args = parser.parse_args()
    carriers = [c.strip() for c in args.carriers.split(",") if c.strip()]
    levels = [int(v) for v in args.levels.split(",")]

    from support_server import running_server

    env = {"PERSONAPLEX_PHONE_API_TOKEN": API_TOKEN, "PUBLIC_URL": "", "PERSONAPLEX_LOG_LEVEL": "warning"}
    for name in carriers:
        env.update(PLATFORMS[name].env)
    summary: dict[str, dict[str, Any]] = {}
    cost: dict[str, dict[int, float]] = {c: {} for c in carriers}
    with running_server(
        "--carriers",
        ",".join(carriers),
        "--max-sessions",
        str(max(levels)),
        "--log-level",
        "warning",
        env=env,
    ) as server:
        for carrier in carriers:  # one unmeasured call each: first-call costs fall on none of them
            run_level(server.url, carrier, 1, 1.0, 0.0)
        for carrier in carriers:
            best, failed = 0, False
            for calls in levels:
                wait_idle(server.url)
                cpu0 = cpu_seconds(server.process.pid)
                row = run_level(server.url, carrier, calls, args.seconds, args.ramp_ms / 1000)
                cpu = cpu_seconds(server.process.pid) - cpu0
                row["server_cpu_ms_per_call_second"] = round(1000 * cpu / (calls * args.seconds), 2)
                cost[carrier][calls] = row["server_cpu_ms_per_call_second"]
                print(json.dumps(row), flush=True)
                if row["passed"] and not failed:
                    best = calls  # the most calls below the first level that failed
                elif not row["passed"]:
                    failed = True
                    if not args.all_levels:
                        break
            summary[carrier] = {"max_calls_no_late_frames": best}
    common = [n for n in levels if all(n in cost[c] for c in carriers)]
    at = max(common) if common else None
    for carrier in carriers:
        if at is None:
            continue
        summary[carrier]["server_cpu_ms_per_call_second"] = cost[carrier][at]
        if "twilio" in cost and cost["twilio"].get(at):
            summary[carrier]["cpu_ratio_to_twilio"] = round(cost[carrier][at] / cost["twilio"][at], 2)
    print(
        json.dumps(
            {"seconds": args.seconds, "cpu_at_calls": at, "cpu_count": os.cpu_count(), "carriers": summary}
        )
    )


if __name__ == "__main__":
    main()
