"""Ogg-Opus as a live byte stream: the audio format of /api/chat (Moshi and PersonaPlex clients).

The Opus codec is libopus through ``opuslib``. The Ogg framing around it (RFC 3533 pages, RFC 7845
Opus mapping) is written here because no maintained Python library fits a live stream: pyogg and
soundfile/libsndfile read whole files, and sphn's stream reader (the closest fit) decodes pages
without checking their CRC, ignores pre-skip and exposes neither the headers nor what it dropped.
The framing is small: page parsing, lacing, a CRC, and two header formats.

Reader policy, for a stream that arrives over a reliable transport (so damage means a buggy or
hostile client, and the right answer is to tell that client, not to guess):

* structural damage (bytes that are not a page, an unknown page version, a page over
  ``max_page_bytes``, a stream that is not Opus or lacks OpusHead/OpusTags, an unsupported
  channel mapping) raises :class:`OggError`; the reader then stays failed;
* local damage (a page whose CRC does not match, a lost page, an Opus packet libopus rejects,
  pages of another multiplexed logical stream) is skipped and counted in ``dropped``.

Decoding is the receiving server's cost, so ``feed`` takes an optional :class:`DecodeBudget`: every
page and every packet (decoded or rejected) is charged as it is met, and the first breach stops
the message there (``DecodeBudgetExceeded``) instead of after all of it has been decoded. A
failed reader keeps only what went wrong, never the exception (whose traceback would hold the
decoded audio of the message that failed).
"""

from __future__ import annotations

import secrets
import struct
import zlib
from dataclasses import dataclass, field

import numpy as np

from .budget import DecodeBudget, DecodeBudgetExceeded
from .framing import FrameBuffer
from .opus_library import opuslib  # libopus is loaded at first use, not at import

__all__ = ["OPUS_RATES", "OggError", "OggOpusReader", "OggOpusWriter", "OpusHead", "ogg_crc"]

OPUS_RATES = (8000, 12000, 16000, 24000, 48000)  # rates libopus decodes to and encodes from
_GRANULE_RATE = 48000  # Ogg-Opus granule positions and pre-skip always count 48 kHz samples

_CAPTURE = b"OggS"
_PAGE_HEADER = struct.Struct("<4sBBqIIIB")  # capture, version, flags, granule, serial, seq, crc, segs
_CRC_OFFSET = 22
_FLAG_CONTINUED, _FLAG_BOS, _FLAG_EOS = 0x01, 0x02, 0x04
MAX_PAGE_BYTES = 27 + 255 + 255 * 255  # the largest page the format can express


class OggError(ValueError):
    """The bytes are not a well-formed Ogg-Opus stream (the message says what is wrong)."""


# --- CRC ------------------------------------------------------------------------------------------
# Ogg's CRC-32 is the non-reflected polynomial 0x04C11DB7 with zero init and no final xor. zlib's
# crc32 is the reflected form of the same polynomial, so feeding it bit-reversed bytes yields the
# bit-reversed Ogg CRC: C speed without a table loop in Python.
_REVERSE_BITS = bytes(int(f"{i:08b}"[::-1], 2) for i in range(256))


def ogg_crc(data: bytes) -> int:
    reflected = zlib.crc32(bytes(data).translate(_REVERSE_BITS), 0xFFFFFFFF) ^ 0xFFFFFFFF
    return int(f"{reflected:032b}"[::-1], 2)


def _build_page(packet: bytes, *, flags: int, granule: int, serial: int, seq: int) -> bytes:
    """One page holding exactly one whole packet (the writer never splits or groups packets)."""
    full, rest = divmod(len(packet), 255)
    if full >= 255:
        raise ValueError(f"packet of {len(packet)} bytes does not fit one Ogg page")
    lacing = bytes([255] * full + [rest])
    page = bytearray(_PAGE_HEADER.pack(_CAPTURE, 0, flags, granule, serial, seq, 0, len(lacing)))
    page += lacing
    page += packet
    struct.pack_into("<I", page, _CRC_OFFSET, ogg_crc(page))
    return bytes(page)


# --- Opus headers ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class OpusHead:
    """The identification header (RFC 7845 §5.1)."""

    channels: int
    pre_skip: int  # 48 kHz samples to discard at the start of the decoded stream
    input_sample_rate: int  # informational only
    output_gain_q8: int  # dB * 256, to apply to the decoded signal
    mapping_family: int = 0

    _FORMAT = struct.Struct("<8sBBHIhB")

    def to_bytes(self) -> bytes:
        return self._FORMAT.pack(
            b"OpusHead", 1, self.channels, self.pre_skip, self.input_sample_rate, self.output_gain_q8, 0
        )

    @classmethod
    def parse(cls, packet: bytes) -> OpusHead:
        if not packet.startswith(b"OpusHead"):
            raise OggError("not an Opus stream: the first packet is not OpusHead")
        if len(packet) < cls._FORMAT.size:
            raise OggError(f"OpusHead too short ({len(packet)} bytes)")
        _, version, channels, pre_skip, rate, gain, family = cls._FORMAT.unpack_from(packet)
        if version >> 4 != 0:
            raise OggError(f"unsupported OpusHead version {version}")
        if channels == 0:
            raise OggError("OpusHead declares 0 channels")
        if family != 0 or channels > 2:
            raise OggError(f"unsupported Opus channel mapping (family {family}, {channels} channels)")
        return cls(channels, pre_skip, rate, gain, family)


@dataclass(frozen=True)
class OpusTags:
    """The comment header (RFC 7845 §5.2): vendor string and ``KEY=value`` comments."""

    vendor: str
    comments: tuple[str, ...] = field(default_factory=tuple)

    def to_bytes(self) -> bytes:
        def length_prefixed(text: str) -> bytes:
            raw = text.encode()
            return struct.pack("<I", len(raw)) + raw

        count = struct.pack("<I", len(self.comments))
        comments = b"".join(length_prefixed(c) for c in self.comments)
        return b"OpusTags" + length_prefixed(self.vendor) + count + comments

    @classmethod
    def parse(cls, packet: bytes) -> OpusTags:
        if not packet.startswith(b"OpusTags"):
            raise OggError("missing OpusTags: the second packet of an Opus stream must be OpusTags")
        try:
            pos = 8
            (vendor_len,) = struct.unpack_from("<I", packet, pos)
            vendor = packet[pos + 4 : pos + 4 + vendor_len]
            pos += 4 + vendor_len
            (count,) = struct.unpack_from("<I", packet, pos)
            pos += 4
            comments = []
            for _ in range(count):
                (n,) = struct.unpack_from("<I", packet, pos)
                if pos + 4 + n > len(packet):
                    raise struct.error("comment runs past the packet")
                comments.append(packet[pos + 4 : pos + 4 + n].decode("utf-8", "replace"))
                pos += 4 + n
            if len(vendor) != vendor_len:
                raise struct.error("vendor string runs past the packet")
        except struct.error as exc:
            raise OggError(f"malformed OpusTags: {exc}") from None
        return cls(vendor.decode("utf-8", "replace"), tuple(comments))


# --- Reader ---------------------------------------------------------------------------------------
class OggOpusReader:
    """Push bytes in any split (parts of pages, several pages at once); get decoded audio out.

    ``feed`` returns one float32 mono array per decoded Opus packet (stereo streams are mixed
    down), at ``sample_rate``, with the stream's pre-skip and output gain applied.
    """

    def __init__(self, sample_rate: int = 24000, max_page_bytes: int = MAX_PAGE_BYTES) -> None:
        if sample_rate not in OPUS_RATES:
            raise ValueError(f"Opus decodes to {OPUS_RATES} Hz, not {sample_rate}")
        if max_page_bytes < 27 + 255:
            raise ValueError(f"max_page_bytes {max_page_bytes} is below a page header with its lacing")
        self.sample_rate = sample_rate
        self.max_page_bytes = max_page_bytes
        self.dropped = 0  # pages and packets skipped as damaged or foreign (see the module docstring)
        self.pages = 0  # pages accepted
        self.head: OpusHead | None = None
        self.tags: OpusTags | None = None
        self._buf = bytearray()
        self._failure: OggError | DecodeBudgetExceeded | None = None  # a fresh copy is raised each time
        self._serial: int | None = None
        self._ended = False  # EOS seen; only a new logical stream (BOS) may follow
        self._next_seq = 0
        self._partial: bytearray | None = None  # a packet continued on the next page
        self._decoder: opuslib.Decoder | None = None
        self._to_skip = 0  # pre-skip samples still to drop, at sample_rate
        self._decoded = 0  # samples decoded in this logical stream, pre-skip included
        self._gain = 1.0
        self._max_frame = sample_rate * 120 // 1000  # the longest Opus packet: 120 ms
        self._pcm = np.empty(0, dtype=np.float32)  # decode buffer, sized once OpusHead is known

    def feed(self, data: bytes, budget: DecodeBudget | None = None) -> list[np.ndarray]:
        """Decodes every page ``data`` completes. With a ``budget``, each page and packet is charged
        as it is met and the first breach raises ``DecodeBudgetExceeded``: the reader is then
        failed, like after an ``OggError``, and the audio of that message is dropped."""
        if self._failure is not None:
            raise _copy(self._failure)
        self._buf += data
        out: list[np.ndarray] = []
        if budget is not None:
            budget.begin_message()
        try:
            pos = 0
            while (page_len := self._complete_page_length(pos)) is not None:
                if budget is not None:
                    budget.charge_page()
                self._on_page(bytes(self._buf[pos : pos + page_len]), out, budget)
                pos += page_len
            del self._buf[:pos]
            if budget is not None:
                budget.end_message()
        except (OggError, DecodeBudgetExceeded) as exc:
            out.clear()  # the traceback keeps this frame: it must not keep the audio too
            self._failure = _copy(exc)
            self._buf.clear()
            raise
        return out

    def _complete_page_length(self, pos: int) -> int | None:
        """Length of the page starting at ``pos`` once all of it has arrived; raises on non-pages."""
        available = len(self._buf) - pos
        if available <= 0:
            return None
        if self._buf[pos : pos + 4] != _CAPTURE[: min(4, available)]:
            raise OggError("not an Ogg page (lost sync: no 'OggS' capture pattern where a page starts)")
        if available < 27:
            return None
        if self._buf[pos + 4] != 0:
            raise OggError(f"unsupported Ogg version {self._buf[pos + 4]}")
        segments = self._buf[pos + 26]
        if available < 27 + segments:
            return None
        page_len = 27 + segments + sum(self._buf[pos + 27 : pos + 27 + segments])
        if page_len > self.max_page_bytes:
            raise OggError(f"Ogg page of {page_len} bytes is over the {self.max_page_bytes}-byte limit")
        return page_len if available >= page_len else None

    def _on_page(self, page: bytes, out: list[np.ndarray], budget: DecodeBudget | None) -> None:
        _, _, flags, granule, serial, seq, crc, segments = _PAGE_HEADER.unpack_from(page)
        unsummed = bytearray(page)
        unsummed[_CRC_OFFSET : _CRC_OFFSET + 4] = b"\0\0\0\0"
        if ogg_crc(unsummed) != crc:
            self.dropped += 1
            self._lose_partial()
            if budget is not None:
                budget.charge_damage()
            return
        if self._serial is None or (self._ended and flags & _FLAG_BOS):
            if not flags & _FLAG_BOS:
                raise OggError("missing OpusHead: the stream does not start with a beginning-of-stream page")
            self._start_logical_stream(serial, seq)
        elif serial != self._serial or self._ended:
            self.dropped += 1  # another multiplexed stream, or pages after end of stream
            if budget is not None:
                budget.charge_damage()
            return
        if seq != self._next_seq:
            self._lose_partial()  # pages went missing in between
        if not flags & _FLAG_CONTINUED:
            self._lose_partial()  # the packet's continuation never came
        self._next_seq = (seq + 1) & 0xFFFFFFFF
        self.pages += 1

        lacing = page[27 : 27 + segments]
        body = page[27 + segments :]
        # A continued page with no packet in progress starts with the tail of a packet whose head
        # was lost: skip up to the end of that packet.
        skipping = bool(flags & _FLAG_CONTINUED) and self._partial is None
        offset = 0
        first_new = len(out)
        for value in lacing:
            if skipping:
                offset += value
                if value < 255:
                    skipping = False
                    self.dropped += 1
                continue
            if self._partial is None:
                self._partial = bytearray()
            self._partial += body[offset : offset + value]
            offset += value
            if len(self._partial) > self.max_page_bytes:
                raise OggError(f"Opus packet over {self.max_page_bytes} bytes")
            if value < 255:  # packet complete
                packet, self._partial = bytes(self._partial), None
                decoded = self._on_packet(packet, out)
                if budget is not None and decoded < 0:
                    budget.charge_damage()
                elif budget is not None:
                    budget.charge_packet(decoded)
        if flags & _FLAG_EOS:
            self._ended = True
            self._partial = None
            self._trim_end(granule, out, first_new)

    def _trim_end(self, granule: int, out: list[np.ndarray], first_new: int) -> None:
        """The end-of-stream granule position may stop short of the last packet's end (the
        encoder padded the final frame): cut the excess from the audio this page produced."""
        end = granule * self.sample_rate // _GRANULE_RATE
        excess = self._decoded - end if granule >= 0 else 0
        while excess > 0 and len(out) > first_new:
            cut = min(excess, len(out[-1]))
            out[-1] = out[-1][: len(out[-1]) - cut]
            excess -= cut
            if not len(out[-1]):
                out.pop()

    def _start_logical_stream(self, serial: int, seq: int) -> None:
        self._serial, self._next_seq, self._ended = serial, seq, False
        self.head = self.tags = None
        self._decoder = None
        self._partial = None

    def _lose_partial(self) -> None:
        if self._partial is not None:
            self.dropped += 1
            self._partial = None

    def _on_packet(self, packet: bytes, out: list[np.ndarray]) -> int:
        """Decodes one packet into ``out``; returns the samples libopus produced (0 for a header),
        -1 for a packet skipped as damaged."""
        if self.head is None:
            self.head = OpusHead.parse(packet)
            self._decoder = opuslib.Decoder(self.sample_rate, self.head.channels)
            self._pcm = np.empty(self._max_frame * self.head.channels, dtype=np.float32)
            self._to_skip = round(self.head.pre_skip * self.sample_rate / _GRANULE_RATE)
            self._decoded = 0
            self._gain = 10.0 ** (self.head.output_gain_q8 / (20.0 * 256.0))
            return 0
        if self.tags is None:
            self.tags = OpusTags.parse(packet)
            return 0
        if not packet:
            self.dropped += 1
            return -1
        assert self._decoder is not None
        # The same libopus call as opuslib's Decoder.decode_float, but into a reused numpy buffer:
        # opuslib copies the samples through a Python list, which costs more than the decoding.
        n = opuslib.api.decoder.libopus_decode_float(
            self._decoder.decoder_state,
            packet,
            len(packet),
            self._pcm.ctypes.data_as(opuslib.api.c_float_pointer),
            self._max_frame,
            0,
        )
        if n < 0:  # libopus rejected the packet
            self.dropped += 1
            return -1
        pcm = self._pcm[: n * self.head.channels].copy()
        if self.head.channels == 2:
            pcm = pcm.reshape(-1, 2).mean(axis=1, dtype=np.float32)
        self._decoded += len(pcm)
        if self._to_skip:
            skip = min(self._to_skip, len(pcm))
            pcm, self._to_skip = pcm[skip:], self._to_skip - skip
        if self._gain != 1.0:
            pcm = pcm * np.float32(self._gain)
        if len(pcm):
            out.append(np.ascontiguousarray(pcm))
        return n


def _copy(exc: OggError | DecodeBudgetExceeded) -> OggError | DecodeBudgetExceeded:
    """The same failure as a new exception object, without the original's traceback."""
    if isinstance(exc, DecodeBudgetExceeded):
        return DecodeBudgetExceeded(exc.reason, str(exc))
    return OggError(str(exc))


# --- Writer ---------------------------------------------------------------------------------------
_FRAME_MS = (2.5, 5, 10, 20, 40, 60)


class OggOpusWriter:
    """Encodes mono float32 audio to Ogg-Opus pages, one page per packet so that every ``frame_ms``
    of audio leaves as soon as it is encoded.

    ``write`` returns whole pages (the first call prefixed by the OpusHead and OpusTags pages unless
    ``headers()`` already handed them out); ``flush`` encodes what is left (zero-padded), ends the
    stream with an end-of-stream page whose granule position trims the padding, and finishes the
    writer. Granule positions count 48 kHz samples including the pre-skip, as RFC 7845 requires.
    """

    def __init__(
        self,
        sample_rate: int = 24000,
        frame_ms: float = 20,
        *,
        bitrate: int | None = None,
        application: str = "restricted_lowdelay",
        serial: int | None = None,
        vendor: str = "personaplex-voice",
    ) -> None:
        if sample_rate not in OPUS_RATES:
            raise ValueError(f"Opus encodes from {OPUS_RATES} Hz, not {sample_rate}")
        if frame_ms not in _FRAME_MS:
            raise ValueError(f"Opus frames are {_FRAME_MS} ms, not {frame_ms}")
        self.sample_rate = sample_rate
        self.frame_size = int(sample_rate * frame_ms / 1000)
        self._encoder = opuslib.Encoder(sample_rate, 1, application)
        if bitrate is not None:
            self._encoder.bitrate = bitrate
        lookahead = opuslib.api.encoder.encoder_ctl(
            self._encoder.encoder_state, opuslib.api.ctl.get_lookahead
        )
        self._scale = _GRANULE_RATE // sample_rate
        self.head = OpusHead(
            channels=1, pre_skip=lookahead * self._scale, input_sample_rate=sample_rate, output_gain_q8=0
        )
        self.tags = OpusTags(vendor=vendor)
        self.serial = secrets.randbits(32) if serial is None else serial & 0xFFFFFFFF
        self._pending = FrameBuffer(self.frame_size)
        self._headers_sent = False
        self._finished = False
        self._seq = 2  # pages 0 and 1 are the headers
        self._granule = 0  # decoded 48 kHz samples so far (pre-skip included)
        self._samples_in = 0

    def headers(self) -> bytes:
        """The OpusHead and OpusTags pages (the same bytes every call); ``write`` then omits them."""
        self._headers_sent = True
        return _build_page(self.head.to_bytes(), flags=_FLAG_BOS, granule=0, serial=self.serial, seq=0) + (
            _build_page(self.tags.to_bytes(), flags=0, granule=0, serial=self.serial, seq=1)
        )

    def write(self, pcm: np.ndarray) -> bytes:
        if self._finished:
            raise RuntimeError("OggOpusWriter.write after flush(): the stream has ended")
        pcm = np.asarray(pcm, dtype=np.float32).reshape(-1)
        self._samples_in += len(pcm)
        self._pending.push(pcm)
        out = bytearray() if self._headers_sent else bytearray(self.headers())
        for frame in self._pending.pop_all():
            out += self._page_for(frame, eos=False)
        return bytes(out)

    def flush(self) -> bytes:
        """Encodes the rest (padded with silence until the decoder has all real samples past the
        pre-skip), marks the end of stream, and finishes the writer."""
        if self._finished:
            return b""
        out = bytearray() if self._headers_sent else bytearray(self.headers())
        end_granule = self.head.pre_skip + self._samples_in * self._scale
        frames = []
        if len(self._pending):
            frames.append(self._pending.pop_padded())
        while self._granule + len(frames) * self.frame_size * self._scale < end_granule or not frames:
            frames.append(np.zeros(self.frame_size, dtype=np.float32))
        for i, frame in enumerate(frames):
            out += self._page_for(frame, eos=i == len(frames) - 1, end_granule=end_granule)
        self._finished = True
        return bytes(out)

    def _page_for(self, frame: np.ndarray, *, eos: bool, end_granule: int | None = None) -> bytes:
        packet = self._encoder.encode_float(frame.tobytes(), self.frame_size)
        self._granule += self.frame_size * self._scale
        granule = self._granule
        if eos and end_granule is not None:
            granule = max(min(end_granule, granule), granule - self.frame_size * self._scale)
        page = _build_page(
            packet, flags=_FLAG_EOS if eos else 0, granule=granule, serial=self.serial, seq=self._seq
        )
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        return page
