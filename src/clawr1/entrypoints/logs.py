"""Logging for the long-running commands (`up`, `serve`, `train`): rich lines for a terminal, or one
JSON object a line for a log shipper (`--log-json`, `log_format = "json"`).

Plain stdlib `logging`: one handler on the root logger, so the gateway's, the judge's, the
trainer's and uvicorn's records all come out the same way. Secrets never reach a log, whichever
format: the configured keys and anything after `Bearer ` are replaced in every message and string
extra, an extra named like a key, secret, password, token or authorization is redacted whole, and
a JSON line is scrubbed of the configured keys once more as a whole (tracebacks, nested extras).
"""

from __future__ import annotations

import json
import logging
import re
import sys
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any, Literal, TextIO

from pydantic import BaseModel

from clawr1.core.config import SECRET_FIELDS, Config

REDACTED = "[redacted]"
# Every attribute a plain LogRecord has: anything else on a record came in through `extra=`.
_STANDARD = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}
_SECRET_NAME = re.compile(r"(key|keys|secret|password|authorization|token)$", re.IGNORECASE)  # not "tokens"
_BEARER = re.compile(r"(Bearer\s+)[^\s\"']+")
_NOISY = ("httpx", "uvicorn.access")  # one line per request: too much for a long-running log


class JSONFormatter(logging.Formatter):
    """`{"time", "level", "logger", "message", ...extras}`, plus `exception` with its traceback.
    An extra named like a core key is kept under `extra_<name>` rather than replacing it."""

    def __init__(self, secrets: Iterable[str] = ()):
        super().__init__()
        self.secrets = _longest_first(secrets)

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in _extras(record):
            out[f"extra_{key}" if key in out else key] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        line = json.dumps(out, ensure_ascii=False, default=str)
        for secret in self.secrets:
            line = line.replace(secret, REDACTED)
        return line


class RedactSecrets(logging.Filter):
    """Replaces the given secrets and bearer tokens in a record's message and string extras."""

    def __init__(self, secrets: Iterable[str] = ()):
        super().__init__()
        self.secrets = _longest_first(secrets)

    def redact(self, text: str) -> str:
        for secret in self.secrets:
            text = text.replace(secret, REDACTED)
        return _BEARER.sub(r"\1" + REDACTED, text)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = self.redact(message)
        if clean != message:
            record.msg, record.args = clean, None
        for key, value in _extras(record):
            if _SECRET_NAME.search(key):
                setattr(record, key, REDACTED)
            elif isinstance(value, str):
                setattr(record, key, self.redact(value))
        return True


def _longest_first(secrets: Iterable[str]) -> list[str]:
    """Longest first, so a key that contains another is replaced whole."""
    return sorted({s for s in secrets if s}, key=len, reverse=True)


def _extras(record: logging.LogRecord) -> list[tuple[str, Any]]:
    return [(k, v) for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")]


def secrets_of(config: Config) -> list[str]:
    """The values of every secret field (`SECRET_FIELDS`) in any section of the config."""
    found: list[str] = []
    for section in (getattr(config, name) for name in type(config).model_fields):
        if not isinstance(section, BaseModel):
            continue
        for name in SECRET_FIELDS & set(type(section).model_fields):
            value = getattr(section, name)
            if isinstance(value, dict):  # tenants.keys: tenant -> keys
                found.extend(key for keys in value.values() for key in keys)
            else:
                found.extend(value if isinstance(value, list) else [value] if value else [])
    return found


def configure(fmt: Literal["rich", "json"], secrets: Iterable[str] = (), *, stream: TextIO | None = None,
              console: Any = None) -> logging.Handler:
    """Make one handler the root logger's only one, at INFO; returns it (tests remove it again).
    `stream` is where JSON goes (default stderr); `console` the rich Console for `rich`."""
    secrets = list(secrets)
    if fmt == "json":
        handler: logging.Handler = logging.StreamHandler(stream or sys.stderr)
        handler.setFormatter(JSONFormatter(secrets))
    else:
        from rich.logging import RichHandler

        handler = RichHandler(console=console, show_path=False)
        handler.setFormatter(logging.Formatter("%(message)s"))
    handler.addFilter(RedactSecrets(secrets))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    for noisy in _NOISY:
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return handler
