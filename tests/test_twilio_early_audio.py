"""A Twilio caller's audio from before its session is ready reaches the session (issue 16):
kept in order behind the phasing silence, which keeps its phase against the engine's ticks."""

from __future__ import annotations

import numpy as np
import pytest
from personaplex_phone.audio_path import CHUNK_BYTES, InboundAudio
from personaplex_phone.caller_audio import EARLY_AUDIO_S, CallerAudio

from personaplex_voice.audio.mulaw import ulaw_encode
from personaplex_voice.engine.base import FRAME_SIZE
from personaplex_voice.engine.loopback import LoopbackEngine


class FakeSession:
    """What CallerAudio needs: `push` (recorded) and the engine's next tick."""

    def __init__(self, to_tick_s: float | None):
        self.to_tick_s = to_tick_s
        self.pushed: list[np.ndarray] = []

    def push(self, pcm: np.ndarray) -> None:
        self.pushed.append(np.array(pcm, np.float32))

    def seconds_to_next_tick(self) -> float | None:
        return self.to_tick_s


def caller_messages(n: int, seed: int = 3) -> list[bytes]:
    rng = np.random.default_rng(seed)
    tone = 0.3 * np.sin(2 * np.pi * 440 * np.arange(n * 160) / 8000) + 0.01 * rng.standard_normal(n * 160)
    data = ulaw_encode(tone.astype(np.float32))
    return [data[i * CHUNK_BYTES : (i + 1) * CHUNK_BYTES] for i in range(n)]


@pytest.mark.parametrize("to_tick_s", [None, 0.013, 0.047, 0.071])
@pytest.mark.parametrize("early_messages", [0, 3, 25])
def test_early_audio_follows_the_silence_in_order_and_keeps_the_phase(to_tick_s, early_messages):
    messages = caller_messages(early_messages + 8)
    caller = CallerAudio(inbound_slack_ms=20)
    for i, message in enumerate(messages[:early_messages]):
        caller.feed(message, i + 1, None)  # the session is not ready yet
    session = FakeSession(to_tick_s)
    for i, message in enumerate(messages[early_messages:], start=early_messages):
        caller.feed(message, i + 1, session)
    pushed = np.concatenate(session.pushed)
    silence = len(session.pushed[0])
    assert not np.any(session.pushed[0])
    # after the silence: every message, kept ones first, as one continuous conversion
    reference = InboundAudio().convert(b"".join(messages))
    np.testing.assert_allclose(pushed[silence:], reference[: len(pushed) - silence], atol=1e-6)
    # the phase the silence sets up is the one it sets up without early audio
    plain = CallerAudio(inbound_slack_ms=20).cushion_samples(to_tick_s)
    assert (silence + early_messages * CHUNK_BYTES * 3) % FRAME_SIZE == plain % FRAME_SIZE
    assert silence + early_messages * CHUNK_BYTES * 3 >= plain  # never less ahead than without
    assert caller.dropped == 0


def test_early_audio_beyond_the_bound_drops_the_oldest_counted():
    messages = caller_messages(75)  # 1.5 s before the session is ready
    caller = CallerAudio(inbound_slack_ms=20)
    for i, message in enumerate(messages):
        caller.feed(message, i + 1, None)
    kept = round(EARLY_AUDIO_S * 8000) // CHUNK_BYTES  # μ-law: a byte a sample
    assert caller.dropped == 75 - kept and caller.metrics()["inbound_dropped_before_ready"] == 75 - kept
    session = FakeSession(None)
    last = caller_messages(1, seed=9)[0]
    caller.feed(last, 76, session)
    pushed = np.concatenate(session.pushed)
    reference = InboundAudio().convert(b"".join(messages[-kept:]) + last)
    silence = len(session.pushed[0])
    np.testing.assert_allclose(pushed[silence:], reference[: len(pushed) - silence], atol=1e-6)
    assert len(pushed) <= 24000  # within what a session keeps before it runs


class RecordingEcho(LoopbackEngine):
    """The loopback engine, keeping what it was given to step: what the model heard."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.heard: dict[int, list[np.ndarray]] = {}

    def step(self, pcm, active):
        for slot in np.flatnonzero(active):
            self.heard.setdefault(int(slot), []).append(np.array(pcm[slot]))
        return super().step(pcm, active)


async def test_a_caller_heard_from_the_first_word_while_the_prompt_is_prefilled(tmp_path):
    """The real bridge on a real server (in this process, Twilio's cloud faked): the caller starts
    talking the moment the stream starts, during a 0.5 s prefill; the model hears its first tone
    from its start. (What the caller hears back is the playout's business: it plays just in time,
    so the echo of a backlog caught up faster than real time is not all played.)"""
    import asyncio

    from support_twilio import RATE, bridge_harness, sine_fit_snr_db, tone

    personas = "default: desk\npersonas:\n  desk: {text_prompt: 'Front desk.'}\n"
    engine = RecordingEcho(num_slots=2, prefill_s=0.5)
    with bridge_harness(personas, tmp_path, engine=engine, manager_options={"cache_bytes": 0}) as h:
        call_sid, url, params = await asyncio.to_thread(h.sim.answer)
        first, then = tone(500.0, 0.3), tone(1300.0, 1.0)
        async with h.sim.media_stream(url, params, call_sid=call_sid) as call:
            await call.play(np.concatenate([first, then, np.zeros(RATE, np.float32)]))
        metrics = h.manager.metrics
    (frames,) = engine.heard.values()
    heard = np.concatenate(frames)  # 24 kHz, from the call's first stepped frame
    block = 24000 // 5  # 200 ms
    blocks = [heard[i : i + block] for i in range(0, 24000, 240)]
    first_heard = max(sine_fit_snr_db(b, 500.0, rate=24000) for b in blocks if np.any(b))
    assert first_heard >= 20.0, first_heard  # the caller's first 200 ms reached the model
    assert metrics.jitter_dropped_frames.value == 0 and metrics.dropped_input_samples.value == 0
