"""What a server checks before anything starts: the files its settings name exist."""

from __future__ import annotations

from personaplex_voice.errors import UserError
from personaplex_voice.process.settings import ServerSettings


def check_files(settings: ServerSettings) -> None:
    """(`--ssl` is tls.prepare's: a directory without a pair gets one.)"""
    if settings.voice_dir is not None and not settings.voice_dir.is_dir():
        raise UserError(f"--voice-prompt-dir {settings.voice_dir}: not a directory")
    if settings.static is not None and not (settings.static / "index.html").is_file():
        raise UserError(f"--static {settings.static}: no index.html there (give a client build's folder)")
    for flag, path in (
        ("--moshi-weight", settings.moshi_weight),
        ("--mimi-weight", settings.mimi_weight),
        ("--tokenizer", settings.tokenizer),
    ):
        if path is not None and not path.is_file():
            raise UserError(f"{flag} {path}: no such file")
