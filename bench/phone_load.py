"""Phone lines benchmark: echo calls carried in real time by one server process, and the server's
CPU per call-second, for every carrier (the cloud carriers, Asterisk's two media legs, jambonz,
Genesys Cloud) in one run, with each carrier's ratio to Twilio's (printed, never asserted).

    .venv/bin/python bench/phone_load.py [--carrier twilio,jambonz,asterisk-audiosocket,…]
        [--levels 10,20,40,60,80] [--seconds 5] [--cpu-calls 20] [--rounds 2] [--processes 2]
        [--memory-calls 100] [--warmup-calls 5]

`--carrier` (default: all) takes twilio, telnyx, plivo, vonage, exotel, asterisk-websocket
(chan_websocket), asterisk-audiosocket, jambonz, genesys; Twilio, the baseline, is always
measured too. One server runs `personaplex-voice serve --engine echo --carriers … [--audiosocket
127.0.0.1:PORT]` in its own process, every carrier's REST API faked locally and its secrets
shared with the simulators (tests/support_phone.py). Simulated carriers, in `--processes` worker
processes on uvloop, each call a task sending precomputed real-time audio in its carrier's format
(personaplex_phone.simulator with the carrier's `sim.py` side; AudioSocket's plain TCP leg with
personaplex_asterisk.simulate), then:

0. Warm-up: `--warmup-calls` calls of every carrier first, not counted (a fresh server's first
   calls pay for imports, filter designs and the allocator's growth).
1. Capacity, per carrier: levels of concurrent calls of `--seconds`; a level passes when the
   server counted no late frame (no engine frame without its caller audio in time, no message
   reaching the carrier after its buffer of ours ran dry) and no call closed early or failed.
   Printed: the largest passing level ("calls carried in real time per process": the server is
   one process), with each level's end reasons and the simulators' own late messages (on a small
   machine a late frame at the higher levels may be the simulators').
2. CPU, per carrier: `--cpu-calls` calls of `--seconds`, the carriers in turn for `--rounds`
   rounds (the shared machine's drift hits all alike): the server's CPU time per call-second, and
   its ratio to Twilio's.
3. Memory (`--memory-calls N`, 0 skips it): N short calls in a row per carrier; the server's
   resident memory before and after (records of ended calls stay on disk, only a bounded summary
   in memory).

Last line: {"max_calls": {carrier: …}, "cpu_ms_per_call_second": {…}, "ratio_to_twilio": {…},
"rss_growth_mib": {…}, …}
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
from typing import Any

import numpy as np
from sim_pool import cpu_seconds, deal, paced, rss_mib, run_workers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

AUDIOSOCKET = "asterisk-audiosocket"
# What the benchmark calls a carrier -> the server's carrier (Asterisk has two media legs).
CARRIERS = {
    "twilio": "twilio",
    "telnyx": "telnyx",
    "plivo": "plivo",
    "vonage": "vonage",
    "exotel": "exotel",
    "asterisk-websocket": "asterisk",
    AUDIOSOCKET: "asterisk",
    "jambonz": "jambonz",
    "genesys": "genesys",
}
AUDIOSOCKET_RATE = 16000  # `Dial(AudioSocket/…/c(slin16))`, Asterisk's wideband leg
LATE_AFTER_S = (
    1.0  # a call's first second is its start (prefill, priming): late messages there are not counted
)


def speech(rate: int, seconds: float = 2.0) -> np.ndarray:
    t = np.arange(round(seconds * rate)) / rate
    tone = 0.3 * np.sin(2 * np.pi * 440 * t) * (0.5 + 0.5 * np.sin(2 * np.pi * 3 * t))
    return tone.astype(np.float32)


def side_of(name: str) -> Any:
    """The carrier's simulated side, signing with the server's secrets."""
    from support_phone import carrier_side

    return carrier_side(CARRIERS[name])


# --- one worker process of simulated calls ---------------------------------------------------------


async def _stream_calls(
    name: str, base_url: str, public_url: str, starts: list[float], seconds: float
) -> list[dict]:
    """Calls over the carrier's WebSocket (the phone simulator), call i starting at starts[i]."""
    from personaplex_phone.audio_path import codec_for
    from personaplex_phone.simulator import PhoneSimulator

    sim = PhoneSimulator(side_of(name), base_url, public_url=public_url, timeout_s=60)
    offers = [await sim.answer() for _ in starts]
    fmt = offers[0].inbound
    size = fmt.rate * sim.side.chunk_ms // 1000 * fmt.bytes_per_sample
    audio = codec_for(fmt).encode(speech(fmt.rate))
    payloads = [audio[i : i + size] for i in range(0, len(audio) - size + 1, size)]
    period = sim.side.chunk_ms / 1000

    async def one(offer: Any, start_at: float) -> dict:
        await asyncio.sleep(max(0.0, start_at - time.time()))
        async with sim.stream(offer) as call:
            t0 = time.monotonic()
            async for n, _ in paced(t0, period, call.closed.is_set, round(seconds / period)):
                await call.send_payload(payloads[n % len(payloads)])
            closed_early = call.closed.is_set()  # the server ended it before the caller did
        late = sum(p.late for p in call.played if p.arrival - t0 > LATE_AFTER_S)
        return {"late": int(late), "messages": len(call.played), "closed_early": closed_early}

    async with asyncio.TaskGroup() as group:
        tasks = [group.create_task(one(o, at)) for o, at in zip(offers, starts, strict=True)]
    return [t.result() for t in tasks]


async def _audiosocket_calls(
    base_url: str, listener: tuple[str, int], starts: list[float], seconds: float
) -> list[dict]:
    """Calls over Asterisk's AudioSocket (TCP): the dialplan's request, then the leg."""
    from personaplex_asterisk.simulate import AsteriskSimulator
    from support_phone import API_TOKEN

    from personaplex_voice.audio.telephony import l16_encode

    audio = l16_encode(speech(AUDIOSOCKET_RATE), big_endian=False)
    size = AUDIOSOCKET_RATE // 50 * 2
    payloads = [audio[i : i + size] for i in range(0, len(audio) - size + 1, size)]
    sim = AsteriskSimulator(base_url, API_TOKEN, listener)

    async def one(call_uuid: str, start_at: float) -> dict:
        await asyncio.sleep(max(0.0, start_at - time.time()))
        async with sim.audiosocket_call(call_uuid, rate=AUDIOSOCKET_RATE) as call:
            t0 = time.monotonic()
            call.late_after = t0 + LATE_AFTER_S
            async for n, _ in paced(t0, 0.020, call.closed.is_set, round(seconds / 0.020)):
                await call.send_chunk(payloads[n % len(payloads)])
            closed_early = call.closed.is_set()
        return {"late": call.late, "messages": call.received_messages, "closed_early": closed_early}

    try:
        uuids = []
        for _ in starts:
            status, answer = await sim.ask()
            if status != 200:
                raise RuntimeError(f"POST /asterisk/calls answered {status}: {answer}")
            uuids.append(answer["uuid"])
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(one(u, at)) for u, at in zip(uuids, starts, strict=True)]
    finally:
        await sim.close()
    return [t.result() for t in tasks]


def worker(
    name: str,
    base_url: str,
    public_url: str,
    listener: tuple[str, int] | None,
    seconds: float,
    starts: list[float],
    out: mp.Queue,
) -> None:
    """One process of simulated calls of carrier `name`, call i starting at `starts[i]` (wall
    clock). Puts one row per call (late messages heard after the first second, messages, closed
    early) with `worker_cpu_s`, this process's CPU per call."""
    import gc

    gc.freeze()
    os.nice(5)  # the simulated carrier shares this machine with the server under test: the server first

    async def main() -> list[dict]:
        if name == AUDIOSOCKET:
            assert listener is not None
            return await _audiosocket_calls(base_url, listener, starts, seconds)
        return await _stream_calls(name, base_url, public_url, starts, seconds)

    try:
        cpu0 = time.process_time()
        try:
            import uvloop

            rows = uvloop.run(main())
        except ImportError:
            rows = asyncio.run(main())
        cpu = time.process_time() - cpu0
        for row in rows:
            row["worker_cpu_s"] = cpu / max(1, len(rows))
        out.put(rows)
    except Exception as exc:  # reported: the level then fails
        out.put([{"error": repr(exc)}])


# --- the server under test ------------------------------------------------------------------------


class Bench:
    """The running server and how to call it."""

    def __init__(self, base_url: str, public_url: str, listener: tuple[str, int] | None, processes: int):
        self.base_url = base_url
        self.public_url = public_url
        self.listener = listener
        self.processes = processes

    def run_calls(self, name: str, calls: int, seconds: float) -> dict:
        """`calls` concurrent calls of `seconds` each, over the worker processes."""
        start_at = time.time() + 2.0 + calls * 0.02  # every call answered before any speaks
        starts = [start_at + k * 0.01 for k in range(calls)]
        args = (name, self.base_url, self.public_url, self.listener, seconds)
        rows = run_workers(worker, deal(starts, self.processes), *args, timeout=seconds + calls + 120)
        sim_cpu = sum(r.get("worker_cpu_s", 0.0) for r in rows)
        return {
            "calls": calls,
            "simulator_late_messages": int(sum(r.get("late", 0) for r in rows)),
            "closed_early": int(sum(bool(r.get("closed_early")) for r in rows)),
            "simulator_cpu_ms_per_call_second": round(1000 * sim_cpu / (calls * seconds), 2),
            "errors": [r["error"] for r in rows if "error" in r][:3],
        }

    def listing(self) -> dict:
        import httpx
        from support_phone import API_TOKEN

        headers = {"Authorization": f"Bearer {API_TOKEN}"}
        return httpx.get(self.base_url + "/phone/calls", headers=headers, timeout=30).json()

    def records(self, name: str, calls: int) -> list[dict]:
        """The server's records of the carrier's last `calls` calls."""
        return [c for c in self.listing()["calls"] if c.get("carrier") == CARRIERS[name]][-calls:]

    def wait_idle(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.listing()
            if state["active_sessions"] == 0 and state["reserved"] == 0 and not state["live"]:
                return
            time.sleep(0.2)

    async def short_calls(self, name: str, count: int) -> None:
        """`count` short calls in a row: answered, a key, a little speech, hung up."""
        if name == AUDIOSOCKET:
            from personaplex_asterisk.simulate import AsteriskSimulator
            from support_phone import API_TOKEN

            sim = AsteriskSimulator(self.base_url, API_TOKEN, self.listener)
            try:
                for _ in range(count):
                    _, answer = await sim.ask()
                    async with sim.audiosocket_call(answer["uuid"], rate=AUDIOSOCKET_RATE) as call:
                        await call.answered()
                        await call.dtmf("5")
                        await call.play(speech(AUDIOSOCKET_RATE, 0.3))
            finally:
                await sim.close()
            return
        from personaplex_phone.simulator import PhoneSimulator

        phone = PhoneSimulator(side_of(name), self.base_url, public_url=self.public_url)
        for _ in range(count):
            offer = await phone.answer()
            async with phone.stream(offer) as stream:
                await stream.answered()
                await stream.dtmf("5")
                await stream.play(speech(offer.inbound.rate, 0.3))


def late_frames(records: list[dict]) -> int:
    """The server's own count of late frames: out (the carrier's buffer ran dry) and in (an engine
    frame without its caller audio)."""
    metrics = [r.get("metrics") or {} for r in records]
    return sum(m.get("late_frames", 0) + (m.get("session") or {}).get("late_frames", 0) for m in metrics)


def end_reasons(records: list[dict]) -> dict[str, int]:
    reasons: dict[str, int] = {}
    for record in records:
        reason = str(record.get("end_reason"))
        reasons[reason] = reasons.get(reason, 0) + 1
    return reasons


def emit(row: dict) -> None:
    print(json.dumps(row), flush=True)


def chosen(spec: str) -> list[str]:
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in CARRIERS]
    if unknown:
        raise SystemExit(f"unknown carrier {', '.join(unknown)} (known: {', '.join(CARRIERS)})")
    return ["twilio", *[n for n in dict.fromkeys(names) if n != "twilio"]]  # Twilio: the baseline


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
    from support_server import free_port, running_server

    names = chosen(args.carrier)
    levels = [int(x) for x in args.levels.split(",") if x.strip()]
    top = max([*levels, args.cpu_calls, args.warmup_calls, 1])
    servers = sorted(set(CARRIERS[n] for n in names), key=list(CARRIERS.values()).index)
    listener = ("127.0.0.1", free_port()) if AUDIOSOCKET in names else None
    serve = ["--carriers", ",".join(servers), "--max-sessions", str(top), "--log-level", "warning"]
    if listener is not None:
        serve += ["--audiosocket", f"{listener[0]}:{listener[1]}"]
    apis = FakeCarrierApis().start()
    result: dict = {"carriers": names, "seconds": args.seconds, "cpu_calls": args.cpu_calls}
    with tempfile.TemporaryDirectory(prefix="phone-load-") as tmp:
        personas = Path(tmp) / "personas.yaml"
        personas.write_text("default: desk\npersonas:\n  desk: {text_prompt: 'Hello.'}\n")
        # Every call of a level answered at once: raw capacity, admission control off.
        env = {
            **carrier_env(apis.url, str(personas)),
            "PERSONAPLEX_LOG_LEVEL": "warning",
            "PERSONAPLEX_SATURATION": "0",
        }
        with running_server(*serve, env=env, timeout=120) as server:
            pid = server.process.pid
            bench = Bench(server.url, PUBLIC_URL, listener, args.processes)
            for name in names if args.warmup_calls else ():
                bench.run_calls(name, args.warmup_calls, 2.0)
                bench.wait_idle()
            # 1. capacity
            max_calls: dict[str, int] = {}
            for name in names:
                best = 0
                for level in levels:
                    row = bench.run_calls(name, level, args.seconds)
                    bench.wait_idle()
                    records = bench.records(name, level)
                    row.update(server_late_frames=late_frames(records), end_reasons=end_reasons(records))
                    emit({"carrier": name, **row})
                    if row["errors"] or row["closed_early"] or row["server_late_frames"]:
                        break
                    best = level
                max_calls[name] = best
            # 2. CPU per call-second, the carriers in turn
            cost: dict[str, list[float]] = {n: [] for n in names}
            for _ in range(args.rounds):
                for name in names:
                    cpu0 = cpu_seconds(pid)
                    row = bench.run_calls(name, args.cpu_calls, args.seconds)
                    cost[name].append(1000 * (cpu_seconds(pid) - cpu0) / (args.cpu_calls * args.seconds))
                    bench.wait_idle()
                    emit({"carrier": name, "cpu_ms_per_call_second": round(cost[name][-1], 2), **row})
            # 3. memory
            memory: dict[str, float] = {}
            for name in names if args.memory_calls else ():
                before = rss_mib(pid)
                asyncio.run(bench.short_calls(name, args.memory_calls))
                bench.wait_idle()
                memory[name] = round(rss_mib(pid) - before, 2)
                emit({"carrier": name, "calls": args.memory_calls, "rss_growth_mib": memory[name]})
    apis.stop()
    means = {n: round(float(np.mean(v)), 2) for n, v in cost.items() if v}  # --rounds 0: none
    base = means.get("twilio")
    result.update(
        max_calls=max_calls,
        cpu_ms_per_call_second=means,
        ratio_to_twilio={n: round(v / base, 3) for n, v in means.items()} if base else None,
        rss_growth_mib=memory,
        memory_calls=args.memory_calls,
        cpu_count=os.cpu_count(),
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
