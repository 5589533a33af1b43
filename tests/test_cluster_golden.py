"""Exactness through the split: the golden model in an engine-worker process (non-realtime),
reached over its Unix socket by a ClusterClient; two golden runs at once give the published
tokens, text pieces and PCM exactly as in process."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from support_cluster import running_worker

from personaplex_voice.audio.io import read_audio
from personaplex_voice.cluster.client import ClusterClient
from personaplex_voice.engine.base import FRAME_SIZE, Persona, Sampling

pytestmark = pytest.mark.timeout(240)

SERVICE_PROMPT = (
    "You work for CitySan Services which is a waste management and your name is Ayelen Lucero. "
    "Information: Verify customer name Omar Torres. Current schedule: every other week."
)
PERSONAS = {
    "service": Persona(text_prompt=SERVICE_PROMPT, voice="TINYF0.pt", sampling=Sampling(greedy=True), seed=0),
    "pt_voice": Persona(
        text_prompt="You enjoy having a good conversation.",
        voice="TINYF0.pt",
        sampling=Sampling(greedy=True),
        seed=0,
    ),
}


def piece(p: str) -> str | None:
    return None if p in ("EPAD", "PAD") else p


async def run_calls(address: str, secret: str, user: np.ndarray) -> dict[str, list]:
    client = ClusterClient(frontend_id="fe-golden", realtime=False)
    client.add_static_worker("w0", address, secret)
    await client.start()
    try:
        await client.wait_for_workers(1, timeout=30)
        sessions = {name: await client.open(persona) for name, persona in PERSONAS.items()}
        await asyncio.gather(*(s.ready() for s in sessions.values()))
        assert client.metrics.workers_up.value == 1
        for session in sessions.values():
            session.push(user)
            session.end_input()

        async def collect(session) -> list:
            return [f async for f in session.frames()]

        frames = await asyncio.wait_for(asyncio.gather(*(collect(s) for s in sessions.values())), 120)
        for session in sessions.values():
            assert session.close_reason == "input_ended"
        return dict(zip(sessions, frames, strict=True))
    finally:
        await client.shutdown()


def test_golden_runs_through_an_engine_worker_are_exact(tmp_path, golden_dir):
    expected = dict(np.load(golden_dir / "expected.npz"))
    user = read_audio(golden_dir / "user.wav")
    user = np.pad(user, (0, 70 * FRAME_SIZE - user.size)).astype(np.float32)  # as the reference
    settings = {
        "engine": "model",
        "model": str(golden_dir),
        "device": "cpu",
        "threads": 1,
        "max_sessions": 2,
        "idle_timeout_s": 0,
        "max_call_s": 0,
        "log_level": "warning",
    }
    with running_worker(tmp_path, settings, realtime=False) as worker:
        results = asyncio.run(run_calls(worker.address, worker.secret, user))
    for name, frames in results.items():
        assert len(frames) == 70, name
        got = np.stack([f.tokens for f in frames])
        want = expected[f"{name}__tokens"]
        n = min(got.shape[1], want.shape[1])
        assert n >= 9
        np.testing.assert_array_equal(got[:, :n], want[:, :n], err_msg=name)
        assert [f.text for f in frames] == [piece(p) for p in expected[f"{name}__pieces"]], name
        pcm = np.concatenate([f.pcm for f in frames])
        np.testing.assert_allclose(pcm, expected[f"{name}__pcm"], atol=1e-4, rtol=0, err_msg=name)
