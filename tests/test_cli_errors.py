"""Bad input at the command line: one clear `error:` line naming the file and the problem, exit 2,
no traceback unless --debug. The unknown-voice and --debug cases run `personaplex-voice` as a real
subprocess; the others call the same `main` in-process to keep the suite fast."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support_cli import assert_one_line_error, call_cli, run_cli

MODEL_FILES = ("config.json", "model.safetensors", "mimi.safetensors", "tokenizer.model", "voices")


def model_dir(golden_dir: Path, dest: Path, replace: dict[str, bytes] | None = None) -> Path:
    """A model directory linking the golden files, with some replaced by the given bytes."""
    replace = replace or {}
    dest.mkdir()
    for name in MODEL_FILES:
        if name in replace:
            (dest / name).write_bytes(replace[name])
        else:
            (dest / name).symlink_to(golden_dir / name)
    return dest


def offline(model: Path | str, input_wav: Path, tmp_path: Path, *extra: str | Path):
    return call_cli(
        "offline",
        "--model", model,
        "--greedy",
        "--voice-prompt", "TINYF0.pt",
        "--input-wav", input_wav,
        "--output-wav", tmp_path / "out.wav",
        "--output-text", tmp_path / "out.json",
        *extra,
    )  # fmt: skip


def test_missing_input_file(golden_dir: Path, tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.wav"
    assert_one_line_error(offline(golden_dir, missing, tmp_path), str(missing), "no such audio file")


def test_unreadable_audio_file(golden_dir: Path, tmp_path: Path) -> None:
    bad = tmp_path / "user.wav"
    bad.write_bytes(b"RIFF\x10\x00\x00\x00WAVEjunk" * 4)
    assert_one_line_error(offline(golden_dir, bad, tmp_path), str(bad))
    assert not (tmp_path / "out.wav").exists()


def test_output_directory_missing_is_reported_before_the_run(golden_dir: Path, tmp_path: Path) -> None:
    proc = call_cli(
        "offline", "--model", golden_dir, "--input-wav", golden_dir / "user.wav",
        "--output-wav", tmp_path / "nowhere" / "out.wav", "--output-text", tmp_path / "out.json",
    )  # fmt: skip
    assert_one_line_error(proc, str(tmp_path / "nowhere"), "does not exist")


def test_missing_weights_file(golden_dir: Path, tmp_path: Path) -> None:
    root = model_dir(golden_dir, tmp_path / "model")
    (root / "mimi.safetensors").unlink()
    proc = offline(root, golden_dir / "user.wav", tmp_path)
    assert_one_line_error(proc, str(root / "mimi.safetensors"), "missing")


def test_corrupt_weights_file(golden_dir: Path, tmp_path: Path) -> None:
    root = model_dir(golden_dir, tmp_path / "model", {"model.safetensors": b"\x00" * 64})
    proc = offline(root, golden_dir / "user.wav", tmp_path)
    assert_one_line_error(proc, str(root / "model.safetensors"), "not a safetensors file")


def test_truncated_weights_file(golden_dir: Path, tmp_path: Path) -> None:
    data = (golden_dir / "mimi.safetensors").read_bytes()
    root = model_dir(golden_dir, tmp_path / "model", {"mimi.safetensors": data[: len(data) // 2]})
    proc = offline(root, golden_dir / "user.wav", tmp_path)
    assert_one_line_error(proc, str(root / "mimi.safetensors"))


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [("lm", "num_layers", 3), ("mimi.transformer", "d_model", 48)],
    ids=["lm-missing-keys", "mimi-shape-mismatch"],
)
def test_weights_not_matching_the_config(golden_dir: Path, tmp_path: Path, section, key, value) -> None:
    config = json.loads((golden_dir / "config.json").read_text())
    table = config
    for part in section.split("."):
        table = table[part]
    table[key] = value
    if key == "d_model":  # keep the Mimi config self-consistent; only the weights disagree
        table["input_dimension"] = value
        table["output_dimensions"] = [value]
        config["mimi"]["seanet"]["dimension"] = value
        config["mimi"]["quantizer"]["input_dimension"] = value
        config["mimi"]["quantizer"]["output_dimension"] = value
    root = model_dir(golden_dir, tmp_path / "model", {"config.json": json.dumps(config).encode()})
    weights = "model.safetensors" if section == "lm" else "mimi.safetensors"
    proc = offline(root, golden_dir / "user.wav", tmp_path)
    assert_one_line_error(proc, str(root / weights))


def test_corrupt_tokenizer(golden_dir: Path, tmp_path: Path) -> None:
    root = model_dir(golden_dir, tmp_path / "model", {"tokenizer.model": b"not sentencepiece"})
    proc = offline(root, golden_dir / "user.wav", tmp_path)
    assert_one_line_error(proc, str(root / "tokenizer.model"))


def test_config_the_engine_cannot_run(golden_dir: Path, tmp_path: Path) -> None:
    config = json.loads((golden_dir / "config.json").read_text())
    # Same weights, but 48 kHz at 25 Hz: the engine only runs 24 kHz audio in 80 ms frames.
    config["sample_rate"], config["frame_rate"] = 48000, 25.0
    root = model_dir(golden_dir, tmp_path / "model", {"config.json": json.dumps(config).encode()})
    proc = offline(root, golden_dir / "user.wav", tmp_path)
    assert_one_line_error(proc, f"cannot run model {root}", "24 kHz")


def test_unknown_voice(golden_dir: Path, tmp_path: Path) -> None:
    proc = run_cli(
        "offline",
        "--model", golden_dir,
        "--voice-prompt", "NOBODY.pt",
        "--input-wav", golden_dir / "user.wav",
        "--output-wav", tmp_path / "out.wav",
        "--output-text", tmp_path / "out.json",
    )  # fmt: skip
    assert_one_line_error(proc, "NOBODY")
    assert not (tmp_path / "out.wav").exists()


def test_debug_shows_the_traceback(golden_dir: Path, tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.wav"
    proc = run_cli(
        "offline", "--model", golden_dir, "--input-wav", missing,
        "--output-wav", tmp_path / "out.wav", "--output-text", tmp_path / "out.json", "--debug",
    )  # fmt: skip
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr and "UserError" in proc.stderr


def test_missing_model_directory(tmp_path: Path, golden_dir: Path) -> None:
    proc = offline(tmp_path / "no-model", golden_dir / "user.wav", tmp_path)
    assert_one_line_error(proc, str(tmp_path / "no-model"), "no such model directory")
