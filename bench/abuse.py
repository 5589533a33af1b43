"""One bad caller harms nobody else: a good call's timing beside each attack on /api/chat.

    .venv/bin/python bench/abuse.py --engine echo [--seconds 8] [--model DIR]

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
Last line: one JSON object with the rows and each attack row's p99 and max gap over the alone
row's (goal: within 1.5x).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import multiprocessing
import random
import sys
import time
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", default="echo", choices=("echo", "model"))
    parser.add_argument("--model", default=None, help="with --engine model: demo, a repo id or a model dir")
    parser.add_argument("--seconds", type=float, default=8.0, help="length of the good call")
    args = parser.parse_args()
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
    print(json.dumps({"engine": args.engine, "good_call_s": args.seconds, "rows": results, "ratios": ratios}))


if __name__ == "__main__":
    main()
