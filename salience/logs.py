"""Structured (logfmt) logging, quiet by default.

One line per event, `key=value` pairs, so logs grep and parse. Salience's own
lifecycle lines are INFO; the libraries under it only speak from WARNING.
"""

from __future__ import annotations

import logging
import os
import sys
import time

__all__ = ["setup_logging"]

_RESERVED = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


def _quote(value: object) -> str:
    text = str(value)
    if not text or any(c in text for c in ' "=\n'):
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    return text


class LogfmtFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(record.created))
        fields = {
            "time": f"{stamp}.{int(record.msecs):03d}",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        # Extra fields given by the caller; vLLM stamps every record with vllm_* ones.
        fields.update((k, v) for k, v in record.__dict__.items() if k not in _RESERVED and not k.startswith("vllm_"))
        line = " ".join(f"{k}={_quote(v)}" for k, v in fields.items())
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup_logging(level: str = "info") -> None:
    """Salience at `level`; vLLM, torch and friends at WARNING unless asked for more."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(LogfmtFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    logging.getLogger("salience").setLevel(level.upper())
    if level == "debug":
        os.environ["VLLM_LOGGING_LEVEL"] = "DEBUG"
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
