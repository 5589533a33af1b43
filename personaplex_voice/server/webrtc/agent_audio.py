"""The agent's audio as an aiortc track: Opus packets made here, paced by the session's clock.

The session hands out one 80 ms frame per engine tick. Each frame becomes four 20 ms Opus
packets (`OpusPacketEncoder`: in-band FEC sized by the loss the peer reports, DTX when the peer
asked for it), and the packets of a frame leave 20 ms apart from the moment the frame arrived,
so the peer's jitter buffer sees the steady 20 ms cadence of a phone rather than a burst every
80 ms. The RTP timestamp of every packet comes from the frame's index in the session (80 ms
each), not from a clock here: a frame the session dropped shows as a gap, and the peer conceals
it. aiortc packs each `av.Packet` the track returns into one RTP packet as it is (no encoder of
its own runs).
"""

from __future__ import annotations

import asyncio
import fractions
import time
from collections import deque
from dataclasses import dataclass

import av
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from personaplex_voice.audio.opus_packets import RTP_CLOCK, OpusPacket

__all__ = ["AgentTrack", "PacedPacket", "PacketPacer"]

_TIME_BASE = fractions.Fraction(1, RTP_CLOCK)


@dataclass(frozen=True)
class PacedPacket:
    pts: int  # RTP clock (48 kHz) from the session's frame index
    data: bytes
    due: float  # monotonic time it may leave


class PacketPacer:
    """FIFO of packets, each due a packet's length after the previous one of its frame.

    Bounded: past `max_packets` the oldest are dropped and counted, and so is a packet found
    more than `max_late_s` past its time when it is taken (the peer connection was not up yet,
    or its sender stalled): stale audio sent in a burst would only teach the peer's jitter
    buffer to wait longer for the rest of the call."""

    def __init__(self, packet_s: float = 0.020, max_packets: int = 25, max_late_s: float = 0.100) -> None:
        self.packet_s = packet_s
        self.max_packets = max_packets
        self.max_late_s = max_late_s
        self._queue: deque[PacedPacket] = deque()
        self.dropped = 0

    def add_frame(self, first_pts: int, packets: list[OpusPacket], arrival: float, rate: int) -> None:
        pts = first_pts
        for k, packet in enumerate(packets):
            if not packet.dtx:  # a DTX frame is silence the peer's decoder fills itself
                self._queue.append(PacedPacket(pts, packet.data, arrival + k * self.packet_s))
            pts += packet.samples * RTP_CLOCK // rate
        while len(self._queue) > self.max_packets:
            self._queue.popleft()
            self.dropped += 1

    def __len__(self) -> int:
        return len(self._queue)

    def next_due(self, now: float | None = None) -> float | None:
        """When the next packet may leave; with `now`, stale packets are dropped first."""
        if now is not None:
            while self._queue and now - self._queue[0].due > self.max_late_s:
                self._queue.popleft()
                self.dropped += 1
        return self._queue[0].due if self._queue else None

    def pop(self) -> PacedPacket:
        return self._queue.popleft()


class AgentTrack(MediaStreamTrack):
    """An audio track whose `recv()` returns the pacer's packets when due (see the module
    docstring). `push_frame` is called by the call for every session frame."""

    kind = "audio"

    def __init__(self, pacer: PacketPacer) -> None:
        super().__init__()
        self.pacer = pacer
        self._more = asyncio.Event()
        self.sent_packets = 0

    def wake(self) -> None:
        self._more.set()

    async def recv(self) -> av.Packet:
        while True:
            if self.readyState != "live":
                raise MediaStreamError
            now = time.monotonic()
            due = self.pacer.next_due(now)
            if due is None:
                self._more.clear()
                await self._more.wait()
                continue
            wait = due - now
            if wait > 0:
                await asyncio.sleep(wait)
                continue  # the queue may have been trimmed meanwhile
            paced = self.pacer.pop()
            packet = av.Packet(paced.data)
            packet.pts = paced.pts
            packet.time_base = _TIME_BASE
            self.sent_packets += 1
            return packet

    def stop(self) -> None:
        super().stop()
        self._more.set()  # a recv() waiting for audio sees the track ended
