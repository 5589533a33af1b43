"""Process-wide interpreter settings a realtime server wants, applied once per process.

The SessionManager's frame clock runs on its inference thread; everything else (the event loop
with every call's WebSocket and pacing) shares the GIL with it. Two interpreter defaults delay
ticks under load:

- A full garbage collection walks every object alive (FastAPI, pydantic, numpy, torch, the
  model's modules...): tens of ms on a small CPU, felt at once by every call's 20 ms pacing.
  Objects alive once the engine is loaded live as long as the process, so after one last
  collection they are frozen out of collection (`gc.freeze`).
- The GIL hand-over interval (5 ms by default) is paid several times per tick when the event
  loop is busy; at 25 phone calls that made ticks ~50 ms late. 1 ms keeps them on time.

The server's lifespan calls `tune_for_realtime()` once the engine is loaded (embedders that own
the process may switch it off with `PERSONAPLEX_TUNE_RUNTIME=0`).
"""

from __future__ import annotations

import gc
import logging
import sys
import threading

log = logging.getLogger(__name__)

SWITCH_INTERVAL_S = 0.001

_lock = threading.Lock()
_tuned = False


def tune_for_realtime() -> bool:
    """Collect, freeze what is alive, shorten the GIL switch interval. Only the first call in a
    process does anything (a later engine's objects would be few; freezing twice keeps garbage
    of the first app alive for good). Returns True when this call applied the settings."""
    global _tuned
    with _lock:
        if _tuned:
            return False
        _tuned = True
    gc.collect()  # never freeze garbage: what is frozen is never collected
    gc.freeze()
    sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
    log.info(
        "runtime tuned for realtime: %d objects frozen, GIL switch interval %g s",
        gc.get_freeze_count(),
        sys.getswitchinterval(),
    )
    return True
