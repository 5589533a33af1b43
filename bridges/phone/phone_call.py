"""One phone call as the bridge keeps it: its session, its journal, recording and rule state.

A call usually has one media stream. A `play … then: resume` action gives it a second: the
carrier ends the first stream to say the message, then comes back (through our answer webhook,
or straight to a stream URL where the carrier can be told one) on a new stream, and the call
(its session included, the conversation going on) moves over. Between the two it is *parked*:
`Parking` keeps the session fed with silence and gives the call up (ending it) when it does not
come back in time.

Everything a call writes goes through its journal (journal.py, the record's one writer); what
ends a call (its finish: record closed, recording closed, webhook sent) happens once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from personaplex_voice.engine.base import FRAME_SIZE

from .actions import ActionMatcher, ActionRule
from .carrier import CallHandle
from .journal import CallJournal
from .personas import PersonaSpec
from .recording import CallRecording
from .records import RecordStore
from .webhooks import PostCallWebhooks

log = logging.getLogger(__name__)

FLUSH_EVERY_S = 1.0


@dataclass
class CallOutputs:
    """Where calls' records go: the records folder, the post-call webhooks. `recordings` is
    False when the folder is a private temporary one (records but no recordings without
    `--records-dir`)."""

    store: RecordStore | None
    webhooks: PostCallWebhooks
    default_secret: str
    live_sids: Callable[[], set[str]]  # calls whose folders retention must keep
    recordings: bool = True

    def secret_for(self, spec: PersonaSpec) -> str | None:
        if spec.webhook_secret_env:
            return os.environ.get(spec.webhook_secret_env) or None
        return self.default_secret or None


class PhoneCall:
    def __init__(
        self,
        spec: PersonaSpec,
        journal: CallJournal,
        outputs: CallOutputs,
        public_base: str,
        *,
        stream_id: str,
        variables: dict[str, str],
        caller_rate: int = 8000,
        agent_rate: int = 8000,
    ):
        self.spec = spec
        self.journal = journal
        self.outputs = outputs
        self.public_base = public_base
        self.call_sid = journal.call_id
        self.handle = CallHandle(self.call_sid, public_base=public_base)  # the stream sets the rest
        self.matcher = ActionMatcher(spec.actions)
        self.session: Any = None
        self.started_at = time.monotonic()  # for the call's length limit, across its streams
        self.t0: float | None = None  # the caller's first audio: time 0 of transcript and recording
        self.recording: CallRecording | None = None
        self._flushed_at = 0.0
        self.finished = False
        files = journal.stream_started(stream_id, spec.name, variables, keep_files=True)
        if files is not None and spec.record and outputs.recordings:
            try:
                self.recording = CallRecording(
                    files.recording_path, max(caller_rate, agent_rate), caller_rate, agent_rate
                )
                journal.recording(True)
                journal.save()
            except OSError as exc:
                log.warning("phone: call %s is not recorded: %s", self.call_sid, exc)

    @property
    def record(self) -> Any:
        return self.journal.record

    # --- while the call runs (the stream's tasks call these; each is cheap) -------------------
    def session_started(self, session: Any) -> None:
        self.session = session
        prompt = getattr(getattr(session, "persona", None), "text_prompt", None)
        self.journal.session_started(str(getattr(session, "id", "")), prompt)

    def new_stream(self, stream_id: str) -> None:
        """A second stream of this call starts: its chunk numbers start again."""
        self.journal.stream_started(stream_id, self.spec.name, self.record.variables, keep_files=True)
        if self.recording is not None:
            self.recording.new_stream()

    def caller_media(self, pcm: np.ndarray | None, chunk: int | None, now: float) -> None:
        """A caller payload (decoded at its line rate; None when nothing records it)."""
        if self.t0 is None:
            self.t0 = self._flushed_at = now
        if self.recording is not None and pcm is not None:
            self.recording.caller(pcm, chunk, now)
        if now - self._flushed_at >= FLUSH_EVERY_S:
            self._flushed_at = now
            self.journal.flush()

    def agent_sent(self, pcm: np.ndarray, plays_at: float) -> None:
        if self.recording is not None:
            self.recording.agent(pcm, plays_at)

    @property
    def records_audio(self) -> bool:
        return self.recording is not None

    def agent_text(self, text: str, frame: int, now: float) -> list[tuple[ActionRule, str]]:
        """An agent text piece: into the transcript; returns the rules it fires (with the
        phrase that fired each)."""
        self.journal.transcript({"t": round(now - (self.t0 or now), 3), "frame": frame, "text": text})
        return self.matcher.on_agent_text(text)

    def dtmf(self, digit: str) -> list[ActionRule]:
        self.journal.dtmf(digit)
        return self.matcher.on_dtmf(digit)

    def log_action(self, rule: ActionRule, trigger: str, ok: bool, detail: str = "") -> None:
        entry = {
            "t": round(time.monotonic() - (self.t0 or self.started_at), 3),
            "at": time.time(),
            "rule": rule.index,
            "trigger": trigger,
            "action": rule.kind,
            "what": rule.describe(),
            "ok": ok,
        }
        if detail:
            entry["detail"] = detail
        self.journal.action(entry)
        log.info(
            "phone: call %s: %s on %s (%s)",
            self.call_sid,
            rule.describe(),
            trigger,
            "ok" if ok else f"failed{': ' + detail if detail else ''}",
        )

    # --- the end ---------------------------------------------------------------------------------
    async def finish(self, reason: str, metrics: dict[str, Any]) -> None:
        """The call is over: close the recording and the record, send the webhook. Once."""
        if self.finished:
            return
        self.finished = True
        recording_s = None
        if self.recording is not None:
            with contextlib.suppress(OSError):
                recording_s = round(self.recording.close(time.monotonic()), 3)
        extra = {}
        if self.spec.webhook_url and self.recording is not None:
            # Served under the carrier's own prefix too (and /phone/calls), behind the API key.
            carrier = self.record.carrier or "phone"
            extra["recording_url"] = f"{self.public_base}/{carrier}/calls/{self.call_sid}/recording"
        body = await self.journal.finish(reason, metrics, recording_s, extra)
        outputs = self.outputs
        if self.spec.webhook_url:
            outputs.webhooks.send(
                self.spec.webhook_url, outputs.secret_for(self.spec), body, on_done=self.journal.webhook_done
            )
        store = outputs.store
        if store is not None and store.sweep_due():
            keep = outputs.live_sids()
            await asyncio.to_thread(store.sweep, keep)


# --- parking ----------------------------------------------------------------------------------------


@dataclass
class _Parked:
    call: PhoneCall
    keeper: asyncio.Task[None]


class Parking:
    """Calls between two streams (see the module docstring), by one-time resume token."""

    def __init__(self, timeout_s: float, give_up: Callable[[PhoneCall, str], Awaitable[None]]):
        self.timeout_s = timeout_s
        self._give_up = give_up  # ends a call that did not come back (closes its session)
        self._held: dict[str, _Parked] = {}

    @staticmethod
    def new_token() -> str:
        return secrets.token_urlsafe(18)

    def park(self, token: str, call: PhoneCall) -> None:
        keeper = asyncio.get_running_loop().create_task(self._keep(token, call))
        self._held[token] = _Parked(call, keeper)

    def holds(self, token: str, call_sid: str) -> bool:
        parked = self._held.get(token)
        return parked is not None and parked.call.call_sid == call_sid

    def take(self, token: str, call_sid: str) -> PhoneCall | None:
        """The parked call for its own resumed stream (None for any other)."""
        if not self.holds(token, call_sid):
            return None
        parked = self._held.pop(token)
        parked.keeper.cancel()
        return parked.call

    def release(self, call_sid: str) -> PhoneCall | None:
        """The parked call of `call_sid`, taken off hold (its caller hung up meanwhile)."""
        for token, parked in list(self._held.items()):
            if parked.call.call_sid == call_sid:
                return self.take(token, call_sid)
        return None

    @property
    def call_sids(self) -> set[str]:
        return {p.call.call_sid for p in self._held.values()}

    async def _keep(self, token: str, call: PhoneCall) -> None:
        """Feed the session silence (a frame in for each frame out, so the engine's clock never
        waits on it) until the call comes back or the time is up."""
        session = call.session
        silence = np.zeros(FRAME_SIZE, np.float32)

        async def feed() -> None:
            async for _ in session.frames():
                session.push(silence)

        try:
            await asyncio.wait_for(feed(), self.timeout_s)
            reason = f"session ended while on hold: {session.close_reason}"
        except TimeoutError:
            reason = "the caller did not come back after a message"
        if self._held.pop(token, None) is not None:
            await self._give_up(call, reason)
