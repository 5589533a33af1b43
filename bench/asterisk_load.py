"""Asterisk benchmark: echo calls carried in real time per process, and the server's CPU per
call-second, for AudioSocket and chan_websocket beside Twilio's (printed, never asserted).

    .venv/bin/python bench/asterisk_load.py [--modes audiosocket,websocket] [--levels 10,20,40]
        [--seconds 5] [--cpu-calls 20] [--rounds 2] [--processes 2] [--no-twilio]

One server runs `personaplex-voice serve --engine echo --carriers twilio,asterisk --audiosocket
127.0.0.1:PORT` in its own process. Simulated Asterisks (personaplex_asterisk.simulate, in
worker processes on uvloop; each call a task sending real-time 16 kHz L16 audio, precomputed)
and simulated Twilio (bench/twilio_load.py's worker, the baseline) then:

1. Capacity, per mode: levels of concurrent calls of `--seconds`; a level passes when the server
   counted no late frame (no engine frame without its caller audio in time, no message after
   the carrier's buffer of ours ran dry) and no call closed early. Printed: the largest passing
   level ("calls carried in real time per process": the server is one process).
2. CPU, per mode: `--cpu-calls` calls of `--seconds`, the modes in turn for `--rounds` rounds
   (the shared machine's drift hits all alike): the server's CPU time per call-second, and its
   ratio to Twilio's.

`asterisk_worker(mode, base_url, audiosocket, starts, seconds, out)` and `run_asterisk_calls`
have the shape of bench/phone_load.py's per-carrier worker and `run_calls`, so that script can
take the two modes as carriers `asterisk-audiosocket` and `asterisk-websocket`.

Last line: {"cpu_ms_per_call_second": {mode: …}, "ratio_to_twilio": {…}, "max_calls": {…}, …}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

API_TOKEN = "bench-api-token"
RATE = 16000
MODES = ("audiosocket", "websocket")


def speech(rate: int = RATE, seconds: float = 2.0) -> np.ndarray:
    t = np.arange(round(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * 440 * t) * (0.5 + 0.5 * np.sin(2 * np.pi * 3 * t))).astype(np.float32)


def asterisk_worker(
    mode: str, base_url: str, audiosocket: tuple[str, int], starts: list[float], seconds: float, out: mp.Queue
) -> None:
    """One process of simulated Asterisk calls (`mode` audiosocket or websocket), call i starting
    at `starts[i]` (wall clock). Puts one row per call: late messages heard (after the first
    second), messages, closed early; `worker_cpu_s`, this process's CPU per call."""
    import gc

    from personaplex_asterisk.simulate import AsteriskSimulator

    from personaplex_voice.audio.telephony import l16_encode

    gc.freeze()
    os.nice(5)  # the simulated Asterisk shares the machine with the server under test: the server first
    cpu = [0.0]
    audio = l16_encode(speech(), big_endian=False)
    size = RATE // 50 * 2
    payloads = [audio[i : i + size] for i in range(0, len(audio) - size + 1, size)]

    async def main() -> list[dict]:
        sim = AsteriskSimulator(base_url, API_TOKEN, audiosocket)
        answers = []
        for _ in starts:
            status, answer = await sim.ask()
            if status != 200:
                raise RuntimeError(f"POST /asterisk/calls answered {status}: {answer}")
            answers.append(answer)
        await asyncio.sleep(max(0.0, min(starts) - time.time()))
        cpu0 = time.process_time()
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [
                    group.create_task(one(sim, a["uuid"], at)) for a, at in zip(answers, starts, strict=True)
                ]
        finally:
            await sim.close()
        cpu[0] = time.process_time() - cpu0
        return [t.result() for t in tasks]

    async def one(sim, call_uuid: str, start_at: float) -> dict:
        await asyncio.sleep(max(0.0, start_at - time.time()))
        opened = (
            sim.audiosocket_call(call_uuid, rate=RATE)
            if mode == "audiosocket"
            else sim.websocket_call(call_uuid, "slin16")
        )
        async with opened as call:
            t0 = time.monotonic()
            call.late_after = t0 + 1.0  # the first second is the call's start (prefill, priming)
            for n in range(round(seconds / 0.020)):
                if call.closed.is_set():
                    break
                delay = t0 + n * 0.020 - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                await call.send_chunk(payloads[n % len(payloads)])
            late = call.late
            closed_early = call.closed.is_set()
        return {"late": late, "messages": call.received_messages, "closed_early": closed_early}

    try:
        try:
            import uvloop

            rows = uvloop.run(main())
        except ImportError:
            rows = asyncio.run(main())
        for row in rows:
            row["worker_cpu_s"] = cpu[0] / max(1, len(rows))
        out.put(rows)
    except Exception as exc:  # reported: the level then fails
        out.put([{"error": repr(exc)}])


def _starts(calls: int) -> list[float]:
    start_at = time.time() + 2.0 + calls * 0.02  # every call asked for before any speaks
    return [start_at + k * 0.01 for k in range(calls)]


def run_asterisk_calls(
    mode: str, base_url: str, audiosocket: tuple[str, int], calls: int, seconds: float, processes: int
) -> dict:
    return _collect(
        [
            (asterisk_worker, (mode, base_url, audiosocket, share, seconds))
            for share in _shares(calls, processes)
        ],
        calls,
        seconds,
    )


def run_twilio_calls(base_url: str, calls: int, seconds: float, processes: int) -> dict:
    from twilio_load import worker as twilio_worker

    return _collect(
        [(twilio_worker, (base_url, seconds, share)) for share in _shares(calls, processes)], calls, seconds
    )


def _shares(calls: int, processes: int) -> list[list[float]]:
    starts = _starts(calls)
    return [s for s in (starts[i::processes] for i in range(processes)) if s]


def _collect(jobs: list, calls: int, seconds: float) -> dict:
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, out)) for target, args in jobs]
    for p in procs:
        p.start()
    rows: list[dict] = []
    for _ in procs:
        rows += out.get(timeout=seconds + calls + 120)
    for p in procs:
        p.join(timeout=30)
    sim_cpu = sum(r.get("worker_cpu_s", 0.0) for r in rows)
    return {
        "calls": calls,
        "simulator_late_messages": int(sum(r.get("late", 0) for r in rows)),
        "closed_early": int(sum(bool(r.get("closed_early")) for r in rows)),
        "simulator_cpu_ms_per_call_second": round(1000 * sim_cpu / (calls * seconds), 2),
        "errors": [r["error"] for r in rows if "error" in r][:3],
    }


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def listing(base_url: str) -> dict:
    import httpx

    return httpx.get(
        base_url + "/phone/calls", headers={"Authorization": f"Bearer {API_TOKEN}"}, timeout=30
    ).json()


def server_late(base_url: str, carrier: str, calls: int) -> int:
    """The server's own count of late frames over the carrier's last `calls` calls."""
    rows = [c for c in listing(base_url)["calls"] if c.get("carrier") == carrier][-calls:]
    metrics = [c.get("metrics") or {} for c in rows]
    return sum(m.get("late_frames", 0) + (m.get("session") or {}).get("late_frames", 0) for m in metrics)


def end_reasons(base_url: str, carrier: str, calls: int) -> dict[str, int]:
    rows = [c for c in listing(base_url)["calls"] if c.get("carrier") == carrier][-calls:]
    reasons: dict[str, int] = {}
    for row in rows:
        reason = str(row.get("end_reason"))
        reasons[reason] = reasons.get(reason, 0) + 1
    return reasons


def wait_idle(base_url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = listing(base_url)
        if state["active_sessions"] == 0 and state["reserved"] == 0 and not state["live"]:
            return
        time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--levels", default="10,20,40")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--cpu-calls", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--processes", type=int, default=2, help="simulator processes")
    parser.add_argument("--no-twilio", action="store_true", help="skip Twilio's baseline")
    args = parser.parse_args()

    from support_server import free_port, running_server
    from twilio_load import SERVER_ENV

    modes = [m for m in args.modes.split(",") if m in MODES]
    names = modes if args.no_twilio else ["twilio", *modes]
    levels = [int(x) for x in args.levels.split(",")]
    top = max([*levels, args.cpu_calls])
    port = free_port()
    audiosocket = ("127.0.0.1", port)
    env = {**SERVER_ENV, "PERSONAPLEX_PHONE_API_TOKEN": API_TOKEN, "PERSONAPLEX_SATURATION": "0"}
    serve = ("--carriers", "twilio,asterisk", "--audiosocket", f"127.0.0.1:{port}")
    serve += ("--max-sessions", str(top), "--log-level", "warning")

    def run(name: str, calls: int) -> dict:
        if name == "twilio":
            return run_twilio_calls(server.url, calls, args.seconds, args.processes)
        return run_asterisk_calls(name, server.url, audiosocket, calls, args.seconds, args.processes)

    result: dict = {"modes": names, "seconds": args.seconds, "cpu_calls": args.cpu_calls}
    with running_server(*serve, env=env, timeout=120) as server:
        pid = server.process.pid
        max_calls: dict[str, int] = {}
        for name in names:
            best = 0
            for level in levels:
                row = run(name, level)
                wait_idle(server.url)
                carrier = "twilio" if name == "twilio" else "asterisk"
                row["server_late_frames"] = server_late(server.url, carrier, level)
                row["end_reasons"] = end_reasons(server.url, carrier, level)
                print(json.dumps({"mode": name, **row}), flush=True)
                if row["errors"] or row["closed_early"] or row["server_late_frames"]:
                    break
                best = level
            max_calls[name] = best
        cost: dict[str, list[float]] = {n: [] for n in names}
        for _ in range(args.rounds):
            for name in names:
                cpu0 = cpu_seconds(pid)
                row = run(name, args.cpu_calls)
                cost[name].append(1000 * (cpu_seconds(pid) - cpu0) / (args.cpu_calls * args.seconds))
                wait_idle(server.url)
                print(
                    json.dumps({"mode": name, "cpu_ms_per_call_second": round(cost[name][-1], 2), **row}),
                    flush=True,
                )
    means = {n: round(float(np.mean(v)), 2) for n, v in cost.items() if v}  # --rounds 0: none
    base = means.get("twilio")
    result.update(
        max_calls=max_calls,
        cpu_ms_per_call_second=means,
        ratio_to_twilio={n: round(v / base, 3) for n, v in means.items()} if base else None,
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
