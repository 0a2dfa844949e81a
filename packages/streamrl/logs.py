"""Structured logging: one JSON event per line, with the worker's ids bound in.

Secrets never reach a log: Redis URLs are shown without their password and any field whose
name says it holds a secret is masked.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import MutableMapping
from typing import Any, TextIO

import structlog

_URL_AUTH = re.compile(r"(?P<scheme>[a-z+]+://)(?P<auth>[^@/]*@)")
_SECRET_KEYS = ("password", "secret", "token", "requirepass", "redis_url")


def redact_url(url: str) -> str:
    """A URL with its credentials replaced by `***`."""
    return _URL_AUTH.sub(lambda m: f"{m.group('scheme')}***@", url)


def _redact_value(key: str, value: Any) -> Any:
    """`value` of field `key` with its secrets masked, through nested dicts and lists."""
    secret_name = any(s in key.lower() for s in _SECRET_KEYS)
    # Numbers are never secrets: a count of `tokens` stays readable.
    if secret_name and not isinstance(value, int | float):
        return "***"
    if isinstance(value, str) and "://" in value:
        return redact_url(value)
    if isinstance(value, dict):
        return {k: _redact_value(str(k), v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_redact_value(key, v) for v in value]
    return value


def _redact(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    for key, value in list(event.items()):
        if key != "event":
            event[key] = _redact_value(key, value)
    return event


def configure_logging(
    worker: str, stream: TextIO | None = None, level: int = logging.INFO, **ids: Any
) -> structlog.stdlib.BoundLogger:
    """Configure this process's structlog output and return a logger bound to its ids."""
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            _redact,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=stream or sys.stdout),
        cache_logger_on_first_use=False,
    )
    log: structlog.stdlib.BoundLogger = structlog.get_logger().bind(worker=worker, **ids)
    return log
