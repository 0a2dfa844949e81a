"""The bubblewrap sandbox: a tool call in fresh Linux namespaces, for hosts with no engine.

Each call runs under `bwrap` in new user, pid, network, ipc, uts and cgroup namespaces
(no network at all, further user namespaces disallowed), with every capability dropped, a
clean environment, a new session (no terminal injection), and a root that holds only
/usr (read-only, with the /bin and /lib* links), a private /proc and /dev, and size-capped
tmpfs /tmp and /work; the root itself is remounted read-only. rlimits come from `prlimit`
as in `SubprocessSandbox`. A root worker drops the call to an unprivileged uid (`setpriv`)
before bwrap.

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
import os
import shutil
from dataclasses import dataclass

from streamrl.tools.sandbox import (
    ExecResult,
    SandboxUnavailableError,
    portable_argv,
    prlimit_args,
    run_process,
)

WORKDIR = "/work"
_TOP_DIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")


@dataclass(frozen=True)
class BubblewrapConfig:
    """Limits of one call. Sizes are bytes."""

    memory_bytes: int = 512 * 2**20  # address space of each process (RLIMIT_AS)
    max_processes: int = 64  # tasks one call may add to its uid's on the host (RLIMIT_NPROC)
    tmpfs_bytes: int = 64 * 2**20  # size of each of /tmp and /work
    run_as_uid: int = 65534  # uid and gid a root worker drops the call to
    python: str = "/usr/bin/python3"  # the interpreter a python tool runs with (under /usr)

    def __post_init__(self) -> None:
        if self.memory_bytes < 16 * 2**20 or self.tmpfs_bytes < 2**20:
            raise ValueError("memory_bytes must be >= 16 MiB and tmpfs_bytes >= 1 MiB")
        if self.max_processes < 4 or self.run_as_uid <= 0:
            raise ValueError("max_processes must be >= 4 and run_as_uid > 0")
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
        status_r, status_w = os.pipe()
        try:
            cmd = self._command(portable_argv(argv, self.cfg.python), time_limit_s, status_w)
            result = run_process(
                cmd, stdin, time_limit_s, output_cap, cwd="/", pass_fds=(status_w,)
            )
            os.close(status_w)
            status_w = -1
            started = b'"child-pid"' in _read_available(status_r)
        finally:
            os.close(status_r)
            if status_w >= 0:
                os.close(status_w)
        if not started and not result.timed_out:
            err = result.stderr.decode(errors="replace").strip()
            raise SandboxUnavailableError(f"bubblewrap could not start the call: {err}")
        return result

    def close(self) -> None:
        """Nothing to release: a call's namespaces die with it."""

    def _command(self, argv: list[str], time_limit_s: float, status_fd: int) -> list[str]:
        cfg = self.cfg
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
            "--setenv", "PATH", "/usr/bin:/bin",
            "--setenv", "LANG", "C.UTF-8",
            "--setenv", "HOME", WORKDIR,
            "--hostname", "sandbox",
            "--ro-bind", "/usr", "/usr",
            *_top_dirs(),
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


def _read_available(fd: int) -> bytes:
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
