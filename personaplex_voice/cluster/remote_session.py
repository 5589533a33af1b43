"""`RemoteSession`: one conversation on an engine worker, a `session_api.CallSession`.

Made by `ClusterClient.open`, which queues and places it; once placed it holds a `WorkerChannel`
(its send side on the worker's link) and hears the worker's answers on that channel
(`worker_opened`, `worker_ready`, `worker_frame`, `worker_closed`, `worker_refused`,
`worker_lost`). It frames pushed audio into 1920-sample frames and sends them as they complete;
output frames wait in a bounded queue (a slow consumer loses its own oldest, in real time).
Its state is a `SessionRecord` like an embedded session's. Called from the front-end's event
loop, except `close_nowait`, which may be called from any thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from personaplex_voice.audio.framing import FrameBuffer
from personaplex_voice.cluster import wire
from personaplex_voice.cluster.worker_link import WorkerChannel
from personaplex_voice.engine.base import (
    FRAME_SIZE,
    SAMPLE_RATE,
    CapacityError,
    EngineError,
    Persona,
    PersonaError,
)
from personaplex_voice.engine.scheduler import RecordReadout, SessionRecord, SessionState
from personaplex_voice.session_api import OutFrame, SessionClosed, clock_slips, pushed_samples

ENGINE_LOST = "engine_lost"


@dataclass(frozen=True)
class RemoteSessionConfig:
    """What a remote session needs of its host's settings."""

    realtime: bool  # the workers tick on an 80 ms clock (the host's `realtime`)
    output_frames: int  # output queue bound
    max_input_samples: int  # input backlog bound


class RemoteSession(RecordReadout):
    """One conversation on an engine worker (see the module docstring)."""

    def __init__(
        self,
        config: RemoteSessionConfig,
        persona: Persona | None,
        *,
        loop: asyncio.AbstractEventLoop,
        on_end: Callable[[RemoteSession, SessionState], None],
        on_drop: Callable[[str, float], None] | None = None,
    ):
        self.id = uuid.uuid4().hex[:16]
        self.persona = persona  # None until the worker says which (a ticket's persona)
        self._config = config
        self._loop = loop
        self._loop_thread = threading.get_ident()
        self._on_end = on_end
        self._on_drop = on_drop  # (reason, seconds) of audio dropped here (metrics)
        self._record = SessionRecord(self.id, time.monotonic())
        self._channel: WorkerChannel | None = None  # kept after the session ended (its worker id)
        self._opened: asyncio.Future[None] | None = None
        self._input = FrameBuffer(FRAME_SIZE, max_samples=config.max_input_samples)
        self._input_ended = False
        self._end_sent = False
        self._pieces = 0  # samples of the pieces the input comes in (expect_input_pieces); 0: frames
        self._pieces_sent = False
        self._out: deque[OutFrame] = deque()
        self._waiters: list[asyncio.Future[None]] = []
        self._worker_stats: dict[str, Any] = {}
        self._counts = {
            "frames_in": 0,
            "frames_out": 0,
            "dropped_output_frames": 0,
            "dropped_input_samples": 0,
            "dropped_pre_ready_samples": 0,
        }

    # ---- state ---------------------------------------------------------------------------------

    @property
    def record(self) -> SessionRecord:
        return self._record

    @property
    def worker_id(self) -> str | None:
        return None if self._channel is None else self._channel.worker_id

    @property
    def slot(self) -> None:
        return None  # slots are the worker's business

    @property
    def stats(self) -> dict[str, Any]:
        """The embedded session's `stats` keys: this side's counts (frames that crossed, drops
        here) over the worker's (its READY, then its final stats once the session ended), plus
        `worker`."""
        worker = self._worker_stats
        local = dict(self._counts)
        counts = {
            **worker,
            **local,
            "dropped_output_frames": local["dropped_output_frames"]
            + int(worker.get("dropped_output_frames") or 0),
            "dropped_input_samples": local["dropped_input_samples"]
            + int(worker.get("dropped_input_samples") or 0),
        }
        dropped, inserted = clock_slips(counts)
        return {
            "late_frames": 0,
            "lead_in_frames": 0,
            "jitter_dropped_frames": 0,
            "cache_hit": None,
            "prefill_ms": None,
            "queue_wait_ms": None,
            **{k: v for k, v in worker.items() if k not in ("id", "state", "slot", "queue_position")},
            **local,
            "dropped_output_frames": local["dropped_output_frames"]
            + int(worker.get("dropped_output_frames") or 0),
            "id": self.id,
            "state": self.state.value,
            "slot": None,
            "worker": self.worker_id,
            "queue_position": self.queue_position,
            "close_reason": self.close_reason,
            "input_backlog_samples": len(self._input),
            "output_queued_frames": len(self._out),
            "duration_s": local["frames_out"] * FRAME_SIZE / SAMPLE_RATE,
            "dropped_ms": dropped,
            "inserted_ms": inserted,
        }

    # ---- the CallSession API -----------------------------------------------------------------------

    async def ready(self) -> None:
        """Until the worker runs the session; raises PersonaError / SessionClosed as `Session`."""
        record = self._record
        while not record.was_ready:
            if record.closed:
                if record.error is not None:
                    raise record.error
                raise SessionClosed(record.close_reason or "closed")
            await self._wait()

    def push(self, pcm: np.ndarray) -> None:
        """As `Session.push`: whole frames go to the worker as they complete. Audio pushed
        before the worker holds the session (queued, being placed) waits here, up to the input
        bound, and goes in order once it does (the worker's session keeps it until ready)."""
        x = pushed_samples(pcm)
        if self.closed or self._input_ended:
            return
        dropped = self._input.push(x)
        if dropped:
            self._counts["dropped_input_samples"] += dropped
            if not self.ready_now:
                self._counts["dropped_pre_ready_samples"] += dropped
            if self._on_drop is not None:
                self._on_drop("input_bound", dropped / SAMPLE_RATE)
        self._send_input()

    def expect_input_pieces(self, seconds: float) -> None:
        """As `Session.expect_input_pieces`: told to the worker's session before any input."""
        self._pieces = round(max(0.0, seconds) * SAMPLE_RATE)
        self._pieces_sent = False
        self._send_input()

    def end_input(self) -> None:
        """As `Session.end_input`: the padded last frame, then END_INPUT."""
        if self._input_ended or self.closed:
            return
        self._input_ended = True
        self._send_input()

    async def frames(self) -> AsyncIterator[OutFrame]:
        """Output frames as they arrive; ends once the session ended and every frame was taken."""
        while True:
            if self._out:
                frame = self._out.popleft()
                channel = self._channel
                if channel is not None and channel.lossless:
                    channel.send_credit(1)
                yield frame
            elif self.closed:
                return
            else:
                await self._wait()

    def seconds_to_next_tick(self) -> float | None:
        """How long until the worker's engine next takes an input frame (from its last report,
        projected on its frame period); None while its clock is idle or unknown."""
        return None if self._channel is None else self._channel.seconds_to_next_tick()

    async def close(self, reason: str = "client") -> None:
        self.end(reason, None, tell_worker=True)

    def close_nowait(self, reason: str = "client") -> None:
        if threading.get_ident() == self._loop_thread:
            self.end(reason, None, tell_worker=True)
        else:
            self._loop.call_soon_threadsafe(self.end, reason, None, True)

    def __repr__(self) -> str:
        return f"<RemoteSession {self.id} {self.state.value} worker={self.worker_id}>"

    # ---- the host's side: queueing, placing, ending ---------------------------------------------

    def placing(self, channel: WorkerChannel) -> asyncio.Future[None]:
        """The host sent OPEN on `channel`; the future resolves once the worker took the session
        (or fails with its refusal)."""
        self._channel = channel
        self._record.mark_placing()
        self._opened = self._loop.create_future()
        return self._opened

    def end(self, reason: str, error: BaseException | None, tell_worker: bool) -> None:
        """End the session here (idempotent); `tell_worker` sends CLOSE when the worker holds it."""
        record = self._record
        previous = record.state
        if not record.mark_closed(reason, error):
            return
        self._input.clear()
        channel = self._channel
        if channel is not None:
            if tell_worker and previous in (SessionState.PLACING, SessionState.JOINING, SessionState.RUNNING):
                channel.close(reason)
            else:
                channel.forget()
        if self._opened is not None and not self._opened.done():
            self._opened.set_exception(error or SessionClosed(reason))
            self._opened.exception()  # retrieved: the opener may be gone
        self._on_end(self, previous)
        self._wake()

    # ---- what the worker says (the link calls these: `worker_link.ChannelListener`) -----------------

    def worker_opened(self, answer: dict[str, Any]) -> None:
        if self.state is not SessionState.PLACING:
            return
        if self.persona is None:
            with contextlib.suppress(PersonaError):
                self.persona = wire.persona_from_json(answer.get("persona"))
        self._record.mark_joining(None, time.monotonic() - self._record.opened_at)
        if self._opened is not None and not self._opened.done():
            self._opened.set_result(None)
        self._send_input()
        self._wake()

    def worker_ready(self, answer: dict[str, Any]) -> None:
        if self.state not in (SessionState.JOINING, SessionState.PLACING):
            return
        self._worker_stats.update({k: answer.get(k) for k in ("cache_hit", "prefill_ms", "queue_wait_ms")})
        self._record.mark_running(time.monotonic(), None, answer.get("cache_hit"))
        self._send_input()
        self._wake()

    def worker_frame(self, frame: OutFrame) -> None:
        if self.closed:
            return
        channel = self._channel
        if channel is None or not channel.lossless:
            while len(self._out) >= self._config.output_frames:
                self._out.popleft()
                self._counts["dropped_output_frames"] += 1
                if self._on_drop is not None:
                    self._on_drop("slow_consumer", FRAME_SIZE / SAMPLE_RATE)
        self._out.append(frame)
        self._counts["frames_out"] += 1
        if self._waiters:
            self._wake()

    def worker_closed(self, answer: dict[str, Any]) -> None:
        stats = answer.get("stats")
        if isinstance(stats, dict):
            self._worker_stats.update(stats)
        reason = str(answer.get("reason") or "closed")
        error: BaseException | None = None
        if answer.get("error") == "persona":
            error = PersonaError(str(answer.get("message") or "the persona was refused"))
        elif answer.get("error"):
            error = SessionClosed(reason)
        self.end(reason, error, tell_worker=False)

    def worker_refused(self, error: EngineError) -> None:
        """The worker would not take the session: back to the opener (or the queue)."""
        self._channel = None
        self._record.mark_unplaced()
        if self._opened is not None and not self._opened.done():
            self._opened.set_exception(error)

    def worker_lost(self) -> None:
        if self.state is SessionState.PLACING and self._opened is not None and not self._opened.done():
            self.worker_refused(CapacityError("the engine worker went away", retry_after_s=1.0))
            return
        self.end(ENGINE_LOST, SessionClosed(ENGINE_LOST), tell_worker=False)

    # ---- plumbing ------------------------------------------------------------------------------------

    async def _wait(self) -> None:
        fut = self._loop.create_future()
        self._waiters.append(fut)
        await fut

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def _send_input(self) -> None:
        """Whole frames go to the worker once it holds the session; the end of input (padded as
        the worker's session would pad it) after them."""
        channel = self._channel
        if channel is None or self.state not in (SessionState.JOINING, SessionState.RUNNING):
            return
        if self._pieces and not self._pieces_sent:
            channel.send_pieces(self._pieces)  # before the first frame: the worker's first tick knows
            self._pieces_sent = True
        now = time.monotonic()
        while (frame := self._input.pop()) is not None:
            channel.send_audio(frame, now)
            self._counts["frames_in"] += 1
        if self._input_ended and not self._end_sent:
            last = self._input.pop_padded()
            if last is not None:
                channel.send_audio(last, now)
                self._counts["frames_in"] += 1
            channel.send_end_input()
            self._end_sent = True
