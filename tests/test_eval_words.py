"""Words heard, not words meant: `agent_says` and `agent_never_says` are decided by a speech
recogniser (pocketsphinx) on the agent's audio, with the model's own text checked beside it; a
call where the two disagree says so in the messages, results.json and the report. The scripted
agent here says one thing and streams another as its text."""

from __future__ import annotations

import itertools
import json

import pytest
from support_eval import load, run, scripted_engine

from personaplex_voice.eval.recognizer import Recognizer
from personaplex_voice.eval.speech import synthesize
from personaplex_voice.eval.steps import CallerVoice

pytestmark = pytest.mark.timeout(240)

SAID, MEANT = "We are closed on Sunday.", "Your pickup is on Tuesday."
SCENARIOS = """
defaults:
  persona: {text_prompt: "You answer the phone.", voice: NATF2}
scenarios:
  - name: words
    script:
      - say: "When are you open?"
      - silence: 3.5s
    expect:
      agent_says: ["closed on sunday", "tuesday"]
      agent_never_says: ["sunday", "pickup"]
"""


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    import asyncio

    root = tmp_path_factory.mktemp("words")
    engine = scripted_engine(1, respond_ms=300, replies=[(MEANT, SAID)])  # says SAID, streams MEANT
    summary, _ = asyncio.run(run(load(root, SCENARIOS), root / "out", engine))
    (sr,) = summary.scenarios
    (call,) = sr.calls
    return call, json.loads((root / "out/results.json").read_text()), (root / "out/report.html").read_text()


def test_the_recogniser_hears_a_clear_line_with_its_timing():
    pcm = synthesize("We are closed on Sunday.", CallerVoice(voice="en-us+f2", rate=150))
    from personaplex_voice.audio.resample import resample

    words = Recognizer().words(resample(pcm, 24000, 16000))
    assert [w.text for w in words] == ["we", "are", "closed", "on", "sunday"]
    assert words[0].start < 0.15 and abs(words[-1].end - len(pcm) / 24000) < 0.15
    assert all(a.end <= b.start + 0.011 for a, b in itertools.pairwise(words))


def test_the_audio_decides_and_the_text_is_the_second_column(checked):
    call, _, _ = checked
    assert "closed on sunday" in call.heard_text and "tuesday" not in call.heard_text
    assert "Tuesday" in call.transcript and "Sunday" not in call.transcript
    outcomes = {o.label: o for o in call.outcomes}
    said = outcomes["agent_says /closed on sunday/"]
    assert said.passed and said.by_text is False and said.disagrees
    assert said.message.startswith("heard 'closed on sunday' at ")
    assert "its own text disagrees: the agent never said /closed on sunday/" in said.message
    meant = outcomes["agent_says /tuesday/"]
    assert not meant.passed and meant.by_text is True and meant.disagrees
    assert "was never heard saying /tuesday/" in meant.message
    never = outcomes["agent_never_says /sunday/"]
    assert not never.passed and never.by_text is True and never.disagrees
    assert "the agent was heard saying 'sunday'" in never.message
    pickup = outcomes["agent_never_says /pickup/"]
    assert pickup.passed and pickup.by_text is False and pickup.disagrees
    # Word counts come from what was heard too: the answer is not a short backchannel.
    assert call.measures.agent_words == len(call.heard) >= 5


def test_results_and_report_show_both_columns_and_the_disagreements(checked):
    call, results, report = checked
    (scenario,) = results["scenarios"]
    (row,) = scenario["calls"]
    assert results["run"]["words"] == "heard" and results["run"]["recognizer_s"] > 0
    assert row["agent_heard"]["text"] == call.heard_text
    assert [w[0] for w in row["agent_heard"]["words"]] == call.heard_text.split()
    assert row["agent_text"] == call.transcript.strip()
    assert row["disagreements"] == [  # every words check: the audio and the text say opposite things
        "agent_says /closed on sunday/",
        "agent_says /tuesday/",
        "agent_never_says /sunday/",
        "agent_never_says /pickup/",
    ]
    by_label = {e["expectation"]: e for e in row["expectations"]}
    tuesday = by_label["agent_says /tuesday/"]
    assert tuesday["by_text"] is True and tuesday["disagrees"] and not tuesday["passed"]
    assert 'class="heard-words"' in report and 'class="text-words"' in report
    assert "audio and text disagree" in report
    assert report.count('class="disagree"') == 4


async def test_words_text_judges_the_models_own_text(tmp_path):
    engine = scripted_engine(1, respond_ms=300, replies=[(MEANT, SAID)])
    summary, _ = await run(load(tmp_path, SCENARIOS), tmp_path / "out", engine, words="text")
    (call,) = summary.scenarios[0].calls
    assert call.heard is None
    verdicts = {o.label: o.passed for o in call.outcomes}
    assert verdicts == {
        "agent_says /closed on sunday/": False,
        "agent_says /tuesday/": True,
        "agent_never_says /sunday/": True,
        "agent_never_says /pickup/": False,
    }
    assert all(o.by_text is None for o in call.outcomes)
