"""WebRTC against /api/chat, one run: server CPU per session-second and mouth-to-ear delay, at 0, 5
and 10 % packet loss.

For each loss level a fresh `serve --engine echo` takes `--calls` concurrent callers on one
transport, then on the other, each streaming the same espeak-ng speech in real time for
`--seconds`; the echo engine returns each caller its own audio, so the delay of every 20 ms of it
can be found in what comes back.

* **Loss.** As root where the kernel has it (`ip netns`, a veth pair, iptables' `statistic`
  match; `apt-get install iptables`), the run moves into its own network namespace and the
  kernel drops that share of every packet both ways, UDP and TCP alike: the WebSocket path meets
  the same loss as WebRTC (and TCP's answer to it, retransmission, holds back every later
  byte). The callers connect first; the loss starts when all are in, before the first word (a
  call that could not connect says nothing about its media). Elsewhere the loss is injected at
  the RTP layer by a UDP relay (tests/support_webrtc.py) and the WebSocket rows under loss say
  "not measured".
* **server_cpu_ms_per_session_s**: the server process's CPU time (user + system, /proc) from the
  first word to the last hang-up, divided by the seconds of call it carried.
* **mouth_to_ear_ms**: for each 20 ms of echoed speech, the time from its first sample being
  spoken (captured) at the caller to its arrival back at the caller, decoded: p50, p95, p99 and
  max. It counts the network both ways, the server (framing to 80 ms, one tick, the
  encoders) and, on WebRTC, the lost packets rebuilt or concealed (at the time they were); not a
  playout buffer, which a client sizes from this spread (`playout_ms_for_99pct`: p99 - p50).
  `stalls` counts arrivals more than 100 ms late against the p50 (what a listener hears as a
  gap or a burst); `echo_similarity` is tests/support_server.py's, against what was sent.

Both callers are Python: the WebSocket one sends one Ogg page per 20 ms packet (as the browser
page does); the WebRTC one is aiortc's client side, whose received packets go through the same
receive path the server uses for callers (FEC, concealment), as a browser's NetEq would without
its playout delay. The clients share the machine with the server: on a 2-core box their own CPU
shows in the delays, equally for both.

    .venv/bin/python bench/webrtc_transport.py [--calls 3] [--seconds 10] [--losses 0,5,10]

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

SR = 24000
CHUNK = 480  # 20 ms


# -- the network ---------------------------------------------------------------------------------


def kernel_loss_available() -> bool:
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("iptables"):
        return False
    name = f"ppprobe{os.getpid()}"
    try:
        ok = subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode == 0
        if ok:
            rule = [
                "iptables",
                "-A",
                "INPUT",
                "-m",
                "statistic",
                "--mode",
                "random",
                "--probability",
                "0.5",
                "-j",
                "DROP",
            ]
            ok = subprocess.run(["ip", "netns", "exec", name, *rule], capture_output=True).returncode == 0
        return ok
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def make_namespace(name: str) -> None:
    for cmd in (
        ["ip", "netns", "add", name],
        ["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"],
        # aioice gathers no loopback candidates: a veth pair gives the namespace two addresses.
        ["ip", "netns", "exec", name, "ip", "link", "add", "v0", "type", "veth", "peer", "name", "v1"],
        ["ip", "netns", "exec", name, "ip", "addr", "add", "10.77.0.1/24", "dev", "v0"],
        ["ip", "netns", "exec", name, "ip", "addr", "add", "10.77.0.2/24", "dev", "v1"],
        ["ip", "netns", "exec", name, "ip", "link", "set", "v0", "up"],
        ["ip", "netns", "exec", name, "ip", "link", "set", "v1", "up"],
    ):
        subprocess.run(cmd, check=True, capture_output=True)


def set_kernel_loss(percent: float) -> None:
    """Inside the namespace: drop `percent` of every packet delivered (each direction once)."""
    subprocess.run(["iptables", "-F", "INPUT"], check=True)
    if percent > 0:
        subprocess.run(
            [
                "iptables",
                "-A",
                "INPUT",
                "-m",
                "statistic",
                "--mode",
                "random",
                "--probability",
                str(percent / 100),
                "-j",
                "DROP",
            ],
            check=True,
        )


# -- the callers ---------------------------------------------------------------------------------


def speech(seconds: float) -> np.ndarray:
    from support_audio import espeak_speech

    from personaplex_voice.audio.resample import resample

    text = (
        "Hello, thanks for calling. I can help you change your booking, check an order, or answer a "
        "question about your account. What would you like to do today? "
    ) * 4
    with tempfile.TemporaryDirectory() as tmp:
        pcm, rate = espeak_speech(Path(tmp), text)
    pcm = resample(pcm, rate, SR)
    return np.tile(pcm, int(np.ceil(seconds * SR / len(pcm))))[: round(seconds * SR)].astype(np.float32)


class Timeline:
    """What one caller sent and got back, each 20 ms chunk with its time."""

    def __init__(self) -> None:
        self.sent: list[tuple[float, np.ndarray]] = []  # (time its last sample was captured, pcm)
        self.received: list[tuple[float, np.ndarray]] = []  # (arrival, decoded pcm)


class Start:
    """The callers connect first; the loss and the speech start when all are in (a call that
    cannot connect under loss says nothing about its media)."""

    def __init__(self, calls: int) -> None:
        self.calls, self.connected = calls, 0
        self.all_in = asyncio.Event()
        self.go = asyncio.Event()

    async def ready_and_wait(self) -> None:
        self.connected += 1
        if self.connected >= self.calls:
            self.all_in.set()
        await self.go.wait()


async def ws_caller(url: str, audio: np.ndarray, seconds: float, start_line: Start) -> Timeline:
    from websockets.asyncio.client import connect

    from personaplex_voice.audio.opus import OggOpusReader, OggOpusWriter

    line = Timeline()
    writer = OggOpusWriter(SR, frame_ms=20)
    reader = OggOpusReader(SR)
    async with connect(url, max_size=None, compression=None) as ws:
        while (await ws.recv())[0] != 0x00:
            pass

        async def receive() -> None:
            async for message in ws:
                if message[0] == 0x01:
                    now = time.monotonic()
                    for pcm in reader.feed(message[1:]):
                        line.received.append((now, pcm))

        receiver = asyncio.create_task(receive())
        await start_line.ready_and_wait()
        start = time.monotonic()
        for i in range(round(seconds * SR) // CHUNK):
            await asyncio.sleep(max(0.0, start + (i + 1) * CHUNK / SR - time.monotonic()))
            chunk = audio[i * CHUNK : (i + 1) * CHUNK]
            line.sent.append((time.monotonic(), chunk))
            await ws.send(b"\x01" + writer.write(chunk))
        await asyncio.sleep(1.0)
        receiver.cancel()
    return line


async def webrtc_caller(
    base_url: str, audio: np.ndarray, seconds: float, relay_loss: float, start_line: Start
) -> Timeline:
    import av
    import httpx
    from aiortc import RTCPeerConnection, RTCSessionDescription
    from aiortc.mediastreams import MediaStreamTrack
    from support_webrtc import host_candidate, start_relay, to_48k, via_relay

    from personaplex_voice.audio.budget import DecodeBudget, DecodeLimits
    from personaplex_voice.audio.opus_packets import OpusPacketDecoder
    from personaplex_voice.server.webrtc.caller_audio import CallerAudio

    line = Timeline()
    go = asyncio.Event()

    class Speaker(MediaStreamTrack):
        kind = "audio"

        def __init__(self) -> None:
            super().__init__()
            self.i = 0
            self.t0: float | None = None
            self.samples = to_48k(audio)

        async def recv(self) -> Any:
            import fractions

            if self.t0 is None:
                self.t0 = time.monotonic()
            await asyncio.sleep(max(0.0, self.t0 + (self.i + 1) * 0.02 - time.monotonic()))
            chunk48 = np.zeros(960, np.float32)
            if go.is_set():
                k = len(line.sent)
                chunk48[:] = (
                    self.samples[k * 960 : (k + 1) * 960] if (k + 1) * 960 <= len(self.samples) else 0
                )
                line.sent.append((time.monotonic(), audio[k * CHUNK : (k + 1) * CHUNK]))
            frame = av.AudioFrame.from_ndarray(
                (np.clip(chunk48, -1, 1) * 32767).astype(np.int16).reshape(1, -1), format="s16", layout="mono"
            )
            frame.sample_rate, frame.pts, frame.time_base = 48000, self.i * 960, fractions.Fraction(1, 48000)
            self.i += 1
            return frame

    arrival = [0.0]

    def heard(pcm: np.ndarray) -> None:
        line.received.append((arrival[0], pcm))

    ear = CallerAudio(OpusPacketDecoder(SR), heard, DecodeBudget(SR, DecodeLimits(speed=100, burst_s=100)))

    class Tap:
        capacity = 16

        def add(self, packet: Any) -> tuple[bool, None]:
            arrival[0] = time.monotonic()
            ear.on_packet(packet.sequence_number, packet.timestamp, packet.payload, arrival[0])
            return False, None

    pc = RTCPeerConnection()
    transceiver = pc.addTransceiver(Speaker(), direction="sendrecv")
    transceiver.receiver._RTCRtpReceiver__jitter_buffer = Tap()
    channel = pc.createDataChannel("personaplex")
    ready = asyncio.Event()
    channel.on("message", lambda m: ready.set() if isinstance(m, bytes) and m[:1] == b"\x00" else None)
    await pc.setLocalDescription(await pc.createOffer())
    relay = None
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        response = await http.post(
            "/api/whip", content=pc.localDescription.sdp, headers={"content-type": "application/sdp"}
        )
        response.raise_for_status()
        answer = response.text
        if relay_loss:
            relay = await start_relay(host_candidate(answer), relay_loss, seed=len(answer))
            answer = via_relay(answer, relay)
        await pc.setRemoteDescription(RTCSessionDescription(sdp=answer, type="answer"))
        await asyncio.wait_for(ready.wait(), 60)

        async def clock() -> None:
            while True:
                await asyncio.sleep(0.02)
                arrival[0] = time.monotonic()
                ear.on_clock(arrival[0])

        ticking = asyncio.create_task(clock())
        await start_line.ready_and_wait()
        go.set()
        await asyncio.sleep(seconds + 1.0)
        ticking.cancel()
        await http.delete(response.headers["location"])
    await pc.close()
    if relay is not None:
        relay.transport.close()
    return line


# -- measuring -----------------------------------------------------------------------------------


def delays_ms(line: Timeline) -> tuple[np.ndarray, float]:
    """Mouth-to-ear of each received 20 ms chunk of echoed speech, and the echo similarity."""
    from scipy.signal import correlate
    from support_server import echo_similarity

    if not line.sent or not line.received:
        return np.zeros(0), 0.0
    sent = np.concatenate([c for _, c in line.sent])
    sent_end = np.concatenate([np.full(len(c), t) for t, c in line.sent])
    got = np.concatenate([c for _, c in line.received])
    got_at = np.concatenate([np.full(len(c), t) for t, c in line.received])
    similarity = echo_similarity(sent, got)
    glob = int(np.argmax(correlate(got, sent, mode="full", method="fft"))) - (len(sent) - 1)
    out = []
    block = SR
    for start in range(0, len(sent) - block, block):  # the local lag of each second (the session
        ref = sent[start : start + block]  # may drop or add a frame to keep its clock)
        if np.sqrt(np.mean(ref**2)) < 0.01:
            continue
        lo = max(0, start + glob - 6 * 480)
        window = got[lo : start + glob + block + 6 * 480]
        if len(window) < block:
            continue
        xc = correlate(window, ref, mode="valid", method="fft")
        lag = lo + int(np.argmax(xc)) - start
        for k in range(start, start + block, CHUNK):
            j = k + lag
            if 0 <= j < len(got) and np.sqrt(np.mean(sent[k : k + CHUNK] ** 2)) > 0.01:
                mouth = sent_end[k] - CHUNK / SR  # its first sample was spoken 20 ms before
                out.append(1000 * (got_at[j] - mouth))
    return np.asarray(out), similarity


def summarize(lines: list[Timeline]) -> dict[str, Any]:
    all_delays, similarities = [], []
    for line in lines:
        d, s = delays_ms(line)
        all_delays.append(d)
        similarities.append(s)
    d = np.concatenate(all_delays) if all_delays else np.zeros(0)
    if not len(d):
        return {"mouth_to_ear_ms": None}
    p50, p95, p99 = (float(np.percentile(d, q)) for q in (50, 95, 99))
    return {
        "mouth_to_ear_ms": {
            "p50": round(p50),
            "p95": round(p95),
            "p99": round(p99),
            "max": round(float(d.max())),
        },
        "playout_ms_for_99pct": round(p99 - p50),
        "stalls": int(np.sum(d > p50 + 100)),
        "chunks": len(d),
        "echo_similarity": round(float(np.median(similarities)), 3),
    }


def process_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_level(loss: float, calls: int, seconds: float, kernel: bool) -> dict[str, Any]:
    from support_server import running_server

    audio = speech(seconds + 1)
    if kernel:
        set_kernel_loss(0)
    row: dict[str, Any] = {"loss_pct": loss, "injected": "kernel" if kernel else "rtp relay"}
    with running_server("--max-sessions", str(calls), "--idle-timeout-s", "0", timeout=120) as server:
        pid = server.process.pid
        for transport in ("websocket", "webrtc"):
            if transport == "websocket" and loss and not kernel:
                row[transport] = "not measured: TCP loss needs the kernel's (root, ip netns, iptables)"
                continue
            measured: dict[str, float] = {}

            async def all_calls(transport: str = transport, measured: dict = measured) -> list[Any]:
                start_line = Start(calls)
                if transport == "websocket":
                    url = server.ws_url + "/api/chat?text_prompt=hi"
                    callers = [ws_caller(url, audio, seconds, start_line) for _ in range(calls)]
                else:
                    relay = 0.0 if kernel else loss / 100
                    callers = [
                        webrtc_caller(server.url, audio, seconds, relay, start_line) for _ in range(calls)
                    ]
                tasks = [asyncio.ensure_future(c) for c in callers]
                await asyncio.wait(
                    [asyncio.ensure_future(start_line.all_in.wait()), *tasks],
                    return_when=asyncio.FIRST_COMPLETED,
                    timeout=120,
                )
                if kernel:
                    set_kernel_loss(loss)  # every caller is in: the loss holds from the first word
                measured["cpu0"], measured["t0"] = process_cpu_s(pid), time.monotonic()
                start_line.go.set()
                outcomes = list(await asyncio.gather(*tasks, return_exceptions=True))
                measured["cpu1"], measured["t1"] = process_cpu_s(pid), time.monotonic()
                return outcomes

            try:
                outcomes = asyncio.run(all_calls())
            finally:
                if kernel:
                    set_kernel_loss(0)
            lines = [o for o in outcomes if isinstance(o, Timeline)]
            failed = [f"{type(o).__name__}: {o}"[:200] for o in outcomes if not isinstance(o, Timeline)]
            cpu = measured["cpu1"] - measured["cpu0"]
            elapsed = measured["t1"] - measured["t0"]
            row[transport] = {
                "calls_failed": failed,
                # CPU over the talking (and the hang-up), per second of call carried.
                "server_cpu_ms_per_session_s": round(1000 * cpu / (calls * elapsed), 1),
                "server_cpu_share_of_a_core": round(cpu / elapsed, 3),
                **summarize(lines),
            }
            time.sleep(1.0)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--losses", default="0,5,10", help="loss levels in percent")
    parser.add_argument("--no-kernel-loss", action="store_true", help="inject loss at the RTP layer only")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    losses = [float(x) for x in args.losses.split(",")]

    if not args.inside and not args.no_kernel_loss and kernel_loss_available():
        name = f"ppbench{os.getpid()}"
        make_namespace(name)
        try:
            cmd = [
                "ip",
                "netns",
                "exec",
                name,
                sys.executable,
                __file__,
                "--inside",
                "--calls",
                str(args.calls),
                "--seconds",
                str(args.seconds),
                "--losses",
                args.losses,
            ]
            sys.exit(subprocess.run(cmd, cwd=ROOT).returncode)
        finally:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)

    kernel = args.inside
    rows = []
    for loss in losses:
        row = run_level(loss, args.calls, args.seconds, kernel)
        print(json.dumps(row), flush=True)
        rows.append(row)
    ratios = {}
    for row in rows:
        ws, rtc = row.get("websocket"), row.get("webrtc")
        if (
            isinstance(ws, dict)
            and isinstance(rtc, dict)
            and ws.get("mouth_to_ear_ms")
            and rtc.get("mouth_to_ear_ms")
        ):
            ratios[f"{row['loss_pct']:g}%"] = {
                "cpu_webrtc_over_websocket": round(
                    rtc["server_cpu_ms_per_session_s"] / max(ws["server_cpu_ms_per_session_s"], 1e-9), 2
                ),
                "p99_mouth_to_ear_webrtc_over_websocket": round(
                    rtc["mouth_to_ear_ms"]["p99"] / max(ws["mouth_to_ear_ms"]["p99"], 1), 2
                ),
            }
    print(
        json.dumps(
            {
                "calls": args.calls,
                "seconds": args.seconds,
                "loss": "kernel" if kernel else "rtp relay",
                "rows": rows,
                "same_run_ratios": ratios,
            }
        )
    )


if __name__ == "__main__":
    main()
