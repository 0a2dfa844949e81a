"""Structured logging: one JSON event per line, with the worker's ids bound in.

Secrets never reach a log: Redis URLs are shown without their password and any field whose
name says it holds a secret is masked.

A process writes to a stream (stdout by default), or to a `LogFile` that rolls over by size
(`logging.handlers.RotatingFileHandler`): `streamrl up` has every worker write its own
`RUN_DIR/logs/<worker id>.log` so (`LOG_DIR_ENV`, `run.log_max_mb`, `run.log_backups`).
"""

from __future__ import annotations

import functools
import logging
import logging.handlers
import os
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import structlog
from structlog.typing import EventDict, WrappedLogger

_URL_AUTH = re.compile(r"(?P<scheme>[a-z+]+://)(?P<auth>[^@/]*@)")
_SECRET_KEYS = ("password", "secret", "token", "requirepass", "redis_url")
_SECRET_NAME = re.compile("|".join(_SECRET_KEYS), re.IGNORECASE)
_PLAIN = (int, float, bool, type(None))  # never secrets: a count of `tokens` stays readable

# Set by `streamrl up` for its workers: the directory of their `<worker id>.log` files.
LOG_DIR_ENV = "STREAMRL_LOG_DIR"


@dataclass(frozen=True)
class LogFile:
    """A log file that rolls over at `max_mb` into `.1`, `.2`, ... keeping `backups`."""

    path: Path
    max_mb: float
    backups: int

    def logger(self) -> logging.Logger:
        """This process's stdlib logger writing to the file (one per process: a second
        call replaces the first's file)."""
        handler = logging.handlers.RotatingFileHandler(
            self.path,
            maxBytes=max(1, int(self.max_mb * 2**20)),
            backupCount=self.backups,
            encoding="utf-8",
        )
        handler.setFormatter(logging.Formatter("%(message)s"))  # the JSON line as rendered
        logger = logging.getLogger("streamrl.events")
        for old in list(logger.handlers):
            logger.removeHandler(old)
            old.close()
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)  # structlog has filtered by level already
        logger.propagate = False
        return logger


def cap_file(path: Path, max_mb: float, backups: int) -> bool:
    """Roll `path` over into `.1`, `.2`, ... (keeping `backups`) once it passes `max_mb`,
    by copying it and truncating it in place: a process appending to it (a worker's stderr,
    opened with O_APPEND) goes on writing at its new end. Review part 3: the stderr files
    of `streamrl up` grew without bound (XLA warnings, a traceback per crash). True when it
    rolled over. What is written between the copy and the truncation is lost."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return False
    if size <= max_mb * 2**20:
        return False
    if backups > 0:
        for i in range(backups - 1, 0, -1):
            older = path.with_name(f"{path.name}.{i}")
            if older.exists():
                os.replace(older, path.with_name(f"{path.name}.{i + 1}"))
        shutil.copyfile(path, path.with_name(f"{path.name}.1"))
    with open(path, "r+b") as f:
        f.truncate(0)
    return True


def redact_url(url: str) -> str:
    """A URL with its credentials replaced by `***`."""
    return _URL_AUTH.sub(lambda m: f"{m.group('scheme')}***@", url)


@functools.lru_cache(maxsize=4096)
def _is_secret_name(key: str) -> bool:
    return _SECRET_NAME.search(key) is not None


def _redact_value(key: str, value: object, secret_name: bool | None = None) -> object:
    """`value` of field `key` with its secrets masked, through nested dicts and lists.
    `secret_name`: whether `key` names a secret, if the caller knows (the items of a list
    share their field's name, so a long list asks once)."""
    if type(value) in _PLAIN:
        return value
    if secret_name is None:
        secret_name = _is_secret_name(key)
    if secret_name:
        return "***"
    if isinstance(value, str):
        return redact_url(value) if "://" in value else value
    if isinstance(value, dict):
        return {k: _redact_value(str(k), v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_redact_value(key, v, False) for v in value]
    return value


def _redact(_: WrappedLogger, __: str, event: EventDict) -> EventDict:
    for key, value in list(event.items()):
        if key != "event":
            event[key] = _redact_value(key, value)
    return event


def configure_logging(
    worker: str,
    stream: TextIO | None = None,
    level: int = logging.INFO,
    file: LogFile | None = None,
    **ids: object,
) -> structlog.stdlib.BoundLogger:
    """Configure this process's structlog output (to `file`, else `stream`, else stdout)
    and return a logger bound to its ids."""
    factory: Callable[..., WrappedLogger] = structlog.PrintLoggerFactory(file=stream or sys.stdout)
    if file is not None:
        events = file.logger()

        def factory(*_args: object) -> logging.Logger:
            return events

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
        logger_factory=factory,
        cache_logger_on_first_use=False,
    )
    log: structlog.stdlib.BoundLogger = structlog.get_logger().bind(worker=worker, **ids)
    sys.unraisablehook = functools.partial(_log_unraisable, log)
    return log


def _log_unraisable(log: structlog.stdlib.BoundLogger, info: sys.UnraisableHookArgs) -> None:
    """Python's report of an exception it could not raise (a `__del__` that failed, a
    coroutine collected while suspended) as one log event, instead of the interpreter's
    plain lines on stderr, which would break a log of one JSON object per line."""
    exc = (info.exc_type, info.exc_value, info.exc_traceback)
    log.error(
        "unraisable_exception",
        message=info.err_msg or "Exception ignored in",
        object=repr(info.object)[:200],
        exc_info=exc if info.exc_type is not None else None,
    )
