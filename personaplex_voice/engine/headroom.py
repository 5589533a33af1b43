"""A process's real-time headroom, and the saturation policy that turns it into admission.

A realtime server owes every admitted call a frame every 80 ms and a media message every 20 ms.
What it has left to give is measured where it is spent, by whoever spends it:

- the event loop (every call's sockets, JSON, codecs and pacing): how late its timers fire (lag:
  the median of a second; stalls: the worst gaps, its own and each call's playout pacer's) and
  how much of the wall clock it works (load: its thread's CPU, or the media path's wall time
  when that is more), sampled by `process.loop_monitor.LoopMonitor`;
- the media path: transports time each message they handle (`MediaMeter`), per call and for the
  process;
- the engine: its step time against the frame period and clock overruns (the scheduler's
  `EngineLoad`).

Only the process's own lateness decides. How late callers *send* is theirs: a caller whose audio
arrives late or in bursts (a poor mobile link, or on purpose) gets silence fed to the model and
its late audio trimmed, counted per call (`late_input`, `jitter_buffer`), and the share of
streaming sessions fed late silence is reported (`late_share`) but refuses nobody: five such
callers must not shut the door on everyone else.

`SaturationPolicy` (pure: a fake clock and made-up `Signals` test it exactly) decides from those:
a signal over its *enter* level for its hold time makes the process saturated; it stays so until
every signal is back under its *exit* level for `exit_hold_s` (hysteresis, in level and in time).
Admission also looks ahead: the calls this process took on in the last `settle_s` (the growth of
its call count) have not shown up in the measured load yet, so each counts at what a call was
seen to cost, and a call that would take the loop over its enter level is refused before it
gets there. While saturated or so
refused, new calls are refused (`SaturatedError`), the calls already talking keep their line.

`Headroom` is the one owner of a process's saturation state: it holds the samples, feeds the
policy, and tells its host when the state changes. It also owns the process's `ArrivalGate`
(engine/arrivals.py), which paces call set-up behind the calls in progress. Knobs:
`HeadroomConfig`, `ArrivalConfig` (docs/capacity.md).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from personaplex_voice.engine.arrivals import ArrivalConfig, ArrivalGate, wait_histogram
from personaplex_voice.engine.base import SaturatedError
from personaplex_voice.metrics import Counter, Gauge, Histogram, InstrumentSet

log = logging.getLogger("personaplex_voice.engine.headroom")

# How often the state is re-evaluated when a caller asks (the loop monitor evaluates on its own).
EVALUATE_EVERY_S = 0.1
# What a call is taken to cost the loop at least (a share of one core): about what a phone call
# costs here (docs/capacity.md), so a connection storm on a fresh process is bounded too.
FIRST_CALL_LOAD = 0.01


@dataclass(frozen=True)
class HeadroomConfig:
    """The saturation policy's knobs. Levels are shares (loads) or seconds (lag)."""

    enabled: bool = True
    window_s: float = 1.0  # loop samples are summarized over this long
    exit_hold_s: float = 3.0  # every signal under its exit level this long ends a saturation
    settle_s: float = 2.0  # calls taken on this recently count as load not yet measured
    # The most a call is believed to cost the loop, from the loop's load over its calls: beyond
    # it the load is something else (connection churn, webhooks), which the measured load itself
    # covers. Calls whose own media path costs more (a test's blocked handler) count at that.
    max_call_load: float = 0.05
    # Event-loop lag: the median of the window's timer delays (a loop whose every other timer
    # is 20 ms late has less left than a phone call's inbound slack and playout cushion; a
    # collection pause or a neighbour's burst moves the median of a second by nothing).
    loop_lag_enter_s: float = 0.020
    loop_lag_exit_s: float = 0.005
    loop_lag_hold_s: float = 1.0
    # Event-loop load: share of the wall clock the loop works (window mean).
    loop_load_enter: float = 0.70
    loop_load_exit: float = 0.55
    loop_load_hold_s: float = 0.5
    # Engine step: the 90th percentile of the last 2 s of steps, over the frame period.
    step_load_enter: float = 0.85
    step_load_exit: float = 0.70
    step_load_hold_s: float = 1.0
    # Engine clock overruns (the clock fell more than 3 ticks behind and skipped) within
    # `overrun_window_s`: this many saturate at once.
    overruns_enter: int = 2
    overrun_window_s: float = 5.0
    # Stalls: the loop (or a call's playout pacer) woke more than `stall_s` late, a gap every
    # call in progress hears (its carrier holds ~80 ms of our audio). This many stalls within
    # `stall_window_s` saturate at once; one (a collection, a neighbour's burst) refuses nobody.
    stall_s: float = 0.100
    stalls_enter: int = 3
    stall_window_s: float = 5.0
    # Share of streaming sessions fed late silence (reported, never a reason to refuse: how late
    # callers send is theirs), shown with at least this many streaming.
    late_min_sessions: int = 4

    def __post_init__(self) -> None:
        pairs = (
            ("loop_lag", self.loop_lag_enter_s, self.loop_lag_exit_s),
            ("loop_load", self.loop_load_enter, self.loop_load_exit),
            ("step_load", self.step_load_enter, self.step_load_exit),
        )
        for name, enter, leave in pairs:
            if not 0 <= leave <= enter:
                raise ValueError(
                    f"{name}: the exit level ({leave}) must be between 0 and the enter level ({enter})"
                )
        if self.window_s <= 0 or self.exit_hold_s < 0 or self.settle_s < self.window_s:
            raise ValueError("window_s must be > 0, exit_hold_s >= 0 and settle_s >= window_s")
        if self.stall_s <= 0 or self.stalls_enter < 1 or self.stall_window_s <= 0:
            raise ValueError("stall_s and stall_window_s must be > 0, stalls_enter >= 1")


DISABLED = HeadroomConfig(enabled=False)


@dataclass(frozen=True)
class Signals:
    """One look at a process's load. None: the process does not measure that (a front-end has
    no engine, a bare manager no event loop of its own)."""

    loop_lag_s: float | None = None
    loop_load: float | None = None
    step_load: float | None = None
    overruns: int = 0  # clock overruns within the overrun window
    late_share: float | None = None  # reported only: the callers' lateness, not the process's
    active: int = 0  # calls this process carries now (reserved ones included)
    media_load: float | None = None  # the calls' media path alone, share of the wall clock
    stalls: int = 0  # loop or playout gaps over `stall_s` within the stall window
    worst_gap_s: float | None = None  # the longest loop or playout gap of the last window


@dataclass(frozen=True)
class _Rule:
    name: str
    enter: float
    leave: float
    hold_s: float


@dataclass(frozen=True)
class Verdict:
    """What the policy decided at one evaluation."""

    saturated: bool  # the measured state (with hysteresis)
    reasons: tuple[str, ...]  # the signals that made (or keep) it saturated
    projected_load: float | None  # the loop's load once the calls admitted lately show
    refusing: bool  # new calls are refused: saturated, or the projection is over the enter level

    @property
    def why(self) -> str:
        if self.saturated:
            return ", ".join(self.reasons)
        if self.refusing:
            return "loop_load (projected)"
        return ""


class SaturationPolicy:
    """Saturation with hysteresis, and admission by projected load. Pure: time and signals come
    from the caller (`update(now, signals)`)."""

    def __init__(self, config: HeadroomConfig):
        self.config = config
        self._rules = (
            _Rule("loop_lag", config.loop_lag_enter_s, config.loop_lag_exit_s, config.loop_lag_hold_s),
            _Rule("loop_load", config.loop_load_enter, config.loop_load_exit, config.loop_load_hold_s),
            _Rule("step_load", config.step_load_enter, config.step_load_exit, config.step_load_hold_s),
            _Rule("overruns", float(config.overruns_enter), 0.0, 0.0),
            _Rule("stalls", float(config.stalls_enter), 0.0, 0.0),
        )
        self.saturated = False
        self.reasons: tuple[str, ...] = ()
        self._over_since: dict[str, float] = {}
        self._calm_since: float | None = None
        self._active: deque[tuple[float, int]] = deque()  # (time, calls carried) over settle_s
        self._idle_load: float | None = None  # the loop's load with no call (its own overhead)
        self.verdict = Verdict(False, (), None, False)

    def pending(self, now: float, active: int) -> int:
        """Calls taken on in the last `settle_s` (what the call count grew by since its lowest),
        whose load the measured window does not hold yet. Calls that come and go (a churn of
        short sessions) are in the load already and count nothing here."""
        history = self._active
        history.append((now, active))
        while history and now - history[0][0] > self.config.settle_s:
            history.popleft()
        return max(0, active - min(count for _, count in history))

    def update(self, now: float, signals: Signals) -> Verdict:
        if not self.config.enabled:
            self.verdict = Verdict(False, (), None, False)
            return self.verdict
        values = {
            "loop_lag": signals.loop_lag_s,
            "loop_load": signals.loop_load,
            "step_load": signals.step_load,
            "overruns": float(signals.overruns),
            "stalls": float(signals.stalls),
        }
        over: list[str] = []
        calm = True
        for rule in self._rules:
            value = values[rule.name]
            if value is not None and value >= rule.enter:
                since = self._over_since.setdefault(rule.name, now)
                if now - since >= rule.hold_s:
                    over.append(rule.name)
            else:
                self._over_since.pop(rule.name, None)
            if value is not None and value > rule.leave:
                calm = False
        if not self.saturated:
            if over:
                self.saturated, self.reasons, self._calm_since = True, tuple(over), None
        elif not calm:
            self._calm_since = None
            if over:
                self.reasons = tuple(over)
        else:
            if self._calm_since is None:
                self._calm_since = now
            if now - self._calm_since >= self.config.exit_hold_s:
                self.saturated, self.reasons, self._calm_since = False, (), None
        projected, per_call = self._project(now, signals)
        # One more call must fit under the loop's enter level, with the ones on their way.
        refusing = self.saturated or (
            projected is not None and projected + per_call >= self.config.loop_load_enter
        )
        self.verdict = Verdict(self.saturated, self.reasons, projected, refusing)
        return self.verdict

    def _project(self, now: float, signals: Signals) -> tuple[float | None, float]:
        """(the loop's load once the calls taken on in the last `settle_s` show up in it, what one
        call costs). A call costs what the calls carried cost on average above the idle loop,
        between `FIRST_CALL_LOAD` and `max_call_load`, or what their media path alone costs
        when that is more."""
        load = signals.loop_load
        active = signals.active
        pending = self.pending(now, active)
        if load is None:
            return None, 0.0
        if active == 0:
            previous = self._idle_load
            self._idle_load = load if previous is None else 0.8 * previous + 0.2 * load
        per_call = FIRST_CALL_LOAD
        if active:
            average = (load - (self._idle_load or 0.0)) / active
            per_call = min(max(average, FIRST_CALL_LOAD), self.config.max_call_load)
            if signals.media_load is not None:
                per_call = max(per_call, signals.media_load / active)
        return load + pending * per_call, per_call


@dataclass(frozen=True)
class EngineLoad:
    """What an engine's scheduler reports of its own clock (`Scheduler.engine_load`)."""

    step_load: float | None  # 90th percentile of recent steps over the frame period
    overruns: int  # clock overruns since the scheduler started
    late_frames: int  # over the last second of ticks: streaming sessions fed late silence
    streaming_frames: int  # and streaming sessions stepped
    ticks: int  # ticks that second held


@dataclass
class HeadroomMetrics(InstrumentSet):
    """A process's headroom as /metrics shows it (`prefix`: "frontend_" on a cluster front-end,
    whose engine workers report theirs under the plain names)."""

    saturated: Gauge
    loop_lag: Gauge
    loop_load: Gauge
    media_load: Gauge
    step_load: Gauge
    worst_gap: Gauge
    saturations: Counter
    arrival_wait: Histogram
    arrivals_waiting: Gauge

    @classmethod
    def create(cls, prefix: str = "") -> HeadroomMetrics:
        return cls(
            saturated=Gauge(
                prefix + "saturated", "1 while new calls are refused for lack of real-time headroom"
            ),
            loop_lag=Gauge(prefix + "loop_lag_seconds", "Event-loop timer lag, median over the last second"),
            loop_load=Gauge(
                prefix + "loop_load", "Share of the wall clock the event loop works (last second)"
            ),
            media_load=Gauge(
                prefix + "media_path_load",
                "Share of the wall clock spent in the calls' media path (last second)",
            ),
            step_load=Gauge(
                prefix + "engine_step_load", "Engine step time over the frame period (p90, last 2 s)"
            ),
            worst_gap=Gauge(
                prefix + "loop_worst_gap_seconds",
                "The longest the event loop or a call's playout pacer woke late (last second)",
            ),
            saturations=Counter(prefix + "saturations_total", "Times the process became saturated"),
            arrival_wait=wait_histogram(prefix),
            arrivals_waiting=Gauge(
                prefix + "arrivals_waiting", "Call set-up steps waiting for their turn on the event loop"
            ),
        )


class MediaMeter:
    """One call's media-path time: each message a transport handles, timed by it (`add`), and
    added to its process's `Headroom`. Used from the call's event loop only."""

    __slots__ = ("_headroom", "count", "max_s", "seconds")

    def __init__(self, headroom: Headroom | None):
        self._headroom = headroom
        self.seconds = 0.0
        self.max_s = 0.0
        self.count = 0

    def add(self, seconds: float) -> None:
        self.seconds += seconds
        self.count += 1
        if seconds > self.max_s:
            self.max_s = seconds
        if self._headroom is not None:
            self._headroom.add_media(seconds)

    def woke_late(self, seconds: float) -> None:
        """The call's playout pacer woke `seconds` after it meant to (its loop was busy)."""
        if self._headroom is not None:
            self._headroom.note_gap(seconds)

    def summary(self, call_s: float) -> dict[str, float]:
        """Per call: media-path ms per second of call, and the costliest message's ms."""
        per_s = 1000 * self.seconds / call_s if call_s > 0 else 0.0
        return {"media_ms_per_s": round(per_s, 3), "media_max_ms": round(1000 * self.max_s, 3)}


@dataclass
class _LoopWindow:
    """The loop monitor's samples over the last window: (time, lag, worst gap), (time, load,
    media load); and the stalls (time, gap) of the last stall window."""

    lags: deque[tuple[float, float, float]] = field(default_factory=deque)
    loads: deque[tuple[float, float, float]] = field(default_factory=deque)
    stalls: deque[tuple[float, float]] = field(default_factory=deque)

    def trim(self, now: float, window_s: float, stall_window_s: float) -> None:
        for samples in (self.lags, self.loads):
            while samples and now - samples[0][0] > window_s:
                samples.popleft()
        while self.stalls and now - self.stalls[0][0] > stall_window_s:
            self.stalls.popleft()


class Headroom:
    """The one owner of a process's saturation state (see the module docstring).

    Fed from any thread: `note_loop` (the loop monitor), `add_media` and `note_gap`
    (transports, via their `MediaMeter`), `admitted` (the host, per call admitted); `engine` and
    `active` are read when it evaluates. `check()` raises `SaturatedError` while new calls are
    refused; `on_change` callbacks hear each change of the measured state (the host sheds its
    queue, the log says so). `arrivals` is the process's set-up gate (engine/arrivals.py): it
    paces set-up whether or not the policy is on, and refuses offers that waited too long only
    while it is.
    """

    def __init__(
        self,
        config: HeadroomConfig | None = None,
        *,
        now: Callable[[], float] = time.monotonic,
        engine: Callable[[], EngineLoad] | None = None,
        active: Callable[[], int] = lambda: 0,
        metrics_prefix: str = "",
        retry_after_s: float = 5.0,
        name: str = "this server",
        arrivals: ArrivalConfig | None = None,
    ):
        self.config = config if config is not None else HeadroomConfig()
        self.name = name
        self.metrics = HeadroomMetrics.create(metrics_prefix)
        self.retry_after_s = retry_after_s
        self._now = now
        self._engine = engine
        self._active = active
        self._policy = SaturationPolicy(self.config)
        self._lock = threading.Lock()
        self._window = _LoopWindow()
        self._media_total = 0.0  # media-path seconds so far (written by transports, lock-free)
        self._media_seen = 0.0  # `_media_total` at the last loop sample
        self._gap = 0.0  # the worst playout gap reported since the last loop sample (lock-free)
        self._overruns: deque[tuple[float, int]] = deque()
        self._evaluated_at: float | None = None
        self._listeners: list[Callable[[bool, Verdict], None]] = []
        self.signals = Signals()
        self.arrivals = ArrivalGate(
            arrivals,
            refusing=lambda: self.config.enabled,
            wait=self.metrics.arrival_wait,
            waiting=self.metrics.arrivals_waiting,
            retry_after_s=retry_after_s,
        )

    @property
    def enabled(self) -> bool:
        return self.config.enabled

    # ---- what is measured -------------------------------------------------------------------

    def note_loop(self, lag_s: float, busy: float) -> None:
        """One loop sample: the timer's lag, and the share of the interval the loop's thread was
        on the CPU. The media path's wall time since the last sample counts when it is more
        (time blocked in a call's message handling is the loop's too). The sample's gap is the
        longer of its lag and the worst a call's playout pacer woke late since the last sample;
        one over `stall_s` is a stall (a run of such samples, one stall)."""
        now = self._now()
        config = self.config
        with self._lock:
            window = self._window
            media, self._media_seen = self._media_total - self._media_seen, self._media_total
            if window.loads:
                interval = now - window.loads[-1][0]
                media_load = media / interval if interval > 0 else 0.0
            else:
                media_load = 0.0
            lag = max(0.0, lag_s)
            gap, self._gap = max(lag, self._gap), 0.0
            stalled_before = bool(window.lags) and window.lags[-1][2] > config.stall_s
            if gap > config.stall_s and not stalled_before:
                window.stalls.append((now, gap))
            window.lags.append((now, lag, gap))
            window.loads.append((now, max(busy, media_load, 0.0), media_load))
            window.trim(now, config.window_s, config.stall_window_s)

    def add_media(self, seconds: float) -> None:
        # A lost update between two loops' threads costs a message's time in one sample: no lock.
        self._media_total += seconds

    def note_gap(self, seconds: float) -> None:
        """A call's playout pacer woke `seconds` late (kept until the next loop sample)."""
        if seconds > self._gap:
            self._gap = seconds

    def meter(self) -> MediaMeter:
        """A call's media-path meter, adding to this process's."""
        return MediaMeter(self)

    def admitted(self) -> None:
        """A call was admitted (an open, or a reservation for one): decide afresh now, so a burst
        of admissions is judged one by one."""
        self.evaluate()

    # ---- the state ------------------------------------------------------------------------------

    def evaluate(self) -> Verdict:
        """Gather the signals, let the policy decide, tell listeners of a change."""
        if not self.config.enabled:
            return self._policy.verdict
        with self._lock:
            now = self._now()
            was = self._policy.saturated
            self.signals = signals = self._signals(now)
            verdict = self._policy.update(now, signals)
            self._evaluated_at = now
            self._publish(signals, verdict)
        if verdict.saturated != was:
            self._log_change(verdict, signals)
            for listener in list(self._listeners):
                listener(verdict.saturated, verdict)
        return verdict

    @property
    def verdict(self) -> Verdict:
        """The latest decision, re-evaluated when older than `EVALUATE_EVERY_S`."""
        at = self._evaluated_at
        if self.config.enabled and (at is None or self._now() - at >= EVALUATE_EVERY_S):
            return self.evaluate()
        return self._policy.verdict

    @property
    def refusing(self) -> bool:
        return self.verdict.refusing

    def check(self) -> None:
        """Raise `SaturatedError` while new calls are refused."""
        verdict = self.verdict
        if verdict.refusing:
            raise SaturatedError(
                f"this server cannot take another call in real time ({verdict.why}); retry in "
                f"{self.retry_after_s:g} s or elsewhere",
                retry_after_s=self.retry_after_s,
            )

    def on_change(self, listener: Callable[[bool, Verdict], None]) -> None:
        self._listeners.append(listener)

    def describe(self) -> dict[str, Any]:
        """The state and its signals, for /readyz, /api/cluster and a worker's STATUS."""
        verdict, signals = self.verdict, self.signals
        return {
            "saturated": verdict.refusing,
            "reasons": list(verdict.reasons) or ([verdict.why] if verdict.why else []),
            "loop_lag_ms": _rounded(signals.loop_lag_s, 1000, 1),
            "loop_load": _rounded(signals.loop_load),
            "projected_loop_load": _rounded(verdict.projected_load),
            "engine_step_load": _rounded(signals.step_load),
            "late_share": _rounded(signals.late_share),
            "overruns": signals.overruns,
            "worst_gap_ms": _rounded(signals.worst_gap_s, 1000, 1),
            "stalls": signals.stalls,
            "arrivals_waiting": self.arrivals.waiting,
        }

    # ---- internals (callers hold `_lock`) -------------------------------------------------------

    def _signals(self, now: float) -> Signals:
        config = self.config
        window = self._window
        window.trim(now, config.window_s, config.stall_window_s)
        lags = sorted(lag for _, lag, _ in window.lags)
        loop_lag = lags[len(lags) // 2] if lags else None
        worst_gap = max((gap for _, _, gap in window.lags), default=None)
        loads = window.loads
        loop_load = sum(load for _, load, _ in loads) / len(loads) if loads else None
        media_load = sum(media for _, _, media in loads) / len(loads) if loads else None
        step_load = late_share = None
        overruns = 0
        if self._engine is not None:
            engine = self._engine()
            step_load = engine.step_load
            self._overruns.append((now, engine.overruns))
            while self._overruns and now - self._overruns[0][0] > config.overrun_window_s:
                self._overruns.popleft()
            overruns = engine.overruns - self._overruns[0][1]
            if engine.ticks and engine.streaming_frames >= config.late_min_sessions * engine.ticks:
                late_share = engine.late_frames / engine.streaming_frames
        return Signals(
            loop_lag,
            loop_load,
            step_load,
            overruns,
            late_share,
            self._active(),
            media_load,
            stalls=len(window.stalls),
            worst_gap_s=worst_gap,
        )

    def _log_change(self, verdict: Verdict, signals: Signals) -> None:
        described = ", ".join(
            f"{name} {value}"
            for name, value in (
                (
                    "loop lag",
                    f"{1000 * signals.loop_lag_s:.0f} ms" if signals.loop_lag_s is not None else None,
                ),
                ("loop load", f"{signals.loop_load:.2f}" if signals.loop_load is not None else None),
                ("engine step load", f"{signals.step_load:.2f}" if signals.step_load is not None else None),
                ("overruns", str(signals.overruns) if signals.overruns else None),
                ("stalls", str(signals.stalls) if signals.stalls else None),
                (
                    "worst gap",
                    f"{1000 * signals.worst_gap_s:.0f} ms" if signals.worst_gap_s is not None else None,
                ),
                (
                    "late share (callers')",
                    f"{signals.late_share:.2f}" if signals.late_share is not None else None,
                ),
            )
            if value is not None
        )
        if verdict.saturated:
            self.metrics.saturations.inc()
            log.warning(
                "%s is saturated (%s; %s): new calls are refused, the %d it carries keep their line",
                self.name,
                verdict.why,
                described or "no signals",
                signals.active,
            )
        else:
            log.info(
                "%s has headroom again (%s): new calls are admitted", self.name, described or "no signals"
            )

    def _publish(self, signals: Signals, verdict: Verdict) -> None:
        metrics = self.metrics
        metrics.saturated.set(1.0 if verdict.refusing else 0.0)
        metrics.loop_lag.set(signals.loop_lag_s or 0.0)
        metrics.loop_load.set(signals.loop_load or 0.0)
        metrics.media_load.set(signals.media_load or 0.0)
        metrics.step_load.set(signals.step_load or 0.0)
        metrics.worst_gap.set(signals.worst_gap_s or 0.0)


def _rounded(value: float | None, scale: float = 1.0, digits: int = 3) -> float | None:
    return None if value is None else round(value * scale, digits)
