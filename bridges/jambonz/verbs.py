"""jambonz applications (JSON lists of verbs): our answers and the phone call's instructions.

The answer is one `listen` verb: bidirectional streaming audio (`bidirectionalAudio.streaming`,
its `sampleRate` always set: jambonz has none by default), `passDtmf`, the persona's name and
the flow's values in `metadata`, and an `actionHook`: when the listen ends (our socket closes),
jambonz asks it what next, and control.py answers with the call's instructions (a transfer, a
goodbye, back to the agent) or a hang-up.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from personaplex_phone import carrier as phone

from .wire import METADATA_KEY

JSON = "application/json"
ACTION_PATH = "/jambonz/action"
MEDIA_PATH = "/jambonz/media-stream"


def listen(stream_url: str, rate: int, params: Mapping[str, str], action_url: str) -> dict[str, Any]:
    return {
        "verb": "listen",
        "url": stream_url,
        "mixType": "mono",
        "sampleRate": rate,
        "passDtmf": True,
        "bidirectionalAudio": {"enabled": True, "streaming": True, "sampleRate": rate},
        "metadata": {METADATA_KEY: dict(params)},
        "actionHook": action_url,
    }


def say_and_hang_up(message: str) -> list[dict[str, Any]]:
    return [{"verb": "say", "text": message}, {"verb": "hangup"}]


def dial_target(target: str) -> dict[str, Any]:
    if target.startswith(("sip:", "sips:")):
        return {"type": "sip", "sipUri": target}
    return {"type": "phone", "number": target}


def render(
    steps: Sequence[phone.Step],
    *,
    whisper_url: Callable[[phone.Dial], str | None],
    resume: Callable[[phone.Resume], dict[str, Any]],
) -> list[dict[str, Any]]:
    """The verbs for `steps`; a Markup step must be a JSON list of verbs (ValueError if not)."""
    verbs: list[dict[str, Any]] = []
    for step in steps:
        if isinstance(step, phone.Say):
            verbs.append({"verb": "say", "text": step.text})
        elif isinstance(step, phone.Play):
            verbs.append({"verb": "play", "url": step.url})
        elif isinstance(step, phone.Dial):
            target = dial_target(step.target)
            url = whisper_url(step)
            if url:
                target["confirmHook"] = url  # verbs of ours for whoever answers, before connecting
            dial: dict[str, Any] = {"verb": "dial", "target": [target], "answerOnBridge": True}
            if step.caller_id:
                dial["callerId"] = step.caller_id
            verbs.append(dial)
        elif isinstance(step, phone.Hangup):
            verbs.append({"verb": "hangup"})
        elif isinstance(step, phone.Redirect):
            verbs.append({"verb": "redirect", "actionHook": step.url})
        elif isinstance(step, phone.Resume):
            verbs.append(resume(step))
        elif isinstance(step, phone.Markup):
            given = json.loads(step.text)
            if not isinstance(given, list) or not all(isinstance(v, dict) and "verb" in v for v in given):
                raise ValueError("a jambonz document is a JSON list of verbs")
            verbs.extend(given)
    return verbs
