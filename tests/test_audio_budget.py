"""Decode budgets: token buckets on a fake clock, and OggOpusReader stopping at the first breach
(a decode bomb, rejected packets, damaged pages), while a real-time stream is never refused."""

from __future__ import annotations

import gc
import time
import tracemalloc

import numpy as np
import pytest
from support_abuse import PACKET_120MS, PACKET_REJECTED, ogg_page, opus_headers

from personaplex_voice.audio.budget import DecodeBudget, DecodeBudgetExceeded, DecodeLimits, TokenBucket
from personaplex_voice.audio.opus import OggError, OggOpusReader, OggOpusWriter

SR = 24000


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_token_bucket_refills_with_time_up_to_its_burst():
    clock = FakeClock()
    bucket = TokenBucket(rate=10, burst=20, clock=clock)
    assert bucket.take(20) and not bucket.take(1)  # starts full; over by one
    clock.now = 0.1  # earns 1: pays the debt back to 0
    assert bucket.take(0)
    clock.now = 100.0
    assert bucket.refill() == 20  # saved up no more than the burst


def bomb_pages(packet: bytes, pages: int, first_seq: int = 2) -> bytes:
    return b"".join(ogg_page([packet] * 255, first_seq + i) for i in range(pages))


def test_a_decode_bomb_stops_at_the_audio_burst_within_a_few_ms():
    reader, budget = OggOpusReader(SR), DecodeBudget(SR)
    reader.feed(opus_headers(), budget)
    bomb = bomb_pages(PACKET_120MS, 300)  # ~9,000 s of audio, ~230 KB
    started = time.thread_time()
    with pytest.raises(DecodeBudgetExceeded, match="faster than real time") as caught:
        reader.feed(bomb, budget)
    assert caught.value.reason == "too_fast"
    assert time.thread_time() - started < 0.05  # the whole bomb decodes in seconds
    assert reader.pages <= 4  # stopped within the first pages: 10 s is 84 packets of 120 ms
    with pytest.raises(DecodeBudgetExceeded):  # the reader stays failed
        reader.feed(opus_headers())


@pytest.mark.parametrize("damage", ["rejected packets", "bad crc pages", "foreign stream pages"])
def test_damage_is_charged_like_the_costliest_audio(damage):
    reader, budget = OggOpusReader(SR), DecodeBudget(SR)
    reader.feed(opus_headers(), budget)
    if damage == "rejected packets":
        data = bomb_pages(PACKET_REJECTED, 300)
    elif damage == "bad crc pages":
        page = bytearray(ogg_page([PACKET_120MS], 2))
        page[-1] ^= 0xFF
        data = bytes(page) * 5000
    else:
        data = b"".join(ogg_page([PACKET_120MS], i, serial=99) for i in range(5000))
    with pytest.raises(DecodeBudgetExceeded) as caught:
        reader.feed(data, budget)
    assert caught.value.reason == "too_fast"
    assert reader.dropped <= 100  # ~84 pieces of damage empty a 10 s burst


def test_cpu_per_message_is_capped_whatever_the_audio_budget_allows():
    cpu = FakeClock()
    limits = DecodeLimits(burst_s=1e6)  # the audio bucket never empties here
    budget = DecodeBudget(SR, limits, cpu_clock=cpu)
    budget.begin_message()
    for _ in range(DecodeBudget.CPU_CHECK_EVERY - 1):
        budget.charge_packet(480)
    cpu.now = 0.021  # over the 20 ms a message may cost
    with pytest.raises(DecodeBudgetExceeded, match="ms for one message") as caught:
        budget.charge_packet(480)
    assert caught.value.reason == "decode_cost"


def test_cpu_per_second_is_capped_across_messages():
    cpu, wall = FakeClock(), FakeClock()
    budget = DecodeBudget(SR, DecodeLimits(burst_s=1e6), clock=wall, cpu_clock=cpu)
    with pytest.raises(DecodeBudgetExceeded, match="per second"):
        for _ in range(100):  # 4 ms messages back to back: under the per-message cap, over 50 ms
            budget.begin_message()
            cpu.now += 0.004
            budget.end_message()


def test_a_real_time_stream_is_never_refused():
    wall = FakeClock()
    writer, reader = OggOpusWriter(SR, frame_ms=20), OggOpusReader(SR)
    budget = DecodeBudget(SR, clock=wall)
    rng = np.random.default_rng(1)
    decoded = 0
    for frame in range(60 * 50):  # a minute of 20 ms pages, one message each, as they are spoken
        wall.now = frame * 0.02
        pcm = (0.1 * rng.standard_normal(480)).astype(np.float32)
        decoded += sum(len(c) for c in reader.feed(writer.write(pcm), budget))
    assert decoded >= 59 * SR
    # ...and after a 9 s network stall, the 450 messages that then arrive at once are taken too.
    wall.now += 9.0
    burst = [writer.write((0.1 * rng.standard_normal(480)).astype(np.float32)) for _ in range(9 * 50)]
    assert sum(len(c) for message in burst for c in reader.feed(message, budget)) >= 8 * SR


def test_a_failed_feed_keeps_no_decoded_audio_alive_with_the_collector_off():
    """The exception's traceback holds `feed`'s frame: the audio decoded before the breach must
    not hang from it, nor the failure from the reader (a cycle gc would have to break)."""
    bomb = bomb_pages(PACKET_120MS, 300)
    gc.collect()
    gc.disable()
    tracemalloc.start()
    try:
        readers = []
        for _ in range(5):
            reader = OggOpusReader(SR)
            try:
                reader.feed(opus_headers() + bomb, DecodeBudget(SR))
            except DecodeBudgetExceeded as exc:
                held = exc
            readers.append(reader)  # failed readers alive, as a connection holds its own
        del held
        retained, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        gc.enable()
    assert retained < 2 * 1024 * 1024  # each bomb decoded ~1 MB (10 s) before it was stopped
    with pytest.raises(OggError):
        OggOpusReader(SR).feed(b"not ogg")
