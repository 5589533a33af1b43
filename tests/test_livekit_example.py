"""examples/livekit_agent.py stays wired: a LiveKit worker whose agent's tools are the ones its
persona's action rules call (a LiveKit server is not reachable here; the bridge itself runs in
real AgentSessions in test_livekit_remote.py / test_livekit_inprocess.py)."""

from __future__ import annotations

import importlib.util
import json

from livekit.agents import AgentServer, llm
from personaplex_livekit import DuplexModel, ToolRules
from support_server import ROOT


def load_example(monkeypatch):
    monkeypatch.setenv("PERSONAPLEX_URL", "ws://127.0.0.1:9")  # nothing is connected here
    spec = importlib.util.spec_from_file_location(
        "livekit_agent_example", ROOT / "examples" / "livekit_agent.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_the_example_worker_its_tools_and_rules(monkeypatch):
    example = load_example(monkeypatch)
    assert isinstance(example.server, AgentServer)
    tools = llm.ToolContext(example.Receptionist().tools)
    rules = ToolRules(example.ACTIONS)
    transfer = rules.on_agent_text(" Sure, I will transfer you to a colleague now.")
    goodbye = rules.on_agent_text(" Thanks for calling, goodbye!")
    assert [c.name for c in transfer + goodbye] == ["transfer_call", "end_call"]
    assert json.loads(transfer[0].arguments) == {"to": example.TRANSFER_TO} and transfer[0].after_s == 1
    for call in transfer + goodbye:
        assert tools.get_function_tool(call.name) is not None  # the agent has what the rules call
    model = DuplexModel(actions=example.ACTIONS)  # the URL from PERSONAPLEX_URL, as the worker does
    assert model.backend.url == "ws://127.0.0.1:9/api/chat"
    # a phone line: the model hears the caller from the first moment, not silence (AEC warm-up)
    assert example.new_session(model).options.aec_warmup_duration is None
    await model.aclose()
