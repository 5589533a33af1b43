"""What a framework bridge needs from wherever the model runs: open a session, push, read frames.

Two implementations: `InProcessBackend` (a SessionManager in this process) and `RemoteBackend`
(a personaplex-voice server over `/api/chat`). Both speak 24 kHz mono float32 PCM; resampling to
and from the framework's rates is the bridge's job.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from personaplex_voice.engine.base import Persona


class BackendError(Exception):
    """Base class of what a backend reports to the service."""


class SessionRefused(BackendError):
    """The model side said no: bad persona, no free slot, wrong API key. Retrying will not help.

    `kind` says why, in the server's words: "auth", "origin", "capacity", "queue_full",
    "saturated" (slots are free but the server has no real-time headroom for another call: try
    later or another server), "loading", "persona", "bad_query", ... ("refused" when unknown).
    """

    def __init__(self, message: str, kind: str = "refused"):
        super().__init__(message)
        self.kind = kind


class BackendUnavailable(BackendError):
    """The model side could not be reached (yet): worth retrying with backoff."""


class SessionLost(BackendError):
    """An open session ended without being asked to (connection dropped, server shut down)."""


@dataclass
class AgentFrame:
    """A piece of the agent's output: audio (24 kHz float32), a text piece, or both. `tokens`:
    the frame's text and audio tokens, when the backend sees them (in process, the real model)."""

    pcm: np.ndarray | None = None
    text: str | None = None
    tokens: np.ndarray | None = None


class BackendSession(Protocol):
    """One conversation with the model."""

    @property
    def session_id(self) -> str:
        """The model side's id of the session (the server's, in its logs and `/calls`)."""

    @property
    def description(self) -> str:
        """Who we talk to, for logs (session id, server address)."""

    @property
    def closed(self) -> bool:
        """True once the session has ended (slot freed, socket closed)."""

    def push(self, pcm: np.ndarray) -> None:
        """User audio, float32 mono 24 kHz, any length. Never blocks; overflow is dropped."""

    def frames(self) -> AsyncIterator[AgentFrame]:
        """The agent's output in order. Ends after `close()`; raises `SessionLost` when the
        session ends on its own and `SessionRefused` when the model side ends it with an error."""

    async def close(self) -> None:
        """Ends the conversation and frees its engine slot or socket at once. Idempotent."""


class Backend(Protocol):
    """Where sessions come from. One backend may serve several services (one per call)."""

    @property
    def model_name(self) -> str:
        """The model identity reported in Pipecat metrics."""

    async def prepare(self) -> None:
        """Slow one-time setup (load the model, start the manager). Idempotent."""

    async def open(self, persona: Persona) -> BackendSession:
        """A session whose system prompt is in place, ready for audio.

        Raises `SessionRefused` or `BackendUnavailable`.
        """

    async def aclose(self) -> None:
        """Release what `prepare` built (a manager this backend owns). Idempotent."""
