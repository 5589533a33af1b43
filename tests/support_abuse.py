"""Hostile /api/chat clients and server-process readings, for tests/test_server_abuse.py and
bench/abuse.py.

    bomb_message()            one 256 KiB message: Ogg pages of 255 two-byte Opus packets, each
                              120 ms of audio (~10,000 s in all; 1 GB once decoded)
    reject_flood_message()    the same size of pages whose packets libopus rejects
    await attack(url, msgs)   sends them on one connection; says whether and how it was refused
    process_rss_bytes(pid)   from /proc (CPU time: personaplex_voice.cluster.procs.cpu_seconds)
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

from personaplex_voice.audio.opus import OggOpusWriter, ogg_crc

MESSAGE_BYTES = 256 * 1024  # the server's default message limit, kind byte included
SERIAL = 0x0B0B
# A code-3 Opus packet (TOC config 11: SILK wideband 60 ms frames) announcing 2 frames of 0 bytes:
# valid, 120 ms of concealment audio from two bytes. With a count of 0 frames libopus rejects it.
PACKET_120MS = bytes([11 << 3 | 3, 2])
PACKET_REJECTED = bytes([11 << 3 | 3, 0])


def ogg_page(
    packets: list[bytes], seq: int, *, serial: int = SERIAL, flags: int = 0, granule: int = 0
) -> bytes:
    """One page with whole packets, its CRC right."""
    lacing = b"".join(bytes([255] * (len(p) // 255) + [len(p) % 255]) for p in packets)
    page = bytearray(struct.pack("<4sBBqIIIB", b"OggS", 0, flags, granule, serial, seq, 0, len(lacing)))
    page += lacing + b"".join(packets)
    struct.pack_into("<I", page, 22, ogg_crc(bytes(page)))
    return bytes(page)


def opus_headers(serial: int = SERIAL) -> bytes:
    return OggOpusWriter(serial=serial).headers()


def _pages_message(packet: bytes, *, headers: bool, first_seq: int, size: int) -> tuple[bytes, int]:
    body = bytearray(b"\x01")
    if headers:
        body += opus_headers()
    seq = first_seq
    page = ogg_page([packet] * 255, seq)
    while len(body) + len(page) <= size:
        body += page
        seq += 1
        page = ogg_page([packet] * 255, seq)
    return bytes(body), seq


def bomb_message(size: int = MESSAGE_BYTES) -> bytes:
    return _pages_message(PACKET_120MS, headers=True, first_seq=2, size=size)[0]


def reject_flood_messages(count: int, size: int = MESSAGE_BYTES) -> list[bytes]:
    """`count` messages for one connection (headers in the first), every packet rejected."""
    messages, seq = [], 2
    for i in range(count):
        message, seq = _pages_message(PACKET_REJECTED, headers=i == 0, first_seq=seq, size=size)
        messages.append(message)
    return messages


@dataclass
class AttackResult:
    errors: list[str] = field(default_factory=list)  # 0x05 texts
    closed: bool = False
    sent: int = 0  # messages sent before the server closed
    seconds: float = 0.0

    @property
    def refused(self) -> bool:
        return self.closed and bool(self.errors)


async def attack(url: str, messages: list[bytes], *, timeout: float = 20.0) -> AttackResult:
    """Connect, send `messages` as fast as the socket takes them, and read until the server closes
    (or `timeout`). Does not wait for the handshake: audio before it is decoded too."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    result = AttackResult()
    started = time.monotonic()
    async with connect(url, compression=None, proxy=None, max_size=None, open_timeout=30) as ws:

        async def read() -> None:
            with contextlib.suppress(ConnectionClosed):
                async for message in ws:
                    if isinstance(message, bytes) and message[:1] == b"\x05":
                        result.errors.append(message[1:].decode())
            result.closed = True

        reader = asyncio.create_task(read())
        with contextlib.suppress(ConnectionClosed):
            for message in messages:
                if reader.done():
                    break
                await ws.send(message)
                result.sent += 1
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(reader), timeout)
        if not reader.done():
            reader.cancel()
    result.seconds = time.monotonic() - started
    return result


async def abrupt_disconnect(url: str) -> None:
    """Connects, waits for the first server message, and drops the TCP connection (no close)."""
    from websockets.asyncio.client import connect

    async with connect(url, compression=None, proxy=None, max_size=None, open_timeout=30) as ws:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(ws.recv(), 10)
        ws.transport.abort()


def process_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def frame_gaps(arrivals: list[tuple[float, int]], until: float | None = None) -> list[float]:
    """Seconds between consecutive audio messages received (up to monotonic time `until`)."""
    times = [t for t, _ in arrivals if until is None or t <= until]
    return [b - a for a, b in itertools.pairwise(times)]
