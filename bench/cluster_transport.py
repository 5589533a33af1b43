"""How engine-worker frames should travel on one host: Unix socket, TCP loopback, shared memory, Ray.

    .venv/bin/python bench/cluster_transport.py [--frames 2000] [--streams 64] [--seconds 5] [--no-ray]

Two processes, as front-end and engine worker are, both on asyncio (uvloop when installed, as
uvicorn and Ray actors run). One message each way per 80 ms frame: 1920 float32 samples plus a
small header (the session protocol's AUDIO and FRAME), so 7.7 KB each way.

1. Ping-pong: one frame out, the worker echoes it, `--frames` times: round-trip p50 / p99 (us).
2. Load: `--streams` sessions at 12.5 frames/s each for `--seconds` (64 = one GPU's calls), the
   worker echoing every frame: CPU (user + system, /proc) of each process per frame, and the
   round trip's p50 / p99 under that load.

Paths:
- `unix`, `tcp`: the session protocol's framing (`cluster/wire.py`) over an asyncio stream.
- `shm`: the same bytes through a shared-memory ring per direction (`multiprocessing.shared_memory`,
  64 slots of one message), each message announced on an eventfd the other side's loop watches:
  the copy into the socket buffer is saved, the wake-up (a syscall each way) is not.
- `ray`: an async Ray actor method called with the frame bytes and returning them (a local
  one-node Ray; skipped without ray or with --no-ray).

Last line: one JSON object with every number, the numbers docs/cluster.md quotes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import struct
import sys
import time
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from personaplex_voice.cluster import wire  # noqa: E402
from personaplex_voice.cluster.procs import cpu_seconds  # noqa: E402

FRAME = np.random.default_rng(0).standard_normal(1920).astype(np.float32) * 0.1
SLOTS = 64
SLOT_BYTES = 8192


def run_loop(coro) -> None:
    try:
        import uvloop

        uvloop.run(coro)
    except ImportError:
        asyncio.run(coro)


# -- the echoing worker side ---------------------------------------------------------------------


class EchoProtocol(asyncio.Protocol):
    """Echo every AUDIO message back as a FRAME (parse, re-encode: what a worker does)."""

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.reader = wire.MessageReader()

    def data_received(self, data: bytes) -> None:
        out = []
        for _kind, channel, body in self.reader.feed(data):
            pcm, stamp = wire.parse_audio(body)
            out.append(wire.frame_message(channel, 0, pcm, None, None, stamp))
        self.transport.write(b"".join(out))


def socket_worker(address: str, ready) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        kind, _, rest = address.partition(":")
        if kind == "unix":
            server = await loop.create_unix_server(EchoProtocol, rest)
        else:
            host, _, port = rest.rpartition(":")
            server = await loop.create_server(EchoProtocol, host, int(port))
        ready.set()
        async with server:
            await server.serve_forever()

    run_loop(main())


class ShmRing:
    """One direction: SLOTS fixed-size slots in shared memory; an eventfd counts messages."""

    def __init__(self, name: str, event_fd: int, create: bool):
        self.shm = shared_memory.SharedMemory(name=name, create=create, size=SLOTS * SLOT_BYTES)
        self.fd = event_fd
        self.write_at = 0
        self.read_at = 0

    def put(self, data: bytes) -> None:
        offset = (self.write_at % SLOTS) * SLOT_BYTES
        self.shm.buf[offset : offset + 4] = struct.pack("<I", len(data))
        self.shm.buf[offset + 4 : offset + 4 + len(data)] = data
        self.write_at += 1
        os.eventfd_write(self.fd, 1)

    def take(self) -> list[bytes]:
        count = os.eventfd_read(self.fd)
        out = []
        for _ in range(count):
            offset = (self.read_at % SLOTS) * SLOT_BYTES
            (length,) = struct.unpack_from("<I", self.shm.buf, offset)
            out.append(bytes(self.shm.buf[offset + 4 : offset + 4 + length]))
            self.read_at += 1
        return out


def shm_worker(names: tuple[str, str], fds: tuple[int, int], ready) -> None:
    async def main() -> None:
        inbound = ShmRing(names[0], fds[0], create=False)
        outbound = ShmRing(names[1], fds[1], create=False)
        reader = wire.MessageReader()

        def on_message() -> None:
            for data in inbound.take():
                for _kind, channel, body in reader.feed(data):
                    pcm, stamp = wire.parse_audio(body)
                    outbound.put(wire.frame_message(channel, 0, pcm, None, None, stamp))

        asyncio.get_running_loop().add_reader(inbound.fd, on_message)
        ready.set()
        await asyncio.Event().wait()

    run_loop(main())


# -- the front-end side ----------------------------------------------------------------------------


class Collector:
    """Receives echoed frames; records each round trip from the stamp it carries."""

    def __init__(self) -> None:
        self.reader = wire.MessageReader()
        self.rtts: list[float] = []
        self.waiter: asyncio.Future | None = None

    def feed(self, data: bytes) -> None:
        now = time.monotonic()
        for _kind, _channel, body in self.reader.feed(data):
            _, stamp, _, _, _ = wire.parse_frame(body)
            self.rtts.append(now - stamp)
            if self.waiter is not None and not self.waiter.done():
                self.waiter.set_result(None)


async def drive(send, collector: Collector, frames: int, streams: int, seconds: float) -> dict:
    loop = asyncio.get_running_loop()
    for _ in range(frames):  # ping-pong
        collector.waiter = loop.create_future()
        send(wire.audio_message(1, FRAME, time.monotonic()))
        await collector.waiter
    ping = np.array(collector.rtts[50:]) * 1e6
    collector.rtts.clear()
    collector.waiter = None
    # load: `streams` paced streams, phases spread over the 80 ms frame
    period = 0.080
    start = time.monotonic() + 0.1
    ticks = int(seconds / period)
    schedule = sorted(
        (start + k * period + s * period / streams, s) for k in range(ticks) for s in range(streams)
    )
    cpu0 = time.process_time()
    for due, stream in schedule:
        delay = due - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        send(wire.audio_message(stream + 1, FRAME, time.monotonic()))
    await asyncio.sleep(0.3)
    sent = len(schedule)
    cpu = time.process_time() - cpu0
    load = np.array(collector.rtts) * 1e6
    return {
        "pingpong_rtt_us_p50": round(float(np.percentile(ping, 50)), 1),
        "pingpong_rtt_us_p99": round(float(np.percentile(ping, 99)), 1),
        "load_rtt_us_p50": round(float(np.percentile(load, 50)), 1) if len(load) else None,
        "load_rtt_us_p99": round(float(np.percentile(load, 99)), 1) if len(load) else None,
        "load_frames_lost": sent - len(load),
        "frontend_cpu_us_per_frame": round(1e6 * cpu / sent, 1),
        "sent": sent,
    }


def measure_socket(address: str, args) -> dict:
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=socket_worker, args=(address, ready), daemon=True)
    proc.start()
    ready.wait(30)
    result: dict = {}

    async def main() -> None:
        loop = asyncio.get_running_loop()
        collector = Collector()

        class Client(asyncio.Protocol):
            def data_received(self, data: bytes) -> None:
                collector.feed(data)

        kind, _, rest = address.partition(":")
        if kind == "unix":
            transport, _ = await loop.create_unix_connection(Client, rest)
        else:
            host, _, port = rest.rpartition(":")
            transport, _ = await loop.create_connection(Client, host, int(port))
        worker_cpu0 = cpu_seconds(proc.pid)
        result.update(await drive(transport.write, collector, args.frames, args.streams, args.seconds))
        result["worker_cpu_us_per_frame"] = round(
            1e6 * (cpu_seconds(proc.pid) - worker_cpu0) / result["sent"], 1
        )
        transport.close()

    run_loop(main())
    proc.terminate()
    return result


def measure_shm(args) -> dict:
    ctx = mp.get_context("fork")  # the eventfds are inherited
    fds = (os.eventfd(0, os.EFD_NONBLOCK), os.eventfd(0, os.EFD_NONBLOCK))
    tag = f"ppbench{os.getpid()}"
    rings = (ShmRing(tag + "a", fds[0], True), ShmRing(tag + "b", fds[1], True))
    ready = ctx.Event()
    proc = ctx.Process(target=shm_worker, args=((tag + "a", tag + "b"), fds, ready), daemon=True)
    proc.start()
    ready.wait(30)
    result: dict = {}

    async def main() -> None:
        collector = Collector()
        outbound, inbound = rings

        def on_message() -> None:
            for data in inbound.take():
                collector.feed(data)

        asyncio.get_running_loop().add_reader(inbound.fd, on_message)
        worker_cpu0 = cpu_seconds(proc.pid)
        result.update(await drive(outbound.put, collector, args.frames, args.streams, args.seconds))
        result["worker_cpu_us_per_frame"] = round(
            1e6 * (cpu_seconds(proc.pid) - worker_cpu0) / result["sent"], 1
        )

    run_loop(main())
    proc.terminate()
    for ring in rings:
        ring.shm.close()
        ring.shm.unlink()
    return result


def measure_ray(args) -> dict | None:
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    try:
        import ray
    except ImportError:
        return None
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:

        @ray.remote
        class Echo:
            async def echo(self, data: bytes) -> bytes:
                return data

            def pid(self) -> int:
                return os.getpid()

        actor = Echo.remote()
        pid = ray.get(actor.pid.remote())
        data = wire.audio_message(1, FRAME, 0.0)

        async def main() -> dict:
            rtts = []
            for _ in range(min(args.frames, 1000)):
                t0 = time.monotonic()
                await actor.echo.remote(data)
                rtts.append(time.monotonic() - t0)
            ping = np.array(rtts[50:]) * 1e6
            # load: as many calls in flight as streams would send, paced
            period, sent, pending = 0.080, 0, set()
            cpu0, worker0 = time.process_time(), cpu_seconds(pid)
            start = time.monotonic() + 0.1
            for k in range(int(args.seconds / period)):
                for s in range(args.streams):
                    delay = start + k * period + s * period / args.streams - time.monotonic()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    pending.add(asyncio.ensure_future(actor.echo.remote(data)))
                    sent += 1
            await asyncio.gather(*pending)
            return {
                "pingpong_rtt_us_p50": round(float(np.percentile(ping, 50)), 1),
                "pingpong_rtt_us_p99": round(float(np.percentile(ping, 99)), 1),
                "frontend_cpu_us_per_frame": round(1e6 * (time.process_time() - cpu0) / sent, 1),
                "worker_cpu_us_per_frame": round(1e6 * (cpu_seconds(pid) - worker0) / sent, 1),
                "sent": sent,
            }

        return asyncio.run(main())
    finally:
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--frames", type=int, default=2000)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--no-ray", action="store_true")
    args = parser.parse_args()
    import tempfile

    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        results["unix"] = measure_socket(f"unix:{tmp}/bench.sock", args)
    print(json.dumps({"unix": results["unix"]}))
    results["tcp"] = measure_socket("tcp:127.0.0.1:0".replace(":0", f":{_free_port()}"), args)
    print(json.dumps({"tcp": results["tcp"]}))
    results["shm"] = measure_shm(args)
    print(json.dumps({"shm": results["shm"]}))
    if not args.no_ray:
        results["ray"] = measure_ray(args)
        print(json.dumps({"ray": results["ray"]}))
    results["streams"], results["cpu_count"] = args.streams, os.cpu_count()
    print(json.dumps(results))


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


if __name__ == "__main__":
    main()
