"""The realtime jitter buffer's policy for one session's input (`SpareTrimmer`)."""

from __future__ import annotations


class SpareTrimmer:
    """Which spare input frames a realtime session drops, and when.

    After each tick took (or missed) the session's frame, the whole frames still queued are
    *spare*: cushion against late input, but also latency. Spare beyond `slack_frames` goes at
    once; spare that stayed queued through `settle_ticks` ticks in a row was never needed and
    goes then. A tick that finds no spare (the cushion was used) starts the count over.
    """

    def __init__(self) -> None:
        self._streak = 0  # ticks in a row that left at least one whole spare frame queued
        self._floor = 0  # the fewest spare frames seen over those ticks

    def frames_to_drop(self, spare: int, slack_frames: int, settle_ticks: int | None) -> int:
        drop = max(0, spare - slack_frames)
        kept = spare - drop
        if kept == 0:  # the cushion was used (or there was none): start over
            self._streak = 0
        else:
            self._floor = kept if self._streak == 0 else min(self._floor, kept)
            self._streak += 1
            if settle_ticks is not None and self._streak >= settle_ticks:
                drop += self._floor
                self._streak = 0
        return drop
