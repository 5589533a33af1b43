"""ClusterClient against real EngineWorkers over real Unix sockets (one process, one loop):
the SessionManager API through the split, typed refusals, placement, queueing, lost peers."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from personaplex_voice.cluster.client import ClusterClient
from personaplex_voice.cluster.procs import host_identity
from personaplex_voice.cluster.worker import EngineWorker, WorkerInfo
from personaplex_voice.engine.base import FRAME_SIZE, CapacityError, Persona, PersonaError, SaturatedError
from personaplex_voice.engine.headroom import Headroom, HeadroomConfig
from personaplex_voice.engine.loopback import LoopbackEngine
from personaplex_voice.sessions import SessionManager, TicketError

pytestmark = pytest.mark.timeout(60)

SECRET = "test-cluster-secret"
PIECES = (" one", None, " two")


@dataclass
class Cluster:
    client: ClusterClient
    workers: list[EngineWorker]
    managers: list[SessionManager]


@contextlib.asynccontextmanager
async def cluster(
    tmp_path: Path,
    slots: list[int],
    *,
    realtime: bool = False,
    max_queue: int = 0,
    secret: str = SECRET,
    headroom: HeadroomConfig | None = None,
) -> AsyncIterator[Cluster]:
    workers, managers = [], []
    client = ClusterClient(frontend_id="fe-test", realtime=realtime, max_queue=max_queue, headroom=headroom)
    try:
        for i, n in enumerate(slots):
            engine = LoopbackEngine(num_slots=n, text_pieces=PIECES)
            manager = SessionManager(
                engine, realtime=realtime, idle_timeout_s=None, max_call_s=None, headroom=headroom
            )
            info = WorkerInfo(f"w{i}", "cpu", "test", 0, os.getpid(), host_identity())
            worker = EngineWorker(manager, info, SECRET)
            await worker.start()
            address = await worker.listen(f"unix:{tmp_path}/w{i}.sock")
            client.add_static_worker(f"w{i}", address, secret)
            workers.append(worker)
            managers.append(manager)
        await client.start()
        if secret == SECRET:
            await client.wait_for_workers(len(slots), timeout=10)
            await until(lambda: all(link.status for link in client.links))
        yield Cluster(client, workers, managers)
    finally:
        await client.shutdown()
        for worker in workers:
            await worker.stop()


async def until(predicate, timeout: float = 5.0) -> float:
    """Waits for `predicate`; returns the seconds it took."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.01)
    return time.monotonic() - start


def noise(frames: int, seed: int = 0) -> np.ndarray:
    return (0.1 * np.random.default_rng(seed).standard_normal(frames * FRAME_SIZE)).astype(np.float32)


async def _drain(session) -> None:
    async for _ in session.frames():
        pass


def kill_worker(worker: EngineWorker) -> None:
    """What the kernel does when a worker process dies: its sockets close, nothing listens."""
    for server in worker._servers:
        server.close()
    for connection in list(worker.connections):
        connection.abort()


async def test_a_lossless_session_through_the_split_is_the_in_process_session(tmp_path):
    async with cluster(tmp_path, [2]) as c:
        session = await c.client.open(Persona(text_prompt="hi", voice="LOOPM0", seed=3))
        await session.ready()
        audio = noise(30)
        session.push(audio[:1000])  # odd lengths are framed by the front-end
        session.push(audio[1000:])
        session.end_input()
        frames = [f async for f in session.frames()]
        assert session.close_reason == "input_ended" and session.closed
        assert [f.index for f in frames] == list(range(30))
        out = np.concatenate([f.pcm for f in frames])
        np.testing.assert_array_equal(out[FRAME_SIZE:], audio[:-FRAME_SIZE])  # the echo's one-frame delay
        assert [f.text for f in frames[:4]] == [" one", None, " two", " one"]
        assert session.stats["frames_in"] == 30 and session.stats["worker"] == "w0"
        assert c.client.model_name == "loopback"
        assert c.client.voices() == list(LoopbackEngine().voices())


async def test_refusals_are_typed_and_sessions_spread_over_workers(tmp_path):
    async with cluster(tmp_path, [1, 1]) as c:
        with pytest.raises(PersonaError, match="unknown voice"):
            await c.client.open(Persona(voice="NOBODY"))
        first = await c.client.open(Persona(text_prompt="a"))
        second = await c.client.open(Persona(text_prompt="a"))
        assert {first.worker_id, second.worker_id} == {"w0", "w1"}  # the cache does not pile them up
        await asyncio.gather(first.ready(), second.ready())
        await until(lambda: c.client.available == 0)
        with pytest.raises(CapacityError) as refused:
            await c.client.open(Persona())
        assert refused.value.retry_after_s and "busy" in str(refused.value)
        await first.close()
        await until(lambda: c.client.available == 1)
        third = await c.client.open(Persona())
        assert third.worker_id == first.worker_id
        await until(lambda: c.client.active_count == 2)
        assert c.client.capacity == 2


async def test_the_front_end_queue_gives_positions_and_places_in_order(tmp_path):
    async with cluster(tmp_path, [1], max_queue=2) as c:
        running = await c.client.open(Persona())
        await running.ready()
        waiting = [await c.client.open(Persona()) for _ in range(2)]
        assert [w.queue_position for w in waiting] == [1, 2] and c.client.queued_count == 2
        with pytest.raises(CapacityError, match="queue"):
            await c.client.open(Persona())
        await running.close()
        await asyncio.wait_for(waiting[0].ready(), 5)
        assert waiting[0].queue_position is None and waiting[1].queue_position == 1
        await waiting[1].close()  # leaving the queue frees its place
        assert c.client.queued_count == 0


async def test_a_lost_engine_worker_ends_its_sessions_at_once_and_new_ones_go_elsewhere(tmp_path):
    async with cluster(tmp_path, [2, 2], realtime=True) as c:
        sessions = [await c.client.open(Persona(text_prompt=str(i))) for i in range(4)]
        await asyncio.gather(*(s.ready() for s in sessions))
        doomed = [s for s in sessions if s.worker_id == "w0"]
        kept = [s for s in sessions if s.worker_id == "w1"]
        assert len(doomed) == 2 and len(kept) == 2
        kill_worker(c.workers[0])
        await until(lambda: all(s.closed for s in doomed), timeout=5.0)  # at once: the socket closed
        assert {s.close_reason for s in doomed} == {"engine_lost"}
        for s in doomed:
            await asyncio.wait_for(_drain(s), 1.0)  # frames() ends after what had arrived
        assert not any(s.closed for s in kept)
        kept[0].push(noise(2))  # the others still run
        assert c.client.capacity == 2 and c.client.metrics.engine_lost_sessions.value == 2
        await until(lambda: c.client.available == 0)
        with pytest.raises(CapacityError):
            await c.client.open(Persona())
        await kept[0].close()
        replacement = await c.client.open(Persona())
        assert replacement.worker_id == "w1"


async def test_a_lost_front_end_frees_its_slots_at_once(tmp_path):
    async with cluster(tmp_path, [2]) as c:
        sessions = [await c.client.open(Persona()) for _ in range(2)]
        await asyncio.gather(*(s.ready() for s in sessions))
        assert c.managers[0].active_count == 2
        c.client.links[0]._transport.abort()  # as when the front-end process dies
        await until(lambda: c.managers[0].active_count == 0, timeout=5.0)  # at once: the socket closed
        closed = c.managers[0].metrics.sessions_closed.values()
        assert closed.get("frontend_lost") == 2


async def test_a_wrong_secret_never_gets_a_session(tmp_path):
    async with cluster(tmp_path, [1], secret="wrong") as c:
        await asyncio.sleep(0.5)
        assert c.client.links_up() == [] and c.workers[0].connections == set()
        with pytest.raises(CapacityError, match="no engine worker"):
            await c.client.open(Persona())
        ok, body = c.client.readiness()
        assert not ok and body["status"] == "loading"


async def test_drain_refuses_new_sessions_and_keeps_running_ones(tmp_path):
    async with cluster(tmp_path, [2], realtime=True) as c:
        running = await c.client.open(Persona())
        await running.ready()
        c.client.drain()
        ok, body = c.client.readiness()
        assert not ok and body["status"] == "draining" and body["available"] == 0
        with pytest.raises(CapacityError, match="draining"):
            await c.client.open(Persona())
        running.push(noise(2))
        frames = running.frames()
        assert (await asyncio.wait_for(frames.__anext__(), 2)).pcm.shape == (FRAME_SIZE,)
        assert not running.closed


async def test_a_ticket_from_one_front_end_is_redeemed_through_another(tmp_path):
    async with cluster(tmp_path, [1, 1]) as c:
        other = ClusterClient(frontend_id="fe-other")
        for link in c.client.links:
            other.add_static_worker(link.worker_id, link.address, SECRET)
        await other.start()
        try:
            await other.wait_for_workers(2, timeout=10)
            persona = Persona(text_prompt="reserved for you", voice="LOOPM0")
            ticket = c.client.reserve(ttl_s=10, persona=persona)
            holder = ticket.id.partition(".")[0]
            await until(lambda: other.reserved_count == 1 and other.available == 1)
            ok, body = other.readiness()
            assert ok and body["reserved"] == 1
            unticketed = await other.open(Persona())
            assert unticketed.worker_id != holder  # the reserved slot is not given away
            await until(lambda: other.available == 0)
            with pytest.raises(CapacityError):
                await other.open(Persona())
            session = await other.open(None, ticket=ticket.id)
            await session.ready()
            assert session.worker_id == holder and session.persona == persona
            with pytest.raises(TicketError):
                await other.open(Persona(), ticket=ticket.id)  # one time only
            with pytest.raises(TicketError):
                await other.open(Persona(), ticket=holder + ".made-up")
            # an unredeemed ticket gives its slot back after its TTL
            await session.close()
            await until(lambda: c.client.available == 1)
            short = c.client.reserve(ttl_s=0.5)
            await until(lambda: c.client.available == 0, timeout=1)
            await until(lambda: c.client.available == 1, timeout=3)
            with pytest.raises(TicketError):
                await other.open(Persona(), ticket=short.id)
            cancelled = c.client.reserve(ttl_s=30)
            await until(lambda: other.available == 0)
            assert c.client.cancel(cancelled.id)
            await until(lambda: other.available == 1)
        finally:
            await other.shutdown()


# -- saturation: a worker without real-time headroom takes no new call, nor does a front-end ----------

PROMPT_HOLD = HeadroomConfig(loop_load_hold_s=0.0, exit_hold_s=0.3)


class LoopLoad:
    """The loop monitor's samples, the test's own: every 50 ms, `busy` of the wall clock."""

    def __init__(self, headroom: Headroom, busy: float):
        self.headroom, self.busy = headroom, busy
        self._task = asyncio.get_running_loop().create_task(self._feed())

    async def _feed(self) -> None:
        while True:
            self.headroom.note_loop(0.001, self.busy)
            await asyncio.sleep(0.05)

    async def set(self, busy: float) -> None:
        """Until the window (1 s) holds only the new level, and the state follows it."""
        self.busy = busy
        await asyncio.sleep(1.1)
        self.headroom.evaluate()

    async def stop(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


async def test_placement_skips_a_saturated_worker_and_says_so(tmp_path):
    """w0 reports (STATUS) that it has no headroom: new sessions go to w1; once w1 is full too,
    an open gets SaturatedError (not a plain "full": slots are free, on a worker that cannot
    carry them), and /readyz's body says `saturated` at the engine workers. When w0 recovers,
    it takes calls again."""
    async with cluster(tmp_path, [2, 2], realtime=True, headroom=PROMPT_HOLD) as c:
        w0 = c.managers[0].headroom
        await c.workers[0].loop_monitor.stop()  # its samples are the test's from here
        load = LoopLoad(w0, 0.95)
        await until(lambda: w0.verdict.saturated and c.client.links[0].saturated)
        assert c.client.links[0].status["headroom"]["reasons"] == ["loop_load"]
        placed = [await c.client.open(Persona(text_prompt="p")) for _ in range(2)]
        assert [s.worker_id for s in placed] == ["w1", "w1"]
        await until(lambda: c.client.links[1].free == 0)
        with pytest.raises(SaturatedError, match="no real-time headroom"):
            await c.client.open(Persona())
        ok, body = c.client.readiness()
        assert not ok and body["status"] == "saturated" and body["where"] == "engine workers"
        snapshot = {name: entry["value"] for name, entry in c.client.metrics.snapshot().items()}
        assert snapshot["frontend_sessions_rejected_total"] == {"saturated": 1.0}

        await load.set(0.05)
        await until(lambda: not w0.verdict.refusing and not c.client.links[0].saturated)
        await until(lambda: c.client.links[0].free == 2)
        assert c.client.readiness()[1]["status"] == "ready"
        again = await c.client.open(Persona())
        assert again.worker_id == "w0"
        await load.stop()


async def test_a_saturated_front_end_refuses_and_sheds_its_queue(tmp_path):
    """The front-end's own loop without headroom: new opens and reservations get SaturatedError,
    the caller waiting in its queue is ended (`saturated`) rather than placed later, /readyz says
    so; the call it carries goes on."""
    async with cluster(tmp_path, [1], realtime=True, max_queue=2, headroom=PROMPT_HOLD) as c:
        running = await c.client.open(Persona())
        await until(lambda: c.client.available == 0)
        waiting = await c.client.open(Persona())
        assert waiting.queue_position == 1
        load = LoopLoad(c.client.headroom, 0.9)
        await until(lambda: c.client.headroom.verdict.saturated)
        with pytest.raises(SaturatedError):
            await c.client.open(Persona())
        with pytest.raises(SaturatedError):
            c.client.reserve(ttl_s=10)
        await until(lambda: waiting.closed)
        assert waiting.close_reason == "saturated"
        with pytest.raises(SaturatedError):
            await waiting.ready()
        ok, body = c.client.readiness()
        assert not ok and body["status"] == "saturated" and body["where"] == "front-end"
        assert not running.closed
        own = {name: entry["value"] for name, entry in c.client.metrics_snapshots()[0].instruments.items()}
        assert own["frontend_saturated"] == 1.0 and own["frontend_sessions_closed_total"]["saturated"] == 1
        await load.stop()
