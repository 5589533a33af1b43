"""`DuplexModel`: PersonaPlex as a LiveKit Agents duplex model, in process or on a server.

    from personaplex_livekit import DuplexModel

    session = AgentSession(llm=DuplexModel(url="ws://gpu-host:8998/api/chat", voice="NATF2"))
    await session.start(agent=Agent(instructions="You work for CitySan Services..."), room=ctx.room)

LiveKit wraps it in `DuplexRealtimeAdapter` itself (an `AgentSession` or `Agent` given a
`DuplexModel` does), which presents it to the framework as a realtime model that takes turns by
itself: no VAD cuts it, interruptions are its own, its output is segmented into generations by
the sound. The agent's `instructions` are the persona's text prompt; voice, sampling and seed
are the model's; the persona's action rules call the app's tools (tool_rules.py).

Where the model runs is a `personaplex_backends` backend, one per `DuplexModel`, shared by its
sessions: a server's `/api/chat` (`url`), a `SessionManager` in this process (`manager`), or a
model built in this process on first use (`model`).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from personaplex_backends import Backend, Backoff, InProcessBackend, RemoteBackend
from personaplex_backends.caller_speech import load_model as load_caller_vad

from livekit.agents import llm
from personaplex_voice.engine.base import Sampling

from .session import DuplexSession
from .tool_rules import ToolRules

URL_ENV = "PERSONAPLEX_URL"  # the server when no backend is given (LiveKit's NVIDIA plugin reads it too)
API_KEY_ENV = "PERSONAPLEX_API_KEY"
GATE_ACTIVATION_RATIO = 3.0  # llm.FixedGate opens at its silence level times this (its default)


class DuplexModel(llm.DuplexModel):
    """NVIDIA PersonaPlex for LiveKit Agents (see the module docstring and docs/livekit.md).

    Where it runs, one of:
      `url`: a personaplex-voice server, `ws[s]://host:port` or `.../api/chat` (default: the
        `PERSONAPLEX_URL` environment variable); `api_key` (default `PERSONAPLEX_API_KEY`);
      `backend`: a `personaplex_backends` backend you built (shared, you close it);
      `manager`: a running `SessionManager` in this process (shared with other transports);
      `model`: a model to load in this process on first use ("demo", a model dir, a hub id),
        `engine_options` going to `InProcessBackend` (`device="cuda"`, `num_slots=4`, ...).
    The persona:
      `voice`: a voice prompt name known to the model ("NATF2"); None = the model's default.
      `instructions`: the persona's text prompt when the agent's instructions are empty; the
        agent's own, when it gives any, win (and an `update_instructions("")` goes back to these).
      `sampling`, `seed`: `personaplex_voice.engine.base.Sampling` and the sampling seed
        (None = a new one per session).
      `actions`: the persona's action rules (the `actions` list of a personas file; the
        `on_agent_text` ones fire tools), `tool_names`: which tool each kind of action calls
        (default: transfer -> "transfer_call", hangup -> "end_call").
    `speech_threshold_db`: output at or above this RMS level (dBFS) is the agent speaking
      (LiveKit's adapter makes a generation of each stretch of it); the Pipecat service's level.
    `backoff`: reopening a lost session and retrying a full server (`Backoff(attempts=5,
    initial_s=0.5, max_s=8)`); the remote backend's connection retries use it too.
    `caller_vad`: watch the caller's audio with silero-vad and report `input_speech_started` /
      `input_speech_stopped`, from which LiveKit's default session takes the caller's
      `user_state` (False: no caller events; the caller is then "away" after LiveKit's
      `user_away_timeout` of agent silence, even while talking).
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        api_key: str | None = None,
        backend: Backend | None = None,
        manager: Any | None = None,
        model: str | None = None,
        engine_options: Mapping[str, Any] | None = None,
        voice: str | None = None,
        instructions: str | None = None,
        sampling: Sampling | None = None,
        seed: int | None = None,
        actions: Sequence[Mapping[str, Any]] | None = None,
        tool_names: Mapping[str, str] | None = None,
        speech_threshold_db: float = -45.0,
        backoff: Backoff | None = None,
        caller_vad: bool = True,
    ) -> None:
        super().__init__(
            capabilities=llm.DuplexCapabilities(
                user_transcription=False,
                # it never waits to be asked: after a tool runs it simply goes on
                auto_tool_reply_generation=True,
                mutable_chat_context=False,
                mutable_instructions=True,  # a new session with the new persona
                mutable_tools=True,
            )
        )
        chosen = [
            name
            for name, v in (("url", url), ("backend", backend), ("manager", manager), ("model", model))
            if v is not None
        ]
        if len(chosen) > 1:
            raise ValueError(f"give one of url, backend, manager, model (got {', '.join(chosen)})")
        if not chosen:
            url = os.environ.get(URL_ENV)
            if not url:
                raise ValueError(f"give url=, backend=, manager= or model= (or set {URL_ENV})")
        self.backoff = backoff or Backoff()
        self._owns_backend = backend is None and manager is None
        if backend is not None:
            self.backend: Backend = backend
        elif manager is not None:
            self.backend = InProcessBackend(manager)
        elif model is not None:
            self.backend = InProcessBackend(model=model, **dict(engine_options or {}))
        else:
            assert url is not None
            self.backend = RemoteBackend(
                chat_url(url), api_key=api_key or os.environ.get(API_KEY_ENV) or None, backoff=self.backoff
            )
        self.voice = voice
        self.default_instructions = instructions
        self.sampling = sampling or Sampling()
        self.seed = seed
        self.actions = list(actions) if actions is not None else None
        self.tool_names = dict(tool_names or {})
        self.speech_threshold_db = speech_threshold_db
        self.caller_vad = caller_vad
        ToolRules(self.actions, self.tool_names)  # a rule that cannot work fails here, not mid-call
        if caller_vad:
            load_caller_vad()  # a missing silero-vad model fails here, not when a call starts
        self._sessions: weakref.WeakSet[DuplexSession] = weakref.WeakSet()

    @property
    def model(self) -> str:
        return self.backend.model_name

    @property
    def provider(self) -> str:
        return "personaplex-voice"

    def audio_gate(self) -> llm.AudioGate:
        """Which output frames are the agent speaking: a fixed level, not the adapter's default
        gate that learns the model's silence from its first half second of output (a model
        that talks from its first frame, like an echo or a greeting agent, would teach it its
        speech level and be cut into pieces)."""
        return llm.FixedGate(silence=10 ** (self.speech_threshold_db / 20) / GATE_ACTIVATION_RATIO)

    def session(self) -> DuplexSession:
        session = DuplexSession(self)
        self._sessions.add(session)
        return session

    async def aclose(self) -> None:
        for session in list(self._sessions):
            await session.aclose()
        if self._owns_backend:
            await self.backend.aclose()


def chat_url(url: str) -> str:
    """`ws://host:port` (as LiveKit's NVIDIA plugin takes it) or a full `.../api/chat` URL; http(s)
    schemes become ws(s)."""
    parts = urlsplit(url if "://" in url else f"ws://{url}")
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    path = parts.path if parts.path not in ("", "/") else "/api/chat"
    return urlunsplit((scheme, parts.netloc, path, parts.query, ""))
