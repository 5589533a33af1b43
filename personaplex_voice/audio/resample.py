"""Sample-rate conversion: a low-delay streaming resampler for live audio, and a one-shot one for files.

Live audio (phone calls at 8 kHz, the engine at 24 kHz) goes through :class:`StreamingResampler`, a
polyphase FIR whose prototype filter is designed here for *low delay*, not linear phase: a
least-squares fit to ``gain * exp(-j w D)`` over the passband and to zero over the stopband, with
``D`` (1.5 ms for the telephone band) far shorter than half the filter length (5.4 ms). The group
delay stays within 0.15 ms of ``D`` over the passband, so the filter holds audio back only ``D``,
where a linear-phase filter of similar rejection holds it back 3-5 ms and soxr's streaming modes
22-85 ms (bench/transport.py --candidates; docs/audio.md explains the choice).

Files go through :func:`resample` (soxr, very high quality, delay-compensated): there the delay does
not matter and arbitrary rate pairs (44.1 kHz) do.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import soxr
from numpy.lib.stride_tricks import as_strided

__all__ = ["BlockResampler", "StreamingResampler", "design_lowdelay_lowpass", "resample"]

# Filter shape for a conversion whose lower rate is 8 kHz; other rates scale it in time by
# 8000 / lower_rate (a 16 kHz pair gets half the delay and half the duration, same rejection).
_PASS_FRACTION = 0.85  # passband edge as a fraction of the lower Nyquist: 3400 Hz of 4000 Hz
_DELAY_S_AT_8K = 1.5e-3  # group delay over the passband
_LENGTH_S_AT_8K = 10.75e-3  # filter duration: sets the stopband rejection
_STOP_WEIGHT = 100.0  # stopband vs passband weight in the least-squares fit
_TRANSITION_WEIGHT = 1e-3  # just enough to keep the transition band from bulging
_MAX_PHASES = 12  # interpolation factor limit; other ratios belong to the one-shot resample()


@functools.lru_cache(maxsize=32)
def design_lowdelay_lowpass(
    high_rate: int, pass_hz: float, stop_hz: float, num_taps: int, delay: float, gain: float
) -> np.ndarray:
    """Real FIR taps (float64) minimising the weighted squared error to ``gain*exp(-j w delay)``
    times a target amplitude: 1 on [0, pass_hz], a raised-cosine fall to 0 across the transition
    band, 0 on [stop_hz, high_rate/2]; ``delay`` in samples of ``high_rate``.

    The transition gets a small weight: without it a low-delay fit puts a +14 dB bump there (the
    error is free to go anywhere it is not measured), which would amplify line noise at 3.5-4 kHz.
    The pass/stop integrals have closed forms; the transition target is integrated numerically.
    The normal equations (a Toeplitz Gram matrix) are then solved directly: milliseconds.
    """
    wp = 2 * math.pi * pass_hz / high_rate
    ws = 2 * math.pi * stop_hz / high_rate

    def cos_integral(a: float, b: float, n: np.ndarray) -> np.ndarray:
        # integral of cos(w n) for w in [a, b], element-wise in n (n may be fractional or zero)
        out = np.empty_like(n, dtype=np.float64)
        small = np.abs(n) < 1e-12
        nz = n[~small]
        out[~small] = (np.sin(b * nz) - np.sin(a * nz)) / nz
        out[small] = b - a
        return out

    lags = np.arange(num_taps, dtype=np.float64)
    gram_row = (
        cos_integral(0.0, wp, lags)
        + _TRANSITION_WEIGHT * cos_integral(wp, ws, lags)
        + _STOP_WEIGHT * cos_integral(ws, math.pi, lags)
    )
    idx = np.arange(num_taps)
    gram = gram_row[np.abs(idx[:, None] - idx[None, :])]
    target = cos_integral(0.0, wp, lags - delay)
    w = np.linspace(wp, ws, 801)
    ramp = 0.5 + 0.5 * np.cos(np.pi * (w - wp) / (ws - wp))
    trapezoid = np.full(len(w), w[1] - w[0])  # quadrature weights (np.trapezoid needs numpy 2)
    trapezoid[[0, -1]] /= 2
    target += _TRANSITION_WEIGHT * (np.cos(np.outer(lags - delay, w)) @ (ramp * trapezoid))
    taps = np.linalg.solve(gram, gain * target)
    taps.setflags(write=False)  # cached and shared between resamplers
    return taps


class StreamingResampler:
    """Converts a mono float32 stream between rates whose ratio reduces to small integers
    (8, 16, 24, 48 kHz in any direction), chunk by chunk, with about 1.5 ms of delay at 8 kHz.

    The output depends only on the concatenated input, never on how it was chunked: output sample
    ``n`` is computed from the same taps and inputs, in the same order, whatever the chunk sizes.
    After ``k`` input samples in total it has produced ``ceil(k * out_rate / in_rate)`` samples.
    """

    def __init__(self, in_rate: int, out_rate: int) -> None:
        if in_rate <= 0 or out_rate <= 0:
            raise ValueError(f"sample rates must be positive, got {in_rate} -> {out_rate}")
        g = math.gcd(in_rate, out_rate)
        self.in_rate, self.out_rate = in_rate, out_rate
        self._up, self._down = out_rate // g, in_rate // g
        if max(self._up, self._down) > _MAX_PHASES:
            raise ValueError(
                f"streaming resampling {in_rate} -> {out_rate} Hz needs a ratio of small integers "
                f"(8/16/24/48 kHz); use resample() for whole signals"
            )
        if self._up == self._down:  # same rate: a copy, no delay
            self._taps_by_phase = np.ones((1, 1))
            self._delay_high = 0.0
        else:
            lower = min(in_rate, out_rate)
            high = in_rate * self._up  # the rate of the zero-stuffed signal the prototype filters
            scale = 8000.0 / lower
            self._delay_high = _DELAY_S_AT_8K * scale * high
            per_phase = math.ceil(_LENGTH_S_AT_8K * scale * high / self._up)
            taps = design_lowdelay_lowpass(
                high,
                _PASS_FRACTION * lower / 2,
                lower / 2,
                per_phase * self._up,
                self._delay_high,
                float(self._up),
            )
            # Phase p holds taps p, p+L, p+2L, ..., reversed so that they line up with a window of
            # the input in time order (oldest first).
            self._taps_by_phase = taps.reshape(per_phase, self._up).T[:, ::-1].copy()
        self._window = self._taps_by_phase.shape[1]
        self.reset()

    @property
    def delay_samples(self) -> float:
        """Group delay over the passband, in output samples."""
        return self._delay_high / self._down

    @property
    def delay_seconds(self) -> float:
        return self.delay_samples / self.out_rate

    def reset(self) -> None:
        """Forget all past input: the next sample starts a new stream (as if preceded by silence)."""
        self._history = np.zeros(self._window - 1, dtype=np.float64)
        self._consumed = 0  # input samples seen since the start
        self._produced = 0  # output samples returned since the start

    def process(self, x: np.ndarray) -> np.ndarray:
        """Feed any number of input samples; returns every output sample they complete."""
        x = np.asarray(x, dtype=np.float64).reshape(-1)
        buffer = np.concatenate([self._history, x])  # buffer[0] is input index _consumed - (window-1)
        consumed = self._consumed + len(x)
        total_out = -(-consumed * self._up // self._down)  # ceil
        count = total_out - self._produced
        out = np.empty(count, dtype=np.float64)
        up, down, window = self._up, self._down, self._window
        # Outputs r, r+L, r+2L, ... of this call share one polyphase branch, and their input windows
        # start M samples apart: one np.correlate per branch, keeping every M-th result. Each
        # output is one dot product of the same taps with the same inputs however the stream was
        # chunked, which keeps the output independent of chunk sizes down to the last bit.
        for r in range(min(up, count)):
            n0 = self._produced + r
            k = (count - r + up - 1) // up
            start = n0 * down // up - self._consumed  # window of output n0, in `buffer`
            segment = buffer[start : start + (k - 1) * down + window]
            out[r::up] = np.correlate(segment, self._taps_by_phase[n0 * down % up], "valid")[::down]
        self._history = buffer[len(buffer) - (window - 1) :] if window > 1 else buffer[:0]
        self._consumed, self._produced = consumed, total_out
        return out.astype(np.float32)

    def flush(self) -> np.ndarray:
        """Returns the delayed tail of the stream (the filter run on silence), then resets."""
        pad = math.ceil(self._delay_high / self._up) + 1 if self._delay_high else 0
        tail = self.process(np.zeros(pad, dtype=np.float32))
        self.reset()
        return tail


class BlockResampler(StreamingResampler):
    """:class:`StreamingResampler`'s conversion (same filter, delay and state; outputs equal up to
    float64 rounding) computed as one matrix product per call instead of one short dot product
    per output sample.

    ``np.correlate`` makes 640-1920 tiny dot products per 80 ms frame, each dominated by call
    overhead; on a phone server that was a quarter of the CPU per call. Here the outputs go in
    blocks of ``block_inputs * up`` samples whose input windows sit ``block_inputs * down``
    inputs apart: one constant matrix holds a block's taps, and the overlapping input windows (a
    strided view) times that matrix give every block at once in BLAS, 2-4x faster per frame.
    The price: BLAS may sum in a different order for different chunk sizes, so the output is
    chunking-invariant only to ~1e-15, not to the bit as :class:`StreamingResampler` is.
    """

    def __init__(self, in_rate: int, out_rate: int, block_inputs: int = 32) -> None:
        super().__init__(in_rate, out_rate)
        self._block = block_inputs * self._up  # outputs per block
        self._stride = block_inputs * self._down  # inputs between consecutive blocks' windows
        self._matrices: dict[int, np.ndarray] = {}

    def _matrix(self, first: int) -> np.ndarray:
        """[span, block] taps of a block whose first output is ``first`` (mod up): column i holds
        output i's taps at the rows of its input window. Made once per process and shared (read
        only) by every resampler of the same rates: a phone call's first frames then cost no
        filter set-up (a burst of arriving calls shares the event loop with the calls talking)."""
        key = first % self._up
        matrix = self._matrices.get(key)
        if matrix is None:
            matrix = self._matrices[key] = _block_matrix(
                self.in_rate, self.out_rate, self._block // self._up, key
            )
        return matrix

    def process(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, np.float64).reshape(-1)
        # buffer[0] is input sample `_consumed - (window - 1)`; output n reads the `window`
        # samples from buffer[n * down // up - _consumed] on, with the taps of phase n*down % up.
        buffer = np.concatenate([self._history, x])
        up, down = self._up, self._down
        consumed = self._consumed + len(x)
        total_out = -(-consumed * up // down)
        count = total_out - self._produced
        out = np.zeros(0, np.float64)
        if count:
            matrix = self._matrix(self._produced)
            start = self._produced * down // up - self._consumed
            blocks = -(-count // self._block)
            need = start + (blocks - 1) * self._stride + matrix.shape[0]
            padded = buffer  # the last block may run past the input: its extra outputs go
            if need > len(buffer):
                padded = np.concatenate([buffer, np.zeros(need - len(buffer))])
            view = padded[start:]
            windows = as_strided(
                view,
                shape=(blocks, matrix.shape[0]),
                strides=(self._stride * view.strides[0], view.strides[0]),
            )
            out = (windows @ matrix).reshape(-1)[:count]
        self._history = buffer[len(buffer) - (self._window - 1) :]
        self._consumed, self._produced = consumed, total_out
        return out.astype(np.float32)


@functools.lru_cache(maxsize=64)
def _block_matrix(in_rate: int, out_rate: int, block_inputs: int, key: int) -> np.ndarray:
    """`BlockResampler._matrix` for these rates, block and phase (made once, then shared)."""
    prototype = StreamingResampler(in_rate, out_rate)
    up, down, window = prototype._up, prototype._down, prototype._window
    block = block_inputs * up
    offsets = [(key + i) * down // up - key * down // up for i in range(block)]
    matrix = np.zeros((offsets[-1] + window, block), np.float64)
    for i, offset in enumerate(offsets):
        matrix[offset : offset + window, i] = prototype._taps_by_phase[(key + i) * down % up]
    matrix.setflags(write=False)
    return matrix


def resample(x: np.ndarray, in_rate: int, out_rate: int) -> np.ndarray:
    """One-shot conversion of a whole mono signal between any two rates (soxr, very high quality,
    its delay compensated). For files and prompts, not live streams."""
    x = np.asarray(x, dtype=np.float32)
    if in_rate == out_rate:
        return x.copy()
    if len(x) == 0:
        return np.zeros(0, dtype=np.float32)
    return np.asarray(soxr.resample(x, in_rate, out_rate, quality="VHQ"), dtype=np.float32)
