"""`SchedulerConfig`: every policy knob of the scheduler, frozen."""

from __future__ import annotations

from dataclasses import dataclass

from personaplex_voice.engine.base import FRAME_SIZE, SAMPLE_RATE

FRAME_SECONDS = FRAME_SIZE / SAMPLE_RATE  # 0.08
# Realtime: the caller audio from before a session runs (a slow prompt prefill, a queue wait, a
# bridge's connect) that is kept and caught up, unless `max_input_s` is set. A prompt on a loaded
# server can take seconds; the LiveKit and Pipecat bridges hold that much while they open.
DEFAULT_START_BURST_S = 5.0


def default_max_input_s(realtime: bool) -> float:
    """The input backlog bound per session when none is given: a second in realtime (older input
    is latency nobody wants), ten minutes otherwise (offline runs push whole files)."""
    return 1.0 if realtime else 600.0


@dataclass(frozen=True)
class SchedulerConfig:
    """Every policy knob of the scheduler, in the units it uses (frames, ticks, seconds).

    Build it from seconds with `SchedulerConfig.create(...)`; docs/sessions.md explains each.
    """

    realtime: bool = True
    max_queue: int = 0  # sessions that may wait for a slot (0: refuse when full)
    lossless: bool = False  # wait for consumers instead of dropping their oldest frames
    frame_period_s: float = FRAME_SECONDS
    max_catchup_ticks: int = 3  # realtime: beyond this many ticks behind, the clock skips ahead
    late_wait_s: float = 0.020  # realtime: the most a tick waits for late input
    input_slack_frames: int = 2  # realtime jitter buffer: spare frames kept at most
    input_settle_ticks: int | None = 12  # realtime jitter buffer: unused spare goes after this
    max_input_samples: int = SAMPLE_RATE  # input backlog bound per session, at push time
    # realtime: a session's start burst (input kept from before it ran) the jitter buffer leaves
    # alone and catch-up steps consume (engine/start_burst.py); 0 = none. It may exceed the input
    # bound: a session's push-time bound is then the burst (its jitter buffer trims spare input
    # at every tick anyway, so only a start burst can ever fill it).
    start_burst_frames: int = 0
    output_frames: int = 64  # output queue bound per session
    max_call_frames: int | None = 45_000  # a call ends after this many frames (None: never)
    idle_timeout_s: float | None = 60.0  # a call that pushes nothing this long ends
    retry_after_s: float = 5.0  # the hint in CapacityError

    def __post_init__(self) -> None:
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.output_frames < 1:
            raise ValueError(f"output_frames must be >= 1, got {self.output_frames}")
        if not self.frame_period_s > 0:
            raise ValueError(f"frame_period_s must be > 0, got {self.frame_period_s}")

    @classmethod
    def create(
        cls,
        *,
        realtime: bool = True,
        max_queue: int = 0,
        max_call_s: float | None = 3600.0,
        idle_timeout_s: float | None = 60.0,
        late_wait_s: float = 0.020,
        input_slack_s: float = 0.16,
        input_settle_s: float | None = 1.0,
        max_input_s: float | None = None,
        start_burst_s: float | None = None,
        output_frames: int = 64,
        lossless: bool | None = None,
        retry_after_s: float = 5.0,
        frame_period_s: float = FRAME_SECONDS,
        max_catchup_ticks: int = 3,
    ) -> SchedulerConfig:
        """The config from durations in seconds (None: the documented default or no limit)."""
        if start_burst_s is None:  # a bound given for input holds for the start too
            start_burst_s = DEFAULT_START_BURST_S if max_input_s is None else max_input_s
        if max_input_s is None:
            max_input_s = default_max_input_s(realtime)
        burst_s = start_burst_s
        return cls(
            realtime=realtime,
            max_queue=max_queue,
            lossless=(not realtime) if lossless is None else lossless,
            frame_period_s=frame_period_s,
            max_catchup_ticks=max_catchup_ticks,
            late_wait_s=late_wait_s,
            input_slack_frames=max(0, int(input_slack_s / FRAME_SECONDS + 1e-9)),
            input_settle_ticks=None
            if input_settle_s is None
            else max(1, round(input_settle_s / FRAME_SECONDS)),
            max_input_samples=max(FRAME_SIZE, round(max_input_s * SAMPLE_RATE)),
            start_burst_frames=int(burst_s * SAMPLE_RATE) // FRAME_SIZE if realtime else 0,
            output_frames=output_frames,
            max_call_frames=None if max_call_s is None else max(1, round(max_call_s / FRAME_SECONDS)),
            idle_timeout_s=idle_timeout_s,
            retry_after_s=retry_after_s,
        )
