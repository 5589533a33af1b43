"""`personaplex-voice offline`, run as a real subprocess: the golden run, and the demo model end to end."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from support_cli import SERVICE_PROMPT, call_cli, run_cli


def test_offline_reproduces_the_golden_service_run(golden_dir: Path, tmp_path: Path) -> None:
    expected = np.load(golden_dir / "expected.npz")
    out_wav, out_json = tmp_path / "agent.wav", tmp_path / "agent.json"
    proc = run_cli(
        "offline",
        "--model", golden_dir,
        "--device", "cpu",  # float32: the golden tolerances
        "--greedy",
        "--voice-prompt", "TINYF0.pt",
        "--text-prompt", SERVICE_PROMPT,
        "--input-wav", golden_dir / "user.wav",
        "--output-wav", out_wav,
        "--output-text", out_json,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    info = sf.info(str(out_wav))
    assert (info.samplerate, info.channels, info.subtype) == (24_000, 1, "FLOAT")
    pcm, _ = sf.read(str(out_wav), dtype="float32")
    # user.wav is 134163 samples (70 frames, the last one short): like the reference, the output
    # is as long as the input; the golden PCM holds the 70 whole frames.
    n_input = sf.info(str(golden_dir / "user.wav")).frames
    assert pcm.shape == (n_input,)
    np.testing.assert_allclose(pcm, expected["service__pcm"][:n_input], atol=1e-4, rtol=0)
    pieces = json.loads(out_json.read_text(encoding="utf-8"))
    assert pieces == [str(p) for p in expected["service__pieces"]]


def test_offline_with_a_voice_file_path_equals_the_voice_name(golden_dir: Path, tmp_path: Path) -> None:
    """`--voice-prompt path/to/TINYF0.pt` (a file outside the model) gives the named voice's result."""
    voice = tmp_path / "voices" / "MYVOICE.pt"
    voice.parent.mkdir()
    shutil.copy(golden_dir / "voices" / "TINYF0.pt", voice)
    expected = np.load(golden_dir / "expected.npz")
    user = tmp_path / "short.wav"
    sf.write(str(user), sf.read(str(golden_dir / "user.wav"), dtype="float32")[0][: 10 * 1920], 24_000)
    proc = call_cli(
        "offline",
        "--model", golden_dir,
        "--device", "cpu",
        "--greedy",
        "--voice-prompt", voice,
        "--text-prompt", "You enjoy having a good conversation.",
        "--input-wav", user,
        "--output-wav", tmp_path / "out.wav",
        "--output-text", tmp_path / "out.json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    pieces = json.loads((tmp_path / "out.json").read_text(encoding="utf-8"))
    assert pieces == [str(p) for p in expected["pt_voice__pieces"][:10]]


@pytest.fixture(scope="module")
def speech_flac(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A short spoken sentence, as 44.1 kHz *stereo* FLAC: not the model's format in any way."""
    if shutil.which("espeak-ng") is None or shutil.which("sox") is None:
        pytest.fail("espeak-ng and sox are needed (make system-deps)")
    folder = tmp_path_factory.mktemp("speech")
    wav = folder / "espeak.wav"
    subprocess.run(["espeak-ng", "-w", str(wav), "Hello, I would like to book a table for two."], check=True)
    flac = folder / "user.flac"
    subprocess.run(["sox", str(wav), "-r", "44100", "-c", "2", str(flac)], check=True)
    return flac


def test_demo_model_end_to_end_on_speech(speech_flac: Path, tmp_path: Path) -> None:
    out_wav, out_json = tmp_path / "agent.wav", tmp_path / "agent.json"
    proc = run_cli(
        "offline",
        "--model", "demo",
        "--seed", "7",
        "--input-wav", speech_flac,
        "--output-wav", out_wav,
        "--output-text", out_json,
        cache=tmp_path / "cache",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "babbles" in proc.stderr  # said plainly
    seconds = sf.info(str(speech_flac)).duration
    pcm, rate = sf.read(str(out_wav), dtype="float32")
    assert rate == 24_000 and pcm.ndim == 1
    assert abs(pcm.shape[0] - seconds * 24_000) <= 1  # exactly the input's duration
    assert np.isfinite(pcm).all()
    pieces = json.loads(out_json.read_text(encoding="utf-8"))
    assert len(pieces) == math.ceil(pcm.shape[0] / 1920)
    assert all(isinstance(p, str) and p for p in pieces)
    assert (tmp_path / "cache" / "demo").is_dir()


def test_seed_makes_sampling_reproducible(golden_dir: Path, tmp_path: Path) -> None:
    user = tmp_path / "user.wav"
    sf.write(str(user), sf.read(str(golden_dir / "user.wav"), dtype="float32")[0][: 12 * 1920], 24_000)

    def pieces(seed: int, name: str) -> list[str]:
        out = tmp_path / f"{name}.json"
        proc = call_cli(
            "offline", "--model", golden_dir, "--voice-prompt", "TINYF0.pt", "--seed", seed,
            "--input-wav", user, "--output-wav", tmp_path / f"{name}.wav", "--output-text", out,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        return json.loads(out.read_text(encoding="utf-8"))

    first, again, other = pieces(5, "a"), pieces(5, "b"), pieces(6, "c")
    assert first == again
    assert first != other
    # same tokens, so the same audio (up to float rounding between runs)
    a, b = (sf.read(str(tmp_path / f"{n}.wav"), dtype="float32")[0] for n in "ab")
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_long_input_shows_a_progress_bar(golden_dir: Path, tmp_path: Path) -> None:
    pcm = sf.read(str(golden_dir / "user.wav"), dtype="float32")[0]
    user = tmp_path / "long.wav"
    sf.write(str(user), np.concatenate([pcm, pcm])[: 130 * 1920], 24_000)  # 10.4 s
    proc = call_cli(
        "offline", "--model", golden_dir, "--greedy", "--voice-prompt", "TINYF0.pt",
        "--input-wav", user, "--output-wav", tmp_path / "o.wav", "--output-text", tmp_path / "o.json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "130/130" in proc.stderr
