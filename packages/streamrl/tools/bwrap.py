"""The bubblewrap sandbox: tool calls in Linux namespaces, for hosts with no engine.

Two ways (`BubblewrapConfig.call_server`, from `tools.call_server`):

Warm namespaces (the default; issue 28). A namespace lives for up to `recycle_after`
calls with the call server (`streamrl.tools.callserver`, the container backend's) as its
PID 1, reached through a socket that is its stdin and stdout; each call is forked by the
server, `python3 -c` from its pre-imported interpreter (about 10 ms a call, against 30-45 ms
for fresh namespaces). One namespace per call in flight: a pool of idle ones, a new one
when none is idle. The server empties /work and /tmp after every call, kills what the call
left and enforces its time limit, output cap and rlimits (CPU, address space
`memory_bytes`, file size); a limit hit, a death by a signal, an unclean cleanup or a broken
stream retires the namespace (bwrap killed: as PID 1 the server takes every process of the
namespace with it), as do `recycle_after` calls.
  - As root: no user namespace (a namespace that bwrap makes as root maps one uid, and the
    server must be another uid than its calls). Every capability is dropped but
    CAP_SETUID, CAP_SETGID and CAP_KILL, which the server keeps and each call loses when
    it drops to the namespace's call uid: one of a range (`call_uid_base`), claimed under
    a file lock so that no other namespace on the host has it, which makes RLIMIT_NPROC
    (`max_processes`) count this namespace's calls alone. No new privileges, nosuid
    mounts; /tmp and /work are 1777.
    A call cannot signal, trace or replace the server (another uid, not dumpable). What
    fresh namespaces have and this has not: nested user namespaces are not disabled (a call
    may make one: inside the same empty network, read-only /usr, no new privileges).
  - Not root: the user namespace and its limits of a fresh call (nested user namespaces
    disabled), and the calls run as the server's own uid: a call can kill the server (the
    namespace is then retired and the call reported as failed) but not trace it; the
    process limit is that uid's tasks when the namespace was made plus `max_processes`.

Fresh namespaces (`call_server` false). Each call runs under `bwrap` in new user, pid,
network, ipc, uts and cgroup namespaces (no network at all, further user namespaces
disallowed), with every capability dropped, a clean environment, a new session (no terminal
injection), and a root that holds only /usr (read-only, with the /bin and /lib* links), a
private /proc and /dev, and size-capped tmpfs /tmp and /work; the root itself is remounted
read-only. rlimits come from `prlimit` as in `SubprocessSandbox`. A root worker drops the
call to an unprivileged uid (`setpriv`) before bwrap.

The deadline, the kill and the output cap are `SubprocessSandbox`'s. The command is PID 1
of its pid namespace (`--as-pid-1`): when it exits or bwrap is killed
(`--die-with-parent`), the kernel kills every other process of the call. (With bwrap's own
init as PID 1, bwrap exits before reaping it; under an init that reaps late, those
zombies count against the process limit.)

Unlike a container there is no cgroup: memory is capped per process (address space), not
per call. The process limit (RLIMIT_NPROC) counts every task (threads included) of the
call's uid on the host, the new user namespace's creation too: a non-root worker's call
runs as the worker's own user, whose other processes (a JAX trainer holds hundreds of
threads) would leave no room. So each call's limit is the tasks that uid has now plus
`max_processes`: the call may add at most that many.

bwrap reports on a status pipe (`--json-status-fd`) once the call's process exists. A call
for which it never does failed in bubblewrap itself (no namespace, no resources): that is
`SandboxUnavailableError`, an infrastructure failure, never the call's own exit status 1
with bwrap's message as its stderr. The call cannot fake it: its code runs only after.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from streamrl.tools.callclient import (
    CallChannel,
    CallChannelError,
    Reply,
    exec_result,
    serve_once,
    server_command,
)
from streamrl.tools.sandbox import (
    ExecResult,
    SandboxUnavailableError,
    portable_argv,
    prlimit_args,
    run_process,
)

WORKDIR = "/work"
UID_DIR = Path("/run/streamrl/bwrap-uids")  # a root worker's claims on call uids
# A call's whole environment (what a fresh call's bwrap sets with --clearenv --setenv).
CALL_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": WORKDIR}
_TOP_DIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")


class _Spawner:
    """Forks every warm namespace from one thread that lives as long as the process.

    bwrap's `--die-with-parent` is PR_SET_PDEATHSIG, which follows the *thread* that forked
    it: a namespace started on a pool thread (a tool worker's, `asyncio.to_thread`'s) died
    when that thread ended, and a call sent to it while it was dying failed. The main
    thread forks for itself; any other hands the fork to this process's spawner thread (one
    per pid: a forked child makes its own)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = -1
        self._pool: ThreadPoolExecutor | None = None

    def start(self, fork: Callable[[], subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
        """`fork()` (which starts the process) run on a thread that does not end."""
        if threading.current_thread() is threading.main_thread():
            return fork()
        with self._lock:
            if self._pool is None or self._pid != os.getpid():
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="bwrap-spawn")
                self._pid = os.getpid()
            pool = self._pool
        return pool.submit(fork).result()


_SPAWNER = _Spawner()


@dataclass(frozen=True)
class BubblewrapConfig:
    """Limits of one call. Sizes are bytes."""

    memory_bytes: int = 512 * 2**20  # address space of each process (RLIMIT_AS)
    max_processes: int = 64  # tasks one call may add to its uid's on the host (RLIMIT_NPROC)
    tmpfs_bytes: int = 64 * 2**20  # size of each of /tmp and /work
    run_as_uid: int = 65534  # uid and gid a root worker drops a fresh call to
    python: str = "/usr/bin/python3"  # the interpreter a python tool runs with (under /usr)
    call_server: bool = True  # calls through a call server in a warm namespace (module doc)
    # A root worker's warm namespaces each run their calls as a uid of their own from this
    # range (claimed under a lock in UID_DIR), so that RLIMIT_NPROC counts that namespace's
    # calls alone. Used by nothing else on the host.
    call_uid_base: int = 1_900_000_000
    call_uid_slots: int = 65536
    recycle_after: int = 200  # calls one warm namespace serves before it is replaced
    start_timeout_s: float = 10.0  # a new namespace's server must answer its ping by then

    def __post_init__(self) -> None:
        if self.memory_bytes < 16 * 2**20 or self.tmpfs_bytes < 2**20:
            raise ValueError("memory_bytes must be >= 16 MiB and tmpfs_bytes >= 1 MiB")
        if self.max_processes < 4 or self.run_as_uid <= 0:
            raise ValueError("max_processes must be >= 4 and run_as_uid > 0")
        if not (
            self.call_uid_base >= 1000 and self.call_uid_base + self.call_uid_slots < 2**32 - 1
        ):
            raise ValueError("call uids must lie in [1000, 2**32 - 1)")
        if self.recycle_after < 1 or self.start_timeout_s <= 0 or self.call_uid_slots < 1:
            raise ValueError(
                "recycle_after and call_uid_slots must be >= 1 and start_timeout_s > 0"
            )
        if not self.python.startswith("/usr/"):
            raise ValueError("python must live under /usr: nothing else is in the sandbox")


class BubblewrapSandbox:
    """The bubblewrap backend of the `Sandbox` protocol.

    Construction runs one trivial call, so a host that lacks bwrap, prlimit or user
    namespaces raises `SandboxUnavailableError` at once rather than at the first tool call.
    """

    def __init__(self, config: BubblewrapConfig | None = None) -> None:
        self.cfg = config or BubblewrapConfig()
        tools = {name: shutil.which(name) for name in ("bwrap", "prlimit", "setpriv")}
        needed = ["bwrap", "prlimit"] + (["setpriv"] if os.geteuid() == 0 else [])
        missing = [n for n in needed if tools[n] is None]
        if missing:
            raise SandboxUnavailableError(
                f"the bubblewrap sandbox needs {', '.join(missing)} (apt-get install "
                "bubblewrap util-linux, or run ops/sandbox/setup_host.sh)"
            )
        self._lock = threading.Lock()
        self._idle: list[_Server] = []  # warm namespaces between calls (call_server)
        self._closed = False
        self._bwrap = str(tools["bwrap"])
        self._prlimit = str(tools["prlimit"])
        self._setpriv = tools["setpriv"]
        try:
            probe = self.exec(["/bin/true"], b"", 10.0, 4096)
        except SandboxUnavailableError as err:
            raise SandboxUnavailableError(
                f"bubblewrap cannot make a sandbox here (user namespaces off?): {err}"
            ) from None
        if probe.exit_code != 0:
            said = probe.stderr.decode(errors="replace").strip()
            raise SandboxUnavailableError(f"bubblewrap's trivial call failed: {said}")

    def exec(
        self, argv: list[str], stdin: bytes, time_limit_s: float, output_cap: int
    ) -> ExecResult:
        """Run one call; raises `SandboxUnavailableError` when bubblewrap could not start
        it (see the module doc)."""
        if self.cfg.call_server:
            return self._serve(
                portable_argv(argv, self.cfg.python), stdin, time_limit_s, output_cap
            )
        return self._exec_fresh(argv, stdin, time_limit_s, output_cap)

    def _exec_fresh(
        self, argv: list[str], stdin: bytes, time_limit_s: float, output_cap: int
    ) -> ExecResult:
        """One call in namespaces of its own (`call_server` false)."""
        with StatusPipe() as status:
            cmd = self._command(portable_argv(argv, self.cfg.python), time_limit_s, status.fd)
            result = run_process(
                cmd, stdin, time_limit_s, output_cap, cwd="/", pass_fds=(status.fd,)
            )
            status.check(result, "the call")
        return result

    def close(self) -> None:
        """Stop every warm namespace (a fresh call's namespaces die with it)."""
        with self._lock:
            idle, self._idle = self._idle, []
            self._closed = True
        for server in idle:
            server.stop()

    def _serve(
        self, argv: list[str], stdin: bytes, time_limit_s: float, output_cap: int
    ) -> ExecResult:
        """One call through a warm namespace's call server. A server found gone before the
        request left (killed while idle) is replaced and the call sent once more."""

        def call(channel: CallChannel) -> Reply:
            return channel.call(
                argv, stdin, time_limit_s, output_cap, CALL_ENV, WORKDIR,
                self.cfg.tmpfs_bytes, memory_bytes=self.cfg.memory_bytes,
            )  # fmt: skip

        return exec_result(
            serve_once(self._acquire, lambda server: server.channel, self._settle, call)
        )

    def _settle(self, server: _Server, reply: Reply | None) -> None:
        """After a call: the namespace back to the pool, or stopped (its reply says it may
        not serve again, it served `recycle_after` calls, or the call raised)."""
        if reply is not None:
            server.calls += 1
        if reply is not None and reply.reusable and server.calls < self.cfg.recycle_after:
            self._release(server)
        else:
            server.stop()

    def _acquire(self) -> _Server:
        with self._lock:
            if self._closed:
                raise SandboxUnavailableError("the bubblewrap sandbox is closed")
            if self._idle:
                return self._idle.pop()
        return self._start_server()

    def _release(self, server: _Server) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(server)
                return
        server.stop()

    def _start_server(self) -> _Server:
        """A new warm namespace with the call server as its PID 1, answering a ping."""
        claim = self._claim_uid() if os.geteuid() == 0 else None
        uid = claim[0] if claim else os.getuid()
        parent, child = socket.socketpair()
        err = tempfile.TemporaryFile()  # noqa: SIM115  (kept open for the server's life)
        try:
            proc = _SPAWNER.start(
                lambda: subprocess.Popen(
                    self._server_command(uid),
                    stdin=child.fileno(),
                    stdout=child.fileno(),
                    stderr=err,
                    cwd="/",
                    close_fds=True,
                    start_new_session=True,
                )
            )
        except OSError as exc:
            parent.close()
            err.close()
            if claim:
                claim[1].close()
            raise SandboxUnavailableError(f"cannot start bubblewrap: {exc}") from exc
        finally:
            child.close()
        channel = CallChannel(parent, grace_s=5.0, engine_frames=False,
                              stderr_tail=lambda: _tail(err))  # fmt: skip
        server = _Server(proc, parent, err, channel, claim[1] if claim else None)
        try:
            channel.ping(timeout_s=self.cfg.start_timeout_s)
        except (CallChannelError, ValueError) as exc:
            said = channel.server_stderr.strip()[-500:]
            server.stop()
            raise SandboxUnavailableError(
                f"the call server in bubblewrap did not answer: {exc}"
                + (f"; it said: {said}" if said else "")
            ) from exc
        return server

    def _claim_uid(self) -> tuple[int, IO[str]]:
        """A call uid of the range no live namespace on this host uses, and its lock file
        (held while the namespace lives; released with the file, or when this process
        dies). Tried from a random slot, so that workers starting together spread out."""
        cfg = self.cfg
        UID_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
        first = random.randrange(cfg.call_uid_slots)
        for k in range(cfg.call_uid_slots):
            uid = cfg.call_uid_base + (first + k) % cfg.call_uid_slots
            lock = open(UID_DIR / str(uid), "a")  # noqa: SIM115  (held by the namespace)
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock.close()
                continue
            return uid, lock
        raise SandboxUnavailableError(f"all {cfg.call_uid_slots} call uids are in use")

    def _server_command(self, uid: int) -> list[str]:
        """prlimit, then bwrap with the call server as PID 1 of its namespaces; calls run as
        `uid`. As root: no user namespace, every capability dropped but CAP_SETUID,
        CAP_SETGID and CAP_KILL (the server runs each call as `uid`, which has none and
        which no other process uses, so RLIMIT_NPROC = `max_processes` counts this
        namespace's calls alone; the server, root, is not held to it); /tmp and /work mode
        1777. Not root: a user namespace as for a fresh call, nested ones disabled, and the
        calls run as the server's own uid (the worker's), whose tasks now plus
        `max_processes` is the limit."""
        cfg = self.cfg
        root = os.geteuid() == 0
        size = str(cfg.tmpfs_bytes)
        nproc = cfg.max_processes if root else tasks_of(uid) + cfg.max_processes
        cmd = [self._prlimit, f"--nproc={nproc}", "--core=0", "--", self._bwrap]
        if root:
            cmd += [
                "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
                "--unshare-cgroup-try",
                "--cap-drop", "ALL",
                "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_KILL",
            ]  # fmt: skip
        else:
            cmd += ["--unshare-all", "--unshare-user", "--disable-userns", "--cap-drop", "ALL"]
        perms = ["--perms", "1777"] if root else []
        cmd += [
            "--die-with-parent",
            "--as-pid-1",
            "--new-session",
            "--clearenv",
            *[a for k, v in CALL_ENV.items() for a in ("--setenv", k, v)],
            "--hostname", "sandbox",
            "--ro-bind", "/usr", "/usr",
            *_top_dirs(),
            "--proc", "/proc",
            "--dev", "/dev",
            *perms, "--size", size, "--tmpfs", "/tmp",
            *perms, "--size", size, "--tmpfs", WORKDIR,
            "--chdir", WORKDIR,
            "--remount-ro", "/",
            "--",
            *server_command((WORKDIR, "/tmp"), f"{uid}:{uid}", cfg.python),
        ]  # fmt: skip
        return cmd

    @contextlib.contextmanager
    def program_command(
        self,
        argv: list[str],
        time_limit_s: float,
        status_fd: int,
        env: dict[str, str],
        binds: list[tuple[str, str]],
    ) -> Iterator[list[str]]:
        """The command line of one program in fresh namespaces, as a fresh call's (module
        doc), with `env` as its whole environment and each `(host, inside)` of `binds`
        mounted read-only at `inside` (a directory, or a unix socket the program may
        connect to): an agent program's sandbox (`streamrl.endpoint.command`). Run it, with
        `status_fd` open in it, inside the block. As root the program runs as a uid of its
        own for the block (claimed as a warm namespace's is), so that RLIMIT_NPROC
        (`max_processes`) counts its tasks alone: programs side by side under one shared
        uid each met the others' tasks in their limit and could not start a thread."""
        claim = self._claim_uid() if os.geteuid() == 0 else None
        try:
            yield self._command(
                argv, time_limit_s, status_fd, env, binds, claim[0] if claim else None
            )
        finally:
            if claim:
                claim[1].close()

    def _command(
        self,
        argv: list[str],
        time_limit_s: float,
        status_fd: int,
        env: dict[str, str] = CALL_ENV,
        binds: list[tuple[str, str]] | None = None,
        uid: int | None = None,
    ) -> list[str]:
        cfg = self.cfg
        if uid is None:
            uid = cfg.run_as_uid if os.geteuid() == 0 else os.getuid()
        cmd = [
            self._prlimit,
            *prlimit_args(time_limit_s, cfg.memory_bytes),
            f"--nproc={tasks_of(uid) + cfg.max_processes}",
            "--",
        ]
        if os.geteuid() == 0:
            cmd += [
                str(self._setpriv), f"--reuid={uid}", f"--regid={uid}", "--clear-groups"
            ]  # fmt: skip
        size = str(cfg.tmpfs_bytes)
        cmd += [
            self._bwrap,
            "--json-status-fd", str(status_fd),
            "--unshare-all",
            "--unshare-user",
            "--disable-userns",
            "--die-with-parent",
            "--as-pid-1",
            "--new-session",
            "--cap-drop",
            "ALL",
            "--clearenv",
            *[a for k, v in env.items() for a in ("--setenv", k, v)],
            "--hostname", "sandbox",
            "--ro-bind", "/usr", "/usr",
            *_top_dirs(),
            *[a for host, inside in binds or () for a in ("--ro-bind", host, inside)],
            "--proc", "/proc",
            "--dev", "/dev",
            "--size", size, "--tmpfs", "/tmp",
            "--size", size, "--tmpfs", WORKDIR,
            "--chdir", WORKDIR,
            "--remount-ro", "/",
            "--",
            *argv,
        ]  # fmt: skip
        return cmd


@dataclass
class _Server:
    """One warm namespace: bwrap and its call server, and our end of the server's stdio."""

    proc: subprocess.Popen[bytes]
    sock: socket.socket
    err: IO[bytes]  # the server's stderr (an unlinked file)
    channel: CallChannel
    uid_lock: IO[str] | None  # the claim on the call uid (root workers)
    calls: int = 0

    def stop(self) -> None:
        """Kill bwrap (`--die-with-parent`: the namespace and every call in it die with it)
        and release the stream and the stderr file."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        self.sock.close()
        self.err.close()
        if self.uid_lock is not None:
            self.uid_lock.close()  # the uid is free once the namespace is gone


def _tail(f: IO[bytes], size: int = 4096) -> bytes:
    """The last `size` bytes written to `f` (an unlinked file)."""
    try:
        end = f.seek(0, os.SEEK_END)
        f.seek(max(0, end - size))
        return f.read()
    except (OSError, ValueError):
        return b""


def tasks_of(uid: int) -> int:
    """Tasks (threads included) whose real uid is `uid` on this host now: what RLIMIT_NPROC
    counts. Processes that end while being read are skipped."""
    count = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, KeyError, ValueError):
            with open(f"/proc/{entry.name}/status", "rb") as f:
                fields = dict(line.split(b":", 1) for line in f.read().splitlines() if b":" in line)
            if int(fields[b"Uid"].split()[0]) == uid:
                count += int(fields[b"Threads"])
    return count


class StatusPipe:
    """bwrap's `--json-status-fd`: `fd`, the write end, goes to the command (pass it in
    `pass_fds`); once the command has exited, `check` raises `SandboxUnavailableError`
    unless bwrap got as far as the command's process (it reports `child-pid` then) or the
    command ran out of time first. Both ends close with the block."""

    def __enter__(self) -> StatusPipe:
        self._r, self.fd = os.pipe()
        return self

    def check(self, result: ExecResult, what: str) -> None:
        """After the command's `result`: `what` (e.g. "the call") failed in bubblewrap
        itself, an infrastructure failure, or it started."""
        os.close(self.fd)
        self.fd = -1
        if b'"child-pid"' not in read_available(self._r) and not result.timed_out:
            said = result.stderr.decode(errors="replace").strip()
            raise SandboxUnavailableError(f"bubblewrap could not start {what}: {said}")

    def __exit__(self, *exc: object) -> None:
        os.close(self._r)
        if self.fd >= 0:
            os.close(self.fd)


def read_available(fd: int) -> bytes:
    """What the pipe `fd` holds now, without waiting for a writer that may linger."""
    os.set_blocking(fd, False)
    data = b""
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(fd, 65536):
            data += chunk
    return data


def _top_dirs() -> list[str]:
    """/bin, /lib and friends as on the host: the merged-/usr links, or read-only binds."""
    args: list[str] = []
    for d in _TOP_DIRS:
        if os.path.islink(d):
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            args += ["--ro-bind", d, d]
    return args
