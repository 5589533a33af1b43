"""`eval --url`: the same scenarios against a real server (`serve --engine echo` under uvicorn),
in real time over /api/chat with Ogg-Opus, end to end. The echo's text stream ("echo engine")
is not what its audio says (the caller's own words), so the words checks here judge the text
(`--words text`); the recogniser on the agent's audio: test_eval_words.py."""

from __future__ import annotations

import json

import pytest
from support_eval import scenario_file
from support_server import running_server

from personaplex_voice.cli import main

pytestmark = pytest.mark.timeout(240)

SCENARIOS = """
defaults:
  persona:
    text_prompt: "You repeat what you hear."
    voice: NATF2
    actions:
      - {on_dtmf: "0", do: transfer, to: "+15551230099"}
scenarios:
  - name: echo
    line: twilio
    script:
      - silence: 0.4s
      - say: "Hello there, this is a test of the line."
      - silence: 1.2s
    expect:
      agent_says: ["echo engine"]
      agent_never_says: ["goodbye"]
  - name: keys
    script:
      - silence: 0.6s
      - dtmf: "0"
      - silence: 1.5s
    expect:
      action: transfer
"""


def test_url_mode_runs_the_scenarios_against_a_served_echo(tmp_path):
    path = scenario_file(tmp_path, SCENARIOS)
    out = tmp_path / "out"
    with running_server("--max-sessions", "2") as server:
        main(
            [
                "eval",
                str(path),
                "--url",
                f"{server.ws_url}/api/chat",
                "--out",
                str(out),
                "--concurrency",
                "2",
                "--quiet",
                "--words",
                "text",
            ]
        )
        assert server.alive()
    results = json.loads((out / "results.json").read_text())
    assert results["pass_rate"] == 1.0 and results["checks"] == {"passed": 3, "total": 3}
    run = results["run"]
    assert run["mode"] == "url" and run["url"].endswith("/api/chat") and run["words"] == "text"
    assert run["x_realtime"] <= 2.5  # two calls at once, each paced in real time
    by_name = {s["scenario"]: s["calls"][0] for s in results["scenarios"]}

    echo = by_name["echo"]
    assert echo["error"] is None and echo["duration_s"] == pytest.approx(0.4 + 2.0 + 1.2, abs=0.8)
    (turn,) = echo["turns"]
    (caller,) = echo["vad"]["caller"]
    agent = echo["vad"]["agent"]
    assert turn["heard"] and agent, echo
    # The echo says back what the caller said: its speech starts and ends a round trip later.
    delay_start = agent[0][0] - caller[0]
    delay_end = agent[-1][1] - caller[1]
    assert 0.08 <= delay_start <= 1.0 and 0.08 <= delay_end <= 1.0, (caller, agent)
    assert "echo engine" in echo["agent_text"]

    keys = by_name["keys"]
    assert [(a["kind"], a["trigger"]) for a in keys["actions"]] == [("transfer", "dtmf 0")]
    assert keys["ended_by"] == "action transfer to +15551230099 (dtmf 0)"
    assert keys["duration_s"] == pytest.approx(0.6, abs=0.01)
