"""eval on the golden tiny model: 8 scenarios run as batched sessions of one SessionManager (far
fewer engine ticks than their frames), and each gives the very tokens it gives run alone with
the same seed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from support_eval import load

from personaplex_voice.engine.generator import PersonaPlexEngine
from personaplex_voice.eval.runner import run_batched
from personaplex_voice.eval.speech import ClipBook
from personaplex_voice.eval.suite import plan_calls
from personaplex_voice.model.sources import resolve_model

pytestmark = pytest.mark.timeout(300)

LINES = ["wideband", "twilio", "browser", "wideband", "twilio", "wideband", "browser", "wideband"]
SAYS = [
    "Hello.",
    "When is my pickup?",
    "Can you help me?",
    "Thanks.",
    "My bin was not emptied.",
    "Goodbye now.",
    "Is it Tuesday?",
    "Hi there.",
]


def scenarios_text() -> str:
    out = ["scenarios:"]
    for i, (line, say) in enumerate(zip(LINES, SAYS, strict=True)):
        prompt = "You work for CitySan Services." if i % 2 else "You enjoy having a good conversation."
        out += [
            f"  - name: s{i}",
            f"    persona: {{text_prompt: {prompt!r}, voice: TINYF0.pt, seed: {100 + i}}}",
            f"    line: {line}",
            "    script:",
            f"      - silence: {0.16 + 0.08 * (i % 3):.2f}s",
            f"      - say: {say!r}",
        ]
        if i == 2:  # one caller reacts to what the agent says (or gives up waiting)
            out.append("      - barge_in: {after_agent_speech_ms: 160, say: 'Wait.', max_wait: 0.8s}")
        out.append(f"      - silence: {0.4 + 0.08 * i:.2f}s")
    return "\n".join(out) + "\n"


@pytest.fixture(scope="module")
def engine(golden_dir: Path) -> PersonaPlexEngine:
    torch.set_num_threads(1)
    return PersonaPlexEngine(resolve_model(str(golden_dir)), num_slots=8)


async def test_eight_scenarios_batch_and_match_their_solo_tokens(tmp_path, engine):
    scenarios = load(tmp_path, scenarios_text())
    clips = ClipBook()
    clips.add_scenarios(scenarios)
    plans = plan_calls(scenarios)
    traces, stats = await run_batched(engine, plans, clips)
    frames = [len(t.tokens) for t in traces]
    assert all(t.error is None for t in traces)
    assert all(t.tokens is not None and t.tokens.shape[1] > 1 for t in traces)
    assert stats["ticks"] < sum(frames) / 4, (stats["ticks"], frames)
    assert stats["ticks"] >= max(frames)
    assert len({t.tokens.tobytes() for t in traces}) == len(traces)  # different calls, different tokens

    for plan, batched in zip(plans, traces, strict=True):
        (alone,), solo = await run_batched(engine, [plan], clips)
        assert solo["ticks"] == len(alone.tokens)
        assert np.array_equal(alone.tokens, batched.tokens), plan.id
        assert np.array_equal(alone.caller, batched.caller), plan.id  # the same caller heard the same agent
        assert [p.text for p in alone.pieces] == [p.text for p in batched.pieces]
