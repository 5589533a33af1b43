"""PersonaPlex for LiveKit Agents: a `DuplexModel`, in process or on a personaplex-voice server.

    from personaplex_livekit import DuplexModel
    session = AgentSession(llm=DuplexModel(url="ws://gpu-host:8998/api/chat", voice="NATF2"))

See docs/livekit.md. Needs the `livekit` extra: `pip install "personaplex-voice[livekit]"`.
"""

from __future__ import annotations

from personaplex_backends import Backoff, InProcessBackend, RemoteBackend

from .model import DuplexModel, chat_url
from .session import AgentFrameEvent, DuplexSession
from .tool_rules import DEFAULT_TOOL_NAMES, ToolRules

__all__ = [
    "DEFAULT_TOOL_NAMES",
    "AgentFrameEvent",
    "Backoff",
    "DuplexModel",
    "DuplexSession",
    "InProcessBackend",
    "RemoteBackend",
    "ToolRules",
    "chat_url",
]
