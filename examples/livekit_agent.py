"""A LiveKit Agents worker whose agent is NVIDIA PersonaPlex on a personaplex-voice server.

    pip install "personaplex-voice[livekit]"
    export LIVEKIT_URL=wss://your-project.livekit.cloud LIVEKIT_API_KEY=... LIVEKIT_API_SECRET=...
    export PERSONAPLEX_URL=ws://gpu-host:8998          # the only new setting
    python examples/livekit_agent.py dev              # or `start` in production

Everything else is an ordinary LiveKit worker: the `AgentSession` keeps LiveKit's defaults, the
agent's `instructions` are the persona, and the agent's tools are LiveKit tools. PersonaPlex
calls no tools itself; the persona's action rules below watch what it says and call them: when
it says it will transfer the caller, `transfer_call` moves a phone caller (LiveKit SIP) to
`TRANSFER_TO`; when it says goodbye, LiveKit's own `end_call` tool ends the call.

Optional: `PERSONAPLEX_API_KEY` (the server's `--api-key`), `PERSONAPLEX_VOICE` (default NATF2),
`TRANSFER_TO` (a phone number or a sip: URI). See docs/livekit.md.

The model runs on the server, which every job of every worker shares (its slots, its persona
cache). Not in the worker: LiveKit runs each job in a process of its own (or, with the thread
executor, on an event loop of its own), so a model loaded in the worker would be loaded once
per job, and a `SessionManager` cannot be shared between event loops.
"""

from __future__ import annotations

import logging
import os

from livekit import api, rtc
from livekit.agents import (
    Agent,
    AgentServer,
    AgentSession,
    JobContext,
    RunContext,
    cli,
    function_tool,
    get_job_context,
)
from livekit.agents.beta.tools import EndCallTool
from personaplex_livekit import DuplexModel

log = logging.getLogger("personaplex-livekit-example")

PERSONA = (
    "You work for CitySan Services, a waste management company, and your name is Ayelen Lucero. "
    "You help callers with pickups, bins and billing. Be brief and friendly. When a caller asks "
    "for a person, say that you will transfer them to a colleague."
)
TRANSFER_TO = os.environ.get("TRANSFER_TO", "+15551230099")
# The persona's action rules, the same format as a phone persona's (docs/contact-center.md).
ACTIONS = [
    {
        "on_agent_text": r"transfer you|connect you (to|with)",
        "do": "transfer",
        "to": TRANSFER_TO,
        "after_s": 1,  # let it finish its sentence first
    },
    {"on_agent_text": r"\bgoodbye\b", "do": "hangup"},
]


class Receptionist(Agent):
    def __init__(self) -> None:
        super().__init__(instructions=PERSONA, tools=[EndCallTool(end_instructions=None)])

    @function_tool
    async def transfer_call(self, ctx: RunContext, to: str) -> str:
        """Transfer the caller to a colleague at `to` (a phone number or a SIP URI)."""
        job = get_job_context()
        callers = [
            p
            for p in job.room.remote_participants.values()
            if p.kind == rtc.ParticipantKind.PARTICIPANT_KIND_SIP
        ]
        if not callers:
            log.info("transfer to %s asked, but nobody here came in by phone", to)
            return "the caller is not on a phone line"
        target = to if to.startswith(("sip:", "sips:", "tel:")) else f"tel:{to}"
        await job.api.sip.transfer_sip_participant(
            api.TransferSIPParticipantRequest(
                room_name=job.room.name, participant_identity=callers[0].identity, transfer_to=target
            )
        )
        return f"transferred to {to}"


server = AgentServer()


def new_session(model: DuplexModel) -> AgentSession:
    # The caller comes in on a SIP trunk: the phone network cancels the line's echo, and LiveKit's
    # AEC warm-up (on by default for inbound calls) would feed the model silence instead of the
    # caller during the agent's first 3 s of speech, its greeting (docs/livekit.md).
    return AgentSession(llm=model, aec_warmup_duration=None)


@server.rtc_session()
async def entrypoint(ctx: JobContext) -> None:
    model = DuplexModel(
        voice=os.environ.get("PERSONAPLEX_VOICE", "NATF2"), actions=ACTIONS
    )  # PERSONAPLEX_URL
    ctx.add_shutdown_callback(model.aclose)  # the job's sessions and sockets, closed with it
    session = new_session(model)
    await session.start(room=ctx.room, agent=Receptionist())


if __name__ == "__main__":
    cli.run_app(server)
