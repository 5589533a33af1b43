"""The scheduler: the one owner of every session's state, and the frame clock that steps them.

| module | job |
| --- | --- |
| `core` | `Scheduler`: admission, queue, tickets, slot table, transitions, the inference thread |
| `records` | `SessionRecord`: a session's state, written only here; tickets; `WaitingQueue` |
| `config` | `SchedulerConfig`: every policy knob, frozen |
| `clock` | `Clock`: real time in production, fake time in tests |
| `isolation` | a failing batched step ends only the sessions it fails for |

See `core` for how a tick runs, and docs/sessions.md for the policies.
"""

from personaplex_voice.engine.scheduler.clock import Clock, MonotonicClock
from personaplex_voice.engine.scheduler.config import FRAME_SECONDS, SchedulerConfig, default_max_input_s
from personaplex_voice.engine.scheduler.core import PREFILL_STARVE_TICKS, Scheduler
from personaplex_voice.engine.scheduler.records import (
    RecordReadout,
    ScheduledSession,
    SessionRecord,
    SessionState,
    SlotStream,
    Ticket,
    TicketError,
    WaitingQueue,
    new_ticket_id,
)

__all__ = [
    "FRAME_SECONDS",
    "PREFILL_STARVE_TICKS",
    "Clock",
    "MonotonicClock",
    "RecordReadout",
    "ScheduledSession",
    "Scheduler",
    "SchedulerConfig",
    "SessionRecord",
    "SessionState",
    "SlotStream",
    "Ticket",
    "TicketError",
    "WaitingQueue",
    "default_max_input_s",
    "new_ticket_id",
]
