"""Call records: what happened on each call, in memory and (with a records directory) on disk.

On disk, one folder per call, named by the carrier's call id (Twilio's CallSid, Telnyx's call
control id, Plivo's CallUUID, Vonage's uuid, Exotel's CallSid):

    <records_dir>/CA…/record.json     the record; rewritten (atomically) when the stream starts
                                      and when the call ends ("live": false)
    <records_dir>/CA…/events.jsonl    transcript pieces, DTMF and actions, appended about once
                                      a second while the call runs
    <records_dir>/CA…/recording.wav   the stereo recording, when the persona opts in

A server killed mid-call leaves a record.json that says "live": true, an events.jsonl and a WAV
that are at most a second or two short; `load` puts them together (and says "interrupted").

A call's writes never wait for the disk on the event loop that carries every call (a slow write
there is a gap in every call's audio): its folder's `CallFiles` hands them, in order, to the
store's one writer thread (`DiskWriter`).
Retention: folders older than `max_age_s` go first, then the oldest until the total fits
`max_bytes`; a live call's folder is never removed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

log = logging.getLogger(__name__)

RECORD = "record.json"
EVENTS = "events.jsonl"
RECORDING = "recording.wav"
# Carriers' call ids: letters and digits (Twilio, Exotel), UUIDs (Plivo, Vonage), `v3:…` with
# `-`/`_` (Telnyx), `1712345678.42` (Asterisk's UNIQUEID). Never a `/` or a leading dot: an id
# is always one plain folder name.
_SID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.:_-]{1,127}$")
MAX_TRANSCRIPT = 50_000  # pieces kept per call (a 15 min call of the real model has ~3 000)


def valid_sid(call_sid: str) -> bool:
    """A call id that is safe as a folder name (Twilio's are CA + 32 hex digits)."""
    return bool(_SID.match(call_sid))


@dataclass
class CallRecord:
    call_sid: str  # the carrier's call id, whatever the carrier calls it
    carrier: str = ""
    direction: str = "inbound"
    from_: str = ""
    to: str = ""
    persona: str = ""
    stream_sid: str = ""
    session_id: str = ""
    statuses: list[tuple[float, str]] = field(default_factory=list)
    events: list[tuple[float, str]] = field(default_factory=list)  # DTMF and other session events
    end_reason: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)
    started_at: float | None = None  # wall clock (epoch s) when the stream started
    ended_at: float | None = None
    prompt: str | None = None  # the rendered text prompt the session got
    variables: dict[str, str] = field(default_factory=dict)
    # {"t": seconds on the recording's timeline, "frame": engine frame index, "text": piece}
    transcript: list[dict[str, Any]] = field(default_factory=list)
    actions: list[dict[str, Any]] = field(default_factory=list)
    recording: bool = False
    recording_s: float | None = None
    live: bool = False
    webhook: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "call_sid": self.call_sid,
            "carrier": self.carrier,
            "direction": self.direction,
            "from": self.from_,
            "to": self.to,
            "persona": self.persona,
            "stream_sid": self.stream_sid,
            "session_id": self.session_id,
            "live": self.live,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "prompt": self.prompt,
            "variables": self.variables,
            "statuses": [{"t": t, "status": s} for t, s in self.statuses],
            "events": [{"t": t, "event": e} for t, e in self.events],
            "transcript": self.transcript,
            "actions": self.actions,
            "end_reason": self.end_reason,
            "metrics": self.metrics,
            "recording": self.recording,
            "recording_s": self.recording_s,
            "webhook": self.webhook,
        }

    def summary(self) -> dict[str, Any]:
        """The record without its long lists (for call lists)."""
        full = self.to_dict()
        return summarize(full)


SUMMARY_ITEMS = 32  # statuses, events and actions a summary keeps (the newest; the file has all)


def summarize(record: dict[str, Any]) -> dict[str, Any]:
    """A record as call lists show it: no transcript or prompt, and its lists cut to their newest
    entries, so an ended call costs a bounded amount of memory whatever happened in it."""
    short = {k: v for k, v in record.items() if k not in ("transcript", "prompt")}
    short["transcript_pieces"] = record.get("transcript_pieces", len(record.get("transcript") or []))
    for key in ("statuses", "events", "actions"):
        items = record.get(key) or []
        if len(items) > SUMMARY_ITEMS:
            short[key] = items[-SUMMARY_ITEMS:]
            short[f"{key}_total"] = len(items)
    return short


class DiskWriter:
    """One thread that does a record store's writes, in the order they were handed over (a
    call's record after its events, its last record after every earlier one).

    Handing a write over costs the event loop an append, nothing more: the thread is not woken
    per write (each wake-up would make the loop hand the GIL over mid-callback) but looks for
    work every `interval_s`, so a record reaches the disk within that of being written."""

    def __init__(self, interval_s: float = 0.05) -> None:
        self.interval_s = interval_s
        self._jobs: deque[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]] = deque()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, job: Callable[..., T], *args: Any) -> Future[T]:
        done: Future[T] = Future()
        self._jobs.append((done, job, args))  # deque.append is atomic: no lock on the loop's side
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="personaplex-records", daemon=True)
                    self._thread.start()
        return done

    def _run(self) -> None:
        while True:
            time.sleep(self.interval_s)
            while self._jobs:
                done, job, args = self._jobs.popleft()
                if not done.set_running_or_notify_cancel():
                    continue
                try:
                    done.set_result(job(*args))
                except BaseException as exc:  # the caller awaiting it hears it; others are logged
                    done.set_exception(exc)
                    log.warning("phone: a record write failed: %s", exc)


class CallFiles:
    """One call's folder while the call runs: its pending events and its record file. Writes go
    to `writer` (in order); `write_record_now` is for code already on the writer's thread."""

    def __init__(self, folder: Path, writer: DiskWriter | None = None):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)  # now: a recording opens its file in it at once
        self.writer = writer if writer is not None else DiskWriter()
        self._pending: list[str] = []

    @property
    def recording_path(self) -> Path:
        return self.folder / RECORDING

    def event(self, kind: str, **fields: Any) -> None:
        self._pending.append(json.dumps({"kind": kind, **fields}, separators=(",", ":")))

    def flush(self) -> None:
        """Append the pending events (a small write, about once a second per call)."""
        if not self._pending:
            return
        lines, self._pending = self._pending, []
        self.writer.submit(_append_lines, self.folder / EVENTS, "\n".join(lines) + "\n")

    def write_record(self, record: dict[str, Any]) -> None:
        """Rewrite the record (encoded now: the call goes on changing it)."""
        self.writer.submit(_write_text_atomically, self.folder / RECORD, _encoded(record))

    def write_record_now(self, record: dict[str, Any]) -> None:
        write_json_atomically(self.folder / RECORD, record)


def wav_seconds(path: Path) -> float:
    """The length of one of our stereo 16-bit recordings from its size and its header's rate
    (a recording cut short by a crash has a stale size in its header, never a stale rate)."""
    try:
        with path.open("rb") as wav:
            header = wav.read(44)
        size = path.stat().st_size
    except OSError:
        return 0.0
    rate = int.from_bytes(header[24:28], "little") if len(header) == 44 else 0
    return max(0, size - 44) / (rate * 4) if rate > 0 else 0.0


def _encoded(data: dict[str, Any]) -> str:
    return json.dumps(data, separators=(",", ":"))


def write_json_atomically(path: Path, data: dict[str, Any]) -> None:
    _write_text_atomically(path, _encoded(data))


def _write_text_atomically(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("phone: cannot write %s: %s", path, exc)


def _append_lines(path: Path, text: str) -> None:
    try:
        with path.open("a", encoding="utf-8") as out:
            out.write(text)
    except OSError as exc:
        log.warning("phone: cannot write %s: %s", path, exc)


class RecordStore:
    def __init__(self, root: Path, *, max_age_s: float, max_bytes: int):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_age_s = max_age_s
        self.max_bytes = max_bytes
        self._last_sweep = 0.0
        self.writer = DiskWriter()  # every call's writes, in order, off the event loop

    def folder(self, call_sid: str) -> Path:
        if not valid_sid(call_sid):
            raise ValueError(f"not a call id: {call_sid!r}")
        return self.root / call_sid

    def open_call(self, call_sid: str) -> CallFiles:
        return CallFiles(self.folder(call_sid), self.writer)

    def recording(self, call_sid: str) -> Path | None:
        if not valid_sid(call_sid):
            return None
        path = self.root / call_sid / RECORDING
        return path if path.is_file() else None

    def load(self, call_sid: str) -> dict[str, Any] | None:
        """A call's record from disk; a call that never ended (the server died) gets its
        transcript, DTMF and actions back from events.jsonl and `"interrupted": true`."""
        if not valid_sid(call_sid):
            return None
        folder = self.root / call_sid
        try:
            record = json.loads((folder / RECORD).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if not isinstance(record, dict):
            return None
        if record.get("live"):
            self._replay_events(folder, record)
        return record

    @staticmethod
    def _replay_events(folder: Path, record: dict[str, Any]) -> None:
        transcript, actions, events = [], [], []
        try:
            lines = (folder / EVENTS).read_text(encoding="utf-8").splitlines()
        except OSError:
            lines = []
        for line in lines:
            try:
                event = json.loads(line)
            except ValueError:
                continue  # the last line may have been cut by the crash
            kind = event.pop("kind", None)
            if kind == "text":
                transcript.append(event)
            elif kind == "action":
                actions.append(event)
            elif kind == "dtmf":
                events.append({"t": event.get("at"), "event": f"dtmf:{event.get('digit')}"})
        record.update(transcript=transcript, actions=actions, events=events, interrupted=True)
        recording = folder / RECORDING
        if recording.is_file():
            record["recording"] = True
            record["recording_s"] = wav_seconds(recording)

    def recent(self, limit: int = 100) -> list[dict[str, Any]]:
        """Summaries of the newest records on disk (for the call list after a restart)."""
        try:
            folders = sorted(
                (e for e in os.scandir(self.root) if e.is_dir() and valid_sid(e.name)),
                key=lambda e: e.stat().st_mtime,
                reverse=True,
            )[:limit]
        except OSError:
            return []
        out = []
        for entry in folders:
            record = self.load(entry.name)
            if record is not None:
                out.append(summarize(record))
        return out

    # --- retention ----------------------------------------------------------------------------
    def sweep_due(self, every_s: float = 60.0) -> bool:
        now = time.monotonic()
        if self._last_sweep and now - self._last_sweep < every_s:
            return False
        self._last_sweep = now
        return True

    def sweep(self, keep: set[str] | frozenset[str] = frozenset()) -> int:
        """Apply retention (blocking file work: run it in a thread). Returns folders removed."""
        now = time.time()
        entries: list[tuple[float, int, Path]] = []
        try:
            listing = list(os.scandir(self.root))
        except OSError:
            return 0
        total = 0  # live calls' folders count toward the bound, but are never removed
        for entry in listing:
            if not entry.is_dir() or not valid_sid(entry.name):
                continue
            size, newest = 0, 0.0
            with contextlib.suppress(OSError):
                for item in os.scandir(entry.path):
                    info = item.stat()
                    size += info.st_size
                    newest = max(newest, info.st_mtime)
            total += size
            if entry.name not in keep:
                entries.append((newest, size, Path(entry.path)))
        entries.sort()  # oldest first
        removed = 0
        for newest, size, path in entries:
            if now - newest <= self.max_age_s and total <= self.max_bytes:
                break
            shutil.rmtree(path, ignore_errors=True)
            total -= size
            removed += 1
        if removed:
            log.info("phone: retention removed %d call record(s) from %s", removed, self.root)
        return removed
