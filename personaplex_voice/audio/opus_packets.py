"""Bare Opus packets, one 20 ms frame each, as RTP carries them (RFC 7587): no Ogg around them.

The WebRTC transport sends and receives these; /api/chat uses the Ogg stream codec in `opus.py`.
Both are libopus through ``opuslib`` (loaded at first use). What RTP adds over a reliable stream
is loss: a packet may never arrive, and the codec has two answers to that, both here:

* **in-band FEC** (RFC 6716 §2.1.7, "LBRR"): the encoder adds a low-bitrate copy of the previous
  frame to each packet, sized by the loss it expects (`expected_loss_pct`); the decoder rebuilds a
  lost frame from the *next* packet (`recover`). LBRR exists only in the SILK and hybrid modes,
  so the encoder runs in the `voip` application (the `restricted_lowdelay` mode of the Ogg
  writer is CELT only and would carry no FEC);
* **concealment** (`conceal`): libopus extrapolates a frame from its state (PLC), or, after a
  DTX pause, makes comfort noise.

DTX (RFC 7587 §3.1.3): with `dtx` on, the encoder signals silence with packets of at most two
bytes, which a sender does not transmit (`OpusPacket.dtx`); the receiver fills the pause with
`conceal`. The RTP clock of Opus is always 48 kHz whatever rate the codec runs at.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .framing import FrameBuffer
from .opus_library import opuslib

__all__ = ["RTP_CLOCK", "OpusPacket", "OpusPacketDecoder", "OpusPacketEncoder"]

RTP_CLOCK = 48000  # RFC 7587 §4.1: the RTP timestamp of Opus counts 48 kHz samples
_DTX_MAX_BYTES = 2  # RFC 7587 §3.1.3: a packet this small is a DTX frame, not to be sent
_MAX_PACKET_BYTES = 1500  # far above any 20 ms voice packet (510 kbit/s is 1275 bytes)


@dataclass(frozen=True)
class OpusPacket:
    data: bytes
    samples: int  # at the encoder's rate

    @property
    def dtx(self) -> bool:
        """A silence marker the sender keeps to itself (RFC 7587 §3.1.3)."""
        return len(self.data) <= _DTX_MAX_BYTES


class OpusPacketEncoder:
    """Mono float32 at `sample_rate` in (any length); 20 ms Opus packets out."""

    def __init__(
        self,
        sample_rate: int = 24000,
        frame_ms: int = 20,
        *,
        bitrate: int = 32000,
        complexity: int = 5,
        fec: bool = True,
        dtx: bool = False,
        expected_loss_pct: int = 5,
    ) -> None:
        self.sample_rate = sample_rate
        self.frame_size = sample_rate * frame_ms // 1000
        self._encoder = opuslib.Encoder(sample_rate, 1, "voip")
        self._encoder.bitrate = bitrate
        # 5 of 10: a third of the CPU of 10 in voip mode with FEC, at the same bitrate (libwebrtc
        # picks 5 on mobile); the server encodes every call's agent audio.
        self._ctl(opuslib.api.ctl.set_complexity, complexity)
        # opuslib's `inband_fec` property setter drops its value (opuslib 3.0.1): set it directly.
        self._ctl(opuslib.api.ctl.set_inband_fec, 1 if fec else 0)
        self._ctl(opuslib.api.ctl.set_dtx, 1 if dtx else 0)
        self.fec, self.dtx = fec, dtx
        self.expected_loss_pct = -1
        self.set_expected_loss(expected_loss_pct)
        self._pending = FrameBuffer(self.frame_size)

    def set_expected_loss(self, percent: float) -> None:
        """The loss the peer reports (RTCP): how much FEC the encoder spends bits on."""
        value = int(min(100, max(0, round(percent))))
        if value != self.expected_loss_pct:
            self._ctl(opuslib.api.ctl.set_packet_loss_perc, value)
            self.expected_loss_pct = value

    def _ctl(self, request: object, value: int) -> None:
        opuslib.api.encoder.encoder_ctl(self._encoder.encoder_state, request, value)

    def encode(self, pcm: np.ndarray) -> list[OpusPacket]:
        """One packet per complete 20 ms frame; the rest waits for the next call."""
        self._pending.push(np.asarray(pcm, dtype=np.float32).reshape(-1))
        return [
            OpusPacket(self._encoder.encode_float(frame.tobytes(), self.frame_size), self.frame_size)
            for frame in self._pending.pop_all()
        ]


class OpusPacketDecoder:
    """Opus packets (mono or stereo, any mode) to mono float32 at `sample_rate`, with the loss
    answers of the module docstring. Every method returns a new array; a packet libopus rejects
    raises ValueError."""

    def __init__(self, sample_rate: int = 24000) -> None:
        self.sample_rate = sample_rate
        self._decoder = opuslib.Decoder(sample_rate, 1)
        self._max = sample_rate * 120 // 1000  # the longest Opus packet
        self._pcm = np.empty(self._max, dtype=np.float32)
        self._step = sample_rate // 400  # frame sizes are multiples of 2.5 ms

    def decode(self, packet: bytes) -> np.ndarray:
        if not packet or len(packet) > _MAX_PACKET_BYTES:
            raise ValueError(f"an Opus packet of {len(packet)} bytes")
        return self._run(packet, self._max, fec=False)

    def recover(self, next_packet: bytes, samples: int) -> np.ndarray:
        """The frame lost just before `next_packet`, from its FEC data (concealed by libopus
        when the packet carries none). `samples`: the lost frame's length."""
        return self._run(next_packet, self._frame(samples), fec=True)

    def conceal(self, samples: int) -> np.ndarray:
        """`samples` of packet-loss concealment, or comfort noise after a DTX frame."""
        return self._run(None, self._frame(samples), fec=False)

    def frame_samples(self, samples: int) -> int:
        """`samples` rounded down to what one concealment call can produce (2.5 ms steps, at
        most 120 ms)."""
        return self._frame(samples)

    def _frame(self, samples: int) -> int:
        return max(self._step, min(self._max, samples - samples % self._step))

    def _run(self, packet: bytes | None, frame_size: int, *, fec: bool) -> np.ndarray:
        # opuslib's own decode copies the samples through a Python list; this is the same call
        # into a reused buffer (as OggOpusReader does).
        n = opuslib.api.decoder.libopus_decode_float(
            self._decoder.decoder_state,
            packet,
            len(packet) if packet else 0,
            self._pcm.ctypes.data_as(opuslib.api.c_float_pointer),
            frame_size,
            1 if fec else 0,
        )
        if n < 0:
            raise ValueError(f"libopus rejected the packet (error {n})")
        return self._pcm[:n].copy()
