"""Scenario files: what loads, and how a bad one is refused (one line: file, line, problem;
exit status 2; no traceback)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from support_eval import scenario_file

from personaplex_voice.cli import main
from personaplex_voice.eval.scenario import load_scenarios
from personaplex_voice.eval.steps import Dtmf, Pause, Say, Silence
from personaplex_voice.eval.suite import plan_calls
from personaplex_voice.eval.yaml_source import ScenarioError

GOOD = """
personas_file: personas.yaml
defaults:
  persona: shop
  line: twilio
  variables: {customer_name: Omar}
scenarios:
  - name: one
    caller: {voice: en-gb, rate: 150}
    script:
      - silence: 1.5s
      - say: {text: "Hello there.", pitch: 30}
      - pause: 800ms
      - say: Bye
      - dtmf: 0
      - silence: 2
    expect:
      agent_says: ["hello", "shop"]
      responds_within_ms: 900
      max_pause_takeovers: 0
      action: transfer
  - name: two
    persona: {text_prompt: "Inline.", voice: NATF2, seed: 7}
    line: wideband
    script: [{silence: 1s}]
"""

PERSONAS = """
default: shop
personas:
  shop:
    text_prompt: "You sell shoes to {customer_name} who calls from {From}."
    variables: {customer_name: "a customer"}
    voice: NATF1
    seed: 100
    actions:
      - {on_dtmf: "0", do: transfer, to: "+15551230099"}
"""


def test_a_good_file_loads_with_defaults_templates_and_seeds(tmp_path):
    scenario_file(tmp_path, PERSONAS, "personas.yaml")
    one, two = load_scenarios([scenario_file(tmp_path, GOOD)])
    assert (one.name, one.line, one.persona_name) == ("one", "twilio", "shop")
    assert [type(s) for s in one.script] == [Silence, Say, Pause, Say, Dtmf, Silence]
    assert one.script[1].voice.voice == "en-gb" and one.script[1].voice.pitch == 30
    assert one.script[2].seconds == pytest.approx(0.8) and one.script[5].seconds == 2
    assert one.script[4].keys == "0"
    assert [e.label for e in one.expectations] == [
        "agent_says /hello/",
        "agent_says /shop/",
        "responds_within_ms 900",
        "max_pause_takeovers 0",
        "action transfer",
    ]
    assert two.line == "wideband" and two.persona_name == "two-persona"
    plans = plan_calls([one, two], repeat=2, base_seed=5)
    assert [p.seed for p in plans] == [100, 101, 7, 8]  # the persona's seed, else --seed, then + repeat
    assert plans[0].persona.text_prompt == "You sell shoes to Omar who calls from +15550100000."
    assert plans[0].persona.voice == "NATF1" and plans[1].persona.seed == 101
    assert [p.line.name for p in plan_calls([one], line="browser")] == ["browser"]


BAD = [
    # (problem in the file, line, words the message must hold)
    (
        "unknown key",
        "scenarios:\n  - name: a\n    persona: {text_prompt: x}\n    script: [{silence: 1s}]\n"
        "    expect: {respond_within_ms: 500}\n",
        5,
        "unknown key 'respond_within_ms' in expect (did you mean 'responds_within_ms'?)",
    ),
    (
        "bad duration",
        "scenarios:\n  - name: a\n    persona: {text_prompt: x}\n    script:\n      - silence: 1s\n"
        "      - silence: two seconds\n",
        6,
        "bad duration 'two seconds' for silence",
    ),
    (
        "missing persona",
        "scenarios:\n  - name: a\n    script: [{silence: 1s}]\n",
        2,
        "scenario 'a' has no persona",
    ),
    (
        "unknown persona",
        "personas_file: personas.yaml\nscenarios:\n  - name: a\n    persona: nobody\n"
        "    script: [{silence: 1s}]\n",
        4,
        "unknown persona 'nobody' (the personas file has: shop)",
    ),
    (
        "bad regex",
        "scenarios:\n  - name: a\n    persona: {text_prompt: x}\n    script: [{silence: 1s}]\n"
        '    expect:\n      agent_says:\n        - ok\n        - "(unclosed"\n',
        8,
        "'(unclosed' is not a regular expression",
    ),
    ("not YAML", "scenarios:\n  - name: a\n   script: [\n", 3, "not valid YAML"),
    (
        "undeclared variable",
        "personas_file: personas.yaml\nscenarios:\n  - name: a\n    persona: shop\n"
        "    variables: {custmer_name: x}\n    script: [{silence: 1s}]\n",
        5,
        "does not declare the variable 'custmer_name'",
    ),
    (
        "unknown line",
        "scenarios:\n  - name: a\n    persona: {text_prompt: x}\n    line: twillio\n"
        "    script: [{silence: 1s}]\n",
        4,
        "unknown line 'twillio' (did you mean 'twilio'?)",
    ),
    (
        "missing wav",
        "scenarios:\n  - name: a\n    persona: {text_prompt: x}\n    script:\n      - wav: nope.wav\n",
        5,
        "no such audio file",
    ),
    (
        "barge-in without speech",
        "scenarios:\n  - name: a\n    persona: {text_prompt: x}\n    script:\n"
        "      - barge_in: {after_agent_speech_ms: 500}\n",
        5,
        "exactly one of say: or wav:",
    ),
    (
        "expectation the script cannot meet",
        "scenarios:\n  - name: a\n    persona: {text_prompt: x}\n"
        "    script: [{silence: 1s}]\n    expect: {stops_within_ms: 300}\n",
        5,
        "needs a barge_in step",
    ),
    (
        "action the persona lacks",
        "scenarios:\n  - name: a\n    persona: {text_prompt: x}\n"
        "    script: [{silence: 1s}]\n    expect: {action: transfer}\n",
        5,
        "has no rule that can transfer",
    ),
    (
        "duplicate key",
        "scenarios:\n  - name: a\n    name: b\n    persona: {text_prompt: x}\n    script: [{silence: 1s}]\n",
        3,
        "duplicate key 'name'",
    ),
    (
        "bad dtmf",
        'scenarios:\n  - name: a\n    persona: {text_prompt: x}\n    script:\n      - dtmf: "1x"\n',
        5,
        "dtmf must be 1-20 keys",
    ),
]


@pytest.mark.parametrize(("case", "text", "line", "words"), BAD, ids=[b[0] for b in BAD])
def test_a_bad_file_is_one_line_naming_file_line_and_problem(tmp_path, capsys, case, text, line, words):
    scenario_file(tmp_path, PERSONAS, "personas.yaml")
    path = tmp_path / "bad.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ScenarioError) as raised:
        load_scenarios([path])
    assert raised.value.where == f"{path}:{line}", case
    assert words in raised.value.problem, case
    # Through the command: the same line on stderr, exit 2, nothing else.
    with pytest.raises(SystemExit) as exited:
        main(["eval", str(path), "--out", str(tmp_path / "out"), "--engine", "scripted"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err == f"error: {path}:{line}: {raised.value.problem}\n"
    assert not (tmp_path / "out").exists()


def test_the_real_command_prints_no_traceback(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(
        textwrap.dedent(
            """\
            scenarios:
              - name: a
                persona: {text_prompt: x}
                script:
                  - silence: 1 fortnight
            """
        ),
        encoding="utf-8",
    )
    done = subprocess.run(
        [sys.executable, "-m", "personaplex_voice.cli", "eval", str(path), "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert (
        done.stderr
        == f"error: {path}:5: bad duration '1 fortnight' for silence (write it like 2s, 1.5s or 800ms)\n"
    )
    assert "Traceback" not in done.stdout + done.stderr


def test_names_are_unique_across_files(tmp_path):
    a = scenario_file(
        tmp_path,
        "scenarios:\n  - name: same\n    persona: {text_prompt: x}\n    script: [{silence: 1s}]\n",
        "a.yaml",
    )
    b = scenario_file(
        tmp_path,
        "scenarios:\n  - {name: same, persona: {text_prompt: y}, script: [{silence: 1s}]}\n",
        "b.yaml",
    )
    with pytest.raises(ScenarioError, match=f"already used at {a}:2") as raised:
        load_scenarios([a, b])
    assert raised.value.where == f"{b}:2"


def test_a_voice_the_engine_lacks_is_refused_before_any_call(tmp_path, capsys):
    path = scenario_file(
        tmp_path,
        "scenarios:\n  - name: v\n    persona: {text_prompt: hi, voice: NOPE}\n    script: [{silence: 1s}]\n",
    )
    with pytest.raises(SystemExit) as exited:
        main(["eval", str(path), "--out", str(tmp_path / "out"), "--engine", "scripted", "--quiet"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}:3: scenario 'v': unknown voice 'NOPE'") and err.count("\n") == 1
    assert not (tmp_path / "out" / "results.json").exists()
