"""Structured (logfmt) logging, quiet by default.

One line per event, `key=value` pairs, so logs grep and parse. Salience's own
lifecycle lines are INFO; the libraries under it only speak from WARNING, and
the warnings they give about choices Salience makes on purpose are left out
(all of it comes back with --log-level debug).

vLLM's engine core is a process of its own that sets up its logging afresh, so
vLLM is handed the same configuration as a dictConfig file
(VLLM_LOGGING_CONFIG_PATH, inherited by its processes); Python and torch
warnings are silenced through the environment for the same reason.

Every line logged while a request is served carries `request_id=...` and, once the
frontend knows whose it is, `client=...`: frontends set REQUEST_ID and CLIENT_NAME in
the request's task, and a filter on the handler copies them onto each record, vLLM's
included (its frontend half logs from the same task).
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import time
import warnings

from salience.core.models.home import salience_home

__all__ = ["CLIENT_NAME", "REQUEST_ID", "ExpectedWarnings", "LogfmtFormatter", "RequestIdFilter", "setup_logging"]

REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("salience_request_id", default=None)
CLIENT_NAME: contextvars.ContextVar[str | None] = contextvars.ContextVar("salience_client", default=None)

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
        # Extra fields given by the caller. vLLM stamps every record with vllm_* ones, and Ray, once
        # imported (vLLM imports it when installed), with a private _ray_timestamp_ns.
        fields.update(
            (k, v) for k, v in record.__dict__.items() if k not in _RESERVED and not k.startswith(("vllm_", "_"))
        )
        line = " ".join(f"{k}={_quote(v)}" for k, v in fields.items())
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


# What vLLM says of settings Salience chooses deliberately (eager mode when asked for,
# whole-prompt prefill on CPU, token prompts, the readout scheduler where vLLM never schedules
# asynchronously anyway, its CPU build's missing extras): nothing an operator can act on.
_EXPECTED = (
    "does not officially support disabling chunked prefill",
    "Enforce eager set",
    "Inductor compilation was disabled",
    "Triton is not installed",
    "doesn't include CPU backend",
    "Model Runner V2 requires Triton",
    "is not found in LD_PRELOAD",
    "doesn't allow to use `torch.set_num_threads`",
    "Passing raw prompts to InputProcessor is deprecated",
    "The global random seed is set",
    "Using custom scheduler class salience.",
)


class RequestIdFilter(logging.Filter):
    """Stamp each record with the request id and the client of the task that logs it, unless it
    names them."""

    def filter(self, record: logging.LogRecord) -> bool:
        for field, variable in (("request_id", REQUEST_ID), ("client", CLIENT_NAME)):
            value = variable.get()
            if value is not None and not hasattr(record, field):
                setattr(record, field, value)
        return True


class ExpectedWarnings(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(expected in message for expected in _EXPECTED)


def _config(level: str) -> dict:
    """The dictConfig both Salience and vLLM's processes use."""
    debug = level == "debug"
    libraries = "DEBUG" if debug else "WARNING"
    handler = {"class": "logging.StreamHandler", "stream": "ext://sys.stderr", "formatter": "logfmt"}
    handler["filters"] = ["request_id"] if debug else ["request_id", "expected"]
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"logfmt": {"()": f"{__name__}.LogfmtFormatter"}},
        "filters": {
            "expected": {"()": f"{__name__}.ExpectedWarnings"},
            "request_id": {"()": f"{__name__}.RequestIdFilter"},
        },
        "handlers": {"stderr": handler},
        "root": {"handlers": ["stderr"], "level": libraries},
        "loggers": {
            "salience": {"level": level.upper()},
            # vLLM sets up its own logger; this stops its records reaching the root twice.
            "vllm": {"handlers": ["stderr"], "level": libraries, "propagate": False},
        },
    }


def setup_logging(level: str = "info") -> None:
    """Salience at `level`; vLLM, torch and friends at WARNING unless asked for more.
    Call before vLLM or torch is imported."""
    import logging.config

    config = _config(level)
    logging.config.dictConfig(config)
    path = salience_home() / f"logging-{level}.json"
    scratch = path.with_name(f".{path.name}.{os.getpid()}")
    scratch.write_text(json.dumps(config, indent=1))
    scratch.replace(path)  # another server starting at once reads a whole file
    os.environ.setdefault("VLLM_LOGGING_CONFIG_PATH", str(path))
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if level == "debug":
        os.environ["VLLM_LOGGING_LEVEL"] = "DEBUG"  # vLLM reads it beyond logging (its debug checks)
    else:
        # Library deprecation notices are for their developers; torch's C++ warnings bypass logging.
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=FutureWarning)
        os.environ.setdefault("PYTHONWARNINGS", "ignore::DeprecationWarning,ignore::FutureWarning")
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
