"""The cluster's pure parts: the session protocol's codecs and framing, placement, back-off."""

from __future__ import annotations

import numpy as np
import pytest

from personaplex_voice.cluster import wire
from personaplex_voice.cluster.placement import Candidate, choose_worker, persona_fingerprint
from personaplex_voice.cluster.supervisor import Backoff
from personaplex_voice.cluster.wire import Kind, MessageReader, WireError
from personaplex_voice.engine.base import (
    FRAME_SIZE,
    CapacityError,
    Persona,
    PersonaError,
    Sampling,
    SaturatedError,
)
from personaplex_voice.engine.scheduler import TicketError


def test_frames_and_audio_round_trip_bit_exact_through_any_split_of_the_stream():
    rng = np.random.default_rng(1)
    pcm = rng.standard_normal(FRAME_SIZE).astype(np.float32)
    tokens = np.arange(17, dtype=np.int64) * 1000
    stream = (
        wire.frame_message(7, 41, pcm, " héllo", tokens, 12.5)
        + wire.frame_message(8, 0, -pcm, None, None, 1.0)
        + wire.audio_message(9, pcm * 0.5, 99.25)
        + wire.json_message(Kind.OPEN, 10, {"persona": {"text_prompt": "x"}})
    )
    reader = MessageReader()
    messages = []
    for i in range(0, len(stream), 1000):  # the kernel may cut anywhere
        messages += reader.feed(stream[i : i + 1000])
    assert [(k, c) for k, c, _ in messages] == [
        (Kind.FRAME, 7),
        (Kind.FRAME, 8),
        (Kind.AUDIO, 9),
        (Kind.OPEN, 10),
    ]
    index, stamp, got, text, got_tokens = wire.parse_frame(messages[0][2])
    assert (index, stamp, text) == (41, 12.5, " héllo")
    np.testing.assert_array_equal(got, pcm)
    np.testing.assert_array_equal(got_tokens, tokens)
    _, _, got2, text2, tokens2 = wire.parse_frame(messages[1][2])
    assert text2 is None and tokens2 is None
    np.testing.assert_array_equal(got2, -pcm)
    audio, sent_at = wire.parse_audio(messages[2][2])
    assert sent_at == 99.25
    np.testing.assert_array_equal(audio, pcm * 0.5)
    assert wire.parse_json(messages[3][2]) == {"persona": {"text_prompt": "x"}}


def test_the_reader_refuses_oversize_and_unknown_messages_before_buffering_them():
    with pytest.raises(WireError, match="exceeds"):
        MessageReader(max_body=1024).feed(wire.HEADER.pack(1 << 30, Kind.AUDIO, 1))
    with pytest.raises(WireError, match="unknown message kind"):
        MessageReader().feed(wire.HEADER.pack(0, 200, 0))
    with pytest.raises(WireError, match="not one frame"):
        wire.parse_audio(b"\x00" * 100)
    with pytest.raises(WireError, match="JSON"):
        wire.parse_json(b"\xff\xfe")


def test_personas_cross_the_wire_whole_and_bad_ones_are_persona_errors():
    persona = Persona(text_prompt="You sell anvils.", voice="NATF2", sampling=Sampling(text_topk=3), seed=5)
    assert wire.persona_from_json(wire.persona_to_json(persona)) == persona
    for bad in (
        "a string",
        {"text_prompt": 3},
        {"seed": "7"},
        {"seed": True},
        {"sampling": {"nope": 1}},
        {"sampling": {"text_topk": 0}},
    ):
        with pytest.raises(PersonaError):
            wire.persona_from_json(bad)


def test_placement_prefers_a_warm_cache_but_spreads_load():
    assert choose_worker([Candidate("a", 0, True), Candidate("b", 0, False)]) is None
    # the persona is cached on a: a wins while it has at least half of b's free slots
    assert choose_worker([Candidate("a", 2, True), Candidate("b", 4, False)]) == "a"
    assert choose_worker([Candidate("a", 1, True), Candidate("b", 4, False)]) == "b"
    # otherwise the emptiest, and equal workers take turns
    assert choose_worker([Candidate("a", 1, False), Candidate("b", 3, False)]) == "b"
    turns = {choose_worker([Candidate("a", 2, False), Candidate("b", 2, False)], t) for t in range(4)}
    assert turns == {"a", "b"}


def test_placement_skips_a_saturated_worker_whatever_its_free_slots():
    """A worker without real-time headroom takes no new call, even a warm, empty one."""
    assert choose_worker([Candidate("a", 8, True, saturated=True), Candidate("b", 1, False)]) == "b"
    assert choose_worker([Candidate("a", 8, False, saturated=True)]) is None


def test_refusals_keep_their_type_across_the_wire():
    """REFUSED bodies carry the kind; the front-end raises what the worker's host raised."""
    for error in (
        SaturatedError("no headroom", retry_after_s=5.0),
        CapacityError("full", retry_after_s=5.0),
        TicketError("used", retry_after_s=None),
        PersonaError("no such voice"),
    ):
        back = wire.refusal_error(wire.refusal_of(error))
        assert type(back) is type(error) and str(back) == str(error)
        assert getattr(back, "retry_after_s", None) == getattr(error, "retry_after_s", None)
    assert wire.refusal_of(SaturatedError("x"))["kind"] == "saturated"


def test_fingerprints_ignore_sampling_and_seed_and_the_pt_suffix():
    a = Persona(text_prompt="p", voice="NATF2.pt", seed=1)
    b = Persona(text_prompt="p", voice="NATF2", sampling=Sampling(greedy=True), seed=2)
    assert persona_fingerprint(a) == persona_fingerprint(b)
    assert persona_fingerprint(a) != persona_fingerprint(Persona(text_prompt="q", voice="NATF2"))


def test_backoff_doubles_up_to_its_cap_and_resets_after_a_good_run():
    backoff = Backoff(initial=0.5, maximum=4.0, reset_after=60.0)
    assert [backoff.delay(1.0) for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert backoff.delay(120.0) == 0.5


def test_input_pieces_cross_the_wire_before_the_first_frame():
    """A phone call whose carrier sends 100 ms messages tells its session so (issue 27); on a
    cluster the front-end tells the worker's session, before any of the input reaches it."""
    import asyncio

    from personaplex_voice.cluster.remote_session import RemoteSession, RemoteSessionConfig

    reader = MessageReader()
    (kind, channel, body), *_ = reader.feed(wire.pieces_message(4, 2400))
    assert (kind, channel, wire.parse_pieces(body)) == (Kind.PIECES, 4, 2400)
    with pytest.raises(WireError, match="4 bytes"):
        wire.parse_pieces(b"\x00")

    class Channel:
        def __init__(self) -> None:
            self.sent: list[tuple[str, int]] = []

        def send_pieces(self, samples: int) -> None:
            self.sent.append(("pieces", samples))

        def send_audio(self, frame, sent_at: float) -> None:
            self.sent.append(("audio", len(frame)))

    loop = asyncio.new_event_loop()
    try:
        config = RemoteSessionConfig(realtime=True, output_frames=8, max_input_samples=24000)
        session = RemoteSession(config, None, loop=loop, on_end=lambda *_: None)
        session.expect_input_pieces(0.1)
        session.push(np.zeros(2400, np.float32))  # held: the worker does not hold the session yet
        channel = Channel()
        session.placing(channel)
        session.worker_opened({})
        assert channel.sent == [("pieces", 2400), ("audio", FRAME_SIZE)]
    finally:
        loop.close()
