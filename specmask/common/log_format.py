"""Process log set-up shared by the server CLIs: ``--log-format text|json``.

``text`` is for people (one line: time, level, logger, message). ``json`` is for
log pipelines (one JSON object a line: ``ts``, ``level``, ``logger``,
``message``, plus ``exc`` with the traceback when there is one), so a cluster's
collector can index fields instead of parsing lines.
"""

from __future__ import annotations

import json
import logging
import time

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOG_FORMATS = ("text", "json")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def configure_logging(level: str, log_format: str = "text") -> None:
    """Root logging for a server process (replaces handlers set earlier in the process)."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"--log-format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level, handlers=[handler], force=True)
