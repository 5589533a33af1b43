"""In-process backend: the model runs in this Python process, behind a SessionManager.

Either hand it a running `SessionManager` (shared with other transports: a FastAPI app that also
serves Twilio or `/api/chat`), an `Engine`, or let it build the engine with `build_engine` the
first time a pipeline starts. It only knows the session API, never torch.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from personaplex_voice.engine.base import (
    CapacityError,
    Engine,
    EngineError,
    Persona,
    PersonaError,
    SaturatedError,
)
from personaplex_voice.errors import UserError
from personaplex_voice.session_api import CallSession, SessionHost
from personaplex_voice.sessions import SessionManager

from .base import AgentFrame, BackendUnavailable, SessionLost, SessionRefused

log = logging.getLogger("personaplex_backends.inprocess")


class InProcessSession:
    def __init__(self, session: CallSession):
        self._session = session
        self._closing = False

    @property
    def session_id(self) -> str:
        return str(self._session.id)

    @property
    def description(self) -> str:
        return f"in-process session {self._session.id}"

    @property
    def closed(self) -> bool:
        return self._session.closed

    @property
    def session(self) -> CallSession:
        return self._session

    def push(self, pcm: np.ndarray) -> None:
        if not self._closing:
            self._session.push(pcm)

    async def frames(self) -> AsyncIterator[AgentFrame]:
        async for out in self._session.frames():
            yield AgentFrame(pcm=out.pcm, text=out.text, tokens=out.tokens)
        if not self._closing:
            reason = self._session.close_reason or "ended"
            raise SessionLost(f"the engine session ended ({reason})")

    async def close(self) -> None:
        self._closing = True
        await self._session.close(reason="client")


class InProcessBackend:
    """Sessions from a SessionManager in this process.

    `manager`: use this one (it is started if needed, never shut down here).
    `engine`: wrap it in a new SessionManager that this backend owns.
    Neither: `build_engine(model, engine=engine_kind, num_slots=..., device=..., **engine_options)`
    runs (in a worker thread) when `prepare()` is first awaited.
    """

    def __init__(
        self,
        manager: SessionHost | None = None,
        *,
        engine: Engine | None = None,
        model: str = "demo",
        engine_kind: str = "model",
        num_slots: int = 1,
        device: str = "cpu",
        max_queue: int = 0,
        **engine_options: Any,
    ):
        if manager is not None and engine is not None:
            raise ValueError("pass either a SessionManager or an Engine, not both")
        self._manager = manager
        self._engine = engine
        self._owns_manager = manager is None
        self._build_args = dict(engine=engine_kind, num_slots=num_slots, device=device, **engine_options)
        self._model = model
        self._max_queue = max_queue
        self._prepare_lock = asyncio.Lock()

    @property
    def model_name(self) -> str:
        if self._manager is not None:
            return self._manager.model_name
        name = getattr(self._engine, "name", None)
        return str(name) if name else str(self._model)

    @property
    def manager(self) -> SessionHost | None:
        return self._manager

    async def prepare(self) -> None:
        async with self._prepare_lock:
            if self._manager is None:
                if self._engine is None:
                    log.info("building engine %s (%s)", self._model, self._build_args)
                    try:
                        self._engine = await asyncio.to_thread(self._build_engine)
                    except (UserError, EngineError, OSError) as exc:
                        raise BackendUnavailable(f"could not load model {self._model}: {exc}") from exc
                self._manager = SessionManager(self._engine, max_queue=self._max_queue, realtime=True)
            await self._manager.start()

    def _build_engine(self) -> Engine:
        from personaplex_voice.engine.factory import build_engine

        return build_engine(self._model, **self._build_args)

    async def open(self, persona: Persona) -> InProcessSession:
        await self.prepare()
        assert self._manager is not None
        try:
            session = await self._manager.open(persona)
        except SaturatedError as exc:
            raise SessionRefused(f"no real-time headroom for another call: {exc}", kind="saturated") from exc
        except CapacityError as exc:
            retry = f"; retry in about {exc.retry_after_s:.0f} s" if exc.retry_after_s else ""
            raise SessionRefused(
                f"no free engine slot ({self._manager.capacity} in use){retry}", kind="capacity"
            ) from exc
        except PersonaError as exc:
            raise SessionRefused(f"persona refused: {exc}", kind="persona") from exc
        except EngineError as exc:  # shutting down
            raise BackendUnavailable(f"the engine is not taking sessions: {exc}") from exc
        try:
            await session.ready()
        except PersonaError as exc:
            await session.close(reason="persona")
            raise SessionRefused(f"persona refused: {exc}", kind="persona") from exc
        except asyncio.CancelledError:
            # Cancelled while waiting for a slot or the prefill: never leave a slot behind.
            await asyncio.shield(session.close(reason="client"))
            raise
        except Exception as exc:  # SessionClosed: the manager shut down or the engine failed
            await session.close(reason="client")
            reason = session.close_reason or type(exc).__name__
            raise BackendUnavailable(f"the engine session could not start ({reason})") from exc
        return InProcessSession(session)

    async def aclose(self) -> None:
        if self._owns_manager and self._manager is not None:
            manager, self._manager = self._manager, None
            await manager.shutdown()
