"""Load on /api/chat: how many real-time callers one server process keeps up with.

    .venv/bin/python bench/server_load.py --engine echo [--max-clients 64] [--seconds 4]

Starts `personaplex-voice serve` in a subprocess, then runs rounds of N concurrent clients
(1, 2, 4, ... doubling, then one bisection step) that each stream `--seconds` of speech in real
time as Ogg-Opus (sphn, like Moshi clients) and decode what comes back. A round is *real time*
when the server reports no dropped output frames, no clock overruns and at most one late input
frame per caller during it (a caller whose frames arrive right at the 80 ms tick may slip once,
then has a one-frame cushion), and every client got its whole call back.

Per frame, the delay is the time from sending an 80 ms frame to receiving the last sample of its
echo (found by aligning the echo on the input). It includes the loopback engine's one-frame
delay (80 ms) and the wait for the next tick (up to 80 ms).

Last line: one JSON object, {"max_sessions_realtime", "p99_frame_delay_ms", ...} with the p99 at
the largest real-time round and its ratio to the 1-client baseline of the same run, and the
server's CPU time per second of call (event loop + inference thread, from /proc): on a shared
machine the real-time limit moves with the neighbours' load, the CPU cost per caller does not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from support_server import running_server  # noqa: E402

from personaplex_voice.cluster.procs import cpu_seconds as process_cpu_s  # noqa: E402

SR = 24000
FRAME = 1920
COUNTERS = ("late_frames_total", "dropped_output_frames_total", "tick_overruns_total")


def speech(seconds: float) -> np.ndarray:
    golden = ROOT.parent / "shared" / "golden" / "user.wav"
    if golden.exists():
        import soundfile as sf

        audio = sf.read(golden, dtype="float32")[0]
    else:  # noise bursts: enough structure to align on
        rng = np.random.default_rng(0)
        audio = (rng.standard_normal(SR * 6) * np.repeat(rng.random(75) > 0.3, SR * 6 // 75)).astype(
            np.float32
        )
        audio *= 0.1
    reps = int(np.ceil(seconds * SR / len(audio)))
    return np.tile(audio, reps)[: int(seconds * SR)]


def scrape(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    values = {}
    for name in COUNTERS:
        match = re.search(rf"^personaplex_{name} (\S+)$", text, re.M)
        values[name] = float(match.group(1)) if match else 0.0
    return values


async def one_client(ws_url: str, audio: np.ndarray, offset: int) -> dict:
    import sphn
    from websockets.asyncio.client import connect

    from personaplex_voice.audio.opus import OggOpusReader

    audio = np.roll(audio, offset)  # each client says something different
    reader, writer = sphn.OpusStreamReader(SR), sphn.OpusStreamWriter(SR)
    # What the server can decode from the bytes sent so far: sphn's writer holds audio back, so
    # a frame "arrives" with the message that completes it, not with the call that wrote it.
    mirror = OggOpusReader(SR)
    decodable = 0
    sent: list[tuple[float, int]] = []  # (send time, samples decodable from everything sent)
    arrivals: list[tuple[float, int]] = []
    received: list[np.ndarray] = []
    handshake = asyncio.Event()

    async def receive(ws) -> None:
        total = 0
        async for message in ws:
            if message[:1] == b"\x00":
                handshake.set()
            elif message[:1] == b"\x01":
                pcm = reader.append_bytes(message[1:])
                if pcm is not None and len(pcm):
                    received.append(np.asarray(pcm, np.float32))
                    total += len(pcm)
                    arrivals.append((time.monotonic(), total))

    async with connect(ws_url, compression=None, proxy=None, max_size=None, open_timeout=60) as ws:
        task = asyncio.create_task(receive(ws))
        await asyncio.wait_for(handshake.wait(), 60)
        start = time.monotonic()
        frames = len(audio) // FRAME
        tail = int(1.0 * SR / FRAME)  # keep talking (silence) while the last echoes come back
        for k in range(frames + tail):
            chunk = audio[k * FRAME : (k + 1) * FRAME] if k < frames else np.zeros(FRAME, np.float32)
            data = writer.append_pcm(chunk)
            await ws.send(b"\x01" + data)
            decodable += sum(len(p) for p in mirror.feed(data))
            sent.append((time.monotonic(), decodable))
            await asyncio.sleep(max(0.0, start + (k + 1) * FRAME / SR - time.monotonic()))
        await ws.close()
        await task
    sent_times = np.array([t for t, _ in sent])
    sent_totals = np.array([n for _, n in sent])
    # Arrival of frame k at the server: the first message after which its last sample decodes.
    sent_at = [float(sent_times[np.searchsorted(sent_totals, (k + 1) * FRAME)]) for k in range(frames)]
    return {"audio": audio, "sent_at": sent_at, "arrivals": arrivals, "received": received}


def frame_delays(client: dict) -> tuple[list[float], bool]:
    from scipy.signal import correlate

    sent = client["audio"]
    got = np.concatenate(client["received"]) if client["received"] else np.zeros(0, np.float32)
    if len(got) < len(sent):
        return [], False
    lag = int(np.argmax(correlate(got, sent, mode="full", method="fft"))) - (len(sent) - 1)
    times = np.array([t for t, _ in client["arrivals"]])
    totals = np.array([n for _, n in client["arrivals"]])
    delays = []
    for k, sent_time in enumerate(client["sent_at"]):
        needed = (k + 1) * FRAME + lag
        i = int(np.searchsorted(totals, needed))
        if i >= len(totals):
            return delays, False  # this frame's echo never came
        delays.append(times[i] - sent_time)
    return delays, True


async def run_round(server, audio: np.ndarray, clients: int) -> list[dict]:
    offsets = [i * 7 * FRAME for i in range(clients)]
    url = server.ws_url + "/api/chat?text_prompt=bench"
    return await asyncio.gather(*(one_client(url, audio, o) for o in offsets))


def measure(server, audio: np.ndarray, clients: int) -> dict:
    before = scrape(server.url)
    cpu_before = process_cpu_s(server.process.pid)
    results = asyncio.run(run_round(server, audio, clients))
    cpu_s = process_cpu_s(server.process.pid) - cpu_before
    after = scrape(server.url)
    counters = {name: after[name] - before[name] for name in COUNTERS}
    delays, complete = [], True
    for client in results:
        d, ok = frame_delays(client)
        delays += d
        complete &= ok
    # A caller whose frames arrive just at the 80 ms tick may slip once (one frame of silence,
    # after which it has a one-frame cushion): one late frame per caller is tolerated; more means
    # the server is not keeping up.
    realtime = (
        complete
        and counters["late_frames_total"] <= clients
        and not counters["dropped_output_frames_total"]
        and not counters["tick_overruns_total"]
    )
    p99 = float(np.percentile(delays, 99) * 1000) if delays else float("nan")
    p50 = float(np.percentile(delays, 50) * 1000) if delays else float("nan")
    row = {
        "clients": clients,
        "realtime": realtime,
        "p50_ms": round(p50, 1),
        "p99_ms": round(p99, 1),
        # Server CPU (event loop + inference thread) per second of one caller's call.
        "server_cpu_ms_per_call_s": round(1000 * cpu_s / (clients * len(audio) / SR), 1),
        **counters,
    }
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engine", default="echo", choices=["echo", "model"])
    parser.add_argument("--model", default=None, help="with --engine model: demo, a model dir or a repo")
    parser.add_argument("--max-clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=4.0)
    args = parser.parse_args()

    audio = speech(args.seconds)
    with running_server(
        "--max-sessions",
        str(args.max_clients),
        "--log-level",
        "warning",
        engine=args.engine,
        model=args.model,
    ) as server:
        rows = {1: measure(server, audio, 1)}
        good, bad = (1, None) if rows[1]["realtime"] else (0, 1)
        n = 2
        while bad is None and n <= args.max_clients:  # doubling: at most log2(max) rounds
            rows[n] = measure(server, audio, n)
            if rows[n]["realtime"]:
                good, n = n, n * 2
            else:
                bad = n
        if bad is not None and good and bad - good > 1:  # one bisection step
            mid = (good + bad) // 2
            rows[mid] = measure(server, audio, mid)
            if rows[mid]["realtime"]:
                good = mid

    baseline = rows[1]["p99_ms"]
    at_max = rows[good]["p99_ms"] if good else float("nan")
    print(
        json.dumps(
            {
                "max_sessions_realtime": good,
                "p99_frame_delay_ms": at_max,
                "p99_frame_delay_ms_1_client": baseline,
                "p99_ratio_vs_1_client": round(at_max / baseline, 2) if good and baseline else None,
                "server_cpu_ms_per_call_s": rows[good]["server_cpu_ms_per_call_s"] if good else None,
                "engine": args.engine,
                "seconds_per_client": args.seconds,
                "capped_at": args.max_clients if bad is None else None,
            }
        )
    )


if __name__ == "__main__":
    main()
