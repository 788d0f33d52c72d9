"""Logs a client cannot forge: control characters escaped, or one JSON object per line.

A conversation id, a model name or any other client-supplied value can contain ``\\n``; logged
as it is, it starts a line that looks like the router's own. Two layers stop that:

* :func:`safe` escapes control characters in one value (use it on every client-supplied value
  in a log call's arguments);
* the formatters :func:`configure_logging` installs escape the whole message again
  (``text``) or write each record as one JSON object (``json``, orjson), so even a call site
  that forgot :func:`safe` cannot break a line.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, Literal

import orjson

__all__ = ["JsonFormatter", "SafeFormatter", "configure_logging", "safe"]

LogFormat = Literal["text", "json"]

# C0 controls, DEL, C1 controls and the Unicode line/paragraph separators
_CONTROL = [*range(0x20), 0x7F, *range(0x80, 0xA0), 0x2028, 0x2029]
_NAMED = {0x09: "\\t", 0x0A: "\\n", 0x0D: "\\r"}
_ESCAPES = {c: _NAMED.get(c, f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}") for c in _CONTROL}
_MAX = 1024


def safe(value: object, limit: int = _MAX) -> str:
    """``value`` as one printable line: control characters escaped (``\\n`` → ``\\\\n``),
    cut to ``limit`` characters (``…`` marks the cut). ``None`` stays ``"None"``."""
    text = value if isinstance(value, str) else str(value)
    if len(text) > limit:
        text = text[:limit] + "…"
    return text.translate(_ESCAPES)


class SafeFormatter(logging.Formatter):
    """The stdlib text formatter, with the message's control characters escaped (tracebacks,
    which the router writes itself, keep their lines)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return safe(super().formatMessage(record), limit=1 << 16)


# attributes every LogRecord has; anything else came in ``extra=`` and is a field of its own
_RESERVED = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {
    "message",
    "asctime",
    "taskName",
}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``ts`` (RFC 3339, UTC), ``level``, ``logger``, ``msg``, the
    record's ``extra=`` fields, and ``exc`` (the traceback) when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _RESERVED and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return orjson.dumps(out, default=str).decode()


def configure_logging(format: LogFormat = "text", level: str | int = "INFO") -> None:
    """Route every logger (the router's, uvicorn's, aiohttp's) to one stderr handler with the
    chosen formatter."""
    handler = logging.StreamHandler(sys.stderr)
    if format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(SafeFormatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    logging.captureWarnings(True)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
