"""The engine workers' instruments, as a front-end last heard them, in the one snapshot format.

Each worker sends its manager's metrics snapshot (`metrics.Snapshot`) once a second in its
STATUS. A front-end's `/metrics` exports them under the names an embedded server uses
(`personaplex_ticks_total`, `personaplex_late_frames_total`, ...) with a `worker` label, plus per
worker `engine_worker_up`, `engine_worker_restarts` and the slot gauges `engine_worker_slots`
by state. Every front-end shows every worker; scrape one front-end per host (or all, and
deduplicate on `worker`). The Prometheus conversion itself is `server/metrics.py`'s.
"""

from __future__ import annotations

from collections.abc import Iterable

from personaplex_voice.cluster.worker_link import WorkerLink
from personaplex_voice.metrics import LabelledSnapshot, Snapshot


def _gauge(help: str, value: float | dict[str, float], label: str | None = None) -> dict[str, object]:
    return {"kind": "gauge", "help": help, "label": label, "value": value}


def worker_snapshot(link: WorkerLink) -> Snapshot:
    """One worker's series: its link's state, then (while up) its manager's instruments."""
    own: Snapshot = {
        "engine_worker_up": _gauge("1 while this front-end is connected", 1.0 if link.up else 0.0),
        "engine_worker_restarts": _gauge(
            "Times the engine worker was restarted", float(link.info.get("generation") or 0)
        ),
    }
    if not link.up:
        return own
    status = link.status
    capacity = float(status.get("capacity", 0))
    used, reserved = float(status.get("active", 0)), float(status.get("reserved", 0))
    slots = {"used": used, "reserved": reserved, "free": max(0.0, capacity - used - reserved)}
    own["engine_worker_slots"] = _gauge("Engine worker slots by state", slots, label="state")
    reported = {name: entry for name, entry in link.metrics_snapshot.items() if isinstance(entry, dict)}
    return {**reported, **own}


def worker_snapshots(links: Iterable[WorkerLink]) -> list[LabelledSnapshot]:
    return [LabelledSnapshot({"worker": link.worker_id}, worker_snapshot(link)) for link in links]
