"""eval's measures against the audio's own timing: the scripted agent (it hears with silero-vad)
answers about N ms after the caller stops and stops about M ms after a barge-in, as its ears let
it; each call's line is tapped for the clean audio, and the measures (silero-vad and boundary
refinement on what crossed the line) must equal the clean audio's timing within one frame, on
the wideband and the Twilio line. Noisy, many-voiced calls: test_eval_validation.py."""

from __future__ import annotations

import pytest
from support_eval import load, run, run_tapped, scripted_engine

from personaplex_voice.eval.measures import (
    TEXT_SLACK,
    Piece,
    ScriptPause,
    ScriptTurn,
    measure,
    words_of_pieces,
)
from personaplex_voice.eval.vad import Segment

pytestmark = pytest.mark.timeout(240)

FRAME_MS = 80
N_MS, M_MS = 560, 320

TIMING = """
defaults:
  persona: {text_prompt: "You answer the phone.", voice: NATF2}
scenarios:
  - name: meets-wideband
    line: wideband
    script: &script
      - silence: 0.6s
      - say: "Hello, I would like to know when my next pickup is."
      - silence: 2.2s
      - barge_in: {after_agent_speech_ms: 500, say: "Sorry, I meant the recycling."}
      - silence: 1.6s
    expect: &meets
      responds_within_ms: 900
      stops_within_ms: 600
      agent_says: ["closed on sunday"]
  - name: misses-wideband
    line: wideband
    script: *script
    expect: &misses
      responds_within_ms: 300
      stops_within_ms: 200
      agent_never_says: ["sunday"]
  - name: meets-twilio
    line: twilio
    script: *script
    expect: *meets
  - name: misses-twilio
    line: twilio
    script: *script
    expect: *misses
"""


async def test_latencies_equal_the_audios_own_within_a_frame(tmp_path):
    scenarios = load(tmp_path, TIMING)
    engine = scripted_engine(4, respond_ms=N_MS, stop_ms=M_MS)
    summary, taps = await run_tapped(scenarios, tmp_path / "out", engine)
    results = {sr.scenario.name: sr for sr in summary.scenarios}
    assert set(results) == {"meets-wideband", "misses-wideband", "meets-twilio", "misses-twilio"}
    for sr in results.values():
        (call,) = sr.calls
        assert call.trace.error is None
        turns = call.measures.turns
        assert [t.kind for t in turns] == ["say", "barge_in"]
        assert all(t.heard for t in turns)
        caller, agent = taps[call.id].truth(call.trace.plan.line.rate)  # the clean audio, in the line's band
        ends = [
            max(s.end for s in caller if s.start < t.end and s.end > t.start) for t in call.trace.log.turns
        ]
        for turn, end in zip(
            turns, ends, strict=True
        ):  # the agent answers both the question and the barge-in
            true_ms = 1000 * (min(a.start for a in agent if a.start > end) - end)
            assert abs(turn.response_ms - true_ms) <= FRAME_MS, (sr.scenario.name, turn, true_ms)
            assert N_MS - 150 <= true_ms <= N_MS + 250  # the agent's own timing, as its ears allow
        barge = min(s.start for s in caller if s.end > call.trace.log.turns[1].start)
        true_stop = 1000 * (max(a.end for a in agent if a.start < barge) - barge)
        assert abs(turns[1].stop_ms - true_stop) <= FRAME_MS, (sr.scenario.name, turns[1], true_stop)

    for line in ("wideband", "twilio"):
        meets, misses = results[f"meets-{line}"], results[f"misses-{line}"]
        assert meets.passed and all(e.passed for e in meets.expectations)
        assert [e.passed for e in misses.expectations] == [False, False, False]
        by_label = {e.label: e.failures[0][1] for e in misses.expectations}
        assert "turn 1 (say 'Hello, I would like to know when my nex…')" in by_label["responds_within_ms 300"]
        assert "answered after" in by_label["responds_within_ms 300"]
        assert "turn 2 (barge-in 'Sorry, I meant the recycling.')" in by_label["stops_within_ms 200"]
        assert "went on for" in by_label["stops_within_ms 200"]
        assert "the agent was heard saying 'sunday'" in by_label["agent_never_says /sunday/"]


PAUSES = """
scenarios:
  - name: pauses
    persona: {text_prompt: "You answer the phone.", voice: NATF2}
    script:
      - say: "My address is"
      - pause: 0.25s
      - say: "twenty three Oak Street"
      - pause: 2.2s
      - say: "apartment nine."
      - silence: 1.5s
    expect:
      max_pause_takeovers: 0
"""


async def test_a_pause_longer_than_the_agents_wait_is_taken_over_and_named(tmp_path):
    summary, _ = await run(
        load(tmp_path, PAUSES), tmp_path / "out", scripted_engine(1, respond_ms=400, stop_ms=240)
    )
    (sr,) = summary.scenarios
    (call,) = sr.calls
    pauses = call.measures.pauses
    assert [p.after_turn for p in pauses] == [1, 2]
    assert [p.taken_over for p in pauses] == [False, True]
    assert 400 - 150 <= (pauses[1].agent_start - pauses[1].start) * 1000 <= 400 + 250
    (exp,) = sr.expectations
    assert not exp.passed
    assert "took the floor in 1 of 2 pauses" in exp.failures[0][1]
    assert "the pause after turn 2" in exp.failures[0][1]
    # The caller came back while the agent spoke: a barge-in the measures see as such.
    assert call.measures.turns[2].then == "answer"


ACTIONS = """
defaults:
  persona:
    text_prompt: "You answer the phone."
    voice: NATF2
    actions:
      - {on_dtmf: "0", do: transfer, to: "+15551230099"}
      - {on_agent_text: "transfer you", do: hangup, after_s: 0.4}
scenarios:
  - name: keys
    script:
      - silence: 0.5s
      - dtmf: "0"
      - silence: 1.5s
    expect: {action: transfer}
  - name: words
    script:
      - say: "Can I talk to a person?"
      - silence: 4s
      - say: "Hello?"
      - silence: 1s
    expect: {action: hangup}
  - name: quiet
    script:
      - silence: 1s
    expect: {action: none}
"""


async def test_action_rules_fire_as_on_a_call_and_end_it(tmp_path):
    summary, traces = await run(load(tmp_path, ACTIONS), tmp_path / "out", scripted_engine(3, respond_ms=300))
    by_name = {t.plan.scenario.name: t for t in traces}
    keys = by_name["keys"]
    assert [(a.kind, a.trigger) for a in keys.actions] == [("transfer", "dtmf 0")]
    assert keys.actions[0].t == pytest.approx(0.5)
    assert keys.duration_s == pytest.approx(0.5)  # a transfer takes the caller away at once
    assert keys.ended_by == "action transfer to +15551230099 (dtmf 0)"

    words = by_name["words"]
    (hangup,) = words.actions
    assert hangup.kind == "hangup" and hangup.trigger == "agent said 'transfer you'"
    text, said = "", None
    for piece in words.pieces:  # the rule sees the text as it streams: it fires on the piece completing it
        text += piece.text
        if "transfer you" in text:
            said = piece.t
            break
    assert hangup.t == pytest.approx(said + 0.4, abs=1e-6)
    assert words.duration_s == pytest.approx(hangup.t, abs=1 / 8000)
    assert all(t.text != "Hello?" for t in words.log.turns)  # cut before the caller's second line

    assert by_name["quiet"].actions == []
    assert all(sr.passed for sr in summary.scenarios)


def test_measure_definitions_on_known_segments():
    """Backchannel, talk-over, overlap and no-answer, from hand-made segments."""
    turns = [
        ScriptTurn(1, "say", "one", 1.0, 4.0, "answer"),
        ScriptTurn(2, "say", "two", 8.0, 10.0, "answer"),
    ]
    caller = [Segment(1.0, 4.0), Segment(8.0, 10.0)]
    agent = [
        Segment(2.0, 2.4),  # short, one word: a backchannel
        Segment(3.5, 5.5),  # starts during the caller's speech: 0.5 s of talk-over, answers at -500 ms
        Segment(9.0, 9.3),  # short, but three words: not a backchannel; talk-over 0.3 s
    ]
    pieces = [Piece(2.0, " mhm"), Piece(3.6, " well then"), Piece(9.0, " a b c")]
    words = words_of_pieces(pieces)
    m = measure(turns, [ScriptPause(1, 4.0, 8.0)], caller, agent, words, duration_s=12.0, slack=TEXT_SLACK)
    one, two = m.turns
    assert one.backchannels == 1 and two.backchannels == 0
    assert one.talk_over_ms == pytest.approx(500) and two.talk_over_ms == pytest.approx(300)
    assert m.talk_over_ms == pytest.approx(800)
    assert m.overlap_ms == pytest.approx(400 + 500 + 300)
    assert one.response_ms == pytest.approx(-500)
    assert two.response_ms is None  # the short segment began during the caller's speech and ended first
    assert m.pauses[0].taken_over is False  # nothing started in the 4-8 s silence
    assert m.agent_words == 6
