"""Outgoing HTTP POSTs of the bridge (context lookups, post-call webhooks), bounded in time and size.

A few requests per call, never per audio frame, so each uses its own short-lived aiohttp session
(aiohttp comes with the `phone` extra): nothing to keep alive or to close at shutdown.
"""

from __future__ import annotations

from collections.abc import Mapping

import aiohttp


class AnswerTooBig(Exception):
    pass


class HttpOut:
    async def post(
        self,
        url: str,
        body: bytes,
        headers: Mapping[str, str],
        timeout_s: float,
        *,
        max_answer_bytes: int = 64 * 1024,
    ) -> tuple[int, bytes]:
        """POST `body` (JSON) to `url`; returns (status, answer body). Raises on a timeout (the
        whole exchange, connect included, within `timeout_s`), a connection error or an answer
        larger than `max_answer_bytes`."""
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        all_headers = {"Content-Type": "application/json", "User-Agent": "personaplex-voice", **headers}
        async with (
            aiohttp.ClientSession(timeout=timeout) as client,
            client.post(url, data=body, headers=all_headers, allow_redirects=False) as response,
        ):
            answer = await response.content.read(max_answer_bytes + 1)
            if len(answer) > max_answer_bytes:
                raise AnswerTooBig(f"answer over {max_answer_bytes} bytes")
            return response.status, answer
