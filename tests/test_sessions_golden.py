"""SessionManager on the real engine with the golden tiny model: exactness under batching,
persona-cache hits, per-session seeds, capacity refusal and 1000 open/close cycles."""

from __future__ import annotations

import asyncio
import gc
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

from personaplex_voice.audio.io import read_audio
from personaplex_voice.engine.base import FRAME_SIZE, CapacityError, Persona, Sampling
from personaplex_voice.engine.generator import PersonaPlexEngine
from personaplex_voice.metrics import values_of
from personaplex_voice.model.sources import resolve_model
from personaplex_voice.sessions import OutFrame, Session, SessionManager

pytestmark = pytest.mark.timeout(240)

PROMPT = "You enjoy having a good conversation."
SERVICE_PROMPT = (
    "You work for CitySan Services which is a waste management and your name is Ayelen Lucero. "
    "Information: Verify customer name Omar Torres. Current schedule: every other week."
)
GREEDY = Sampling(greedy=True)
GOLDEN_PERSONAS = {
    "wav_voice": Persona(text_prompt=PROMPT, voice="TINYF0.wav", sampling=GREEDY, seed=0),
    "pt_voice": Persona(text_prompt=PROMPT, voice="TINYF0.pt", sampling=GREEDY, seed=0),
    "service": Persona(text_prompt=SERVICE_PROMPT, voice="TINYF0.pt", sampling=GREEDY, seed=0),
}
NUM_SLOTS = 8


@pytest.fixture(scope="module")
def engine(golden_dir: Path) -> PersonaPlexEngine:
    torch.set_num_threads(1)
    return PersonaPlexEngine(resolve_model(str(golden_dir)), num_slots=NUM_SLOTS)


@pytest.fixture(scope="module")
def golden(golden_dir: Path) -> dict[str, np.ndarray]:
    expected = dict(np.load(golden_dir / "expected.npz"))
    user = read_audio(golden_dir / "user.wav")
    assert 69 * FRAME_SIZE < user.size <= 70 * FRAME_SIZE
    expected["user"] = np.pad(user, (0, 70 * FRAME_SIZE - user.size)).astype(np.float32)  # as the reference
    return expected


def noise(n_frames: int, seed: int) -> np.ndarray:
    return (0.1 * np.random.default_rng(seed).standard_normal(n_frames * FRAME_SIZE)).astype(np.float32)


def piece(p: str) -> str | None:
    return None if p in ("EPAD", "PAD") else p


def tokens_of(frames: list[OutFrame]) -> np.ndarray:
    return np.stack([f.tokens for f in frames])


class GoldenCall:
    """A golden run fed one frame per driver step, so every tick is one step of the schedule."""

    def __init__(self, name: str, session: Session, user: np.ndarray):
        self.name, self.session, self.user = name, session, user
        self.pushed = 0
        self.frames: list[OutFrame] = []
        self.task = asyncio.ensure_future(self._collect())

    async def _collect(self) -> None:
        async for frame in self.session.frames():
            self.frames.append(frame)

    def feed_one(self) -> None:
        if self.pushed < 70:
            self.session.push(self.user[self.pushed * FRAME_SIZE : (self.pushed + 1) * FRAME_SIZE])
            self.pushed += 1
            if self.pushed == 70:
                self.session.end_input()

    @property
    def caught_up(self) -> bool:
        return len(self.frames) >= self.pushed


async def test_golden_runs_are_exact_inside_a_changing_batch(engine, golden):
    manager = SessionManager(engine, realtime=False, output_frames=512, max_call_s=None, idle_timeout_s=None)
    persona_a = Persona(text_prompt="You sell cars.", voice="TINYF0.pt", seed=1)
    noise_plan = {
        # tick: [(name, persona)] joining; the noise input of each is fixed by its name
        0: [("n1", persona_a), ("n2", Persona(text_prompt=PROMPT, voice="TINYF0.pt", seed=7))],
        4: [("n3", Persona(text_prompt="You are a pirate.", voice="TINYF0.wav", sampling=GREEDY))],
        9: [
            ("n4", Persona(text_prompt="", voice="TINYF0.wav", seed=3)),
            ("n5", Persona(text_prompt="Be brief.", voice="TINYF0.pt", sampling=Sampling(text_topk=3))),
            ("n8", Persona(text_prompt=PROMPT, voice="TINYF0.wav", seed=4)),
        ],
        20: [("n6", persona_a)],  # same persona and seed as n1: a cache hit, same tokens
        35: [("n7", Persona(text_prompt="You sell cars.", voice="TINYF0.pt", seed=2))],
    }
    leave_plan = {9: ["n1"], 20: ["n2"], 35: ["n3", "n4"], 50: ["n5"]}
    golden_plan = {0: ["wav_voice"], 4: ["pt_voice"], 9: ["service"]}
    noise_input = {
        name: noise(200, seed=i) for i, name in enumerate(["n1", "n2", "n3", "n4", "n5", "n6", "n7", "n8"])
    }
    noise_input["n6"] = noise_input["n7"] = noise_input["n1"]
    calls: dict[str, GoldenCall] = {}
    others: dict[str, Session] = {}
    refused = False
    try:
        for tick in range(200):
            for name in leave_plan.get(tick, []):
                await others[name].close()
            joining = []
            for name in golden_plan.get(tick, []):
                session = await manager.open(GOLDEN_PERSONAS[name])
                calls[name] = GoldenCall(name, session, golden["user"])
                joining.append(session)
            for name, persona in noise_plan.get(tick, []):
                others[name] = await manager.open(persona)
                joining.append(others[name])
            for session in joining:
                await asyncio.wait_for(session.ready(), 60)
                if session in others.values():
                    session.push(noise_input[next(k for k, v in others.items() if v is session)])
            if manager.active_count == NUM_SLOTS and not refused:
                with pytest.raises(CapacityError):  # the 9th caller is refused cleanly
                    await manager.open(Persona(text_prompt="one too many", voice="TINYF0.pt"))
                refused = True
            for call in calls.values():
                call.feed_one()
            await asyncio.wait_for(_until(lambda: all(c.caught_up for c in calls.values())), 60)
            if len(calls) == 3 and all(c.pushed == 70 for c in calls.values()):
                break
        for call in calls.values():
            await asyncio.wait_for(call.task, 60)
        noise_frames = {}
        for name, session in others.items():
            await session.close()
            noise_frames[name] = [f async for f in session.frames()]
    finally:
        await manager.shutdown()
    assert refused, "the schedule never filled the manager"

    for name, call in calls.items():
        assert len(call.frames) == 70, name
        expected = golden[f"{name}__tokens"]
        got = tokens_of(call.frames)
        n = min(got.shape[1], expected.shape[1])
        assert n >= 9
        np.testing.assert_array_equal(got[:, :n], expected[:, :n], err_msg=name)
        assert [f.text for f in call.frames] == [piece(p) for p in golden[f"{name}__pieces"]], name
        pcm = np.concatenate([f.pcm for f in call.frames])
        np.testing.assert_allclose(pcm, golden[f"{name}__pcm"], atol=1e-4, rtol=0, err_msg=name)
        assert call.session.close_reason == "input_ended"
    # pt_voice's persona was prefilled by n2 first: it ran from the cache and is still exact
    assert calls["pt_voice"].session.stats["cache_hit"] is True
    assert calls["wav_voice"].session.stats["cache_hit"] is False
    # per-session seeds inside one batch: n6 (cache hit, joined later) repeats n1, n7 does not
    n = min(len(noise_frames["n1"]), len(noise_frames["n6"]), len(noise_frames["n7"]))
    assert n >= 5
    first = tokens_of(noise_frames["n1"][:n])
    np.testing.assert_array_equal(tokens_of(noise_frames["n6"][:n]), first)
    assert not np.array_equal(tokens_of(noise_frames["n7"][:n]), first)
    assert others["n6"].stats["cache_hit"] is True
    assert manager.active_count == 0


async def _until(predicate) -> None:
    while not predicate():
        await asyncio.sleep(0.002)


def _tensors() -> int:
    gc.collect()
    return sum(1 for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor))


async def test_thousand_open_close_cycles_on_the_model(engine):
    manager = SessionManager(engine, realtime=False, max_queue=64, idle_timeout_s=None)
    personas = [
        Persona(text_prompt=PROMPT, voice="TINYF0.pt", sampling=GREEDY),
        Persona(text_prompt="You sell cars.", voice="TINYF0.pt", seed=5),
        Persona(text_prompt="", voice="TINYF0.pt", seed=6),
    ]  # .pt voices: a .wav voice is Mimi-encoded by every prepare (0.4 s here), too slow for 1000
    alive: weakref.WeakSet[Session] = weakref.WeakSet()
    frame = noise(1, seed=9)

    async def cycle(i: int) -> None:
        session = await manager.open(personas[i % len(personas)])
        alive.add(session)
        kind = i % 20
        if kind < 8:  # close while queued or during prefill
            await session.close()
            return
        await session.ready()
        if kind < 19:  # ready, never streams
            await session.close()
            return
        session.push(frame)  # mid-stream: one frame in, one out, then hang up
        frames = session.frames()
        await frames.__anext__()
        await session.close()

    async def run(start: int, stop: int) -> None:
        for first in range(start, stop, 40):
            await asyncio.wait_for(asyncio.gather(*(cycle(i) for i in range(first, first + 40))), 60)

    try:
        await run(0, 40)  # warm up: the persona cache fills, the engine allocates what it keeps
        await _until(lambda: manager.scheduler.settled)
        before = _tensors()
        await run(40, 1000)
        await asyncio.wait_for(_until(lambda: manager.scheduler.settled), 10)
        after = _tensors()
    finally:
        await manager.shutdown()
    assert manager.active_count == 0 and manager.queued_count == 0 and manager.sessions == []
    assert manager.scheduler.settled and manager.scheduler.queued_count == 0
    gc.collect()
    assert len(alive) == 0, "the manager keeps sessions alive"
    assert after <= before, f"tensors grew from {before} to {after}"
    snap = values_of(manager.metrics.snapshot())
    assert snap["sessions_opened_total"] == 1000
    assert sum(snap["sessions_closed_total"].values()) == 1000
    assert snap["persona_cache_entries"] == len(personas)
