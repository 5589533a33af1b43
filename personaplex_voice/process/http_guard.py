"""HTTP limits that uvicorn leaves open, as protocol classes handed to `uvicorn.Config`.

What uvicorn 0.5x does by itself (`uvicorn[standard]`: httptools for HTTP/1.1, websockets'
sans-I/O protocol for WebSocket upgrades):

* httptools has no limit on the request line, the header count or their size, and nothing times
  out a connection that sends nothing or stops half way through its headers (uvicorn's
  keep-alive timeout starts only after a first response);
* a WebSocket upgrade is parsed a second time by websockets, which rejects a request line or a
  header line over 8 KiB (or over 128 headers) with a 414/431 response... that uvicorn never
  writes: the socket stays open, unanswered, forever;
* a text frame that is not UTF-8 is logged at ERROR with a traceback.

`GuardedHttpToolsProtocol` enforces `HttpLimits` while a request's head arrives (414 for a
request line over the limit, 431 for too many or too large headers, 408 for a head that does not
complete in time; an idle connection is closed without a word), before httptools buffers it and
before any upgrade; every refusal is an HTTP answer and a close, with one log line.
`AnsweringWebSocketProtocol` writes and closes whatever handshake websockets rejects anyway
(answering it itself where websockets before 16 gives no answer), and takes an app's HTTP answer
to an upgrade (`/api/chat`'s refusals) as the end of the handshake, which uvicorn does not (it
would log an ERROR for each); `allow_request_lines` lets websockets take the request lines the
HTTP layer accepted (a 1,000-character CJK `text_prompt` is ~9 KB once percent-encoded).
"""

from __future__ import annotations

import asyncio
import http
import logging
from dataclasses import dataclass
from typing import Any, ClassVar

log = logging.getLogger("personaplex_voice.server.http")

__all__ = ["AppLogsItsRefusals", "ClientMistakesAreWarnings", "HttpLimits", "protocol_classes"]

# websockets parses each handshake line with this limit; a header line the HTTP layer lets through
# must fit it (the request line's limit is raised to ours by `allow_request_lines`).
WEBSOCKETS_LINE_LIMIT = 8192
_SLICE = 4096  # bytes fed to the parser at a time while a head arrives (see data_received)


@dataclass(frozen=True)
class HttpLimits:
    max_request_line_bytes: int = 16 * 1024
    max_header_bytes: int = 16 * 1024  # all header lines together
    max_headers: int = 100
    request_timeout_s: float = 10.0  # from connecting (or the last response) to a complete head

    @property
    def max_head_bytes(self) -> int:
        """Raw bytes a head may take, line ends included, before it is refused unparsed."""
        return self.max_request_line_bytes + self.max_header_bytes + 4 * self.max_headers + 64


# The releases these classes were written and tested against (they extend uvicorn's own protocol
# classes and raise a websockets module global): pyproject pins the same ranges. Outside them the
# server still runs, unguarded, and says so.
TESTED_UVICORN = ((0, 54), (0, 55))  # [from, to)
TESTED_WEBSOCKETS = ((17, 0), (18, 0))


def _version(text: str) -> tuple[int, int]:
    major, minor = ([*text.split("."), "0"])[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def tested_versions() -> tuple[bool, str]:
    """(the installed uvicorn and websockets are the tested ones, what is installed)."""
    import uvicorn
    import websockets

    found = (_version(uvicorn.__version__), _version(websockets.__version__))
    ok = (
        TESTED_UVICORN[0] <= found[0] < TESTED_UVICORN[1]
        and TESTED_WEBSOCKETS[0] <= found[1] < TESTED_WEBSOCKETS[1]
    )
    return ok, f"uvicorn {uvicorn.__version__}, websockets {websockets.__version__}"


def protocol_classes(limits: HttpLimits) -> tuple[Any, Any]:
    """(http, ws) for `uvicorn.Config`: the guarded classes, or "auto" when the installed uvicorn
    or websockets is not a tested release, or lacks the implementation these classes extend
    (then that layer runs unguarded, and the log says so)."""
    ok, installed = tested_versions()
    if not ok:
        log.warning(
            "%s are not the releases the HTTP guard was tested with (pip install the versions "
            "pyproject pins): request limits and timeouts are not enforced",
            installed,
        )
        return "auto", "auto"
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        log.warning("httptools is not installed: HTTP request limits and timeouts are not enforced")
        http_class: Any = "auto"
    else:
        http_class = type("GuardedHttpToolsProtocol", (_HeadGuard, HttpToolsProtocol), {"limits": limits})
    try:
        from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
    except ImportError:
        ws_class: Any = "auto"
    else:
        allow_request_lines(limits.max_request_line_bytes)
        ws_class = type(
            "AnsweringWebSocketProtocol", (_AnswerRejectedHandshakes, WebSocketsSansIOProtocol), {}
        )
    return http_class, ws_class


def allow_request_lines(max_bytes: int) -> None:
    """websockets reads its line limit from this module global at parse time (its documented
    knob is the WEBSOCKETS_MAX_LINE_LENGTH variable, read once at import); only ever raised."""
    import websockets.http11

    websockets.http11.MAX_LINE_LENGTH = max(websockets.http11.MAX_LINE_LENGTH, max_bytes + 16)


class _HeadGuard:
    """Mixed in before uvicorn's HttpToolsProtocol (see the module docstring)."""

    limits: ClassVar[HttpLimits]
    transport: asyncio.Transport
    pipeline: Any
    client: Any

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._refused = False
        self._upgraded = False
        self._head_timer: asyncio.TimerHandle | None = None
        self._start_waiting_for_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)  # type: ignore[misc]

    def data_received(self, data: bytes) -> None:
        if self._refused or self._upgraded:
            return
        # While a head arrives, feed it in slices and count the raw bytes first: httptools buffers
        # a header field until it ends, so its own callbacks alone would come too late.
        pos = 0
        while pos < len(data) and self._waiting and not (self._refused or self._upgraded):
            piece = data[pos : pos + _SLICE]
            pos += len(piece)
            self._head_bytes += len(piece)
            self._line_ended = self._line_ended or b"\n" in piece
            if self._head_bytes > self.limits.max_head_bytes:
                if self._line_ended:
                    self._refuse(431, f"the request's headers are over {self.limits.max_header_bytes} bytes")
                else:
                    self._refuse_long_line()
                return
            super().data_received(piece)  # type: ignore[misc]
        if pos < len(data) and not (self._refused or self._upgraded):
            super().data_received(data[pos:])  # type: ignore[misc]

    # -- parser callbacks ----------------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()  # type: ignore[misc]
        self._url_bytes = self._header_count = self._header_bytes = 0

    def on_url(self, url: bytes) -> None:
        if self._refused:
            return
        self._url_bytes += len(url)
        if self._url_bytes > self.limits.max_request_line_bytes:
            self._refuse_long_line()
            return
        super().on_url(url)  # type: ignore[misc]

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._refused:
            return
        self._header_count += 1
        size = len(name) + len(value) + 4  # "name: value\r\n"
        self._header_bytes += size
        limits = self.limits
        if self._header_count > limits.max_headers:
            self._refuse(431, f"the request has over {limits.max_headers} headers")
        elif self._header_bytes > limits.max_header_bytes:
            self._refuse(431, f"the request's headers are over {limits.max_header_bytes} bytes")
        elif size > WEBSOCKETS_LINE_LIMIT:
            self._refuse(431, f"a header line is over {WEBSOCKETS_LINE_LIMIT} bytes")
        else:
            super().on_header(name, value)  # type: ignore[misc]

    def on_headers_complete(self) -> None:
        if self._refused:
            return
        self._waiting = False
        self._stop_head_timer()
        super().on_headers_complete()  # type: ignore[misc]

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)  # type: ignore[misc]

    def on_message_complete(self) -> None:
        if not self._refused:
            super().on_message_complete()  # type: ignore[misc]

    def handle_websocket_upgrade(self) -> None:
        if self._refused:
            return
        self._upgraded = True  # from here on the transport belongs to the WebSocket protocol
        super().handle_websocket_upgrade()  # type: ignore[misc]

    def _unsupported_upgrade_warning(self) -> None:
        # httptools still reports the upgrade of a request this guard already refused (its
        # headers were never recorded, so uvicorn takes it for an unsupported one): the refusal
        # logged its own line.
        if not self._refused:
            super()._unsupported_upgrade_warning()  # type: ignore[misc]

    def send_400_response(self, msg: str) -> None:
        if not self._refused:
            self._refused = True
            self._stop_head_timer()
            super().send_400_response(msg)  # type: ignore[misc]

    def on_response_complete(self) -> None:
        next_head_pending = not self.pipeline  # a queued request already has its whole head
        super().on_response_complete()  # type: ignore[misc]
        if next_head_pending and not self.transport.is_closing():
            self._start_waiting_for_head()

    # -- refusing ------------------------------------------------------------------------------

    def _start_waiting_for_head(self) -> None:
        self._waiting = True
        self._head_bytes = 0
        self._line_ended = False  # the request line's end has arrived
        self._url_bytes = self._header_count = self._header_bytes = 0
        self._stop_head_timer()
        loop = asyncio.get_running_loop()
        self._head_timer = loop.call_later(self.limits.request_timeout_s, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self._waiting or self._refused or self.transport.is_closing():
            return
        if self._head_bytes:
            self._refuse(408, f"the request did not arrive within {self.limits.request_timeout_s:g} s")
        else:  # nothing sent at all (or nothing after the last response): just hang up
            self._refused = True
            log.debug("closing an idle HTTP connection from %s", _client(self.client))
            self.transport.close()

    def _refuse_long_line(self) -> None:
        limit = self.limits.max_request_line_bytes
        self._refuse(
            414,
            f"the request line is over {limit} bytes. A long text_prompt does not fit a URL: store it "
            "with POST /api/prompts and connect with ?prompt_id=ID (see docs/server.md)",
        )

    def _refuse(self, status: int, message: str) -> None:
        """Answers `status` with `message` as plain text and closes the connection."""
        self._refused = True
        self._stop_head_timer()
        log.info("refused an HTTP request from %s: %d %s", _client(self.client), status, message)
        body = (message + "\n").encode()
        phrase = http.HTTPStatus(status).phrase
        head = (
            f"HTTP/1.1 {status} {phrase}\r\ncontent-type: text/plain; charset=utf-8\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        )
        if not self.transport.is_closing():
            self.transport.write(head.encode("ascii") + body)
            self.transport.close()


class _AnswerRejectedHandshakes:
    """Mixed in before uvicorn's WebSocketsSansIOProtocol (see the module docstring)."""

    conn: Any
    transport: asyncio.Transport
    handshake_initiated: bool
    handshake_complete: bool
    client: Any

    def data_received(self, data: bytes) -> None:
        super().data_received(data)  # type: ignore[misc]
        rejected = getattr(self.conn, "handshake_exc", None)
        if not self.handshake_initiated and rejected is not None and not self.transport.is_closing():
            log.info("refused a WebSocket upgrade from %s: %s", _client(self.client), rejected)
            answer = b"".join(self.conn.data_to_send())
            if not answer.startswith(b"HTTP/"):
                # websockets before 16 (LiveKit's NVIDIA plugin pins 15) rejects a head it will
                # not parse without an answer: give the one later versions give.
                answer = self._answer_for(rejected)
            self.transport.write(answer)
            self.transport.close()

    async def send(self, message: Any) -> None:
        await super().send(message)  # type: ignore[misc]
        if message.get("type") == "websocket.http.response.body" and not message.get("more_body", False):
            # An app's HTTP answer to the upgrade (/api/chat's refusals) ends the handshake, but
            # uvicorn 0.5x's sans-I/O protocol never marks it so and logs "ASGI callable returned
            # without completing handshake." at ERROR for every refused upgrade.
            self.handshake_complete = True

    def _answer_for(self, rejected: BaseException) -> bytes:
        cause = rejected.__cause__ or rejected
        # Its SecurityError is a header line over its limit or too many headers (request lines
        # over ours were refused by the HTTP layer first).
        status = 431 if type(cause).__name__ == "SecurityError" else 400
        # Serialized here: the connection already ended its side (send_response would too).
        return self.conn.reject(status, f"Failed to open a WebSocket connection: {cause}.\n").serialize()


class ClientMistakesAreWarnings(logging.Filter):
    """uvicorn logs a client's invalid UTF-8 text frame at ERROR with a traceback; it is the
    client's mistake (the connection is closed with 1007), so one WARNING line says it."""

    _MESSAGES = ("Invalid UTF-8 sequence received from client",)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and str(record.msg).startswith(self._MESSAGES):
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.exc_info = record.exc_text = None
            record.msg = f"{record.msg.rstrip('.')} (connection closed with 1007)"
        return True


class AppLogsItsRefusals(logging.Filter):
    """uvicorn logs every HTTP answer to a WebSocket upgrade (`"WebSocket /path?query" 400`);
    /api/chat logs its refusals itself, with the reason, so uvicorn's line would say it twice."""

    _FORMAT = '%s - "WebSocket %s" %d'

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if record.msg == self._FORMAT and isinstance(args, tuple) and len(args) == 3:
            path, status = args[1], args[2]
            if isinstance(status, int) and status >= 400 and str(path).startswith("/api/chat"):
                return False
        return True


def _client(client: Any) -> str:
    return f"{client[0]}:{client[1]}" if client else "unknown client"
