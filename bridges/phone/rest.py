"""The HTTP client for carriers' REST APIs: sends the `RestRequest`s carrier modules build.

A few requests per call (a hang-up, a transfer), never per audio frame, so each uses its own
short-lived aiohttp session, bounded in time and in the answer's size; redirects are not
followed (a carrier API does not redirect; anything that does is not the carrier). Failures are
answers, not exceptions: `RestAnswer(status=0, error=...)`.
"""

from __future__ import annotations

import logging

import aiohttp

from .carrier import RestAnswer, RestRequest

log = logging.getLogger(__name__)

MAX_ANSWER_BYTES = 64 * 1024


class RestClient:
    def __init__(self, timeout_s: float = 10.0):
        self.timeout_s = timeout_s

    async def send(self, request: RestRequest) -> RestAnswer:
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        headers = {"User-Agent": "personaplex-voice", **request.headers}
        kwargs: dict = {"headers": headers, "allow_redirects": False}
        if request.json is not None:
            kwargs["json"] = request.json
        elif request.form is not None:
            kwargs["data"] = dict(request.form)
        try:
            async with (
                aiohttp.ClientSession(timeout=timeout) as client,
                client.request(request.method, request.url, **kwargs) as response,
            ):
                body = await response.content.read(MAX_ANSWER_BYTES)
                return RestAnswer(response.status, body)
        except Exception as exc:  # timeouts, refused connections, DNS: an answer of "nobody"
            log.warning("phone: %s %s failed: %s", request.method, request.url, type(exc).__name__)
            return RestAnswer(0, b"", type(exc).__name__)
