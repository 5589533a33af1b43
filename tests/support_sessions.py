"""Helpers for the SessionManager tests: test audio, collecting frames, waiting (the
`manager_factory` fixture is in conftest.py)."""

from __future__ import annotations

import asyncio
import time

import numpy as np

from personaplex_voice.engine.base import FRAME_SIZE, Persona
from personaplex_voice.sessions import OutFrame, Session, SessionManager


def audio(n_frames: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-0.5, 0.5, n_frames * FRAME_SIZE).astype(np.float32)


async def collect(session: Session, timeout: float = 10.0) -> list[OutFrame]:
    async def run() -> list[OutFrame]:
        return [frame async for frame in session.frames()]

    return await asyncio.wait_for(run(), timeout)


async def echo_call(manager: SessionManager, x: np.ndarray, persona: Persona | None = None) -> list[OutFrame]:
    session = await manager.open(persona or Persona())
    await asyncio.wait_for(session.ready(), 10)
    session.push(x)
    session.end_input()
    return await collect(session)


def assert_echo(out: list[OutFrame], x: np.ndarray, delay: int = 1) -> None:
    got = np.concatenate([f.pcm for f in out])
    assert got.size == x.size
    np.testing.assert_array_equal(got[: delay * FRAME_SIZE], 0)
    np.testing.assert_array_equal(got[delay * FRAME_SIZE :], x[: x.size - delay * FRAME_SIZE])
    assert [f.index for f in out] == list(range(len(out)))


async def wait_until(predicate, timeout: float = 5.0) -> None:
    t_end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < t_end, "condition not reached"
        await asyncio.sleep(0.005)
