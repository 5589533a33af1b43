"""The `demo` model's files: built at first use into the cache, no network, the published conventions."""

from __future__ import annotations

from pathlib import Path

import pytest
import sentencepiece as spm

from personaplex_voice.errors import UserError
from personaplex_voice.model import demo
from personaplex_voice.model.sources import resolve_model


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PERSONAPLEX_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_demo_resolves_into_the_cache_without_weight_files(cache: Path) -> None:
    files = resolve_model("demo")
    assert files.name == "demo" and files.is_demo
    assert files.lm_weights is None and files.mimi_weights is None
    assert files.tokenizer.is_file() and files.tokenizer.is_relative_to(cache / "demo")
    assert files.config.to_dict()["lm"]["text_card"] == demo.VOCAB_SIZE
    assert files.voice_dirs[0].is_dir() and files.voice_source == "demo"


def test_demo_tokenizer_follows_the_published_conventions(cache: Path, golden_dir: Path) -> None:
    files = resolve_model("demo")
    sp = spm.SentencePieceProcessor(model_file=str(files.tokenizer))
    golden = spm.SentencePieceProcessor(model_file=str(golden_dir / "tokenizer.model"))
    assert sp.vocab_size() == files.config.to_dict()["lm"]["text_card"]
    # ids 0..3 = unk (EPAD), BOS, EOS, PAD, the same pieces as the published layout
    assert [sp.id_to_piece(i) for i in range(4)] == [golden.id_to_piece(i) for i in range(4)]
    assert (sp.unk_id(), sp.bos_id(), sp.eos_id(), sp.pad_id()) == (0, 1, 2, 3)
    pieces = sp.encode("<system> You are a helpful agent. <system>", out_type=str)
    assert pieces.count("<system>") == 2


def test_demo_assets_are_made_once_and_reproducibly(cache: Path, tmp_path: Path, monkeypatch) -> None:
    first = resolve_model("demo")
    stamp = first.tokenizer.stat().st_mtime_ns
    again = resolve_model("demo")
    assert again.tokenizer.stat().st_mtime_ns == stamp

    monkeypatch.setenv("PERSONAPLEX_CACHE", str(tmp_path / "other-cache"))
    other = resolve_model("demo")
    assert other.tokenizer != first.tokenizer
    assert other.tokenizer.read_bytes() == first.tokenizer.read_bytes()


def test_demo_takes_a_voice_dir_but_no_weight_files(cache: Path, tmp_path: Path, golden_dir: Path) -> None:
    files = resolve_model("demo", voice_prompt_dir=golden_dir / "voices")
    assert files.voice_dirs == (golden_dir / "voices",) and files.voice_source == "model"
    with pytest.raises(UserError, match="drop --tokenizer"):
        resolve_model("demo", tokenizer=golden_dir / "tokenizer.model")
