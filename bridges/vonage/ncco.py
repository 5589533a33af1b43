"""NCCOs (Vonage's call control objects, JSON lists of actions): our answers and the phone
call's instructions.

The answer connects the call to our WebSocket: `[{"action": "connect", "endpoint": [{"type":
"websocket", "uri": …, "content-type": "audio/l16;rate=16000", "headers": {...}}]}]`; the headers
come back in the socket's first message. Instructions for a live call are an NCCO given to
Vonage with a `transfer`; going back to the agent is another `connect` to a stream of ours
(whose ticket is the call's resume token), no webhook round trip needed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from personaplex_phone import carrier as phone

JSON = "application/json"


def websocket(uri: str, content_type: str, headers: Mapping[str, str]) -> dict[str, Any]:
    return {
        "action": "connect",
        "endpoint": [
            {"type": "websocket", "uri": uri, "content-type": content_type, "headers": dict(headers)}
        ],
    }


def number(target: str) -> str:
    """Vonage writes numbers E.164 without the `+`."""
    return target.removeprefix("+")


def render(
    steps: Sequence[phone.Step],
    *,
    whisper_url: Callable[[phone.Dial], str | None],
    resume: Callable[[phone.Resume], dict[str, Any]],
) -> list[dict[str, Any]]:
    actions: list[dict[str, Any]] = []
    for step in steps:
        if isinstance(step, phone.Say):
            actions.append({"action": "talk", "text": step.text})
        elif isinstance(step, phone.Play):
            actions.append({"action": "stream", "streamUrl": [step.url]})
        elif isinstance(step, phone.Dial):
            if step.target.startswith(("sip:", "sips:")):
                endpoint: dict[str, Any] = {"type": "sip", "uri": step.target}
            else:
                endpoint = {"type": "phone", "number": number(step.target)}
            url = whisper_url(step)
            if url:
                endpoint["onAnswer"] = {"url": url}  # an NCCO of ours for whoever answers, first
            connect: dict[str, Any] = {"action": "connect", "endpoint": [endpoint]}
            if step.caller_id:
                connect["from"] = number(step.caller_id)
            actions.append(connect)
        elif isinstance(step, phone.Resume):
            actions.append(resume(step))
        # Hangup: an NCCO that runs out ends the call. Redirect and Markup go to `transfer` whole.
    return actions
