"""`personaplex-voice voices list|make`, run as a real subprocess on the golden model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from support_cli import assert_one_line_error, call_cli, run_cli


def test_voices_make_writes_the_published_pt(golden_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "MINE.pt"
    proc = run_cli(
        "voices", "make",
        "--model", golden_dir,
        "--device", "cpu",  # float32: the golden tolerances
        "--audio", golden_dir / "voices" / "TINYF0.wav",
        "--out", out,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    made = torch.load(out, weights_only=True)
    golden = torch.load(golden_dir / "voices" / "TINYF0.pt", weights_only=True)
    assert set(made) == {"embeddings", "cache"}
    assert made["embeddings"].dtype == torch.float32 and made["cache"].dtype == torch.int64
    assert made["embeddings"].shape == golden["embeddings"].shape
    np.testing.assert_allclose(made["embeddings"].numpy(), golden["embeddings"].numpy(), atol=1e-4, rtol=0)
    assert torch.equal(made["cache"], golden["cache"])


def test_voices_list_shows_the_model_voices(golden_dir: Path, tmp_path: Path) -> None:
    proc = run_cli("voices", "list", "--model", golden_dir)
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines()]
    kinds = {row[0]: row[1] for row in rows}
    pt = next(name for name in kinds if name.startswith("TINYF0") and kinds[name] == "embeddings")
    wav = next(name for name in kinds if name.startswith("TINYF0") and kinds[name] == "audio")
    assert pt != wav

    empty = tmp_path / "no-voices"
    empty.mkdir()
    proc = call_cli("voices", "list", "--model", golden_dir, "--voice-prompt-dir", empty)
    assert proc.returncode == 0 and proc.stdout == "" and "no voices" in proc.stderr


def test_voices_make_refuses_bad_input_with_one_line(golden_dir: Path, tmp_path: Path) -> None:
    proc = call_cli(
        "voices", "make", "--model", golden_dir, "--audio", golden_dir / "voices" / "TINYF0.wav",
        "--out", tmp_path / "voice.wav",
    )  # fmt: skip
    assert_one_line_error(proc, "voice.wav", "must end in .pt")
    bad = tmp_path / "speaker.wav"
    bad.write_text("this is not audio")
    proc = call_cli("voices", "make", "--model", golden_dir, "--audio", bad, "--out", tmp_path / "x.pt")
    assert_one_line_error(proc, str(bad))
    assert not (tmp_path / "x.pt").exists()
