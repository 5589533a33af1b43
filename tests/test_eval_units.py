"""eval's parts on their own: the scripted agent's timing (it hears with silero-vad, so it is
never early and late by no more than its detector's lag), the line registry's codecs, the
progress lines."""

from __future__ import annotations

import io

import numpy as np
import pytest

from personaplex_voice.engine.base import FRAME_SIZE, SAMPLE_RATE, Persona
from personaplex_voice.engine.scripted import Reply, ScriptedEngine
from personaplex_voice.eval.lines import LINES, Line, Reframer, get_line, register
from personaplex_voice.eval.progress import Progress
from personaplex_voice.eval.speech import synthesize as espeak
from personaplex_voice.eval.steps import CallerVoice


def synthesize(text: str) -> np.ndarray:
    return espeak(text, CallerVoice())


def tone(seconds: float, freq: float = 440.0, level: float = 0.3) -> np.ndarray:
    t = np.arange(round(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    return (level * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def drive(engine: ScriptedEngine, caller: np.ndarray) -> tuple[np.ndarray, list[str | None]]:
    engine.start(0, engine.prepare(Persona(voice="NATF2")))
    n = -(-len(caller) // FRAME_SIZE)
    caller = np.pad(caller, (0, n * FRAME_SIZE - len(caller)))
    out, text = [], []
    for k in range(n):
        step = engine.step(caller[k * FRAME_SIZE : (k + 1) * FRAME_SIZE][None, :], np.ones(1, bool))
        out.append(step.pcm[0])
        text.append(step.text[0])
    return np.concatenate(out), text


def speech_span(pcm: np.ndarray, offset: int = 0) -> tuple[int, int]:
    """First and one past the last sample of a clean clip above -60 dBFS: where its sound is."""
    loud = np.flatnonzero(np.abs(pcm) > 1e-3)
    return offset + int(loud[0]), offset + int(loud[-1]) + 1


def test_the_scripted_agent_acts_on_what_silero_hears():
    """The agent acts on its detector's news: it answers `respond_after` after silero says the
    caller's speech ended and yields `stop_after` after silero says a barge-in started, each off
    the sound's own edges by the detector's error (32 ms windows; its end can come before a
    soft tail's last sample, its start a window late)."""
    clip = np.full(SAMPLE_RATE, 0.3, np.float32)  # one second of agent "speech"
    engine = ScriptedEngine(
        1, replies=[Reply("one two three four", clip)], respond_after_ms=250, stop_after_ms=130
    )
    question, cut_in = synthesize("When is my next pickup?"), synthesize("Sorry, one more thing.")
    gap = np.zeros(round(0.8 * SAMPLE_RATE), np.float32)
    caller = np.concatenate([question, gap, cut_in, np.zeros(2 * SAMPLE_RATE, np.float32)])
    out, text = drive(engine, caller)
    speaking = np.flatnonzero(out != 0)
    _, asked = speech_span(question)
    answered = int(speaking[0])
    lag_ms = (answered - asked) / SAMPLE_RATE * 1000 - 250
    assert -100 <= lag_ms <= 200, lag_ms
    barge, barge_end = speech_span(cut_in, len(question) + len(gap))
    assert answered < barge  # the barge-in lands inside the one-second reply
    stopped = int(speaking[speaking < barge + SAMPLE_RATE // 2][-1]) + 1
    stop_lag_ms = (stopped - barge) / SAMPLE_RATE * 1000 - 130
    assert -40 <= stop_lag_ms <= 120, stop_lag_ms
    # Its words came with its audio and stopped with it; then it answers the barge-in.
    said = stopped - answered
    words = "".join(t for t in text if t).split()
    assert (
        words[: 1 + (said - 1) * 4 // SAMPLE_RATE]
        == ["one", "two", "three", "four"][: 1 + (said - 1) * 4 // SAMPLE_RATE]
    )
    again = int(speaking[speaking > stopped][0])
    assert -100 <= (again - barge_end) / SAMPLE_RATE * 1000 - 250 <= 200


def test_the_scripted_agent_greets_a_silent_caller_only():
    reply = Reply("hello there", np.full(4000, 0.5, np.float32))
    engine = ScriptedEngine(1, replies=[reply], greet=True, greet_after_ms=400)
    out, text = drive(engine, np.zeros(8 * FRAME_SIZE, np.float32))
    start = round(0.4 * SAMPLE_RATE)
    assert np.flatnonzero(out)[0] == start and len(np.flatnonzero(out)) == 4000
    assert [t for t in text if t] == [" hello", " there"]
    # A caller who speaks first gets no greeting: the agent waits for it to finish.
    question = synthesize("Hello, is anybody there?")
    out, _ = drive(engine, np.concatenate([question, np.zeros(SAMPLE_RATE, np.float32)]))
    assert np.flatnonzero(out)[0] >= speech_span(question)[1]


@pytest.mark.parametrize("name", sorted(LINES))
def test_every_line_carries_a_call_frame_by_frame(name):
    line = get_line(name)
    codec = line.open()
    signal = tone(1.2, freq=700.0)
    to_engine, on_line, heard = [], [], []
    for k in range(len(signal) // FRAME_SIZE):
        frame = signal[k * FRAME_SIZE : (k + 1) * FRAME_SIZE]
        wire, engine_in = codec.uplink(frame)
        assert engine_in.shape == (FRAME_SIZE,) and engine_in.dtype == np.float32
        assert len(wire) == FRAME_SIZE * line.rate // SAMPLE_RATE
        back = codec.downlink(frame)
        assert len(back) == FRAME_SIZE * line.rate // SAMPLE_RATE
        to_engine.append(engine_in)
        on_line.append(wire)
        heard.append(back)
    got = np.concatenate(to_engine)[SAMPLE_RATE // 2 :]
    want = signal[SAMPLE_RATE // 2 : SAMPLE_RATE // 2 + len(got)]
    lag = max(range(0, 600), key=lambda d: float(np.dot(got[d:], want[: len(want) - d])))
    corr = np.corrcoef(got[lag:], want[: len(want) - lag])[0, 1]
    assert corr > 0.95 and lag < 500, (name, corr, lag)  # the tone gets through, a codec's delay at most


def test_a_carrier_codec_is_one_registration():
    class Silent:
        def uplink(self, caller):
            return np.zeros(len(caller) * 2 // 3, np.float32), np.zeros(FRAME_SIZE, np.float32)

        def downlink(self, agent):
            return np.zeros(len(agent) * 2 // 3, np.float32)

    register(Line("l16-test", 16000, "a test line", Silent))
    try:
        assert get_line("l16-test").rate == 16000
    finally:
        del LINES["l16-test"]
    with pytest.raises(ValueError, match="unknown line 'nope'"):
        get_line("nope")


def test_reframer_delays_a_short_start_instead_of_losing_it():
    frames = Reframer(4)
    assert list(frames.take(np.array([1, 2], np.float32))) == [0, 0, 1, 2]
    assert list(frames.take(np.array([3, 4, 5, 6, 7], np.float32))) == [3, 4, 5, 6]
    assert list(frames.take(np.array([], np.float32))) == [0, 0, 0, 7]


def test_progress_lines_without_a_terminal():
    stream = io.StringIO()
    progress = Progress(2, stream=stream)
    for _ in range(25):
        progress.frame()
    progress.call_done("a-r1")
    progress.call_done("b-r1", error="the session ended early (engine_error)")
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("eval: call 1/2 a-r1 done (2.0 s audio, ")
    assert lines[1].startswith("eval: call 2/2 b-r1 failed: the session ended early (engine_error)")
    assert "x real time" in lines[0]
