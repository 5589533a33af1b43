"""How much decoding work one client's audio may cost: token buckets refilled by wall time.

A transport decodes what a client sends on the server's CPU, shared with every other call. A
client may burst (after a network stall) but not stream much faster than real time, and no
message may cost more than a few milliseconds, whatever its bytes hold. Two resources are
counted, each as a bucket that refills with wall time and holds at most a burst:

* **audio**: what decoding produced, in samples, where every packet and page is charged at least
  a minimum, and damage (a packet the codec rejects, a page with a bad CRC or of another stream)
  the most a packet can hold: over a reliable transport damage means a broken or hostile client,
  and a flood of it must empty the bucket as fast as the costliest real audio would;
* **CPU**: the thread CPU time spent decoding, per message and per wall second (the ground
  truth, whatever the bytes are).

`DecodeBudget` is what a decoder (`OggOpusReader.feed`) consults as it goes, so it stops at the
first breach instead of finishing a message first. `TokenBucket` is the bucket itself, for
transports that only need to pace a count (the Twilio bridge's μ-law bytes, message bytes).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["DecodeBudget", "DecodeBudgetExceeded", "DecodeLimits", "TokenBucket"]

Clock = Callable[[], float]


class TokenBucket:
    """`rate` units per second of `clock`, at most `burst` saved up; starts full."""

    def __init__(self, rate: float, burst: float, clock: Clock = time.monotonic) -> None:
        if rate < 0 or burst <= 0:
            raise ValueError(f"a token bucket needs rate >= 0 and burst > 0, got {rate} and {burst}")
        self.rate, self.burst = float(rate), float(burst)
        self._clock = clock
        self._level = self.burst
        self._at = clock()

    def refill(self) -> float:
        """Adds what the time since the last refill earned; returns the level."""
        now = self._clock()
        self._level = min(self.burst, self._level + (now - self._at) * self.rate)
        self._at = now
        return self._level

    def take(self, amount: float) -> bool:
        """Spends `amount` (refilling first); False, and the level left below zero, once over.
        A bucket that went negative stays so until time pays the debt back."""
        self.refill()
        self._level -= amount
        return self._level >= 0

    def spend(self, amount: float) -> bool:
        """Like `take` without refilling first (for many small charges within one message)."""
        self._level -= amount
        return self._level >= 0

    @property
    def level(self) -> float:
        return self._level


class DecodeBudgetExceeded(Exception):
    """A client's audio costs more than its budget. `reason` is `too_fast` (more audio than real
    time allows) or `decode_cost` (too much CPU); the message says it in words."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class DecodeLimits:
    """The numbers of a `DecodeBudget` (defaults: see docs/audio.md for why these values)."""

    speed: float = 1.5  # decoded audio per wall second, times real time
    burst_s: float = 10.0  # audio that may arrive at once (after a network stall)
    min_packet_s: float = 0.0025  # the least a packet is charged: the shortest Opus frame
    min_page_s: float = 0.001  # what examining one Ogg page is charged, on top of its packets
    damage_s: float = 0.120  # a rejected packet or a skipped page: the longest Opus packet
    message_cpu_s: float = 0.020  # CPU one message may cost
    cpu_share: float = 0.02  # CPU per wall second over time (a fraction of one core)
    cpu_burst_s: float = 0.050  # CPU that may be spent at once


class DecodeBudget:
    """The budget of one client's decoder. Use per message: `begin_message()`, then
    `charge_page()` / `charge_packet(samples)` as the decoder goes (each raises
    `DecodeBudgetExceeded` at the first breach), then `end_message()`.

    Audio is counted in samples at `sample_rate`. CPU is read from `cpu_clock` (thread CPU time:
    time the thread spent waiting for the GIL or a core is not the client's cost) every few
    charges, so the check costs far less than the decoding it bounds.
    """

    CPU_CHECK_EVERY = 8  # charges between two CPU readings

    def __init__(
        self,
        sample_rate: int,
        limits: DecodeLimits | None = None,
        *,
        clock: Clock = time.monotonic,
        cpu_clock: Clock = time.thread_time,
    ) -> None:
        self.limits = limits = limits or DecodeLimits()
        self.sample_rate = sample_rate
        self._audio = TokenBucket(limits.speed * sample_rate, limits.burst_s * sample_rate, clock)
        self._cpu = TokenBucket(limits.cpu_share, limits.cpu_burst_s, clock)
        self._cpu_clock = cpu_clock
        self._min_packet = max(1, round(limits.min_packet_s * sample_rate))
        self._min_page = max(1, round(limits.min_page_s * sample_rate))
        self._damage = max(1, round(limits.damage_s * sample_rate))
        self._message_started: float | None = None
        self._until_cpu_check = self.CPU_CHECK_EVERY
        self.cpu_s = 0.0  # CPU spent in messages so far (for metrics and tests)

    def begin_message(self) -> None:
        self._audio.refill()
        self._cpu.refill()
        self._message_started = self._cpu_clock()
        self._until_cpu_check = self.CPU_CHECK_EVERY

    def charge_page(self) -> None:
        self._charge(self._min_page)

    def charge_packet(self, samples: int) -> None:
        self._charge(max(samples, self._min_packet))

    def charge_damage(self) -> None:
        self._charge(self._damage)

    def end_message(self) -> None:
        """Books the message's CPU; raises if it overdrew the per-second CPU budget."""
        if self._message_started is None:
            return
        used = self._cpu_clock() - self._message_started
        self._message_started = None
        self.cpu_s += used
        if not self._cpu.spend(used):
            raise self._cpu_exceeded(used)

    def _charge(self, samples: int) -> None:
        if not self._audio.spend(samples):
            self._abandon_message()
            raise DecodeBudgetExceeded("too_fast", "audio arrives much faster than real time")
        self._until_cpu_check -= 1
        if self._until_cpu_check <= 0 and self._message_started is not None:
            self._until_cpu_check = self.CPU_CHECK_EVERY
            used = self._cpu_clock() - self._message_started
            if used > self.limits.message_cpu_s or used > self._cpu.level:
                self._abandon_message()
                raise self._cpu_exceeded(used)

    def _abandon_message(self) -> None:
        if self._message_started is not None:
            self.cpu_s += self._cpu_clock() - self._message_started
            self._message_started = None

    def _cpu_exceeded(self, used: float) -> DecodeBudgetExceeded:
        limits = self.limits
        if used > limits.message_cpu_s:
            spent = f"{used * 1000:.1f} ms for one message, at most {limits.message_cpu_s * 1000:g} ms"
        else:
            spent = f"over {limits.cpu_share * 1000:g} ms per second"
        return DecodeBudgetExceeded("decode_cost", f"audio costs too much server time to decode ({spent})")
