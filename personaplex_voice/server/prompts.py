"""Stored prompts: how a client passes a `text_prompt` too long for a URL.

A WebSocket upgrade carries its parameters in the request line, which servers and proxies cap
(this one at `PERSONAPLEX_MAX_REQUEST_LINE_BYTES`, nginx at 8 KiB by default); a 4,000-character
prompt in a non-Latin script is ~36 KB once percent-encoded. So a client may first
`POST /api/prompts` the text (same API key and Origin rules as `/api/chat`), get a short
unguessable `prompt_id`, and connect with `/api/chat?prompt_id=...` instead of `text_prompt`.

A stored prompt lives `ttl_s` and may be used any number of times until then (a reconnect needs
no new POST). The store holds at most `max_entries` prompts, dropping the oldest first, so its
memory is bounded whatever callers do.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from collections.abc import Callable

__all__ = ["PromptStore"]


class PromptStore:
    def __init__(
        self, ttl_s: float = 600.0, max_entries: int = 256, clock: Callable[[], float] = time.monotonic
    ):
        if ttl_s <= 0 or max_entries < 1:
            raise ValueError(
                f"a prompt store needs ttl_s > 0 and max_entries >= 1, got {ttl_s}, {max_entries}"
            )
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._clock = clock
        self._prompts: OrderedDict[str, tuple[float, str]] = (
            OrderedDict()
        )  # id -> (expiry, text), oldest first

    def put(self, text: str) -> str:
        """Stores `text`; returns its id (22 URL-safe characters, 128 random bits)."""
        self._expire()
        while len(self._prompts) >= self.max_entries:
            self._prompts.popitem(last=False)
        prompt_id = secrets.token_urlsafe(16)
        self._prompts[prompt_id] = (self._clock() + self.ttl_s, text)
        return prompt_id

    def get(self, prompt_id: str) -> str | None:
        """The stored text, or None when the id is unknown or expired."""
        self._expire()
        entry = self._prompts.get(prompt_id)
        return entry[1] if entry is not None else None

    def __len__(self) -> int:
        self._expire()
        return len(self._prompts)

    def _expire(self) -> None:
        now = self._clock()
        while self._prompts:
            oldest = next(iter(self._prompts.values()))
            if oldest[0] > now:
                return
            self._prompts.popitem(last=False)
