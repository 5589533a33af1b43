"""Post-call webhooks: each ended call's record, POSTed as JSON to the persona's `webhook_url`.

Signed like this (verify with the shared secret in three lines):

    X-PersonaPlex-Signature: sha256=<hex HMAC-SHA256 of the raw body, keyed by the secret>

    expected = "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    if not hmac.compare_digest(expected, request.headers["X-PersonaPlex-Signature"]):
        reject()

`X-PersonaPlex-Delivery` is one id per call record, the same on every retry (deduplicate on it);
the body's `ended_at` dates it. A delivery is retried with doubling back-off (1 s, 2 s, 4 s ...,
at most 60 s apart) for up to `retry_for_s` on timeouts, connection errors, 408, 429 and 5xx;
other answers end it. It runs in its own task, never on a call's audio path.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

from .http_out import HttpOut

log = logging.getLogger(__name__)

SIGNATURE_HEADER = "X-PersonaPlex-Signature"
DELIVERY_HEADER = "X-PersonaPlex-Delivery"
EVENT_HEADER = "X-PersonaPlex-Event"
MAX_BACKOFF_S = 60.0
MAX_PENDING = 1000  # deliveries in flight; beyond, the oldest is given up (logged)


def sign(secret: str, body: bytes) -> str:
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def signed_headers(secret: str | None, body: bytes, event: str) -> dict[str, str]:
    headers = {EVENT_HEADER: event}
    if secret:
        headers[SIGNATURE_HEADER] = sign(secret, body)
    return headers


def _retryable(status: int) -> bool:
    return status in (408, 429) or status >= 500


class PostCallWebhooks:
    def __init__(
        self,
        http: HttpOut,
        *,
        retry_for_s: float = 300.0,
        first_backoff_s: float = 1.0,
        attempt_timeout_s: float = 5.0,
    ):
        self.http = http
        self.retry_for_s = retry_for_s
        self.first_backoff_s = first_backoff_s
        self.attempt_timeout_s = attempt_timeout_s
        self._tasks: dict[asyncio.Task[None], str] = {}
        self.delivered = 0
        self.failed = 0

    @property
    def pending(self) -> int:
        return len(self._tasks)

    def send(
        self,
        url: str,
        secret: str | None,
        body: bytes,
        on_done: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        """Start delivering `body` (the record's JSON) to `url`; `on_done` gets the outcome."""
        while len(self._tasks) >= MAX_PENDING:
            oldest = next(iter(self._tasks))
            log.warning("phone: too many webhook deliveries pending: giving up on %s", self._tasks[oldest])
            oldest.cancel()
            self._tasks.pop(oldest, None)
        task = asyncio.get_running_loop().create_task(self._deliver(url, secret, body, on_done))
        self._tasks[task] = url
        task.add_done_callback(lambda t: self._tasks.pop(t, None))

    async def _deliver(
        self, url: str, secret: str | None, body: bytes, on_done: Callable[[dict[str, Any]], None] | None
    ) -> None:
        headers = signed_headers(secret, body, "call.ended")
        headers[DELIVERY_HEADER] = secrets.token_hex(12)
        deadline = time.monotonic() + self.retry_for_s
        backoff = self.first_backoff_s
        attempts, status, error = 0, None, ""
        while True:
            attempts += 1
            try:
                status, _ = await self.http.post(
                    url, body, headers, self.attempt_timeout_s, max_answer_bytes=4096
                )
                error = "" if 200 <= status < 300 else f"HTTP {status}"
            except Exception as exc:  # timeouts, refused connections, DNS: all retried
                status, error = None, type(exc).__name__
            if not error:
                self.delivered += 1
                outcome = {"url": url, "delivered": True, "attempts": attempts, "status": status}
                break
            if (status is not None and not _retryable(status)) or time.monotonic() + backoff > deadline:
                self.failed += 1
                log.warning("phone: webhook %s failed after %d attempt(s): %s", url, attempts, error)
                outcome = {
                    "url": url,
                    "delivered": False,
                    "attempts": attempts,
                    "status": status,
                    "error": error,
                }
                break
            log.info(
                "phone: webhook %s attempt %d failed (%s); retrying in %.1f s", url, attempts, error, backoff
            )
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF_S)
        if on_done is not None:
            with contextlib.suppress(Exception):
                on_done(outcome)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
