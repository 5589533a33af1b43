"""One bad caller harms nobody else: good calls' timing beside each attack, on /api/chat and on
every phone carrier.

    .venv/bin/python bench/abuse.py --engine echo [--seconds 8] [--model DIR] [--suite chat,phone]

Starts `personaplex-voice serve` in a subprocess. A good caller streams `--seconds` of speech in
real time (Ogg-Opus, as Moshi clients do), alone and then beside each attack, which starts 1.5 s
into the call and runs from a separate process (so the attackers' own CPU never delays the good
client's event loop):

* `bomb`: 10 connections, each one 256 KiB message of Ogg pages of 255 two-byte Opus packets of
  120 ms (~10,000 s of audio, 1 GB decoded, per message);
* `reject_flood`: 5 connections of 41 such messages whose packets libopus rejects;
* `long_prompt_joins`: 8 callers joining with distinct ~4,000-character personas (stored with
  POST /api/prompts), each streaming 1 s and leaving;
* `abrupt_disconnects`: 100 connections dropped without a close, 10 at a time, at varied stages.

Per row: the good call's p99 and max gap between agent audio messages (ms), its echo similarity
(log-spectrogram correlation, 1.0 = perfect), the attack's server CPU (ms: the server process's
CPU during the row minus the alone row's rate), and the server's RSS change over the row (MB).

`phone` (tests/support_hostile.py's cases, issue 34): `serve --engine echo` with every carrier
(and Asterisk's AudioSocket listener), the carriers' REST APIs faked locally, admission control
off (PERSONAPLEX_SATURATION=0: the good calls are measured, not refused). Eight good calls, one
per line (Twilio, Telnyx, Plivo, Vonage, Exotel, jambonz, Genesys, Asterisk's chan_websocket),
each saying `--seconds` of speech-like noise in real time in its carrier's format; alone, then
while a separate process sends hostile input as fast as the server answers it, every carrier in
turn: streams presenting a made-up ticket whose first messages are nested past the depth limit,
hold numbers of 401 digits, NaN or 1e999 or a rate of `²`; dropped sockets and frames cut short;
webhook bodies nested, numeric or not UTF-8, declared or sent too large; signature headers whose
times are no numbers; chan_websocket sizes of 1e999, AudioSocket frames without a UUID or of half
a sample; Genesys sessions with spoiled structured fields. Per row: the good calls' echo
similarity at their line rate (the tests' measure: ≥ 0.8 is an echo), the p99 and max gap
between the agent's audio messages reaching each simulated carrier (after its first second), and
for the attack row the hostile cases per second, how many got the expected refusal (a 4xx or the
protocol's close code) and the server's log lines at ERROR (goal: none).

Last line: one JSON object with the rows and each attack row's p99 and max gap over the alone
row's (goal: within 1.5x).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import itertools
import json
import multiprocessing
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from support_abuse import (  # noqa: E402
    abrupt_disconnect,
    attack,
    bomb_message,
    frame_gaps,
    process_rss_bytes,
    reject_flood_messages,
)
from support_server import chat, echo_similarity, running_server  # noqa: E402

from personaplex_voice.cluster.procs import cpu_seconds as process_cpu_s  # noqa: E402

SR = 24000
ATTACK_AFTER_S = 1.5
WORDS = [
    "caller",
    "account",
    "invoice",
    "refund",
    "delivery",
    "schedule",
    "warranty",
    "address",
    "payment",
    "order",
]


def speech(seconds: float) -> np.ndarray:
    golden = ROOT.parent / "shared" / "golden" / "user.wav"
    import soundfile as sf

    audio = sf.read(golden, dtype="float32")[0]
    audio = np.concatenate([audio, audio[::-1]])
    return np.tile(audio, int(np.ceil(seconds * SR / len(audio))))[: int(seconds * SR)]


# -- attacks (run in a child process) ---------------------------------------------------------


def run_attack(name: str, ws_url: str, http_url: str) -> dict:
    return asyncio.run(_attack(name, ws_url, http_url))


async def _attack(name: str, ws_url: str, http_url: str) -> dict:
    chat_url = ws_url + "/api/chat?text_prompt=attack"
    if name == "bomb":
        bomb = bomb_message()
        results = [await attack(chat_url, [bomb]) for _ in range(10)]
        return {"refused": sum(r.refused for r in results), "connections": len(results)}
    if name == "reject_flood":
        flood = reject_flood_messages(41)
        results = [await attack(chat_url, flood) for _ in range(5)]
        return {"refused": sum(r.refused for r in results), "connections": len(results)}
    if name == "long_prompt_joins":
        return {"joined": sum(await asyncio.gather(*(_join(ws_url, http_url, i) for i in range(8))))}
    if name == "abrupt_disconnects":
        gate = asyncio.Semaphore(10)

        async def one(i: int) -> None:
            async with gate:
                await asyncio.sleep(random.random() * 0.05)
                await abrupt_disconnect(f"{ws_url}/api/chat?text_prompt=leaver{i}")

        await asyncio.gather(*(one(i) for i in range(100)), return_exceptions=True)
        return {"connections": 100}
    raise ValueError(name)


async def _join(ws_url: str, http_url: str, i: int) -> int:
    import httpx

    rng = random.Random(i)
    persona = " ".join(rng.choice(WORDS) for _ in range(700))[:4000]
    async with httpx.AsyncClient() as client:
        stored = await client.post(http_url + "/api/prompts", json={"text_prompt": persona})
    prompt_id = stored.json()["prompt_id"]
    result = await chat(f"{ws_url}/api/chat?prompt_id={prompt_id}", np.zeros(SR, np.float32), tail_s=0.2)
    return int(result.handshake and not result.errors)


# -- rows --------------------------------------------------------------------------------------


async def row(server, audio: np.ndarray, pool, name: str | None) -> dict:
    url = server.ws_url + "/api/chat?text_prompt=You+enjoy+having+a+good+conversation."
    pid = server.process.pid
    cpu0, rss0, t0 = process_cpu_s(pid), process_rss_bytes(pid), time.monotonic()
    good = asyncio.create_task(chat(url, audio))
    outcome: dict = {}
    if name is not None:
        await asyncio.sleep(ATTACK_AFTER_S)
        loop = asyncio.get_running_loop()
        outcome = await loop.run_in_executor(pool, run_attack, name, server.ws_url, server.url)
    result = await good
    elapsed = time.monotonic() - t0
    gaps = np.array(frame_gaps(result.arrivals, until=result.sent_done_at)) * 1000
    return {
        "p99_gap_ms": round(float(np.percentile(gaps, 99)), 1) if len(gaps) else None,
        "max_gap_ms": round(float(gaps.max()), 1) if len(gaps) else None,
        "echo_similarity": round(echo_similarity(audio, result.pcm), 3),
        "good_errors": result.errors,
        "server_cpu_s": process_cpu_s(pid) - cpu0,
        "seconds": elapsed,
        "rss_delta_mb": round((process_rss_bytes(pid) - rss0) / 2**20, 1),
        **outcome,
    }


def chat_suite(args: argparse.Namespace) -> dict:
    audio = speech(args.seconds)
    attacks = ("bomb", "reject_flood", "long_prompt_joins", "abrupt_disconnects")
    context = multiprocessing.get_context("fork")
    with (
        running_server("--max-sessions", "12", engine=args.engine, model=args.model, timeout=300) as server,
        concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool,
    ):
        pool.submit(time.sleep, 0).result()  # the child exists before any row is timed

        async def rows() -> dict:
            out = {"alone": await row(server, audio, pool, None)}
            for name in attacks:
                out[name] = await row(server, audio, pool, name)
                print(name, json.dumps(out[name]), file=sys.stderr)
            return out

        results = asyncio.run(rows())
    alone = results["alone"]
    rate = alone["server_cpu_s"] / alone["seconds"]
    for name, values in results.items():
        cpu, seconds = values.pop("server_cpu_s"), values.pop("seconds")
        if name != "alone":
            values["attacker_cpu_ms"] = round(max(0.0, cpu - rate * seconds) * 1000, 1)
    ratios = {
        name: {
            "p99_gap": round(results[name]["p99_gap_ms"] / alone["p99_gap_ms"], 2),
            "max_gap": round(results[name]["max_gap_ms"] / alone["max_gap_ms"], 2),
        }
        for name in attacks
    }
    return {"rows": results, "ratios": ratios}


# -- every phone carrier ------------------------------------------------------------------------------

GOOD_LINES = ("twilio", "telnyx", "plivo", "vonage", "exotel", "jambonz", "genesys", "asterisk")
PHONE_PERSONAS = "default: desk\npersonas:\n  desk: {text_prompt: 'You answer for Acme.'}\n"
STEADY_AFTER_S = 1.0  # a call's first second is its start (prefill, priming): its gaps are not counted


@dataclass
class Endpoint:
    """Where the server listens (what support_hostile's raw clients need of it)."""

    url: str
    port: int
    audiosocket: tuple[str, int]


def run_phone_attack(server: Endpoint, seconds: float) -> dict:
    return asyncio.run(_phone_attack(server, seconds))


async def _phone_attack(server: Endpoint, seconds: float) -> dict:
    """Hostile input from every carrier in turn, as fast as the server answers, for `seconds`."""
    from personaplex_phone.simulator import PhoneSimulator
    from support_hostile import WS_CARRIERS, asterisk_round, carrier_round, genesys_round, webhook_round
    from support_phone import PUBLIC_URL, carrier_side

    sims = {
        c: PhoneSimulator(carrier_side(c), server.url, public_url=PUBLIC_URL)
        for c in (*WS_CARRIERS, "asterisk", "genesys")
    }
    templates = {}
    for carrier in WS_CARRIERS:  # a real answer's stream URL per carrier; that call then ends
        offer = await sims[carrier].answer()
        templates[carrier] = offer
        await sims[carrier].status(offer.call_id, "completed")
    cases = expected = 0
    unexpected: dict[str, int] = {}
    started = time.monotonic()
    deadline = started + seconds
    turn = 0
    while time.monotonic() < deadline:
        carrier = (*WS_CARRIERS, "asterisk", "genesys")[turn % (len(WS_CARRIERS) + 2)]
        turn += 1
        sim = sims[carrier]
        try:
            if carrier == "asterisk":
                outcomes = await webhook_round(server, carrier, sim, slow=False)
                outcomes += await asterisk_round(server, sim, server.audiosocket)
            elif carrier == "genesys":
                outcomes = await genesys_round(server, sim)
            else:
                outcomes = await carrier_round(server, carrier, sim, templates[carrier])
                outcomes += await webhook_round(server, carrier, sim, slow=False)
        except Exception as exc:  # a case the server did not answer at all (a hang): counted
            key = f"{carrier}: {type(exc).__name__}: {exc}"[:200]
            unexpected[key] = unexpected.get(key, 0) + 1
            continue
        cases += len(outcomes) + (2 if carrier in WS_CARRIERS else 0)  # + a dropped socket, a cut frame
        expected += sum(o.ok for o in outcomes) + (2 if carrier in WS_CARRIERS else 0)
        for outcome in outcomes:
            if not outcome.ok:
                unexpected[str(outcome)] = unexpected.get(str(outcome), 0) + 1
    elapsed = time.monotonic() - started
    return {
        "hostile_cases": cases,
        "refused_as_expected": expected,
        "hostile_cases_per_s": round(cases / elapsed, 1),
        "unexpected": unexpected,
        "attack_s": round(elapsed, 2),
    }


async def good_call(sim, seconds: float) -> dict:
    """One good call of the simulated carrier: speech-like noise for `seconds`, in real time.
    Returns what it said and heard (measured once every call is over: the measure's own CPU
    must not stall the other calls' clients)."""
    from support_phone import speechlike

    offer = await sim.answer()
    rate = offer.inbound.rate
    said = speechlike(seconds, rate, seed=len(sim.side.name))
    async with sim.stream(offer) as call:
        primed = await call.answered()
        await call.play(said)
        await call.play(np.zeros(rate // 2, np.float32))
    t0 = call.played[0].arrival if call.played else 0.0
    arrivals = [p.arrival for p in call.played if p.arrival - t0 > STEADY_AFTER_S]
    return {"said": said, "heard": call.heard(), "primed": primed, "offer": offer, "arrivals": arrivals}


def measured(call: dict) -> dict:
    from support_phone import line_echo_similarity

    from personaplex_voice.audio.resample import resample

    offer, heard = call["offer"], call["heard"]
    rate = offer.inbound.rate
    if offer.outbound.rate != rate:
        heard = resample(heard, offer.outbound.rate, rate)
    return {
        "echo": round(line_echo_similarity(call["said"], heard[call["primed"] :], rate), 3),
        "gaps_ms": [1000 * (b - a) for a, b in itertools.pairwise(call["arrivals"])],
    }


async def phone_row(server: Endpoint, pid: int, seconds: float, pool, attack: bool, log) -> dict:
    from personaplex_phone.simulator import PhoneSimulator
    from support_phone import PUBLIC_URL, carrier_side

    mark = len(log())
    cpu0, t0 = process_cpu_s(pid), time.monotonic()
    sims = [PhoneSimulator(carrier_side(c), server.url, public_url=PUBLIC_URL) for c in GOOD_LINES]
    calls = asyncio.gather(*(good_call(sim, seconds) for sim in sims))
    outcome: dict = {}
    if attack:
        await asyncio.sleep(ATTACK_AFTER_S)
        loop = asyncio.get_running_loop()
        outcome = await loop.run_in_executor(pool, run_phone_attack, server, seconds - ATTACK_AFTER_S)
    results = [measured(call) for call in await calls]
    gaps = np.array([g for r in results for g in r["gaps_ms"]])
    errors = [line for line in log()[mark:].splitlines() if " ERROR " in line or "Traceback" in line]
    return {
        "echo_min": min(r["echo"] for r in results),
        "echo": {c: r["echo"] for c, r in zip(GOOD_LINES, results, strict=True)},
        "p99_gap_ms": round(float(np.percentile(gaps, 99)), 1),
        "max_gap_ms": round(float(gaps.max()), 1),
        "p99_gap_ms_by_line": {
            c: round(float(np.percentile(r["gaps_ms"], 99)), 1)
            for c, r in zip(GOOD_LINES, results, strict=True)
        },
        "server_cpu_s": round(process_cpu_s(pid) - cpu0, 2),
        "seconds": round(time.monotonic() - t0, 2),
        "server_error_lines": len(errors),
        **outcome,
    }


def phone_suite(args: argparse.Namespace) -> dict:
    from support_phone import FakeCarrierApis, carrier_env
    from support_server import free_port

    listen = ("127.0.0.1", free_port())
    apis = FakeCarrierApis().start()
    carriers = "twilio,telnyx,plivo,vonage,exotel,asterisk,jambonz,genesys"
    serve = ("--carriers", carriers, "--audiosocket", f"{listen[0]}:{listen[1]}", "--max-sessions", "16")
    context = multiprocessing.get_context("fork")
    try:
        with tempfile.TemporaryDirectory(prefix="abuse-") as tmp:
            personas = Path(tmp) / "personas.yaml"
            personas.write_text(PHONE_PERSONAS)
            env = {
                **carrier_env(apis.url, str(personas)),
                "PERSONAPLEX_SATURATION": "0",
                "PERSONAPLEX_HTTP_REQUEST_TIMEOUT_S": "2",
            }
            with (
                running_server(*serve, engine=args.engine, model=args.model, env=env, timeout=300) as server,
                concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool,
            ):
                pool.submit(time.sleep, 0).result()
                where = Endpoint(server.url, server.port, listen)
                pid = server.process.pid

                async def rows() -> dict:
                    out = {"alone": await phone_row(where, pid, args.seconds, pool, False, server.log)}
                    print("phone alone", json.dumps(out["alone"]), file=sys.stderr)
                    out["hostile"] = await phone_row(where, pid, args.seconds, pool, True, server.log)
                    print("phone hostile", json.dumps(out["hostile"]), file=sys.stderr)
                    return out

                results = asyncio.run(rows())
    finally:
        apis.stop()
    alone, hostile = results["alone"], results["hostile"]
    ratios = {
        "p99_gap": round(hostile["p99_gap_ms"] / alone["p99_gap_ms"], 2),
        "max_gap": round(hostile["max_gap_ms"] / alone["max_gap_ms"], 2),
    }
    return {"good_calls": len(GOOD_LINES), "rows": results, "ratios": ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", default="echo", choices=("echo", "model"))
    parser.add_argument("--model", default=None, help="with --engine model: demo, a repo id or a model dir")
    parser.add_argument("--seconds", type=float, default=8.0, help="length of the good call")
    parser.add_argument(
        "--suite", default="chat,phone", help="chat (/api/chat attacks), phone (every carrier)"
    )
    args = parser.parse_args()
    suites = [s.strip() for s in args.suite.split(",") if s.strip()]
    out: dict = {"engine": args.engine, "good_call_s": args.seconds}
    if "chat" in suites:
        out["chat"] = chat_suite(args)
    if "phone" in suites:
        out["phone"] = phone_suite(args)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
