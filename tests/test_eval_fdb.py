"""Full-Duplex-Bench samples: `fdb:` scenarios play one stimulus each, are exported one event per
sample in FDB's layout (stable ids, FDB's annotation files), and score what they were built to
score under FDB's rules, restated here from its published scorers (v1_v1.5/evaluation/
eval_pause_handling.py, eval_smooth_turn_taking.py, eval_user_interruption.py and
get_transcript/asr.py) and fed word timings from the recogniser, as `asr.py` would write them.
A whole call (greeting first) is refused as a sample, or left out with a warning."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import soundfile
from support_eval import load, run, scenario_file, scripted_engine

from personaplex_voice.cli import main
from personaplex_voice.eval.recognizer import Recognizer
from personaplex_voice.eval.vad import Segment
from personaplex_voice.eval.yaml_source import ScenarioError

pytestmark = pytest.mark.timeout(300)

FRAME_S = 0.08
SAMPLES = """
defaults:
  persona: {text_prompt: "You enjoy having a good conversation.", voice: NATF2}
scenarios:
  - name: long-pause
    fdb: pause_handling
    script:
      - say: "My address is twenty three Oak Street"
      - pause: 2.5s
      - say: "apartment nine"
  - name: short-pause
    fdb: {task: pause_handling, id: 7}
    script:
      - say: "My address is twenty three Oak Street"
      - pause: 0.25s
      - say: "apartment nine"
  - name: answer
    fdb: smooth_turn_taking
    script:
      - say: "When is my next pickup?"
      - silence: 4s
  - name: cut-in
    fdb: user_interruption
    script:
      - say: "Tell me about the recycling rules"
      - barge_in: {after_agent_speech_ms: 600, say: "Sorry, what about glass?"}
      - silence: 4s
  - name: monologue
    fdb: {task: backchannel, id: 12}
    script:
      - say: "So we moved here last spring and the bins were a mess"
      - pause: 0.3s
      - say: "and nobody told us the rules"
"""


# ---- FDB's rules, restated for the test from its scorers (not from personaplex_voice) ----------


def asr_output_json(wav: Path, crop_at: float = 0.0) -> dict:
    """What `get_transcript/asr.py` writes: the words of output.wav (from `crop_at` on, for
    `--task user_interruption`) as chunks with [start, end] on the sample's timeline. The
    stand-in for FDB's recogniser is pocketsphinx on where the clean file has sound (it invents
    words in digital silence, which FDB's recogniser does not)."""
    pcm, rate = soundfile.read(wav, dtype="float32")
    assert rate == 16000
    pcm = pcm[round(crop_at * rate) :]
    loud = np.flatnonzero(np.abs(pcm) > 1e-3)
    spans = []
    for i in loud:
        if spans and i / rate - spans[-1][1] < 0.3:
            spans[-1][1] = (i + 1) / rate
        else:
            spans.append([i / rate, (i + 1) / rate])
    words = Recognizer().words(pcm, [Segment(a, b) for a, b in spans])
    chunks = [{"text": w.text, "timestamp": [w.start + crop_at, w.end + crop_at]} for w in words]
    return {"text": " ".join(c["text"] for c in chunks), "chunks": chunks}


def fdb_takes_turn(chunks: list[dict]) -> int:
    """eval_*.py: no words, or under 1 s from the first start to the last end with at most 3
    words, is no turn (TOR 0)."""
    if not chunks:
        return 0
    if chunks[-1]["timestamp"][1] - chunks[0]["timestamp"][0] < 1 and len(chunks) <= 3:
        return 0
    return 1


def sound_edges(wav: Path) -> tuple[float, float]:
    pcm, rate = soundfile.read(wav, dtype="float32")
    loud = np.flatnonzero(np.abs(pcm) > 1e-3)
    return loud[0] / rate, (loud[-1] + 1) / rate


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict:
    import asyncio

    root = tmp_path_factory.mktemp("fdb")
    scenarios = load(root, SAMPLES)
    engine = scripted_engine(5, respond_ms=400, stop_ms=240)
    summary, _ = asyncio.run(run(scenarios, root / "out", engine, fdb_dir=root / "fdb"))
    return {
        "fdb": root / "fdb",
        "summary": summary,
        "index": json.loads((root / "fdb/index.json").read_text()),
    }


def test_each_sample_is_one_folder_with_a_stable_id_in_fdbs_layout(exported):
    fdb, index = exported["fdb"], exported["index"]
    assert index["samples"] == {
        "r1/backchannel/12": {"call": "monologue-r1", "scenario": "monologue", "repeat": 1, "seed": 0},
        "r1/pause_handling/0": {"call": "long-pause-r1", "scenario": "long-pause", "repeat": 1, "seed": 0},
        "r1/pause_handling/7": {"call": "short-pause-r1", "scenario": "short-pause", "repeat": 1, "seed": 0},
        "r1/smooth_turn_taking/0": {"call": "answer-r1", "scenario": "answer", "repeat": 1, "seed": 0},
        "r1/user_interruption/0": {"call": "cut-in-r1", "scenario": "cut-in", "repeat": 1, "seed": 0},
    }
    assert index["skipped"] == {} and index["not_samples"] == []
    annotation = {"pause_handling": "pause.json", "smooth_turn_taking": "turn_taking.json"}
    annotation["user_interruption"] = "interrupt.json"
    for sample in index["samples"]:
        folder = fdb / sample
        task = sample.split("/")[1]
        # The scorers open every entry of a task folder as a sample folder: nothing else is there.
        assert all(p.is_dir() for p in folder.parent.iterdir())
        expected = {"input.wav", "output.wav"} | ({annotation[task]} if task in annotation else set())
        assert {p.name for p in folder.iterdir()} == expected
        inp, out = soundfile.info(folder / "input.wav"), soundfile.info(folder / "output.wav")
        assert (inp.samplerate, inp.channels, out.samplerate, out.channels) == (16000, 1, 16000, 1)
        assert inp.frames == out.frames
    (cut,) = json.loads((fdb / "r1/user_interruption/0/interrupt.json").read_text())
    assert (
        cut["context"] == "Tell me about the recycling rules"
        and cut["interrupt"] == "Sorry, what about glass?"
    )
    assert 0 < cut["timestamp"][0] < cut["timestamp"][1]


def test_pause_takeover_is_scored_where_the_agent_spoke_in_the_pause_and_only_there(exported):
    fdb = exported["fdb"]
    scores = {}
    for sample in ("r1/pause_handling/0", "r1/pause_handling/7"):
        chunks = asr_output_json(fdb / sample / "output.wav")["chunks"]
        scores[sample] = fdb_takes_turn(chunks)
    # The agent answers 400 ms after the caller stops: inside the 2.5 s pause, never in the 0.25 s one.
    assert scores == {"r1/pause_handling/0": 1, "r1/pause_handling/7": 0}
    (long_pause,) = json.loads((fdb / "r1/pause_handling/0/pause.json").read_text())
    first_words = asr_output_json(fdb / "r1/pause_handling/0/output.wav")["chunks"][0]["timestamp"][0]
    assert long_pause["timestamp"][0] < first_words < long_pause["timestamp"][1]
    # Our own computation of FDB's measure agrees, named as FDB names it.
    by_name = {sr.scenario.name: sr for sr in exported["summary"].scenarios}
    assert by_name["long-pause"].calls[0].fdb.tor == 1 and by_name["short-pause"].calls[0].fdb.tor == 0
    assert by_name["long-pause"].aggregates["fdb_tor"]["mean"] == 1.0


def test_turn_taking_latency_is_the_built_one_within_a_frame(exported):
    folder = exported["fdb"] / "r1/smooth_turn_taking/0"
    (turn,) = json.loads((folder / "turn_taking.json").read_text())
    chunks = asr_output_json(folder / "output.wav")["chunks"]
    assert fdb_takes_turn(chunks) == 1
    fdb_latency = chunks[0]["timestamp"][0] - turn["timestamp"][0]  # eval_smooth_turn_taking.py
    # Built: the agent's first sound after the caller's last (the clean wideband audio of the sample).
    _, caller_end = sound_edges(folder / "input.wav")
    agent_start, _ = sound_edges(folder / "output.wav")
    built = agent_start - caller_end
    assert 0.3 < built < 0.8
    assert abs(fdb_latency - built) <= FRAME_S, (fdb_latency, built)
    (call,) = {sr.scenario.name: sr for sr in exported["summary"].scenarios}["answer"].calls
    assert call.fdb.tor == 1 and abs(call.fdb.latency_s - built) <= FRAME_S
    assert abs(call.measures.turns[0].response_ms / 1000 - built) <= FRAME_S  # our response latency


def test_interruption_is_scored_on_what_follows_it(exported):
    folder = exported["fdb"] / "r1/user_interruption/0"
    (cut,) = json.loads((folder / "interrupt.json").read_text())
    end = cut["timestamp"][1]
    chunks = asr_output_json(folder / "output.wav", crop_at=end)["chunks"]  # asr.py --task user_interruption
    assert fdb_takes_turn(chunks) == 1
    latency = chunks[0]["timestamp"][0] - end
    (call,) = {sr.scenario.name: sr for sr in exported["summary"].scenarios}["cut-in"].calls
    assert call.fdb.tor == 1 and abs(call.fdb.latency_s - latency) <= FRAME_S
    # Our stop latency is a different measure under its own name: how long the agent talked on.
    assert call.measures.turns[1].stop_ms is not None and call.measures.turns[1].stop_ms > 0


def test_whole_calls_are_refused_or_left_out_with_a_warning(tmp_path, capsys):
    whole = scenario_file(
        tmp_path,
        """
        defaults:
          persona: {text_prompt: "You answer the phone.", voice: NATF2}
        scenarios:
          - name: call
            script: [{silence: 1s}, {say: "Hello?"}, {silence: 1s}]
        """,
        "whole.yaml",
    )
    args = [
        "eval",
        str(whole),
        "--engine",
        "scripted",
        "--quiet",
        "--words",
        "text",
        "--out",
        str(tmp_path / "o"),
    ]
    with pytest.raises(SystemExit) as refused:
        main([*args, "--fdb", str(tmp_path / "fdb")])
    assert refused.value.code == 2
    assert "no scenario is a Full-Duplex-Bench sample" in capsys.readouterr().err
    mixed = scenario_file(
        tmp_path,
        """
        defaults:
          persona: {text_prompt: "You answer the phone.", voice: NATF2}
        scenarios:
          - name: call
            script: [{silence: 1s}, {say: "Hello?"}, {silence: 1s}]
          - name: sample
            fdb: smooth_turn_taking
            script: [{say: "Hello?"}, {silence: 1.5s}]
        """,
        "mixed.yaml",
    )
    args[1] = str(mixed)
    main([*args, "--fdb", str(tmp_path / "fdb"), "--fail-under", "0"])
    assert "left out: call" in capsys.readouterr().err
    index = json.loads((tmp_path / "fdb/index.json").read_text())
    assert list(index["samples"]) == ["r1/smooth_turn_taking/0"] and index["not_samples"] == ["call"]


@pytest.mark.parametrize(
    ("fdb", "script", "problem"),
    [
        ("pause_handling", '[{silence: 2s}, {say: "a"}, {pause: 1s}, {say: "b"}]', "starts with its speech"),
        ("pause_handling", '[{say: "a"}, {pause: 1s}, {say: "b"}, {silence: 2s}]', "ending on speech"),
        ("smooth_turn_taking", '[{say: "a"}, {silence: 1s}, {say: "b"}, {silence: 1s}]', "one speech step"),
        ("user_interruption", '[{say: "a"}, {silence: 1s}]', "interrupting speech"),
        ("backchannel", '[{say: "a"}]', "backchannel needs an id"),
        (
            "{task: pause_handling, number: 3}",
            '[{say: "a"}, {pause: 1s}, {say: "b"}]',
            "unknown key 'number'",
        ),
        ("smooth_turn_taking", '[{say: "a"}, {dtmf: "1"}]', "no dtmf"),
    ],
)
def test_a_scenario_that_is_not_one_event_is_refused_at_load(tmp_path, fdb, script, problem):
    text = f"""
    scenarios:
      - name: s
        persona: {{text_prompt: "x", voice: NATF2}}
        fdb: {fdb}
        script: {script}
    """
    with pytest.raises(ScenarioError, match=problem):
        load(tmp_path, text)


def test_ids_are_unique_per_task_and_the_old_key_points_to_the_new_one(tmp_path):
    twice = """
    defaults:
      persona: {text_prompt: "x", voice: NATF2}
    scenarios:
      - {name: a, fdb: {task: smooth_turn_taking, id: 3}, script: [{say: "a"}, {silence: 1s}]}
      - {name: b, fdb: {task: smooth_turn_taking, id: 3}, script: [{say: "b"}, {silence: 1s}]}
    """
    with pytest.raises(ScenarioError, match="id 3 is already used"):
        load(tmp_path, twice)
    old = """
    scenarios:
      - {name: a, persona: {text_prompt: "x", voice: NATF2}, fdb_task: pause_handling, script: [{say: "a"}]}
    """
    with pytest.raises(ScenarioError, match="fdb_task is now `fdb: <task>`"):
        load(tmp_path, old)


def test_an_fdb_sample_folder_plays_its_input_and_keeps_its_annotation(tmp_path):
    sample = tmp_path / "candor_turn_taking" / "42"
    sample.mkdir(parents=True)
    soundfile.write(sample / "input.wav", np.zeros(16000, np.float32), 16000)
    (sample / "turn_taking.json").write_text('[{"text": "[TURN-TAKING]", "timestamp": [0.5, 0.9]}]')
    (scenario,) = load(
        tmp_path,
        """
        scenarios:
          - name: candor-42
            persona: {text_prompt: "x", voice: NATF2}
            fdb: {task: smooth_turn_taking, sample: candor_turn_taking/42}
        """,
    )
    assert scenario.fdb.id == 42 and scenario.fdb.annotation == (
        {"text": "[TURN-TAKING]", "timestamp": [0.5, 0.9]},
    )
    assert [type(s).__name__ for s in scenario.script] == ["Wav"]
    assert scenario.script[0].path == sample / "input.wav"


def test_the_fdb_example_file_is_one_sample_per_task():
    from support_eval import ROOT

    from personaplex_voice.eval.scenario import load_scenarios

    scenarios = load_scenarios([ROOT / "examples" / "eval_fdb.yaml"])
    samples = {s.name: (s.fdb.task, s.fdb.id) for s in scenarios}
    assert samples == {
        "pause-address": ("pause_handling", 0),
        "pause-recipe": ("pause_handling", 1),
        "turn-weekend": ("smooth_turn_taking", 0),
        "interrupt-books": ("user_interruption", 0),
    }
    assert "wise and friendly teacher" in scenarios[-1].spec.persona.text_prompt
