"""The caller's RTP audio to the session's 24 kHz PCM: one decode, in order, without holes.

RTP over UDP loses, reorders and pauses; the session wants a continuous stream it can frame
(it keeps its own small jitter buffer against late frames: docs/sessions.md). Between them this
class keeps one timeline, the RTP timestamp of the next sample owed to the session (`next_ts`),
and fills every hole in it exactly once:

* a packet that leaves a hole behind it, with sequence numbers missing (**loss**): libopus
  conceals the hole and rebuilds its last frame from the new packet's in-band FEC;
* a hole with no sequence number missing (**DTX**, the sender kept quiet): concealment, which
  after a DTX frame is libopus's comfort noise;
* nothing arriving at all while the clock runs (`on_clock`, realtime hosts only): the owed audio
  is concealed `conceal_after_s` after it was due, 20 ms at a time, for at most `max_fill_s` of
  silence in a row (past that the caller is not sending, e.g. muted, and the session's own
  idle handling takes over);
* a packet for audio already concealed (**late**, or a duplicate) is dropped and counted.

Opus decodes straight to 24 kHz (the model's rate), so the caller's audio is never resampled
here. Every decode and every fill is charged to the caller's `DecodeBudget`, as /api/chat charges
its pages: a peer that sends more audio than real time, or packets that cost too much to decode,
is refused (`DecodeBudgetExceeded`) before it costs its neighbours anything.

The class knows no sockets and no clock of its own: the call feeds it packets and times
(`time.monotonic()`), so tests drive it deterministically.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from personaplex_voice.audio.budget import DecodeBudget
from personaplex_voice.audio.opus_packets import RTP_CLOCK, OpusPacketDecoder

__all__ = ["CallerAudio", "CallerAudioStats"]

_SEQ_MOD, _TS_MOD = 1 << 16, 1 << 32


def _delta(new: int, old: int, modulus: int) -> int:
    """`new - old` for wrapping counters, in (-modulus/2, modulus/2]."""
    half = modulus // 2
    return (new - old + half) % modulus - half


@dataclass
class CallerAudioStats:
    packets: int = 0
    lost_packets: int = 0  # sequence numbers never seen before a later packet arrived
    late_packets: int = 0  # arrived for audio already concealed (or twice)
    rejected_packets: int = 0  # libopus refused them (concealed instead)
    fec_ms: float = 0.0  # lost audio rebuilt from the next packet's FEC
    concealed_ms: float = 0.0  # lost audio extrapolated (PLC), by packet or by clock
    dtx_ms: float = 0.0  # pauses the sender left (DTX), filled with comfort noise
    resyncs: int = 0  # the sender's timeline jumped; followed without filling
    pushed_ms: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "packets": self.packets,
            "lost_packets": self.lost_packets,
            "late_packets": self.late_packets,
            "rejected_packets": self.rejected_packets,
            "fec_ms": round(self.fec_ms, 1),
            "concealed_ms": round(self.concealed_ms, 1),
            "dtx_ms": round(self.dtx_ms, 1),
            "resyncs": self.resyncs,
            "pushed_ms": round(self.pushed_ms, 1),
        }


class CallerAudio:
    """See the module docstring. `push` receives float32 mono PCM at the decoder's rate."""

    FILL_STEP_S = 0.020  # concealment is produced in packet-sized steps
    STALL_S = 0.060  # a clock call this late means the loop stalled: packets may be queued

    def __init__(
        self,
        decoder: OpusPacketDecoder,
        push: Callable[[np.ndarray], None],
        budget: DecodeBudget,
        *,
        conceal_after_s: float = 0.040,
        max_fill_s: float = 1.0,
    ) -> None:
        self._decoder = decoder
        self._push = push
        self._budget = budget
        self.rate = decoder.sample_rate
        self._ts_per_sample = RTP_CLOCK // self.rate
        self.conceal_after_s = conceal_after_s
        self.max_fill_s = max_fill_s
        self.stats = CallerAudioStats()
        self._next_ts: int | None = None  # RTP timestamp owed next (wrapping, 32 bits)
        self._last_seq: int | None = None
        self._due: float | None = None  # when the audio at `_next_ts` was due to arrive
        self._filled_by_clock_s = 0.0  # silence concealed by the clock since the last packet
        self._last_clock: float | None = None

    # -- packets ---------------------------------------------------------------------------------

    def on_packet(self, sequence: int, timestamp: int, payload: bytes, now: float) -> None:
        """One RTP packet of the caller's Opus track (payload = one Opus packet)."""
        if not payload:  # an empty packet carries no audio (a keepalive)
            return
        stats = self.stats
        stats.packets += 1
        if self._next_ts is None or self._last_seq is None:
            self._next_ts, self._last_seq = timestamp, (sequence - 1) % _SEQ_MOD
        seq_step = _delta(sequence, self._last_seq, _SEQ_MOD)
        owed = _delta(timestamp, self._next_ts, _TS_MOD)  # RTP ticks between what is owed and this
        max_gap = round(self.max_fill_s * RTP_CLOCK)
        if owed < 0 and -owed <= max_gap:
            stats.late_packets += 1  # its audio was concealed already (or it came twice)
            if seq_step > 0:
                self._last_seq = sequence
            return
        self._budget.begin_message()
        try:
            if owed > max_gap or owed < 0:
                # The sender's timeline jumped (a long mute, a new source): follow it, no fill.
                stats.resyncs += 1
            elif owed > 0:
                self._fill(owed // self._ts_per_sample, fec_from=payload if seq_step > 1 else None)
                if seq_step > 1:
                    stats.lost_packets += seq_step - 1
            self._next_ts = timestamp
            pcm = self._decode(payload)
        finally:
            self._budget.end_message()
        self._last_seq = sequence
        self._next_ts = (timestamp + len(pcm) * self._ts_per_sample) % _TS_MOD
        self._due = now + len(pcm) / self.rate
        self._filled_by_clock_s = 0.0
        self._emit(pcm)

    def _decode(self, payload: bytes) -> np.ndarray:
        try:
            pcm = self._decoder.decode(payload)
        except ValueError:  # damaged or hostile: conceal one packet's worth in its place
            self.stats.rejected_packets += 1
            self._budget.charge_damage()
            step = self._decoder.frame_samples(round(self.FILL_STEP_S * self.rate))
            self.stats.concealed_ms += 1000 * step / self.rate
            return self._decoder.conceal(step)
        self._budget.charge_packet(len(pcm))
        return pcm

    def _fill(self, samples: int, fec_from: bytes | None) -> None:
        """`samples` of hole before the packet now arriving: concealment, its last frame rebuilt
        from that packet's FEC when packets were lost (a DTX pause has none to rebuild)."""
        step = self._decoder.frame_samples(round(self.FILL_STEP_S * self.rate))
        last = self._decoder.frame_samples(min(samples, step)) if fec_from is not None else 0
        concealed = samples - last
        while concealed >= self._decoder.frame_samples(1):
            n = self._decoder.frame_samples(min(concealed, step))
            self._budget.charge_packet(n)
            self._emit(self._decoder.conceal(n))
            concealed -= n
            if fec_from is not None:
                self.stats.concealed_ms += 1000 * n / self.rate
            else:
                self.stats.dtx_ms += 1000 * n / self.rate
        if fec_from is not None and last:
            self._budget.charge_packet(last)
            self._emit(self._decoder.recover(fec_from, last))
            self.stats.fec_ms += 1000 * last / self.rate

    # -- the clock -------------------------------------------------------------------------------

    def on_clock(self, now: float) -> None:
        """Conceal the audio owed for longer than `conceal_after_s` (see the module docstring).
        Called every ~20 ms on a realtime host; never on a lossless one (it waits for input)."""
        stalled = self._last_clock is not None and now - self._last_clock > self.STALL_S
        self._last_clock = now
        if stalled or self._due is None or self._next_ts is None:
            return  # after a stall the loop first hands over the packets that queued meanwhile
        step = self._decoder.frame_samples(round(self.FILL_STEP_S * self.rate))
        step_s = step / self.rate
        self._budget.begin_message()
        try:
            while now >= self._due + self.conceal_after_s and self._filled_by_clock_s < self.max_fill_s:
                self._budget.charge_packet(step)
                pcm = self._decoder.conceal(step)
                self._next_ts = (self._next_ts + step * self._ts_per_sample) % _TS_MOD
                self._due += step_s
                self._filled_by_clock_s += step_s
                self.stats.concealed_ms += 1000 * step_s
                self._emit(pcm)
        finally:
            self._budget.end_message()

    def _emit(self, pcm: np.ndarray) -> None:
        if len(pcm):
            self.stats.pushed_ms += 1000 * len(pcm) / self.rate
            self._push(pcm)
