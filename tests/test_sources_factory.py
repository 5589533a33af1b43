"""`build_engine`: the one way every command turns `--model` / `--engine` into an Engine."""

from __future__ import annotations

import pytest

from personaplex_voice.engine.factory import build_engine
from personaplex_voice.errors import UserError


def test_echo_engine_needs_no_model() -> None:
    from personaplex_voice.engine.loopback import LoopbackEngine

    engine = build_engine("no/such-model", engine="echo", num_slots=3)
    assert isinstance(engine, LoopbackEngine)
    assert engine.num_slots == 3


def test_bad_engine_options_are_user_errors(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PERSONAPLEX_CACHE", str(tmp_path / "cache"))
    with pytest.raises(UserError, match="unknown engine 'gpt'"):
        build_engine("demo", engine="gpt")
    with pytest.raises(UserError, match="num_slots"):
        build_engine("demo", num_slots=0)
    with pytest.raises(UserError, match="--device banana"):
        build_engine("demo", device="banana")
    with pytest.raises(UserError, match="no such model directory"):
        build_engine(str(tmp_path / "missing"))


def test_auto_device_is_the_gpu_only_when_there_is_one(tmp_path, monkeypatch) -> None:
    import torch

    from personaplex_voice.engine import factory

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert factory.resolve_device("auto") == "cpu"
    with pytest.raises(UserError, match="CUDA is not available"):
        factory.resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert factory.resolve_device("auto") == "cuda"
