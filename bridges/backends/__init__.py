"""Where a framework bridge's model runs: in this process or on a personaplex-voice server.

The Pipecat service (`personaplex_pipecat`) and the LiveKit model (`personaplex_livekit`) share
these: `InProcessBackend` (a `SessionManager` in this process, shared with other transports or
built on first use) and `RemoteBackend` (a server's `/api/chat`: Ogg-Opus over a WebSocket,
connect retried with backoff, refusals not). Both speak 24 kHz mono float32 PCM and know only
the session API, the `/api/chat` protocol and `personaplex_voice.audio`, never torch (the
in-process backend builds an engine through the engine factory when asked to).

`EarlyAudio` holds a caller's audio while a session is being opened or reopened, so the
caller's first words reach the model (bounded; what it drops it counts). `CallerSpeech` tells
when the caller starts and stops talking (silero-vad on onnxruntime), for the frameworks'
user-state and turn events.
"""

from __future__ import annotations

from .base import (
    AgentFrame,
    Backend,
    BackendError,
    BackendSession,
    BackendUnavailable,
    SessionLost,
    SessionRefused,
)
from .caller_speech import CallerSpeech, CallerSpeechUnavailable, SpeechEdge
from .early_audio import EarlyAudio
from .inprocess import InProcessBackend, InProcessSession
from .remote import Backoff, RemoteBackend, RemoteSession

__all__ = [
    "AgentFrame",
    "Backend",
    "BackendError",
    "BackendSession",
    "BackendUnavailable",
    "Backoff",
    "CallerSpeech",
    "CallerSpeechUnavailable",
    "EarlyAudio",
    "InProcessBackend",
    "InProcessSession",
    "RemoteBackend",
    "RemoteSession",
    "SessionLost",
    "SessionRefused",
    "SpeechEdge",
]
