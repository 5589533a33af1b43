"""Playout: one stream's agent audio, from the session's frames to paced media messages.

Two tasks per stream: the frame reader takes each 80 ms session frame the moment the engine
delivers it, converts it to payloads of one message each (20 ms on most carriers, four to a
frame; `AudioFormat.message_ms`) in the stream's outbound format and puts them (and a mark
after each frame) in a bounded outbox; the pacer sends from the outbox at real time,
keeping the carrier's buffer at the playout cushion plus one message (see playback_buffer.py).
An outbox grown past `max_buffered_ms` (the engine ran ahead) loses its oldest audio: latency
stays bounded. The messages themselves are the carrier's (its StreamWire formats them).

Hooks let the call see what goes out without owning any of it: `on_frame` gets every session
frame as it is read (its text piece, its pcm), `on_sent` every payload with the time the carrier
will start playing it (the recording's agent channel is placed there), `on_slip` every drop
(the outbox over its bound) and every silence the caller heard because we were late (the
carrier's buffer ran dry, then the cushion that refilled it): nothing is lost silently.
`meter` times the conversion of each frame (the call's media path, engine/headroom.py) and
hears how late the pacer woke (the loop's gaps as this call lives them, a headroom signal).
`now` is the clock (the loop's on a virtual-time test loop).

Barge-in (`barge_in`, asked for by the stream when the caller starts talking over the agent):
the pacer, the only writer, drops what it still holds and sends the carrier's `clear` before it
sends anything else, so at most the one message already on its way goes out after the request.
Flow control (`pause`): while the carrier asks us to hold off, nothing is sent and the outbox
keeps only the newest `max_buffered_ms`; sending resumes (re-primed) when it says go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
from starlette.websockets import WebSocketDisconnect

from .audio_path import OutboundAudio, silence_chunk
from .carrier import MULAW_8K, AudioFormat, Outgoing, StreamWire
from .link import LinkClosed
from .playback_buffer import CHUNK_S, FrameJitter, MarkTracker, PlaybackClock, percentile

OnFrame = Callable[[Any], None]  # a session OutFrame
OnSent = Callable[[bytes, float], None]  # (payload, monotonic time the carrier starts playing it)
OnSlip = Callable[[bool, str, float], None]  # (dropped, not inserted; reason; seconds of audio)
# An engine frame at least this loud (RMS, dBFS) is the agent talking: while any of it is still
# to be heard, a caller who starts talking barges in.
AUDIBLE_DB = -40.0
_AUDIBLE_MS = 10 ** (AUDIBLE_DB / 10)  # the same as a mean square
# The pacer woke this much later than it meant to: told to the headroom (a loop gap).
WOKE_LATE_S = 0.005


class SendFailed(Exception):
    """The socket went away while we were sending (the receive loop notices it too)."""


class Playout:
    def __init__(
        self,
        send: Callable[[Outgoing], Awaitable[None]],
        *,
        max_queued_ms: float,
        playout_cushion_ms: float,
        max_buffered_ms: float,
        on_frame: OnFrame | None = None,
        on_sent: OnSent | None = None,
        meter: Any = None,
        on_slip: OnSlip | None = None,
        now: Callable[[], float] = time.monotonic,
    ):
        self._send = send
        self._now = now
        self._on_frame = on_frame
        self._on_sent = on_sent
        self._meter = meter  # a MediaMeter (`add(seconds)`), or None
        self._on_slip = on_slip
        self.messages: StreamWire | None = None  # set by `start_stream`
        self.outbound = OutboundAudio()
        self._silence = silence_chunk(MULAW_8K)
        self._limits_ms = (max_queued_ms, playout_cushion_ms, max_buffered_ms)
        self.clock = PlaybackClock(max_queued_s=max_queued_ms / 1000)
        self.marks = MarkTracker()
        self.jitter = FrameJitter()
        # Outbound audio not yet sent: one message's payloads, and mark names (str) after each frame.
        self._outbox: deque[bytes | str] = deque()  # payloads, and mark names (str)
        self._outbox_ready = asyncio.Event()
        self._frames_done = False
        self._outbox_chunks = 0  # payloads (not marks) in the outbox
        self._pace_in(CHUNK_S)
        self.frames_out = 0
        self.out_dropped = 0
        self.dropped_ms = 0.0  # audio dropped from the outbox (over `max_buffered_ms`)
        self.inserted_ms = 0.0  # silence the caller heard mid-call because we came late
        self.max_send_gap_s = 0.0  # longest wait between two of our media messages
        self._last_send = 0.0
        # Which outbox payloads are the agent talking (in outbox order), and how many; when the
        # last one sent of those ends playing at the carrier.
        self._voiced: deque[bool] = deque()
        self._outbox_voiced = 0
        self._voiced_play_end = 0.0
        self._wake = self._outbox_ready  # frames, a barge-in and a resume all wake the pacer
        self._barge = False
        self._barge_asked_at = 0  # frames_out when the barge-in was asked for
        self.barge_ins = 0
        self.barge_dropped = 0  # payloads dropped from the outbox by barge-ins
        self.barge_sent_after = 0  # most payloads that went out between a barge-in's request and its clear
        self._paused = False
        self._paused_at = 0.0
        self.pauses = 0
        self.paused_s = 0.0

    def _pace_in(self, message_s: float) -> None:
        """Cushion, target and limits in whole messages of `message_s` (20 ms on most carriers).
        Messages longer than that get a message of cushion at least, and the carrier may hold
        two of them whatever MAX_QUEUED_MS says: the next must come before this one has played."""
        max_queued_ms, cushion_ms, max_buffered_ms = self._limits_ms
        cushion = round(cushion_ms / 1000 / message_s)
        if message_s > CHUNK_S:
            cushion = max(cushion, 1)
        most = max(round(max_queued_ms / 1000 / message_s), cushion + 1)
        self.clock.message_s = message_s
        self.clock.max_queued_s = most * message_s
        self.clock.target_s = (cushion + 1) * message_s
        self._cushion_chunks = cushion
        self._max_cushion_chunks = most - 1
        self._buffer_limit = max(1, round(max_buffered_ms / 1000 / message_s))

    def start_stream(self, messages: StreamWire, fmt: AudioFormat) -> None:
        """The stream has started: its messages and its outbound format (before any frame)."""
        self.messages = messages
        if fmt != self.outbound.format:
            self.outbound = OutboundAudio(fmt)
            self._silence = silence_chunk(fmt)
            self._pace_in(fmt.message_s)

    # --- the carrier's side --------------------------------------------------------------------
    def mark_echoed(self, name: str) -> None:
        self.marks.echo(name, self.clock.sent_s)

    def cleared(self) -> None:
        """We sent `clear`: the carrier dropped what it held of ours."""
        self.clock.cleared(self._now())
        self.marks.drop_all()
        self._voiced_play_end = 0.0

    def audible(self, now: float) -> bool:
        """The agent's talking is still to be heard: queued at the carrier or in our outbox."""
        return self._outbox_voiced > 0 or now < self._voiced_play_end

    def barge_in(self) -> None:
        """The caller talks over the agent: drop what is not yet heard (done by the pacer)."""
        if not self._barge:
            self._barge = True
            self._barge_asked_at = self.frames_out
            self._wake.set()

    def pause(self, paused: bool) -> None:
        """Flow control: hold off sending (True) or go on (False)."""
        if paused == self._paused:
            return
        now = self._now()
        self._paused = paused
        if paused:
            self.pauses += 1
            self._paused_at = now
        else:
            self.paused_s += now - self._paused_at
            self.clock.started = False  # start again with the cushion; the wait was no underrun
        self._wake.set()

    # --- the two tasks -------------------------------------------------------------------------
    async def run(self, session: Any) -> None:
        """Pace the session's audio out until its frames end. Raises SendFailed when the socket
        goes away under us."""
        reader = asyncio.create_task(self._read_frames(session))
        try:
            await self._pace()
        except (LinkClosed, WebSocketDisconnect, RuntimeError, OSError) as exc:
            raise SendFailed(type(exc).__name__) from exc
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader

    async def _read_frames(self, session: Any) -> None:
        try:
            async for out in session.frames():
                started = time.perf_counter()
                self.jitter.frame(self._now())
                if self._on_frame is not None:
                    self._on_frame(out)
                chunks = self.outbound.convert(out.pcm)
                pcm = np.asarray(out.pcm, np.float32)
                voiced = bool(len(pcm)) and float(np.dot(pcm, pcm)) / len(pcm) >= _AUDIBLE_MS
                self._outbox.extend(chunks)
                self._outbox_chunks += len(chunks)
                self._voiced.extend([voiced] * len(chunks))
                self._outbox_voiced += len(chunks) if voiced else 0
                self._outbox.append(str(out.index))  # a mark after the frame
                while self._outbox_chunks > self._buffer_limit:
                    if isinstance(self._outbox.popleft(), bytes):
                        self._take_voiced()
                        self._outbox_chunks -= 1
                        self.out_dropped += 1
                        self._slip(True, "playout_overflow", self.clock.message_s)
                self._outbox_ready.set()
                if self._meter is not None:
                    self._meter.add(time.perf_counter() - started)
        finally:
            self._frames_done = True
            self._outbox_ready.set()

    def _slip(self, dropped: bool, reason: str, seconds: float) -> None:
        if dropped:
            self.dropped_ms += 1000 * seconds
        else:
            self.inserted_ms += 1000 * seconds
        if self._on_slip is not None:
            self._on_slip(dropped, reason, seconds)

    def _take_voiced(self) -> bool:
        voiced = self._voiced.popleft()
        self._outbox_voiced -= voiced
        return voiced

    async def _pace(self) -> None:
        """A message (20 ms on most carriers) whenever the carrier's buffer has room under the
        target, marks as they come. An empty buffer there is first refilled with the cushion."""
        while True:
            if self._barge:
                await self._flush()
                continue
            if self._paused or not self._outbox:
                if self._frames_done and (self._paused or not self._outbox):
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            item = self._outbox.popleft()
            if isinstance(item, bytes):
                self._outbox_chunks -= 1
                voiced = self._take_voiced()
            else:
                mark = self.messages.mark(item)  # type: ignore[union-attr]
                if mark is not None:  # None: the carrier has no marks
                    await self._send(mark)
                    self.marks.add(item, self.clock.sent_s)
                continue
            now = self._now()
            if self.clock.needs_prime(now):
                if self.clock.started:
                    # The carrier ran dry: this call's engine frames come later than the cushion
                    # covers. Grow it by a message (up to the limit), like a jitter buffer. The
                    # caller heard silence since it ran dry, and hears the new cushion's.
                    self._cushion_chunks = min(self._cushion_chunks + 1, self._max_cushion_chunks)
                    self.clock.target_s = (self._cushion_chunks + 1) * self.clock.message_s
                    gap = max(0.0, now - self.clock.play_end)
                    self._slip(False, "playout_underrun", gap + self._cushion_chunks * self.clock.message_s)
                for _ in range(self._cushion_chunks):
                    await self._send_chunk(self._silence, False)
            await self._send_chunk(item, voiced)

    async def _send_chunk(self, chunk: bytes, voiced: bool) -> None:
        now = self._now()
        wait = self.clock.wait_before_send(now)
        if wait > 0:
            due = now + wait
            await asyncio.sleep(wait)
            now = self._now()
            if now - due > WOKE_LATE_S and self._meter is not None:
                self._meter.woke_late(now - due)
        if self._barge or self._paused:  # asked for while we waited: this one is not sent
            return
        await self._send(self.messages.media(chunk))  # type: ignore[union-attr]
        plays_at = max(now, self.clock.play_end)
        self.clock.sent(now)  # one message of the stream's length (clock.message_s)
        if voiced:
            self._voiced_play_end = self.clock.play_end
        if self._on_sent is not None:
            self._on_sent(chunk, plays_at)
        if self.frames_out:
            self.max_send_gap_s = max(self.max_send_gap_s, now - self._last_send)
        self._last_send = now
        self.frames_out += 1

    async def _flush(self) -> None:
        """The barge-in itself: forget the outbox, clear the carrier, start the next words fresh."""
        self._barge = False
        self.barge_ins += 1
        self.barge_sent_after = max(self.barge_sent_after, self.frames_out - self._barge_asked_at)
        self.barge_dropped += self._outbox_chunks
        self._outbox.clear()
        self._voiced.clear()
        self._outbox_chunks = self._outbox_voiced = 0
        self.outbound.reset()
        message = self.messages.clear()  # type: ignore[union-attr]
        if message is not None:
            await self._send(message)
        self.cleared()
        self.clock.started = False  # the next words start with the cushion: not an underrun

    # --- numbers -------------------------------------------------------------------------------
    def metrics(self) -> dict[str, Any]:
        queued_ms = [q * 1000 for q in self.marks.queued_at_ack_s]
        return {
            "frames_out": self.frames_out,
            "late_frames": self.clock.underruns,
            "max_send_gap_ms": round(self.max_send_gap_s * 1000, 1),
            "outbound_dropped": self.out_dropped,
            "message_ms": round(self.clock.message_s * 1000),
            "playout_cushion_ms": round(self._cushion_chunks * self.clock.message_s * 1000),
            "jitter_p50_ms": round(self.jitter.p50_ms(), 2),
            "jitter_p99_ms": round(self.jitter.p99_ms(), 2),
            "max_queued_ms_model": round(self.clock.max_seen_queue_s * 1000, 1),
            "queued_ms_marks_p50": round(percentile(queued_ms, 50), 1),
            "queued_ms_marks_max": round(max(queued_ms, default=0.0), 1),
            "marks_sent": self.marks.sent,
            "marks_acked": self.marks.acked,
            "barge_ins": self.barge_ins,
            "barge_in_dropped_ms": round(self.barge_dropped * self.clock.message_s * 1000),
            "barge_in_sent_after": self.barge_sent_after,
            "flow_pauses": self.pauses,
            "flow_paused_ms": round(self.paused_s * 1000),
        }
