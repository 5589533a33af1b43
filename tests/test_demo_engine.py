"""The `demo` model as an engine: builds on CPU with no files, babbles reproducibly, has its voices."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from personaplex_voice.engine.base import FRAME_SIZE, Persona, Sampling
from personaplex_voice.engine.factory import build_engine


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    torch.set_num_threads(1)
    monkeypatch.setenv("PERSONAPLEX_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory):
    """One demo engine (with logits kept) shared by the tests that only run it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PERSONAPLEX_CACHE", str(tmp_path_factory.mktemp("cache")))
        return build_engine("demo", capture_logits=True)


def _run(engine, voice: str | None, frames: int = 4) -> tuple[np.ndarray, list]:
    persona = Persona(text_prompt="You take pizza orders.", voice=voice, sampling=Sampling(greedy=True))
    engine.start(0, engine.prepare(persona))
    user = 0.05 * np.sin(np.arange(frames * FRAME_SIZE) * 2 * np.pi * 220 / 24_000).astype(np.float32)
    pcm, tokens = [], []
    for i in range(frames):
        out = engine.step(user[None, i * FRAME_SIZE : (i + 1) * FRAME_SIZE], np.ones(1, dtype=bool))
        pcm.append(out.pcm[0].copy())
        tokens.append(out.text[0])
    engine.release(0)
    return np.concatenate(pcm), tokens


def test_demo_weights_are_seeded_and_leave_the_callers_rng_alone() -> None:
    torch.manual_seed(1)
    before = torch.random.get_rng_state()
    first = build_engine("demo")
    assert torch.equal(torch.random.get_rng_state(), before)
    torch.manual_seed(2)  # a different global seed must not change the demo's weights
    second = build_engine("demo")
    pcm_a, text_a = _run(first, "NATF0.pt")
    pcm_b, text_b = _run(second, "NATF0.pt")
    np.testing.assert_array_equal(pcm_a, pcm_b)
    assert text_a == text_b
    assert np.isfinite(pcm_a).all()


PUBLISHED_VOICES = [f"NATF{i}.pt" for i in range(4)] + [f"NATM{i}.pt" for i in range(4)]
PUBLISHED_VOICES += [f"VARF{i}.pt" for i in range(5)] + [f"VARM{i}.pt" for i in range(5)]


def test_demo_answers_to_the_published_voice_names_as_demo_voices(engine) -> None:
    voices = engine.voices()
    assert sorted(v.name for v in voices) == sorted(PUBLISHED_VOICES)
    assert {(v.kind, v.source) for v in voices} == {("embeddings", "demo")}
    logits = []
    for name in ("NATF0.pt", "NATM3.pt", "VARF4"):  # with or without the suffix, as clients send
        _run(engine, name, frames=1)
        logits.append(engine.last_text_logits.copy())
    assert not np.allclose(logits[0], logits[1]) and not np.allclose(logits[1], logits[2])


def test_demo_voices_are_made_once_and_identically(tmp_path: Path) -> None:
    first = build_engine("demo")
    folder = first.files.voice_dirs[0]
    stamps = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    assert sorted(stamps) == sorted(PUBLISHED_VOICES)
    build_engine("demo")  # a second build finds them and writes nothing
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == stamps
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PERSONAPLEX_CACHE", str(tmp_path / "elsewhere"))
        other = build_engine("demo").files.voice_dirs[0]
    for name in ("NATF2.pt", "VARM0.pt"):
        assert (other / name).read_bytes() == (folder / name).read_bytes()


def test_demo_codec_answers_at_speech_level(engine) -> None:
    """The random codec is tuned: inputs map to varied codes, output is audible and has no DC."""
    pcm, _ = _run(engine, "NATF0.pt", frames=6)
    assert 0.02 < float(pcm.std()) < 0.5
    assert abs(float(pcm.mean())) < 0.01
    from personaplex_voice.model.random_init import synthetic_voice

    codes = engine.encode_audio(synthetic_voice(150.0, seconds=1.0))
    assert len({tuple(row) for row in codes.tolist()}) > codes.shape[0] // 2


def test_a_mimi_without_weights_is_a_reproducible_toy_codec() -> None:
    """The model layer tunes any weightless Mimi itself: no engine, no demo code involved."""
    from personaplex_voice.model.demo import demo_config
    from personaplex_voice.model.loaders import load_mimi
    from personaplex_voice.model.random_init import synthetic_voice
    from personaplex_voice.model.streaming import StepContext

    cfg = demo_config()
    pcm = torch.from_numpy(synthetic_voice(150.0, seconds=1.0)[: 12 * 1920]).view(1, 1, -1)
    codes = []
    for seed in (5, 5, 6):
        torch.manual_seed(seed)
        mimi = load_mimi(cfg, None)
        codes.append(mimi.encode(pcm, StepContext(mimi.init_state(1)))[0].T)
    assert torch.equal(codes[0], codes[1])  # the global seed fixes the codec
    assert not torch.equal(codes[0], codes[2])
    assert len({tuple(row) for row in codes[0].tolist()}) > codes[0].shape[0] // 2
    # and its codes decode to speech-level sound that follows them
    babble = mimi.decode(codes[2].T[None], StepContext(mimi.init_state(1)))[0, 0, 4 * 1920 :]
    other = mimi.decode(codes[2].T[None].roll(1, -1), StepContext(mimi.init_state(1)))[0, 0, 4 * 1920 :]
    assert 0.01 < float(babble.std()) < 0.5
    assert float((babble - other).std()) > 0.5 * float(babble.std())
