"""One phone call as the bridge keeps it: its session, record, recording and rule state.

A call usually has one Media Stream. A `play … then: resume` action gives it a second: Twilio
ends the first stream to say the message, then our webhook answers its `<Redirect>` with a new
stream, and the call (its session included, the conversation going on) moves over. Between the
two it is *parked*: `Parking` keeps the session fed with silence and gives the call up (ending
it) when it does not come back in time.

Everything a call writes (record, events, recording) goes through here; what ends a call (its
finish: record closed, recording closed, webhook sent) happens once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
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
from .personas import PersonaSpec
from .recording import CallRecording
from .records import MAX_TRANSCRIPT, CallFiles, CallRecord, RecordStore
from .webhooks import PostCallWebhooks

log = logging.getLogger(__name__)

FLUSH_EVERY_S = 1.0


@dataclass
class CallOutputs:
    """Where calls' records go: the records folder (None: memory only), the post-call webhooks."""

    store: RecordStore | None
    webhooks: PostCallWebhooks
    default_secret: str
    live_sids: Callable[[], set[str]]  # calls whose folders retention must keep

    def secret_for(self, spec: PersonaSpec) -> str | None:
        if spec.webhook_secret_env:
            return os.environ.get(spec.webhook_secret_env) or None
        return self.default_secret or None


class PhoneCall:
    def __init__(self, spec: PersonaSpec, record: CallRecord, outputs: CallOutputs, public_base: str):
        self.spec = spec
        self.record = record
        self.outputs = outputs
        self.public_base = public_base
        self.call_sid = record.call_sid
        self.matcher = ActionMatcher(spec.actions)
        self.session: Any = None
        self.started_at = time.monotonic()  # for the call's length limit, across its streams
        self.t0: float | None = None  # the caller's first audio: time 0 of transcript and recording
        self.files: CallFiles | None = None
        self.recording: CallRecording | None = None
        self._flushed_at = 0.0
        self._final: dict[str, Any] | None = None
        self.finished = False
        record.live = True
        record.started_at = time.time()
        if outputs.store is not None:
            try:
                self.files = outputs.store.open_call(self.call_sid)
                if spec.record:
                    self.recording = CallRecording(self.files.recording_path)
                    record.recording = True
            except (OSError, ValueError) as exc:
                log.warning("twilio: call %s is not recorded: %s", self.call_sid, exc)
                self.files = self.recording = None
        self.save_record()

    # --- while the call runs (the stream's tasks call these; each is cheap) -------------------
    def session_started(self, session: Any) -> None:
        self.session = session
        self.record.session_id = str(getattr(session, "id", ""))
        self.record.prompt = getattr(getattr(session, "persona", None), "text_prompt", None)
        self.save_record()

    def new_stream(self) -> None:
        """A second stream of this call starts: its chunk numbers start again at 1."""
        if self.recording is not None:
            self.recording.new_stream()

    def caller_media(self, ulaw: bytes, chunk: int | None, now: float) -> None:
        if self.t0 is None:
            self.t0 = self._flushed_at = now
        if self.recording is not None:
            self.recording.caller(ulaw, chunk, now)
        if self.files is not None and now - self._flushed_at >= FLUSH_EVERY_S:
            self._flushed_at = now
            self.files.flush()

    def agent_sent(self, ulaw: bytes, plays_at: float) -> None:
        if self.recording is not None:
            self.recording.agent(ulaw, plays_at)

    def agent_text(self, text: str, frame: int, now: float) -> list[tuple[ActionRule, str]]:
        """An agent text piece: into the transcript; returns the rules it fires (with the
        phrase that fired each)."""
        piece = {"t": round(now - (self.t0 or now), 3), "frame": frame, "text": text}
        if len(self.record.transcript) < MAX_TRANSCRIPT:
            self.record.transcript.append(piece)
        if self.files is not None:
            self.files.event("text", **piece)
        return self.matcher.on_agent_text(text)

    def dtmf(self, digit: str) -> list[ActionRule]:
        at = time.time()
        self.record.events.append((at, f"dtmf:{digit}"))
        if self.files is not None:
            self.files.event("dtmf", digit=digit, at=at)
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
        self.record.actions.append(entry)
        if self.files is not None:
            self.files.event("action", **entry)
        log.info(
            "twilio: call %s: %s on %s (%s)",
            self.call_sid,
            rule.describe(),
            trigger,
            "ok" if ok else "failed",
        )

    def save_record(self) -> None:
        if self.files is not None:
            self.files.write_record(self.record.to_dict())

    # --- the end ---------------------------------------------------------------------------------
    async def finish(self, reason: str, metrics: dict[str, Any]) -> None:
        """The call is over: close the record and the recording, send the webhook. Once."""
        if self.finished:
            return
        self.finished = True
        record = self.record
        record.live = False
        record.end_reason = reason
        record.ended_at = time.time()
        record.metrics = metrics
        if self.recording is not None:
            with contextlib.suppress(OSError):
                record.recording_s = round(self.recording.close(time.monotonic()), 3)
        if self.files is not None:
            self.files.flush()
        snapshot = record.to_dict()
        if self.spec.webhook_url and record.recording and self.files is not None:
            snapshot["recording_url"] = f"{self.public_base}/twilio/calls/{self.call_sid}/recording"
        files, outputs = self.files, self.outputs
        # JSON of a long call's transcript takes milliseconds: not on the event loop.
        body = await asyncio.to_thread(_encode_and_save, files, snapshot)
        if files is not None:
            record.transcript = []  # it is on disk now; the call list keeps only the summary
        if self.spec.webhook_url:
            # Kept until the delivery's outcome is written into it (the record on disk).
            self._final = snapshot
            outputs.webhooks.send(
                self.spec.webhook_url, outputs.secret_for(self.spec), body, on_done=self._webhook_done
            )
        store = outputs.store
        if store is not None and store.sweep_due():
            keep = outputs.live_sids()
            await asyncio.to_thread(store.sweep, keep)

    def _webhook_done(self, outcome: dict[str, Any]) -> None:
        self.record.webhook = outcome
        snapshot, self._final = self._final, None
        if self.files is not None and snapshot is not None:
            snapshot["webhook"] = outcome
            snapshot.pop("recording_url", None)
            asyncio.get_running_loop().run_in_executor(None, self.files.write_record, snapshot)


def _encode_and_save(files: CallFiles | None, snapshot: dict[str, Any]) -> bytes:
    if files is not None:
        files.write_record(snapshot)
    return json.dumps(snapshot, separators=(",", ":")).encode()


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
