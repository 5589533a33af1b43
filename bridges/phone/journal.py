"""The one writer of a call's record: `CallJournal`.

Everything that happens to a call reaches its record through here: the carrier's webhooks
(statuses, who calls whom), our answer (persona, busy), the stream (its start, the session, the
agent's text, DTMF, actions, metrics), the end and the post-call webhook's outcome. The journal
also owns the call's folder (record.json, events.jsonl) when records are kept on disk, so no two
pieces of code ever write one file.

While the call runs the record is whole in memory. Once the call has ended it is on disk and the
journal keeps only its summary (records.summarize: no transcript, the newest few statuses,
events and actions), so a server that has taken thousands of calls holds a bounded amount for
each.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from .records import MAX_TRANSCRIPT, CallFiles, CallRecord, RecordStore, summarize

log = logging.getLogger(__name__)

MAX_STATUSES = 64  # statuses kept in memory per call (the carrier's callbacks, the stream's own)
MAX_EVENTS = 256  # DTMF keys kept in memory per call (events.jsonl has them all)
MAX_ACTIONS = 64


class CallJournal:
    def __init__(self, call_id: str, carrier: str, store: RecordStore | None):
        self.record = CallRecord(call_sid=call_id, carrier=carrier)
        self.store = store
        self.files: CallFiles | None = None
        self.ended: dict[str, Any] | None = None  # the summary, once the call is over
        # Changes to an ended call's file (a late status, the webhook's outcome), one at a time.
        self._disk_lock: asyncio.Lock | None = None
        self._writes: set[asyncio.Task[None]] = set()

    @property
    def call_id(self) -> str:
        return self.record.call_sid

    @property
    def live(self) -> bool:
        return self.record.live

    # --- what the carrier and our answer say -------------------------------------------------------
    def status(self, status: str, **facts: str) -> None:
        """A status of the call (a callback of the carrier, or a step of ours like `webhook`)."""
        entry = (time.time(), status)
        if self.ended is not None:  # news after the end (a late status callback): into the summary
            item = {"t": entry[0], "status": status}
            statuses = self.ended.setdefault("statuses", [])
            statuses.append(item)
            del statuses[:-MAX_STATUSES]
            self._rewrite_ended(lambda record: record.setdefault("statuses", []).append(item))
            return
        self.record.statuses.append(entry)
        del self.record.statuses[:-MAX_STATUSES]
        for key, value in facts.items():
            if value and not getattr(self.record, key, None):
                setattr(self.record, key, value)

    def set_persona(self, name: str) -> None:
        if self.ended is None:
            self.record.persona = name

    def refused(self, reason: str) -> None:
        """Our answer ended the call before any stream (busy, no usable persona)."""
        if self.ended is None:
            self.record.end_reason = reason

    def note_metric(self, key: str, value: Any) -> None:
        if self.ended is None:
            self.record.metrics.setdefault(key, value)

    # --- the stream ----------------------------------------------------------------------------------
    def stream_started(
        self, stream_id: str, persona: str, variables: dict[str, str], keep_files: bool
    ) -> CallFiles | None:
        """A stream of this call starts (the first: the call is live and its folder opened;
        another after a `play … then: resume`: just its id). Returns the call's folder."""
        record = self.record
        record.stream_sid = stream_id
        if record.live:
            return self.files
        record.live = True
        record.started_at = time.time()
        if persona and not record.persona:
            record.persona = persona
        record.variables = dict(variables)
        if keep_files and self.store is not None:
            try:
                self.files = self.store.open_call(record.call_sid)
            except (OSError, ValueError) as exc:
                log.warning("phone: call %s is not recorded: %s", record.call_sid, exc)
        self.save()
        return self.files

    def session_started(self, session_id: str, prompt: str | None) -> None:
        self.record.session_id = session_id
        self.record.prompt = prompt
        self.save()

    def recording(self, on: bool) -> None:
        self.record.recording = on

    def transcript(self, piece: dict[str, Any]) -> None:
        if len(self.record.transcript) < MAX_TRANSCRIPT:
            self.record.transcript.append(piece)
        if self.files is not None:
            self.files.event("text", **piece)

    def dtmf(self, digit: str) -> None:
        at = time.time()
        self.record.events.append((at, f"dtmf:{digit}"))
        del self.record.events[:-MAX_EVENTS]
        if self.files is not None:
            self.files.event("dtmf", digit=digit, at=at)

    def action(self, entry: dict[str, Any]) -> None:
        self.record.actions.append(entry)
        del self.record.actions[:-MAX_ACTIONS]
        if self.files is not None:
            self.files.event("action", **entry)

    def set_metrics(self, metrics: dict[str, Any]) -> None:
        self.record.metrics = {**self.record.metrics, **metrics}

    def flush(self) -> None:
        """The events since the last flush, to disk (about once a second while the call runs)."""
        if self.files is not None:
            self.files.flush()

    def save(self) -> None:
        if self.files is not None:
            self.files.write_record(self.record.to_dict())

    # --- the end ---------------------------------------------------------------------------------------
    async def finish(
        self, reason: str, metrics: dict[str, Any], recording_s: float | None, extra: dict[str, Any]
    ) -> bytes:
        """The call is over: its record is written (in a worker thread: a long call's transcript
        is milliseconds of JSON) and only its summary stays here. Returns the JSON of the
        record, with `extra` (e.g. a recording URL) for the post-call webhook."""
        record = self.record
        record.live = False
        record.end_reason = reason
        record.ended_at = time.time()
        record.metrics = {**record.metrics, **metrics}
        record.recording_s = recording_s
        snapshot = record.to_dict()
        files = self.files
        if files is None:
            body = await asyncio.to_thread(_save_and_encode, files, snapshot, extra)
        else:  # after the call's earlier writes, on their thread
            files.flush()
            body = await asyncio.wrap_future(files.writer.submit(_save_and_encode, files, snapshot, extra))
        self.close(snapshot)
        return body

    def close(self, snapshot: dict[str, Any] | None = None) -> None:
        """Keep only the summary from now on (also for a call that ended before any stream)."""
        if self.ended is not None:
            return
        self.ended = summarize(snapshot if snapshot is not None else self.record.to_dict())
        self.record.transcript = []
        self.record.prompt = None

    def webhook_done(self, outcome: dict[str, Any]) -> None:
        self.record.webhook = outcome
        if self.ended is not None:
            self.ended["webhook"] = outcome
        self._rewrite_ended(lambda record: record.update(webhook=outcome))

    def _rewrite_ended(self, change: Callable[[dict[str, Any]], Any]) -> None:
        """Apply `change` to the ended call's file, in a worker thread, after earlier changes."""
        if self.files is None or self.store is None:
            return
        task = asyncio.get_running_loop().create_task(self._rewrite(change))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _rewrite(self, change: Callable[[dict[str, Any]], Any]) -> None:
        if self._disk_lock is None:
            self._disk_lock = asyncio.Lock()
        async with self._disk_lock:
            files = self.files
            if files is not None:
                await asyncio.wrap_future(files.writer.submit(self._load_change_write, change))

    def _load_change_write(self, change: Callable[[dict[str, Any]], Any]) -> None:
        full = self.store.load(self.call_id) if self.store is not None else None
        if full is not None and self.files is not None:
            change(full)
            self.files.write_record_now(full)

    def summary(self) -> dict[str, Any]:
        return self.ended if self.ended is not None else self.record.summary()


def _save_and_encode(files: CallFiles | None, snapshot: dict[str, Any], extra: dict[str, Any]) -> bytes:
    if files is not None:
        files.write_record_now(snapshot)
    return json.dumps({**snapshot, **extra}, separators=(",", ":")).encode()
