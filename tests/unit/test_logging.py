"""Tests for the services' log lines: one line per record, client strings escaped."""

from __future__ import annotations

import json
import logging
import sys
from datetime import datetime

import pytest

from tandem.services.common.runtime.process import escape_log_text, log_formatter, setup_logging

# A request id as a client could send it: a forged second line, a colour escape, a line
# separator, a bidirectional override, and ordinary non-ASCII text.
HOSTILE = 'req\n2025-01-01 00:00:00 router INFO forged\x1b[31m\r\u2028\u202eé🤖 "q" \\'


def _record(msg: str, *args: object, exc: bool = False) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise ValueError("bad\nvalue")
        except ValueError:
            exc_info = sys.exc_info()
    return logging.LogRecord(
        "tandem.services.router.server", logging.INFO, __file__, 7, msg, args, exc_info
    )


def test_escape_log_text() -> None:
    assert (
        escape_log_text("a\nb\r\tc\x00\x1b[31m\x7f\x85") == "a\\nb\\r\\tc\\x00\\x1b[31m\\x7f\\x85"
    )
    assert (
        escape_log_text("\u2028\u2029\u200e\u202e\u2066") == "\\u2028\\u2029\\u200e\\u202e\\u2066"
    )
    assert escape_log_text("plain é 🤖 中文 \\n") == "plain é 🤖 中文 \\n"


def test_text_record_is_one_escaped_line() -> None:
    line = log_formatter("router").format(_record("route %s: placed", HOSTILE))
    assert line.splitlines() == [line] and "\x1b" not in line and "\u202e" not in line
    prefix, message = line.split(" router INFO tandem.services.router.server: ")
    assert datetime.strptime(prefix, "%Y-%m-%d %H:%M:%S,%f")
    assert message == (
        "route req\\n2025-01-01 00:00:00 router INFO forged\\x1b[31m\\r\\u2028\\u202eé🤖 "
        '"q" \\: placed'
    )


def test_text_traceback_stays_on_the_line() -> None:
    line = log_formatter("prefill").format(_record("failed %s", "x\ny", exc=True))
    assert line.splitlines() == [line]
    assert "failed x\\ny\\nTraceback (most recent call last):\\n" in line
    assert line.endswith("ValueError: bad\\nvalue")


def test_json_record_round_trips() -> None:
    line = log_formatter("router", "json").format(_record("route %s: placed", HOSTILE))
    assert line.isascii() and line.splitlines() == [line]
    entry = json.loads(line)
    assert entry.pop("time").endswith("+00:00")
    assert entry == {
        "level": "INFO",
        "service": "router",
        "logger": "tandem.services.router.server",
        "message": f"route {HOSTILE}: placed",
    }


def test_json_exception() -> None:
    entry = json.loads(log_formatter("decode", " JSON ").format(_record("boom", exc=True)))
    assert entry["message"] == "boom"
    assert entry["exception"].startswith("Traceback (most recent call last):\n")
    assert entry["exception"].endswith("ValueError: bad\nvalue")


def test_unknown_format() -> None:
    with pytest.raises(ValueError, match="'text' or 'json', got 'yaml'"):
        log_formatter("router", "yaml")


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_setup_logging_writes_one_line_per_record(
    log_format: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # basicConfig only configures a root logger without handlers: hide pytest's for this test.
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])
    monkeypatch.setattr(root, "level", root.level)
    monkeypatch.setenv("TANDEM_LOG_FORMAT", log_format)
    setup_logging("router")
    try:
        log = logging.getLogger("tandem.services.router.server")
        log.info("route %s: placed", HOSTILE)
        log.warning("model %r unknown", "m\nx")
        try:
            raise RuntimeError("multi\nline")
        except RuntimeError:
            log.exception("request %s failed", HOSTILE)
    finally:
        for handler in root.handlers:
            handler.close()
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 3
    if log_format == "json":
        messages = [json.loads(line)["message"] for line in lines]
        assert messages == [
            f"route {HOSTILE}: placed",
            "model 'm\\nx' unknown",
            f"request {HOSTILE} failed",
        ]
    else:
        assert all(" router " in line and "\x1b" not in line for line in lines)
        assert lines[2].endswith("RuntimeError: multi\\nline")
