"""The shipped contact-center example (examples/eval_waste_service.yaml) loads and runs: on the
scripted agent its timing, barge-in and DTMF transfer promises hold, and the ones about words
fail, saying what the agent said instead."""

from __future__ import annotations

import pytest
from support_eval import GREETING, ROOT, run, scripted_engine

from personaplex_voice.eval.scenario import load_scenarios
from personaplex_voice.eval.suite import plan_calls

pytestmark = pytest.mark.timeout(240)

EXAMPLE = ROOT / "examples" / "eval_waste_service.yaml"


async def test_the_waste_service_example_runs_as_documented(tmp_path):
    scenarios = load_scenarios([EXAMPLE])
    assert [s.name for s in scenarios] == [
        "greeting",
        "address-question",
        "barge-in",
        "dtmf-transfer",
        "off-topic",
    ]
    assert all(s.persona_name == "waste-service" and s.line == "twilio" for s in scenarios)
    (plan, *_) = plan_calls(scenarios)
    assert "Verify customer name Omar Torres" in plan.persona.text_prompt
    assert "Upcoming pickup: Tuesday the fourteenth" in plan.persona.text_prompt
    assert "The caller's number is +15550100000" in plan.persona.text_prompt

    # The agent greets, then answers with one long sentence (a barge-in 1.2 s into it lands mid-speech).
    replies = (GREETING, "Let me look up the collection schedule for your street and your bins.")
    engine = scripted_engine(5, respond_ms=300, stop_ms=200, greet=True, replies=replies)
    summary, traces = await run(scenarios, tmp_path / "out", engine)
    results = {sr.scenario.name: sr for sr in summary.scenarios}
    verdicts = {(name, e.label): e.passed for name, sr in results.items() for e in sr.expectations}
    assert verdicts[("greeting", "agent_says /citysan|ayelen/")] is False
    assert verdicts[("greeting", "agent_never_says /goodbye/")] is True
    assert verdicts[("barge-in", "stops_within_ms 600")] is True
    assert verdicts[("barge-in", "responds_within_ms 1000")] is True
    assert verdicts[("address-question", "responds_within_ms 800")] is True
    assert verdicts[("dtmf-transfer", "action transfer")] is True
    failure = results["greeting"].expectations[0].failures[0][1]
    assert "the agent was never heard saying /citysan|ayelen/ (heard: 'thank you for" in failure
    (greeting,) = results["greeting"].calls
    assert "How can I help you today?" in greeting.outcomes[0].text_message  # its own text agrees: no CitySan

    by_name = {t.plan.scenario.name: t for t in traces}
    transfer = by_name["dtmf-transfer"]
    assert [(a.kind, a.trigger, a.what) for a in transfer.actions] == [
        ("transfer", "dtmf 0", "transfer to +15551230099")
    ]
    assert transfer.duration_s == pytest.approx(transfer.log.keys[0][0], abs=1 / 8000)
    barge = results["barge-in"].calls[0].measures.turns[1]
    assert barge.kind == "barge_in" and 150 <= barge.stop_ms <= 340  # 200 ms after the agent hears it
