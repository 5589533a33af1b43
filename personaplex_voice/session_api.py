"""The session API: the one seam between every transport and the engine, declared.

Two hosts implement it: the embedded `personaplex_voice.sessions.SessionManager` (one engine in
this process) and the cluster front-end's `personaplex_voice.cluster.client.ClusterClient`
(sessions on engine workers elsewhere). Transports (`/api/chat`, the phone bridges, Pipecat,
LiveKit, eval) and the server's app type against `SessionHost` and `CallSession` only, and call
them without asking which host they have.

```python
session = await host.open(Persona(text_prompt, voice, sampling, seed))  # CapacityError / PersonaError
await session.ready()            # prompt in (or restored from the persona cache)
session.push(pcm_24k)            # float32 mono, any length, never blocks
async for out in session.frames():   # one OutFrame per 80 ms
    ...
await session.close()            # frees the slot at once; idempotent
ticket = host.reserve(ttl_s=20)  # a slot held for `open(None, ticket=ticket.id)` later
```
See docs/sessions.md.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from personaplex_voice.engine.base import (
    FRAME_SIZE,
    SAMPLE_RATE,
    EngineError,
    Persona,
    SaturatedError,
    VoiceInfo,
)
from personaplex_voice.engine.headroom import Headroom, MediaMeter
from personaplex_voice.engine.scheduler import SessionState, Ticket, TicketError
from personaplex_voice.metrics import LabelledSnapshot

__all__ = [
    "CallSession",
    "Headroom",
    "MediaMeter",
    "OutFrame",
    "SaturatedError",
    "SessionClosed",
    "SessionHost",
    "SessionState",
    "Ticket",
    "TicketError",
    "clock_slips",
    "pushed_samples",
    "slips_warning",
]


class SessionClosed(EngineError):
    """The session ended before it became ready (or was used after it ended)."""

    def __init__(self, reason: str):
        super().__init__(f"session closed ({reason})")
        self.reason = reason


@dataclass(frozen=True)
class OutFrame:
    """One 80 ms frame of agent output.

    `tokens` is int64 [1 + n_audio_codebooks] (text token, then the agent's audio tokens) when
    the engine reports tokens (the real model does; the loopback does not).
    """

    pcm: np.ndarray  # float32 [FRAME_SIZE]
    text: str | None
    index: int  # 0, 1, 2... per session
    tokens: np.ndarray | None = None


def pushed_samples(pcm: np.ndarray) -> np.ndarray:
    """What `push` accepts, as float32 1-D (no copy when it already is): float samples, mono
    (1-D, or 2-D with one channel), finite. Raises ValueError saying what is wrong otherwise."""
    raw = np.asarray(pcm)
    if raw.dtype.kind not in "f":
        raise ValueError(f"push wants float samples in [-1, 1], got {raw.dtype} (scale int16 by 1/32768)")
    x = raw.astype(np.float32, copy=False)
    if x.ndim == 2 and 1 in x.shape:
        x = x.reshape(-1)
    if x.ndim != 1:
        raise ValueError(f"push wants mono samples (1-D), got shape {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError("push got NaN or infinite samples")
    return x


FRAME_MS = 1000 * FRAME_SIZE / SAMPLE_RATE


def clock_slips(counts: Mapping[str, Any]) -> tuple[dict[str, float], dict[str, float]]:
    """A session's audio lost, and silence put in, to keep the frame clock, in ms by reason, from
    its stats counts: (dropped, inserted). Dropped: `jitter_buffer` (late input that arrived after
    all, trimmed), `input_bound` (input beyond the backlog bound), `slow_consumer` (output its
    reader did not take in time); inserted: `late_input` (silence fed for input not there at a
    tick, once the caller's audio resumed after it: the silence after a caller's last audio, who
    hung up, is no slip). Every reason is present, 0 when nothing happened."""
    jitter = int(counts.get("jitter_dropped_frames") or 0)
    bound = max(0, int(counts.get("dropped_input_samples") or 0) - jitter * FRAME_SIZE)
    dropped = {
        "jitter_buffer": jitter * FRAME_MS,
        "input_bound": round(1000 * bound / SAMPLE_RATE, 1),
        "slow_consumer": int(counts.get("dropped_output_frames") or 0) * FRAME_MS,
    }
    late = int(counts.get("late_frames") or 0) - int(counts.get("trailing_late_frames") or 0)
    inserted = {"late_input": max(0, late) * FRAME_MS}
    return dropped, inserted


def slips_warning(dropped: dict[str, float], inserted: dict[str, float]) -> str:
    """'lost N ms of audio (reason N, ...) and had M ms of silence put in (...) to keep the
    frame clock', or "" when neither happened: the one WARNING a call that could not keep a
    clean line logs when it ends."""
    parts = []
    for verb, amounts in (("lost", dropped), ("had", inserted)):
        total = sum(amounts.values())
        if total <= 0:
            continue
        detail = ", ".join(f"{reason} {ms:.0f} ms" for reason, ms in amounts.items() if ms > 0)
        what = "of audio" if verb == "lost" else "of silence put in"
        parts.append(f"{verb} {total:.0f} ms {what} ({detail})")
    if not parts:
        return ""
    return " and ".join(parts) + " to keep the frame clock"


@runtime_checkable
class CallSession(Protocol):
    """One conversation, as every transport uses it (docs/sessions.md has the table)."""

    @property
    def id(self) -> str: ...

    @property
    def persona(self) -> Persona | None:
        """The persona it runs (a ticket's, once the host knows it)."""

    @property
    def state(self) -> SessionState: ...

    @property
    def closed(self) -> bool: ...

    @property
    def ready_now(self) -> bool:
        """True while it is being stepped."""

    @property
    def queue_position(self) -> int | None: ...

    @property
    def close_reason(self) -> str | None: ...

    @property
    def stats(self) -> dict[str, Any]:
        """Counts and timings (docs/sessions.md), `dropped_ms` and `inserted_ms` among them
        (`clock_slips`)."""

    async def ready(self) -> None:
        """Until the prompt is in; raises PersonaError / EngineError / SessionClosed."""

    def push(self, pcm: np.ndarray) -> None:
        """Queue caller audio (float32 mono 24 kHz, any length); never blocks."""

    def end_input(self) -> None:
        """No more audio: the session closes ("input_ended") once what was pushed is stepped."""

    def frames(self) -> AsyncIterator[OutFrame]:
        """Output frames as they are made; ends once the session ended and all were taken."""

    def expect_input_pieces(self, seconds: float) -> None:
        """The caller's audio comes in pieces of about `seconds` (longer than a frame: a carrier's
        100 ms messages); call before the first push. What such pieces leave queued between ticks
        is their own cushion, neither caught up as a start burst nor trimmed."""

    def seconds_to_next_tick(self) -> float | None:
        """When the engine next takes an input frame (None while its clock is idle)."""

    async def close(self, reason: str = "client") -> None: ...

    def close_nowait(self, reason: str = "client") -> None:
        """`close` from synchronous code, on any thread."""


@runtime_checkable
class SessionHost(Protocol):
    """What owns the sessions of a process: admission, queueing, reservations, readiness."""

    @property
    def realtime(self) -> bool:
        """Sessions are stepped on an 80 ms clock (servers), not as fast as input comes."""

    @property
    def model_name(self) -> str:
        """The engine's model identity (a local path on a server: see server/info.py)."""

    @property
    def capacity(self) -> int: ...

    @property
    def active_count(self) -> int: ...

    @property
    def queued_count(self) -> int: ...

    @property
    def reserved_count(self) -> int: ...

    @property
    def available(self) -> int:
        """Slots an open without a ticket would get now (what /readyz reports; 0 while the
        process has no real-time headroom left)."""

    @property
    def headroom(self) -> Headroom:
        """This process's real-time headroom: transports time their media path on it
        (`headroom.meter()`), the server runs its loop monitor into it."""

    @property
    def sessions(self) -> Sequence[CallSession]:
        """Every session not yet closed."""

    def voices(self) -> list[VoiceInfo]: ...

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    async def open(self, persona: Persona | None = None, *, ticket: str | None = None) -> CallSession:
        """Raises PersonaError, CapacityError (`SaturatedError` when slots are free but the
        process has no headroom left; a ticket's open is never refused for that), TicketError."""

    def reserve(self, ttl_s: float = 20.0, persona: Persona | None = None) -> Ticket:
        """A slot for a later `open(None, ticket=...)`; raises CapacityError (SaturatedError)."""

    def cancel(self, ticket_id: str) -> bool: ...

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """(a new open without a ticket would start now, the body /readyz answers with: its
        `status` is `ready`, `full`, `saturated`, `loading` or `draining`)."""

    def describe(self) -> dict[str, Any]:
        """Where sessions run: the body of /api/cluster."""

    def metrics_snapshots(self) -> list[LabelledSnapshot]:
        """Every instrument of the host, as snapshots with their labels (server/metrics.py
        turns them into Prometheus series)."""


def occupancy(host: SessionHost) -> dict[str, int]:
    """The counts /healthz, /readyz and /api/cluster show."""
    return {
        "active": host.active_count,
        "queued": host.queued_count,
        "reserved": host.reserved_count,
        "available": host.available,
        "capacity": host.capacity,
    }
