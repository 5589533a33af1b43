"""Re-chunking: any pushes in, exact frames out, nothing lost or reordered."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from personaplex_voice.audio.framing import ChunkBuffer, FrameBuffer

sizes = st.lists(st.integers(min_value=0, max_value=5000), max_size=20)


@settings(max_examples=60, deadline=None)
@given(pushes=sizes, frame_size=st.sampled_from([1, 160, 480, 1920]))
def test_frames_are_exact_and_in_order(pushes, frame_size):
    buf = FrameBuffer(frame_size)
    total = sum(pushes)
    x = np.arange(total, dtype=np.float32)
    frames, start = [], 0
    for n in pushes:
        buf.push(x[start : start + n])
        start += n
        if n % 3 == 0:  # interleave popping with pushing
            frames += buf.pop_all()
    frames += buf.pop_all()
    assert all(len(f) == frame_size and f.dtype == np.float32 for f in frames)
    assert len(frames) == total // frame_size and len(buf) == total % frame_size
    joined = np.concatenate([*frames, np.zeros(0, np.float32)])
    np.testing.assert_array_equal(joined, x[: len(joined)])
    padded = buf.pop_padded()
    if total % frame_size:
        assert padded is not None and len(padded) == frame_size
        np.testing.assert_array_equal(padded[: total % frame_size], x[len(joined) :])
        assert not padded[total % frame_size :].any()
    else:
        assert padded is None
    assert len(buf) == 0


@settings(max_examples=60, deadline=None)
@given(pushes=sizes, bound=st.integers(min_value=0, max_value=6000), pop_every=st.integers(1, 4))
def test_bounded_buffer_keeps_the_newest_samples_and_counts_drops(pushes, bound, pop_every):
    """With max_samples, the buffer never holds more than the bound, what it hands out is always
    the newest audio in order, and every sample is either popped, waiting or counted as dropped."""
    buf = FrameBuffer(160, max_samples=bound)
    x = np.arange(sum(pushes), dtype=np.float32)
    popped, dropped, start = [], 0, 0
    for i, n in enumerate(pushes):
        dropped += buf.push(x[start : start + n])
        start += n
        assert len(buf) <= bound
        if i % pop_every == 0:
            popped += buf.pop_all()
    popped += buf.pop_all()
    waiting = len(buf)
    assert sum(len(f) for f in popped) + waiting + dropped == len(x)
    joined = np.concatenate([*popped, np.zeros(0, np.float32)])
    assert np.all(np.diff(joined) > 0)  # in order, nothing repeated
    if waiting:  # what waits is the newest input
        tail = buf.pop_padded()
        np.testing.assert_array_equal(tail[: min(waiting, 160)], x[len(x) - waiting :][:160])


def test_drop_oldest_discards_from_the_front():
    buf = FrameBuffer(4)
    buf.push(np.arange(10, dtype=np.float32))
    buf.drop_oldest(3)
    assert len(buf) == 7
    np.testing.assert_array_equal(buf.pop(), [3, 4, 5, 6])
    buf.drop_oldest(100)
    assert len(buf) == 0 and buf.pop() is None


def test_popped_frames_are_not_views_of_the_buffer():
    buf = FrameBuffer(4)
    buf.push(np.ones(4, np.float32))
    frame = buf.pop()
    buf.push(np.full(4, 7, np.float32))
    assert frame is not None and (frame == 1).all()
    buf.clear()
    assert len(buf) == 0 and buf.pop() is None


@settings(max_examples=60, deadline=None)
@given(pushes=st.lists(st.binary(max_size=700), max_size=20), chunk=st.sampled_from([1, 160, 320]))
def test_chunks_are_exact_and_in_order(pushes, chunk):
    buf = ChunkBuffer(chunk)
    out = []
    for data in pushes:
        buf.push(data)
        if (piece := buf.pop()) is not None:
            out.append(piece)
        out += buf.pop_all()
    data = b"".join(pushes)
    assert all(len(c) == chunk for c in out) and b"".join(out) == data[: len(out) * chunk]
    rest = buf.pop_padded()
    if len(data) % chunk:
        assert rest == data[len(out) * chunk :] + b"\xff" * (chunk - len(data) % chunk)
    else:
        assert rest is None


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError):
        FrameBuffer(0)
    with pytest.raises(ValueError):
        ChunkBuffer(-1)
