"""What `personaplex-voice eval` leaves in --out, from one run of the command on the scripted
agent: junit.xml (parsed), results.json (the words heard beside the model's text), per-call
stereo WAV and transcripts, the exit status against --fail-under, and report.html in Chromium.
The Full-Duplex-Bench export: test_eval_fdb.py."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import soundfile
from support_browser import CHROMIUM, FLAGS
from support_eval import scenario_file

from personaplex_voice.cli import main

pytestmark = pytest.mark.timeout(240)

SCENARIOS = """
defaults:
  persona: {text_prompt: "You answer the phone for a shop.", voice: NATF2}
scenarios:
  - name: greeting
    line: twilio
    script:
      - silence: 3.2s
      - say: "Hi."
      - silence: 0.8s
    expect:
      agent_says: ["how can i"]
      agent_never_says: ["goodbye"]
  - name: question
    script:
      - silence: 3.2s
      - say: "Do you sell running shoes?"
      - pause: 0.3s
      - say: "In size ten?"
      - silence: 1.6s
    expect:
      responds_within_ms: 150
      max_pause_takeovers: 0
  - name: interrupt
    line: browser
    script:
      - silence: 0.4s
      - barge_in: {after_agent_speech_ms: 500, say: "Sorry, one moment."}
      - silence: 1.2s
    expect:
      stops_within_ms: 400
"""
REPEAT = 2


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("eval-outputs")
    path = scenario_file(root, SCENARIOS)
    out = root / "out"
    args = ["eval", str(path), "--out", str(out), "--engine", "scripted", "--repeat", str(REPEAT), "--quiet"]
    main([*args, "--fail-under", "0.5"])  # returns: the pass rate is above a half
    with pytest.raises(SystemExit) as strict:
        main([*args, "--out", str(root / "strict")])  # the default: every check must pass
    return {
        "out": out,
        "strict_exit": strict.value.code,
        "results": json.loads((out / "results.json").read_text()),
    }


def test_exit_status_follows_fail_under(run):
    assert run["strict_exit"] == 1
    results = run["results"]
    passed, total = results["checks"]["passed"], results["checks"]["total"]
    assert total == 5 * REPEAT
    assert results["pass_rate"] == pytest.approx(passed / total, abs=1e-4)
    assert 0.5 <= results["pass_rate"] < 1.0


def test_junit_has_one_testcase_per_expectation(run):
    root = ET.parse(run["out"] / "junit.xml").getroot()
    assert root.tag == "testsuites"
    suites = {s.get("name"): s for s in root.findall("testsuite")}
    assert set(suites) == {"greeting", "question", "interrupt"}
    cases = {(s, c.get("name")): c for s, suite in suites.items() for c in suite.findall("testcase")}
    assert set(cases) == {
        ("greeting", "agent_says /how can i/"),
        ("greeting", "agent_never_says /goodbye/"),
        ("question", "responds_within_ms 150"),
        ("question", "max_pause_takeovers 0"),
        ("interrupt", "stops_within_ms 400"),
    }
    assert int(root.get("tests")) == 5
    # The scripted agent answers 300 ms after it hears the caller stop: the 150 ms promise fails.
    failure = cases[("question", "responds_within_ms 150")].find("failure")
    assert failure is not None and "held in 0 of 2 repeats" in failure.get("message")
    assert re.search(r"repeat 1: turn 2 \(say 'In size ten\?'\): answered after [2-5]\d\d ms", failure.text)
    for key in [("greeting", "agent_says /how can i/"), ("interrupt", "stops_within_ms 400")]:
        assert cases[key].find("failure") is None, key
    assert int(root.get("failures")) == sum(c.find("failure") is not None for c in cases.values())
    assert cases[("question", "max_pause_takeovers 0")].get("line") == "22"


def test_results_and_call_files(run):
    out, results = run["out"], run["results"]
    by_name = {s["scenario"]: s for s in results["scenarios"]}
    assert [c["repeat"] for c in by_name["question"]["calls"]] == [1, 2]
    assert [c["seed"] for c in by_name["question"]["calls"]] == [0, 1]
    agg = by_name["question"]["aggregates"]["response_ms"]
    assert agg["n"] == REPEAT and 200 <= agg["mean"] <= 550 and agg["p90"] >= agg["mean"]
    stop = by_name["interrupt"]["aggregates"]["stop_ms"]
    assert (
        stop["n"] == REPEAT and 150 <= stop["mean"] <= 340
    )  # the scripted agent stops 200 ms after it hears

    for scenario, rate in (("greeting", 8000), ("question", 24000), ("interrupt", 24000)):
        for call in by_name[scenario]["calls"]:
            info = soundfile.info(out / call["files"]["wav"])
            assert (info.channels, info.samplerate) == (2, rate)
            assert info.duration == pytest.approx(call["duration_s"], abs=0.01)
            transcript = json.loads((out / call["files"]["transcript"]).read_text())
            assert transcript["agent_text"] == call["agent_text"]
            assert transcript["agent_heard"] == call["agent_heard"]
    greeting = by_name["greeting"]["calls"][0]
    assert "How can I help" in greeting["agent_text"]  # what the model meant
    assert "how can i" in greeting["agent_heard"]["text"]  # what the caller heard
    assert results["run"]["words"] == "heard"
    question = json.loads((out / by_name["question"]["calls"][0]["files"]["transcript"]).read_text())
    assert [t["text"] for t in question["caller"]] == ["Do you sell running shoes?", "In size ten?"]
    assert (
        "caller: In size ten?"
        in (out / by_name["question"]["calls"][0]["files"]["transcript_txt"]).read_text()
    )


@pytest.mark.browser
def test_report_opens_offline_in_chromium_with_plots(run, artifacts_dir: Path):
    from playwright.sync_api import sync_playwright

    report = run["out"] / "report.html"
    page_html = report.read_text()
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page_html)  # nothing from the network
    assert page_html.count('<svg class="timeline"') == 3 * REPEAT
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            problems: list[str] = []
            page.on("pageerror", lambda exc: problems.append(f"pageerror: {exc}"))
            page.on(
                "console", lambda msg: problems.append(msg.text) if msg.type in ("error", "warning") else None
            )
            page.on(
                "request",
                lambda req: problems.append(f"request: {req.url}") if req.url.startswith("http") else None,
            )
            page.goto(report.as_uri())
            page.wait_for_function(
                "[...document.querySelectorAll('audio')].every(a => a.readyState >= 1 && a.duration > 0)",
                timeout=30_000,
            )
            shown = page.evaluate(
                """() => [...document.querySelectorAll('svg.timeline')].map(svg => {
                    const box = svg.getBoundingClientRect();
                    return [box.width, box.height, svg.querySelectorAll('polygon').length,
                            svg.querySelectorAll('rect').length, svg.querySelectorAll('text.word').length];
                })"""
            )
            assert len(shown) == 3 * REPEAT
            for width, height, waves, rects, _words in shown:
                assert width > 800 and height > 150 and waves == 2 and rects >= 1
            assert sum(s[4] for s in shown) > 0  # the agent's words are on the plots
            durations = page.evaluate("[...document.querySelectorAll('audio')].map(a => a.duration)")
            calls = [c for s in run["results"]["scenarios"] for c in s["calls"]]
            assert durations == pytest.approx([c["duration_s"] for c in calls], abs=0.1)
            # A click on a timeline seeks its player; the playhead follows.
            svg = page.locator("svg.timeline").first
            box = svg.bounding_box()
            svg.click(position={"x": box["width"] * 0.75, "y": box["height"] / 2})
            page.wait_for_function("document.querySelector('audio').currentTime > 1.0")
            x = float(page.get_attribute(".playhead", "x1"))
            assert x > 500
            badges = page.locator(".badge.fail").count()
            assert badges >= 1 and page.locator(".badge.pass").count() >= 1
            page.screenshot(path=str(artifacts_dir / "eval_report.png"), full_page=True)
            assert not problems, problems
        finally:
            browser.close()
