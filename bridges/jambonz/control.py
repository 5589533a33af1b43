"""jambonz call control: the `listen` verb's `actionHook`.

A live call on jambonz follows its application, verb by verb; ours is one `listen`. When that
listen ends, because our side closed its socket, jambonz POSTs the verb's `actionHook`
(`/jambonz/action`, signed) and runs the verbs we answer. So a live call gets new instructions
(a transfer, a goodbye, the way back to the agent) by keeping them here for its `call_sid` and
ending our stream: the phone call does the second part after every instruction, and the hook
hands the call its verbs. A call with nothing kept (the socket dropped, a limit ended it) is
hung up. Nothing here needs jambonz's REST credentials or opens a socket.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from personaplex_phone import carrier as phone
from personaplex_phone.carrier import CallHandle, Outcome, Publish, Reply
from personaplex_phone.urls import websocket_base

from . import verbs

HANG_UP: list[dict[str, Any]] = [{"verb": "hangup"}]


class JambonzControl:
    KEEP_S = 600.0  # a call's next verbs wait this long for jambonz to ask
    MAX_CALLS = 10_000

    def __init__(self, publish: Publish, rate: int):
        self._publish = publish
        self.rate = rate
        self._next: OrderedDict[str, tuple[list[dict[str, Any]], float]] = OrderedDict()

    @property
    def available(self) -> bool:
        return True

    def _keep(self, call_id: str, document: list[dict[str, Any]]) -> None:
        now = time.monotonic()
        while self._next and (len(self._next) >= self.MAX_CALLS or next(iter(self._next.values()))[1] < now):
            self._next.popitem(last=False)
        self._next[call_id] = (document, now + self.KEEP_S)
        self._next.move_to_end(call_id)

    def next_verbs(self, call_id: str) -> list[dict[str, Any]]:
        """What the call does when its listen ends (the actionHook's answer): once."""
        kept = self._next.pop(call_id, None)
        if kept is None or kept[1] < time.monotonic():
            return list(HANG_UP)
        return kept[0]

    def forget(self, call_id: str) -> None:
        self._next.pop(call_id, None)

    async def hang_up(self, call: CallHandle) -> Outcome:
        self._keep(call.call_id, list(HANG_UP))
        return Outcome(True)

    async def instruct(self, call: CallHandle, steps: Sequence[phone.Step]) -> Outcome:
        try:
            document = self.document(call, steps)
        except ValueError as exc:
            return Outcome(False, f"jambonz: {exc}")
        self._keep(call.call_id, document or list(HANG_UP))
        return Outcome(True)

    def document(self, call: CallHandle, steps: Sequence[phone.Step]) -> list[dict[str, Any]]:
        def whisper(dial: phone.Dial) -> str | None:
            if not dial.whisper:
                return None
            body = json.dumps([{"verb": "say", "text": dial.whisper}])
            return self._publish(Reply(body, verbs.JSON), call.public_base)

        def resume(step: phone.Resume) -> dict[str, Any]:
            # Back to the agent: a new listen straight to a stream of ours, its ticket the token.
            url = f"{websocket_base(call.public_base)}{verbs.MEDIA_PATH}/{step.token}"
            return verbs.listen(
                url, self.rate, {"persona": step.persona}, call.public_base + verbs.ACTION_PATH
            )

        return verbs.render(steps, whisper_url=whisper, resume=resume)
