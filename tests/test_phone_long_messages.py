"""A carrier that sends the caller's audio in ~100 ms messages (Exotel) gets the same clean line as
one that sends 20 ms (issue 27).

An independent client sending Exotel's 100 ms chunks had its echo back at correlation 0.52-0.76
where every other carrier gave 0.96+: the echo's delay grew by a frame three times in the call's
first second. The cause, checked here tick by tick as the scheduler runs the session (a real
Session, the phone call's real CallerAudio, no clock): 100 ms pieces leave a whole frame queued
after some ticks, which the next tick takes before the next piece comes; the session's start
burst took those frames for a burst and caught them up, so that next tick found nothing (silence
put in, the call one frame later for good); and the cushion for long messages was 80 ms more than
needed. The phone call now tells the session how long its pieces are and computes the least
cushion that keeps every frame complete `inbound_slack_ms` before its tick.
"""

from __future__ import annotations

import numpy as np
import pytest
from personaplex_phone.audio_path import InboundAudio
from personaplex_phone.caller_audio import CallerAudio, _keeps_frames, long_message_cushion_ms
from personaplex_phone.carrier import AudioFormat

from personaplex_voice.audio.telephony import l16_encode
from personaplex_voice.engine.base import Persona
from personaplex_voice.engine.loopback import LoopbackEngine
from personaplex_voice.sessions import Session, SessionManager

LINE = AudioFormat("l16", 8000)
FRAME_MS = 80


class CallerView:
    """The session as CallerAudio sees it, with the engine's next tick `to_tick_s` away."""

    def __init__(self, session: Session, to_tick_s: float | None, tell_pieces: bool):
        self.push = session.push
        self.seconds_to_next_tick = lambda: to_tick_s
        if tell_pieces:
            self.expect_input_pieces = session.expect_input_pieces


def run_call(
    message_ms: int, to_tick_s: float | None, seconds: float, tell_pieces: bool = True, late_ms: float = 0.0
) -> dict:
    """Caller messages every `message_ms` (each `late_ms` late after the first), ticks every 80 ms
    (the next `to_tick_s` after the first message; None: an idle clock, started by that message),
    each tick as the scheduler runs it: take the frame, the jitter buffer, then catch-up steps.
    Returns the counts and what the engine took, in order."""
    engine = LoopbackEngine(num_slots=1)
    manager = SessionManager(engine, realtime=True)
    session = Session(manager, engine.prepare(Persona()))
    stream = session.record.stream
    caller = CallerAudio(inbound_slack_ms=30, fmt=LINE)
    view = CallerView(session, to_tick_s, tell_pieces)
    rng = np.random.default_rng(7)
    speech = (0.2 * rng.standard_normal(round(seconds * 8000))).astype(np.float32)
    step = 8000 * message_ms // 1000
    payloads = [
        l16_encode(speech[i : i + step], big_endian=False) for i in range(0, len(speech) - step + 1, step)
    ]
    first_tick = 0.0 if to_tick_s is None else to_tick_s * 1000
    events = [(k * message_ms + (late_ms if k else 0.0), 1, k) for k in range(len(payloads))]
    events += [(first_tick + n * FRAME_MS, 0, n) for n in range(int(seconds * 1000 / FRAME_MS))]
    if to_tick_s is None:  # an idle clock: the first message's full frame starts it, just after
        events[len(payloads)] = (0.0, 2, 0)
    counts = {"late": 0, "caught_up": 0, "trimmed": 0}
    taken: list[np.ndarray] = []
    started = False
    for _, kind, index in sorted(events):  # a message due at a tick's time comes after it
        if kind == 1:
            caller.feed(payloads[index], index + 1, view)
            continue
        frame = stream.take_frame()
        if frame is None:
            counts["late"] += started
        else:
            started = True
            taken.append(frame)
        counts["trimmed"] += stream.trim_spare(
            manager.config.input_slack_frames, manager.config.input_settle_ticks
        )
        while stream.catchup_due():
            extra = stream.take_catchup_frame()
            if extra is None:
                break
            taken.append(extra)
            counts["caught_up"] += 1
    reference = InboundAudio(LINE).convert(b"".join(payloads))
    return {
        **counts,
        "taken": np.concatenate(taken) if taken else np.zeros(0, np.float32),
        "reference": reference,
    }


@pytest.mark.parametrize("to_tick_s", [None, 0.005, 0.021, 0.03, 0.047, 0.06, 0.079])
def test_100_ms_messages_give_every_tick_its_frame_and_lose_nothing(to_tick_s) -> None:
    call = run_call(100, to_tick_s, seconds=6.0)
    assert (call["late"], call["caught_up"], call["trimmed"]) == (0, 0, 0), call
    # What the engine took: the cushion's silence, then the caller's audio, whole and in order.
    taken, reference = call["taken"], call["reference"]
    lead = int(np.argmax(np.abs(taken) > 0))
    n = min(len(taken) - lead, len(reference))
    assert n > 5 * 24000
    np.testing.assert_allclose(taken[lead : lead + n], reference[:n], atol=1e-6)


@pytest.mark.parametrize("to_tick_s", [None, 0.03, 0.06])
def test_a_message_up_to_the_slack_late_still_leaves_no_gap(to_tick_s) -> None:
    call = run_call(100, to_tick_s, seconds=4.0, late_ms=25.0)  # inbound_slack_ms is 30
    assert (call["late"], call["caught_up"], call["trimmed"]) == (0, 0, 0), call


def test_without_telling_the_session_its_pieces_the_same_call_slips() -> None:
    """The cause, shown: the start burst catches up the frames 100 ms pieces leave queued, and
    the next tick finds nothing (this is what the independent client heard)."""
    slipped = [run_call(100, t, seconds=3.0, tell_pieces=False) for t in (None, 0.03, 0.06)]
    assert all(c["caught_up"] > 0 and c["late"] > 0 for c in slipped), [
        (c["late"], c["caught_up"]) for c in slipped
    ]


def test_20_ms_messages_are_unchanged() -> None:
    for to_tick_s in (None, 0.013, 0.047, 0.071):
        call = run_call(20, to_tick_s, seconds=3.0)
        assert (call["late"], call["caught_up"], call["trimmed"]) == (0, 0, 0)


@pytest.mark.parametrize("message_ms", [60, 100, 120, 200])
@pytest.mark.parametrize("to_tick_s", [None, 0.01, 0.04, 0.07])
def test_the_long_message_cushion_is_the_least_that_works(message_ms, to_tick_s) -> None:
    cushion = long_message_cushion_ms(to_tick_s, message_ms, FRAME_MS, 30)
    assert 0 <= cushion <= FRAME_MS + message_ms + 30
    ticks, idle = 40, to_tick_s is None
    first = 0.0 if idle else to_tick_s * 1000
    assert _keeps_frames(cushion, first, message_ms, FRAME_MS, 30, ticks, idle)
    if cushion >= 1 and not (idle and cushion <= FRAME_MS - message_ms):
        assert not _keeps_frames(cushion - 1, first, message_ms, FRAME_MS, 30, ticks, idle)
    # The caller pushes it, in samples, ahead of its first message.
    caller = CallerAudio(inbound_slack_ms=30, fmt=LINE)
    assert caller.cushion_samples(to_tick_s, message_ms / 1000) == round(cushion * 24)
