"""PersonaPlex for Pipecat: a realtime speech-to-speech service, in-process or remote.

    from personaplex_pipecat import PersonaPlexLLMService
    llm = PersonaPlexLLMService(url="ws://localhost:8998/api/chat", text_prompt="You are ...")
    pipeline = Pipeline([transport.input(), llm, transport.output()])

See docs/pipecat.md. Needs the `pipecat` extra: `pip install "personaplex-voice[pipecat]"`.
"""

from __future__ import annotations

# Where the model runs is shared with the LiveKit bridge (bridges/backends/).
from personaplex_backends import (
    AgentFrame,
    Backend,
    BackendError,
    BackendSession,
    BackendUnavailable,
    Backoff,
    InProcessBackend,
    RemoteBackend,
    SessionLost,
    SessionRefused,
)

from .service import PersonaPlexLLMService, PersonaPlexLLMSettings

__all__ = [
    "AgentFrame",
    "Backend",
    "BackendError",
    "BackendSession",
    "BackendUnavailable",
    "Backoff",
    "InProcessBackend",
    "PersonaPlexLLMService",
    "PersonaPlexLLMSettings",
    "RemoteBackend",
    "SessionLost",
    "SessionRefused",
]
