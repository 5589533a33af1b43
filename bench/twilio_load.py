"""Twilio bridge benchmark: concurrent phone calls on this machine, and the bridge's own delay.

    .venv/bin/python bench/twilio_load.py --engine echo [--levels 1,5,10,25,50,100,150,200] [--seconds 5]
        [--ramp-ms 10] [--all-levels]
    .venv/bin/python bench/twilio_load.py --ramp [--message-ms 20,40,80] [--ramp-rate 5] [--hold-s 10]
        [--cost-calls 50] [--cost-rounds 2]
    .venv/bin/python bench/twilio_load.py --burst 20,40,60,200 [--burst-gap-ms 20] [--burst-hold-s 8]
        [--burst-admission on,off]

1. Bridge delay: an impulse crosses the bridge's audio path in and out (μ-law 8 kHz -> 24 kHz
   in 20 ms messages, then 80 ms engine frames -> 8 kHz μ-law), with the engine frame itself
   taken out (an identity in between). The same signal goes through Pipecat's
   `TwilioFrameSerializer` (deserialize, then serialize), its soxr streaming resamplers.
2. Load: `personaplex-voice serve --engine echo --twilio` runs in its own process; simulated
   Twilio calls (tests/support_twilio.py, in worker processes on uvloop) ramp up level by level,
   one call starting every `--ramp-ms` (0: all at once), each streaming real-time audio for
   `--seconds`; `--all-levels` keeps going after a failed level (the maximum still counts only
   the levels below the first failure). A level passes when the server counted no late
   frame: no engine frame without its caller audio in time, no message reaching Twilio after its
   buffer of ours ran dry. Outbound jitter: p99 of |gap between consecutive media messages at the
   simulator - 20 ms|. Also printed: the simulators' own late-frame count, the server's CPU time
   per call-second, and the delay variation against a perfect 20 ms clock.

3. Records (`--records-calls N`, default 25; 0 skips it): the server's CPU per call-second at N
   calls of `--records-seconds` (10) with call records and stereo recordings on (`--records-dir`,
   a persona with `record: true`; the echo engine says a text piece every frame, so every frame
   also goes to the transcript) beside the same calls with them off, in alternating rounds
   (`--records-rounds`) so the shared machine's drift hits both alike. `--records-only` runs just this part.

4. Ramp (`--ramp`): for each outbound message size (`--message-ms`, Twilio's 20 ms and longer
   ones: `PERSONAPLEX_TWILIO_MESSAGE_MS`), a fresh server with its default saturation policy
   and slots for any load; calls are offered `--ramp-rate` a second (the signed voice webhook),
   each admitted one talking its own speech-like audio, until the first busy answer, then
   `--hold-s` more (offers go on: they are refused or admitted as the headroom says). Every
   admitted call is judged by the per-second rule (each second of its speech comes back with a
   normalized correlation >= 0.8, the echo delay grows by <= 200 ms). Printed per size: the
   calls admitted and refused, the clean capacity (all admitted calls, when every one was clean;
   else those running when the first bad second came), degraded calls, the server's CPU per
   call-second, what the server counted as dropped or inserted, /readyz at the end. Then the
   CPU per call-second of each size at `--cost-calls` calls, sizes in turn for `--cost-rounds`.
   Also per size: the playout underruns the callers heard (a message after their buffer of
   ours ran dry), and how many fell within a second of some call's offer.

5. Burst (`--burst`): for each level and admission mode, a fresh server (slots for any load,
   its saturation policy on or off: `PERSONAPLEX_SATURATION`); the level's calls offered
   `--burst-gap-ms` apart (each offer in its own task, from one shared HTTP client: the
   simulators must not be what is slow), each admitted call talking until `--burst-hold-s` after
   the last offer, then judged by the per-second rule. Printed per run: admitted, busy, degraded
   admitted calls, the underruns the callers heard (how many, how much silence, when: seconds
   after the first offer, and how many within a second of an offer), the server's own count of
   underrun silence and its slips by reason, the webhook answer times. Last line: the table,
   the clean capacity with admission off (the most calls admitted at a level where none
   degraded) and each admission-on level's admitted calls over it.

Last line: {"max_calls_no_late_frames": …, "p99_outbound_jitter_ms": …, "bridge_delay_ms": …,
"records_extra_cpu_ms_per_call_second": …, ...}; with --ramp: {"ramp": {size: {...}},
"cpu_ms_per_call_second_by_message_ms": {...}, ...}; with --burst: {"burst": {"on:40": {...}, ...},
"clean_capacity_admission_off": …, "admitted_over_clean_capacity": {...}}
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import bisect
import contextlib
import json
import multiprocessing as mp
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from sim_pool import cpu_seconds, deal, paced, run_workers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

AUTH_TOKEN = "bench-auth-token"
API_TOKEN = "bench-api-token"
RATE = 8000
SERVER_ENV = {
    "TWILIO_AUTH_TOKEN": AUTH_TOKEN,
    "TWILIO_ACCOUNT_SID": "",
    "PUBLIC_URL": "",
    "PERSONAPLEX_TWILIO_API_TOKEN": API_TOKEN,
    "PERSONAPLEX_LOG_LEVEL": "warning",
}
# The level, records and cost modes measure what the server carries with every call answered
# at once (a connection storm the saturation policy would cut short): admission control off.
# The ramp mode runs with it on, as served.
RAW_CAPACITY = {"PERSONAPLEX_SATURATION": "0"}
# Burst mode, on a machine shared with other work: the server's and the simulated callers'
# scheduling priority (nice). The defaults put the server first; `--server-nice -10
# --simulator-nice -5` puts both ahead of whatever else the machine runs (as if it were theirs).
SERVER_NICE = int(os.environ.get("BENCH_SERVER_NICE", "0"))
SIM_NICE = int(os.environ.get("BENCH_SIMULATOR_NICE", "5"))


# --- 1. bridge delay --------------------------------------------------------------------------


def impulse_8k(seconds: float = 1.0, at: int = 4000) -> np.ndarray:
    x = np.zeros(round(seconds * RATE), np.float32)
    x[at] = 0.5
    return x


def peak_position(y: np.ndarray) -> float:
    """Sub-sample position of the largest |y| (parabolic interpolation)."""
    k = int(np.argmax(np.abs(y)))
    if 0 < k < len(y) - 1:
        a, b, c = np.abs(y[k - 1 : k + 2]).astype(np.float64)
        denom = a - 2 * b + c
        if denom != 0:
            return k + 0.5 * (a - c) / denom
    return float(k)


def ours_in_out(x: np.ndarray) -> tuple[np.ndarray, float]:
    """Our audio path; returns (output at 8 kHz, samples held back at 8 kHz)."""
    from personaplex_phone.audio_path import CHUNK_BYTES, InboundAudio, OutboundAudio

    from personaplex_voice.audio.framing import FrameBuffer
    from personaplex_voice.audio.mulaw import ulaw_decode, ulaw_encode

    data = ulaw_encode(x)
    inbound, outbound, frames = InboundAudio(), OutboundAudio(), FrameBuffer(1920)
    out: list[bytes] = []
    made_24k = framed_24k = 0
    for i in range(0, len(data), CHUNK_BYTES):
        up = inbound.feed(data[i : i + CHUNK_BYTES])
        if up is None:
            continue
        made_24k += len(up)
        frames.push(up)
        while (frame := frames.pop()) is not None:  # the engine frame: an identity here
            framed_24k += len(frame)
            out += outbound.convert(frame)
    y = ulaw_decode(b"".join(out))
    # Samples waiting to complete an engine frame are the frame's delay, not the bridge's.
    held = (len(data) - inbound.waiting - made_24k / 3) + (framed_24k / 3 - len(y))
    return y, held


def pipecat_in_out(x: np.ndarray) -> tuple[np.ndarray, float]:
    """Pipecat's TwilioFrameSerializer: deserialize each 20 ms message, serialize 80 ms frames."""
    from pipecat.frames.frames import OutputAudioRawFrame
    from pipecat.serializers.twilio import TwilioFrameSerializer

    from personaplex_voice.audio.mulaw import ulaw_decode, ulaw_encode

    async def run() -> tuple[np.ndarray, float]:
        serializer = TwilioFrameSerializer(
            "MZbench", params=TwilioFrameSerializer.InputParams(auto_hang_up=False, sample_rate=24000)
        )
        serializer._sample_rate = 24000  # what setup() sets from the pipeline's input rate
        data = ulaw_encode(x)
        pcm = b""
        out: list[bytes] = []
        made_24k = framed_24k = 0
        for i in range(0, len(data), 160):
            message = {"event": "media", "media": {"payload": base64.b64encode(data[i : i + 160]).decode()}}
            frame = await serializer.deserialize(json.dumps(message))
            if frame is not None:
                pcm += frame.audio
                made_24k += len(frame.audio) // 2
            while len(pcm) >= 3840:  # one 80 ms engine frame of int16
                piece, pcm = pcm[:3840], pcm[3840:]
                framed_24k += 1920
                answer = await serializer.serialize(OutputAudioRawFrame(piece, 24000, 1))
                if answer:
                    out.append(base64.b64decode(json.loads(answer)["media"]["payload"]))
        y = ulaw_decode(b"".join(out))
        return y, (len(data) - made_24k / 3) + (framed_24k / 3 - len(y))

    return asyncio.run(run())


def bridge_delays() -> dict[str, float]:
    """Delay = where the impulse sits in the output stream + what each stage still holds back
    (a stream resampler that emits fewer samples than it was fed plays everything that much
    later). The engine's 80 ms framing is outside both: only whole frames cross."""
    x = impulse_8k()
    at = float(np.argmax(x))
    result = {}
    for name, path in (("bridge_delay_ms", ours_in_out), ("pipecat_serializer_delay_ms", pipecat_in_out)):
        y, held = path(x)
        result[name] = round(float(peak_position(y) - at + held) / RATE * 1000, 2)
    return result


# --- 2. load ------------------------------------------------------------------------------------


def worker(base_url: str, seconds: float, starts: list[float], results: mp.Queue) -> None:
    """One process of simulated calls, call i starting at `starts[i]` (wall clock). Each call is
    one task that sends its 20 ms messages on its own real-time grid (precomputed base64 payloads),
    on uvloop: the simulator shares the 2 cores with the server, so its cost caps the measurement.
    """
    from support_twilio import TwilioSimulator, tone

    from personaplex_voice.audio.mulaw import ulaw_encode

    cpu_during_calls = [0.0]
    import gc

    gc.freeze()  # as the server does: no full collections of import-time objects mid-call
    # The simulated Twilio shares this machine with the server under test: the server first.
    os.nice(5)

    async def main() -> list[dict]:
        sim = TwilioSimulator(base_url, AUTH_TOKEN)
        speech = ulaw_encode(np.concatenate([tone(440.0, 1.0, 0.3), np.zeros(RATE, np.float32)]))
        payloads = [base64.b64encode(speech[i : i + 160]).decode("ascii") for i in range(0, len(speech), 160)]
        answers = [await asyncio.to_thread(sim.answer) for _ in starts]
        await asyncio.sleep(max(0.0, min(starts) - time.time()))
        cpu0 = time.process_time()
        async with asyncio.TaskGroup() as group:
            tasks = [
                group.create_task(one_call(sim, a, payloads, at))
                for a, at in zip(answers, starts, strict=True)
            ]
        cpu_during_calls[0] = time.process_time() - cpu0  # the calls only, not imports/answers
        return [t.result() for t in tasks]

    async def one_call(sim, answer, payloads: list[str], start_at: float) -> dict:
        call_sid, url, params = answer
        await asyncio.sleep(max(0.0, start_at - time.time()))
        async with sim.media_stream(url, params, call_sid=call_sid) as call:
            t0 = time.monotonic()
            async for n, _ in paced(t0, 0.020, call.closed.is_set, round(seconds / 0.020)):
                await call.send_media(payloads[n % len(payloads)])
        arrivals = np.array([p.arrival for p in call.played])
        # Late frames mid-call only: the first second is the call's start (prefill, priming).
        late = sum(p.late for p in call.played if p.arrival - t0 > 1.0)
        offsets = arrivals - 0.020 * np.arange(len(arrivals)) if len(arrivals) else np.zeros(0)
        pdv = (offsets - offsets.min()) * 1000 if len(offsets) else offsets
        gaps = np.diff(arrivals) * 1000 if len(arrivals) > 1 else np.zeros(0)
        return {
            "late": int(late),
            "late_at_s": [round(p.arrival - t0, 2) for p in call.played if p.late][:5],
            "messages": len(arrivals),
            "pdv_ms": pdv.tolist(),
            "jitter_ms": np.abs(gaps - 20.0).tolist(),
            "closed_early": call.close_code is not None and call.close_code != 1000,
        }

    try:
        import uvloop

        rows = uvloop.run(main())
        for row in rows:
            row["worker_cpu_s"] = cpu_during_calls[0] / max(1, len(rows))
        results.put(rows)
    except Exception as exc:  # reported, not hidden: the level then fails
        results.put([{"error": repr(exc)}])


def run_level(base_url: str, calls: int, seconds: float, processes: int, ramp_s: float) -> dict:
    """`calls` calls, the k-th starting `k * ramp_s` after the first (dealt round-robin to the
    simulator processes), each streaming for `seconds`."""
    start_at = time.time() + 2.0 + calls * 0.01  # every call answered before any speaks
    starts = [start_at + k * ramp_s for k in range(calls)]
    rows = run_workers(
        worker, deal(starts, processes), base_url, seconds, timeout=seconds + calls * ramp_s + 120
    )
    errors = [r["error"] for r in rows if "error" in r]
    pdv = np.concatenate([np.asarray(r["pdv_ms"]) for r in rows if "pdv_ms" in r] or [np.zeros(1)])
    jitter = np.concatenate([np.asarray(r["jitter_ms"]) for r in rows if "jitter_ms" in r] or [np.zeros(1)])
    sim_cpu = sum(r.get("worker_cpu_s", 0.0) for r in rows)
    return {
        "calls": calls,
        "simulator_cpu_ms_per_call_second": round(1000 * sim_cpu / (calls * seconds), 2),
        "late_frames": int(sum(r.get("late", 0) for r in rows)),
        "calls_with_late_frames": int(sum(r.get("late", 0) > 0 for r in rows)),
        "closed_early": int(sum(r.get("closed_early", False) for r in rows)),
        "p99_outbound_jitter_ms": round(float(np.percentile(jitter, 99)), 2),
        "p99_outbound_delay_variation_ms": round(float(np.percentile(pdv, 99)), 2),
        "late_at_s": [r["late_at_s"] for r in rows if r.get("late")][:3],
        "errors": errors[:3],
    }


def server_side(base_url: str, calls: int) -> dict:
    """The bridge's own view of the last `calls` calls: its late frames and engine frame jitter."""
    import httpx

    state = httpx.get(base_url + "/twilio/calls", headers={"Authorization": f"Bearer {API_TOKEN}"}).json()
    metrics = [c["metrics"] for c in state["calls"][-calls:] if c.get("metrics")]
    sessions = [m.get("session") or {} for m in metrics]
    return {
        "bridge_late_frames": sum(m.get("late_frames", 0) for m in metrics),
        "engine_late_input_frames": sum(s.get("late_frames", 0) for s in sessions),
        "engine_frame_jitter_p99_ms": max((m.get("jitter_p99_ms", 0.0) for m in metrics), default=0.0),
    }


def wait_idle(base_url: str, timeout: float = 30.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = httpx.get(base_url + "/twilio/calls", headers={"Authorization": f"Bearer {API_TOKEN}"}).json()
        if state["active_sessions"] == 0 and state["reserved"] == 0:
            return
        time.sleep(0.2)


def records_cost(calls: int, seconds: float, processes: int, ramp_s: float, rounds: int) -> dict:
    """Server CPU per call-second with call records + recordings on, beside off (one run)."""
    from support_server import running_server

    cost: dict[str, list[float]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory(prefix="twilio-records-") as tmp:
        personas = Path(tmp) / "personas.yaml"
        personas.write_text("default: desk\npersonas:\n  desk: {text_prompt: 'Hello.', record: true}\n")
        for _ in range(rounds):
            for mode in ("off", "on"):
                env = {**SERVER_ENV, **RAW_CAPACITY, "PERSONAPLEX_TWILIO_PERSONAS_FILE": str(personas)}
                extra = ["--records-dir", str(Path(tmp) / "records")] if mode == "on" else []
                with running_server(
                    "--twilio", "--max-sessions", str(calls), "--log-level", "warning", *extra, env=env
                ) as server:
                    cpu0 = cpu_seconds(server.process.pid)
                    row = run_level(server.url, calls, seconds, processes, ramp_s)
                    cpu = cpu_seconds(server.process.pid) - cpu0
                    wait_idle(server.url)
                if row["errors"] or row["closed_early"]:
                    raise RuntimeError(f"records {mode}: {row}")
                cost[mode].append(1000 * cpu / (calls * seconds))
        recorded = sorted((Path(tmp) / "records").glob("CA*/recording.wav"))
        wav_bytes = sum(p.stat().st_size for p in recorded)
    off, on = float(np.mean(cost["off"])), float(np.mean(cost["on"]))
    return {
        "records_calls": calls,
        "records_seconds_per_call": seconds,
        "records_rounds": rounds,
        "records_off_cpu_ms_per_call_second": round(off, 2),
        "records_on_cpu_ms_per_call_second": round(on, 2),
        "records_extra_cpu_ms_per_call_second": round(on - off, 2),
        "records_each_round_off_on": [
            [round(a, 2), round(b, 2)] for a, b in zip(cost["off"], cost["on"], strict=True)
        ],
        "recordings_written": len(recorded),
        "recording_kib_per_call_second": round(wav_bytes / 1024 / max(1, len(recorded)) / seconds, 1),
    }


# --- 4. ramp: calls added until refusals start -------------------------------------------------

SPEECH_S = 10.0  # each caller's own speech, repeated (longer than the 2 s the echo is searched in)


def speech_payloads(seed: int) -> list[str]:
    """A caller's own speech (`SPEECH_S`, repeated), as base64 20 ms μ-law payloads."""
    from support_twilio import speechlike

    from personaplex_voice.audio.mulaw import ulaw_encode

    data = ulaw_encode(speechlike(SPEECH_S, seed))
    return [base64.b64encode(data[i : i + 160]).decode("ascii") for i in range(0, len(data), 160)]


async def talk_and_judge(
    sim, call_sid: str, twiml: str, payloads: list[str], offered_at: float, end_at: Callable[[], float]
) -> dict:
    """An admitted call: the stream our answer named, the caller's speech on a real-time grid
    until `end_at()` (wall clock), then the per-second rule over what came back and every
    moment the caller's playback ran dry (wall clock, and the silence heard, ms)."""
    from support_twilio import echo_quality, parse_stream_twiml

    from personaplex_voice.audio.mulaw import ulaw_decode

    url, params = parse_stream_twiml(twiml)
    async with sim.media_stream(url, params, call_sid=call_sid) as call:
        call.keep_sent = True
        t0, started = time.monotonic(), time.time()
        sent = late_sends = 0

        def over() -> bool:
            return time.time() >= end_at() or call.closed.is_set()

        async for n, late_s in paced(t0, 0.020, over):
            if late_s > 0.030:  # this simulator itself is late: no server's doing
                late_sends += 1
            await call.send_media(payloads[n % len(payloads)])
            sent += 1
    quality = echo_quality(ulaw_decode(bytes(call.sent)), call.played_audio())
    bad = [
        k
        for k, (r, d) in enumerate(zip(quality.correlations, quality.delays_s, strict=True))
        if r < 0.8 or d - quality.delays_s[0] > 0.2
    ]
    wall = started - t0  # monotonic -> wall clock
    return {
        "admitted": True,
        "call_sid": call_sid,
        "offered_at": offered_at,
        "started_at": started,
        "seconds": sent * 0.020,
        "judged_seconds": len(quality.correlations),
        "clean": quality.clean(),
        "min_correlation": round(min(quality.correlations, default=0.0), 3),
        "delay_growth_ms": round(1000 * quality.delay_growth_s),
        "first_bad_at": started + bad[0] if bad else None,
        "closed_early": call.close_code not in (None, 1000),
        "late_sends": late_sends,
        # (wall time, ms of silence heard before it) of each message that came after the
        # caller's playback of ours had run dry (a playout underrun, as the caller hears it)
        "underruns": [(p.arrival + wall, round(1000 * p.gap_s, 1)) for p in call.played if p.late],
    }


def underrun_timing(rows: list[dict], offers: list[float]) -> dict:
    """Where the callers' underruns fell against the arrivals: how many, how much silence, and
    how many within a second after some call was offered (a setup stalling live calls) or not."""
    events = sorted(u for r in rows if r.get("admitted") for u in r.get("underruns", []))
    offers = sorted(offers)
    near = 0
    for at, _ in events:
        k = bisect.bisect_right(offers, at)
        near += k > 0 and at - offers[k - 1] <= 1.0
    first = offers[0] if offers else 0.0
    return {
        "playout_underruns": len(events),
        "calls_with_underruns": sum(bool(r.get("underruns")) for r in rows if r.get("admitted")),
        "underrun_silence_ms": round(sum(ms for _, ms in events)),
        "underruns_within_1s_of_an_arrival": near,
        # seconds after the first offer (the last offer came `arrival_span_s` after it)
        "underruns_at_s": [round(at - first, 2) for at, _ in events[:20]],
        "arrival_span_s": round(offers[-1] - first, 2) if offers else 0.0,
    }


def ramp_worker(base_url: str, hold_s: float, shared: tuple, plan: list[float], results: mp.Queue) -> None:
    """One process of the ramp's callers: an offer (the signed voice webhook) at each time of
    `plan` (wall clock) until the run's end; an admitted call talks its own speech until then and
    is judged by the per-second rule. `shared`: (refused: Event, end: Value) across workers; the
    first busy answer sets the end `hold_s` later."""
    import gc

    from support_twilio import TwilioSimulator, sid

    refused_event, end_at = shared
    gc.freeze()
    os.nice(5)

    async def main() -> list[dict]:
        sim = TwilioSimulator(base_url, AUTH_TOKEN)
        rows: list[dict] = []
        tasks = []
        for at in plan:
            await asyncio.sleep(max(0.0, at - time.time()))
            if time.time() >= end_at.value:
                break
            call_sid = sid("CA")
            response = await asyncio.to_thread(sim.voice_webhook, call_sid=call_sid, timeout=30.0)
            if "<Stream" not in response.text:
                rows.append({"admitted": False, "offered_at": at, "status": response.status_code})
                if not refused_event.is_set():
                    refused_event.set()
                    end_at.value = min(end_at.value, time.time() + hold_s)
                continue
            payloads = speech_payloads(int(call_sid[-6:], 16))
            tasks.append(asyncio.create_task(one_call(sim, call_sid, response.text, payloads, at)))
        rows += await asyncio.gather(*tasks)
        return rows

    async def one_call(sim, call_sid: str, twiml: str, payloads: list[str], offered_at: float) -> dict:
        return await talk_and_judge(sim, call_sid, twiml, payloads, offered_at, lambda: end_at.value)

    try:
        import uvloop

        results.put(uvloop.run(main()))
    except Exception as exc:
        results.put([{"error": repr(exc)}])


def ramp(message_ms: int, rate: float, hold_s: float, max_calls: int, processes: int) -> dict:
    """One server (`PERSONAPLEX_TWILIO_MESSAGE_MS=message_ms`, slots enough for any load), calls
    offered `rate` a second until the first busy answer and `hold_s` more; then the per-second
    rule over every admitted call, the server's CPU per call-second, and what it counted."""
    import httpx
    from support_server import running_server

    ctx = mp.get_context("spawn")
    shared = (ctx.Event(), ctx.Value("d", 0.0, lock=False))
    env = {**SERVER_ENV, "PERSONAPLEX_TWILIO_MESSAGE_MS": str(message_ms)}
    with running_server("--twilio", "--max-sessions", "256", "--log-level", "warning", env=env) as server:
        start = time.time() + 3.0
        plan = [start + k / rate for k in range(max_calls)]
        shared[1].value = plan[-1] + hold_s  # no refusal at all: the run ends after the last offer
        trace: list[dict] = []  # what the server said of its headroom, every half second
        watching = threading.Event()
        watcher = threading.Thread(target=watch_headroom, args=(server.url, trace, watching), daemon=True)
        watcher.start()
        cpu0 = cpu_seconds(server.process.pid)
        rows = run_workers(
            ramp_worker,
            deal(plan, processes),
            server.url,
            hold_s,
            shared,
            timeout=max_calls / rate + hold_s + 300,
        )
        cpu = cpu_seconds(server.process.pid) - cpu0
        watching.set()
        watcher.join()
        ready = httpx.get(server.url + "/readyz").json()
        wait_idle(server.url)
        auth = {"Authorization": f"Bearer {API_TOKEN}"}
        records = {
            r["call_sid"]: httpx.get(f"{server.url}/twilio/calls/{r['call_sid']}", headers=auth).json()
            for r in rows
            if r.get("admitted")
        }
    errors = [r["error"] for r in rows if "error" in r]
    admitted = [r for r in rows if r.get("admitted")]
    # A call admitted in the last moments of the run has no second to judge.
    calls = [r for r in admitted if r["judged_seconds"]]
    refusals = [r for r in rows if r.get("admitted") is False]
    degraded = [r for r in calls if not r["clean"]]
    bad_times = [r["first_bad_at"] for r in calls if r["first_bad_at"] is not None]
    first_bad = min(bad_times, default=None)
    # Clean capacity: every admitted call clean, or else the calls running when the first
    # second of any call broke the rule.
    clean = len(calls) if first_bad is None else sum(r["started_at"] < first_bad for r in calls)
    call_seconds = sum(r["seconds"] for r in admitted)
    records = {sid: record.get("metrics") or {} for sid, record in records.items()}
    # What the server counted per call: audio dropped or silence put in to keep the clock (ms).
    slips = {
        r["call_sid"]: sum(
            sum((records.get(r["call_sid"], {}).get(key) or {}).values())
            for key in ("dropped_ms", "inserted_ms")
        )
        for r in admitted
    }
    by_reason: dict[str, float] = {}
    for metrics in records.values():
        for key in ("dropped_ms", "inserted_ms"):
            for reason, ms in (metrics.get(key) or {}).items():
                name = f"{key.removesuffix('_ms')}:{reason}"
                by_reason[name] = by_reason.get(name, 0.0) + ms
    first_refusal = min((r["offered_at"] for r in refusals), default=None)
    return {
        "message_ms": message_ms,
        "ramp_calls_per_s": rate,
        "admitted": len(admitted),
        "too_short_to_judge": len(admitted) - len(calls),
        "refused": len(refusals),
        "first_refusal_after_s": round(min(r["offered_at"] for r in refusals) - start, 1)
        if refusals
        else None,
        "clean_capacity": clean,
        "degraded_admitted_calls": len(degraded),
        # of which the simulator sending them was itself late (the machine, not the server)
        "degraded_while_simulator_late": sum(r["late_sends"] > 0 for r in degraded),
        "worst_min_correlation": min((r["min_correlation"] for r in calls), default=None),
        "worst_delay_growth_ms": max((r["delay_growth_ms"] for r in calls), default=None),
        "server_cpu_ms_per_call_second": round(1000 * cpu / call_seconds, 2) if call_seconds else None,
        "server_dropped_or_inserted_ms": round(sum(slips.values())),
        "calls_with_slips": sum(ms > 0 for ms in slips.values()),
        "slips_ms_by_reason": {k: round(v) for k, v in sorted(by_reason.items())},
        "readyz_at_end": {k: ready.get(k) for k in ("status", "active")}
        | {"headroom": ready.get("headroom")},
        "closed_early": sum(r["closed_early"] for r in admitted),
        "late_sends_by_simulators": sum(r["late_sends"] for r in admitted),
        **underrun_timing(rows, [r["offered_at"] for r in rows if "offered_at" in r]),
        "headroom_at_first_refusal": nearest(trace, first_refusal),
        "headroom_at_first_bad_second": nearest(trace, first_bad),
        "errors": errors[:3],
        # (calls, loop load) every 2 s: where the load stood as calls were added
        "load_by_calls": [(t["active"], t["loop_load"]) for t in trace[::4]],
    }


# --- 5. burst: calls offered at once ---------------------------------------------------------------


def voice_form(call_sid: str) -> dict[str, str]:
    """An incoming call's voice webhook form, as Twilio posts it (tests/support_twilio.py)."""
    from support_twilio import ACCOUNT_SID

    return {
        "AccountSid": ACCOUNT_SID,
        "CallSid": call_sid,
        "From": "+15550100002",
        "To": "+15550100001",
        "CallStatus": "ringing",
        "Direction": "inbound",
        "ApiVersion": "2010-04-01",
    }


def burst_worker(base_url: str, end_at: float, plan: list[float], results: mp.Queue) -> None:
    """One process of a burst's callers: each offer (the signed voice webhook) at its time of
    `plan` (wall clock), in its own task, so a slow answer holds up no other offer; an admitted
    call talks until `end_at` and is judged by the per-second rule."""
    import gc

    from support_twilio import TwilioSimulator, sid

    gc.freeze()
    os.nice(SIM_NICE)

    async def main() -> list[dict]:
        import httpx

        sim = TwilioSimulator(base_url, AUTH_TOKEN)
        # One client for every offer (a client's TLS set-up alone costs ~65 ms of CPU: made per
        # webhook it is the simulator, not the server, that cannot keep up with a burst), and a
        # new connection per webhook, as each of Twilio's may come from anywhere.
        limits = httpx.Limits(max_keepalive_connections=0)
        # Everything a caller needs is made before the burst: the offers go out on time.
        sids = [sid("CA") for _ in plan]
        speech = [speech_payloads(int(call_sid[-6:], 16)) for call_sid in sids]
        async with httpx.AsyncClient(base_url=base_url, timeout=30.0, limits=limits) as client:
            offers = (offer(sim, client, *args) for args in zip(plan, sids, speech, strict=True))
            return list(await asyncio.gather(*offers))

    async def offer(sim, client, at: float, call_sid: str, payloads: list[str]) -> dict:
        form = voice_form(call_sid)
        await asyncio.sleep(max(0.0, at - time.time()))
        headers = {"X-Twilio-Signature": sim.sign(sim.public_url + "/twilio/voice", form)}
        sent = time.time()
        response = await client.post("/twilio/voice", data=form, headers=headers)
        answered = time.time()
        if "<Stream" not in response.text:
            return {"admitted": False, "offered_at": at, "status": response.status_code}
        row = await talk_and_judge(sim, call_sid, response.text, payloads, at, lambda: end_at)
        row["answer_ms"] = round(1000 * (answered - sent))
        row["offer_late_ms"] = round(1000 * (sent - at))
        return row

    try:
        import uvloop

        results.put(uvloop.run(main()))
    except Exception as exc:
        results.put([{"error": repr(exc)}])


def burst(calls: int, gap_s: float, hold_s: float, admission: bool, processes: int) -> dict:
    """One fresh server (slots for any load; its saturation policy on or off); `calls` calls
    offered `gap_s` apart, each admitted one talking until `hold_s` after the last offer; then
    the per-second rule over every admitted call, the playout underruns the callers heard and
    when (against the arrivals), and what the server counted."""
    import httpx
    from support_server import running_server

    env = {**SERVER_ENV, **({} if admission else RAW_CAPACITY)}
    with running_server("--twilio", "--max-sessions", "256", "--log-level", "warning", env=env) as server:
        renice(server.process.pid, SERVER_NICE)
        start = time.time() + 8.0  # the simulators started and their callers' audio made
        plan = [start + k * gap_s for k in range(calls)]
        end_at = plan[-1] + hold_s
        cpu0 = cpu_seconds(server.process.pid)
        rows = run_workers(
            burst_worker, deal(plan, processes), server.url, end_at, timeout=end_at - time.time() + 300
        )
        cpu = cpu_seconds(server.process.pid) - cpu0
        ready = httpx.get(server.url + "/readyz").json()
        wait_idle(server.url)
        auth = {"Authorization": f"Bearer {API_TOKEN}"}
        records = {
            r["call_sid"]: (httpx.get(f"{server.url}/twilio/calls/{r['call_sid']}", headers=auth).json()).get(
                "metrics"
            )
            or {}
            for r in rows
            if r.get("admitted")
        }
    errors = [r["error"] for r in rows if "error" in r]
    admitted = [r for r in rows if r.get("admitted")]
    judged = [r for r in admitted if r["judged_seconds"]]
    degraded = [r for r in judged if not r["clean"]]
    by_reason: dict[str, float] = {}
    for metrics in records.values():
        for key in ("dropped_ms", "inserted_ms"):
            for reason, ms in (metrics.get(key) or {}).items():
                name = f"{key.removesuffix('_ms')}:{reason}"
                by_reason[name] = by_reason.get(name, 0.0) + ms
    server_underrun = [
        (records.get(r["call_sid"], {}).get("inserted_ms") or {}).get("playout_underrun", 0.0)
        for r in admitted
    ]
    answers = sorted(r["answer_ms"] for r in admitted if "answer_ms" in r)

    def server_slipped(row: dict) -> bool:
        metrics = records.get(row["call_sid"], {})
        return any(sum((metrics.get(key) or {}).values()) > 0 for key in ("dropped_ms", "inserted_ms"))

    return {
        "offered": calls,
        "gap_ms": round(1000 * gap_s),
        "admission": admission,
        "admitted": len(admitted),
        "busy": sum(r.get("admitted") is False for r in rows),
        "judged": len(judged),  # admitted calls with a whole second of speech to judge
        "degraded_admitted_calls": len(degraded),
        "degraded_while_simulator_late": sum(r["late_sends"] > 0 for r in degraded),
        # degraded with nothing dropped or inserted by the server's own count for that call: the
        # simulator heard its own stalls (it shares the machine), not the server's
        "degraded_server_counted_nothing": sum(not server_slipped(r) for r in degraded),
        "worst_min_correlation": min((r["min_correlation"] for r in judged), default=None),
        "worst_delay_growth_ms": max((r["delay_growth_ms"] for r in judged), default=None),
        **underrun_timing(rows, plan),
        # from the first offer to the last admitted call's stream start, and the underruns in it
        "setup_span_s": round(max(r["started_at"] for r in admitted) - plan[0], 2) if admitted else None,
        "underruns_during_setup": sum(
            at <= max(r["started_at"] for r in admitted) for r in admitted for at, _ in r.get("underruns", [])
        ),
        "server_playout_underrun_ms_per_admitted_call": round(float(np.mean(server_underrun)), 1)
        if server_underrun
        else 0.0,
        "server_calls_with_playout_underrun": sum(ms > 0 for ms in server_underrun),
        "slips_ms_by_reason": {k: round(v) for k, v in sorted(by_reason.items())},
        "answer_ms_p50_max": [answers[len(answers) // 2], answers[-1]] if answers else None,
        "server_cpu_share": round(cpu / (end_at - start), 2),
        "late_sends_by_simulators": sum(r["late_sends"] for r in admitted),
        "closed_early": sum(r["closed_early"] for r in admitted),
        "readyz_at_end": ready.get("status"),
        "errors": errors[:3],
    }


def setup_cost(calls: int = 20) -> dict:
    """The server's CPU (all its threads) per call set up and torn down, one call at a time:
    the signed webhook, the stream, a quarter second of line audio until the echo comes back,
    the stop. Set-up is what a burst puts on the loop at once."""
    import httpx
    from support_server import running_server
    from support_twilio import TwilioSimulator, parse_stream_twiml, sid

    async def one(sim, client) -> None:
        call_sid = sid("CA")
        form = voice_form(call_sid)
        headers = {"X-Twilio-Signature": sim.sign(sim.public_url + "/twilio/voice", form)}
        answer = await client.post("/twilio/voice", data=form, headers=headers)
        url, params = parse_stream_twiml(answer.text)
        async with sim.media_stream(url, params, call_sid=call_sid) as call:
            await call.answered()

    async def run(url: str, pid: int) -> float:
        sim = TwilioSimulator(url, AUTH_TOKEN)
        limits = httpx.Limits(max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:
            await one(sim, client)  # the first call's one-off costs (imports, filters) left out
            cpu0 = cpu_seconds(pid)
            for _ in range(calls):
                await one(sim, client)
            return cpu_seconds(pid) - cpu0

    env = {**SERVER_ENV, **RAW_CAPACITY}
    with running_server("--twilio", "--max-sessions", "8", "--log-level", "warning", env=env) as server:
        cpu = asyncio.run(run(server.url, server.process.pid))
    return {"setup_calls": calls, "server_cpu_ms_per_call_set_up_and_torn_down": round(1000 * cpu / calls, 1)}


def renice(pid: int, nice: int) -> None:
    """Every thread of `pid` at `nice` (threads it starts later inherit it from theirs)."""
    if not nice:
        return
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, int(tid), nice)


def burst_table(levels: list[int], gap_s: float, hold_s: float, modes: list[bool], processes: int) -> dict:
    """Every level with admission on and off; the clean capacity with admission off (the most
    calls admitted at a level with no degraded call) and each admission-on level's admitted
    calls against it (goal: >= 0.8, or every call offered)."""
    rows: dict[str, dict] = {}
    for admission in modes:
        for calls in levels:
            row = burst(calls, gap_s, hold_s, admission, processes)
            rows[f"{'on' if admission else 'off'}:{calls}"] = row
            print(json.dumps(row), flush=True)
    clean_off = max(
        (r["admitted"] for r in rows.values() if not r["admission"] and not r["degraded_admitted_calls"]),
        default=None,
    )
    cost = setup_cost()
    print(json.dumps(cost), flush=True)
    summary = {
        **cost,
        "burst": {
            key: {
                k: r[k]
                for k in (
                    "admitted",
                    "busy",
                    "judged",
                    "degraded_admitted_calls",
                    "degraded_while_simulator_late",
                    "degraded_server_counted_nothing",
                    "playout_underruns",
                    "calls_with_underruns",
                    "underruns_within_1s_of_an_arrival",
                    "underruns_during_setup",
                    "setup_span_s",
                    "server_calls_with_playout_underrun",
                )
            }
            for key, r in rows.items()
        },
        "clean_capacity_admission_off": clean_off,
        "cpu_count": os.cpu_count(),
        "gap_ms": round(1000 * gap_s),
        "hold_s": hold_s,
        "server_nice": SERVER_NICE,
        "simulator_nice": SIM_NICE,
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
    }
    if clean_off:
        summary["admitted_over_clean_capacity"] = {
            key: round(min(r["admitted"], r["offered"]) / min(clean_off, r["offered"]), 2)
            for key, r in rows.items()
            if r["admission"]
        }
    return summary


def watch_headroom(base_url: str, trace: list[dict], done: threading.Event) -> None:
    """/readyz every half second: the server's calls and headroom signals, stamped."""
    import httpx

    while not done.wait(0.5):
        try:
            body = httpx.get(base_url + "/readyz", timeout=5).json()
        except Exception:
            continue
        headroom = body.get("headroom") or {}
        trace.append(
            {
                "at": time.time(),
                "active": body.get("active"),
                "reserved": body.get("reserved"),
                **{
                    k: headroom.get(k)
                    for k in ("saturated", "loop_load", "loop_lag_ms", "worst_gap_ms", "stalls", "late_share")
                },
            }
        )


def nearest(trace: list[dict], at: float | None) -> dict | None:
    """The trace's sample nearest `at` (its time left out)."""
    if at is None or not trace:
        return None
    sample = min(trace, key=lambda s: abs(s["at"] - at))
    return {k: v for k, v in sample.items() if k != "at"}


def message_size_cost(sizes: list[int], calls: int, seconds: float, rounds: int, processes: int) -> dict:
    """Server CPU per call-second at `calls` calls with each outbound message size, the sizes
    in turn for `rounds` rounds (the shared machine's drift hits all alike)."""
    from support_server import running_server

    cost: dict[int, list[float]] = {size: [] for size in sizes}
    for _ in range(rounds):
        for size in sizes:
            env = {**SERVER_ENV, **RAW_CAPACITY, "PERSONAPLEX_TWILIO_MESSAGE_MS": str(size)}
            with running_server(
                "--twilio", "--max-sessions", str(calls), "--log-level", "warning", env=env
            ) as server:
                cpu0 = cpu_seconds(server.process.pid)
                row = run_level(server.url, calls, seconds, processes, 0.01)
                cpu = cpu_seconds(server.process.pid) - cpu0
                wait_idle(server.url)
            if row["errors"] or row["closed_early"]:
                raise RuntimeError(f"message size {size}: {row}")
            cost[size].append(1000 * cpu / (calls * seconds))
            print(
                json.dumps(
                    {"message_ms": size, "calls": calls, "cpu_ms_per_call_second": round(cost[size][-1], 2)}
                ),
                flush=True,
            )
    means = {size: float(np.mean(values)) for size, values in cost.items()}
    base = means[sizes[0]]
    return {
        "cost_calls": calls,
        "cost_rounds": rounds,
        "cpu_ms_per_call_second_by_message_ms": {str(k): round(v, 2) for k, v in means.items()},
        "cpu_ratio_to_first_size": {str(k): ratio(v, base) for k, v in means.items()},
        "cpu_each_round": {str(k): [round(v, 2) for v in values] for k, values in cost.items()},
    }


def ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engine", default="echo", choices=["echo"])
    parser.add_argument("--levels", default="1,5,10,25,50,100,150,200")
    parser.add_argument("--seconds", type=float, default=5.0, help="call length at each level")
    parser.add_argument("--processes", type=int, default=2, help="simulator processes")
    parser.add_argument(
        "--all-levels",
        action="store_true",
        help="run every level even after one had late frames (to compare CPU cost)",
    )
    parser.add_argument(
        "--ramp-ms",
        type=float,
        default=10.0,
        help="one call starts every this many ms (0: all at once, a connection storm)",
    )
    parser.add_argument(
        "--records-calls", type=int, default=25, help="calls for the records on/off comparison (0: skip)"
    )
    parser.add_argument("--records-rounds", type=int, default=3, help="off/on rounds of that comparison")
    parser.add_argument(
        "--records-seconds",
        type=float,
        default=10.0,
        help="call length in that comparison (a call's fixed costs spread over it)",
    )
    parser.add_argument("--records-only", action="store_true", help="run only the records comparison")
    parser.add_argument(
        "--ramp",
        action="store_true",
        help="ramp mode: calls added until refusals start, for each --message-ms (then the cost comparison)",
    )
    parser.add_argument("--message-ms", default="20,40,80", help="outbound message sizes to compare")
    parser.add_argument("--ramp-rate", type=float, default=5.0, help="ramp: calls offered per second")
    parser.add_argument(
        "--hold-s", type=float, default=10.0, help="ramp: how long the calls go on after the first refusal"
    )
    parser.add_argument("--max-calls", type=int, default=250, help="ramp: the most calls offered")
    parser.add_argument(
        "--cost-calls",
        type=int,
        default=50,
        help="ramp mode: calls for the CPU comparison of message sizes (0: skip)",
    )
    parser.add_argument("--cost-rounds", type=int, default=2)
    parser.add_argument(
        "--burst",
        default="",
        help="burst mode: calls offered at each level (e.g. 20,40,60,200), --burst-gap-ms apart",
    )
    parser.add_argument("--burst-gap-ms", type=float, default=20.0)
    parser.add_argument(
        "--burst-admission", default="on,off", help="burst mode: with the saturation policy on, off, or both"
    )
    parser.add_argument("--burst-hold-s", type=float, default=8.0, help="burst: talking after the last offer")
    parser.add_argument("--server-nice", type=int, default=0, help="burst: the server's nice")
    parser.add_argument("--simulator-nice", type=int, default=5, help="burst: the simulated callers' nice")
    args = parser.parse_args()
    if args.burst:
        # (read again by the spawned simulator processes, from their environment)
        os.environ["BENCH_SERVER_NICE"] = str(args.server_nice)
        os.environ["BENCH_SIMULATOR_NICE"] = str(args.simulator_nice)
        global SERVER_NICE, SIM_NICE
        SERVER_NICE, SIM_NICE = args.server_nice, args.simulator_nice
        levels = [int(v) for v in args.burst.split(",")]
        modes = [m.strip() == "on" for m in args.burst_admission.split(",")]
        summary = burst_table(levels, args.burst_gap_ms / 1000, args.burst_hold_s, modes, args.processes)
        print(json.dumps(summary))
        return
    if args.ramp:
        sizes = [int(v) for v in args.message_ms.split(",")]
        rows = {}
        for size in sizes:
            rows[str(size)] = ramp(size, args.ramp_rate, args.hold_s, args.max_calls, args.processes)
            print(json.dumps(rows[str(size)]), flush=True)
        summary: dict = {"ramp": rows, "cpu_count": os.cpu_count()}
        if args.cost_calls:
            summary.update(
                message_size_cost(sizes, args.cost_calls, args.seconds, args.cost_rounds, args.processes)
            )
        print(json.dumps(summary))
        return
    if args.records_only:
        result = records_cost(
            args.records_calls or 25,
            args.records_seconds,
            args.processes,
            args.ramp_ms / 1000,
            args.records_rounds,
        )
        print(json.dumps(result))
        return
    levels = [int(v) for v in args.levels.split(",")]

    delays = bridge_delays()
    ours, theirs = delays["bridge_delay_ms"], delays["pipecat_serializer_delay_ms"]
    print(f"bridge delay (ms): ours {ours}, pipecat's TwilioFrameSerializer {theirs}")

    from support_server import running_server

    env = {**SERVER_ENV, **RAW_CAPACITY}
    best, best_jitter, rows = 0, None, []
    sim_late_at_best = None
    cost = None
    with running_server(
        "--twilio", "--max-sessions", str(max(levels)), "--log-level", "warning", env=env
    ) as server:
        failed = False
        for calls in levels:
            cpu0, wall0 = cpu_seconds(server.process.pid), time.monotonic()
            row = run_level(server.url, calls, args.seconds, args.processes, args.ramp_ms / 1000)
            # Server CPU per call per second of audio: what a call costs the bridge + echo engine
            # (includes answering the webhooks and opening the streams).
            cpu = cpu_seconds(server.process.pid) - cpu0
            row["server_cpu_ms_per_call_second"] = round(1000 * cpu / (calls * args.seconds), 2)
            row["server_cpu_share"] = round(cpu / (time.monotonic() - wall0), 2)
            row.update(server_side(server.url, calls))
            rows.append(row)
            print(json.dumps(row))
            wait_idle(server.url)
            # Late frames as the server counts them: engine frames whose caller audio was not in
            # time, and messages that reached Twilio after its buffer of ours had run dry. The
            # simulators' own count (`late_frames`) also catches their own stalls on a shared
            # machine (every call of a process late at the same instant); it is reported beside.
            if (
                row["bridge_late_frames"]
                or row["engine_late_input_frames"]
                or row["closed_early"]
                or row["errors"]
            ):
                failed = True
                if args.all_levels:
                    continue
                break
            if failed:
                continue  # the maximum counts only levels below the first failure
            best, best_jitter = calls, row["p99_outbound_jitter_ms"]
            cost = row["server_cpu_ms_per_call_second"]
            sim_late_at_best = row["late_frames"]
    if best_jitter is None:
        best_jitter = rows[0]["p99_outbound_jitter_ms"] if rows else None
    summary = {
        "max_calls_no_late_frames": best,
        "p99_outbound_jitter_ms": best_jitter,
        "bridge_delay_ms": delays["bridge_delay_ms"],
        "pipecat_serializer_delay_ms": delays["pipecat_serializer_delay_ms"],
        "bridge_delay_ratio_vs_pipecat": round(
            delays["bridge_delay_ms"] / delays["pipecat_serializer_delay_ms"], 3
        )
        if delays["pipecat_serializer_delay_ms"]
        else None,
        "server_cpu_ms_per_call_second": cost,
        "simulator_seen_late_frames_at_max": sim_late_at_best,
        "levels_tried": [r["calls"] for r in rows],
        "seconds_per_level": args.seconds,
        "ramp_ms": args.ramp_ms,
        "cpu_count": os.cpu_count(),
    }
    if args.records_calls:
        summary.update(
            records_cost(
                args.records_calls,
                args.records_seconds,
                args.processes,
                args.ramp_ms / 1000,
                args.records_rounds,
            )
        )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
