"""How server processes log: timestamps and levels, and no API key in a request line."""

from __future__ import annotations

import logging
import re

from personaplex_voice.process.http_guard import AppLogsItsRefusals, ClientMistakesAreWarnings
from personaplex_voice.process.settings import ServerSettings

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class RedactTokens(logging.Filter):
    """Uvicorn logs request lines with their query string: keep API keys out of the logs."""

    _TOKEN = re.compile(r"(token=)[^&\s\"']+")

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(
                self._TOKEN.sub(r"\1***", a) if isinstance(a, str) else a for a in record.args
            )
        if isinstance(record.msg, str):
            record.msg = self._TOKEN.sub(r"\1***", record.msg)
        return True


def configure_logging(settings: ServerSettings, fmt: str = LOG_FORMAT) -> None:
    level = settings.log_level.upper()
    # The CLI set up warnings-only logging; a server wants its info lines, with timestamps.
    logging.basicConfig(level=level, format=fmt, force=True)
    for name in ("uvicorn.access", "uvicorn.error"):
        logging.getLogger(name).addFilter(RedactTokens())
    logging.getLogger("uvicorn.error").addFilter(ClientMistakesAreWarnings())
    logging.getLogger("uvicorn.error").addFilter(AppLogsItsRefusals())  # /api/chat logs its own
