"""Phone carriers benchmark: echo calls carried in real time, and the server's CPU per call-second,
for each carrier, in one run (printed, never asserted).

    .venv/bin/python bench/phone_load.py [--carrier twilio,telnyx,plivo,vonage,exotel] [--levels 10,20,40,60]
        [--seconds 5] [--cpu-calls 20] [--rounds 2] [--memory-calls 100]

One server runs `personaplex-voice serve --engine echo --carriers …` in its own process, every
carrier's REST API faked locally (tests/support_phone.py). Simulated carriers
(personaplex_phone.simulator, in worker processes, each call a task sending real-time audio in
its carrier's format and codec) then:

0. Warm-up: `--warmup-calls` calls of every carrier first, not counted (a fresh server's first
   calls pay for imports, filter designs and the allocator's growth).
1. Capacity, per carrier: levels of concurrent calls of `--seconds`; a level passes when the
   server counted no late frame (no engine frame without its caller audio in time, no message
   reaching the carrier after its buffer of ours ran dry) and no call closed early. Printed:
   the largest passing level ("calls carried in real time per process": the server is one
   process).
2. CPU, per carrier: `--cpu-calls` calls of `--seconds`, the carriers in turn for `--rounds`
   rounds (the shared machine's drift hits all alike): the server's CPU time per call-second,
   and its ratio to Twilio's (the goal: every carrier within 20 %).
3. Memory (`--memory-calls N`, 0 skips it): N short calls in a row, Twilio's and the others';
   the server's resident memory before and after (the records of ended calls stay on disk, only
   a bounded summary in memory).

Last line: {"cpu_ms_per_call_second": {carrier: …}, "ratio_to_twilio": {…}, "max_calls": {…}, …}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from sim_pool import cpu_seconds, deal, rss_mib, run_workers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

CARRIERS = ("twilio", "telnyx", "plivo", "vonage", "exotel")


def speech(rate: int, seconds: float = 2.0) -> np.ndarray:
    t = np.arange(round(seconds * rate)) / rate
    tone = 0.3 * np.sin(2 * np.pi * 440 * t) * (0.5 + 0.5 * np.sin(2 * np.pi * 3 * t))
    return tone.astype(np.float32)


def worker(
    carrier: str, base_url: str, public_url: str, seconds: float, starts: list[float], out: mp.Queue
) -> None:
    """One process of simulated calls of `carrier`, call i starting at `starts[i]` (wall clock)."""
    import gc

    from personaplex_phone.audio_path import codec_for
    from personaplex_phone.simulator import PhoneSimulator
    from support_phone import carrier_side

    gc.freeze()
    os.nice(5)  # the simulated carrier shares this machine with the server under test: the server first
    cpu = [0.0]

    async def main() -> list[dict]:
        sim = PhoneSimulator(carrier_side(carrier), base_url, public_url=public_url, timeout_s=60)
        offers = [await sim.answer() for _ in starts]
        fmt = offers[0].inbound
        step = fmt.rate * sim.side.chunk_ms // 1000
        audio = codec_for(fmt).encode(speech(fmt.rate))
        size = step * fmt.bytes_per_sample
        payloads = [audio[i : i + size] for i in range(0, len(audio) - size + 1, size)]
        await asyncio.sleep(max(0.0, min(starts) - time.time()))
        cpu0 = time.process_time()
        async with asyncio.TaskGroup() as group:
            tasks = [
                group.create_task(one(sim, o, payloads, at)) for o, at in zip(offers, starts, strict=True)
            ]
        cpu[0] = time.process_time() - cpu0
        return [t.result() for t in tasks]

    async def one(sim, offer, payloads: list[bytes], start_at: float) -> dict:
        await asyncio.sleep(max(0.0, start_at - time.time()))
        period = sim.side.chunk_ms / 1000
        async with sim.stream(offer) as call:
            t0 = time.monotonic()
            for n in range(round(seconds / period)):
                if call.closed.is_set():
                    break
                delay = t0 + n * period - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                await call.send_payload(payloads[n % len(payloads)])
        late = sum(p.late for p in call.played if p.arrival - t0 > 1.0)
        return {
            "late": int(late),
            "messages": len(call.played),
            "closed_early": call.closed.is_set() and not call.played,
        }

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


def run_calls(
    carrier: str, base_url: str, public_url: str, calls: int, seconds: float, processes: int
) -> dict:
    start_at = time.time() + 2.0 + calls * 0.02
    starts = [start_at + k * 0.01 for k in range(calls)]
    rows = run_workers(
        worker,
        deal(starts, processes),
        carrier,
        base_url,
        public_url,
        seconds,
        timeout=seconds + calls + 120,
    )
    return {
        "calls": calls,
        "simulator_late_messages": int(sum(r.get("late", 0) for r in rows)),
        "closed_early": int(sum(r.get("closed_early", False) for r in rows)),
        "errors": [r["error"] for r in rows if "error" in r][:3],
    }


def listing(base_url: str) -> dict:
    import httpx
    from support_phone import API_TOKEN

    return httpx.get(
        base_url + "/phone/calls", headers={"Authorization": f"Bearer {API_TOKEN}"}, timeout=30
    ).json()


def server_late(base_url: str, carrier: str, calls: int) -> int:
    """The server's own count of late frames over the carrier's last `calls` calls."""
    rows = [c for c in listing(base_url)["calls"] if c.get("carrier") == carrier][-calls:]
    metrics = [c.get("metrics") or {} for c in rows]
    return sum(m.get("late_frames", 0) + (m.get("session") or {}).get("late_frames", 0) for m in metrics)


def wait_idle(base_url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = listing(base_url)
        if state["active_sessions"] == 0 and state["reserved"] == 0 and not state["live"]:
            return
        time.sleep(0.2)


async def short_calls(carrier: str, base_url: str, public_url: str, count: int) -> None:
    from personaplex_phone.simulator import PhoneSimulator
    from support_phone import carrier_side

    sim = PhoneSimulator(carrier_side(carrier), base_url, public_url=public_url)
    for _ in range(count):
        offer = await sim.answer()
        async with sim.stream(offer) as call:
            await call.answered()
            await call.dtmf("5")
            await call.play(speech(offer.inbound.rate, 0.3))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--carrier", default=",".join(CARRIERS), help="carriers to measure (Twilio is the baseline)"
    )
    parser.add_argument("--levels", default="10,20,40,60,80")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--cpu-calls", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--processes", type=int, default=2, help="simulator processes")
    parser.add_argument("--memory-calls", type=int, default=100)
    parser.add_argument("--warmup-calls", type=int, default=5)
    args = parser.parse_args()

    from support_phone import PUBLIC_URL, FakeCarrierApis, carrier_env
    from support_server import running_server

    carriers = ["twilio", *[c for c in args.carrier.split(",") if c and c != "twilio"]]
    levels = [int(x) for x in args.levels.split(",")]
    top = max([*levels, args.cpu_calls])
    apis = FakeCarrierApis().start()
    result: dict = {"carriers": carriers, "seconds": args.seconds, "cpu_calls": args.cpu_calls}
    with tempfile.TemporaryDirectory(prefix="phone-load-") as tmp:
        personas = Path(tmp) / "personas.yaml"
        personas.write_text("default: desk\npersonas:\n  desk: {text_prompt: 'Hello.'}\n")
        # Every call of a level answered at once: raw capacity, admission control off.
        env = {
            **carrier_env(apis.url, str(personas)),
            "PERSONAPLEX_LOG_LEVEL": "warning",
            "PERSONAPLEX_SATURATION": "0",
        }
        args_ = ("--carriers", ",".join(carriers), "--max-sessions", str(top), "--log-level", "warning")
        with running_server(*args_, env=env, timeout=120) as server:
            pid = server.process.pid
            for carrier in carriers if args.warmup_calls else ():
                run_calls(carrier, server.url, PUBLIC_URL, args.warmup_calls, 2.0, args.processes)
                wait_idle(server.url)
            # 1. capacity
            max_calls: dict[str, int] = {}
            for carrier in carriers:
                best = 0
                for level in levels:
                    row = run_calls(carrier, server.url, PUBLIC_URL, level, args.seconds, args.processes)
                    wait_idle(server.url)
                    row["server_late_frames"] = server_late(server.url, carrier, level)
                    print(json.dumps({"carrier": carrier, **row}), flush=True)
                    if row["errors"] or row["closed_early"] or row["server_late_frames"]:
                        break
                    best = level
                max_calls[carrier] = best
            # 2. CPU per call-second, carriers in turn
            cost: dict[str, list[float]] = {c: [] for c in carriers}
            for _ in range(args.rounds):
                for carrier in carriers:
                    cpu0 = cpu_seconds(pid)
                    row = run_calls(
                        carrier, server.url, PUBLIC_URL, args.cpu_calls, args.seconds, args.processes
                    )
                    cpu = cpu_seconds(pid) - cpu0
                    wait_idle(server.url)
                    cost[carrier].append(1000 * cpu / (args.cpu_calls * args.seconds))
                    print(
                        json.dumps(
                            {"carrier": carrier, "cpu_ms_per_call_second": round(cost[carrier][-1], 2)}
                        ),
                        flush=True,
                    )
            # 3. memory
            memory: dict[str, float] = {}
            if args.memory_calls:
                for carrier in carriers:
                    before = rss_mib(pid)
                    asyncio.run(short_calls(carrier, server.url, PUBLIC_URL, args.memory_calls))
                    wait_idle(server.url)
                    memory[carrier] = round(rss_mib(pid) - before, 2)
                    print(
                        json.dumps(
                            {
                                "carrier": carrier,
                                "calls": args.memory_calls,
                                "rss_growth_mib": memory[carrier],
                            }
                        ),
                        flush=True,
                    )
    apis.stop()
    means = {c: round(float(np.mean(v)), 2) for c, v in cost.items()}
    base = means["twilio"]
    result.update(
        max_calls=max_calls,
        cpu_ms_per_call_second=means,
        ratio_to_twilio={c: round(v / base, 3) if base else None for c, v in means.items()},
        rss_growth_mib=memory,
        memory_calls=args.memory_calls,
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
