"""Through the cluster split (issue 16): audio a front-end session gets before its engine worker
runs it waits at the front-end, follows in order, and the worker's session keeps and catches it
up, as an embedded session does. A real EngineWorker over a real Unix socket, realtime."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest
from support_sessions import collect

from personaplex_voice.cluster.client import ClusterClient
from personaplex_voice.cluster.procs import host_identity
from personaplex_voice.cluster.worker import EngineWorker, WorkerInfo
from personaplex_voice.engine.base import FRAME_SIZE, Persona
from personaplex_voice.engine.loopback import LoopbackEngine
from personaplex_voice.sessions import SessionManager

pytestmark = pytest.mark.timeout(60)
SECRET = "start-burst-secret"


def frame_of(k: int) -> np.ndarray:
    """Frame number k, loud enough to be worth delivering from a catch-up step."""
    return np.full(FRAME_SIZE, 0.1 + k / 1000.0, np.float32)


async def test_audio_before_the_worker_runs_the_session_is_kept_in_order(tmp_path):
    manager = SessionManager(LoopbackEngine(num_slots=1, prefill_s=0.3), cache_bytes=0, idle_timeout_s=None)
    worker = EngineWorker(manager, WorkerInfo("w0", "cpu", "test", 0, os.getpid(), host_identity()), SECRET)
    client = ClusterClient(frontend_id="fe-burst", realtime=True)
    try:
        await worker.start()
        client.add_static_worker("w0", await worker.listen(f"unix:{tmp_path}/w0.sock"), SECRET)
        await client.start()
        await client.wait_for_workers(1, timeout=10)
        session = await client.open(Persona())
        for k in range(1, 10):  # while it is placed and its 0.3 s prompt is prefilled
            session.push(frame_of(k))
        await asyncio.wait_for(session.ready(), 10)
        for k in range(10, 13):  # 12 frames in all: within the 1 s a session keeps
            session.push(frame_of(k))
        session.end_input()
        out = await collect(session)
    finally:
        await client.shutdown()
        await worker.stop()
    echoed = [round(float(f.pcm[0]) * 1000) - 100 for f in out]
    assert echoed[1:12] == list(range(1, 12))  # the loopback answers one frame late
    assert session.stats["dropped_pre_ready_samples"] == 0
    assert manager.metrics.jitter_dropped_frames.value == 0
    assert manager.metrics.dropped_input_samples.value == 0
