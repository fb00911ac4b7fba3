"""Log set-up for the server: a level, and lines as text or as one JSON object each."""

from __future__ import annotations

import json
import logging
import sys
import time

STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message, and any `extra=` fields."""

    def format(self, record: logging.LogRecord) -> str:
        line = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                + f".{int(record.msecs):03d}Z", "level": record.levelname.lower(),
                "logger": record.name, "message": record.getMessage()}
        line.update({k: v for k, v in vars(record).items() if k not in STANDARD})
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def configure_logging(level: str = "info", fmt: str = "text") -> None:
    """Send the process's logs to stderr at `level`, as text or JSON lines."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # the handler filters too: a library that sets its own logger to DEBUG when imported
    # (bm25s does) would otherwise write every debug line
    handler.setLevel(level.upper())
    # uvicorn's own lines, and faster-whisper's line per recognised segment: warnings only
    for noisy in ("uvicorn.access", "uvicorn.error", "faster_whisper"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
