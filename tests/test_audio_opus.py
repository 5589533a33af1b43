"""Ogg-Opus stream codec: interop with sphn (the Moshi/PersonaPlex servers' library), Ogg framing
details, and malformed input (specific errors or counted drops, never a crash or a hang)."""

from __future__ import annotations

import struct

import numpy as np
import opuslib
import pytest
import sphn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support_audio import best_lag, espeak_speech, set_level

from personaplex_voice.audio.opus import (
    MAX_PAGE_BYTES,
    OggError,
    OggOpusReader,
    OggOpusWriter,
    OpusHead,
    OpusTags,
    _build_page,
    ogg_crc,
)
from personaplex_voice.audio.resample import resample

RATE = 24000


@pytest.fixture(scope="session")
def speech(tmp_path_factory) -> np.ndarray:
    """Two seconds of espeak-ng speech at 24 kHz, -20 dBFS."""
    pcm, rate = espeak_speech(tmp_path_factory.mktemp("speech"))
    return set_level(resample(pcm, rate, RATE)[: 2 * RATE], -20)


@pytest.fixture(scope="session")
def our_stream(speech) -> bytes:
    writer = OggOpusWriter(serial=1234)
    return b"".join(writer.write(speech[i : i + 1000]) for i in range(0, len(speech), 1000)) + writer.flush()


def split_pages(data: bytes) -> list[bytes]:
    """Cuts a well-formed Ogg stream into its pages (test-side parser, independent of the reader)."""
    pages, pos = [], 0
    while pos < len(data):
        assert data[pos : pos + 4] == b"OggS"
        segments = data[pos + 26]
        size = 27 + segments + sum(data[pos + 27 : pos + 27 + segments])
        pages.append(data[pos : pos + size])
        pos += size
    return pages


def page_fields(page: bytes) -> dict:
    _, _version, flags, granule, serial, seq, crc, segments = struct.unpack_from("<4sBBqIIIB", page)
    return {
        "flags": flags,
        "granule": granule,
        "serial": serial,
        "seq": seq,
        "crc": crc,
        "lacing": list(page[27 : 27 + segments]),
        "body": page[27 + segments :],
    }


def reference_crc(data: bytes) -> int:
    """The Ogg CRC straight from RFC 3533: polynomial 0x04C11DB7, MSB first, init 0, no xor-out."""
    crc = 0
    for byte in data:
        crc ^= byte << 24
        for _ in range(8):
            crc = ((crc << 1) ^ 0x04C11DB7) & 0xFFFFFFFF if crc & 0x80000000 else (crc << 1) & 0xFFFFFFFF
    return crc


def with_crc(page: bytes) -> bytes:
    page = bytearray(page)
    page[22:26] = b"\0\0\0\0"
    page[22:26] = struct.pack("<I", ogg_crc(page))
    return bytes(page)


def decode_all(reader: OggOpusReader, data: bytes, step: int | None = None) -> np.ndarray:
    step = step or len(data)
    out = []
    for i in range(0, len(data), step):
        out += reader.feed(data[i : i + step])
    return np.concatenate(out) if out else np.zeros(0, np.float32)


# --- interop with sphn ------------------------------------------------------------------------------
def test_sphn_writer_pages_decode_in_our_reader(speech):
    writer = sphn.OpusStreamWriter(RATE)
    data = b"".join(writer.append_pcm(speech[i : i + 1920]) for i in range(0, len(speech) - 1919, 1920))
    reader = OggOpusReader()
    rng = np.random.default_rng(3)
    out, pos = [], 0
    while pos < len(data):  # pages split and merged arbitrarily across "messages"
        n = int(rng.integers(1, 700))
        out += reader.feed(data[pos : pos + n])
        pos += n
    decoded = np.concatenate(out)
    assert reader.dropped == 0 and reader.head is not None and reader.tags is not None
    # We honour the pre-skip sphn declares (3840 at 48 kHz, far more than its encoder's lookahead),
    # so our output starts that much minus the lookahead *ahead* of the input.
    skip = reader.head.pre_skip // 2
    lag, corr = best_lag(speech, decoded, max_lag=skip + 10)
    assert corr >= 0.9
    assert -skip <= lag <= -skip + 240  # codec lookahead: 0-10 ms


def test_our_writer_bytes_decode_in_sphn_reader(speech, our_stream):
    reader = sphn.OpusStreamReader(RATE)
    out = []
    for i in range(0, len(our_stream), 333):
        pcm = reader.append_bytes(our_stream[i : i + 333])
        if pcm is not None and len(pcm):
            out.append(pcm)
    decoded = np.concatenate(out)
    # sphn ignores pre-skip, so the codec delay (= our declared pre-skip) shows as a lag
    head = OpusHead.parse(page_fields(split_pages(our_stream)[0])["body"])
    lag, corr = best_lag(speech, decoded, max_lag=400)
    assert corr >= 0.9
    assert abs(lag - head.pre_skip // 2) <= 2


def test_our_round_trip_is_aligned_and_exact_length(speech, our_stream):
    reader = OggOpusReader()
    decoded = decode_all(reader, our_stream, step=97)
    assert len(decoded) == len(speech)  # pre-skip removed, end padding trimmed by the EOS granule
    lag, corr = best_lag(speech, decoded, max_lag=50)
    assert lag == 0 and corr >= 0.95
    assert reader.tags is not None and reader.tags.vendor == "personaplex-voice"


# --- framing details --------------------------------------------------------------------------------
def test_crc_matches_the_rfc_algorithm_on_our_and_sphn_pages(our_stream):
    sphn_data = sphn.OpusStreamWriter(RATE).append_pcm(np.zeros(1920, np.float32))
    for page in split_pages(our_stream)[:5] + split_pages(sphn_data):
        fields = page_fields(page)
        zeroed = page[:22] + b"\0\0\0\0" + page[26:]
        assert reference_crc(zeroed) == fields["crc"] == ogg_crc(zeroed)
    for blob in (b"", b"a", bytes(range(256)) * 3):
        assert ogg_crc(blob) == reference_crc(blob)


def test_writer_headers_granules_and_one_packet_per_page(speech):
    writer = OggOpusWriter(serial=77)
    n = 24000 + 100  # a second and a bit: the last frame is padded
    data = writer.write(speech[:n]) + writer.flush()
    pages = [page_fields(p) for p in split_pages(data)]
    head, tags, audio = pages[0], pages[1], pages[2:]
    assert head["flags"] == 0x02 and head["granule"] == 0 and head["body"].startswith(b"OpusHead")
    parsed = OpusHead.parse(head["body"])
    assert (
        parsed.channels == 1 and parsed.input_sample_rate == RATE and parsed.pre_skip == writer.head.pre_skip
    )
    assert tags["flags"] == 0 and tags["granule"] == 0 and OpusTags.parse(tags["body"]).vendor
    assert [p["seq"] for p in pages] == list(range(len(pages)))
    assert {p["serial"] for p in pages} == {77}
    for k, page in enumerate(audio[:-1], start=1):
        assert page["granule"] == 960 * k  # 20 ms in 48 kHz units, counted from the stream start
        assert page["lacing"][-1] < 255 and page["flags"] == 0  # exactly one whole packet
    assert audio[-1]["flags"] == 0x04  # end of stream
    assert audio[-1]["granule"] == parsed.pre_skip + 2 * n  # trims the padding
    assert audio[-2]["granule"] < audio[-1]["granule"] <= 960 * len(audio)


def test_writer_headers_once_and_no_writes_after_flush():
    writer = OggOpusWriter()
    headers = writer.headers()
    assert headers == writer.headers() and len(split_pages(headers)) == 2
    first = writer.write(np.zeros(480, np.float32))
    assert b"OpusHead" not in first and len(split_pages(first)) == 1
    assert writer.write(np.zeros(100, np.float32)) == b""  # waits for a full frame
    writer.flush()
    assert writer.flush() == b""
    with pytest.raises(RuntimeError):
        writer.write(np.zeros(480, np.float32))
    with pytest.raises(ValueError):
        OggOpusWriter(sample_rate=44100)
    with pytest.raises(ValueError):
        OggOpusWriter(frame_ms=30)


@pytest.mark.parametrize("frame_ms", [10, 20, 40])
def test_frame_sizes_round_trip(speech, frame_ms):
    writer = OggOpusWriter(frame_ms=frame_ms)
    data = writer.write(speech[:12000]) + writer.flush()
    assert all(page_fields(p)["lacing"][-1] < 255 for p in split_pages(data))
    decoded = decode_all(OggOpusReader(), data)
    assert len(decoded) == 12000 and best_lag(speech[:12000], decoded, 5)[1] > 0.9


def test_stereo_stream_is_mixed_down_and_gain_applied():
    encoder = opuslib.Encoder(48000, 2, "audio")
    t = np.arange(960 * 20) / 48000
    left = 0.3 * np.sin(2 * np.pi * 500 * t)
    stereo = np.stack([left, left], axis=1).astype(np.float32)
    head = OpusHead(channels=2, pre_skip=0, input_sample_rate=48000, output_gain_q8=-6 * 256)
    pages = [
        _build_page(head.to_bytes(), flags=2, granule=0, serial=9, seq=0),
        _build_page(OpusTags("x").to_bytes(), flags=0, granule=0, serial=9, seq=1),
    ]
    for k in range(20):
        packet = encoder.encode_float(stereo[960 * k : 960 * (k + 1)].tobytes(), 960)
        pages.append(_build_page(packet, flags=0, granule=960 * (k + 1), serial=9, seq=2 + k))
    decoded = decode_all(OggOpusReader(), b"".join(pages))
    rms = float(np.sqrt(np.mean(decoded[2400:] ** 2)))
    assert rms == pytest.approx(0.3 / np.sqrt(2) * 10 ** (-6 / 20), rel=0.1)


def test_chained_streams_decode_one_after_the_other(speech):
    def stream(serial):
        w = OggOpusWriter(serial=serial)
        return w.write(speech[:4800]) + w.flush()

    reader = OggOpusReader()
    decoded = decode_all(reader, stream(1) + stream(2))
    assert len(decoded) == 9600 and reader.dropped == 0


# --- malformed input --------------------------------------------------------------------------------
def test_random_bytes_and_non_ogg_are_refused():
    with pytest.raises(OggError, match="OggS"):
        OggOpusReader().feed(b"GET / HTTP/1.1\r\n")
    reader = OggOpusReader()
    assert reader.feed(b"Og") == []  # could still become a page
    with pytest.raises(OggError):
        reader.feed(b"X")
    with pytest.raises(OggError):  # the reader stays failed
        reader.feed(b"gS")


def test_missing_opus_head_and_non_opus_streams(our_stream):
    pages = split_pages(our_stream)
    with pytest.raises(OggError, match="OpusHead"):
        OggOpusReader().feed(pages[2])  # an audio page first, no beginning of stream
    vorbis = _build_page(b"\x01vorbis" + b"\0" * 23, flags=2, granule=0, serial=5, seq=0)
    with pytest.raises(OggError, match="not an Opus stream"):
        OggOpusReader().feed(vorbis)
    with pytest.raises(OggError, match="OpusTags"):  # audio where OpusTags must be
        OggOpusReader().feed(pages[0] + with_crc(pages[2][:18] + struct.pack("<I", 1) + pages[2][22:]))
    bad_head = _build_page(b"OpusHead\x01\x03" + b"\0" * 9, flags=2, granule=0, serial=5, seq=0)
    with pytest.raises(OggError, match="channel mapping"):
        OggOpusReader().feed(bad_head)
    with pytest.raises(OggError, match="too short"):
        OggOpusReader().feed(_build_page(b"OpusHead\x01", flags=2, granule=0, serial=5, seq=0))


def test_bad_crc_drops_only_that_page(speech, our_stream):
    pages = split_pages(our_stream)
    damaged = bytearray(pages[10])
    damaged[-1] ^= 0x55
    reader = OggOpusReader()
    decoded = decode_all(reader, b"".join([*pages[:10], bytes(damaged), *pages[11:]]))
    assert reader.dropped == 1
    assert len(speech) - 480 <= len(decoded) < len(speech)  # one 20 ms packet missing, the rest intact


def test_lost_and_foreign_pages_are_counted_not_fatal(our_stream):
    pages = split_pages(our_stream)
    foreign = _build_page(b"\x01other", flags=0, granule=0, serial=999, seq=0)
    reader = OggOpusReader()
    decoded = decode_all(reader, b"".join([*pages[:5], foreign, *pages[6:]]))
    assert reader.dropped == 1 and len(decoded) > 0


def test_page_over_the_cap_fails_before_its_body_arrives():
    reader = OggOpusReader(max_page_bytes=1000)
    header = struct.pack("<4sBBqIIIB", b"OggS", 0, 2, 0, 1, 0, 0, 8) + bytes([255] * 8)
    with pytest.raises(OggError, match="limit"):
        reader.feed(header)  # 27 + 8 + 2040 bytes declared: refused from the header alone
    with pytest.raises(ValueError):
        OggOpusReader(max_page_bytes=100)
    assert OggOpusReader().max_page_bytes == MAX_PAGE_BYTES


def test_invalid_opus_packets_are_dropped(our_stream):
    pages = split_pages(our_stream)
    junk = [
        _build_page(bytes([3, 0]), flags=0, granule=0, serial=1234, seq=2),  # frame count 0
        _build_page(b"", flags=0, granule=0, serial=1234, seq=3),
    ]
    renumbered = [with_crc(p[:18] + struct.pack("<I", 4 + i) + p[22:]) for i, p in enumerate(pages[2:6])]
    reader = OggOpusReader()
    decoded = decode_all(reader, b"".join([*pages[:2], *junk, *renumbered]))
    assert reader.dropped == 2 and len(decoded) == 4 * 480 - 60  # four good packets less pre-skip


def test_truncated_page_then_more_data_errors_or_drops(our_stream):
    pages = split_pages(our_stream)
    reader = OggOpusReader()
    reader.feed(b"".join(pages[:4]))
    assert reader.feed(pages[4][:40]) == []  # incomplete: waits
    try:
        decode_all(reader, b"".join(pages[5:]))
    except OggError:
        pass
    else:
        assert reader.dropped >= 1


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=3000), step=st.integers(min_value=1, max_value=500))
def test_property_random_bytes_never_crash(data, step):
    reader = OggOpusReader(max_page_bytes=4096)
    try:
        for pcm in [*decode_all(reader, data, step)]:
            assert np.isfinite(pcm)
    except OggError:
        pass


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    edits=st.lists(
        st.tuples(st.sampled_from(["flip", "insert", "delete"]), st.integers(0, 10**6), st.integers(0, 255)),
        min_size=1,
        max_size=4,
    ),
    step=st.integers(min_value=1, max_value=800),
)
def test_property_damaged_streams_give_errors_or_drops(our_stream, edits, step):
    data = bytearray(our_stream[:6000])
    for kind, where, value in edits:
        where %= len(data)
        if kind == "flip":
            data[where] ^= value or 1
        elif kind == "insert":
            data.insert(where, value)
        else:
            del data[where]
    reader = OggOpusReader()
    try:
        decoded = decode_all(reader, bytes(data), step)
    except OggError:
        return
    assert decoded.dtype == np.float32 and np.isfinite(decoded).all()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cuts=st.lists(st.integers(min_value=0, max_value=20000), max_size=15))
def test_property_any_split_decodes_the_same(our_stream, cuts):
    expected = decode_all(OggOpusReader(), our_stream[:20000])
    reader, out, start = OggOpusReader(), [], 0
    for cut in [*sorted(cuts), 20000]:
        out += reader.feed(our_stream[start:cut])
        start = max(start, cut)
    np.testing.assert_array_equal(np.concatenate(out), expected)


def packets_of(data: bytes) -> list[bytes]:
    """The packets of a stream whose pages each hold whole packets (as our writer makes them)."""
    return [page_fields(p)["body"] for p in split_pages(data)]


def remux(packets: list[bytes], segments_per_page: int, serial: int = 42) -> list[bytes]:
    """Packs packets into pages of at most ``segments_per_page`` lacing values, splitting packets
    across pages and grouping several per page, as a file-oriented Ogg muxer does."""
    lacing_stream = []  # (packet index, lacing value)
    for i, packet in enumerate(packets):
        full, rest = divmod(len(packet), 255)
        lacing_stream += [(i, 255)] * full + [(i, rest)]
    body = b"".join(packets)
    pages, pos, seq, offset, continued = [], 0, 0, 0, False
    while pos < len(lacing_stream):
        chunk = lacing_stream[pos : pos + segments_per_page]
        size = sum(v for _, v in chunk)
        flags = (0x01 if continued else 0) | (0x02 if seq == 0 else 0)
        lacing = bytes(v for _, v in chunk)
        header = struct.pack("<4sBBqIIIB", b"OggS", 0, flags, 0, serial, seq, 0, len(lacing))
        pages.append(with_crc(header + lacing + body[offset : offset + size]))
        continued = chunk[-1][1] == 255
        pos, seq, offset = pos + len(chunk), seq + 1, offset + size
    return pages


def test_packets_split_across_pages_and_grouped_in_pages(speech):
    data = OggOpusWriter(bitrate=128000).write(speech[:24000])  # no flush: nothing trimmed
    packets = packets_of(data)
    assert max(len(p) for p in packets[2:]) > 255  # so one lacing value per page splits them
    expected = decode_all(OggOpusReader(), data)
    for per_page in (1, 3, 40):
        reader = OggOpusReader()
        decoded = decode_all(reader, b"".join(remux(packets, per_page)), step=1000)
        assert reader.dropped == 0
        np.testing.assert_array_equal(decoded, expected)
    # losing the page with the head of a split packet drops that packet and nothing else
    big = next(i for i, p in enumerate(packets) if i > 3 and len(p) > 255)
    pages = remux(packets, 1)
    head_page = sum(len(p) // 255 + 1 for p in packets[:big])
    reader = OggOpusReader()
    decoded = decode_all(reader, b"".join(pages[:head_page] + pages[head_page + 1 :]))
    assert reader.dropped == 1 and len(decoded) == len(expected) - 480


@pytest.mark.parametrize(("write_rate", "read_rate"), [(24000, 48000), (48000, 24000), (16000, 8000)])
def test_other_rates_decode_at_the_reader_rate(write_rate, read_rate):
    t = np.arange(write_rate // 2) / write_rate
    x = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    writer = OggOpusWriter(sample_rate=write_rate)
    decoded = decode_all(OggOpusReader(sample_rate=read_rate), writer.write(x) + writer.flush())
    assert len(decoded) == pytest.approx(len(x) * read_rate / write_rate, abs=2)
    reference = resample(x, write_rate, read_rate)
    lag, corr = best_lag(reference, decoded, 20)
    assert corr > 0.95 and abs(lag) <= 2
