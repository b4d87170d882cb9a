"""--log-format json: one JSON object a line, tracebacks in a field, never a multi-line record."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specmask.common.log_format import configure_logging


def test_json_lines_from_a_real_process() -> None:
    code = (
        "import logging\n"
        "from specmask.common.log_format import configure_logging\n"
        "configure_logging('INFO', 'json')\n"
        "log = logging.getLogger('specmask.test')\n"
        "log.info('hello %s', 'world')\n"
        "try:\n    1 / 0\nexcept ZeroDivisionError:\n    log.exception('boom')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    lines = out.stderr.splitlines()
    assert len(lines) == 2, out.stderr
    first, second = (json.loads(line) for line in lines)
    assert (first["level"], first["logger"], first["message"]) == ("INFO", "specmask.test", "hello world")
    assert first["ts"].endswith("Z")
    assert second["message"] == "boom" and "ZeroDivisionError" in second["exc"]


def test_unknown_format_refused() -> None:
    with pytest.raises(ValueError, match="--log-format"):
        configure_logging("INFO", "xml")  # refused before any handler changes
