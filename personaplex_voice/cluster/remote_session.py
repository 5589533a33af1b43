"""`RemoteSession`: one conversation on an engine worker, with the `Session` API of sessions.py.

Made and placed by `ClusterClient.open`; it frames pushed audio into 1920-sample frames and
sends them over its worker's `WorkerLink` as they complete, and takes the worker's answers
(opened, ready, frames, closed, refused, the link lost) from that link. Output frames wait in a
bounded queue (a slow consumer loses its own oldest, in real time). Called from the front-end's
event loop, except `close_nowait`, which may be called from any thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import numpy as np

from personaplex_voice.audio.framing import FrameBuffer
from personaplex_voice.cluster import wire
from personaplex_voice.cluster.wire import Kind
from personaplex_voice.engine.base import (
    FRAME_SIZE,
    SAMPLE_RATE,
    CapacityError,
    EngineError,
    Persona,
    PersonaError,
)
from personaplex_voice.sessions import OutFrame, SessionClosed, TicketError, pushed_samples

if TYPE_CHECKING:
    from personaplex_voice.cluster.client import ClusterClient
    from personaplex_voice.cluster.worker_link import WorkerLink


ENGINE_LOST = "engine_lost"


# -- the session ---------------------------------------------------------------------------------

QUEUED, PLACING, JOINING, RUNNING, CLOSED = "queued", "placing", "joining", "running", "closed"


class RemoteSession:
    """One conversation on an engine worker, with the `Session` API (see sessions.py)."""

    def __init__(self, client: ClusterClient, persona: Persona | None):
        self.id = uuid.uuid4().hex[:16]
        self.persona = persona  # None until the worker says which (a ticket's persona)
        self.queue_position: int | None = None
        self.close_reason: str | None = None
        self.worker_id: str | None = None
        self._client = client
        self._state = QUEUED
        self._link: WorkerLink | None = None
        self._channel = 0
        self._open_future: asyncio.Future[None] | None = None
        self._error: BaseException | None = None
        self._was_ready = False
        self._input = FrameBuffer(FRAME_SIZE, max_samples=client.max_input_samples)
        self._input_ended = False
        self._end_sent = False
        self._out: deque[OutFrame] = deque()
        self._waiters: list[asyncio.Future[None]] = []
        self._opened_at = time.monotonic()
        self._worker_stats: dict[str, Any] = {}
        self._counts = {
            "frames_in": 0,
            "frames_out": 0,
            "dropped_output_frames": 0,
            "dropped_input_samples": 0,
            "dropped_pre_ready_samples": 0,
        }

    # ---- the Session API ----------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._state == CLOSED

    @property
    def ready_now(self) -> bool:
        return self._state == RUNNING

    @property
    def slot(self) -> None:
        return None  # slots are the worker's business

    @property
    def stats(self) -> dict[str, Any]:
        """The `Session.stats` keys: this side's counts (frames that crossed, drops here) over the
        worker's (its READY, then its final stats once the session ended), plus `worker`."""
        worker = self._worker_stats
        local = dict(self._counts)
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
            "state": self._state,
            "slot": None,
            "worker": self.worker_id,
            "queue_position": self.queue_position,
            "close_reason": self.close_reason,
            "input_backlog_samples": len(self._input),
            "output_queued_frames": len(self._out),
            "duration_s": local["frames_out"] * FRAME_SIZE / SAMPLE_RATE,
        }

    async def ready(self) -> None:
        """Until the worker runs the session; raises PersonaError / SessionClosed as `Session`."""
        while True:
            if self._was_ready:
                return
            if self._state == CLOSED:
                if self._error is not None:
                    raise self._error
                raise SessionClosed(self.close_reason or "closed")
            await self._wait()

    def push(self, pcm: np.ndarray) -> None:
        """As `Session.push`: whole frames go to the worker as they complete. Audio pushed
        before the worker holds the session (queued, being placed) waits here, up to the input
        bound, and goes in order once it does (the worker's session keeps it until ready)."""
        x = pushed_samples(pcm)
        if self._state == CLOSED or self._input_ended:
            return
        dropped = self._input.push(x)
        if dropped:
            self._counts["dropped_input_samples"] += dropped
            if self._state != RUNNING:
                self._counts["dropped_pre_ready_samples"] += dropped
        self._send_input()

    def end_input(self) -> None:
        """As `Session.end_input`: the padded last frame, then END_INPUT."""
        if self._input_ended or self._state == CLOSED:
            return
        self._input_ended = True
        self._send_input()

    async def frames(self) -> AsyncIterator[OutFrame]:
        """Output frames as they arrive; ends once the session ended and every frame was taken."""
        while True:
            if self._out:
                frame = self._out.popleft()
                if self._link is not None and self._lossless:
                    self._link.send(wire.credit_message(self._channel, 1))
                yield frame
            elif self._state == CLOSED:
                return
            else:
                await self._wait()

    def seconds_to_next_tick(self) -> float | None:
        """How long until the worker's engine next takes an input frame (from its last report,
        projected on its frame period); None while its clock is idle or unknown."""
        link = self._link
        return None if link is None else link.seconds_to_next_tick()

    async def close(self, reason: str = "client") -> None:
        self._close(reason, None, tell_worker=True)

    def close_nowait(self, reason: str = "client") -> None:
        self._client._call_in_loop(self._close, reason, None, True)

    def __repr__(self) -> str:
        return f"<RemoteSession {self.id} {self._state} worker={self.worker_id}>"

    # ---- plumbing ------------------------------------------------------------------------------

    @property
    def _lossless(self) -> bool:
        return bool(self._link is not None and self._link.info.get("lossless"))

    async def _wait(self) -> None:
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        await fut

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def _send_input(self) -> None:
        """Whole frames go to the worker once it holds the session; the end of input (padded
        by the worker's session) after them."""
        link = self._link
        if link is None or self._state not in (JOINING, RUNNING):
            return
        now = time.monotonic()
        while (frame := self._input.pop()) is not None:
            link.send(wire.audio_message(self._channel, frame, now))
            self._counts["frames_in"] += 1
        if self._input_ended and not self._end_sent:
            last = self._input.pop_padded()  # the worker would pad it the same way
            if last is not None:
                link.send(wire.audio_message(self._channel, last, now))
                self._counts["frames_in"] += 1
            link.send(wire.message(Kind.END_INPUT, self._channel))
            self._end_sent = True

    def _close(self, reason: str, error: BaseException | None, tell_worker: bool) -> None:
        if self._state == CLOSED:
            return
        previous = self._state
        self._state = CLOSED
        self.close_reason = reason
        self._error = error
        self._input.clear()
        link = self._link
        if link is not None and tell_worker and previous in (PLACING, JOINING, RUNNING):
            link.send(wire.message(Kind.CLOSE, self._channel, reason[:80].encode()))
            link.freed_since_status += 1
        if link is not None and not tell_worker:
            link.channels.pop(self._channel, None)
        if self._open_future is not None and not self._open_future.done():
            self._open_future.set_exception(error or SessionClosed(reason))
            self._open_future.exception()  # retrieved: the opener may be gone
        self._client._session_closed(self, previous, reason)
        self._wake()

    # ---- what the worker says (the link calls these) ------------------------------------------

    def _on_opened(self, answer: dict[str, Any]) -> None:
        if self._state != PLACING:
            return
        if self.persona is None:
            with contextlib.suppress(PersonaError):
                self.persona = wire.persona_from_json(answer.get("persona"))
        self._state = JOINING
        if self._open_future is not None and not self._open_future.done():
            self._open_future.set_result(None)
        self._send_input()

    def _on_ready(self, answer: dict[str, Any]) -> None:
        if self._state not in (JOINING, PLACING):
            return
        self._worker_stats.update({k: answer.get(k) for k in ("cache_hit", "prefill_ms", "queue_wait_ms")})
        self._state = RUNNING
        self._was_ready = True
        self._send_input()
        self._wake()

    def _on_frame(self, frame: OutFrame) -> None:
        if self._state == CLOSED:
            return
        limit = self._client.output_frames
        if not self._lossless:
            while len(self._out) >= limit:
                self._out.popleft()
                self._counts["dropped_output_frames"] += 1
        self._out.append(frame)
        self._counts["frames_out"] += 1
        if self._waiters:
            self._wake()

    def _on_closed(self, answer: dict[str, Any]) -> None:
        stats = answer.get("stats")
        if isinstance(stats, dict):
            self._worker_stats.update(stats)
        reason = str(answer.get("reason") or "closed")
        error: BaseException | None = None
        if answer.get("error") == "persona":
            error = PersonaError(str(answer.get("message") or "the persona was refused"))
        elif answer.get("error"):
            error = SessionClosed(reason)
        self._close(reason, error, tell_worker=False)

    def _on_refused(self, error: BaseException) -> None:
        """The worker would not take the session: back to the caller (or the queue)."""
        if self._link is not None:
            self._link.channels.pop(self._channel, None)
        self._link, self._channel, self.worker_id = None, 0, None
        if self._state == PLACING:
            self._state = QUEUED
        if self._open_future is not None and not self._open_future.done():
            self._open_future.set_exception(error)

    def _on_engine_lost(self) -> None:
        if self._state in (PLACING,) and self._open_future is not None and not self._open_future.done():
            self._on_refused(CapacityError("the engine worker went away", retry_after_s=1.0))
            return
        self._close(ENGINE_LOST, SessionClosed(ENGINE_LOST), tell_worker=False)


# -- one engine worker ----------------------------------------------------------------------------


def refusal_error(answer: dict[str, Any]) -> EngineError:
    kind, message = answer.get("kind"), str(answer.get("message") or "refused")
    retry = answer.get("retry_after_s")
    if kind == "persona":
        return PersonaError(message)
    if kind == "ticket":
        return TicketError(message, retry_after_s=retry)
    if kind == "capacity":
        return CapacityError(message, retry_after_s=retry)
    return EngineError(message)
