"""System-prompt text: the `<system>` wrapping and the SentencePiece tokenizer."""

from __future__ import annotations

from pathlib import Path

from personaplex_voice.errors import UserError

SYSTEM_TAG = "<system>"
EPAD_ID = 0  # end of padding: the token before a word
PAD_ID = 3  # text padding (the model is silent in text)
_REFERENCE_SPECIAL = {EPAD_ID: "EPAD", PAD_ID: "PAD"}


def wrap_system_prompt(text: str) -> str:
    """ "<system> " + text + " <system>" (stripped), tags added only when missing; "" stays ""."""
    if text == "":
        return ""
    cleaned = text.strip()
    if cleaned.startswith(SYSTEM_TAG) and cleaned.endswith(SYSTEM_TAG):
        return cleaned
    return f"{SYSTEM_TAG} {cleaned} {SYSTEM_TAG}"


class TextTokenizer:
    """The model's SentencePiece tokenizer (ids 0..3 = EPAD, BOS, EOS, PAD)."""

    def __init__(self, path: str | Path):
        import sentencepiece

        path = Path(path)
        if not path.is_file():
            raise UserError(f"{path}: tokenizer not found")
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        except Exception as exc:  # sentencepiece raises RuntimeError/OSError for bad files
            raise UserError(f"{path}: not a SentencePiece model ({exc})") from None
        self.path = path
        self.vocab_size = int(self._sp.get_piece_size())
        self._pieces = [self._sp.id_to_piece(i).replace("▁", " ") for i in range(self.vocab_size)]

    def encode(self, text: str) -> list[int]:
        return list(self._sp.encode(text))

    def piece(self, token_id: int) -> str:
        """The text of one token, `▁` shown as a space."""
        return self._pieces[token_id] if 0 <= token_id < self.vocab_size else ""

    def display_piece(self, token_id: int) -> str | None:
        """What a client is shown for a step: None for EPAD / PAD (nothing said)."""
        if token_id in _REFERENCE_SPECIAL:
            return None
        return self.piece(token_id)

    def reference_piece(self, token_id: int) -> str:
        """The offline output of the published code: "EPAD" / "PAD" for ids 0 / 3."""
        return _REFERENCE_SPECIAL.get(token_id) or self.piece(token_id)
