"""Where a tool call's untrusted payload runs: the sandbox interface and its local backend.

`SubprocessSandbox` runs a command as a child process in its own session, with resource
limits, a wall-clock limit enforced by killing the whole process group, and capped output.
The hardened backends implement the same `Sandbox` protocol: containers
(`streamrl.tools.containers`) and bubblewrap (`streamrl.tools.bwrap`); `streamrl.tools.backends`
picks one.
"""

from __future__ import annotations

import contextlib
import functools
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

TRUNCATED = b"\n[output truncated]"
TOOLS_DIR = Path(__file__).resolve().parent


@dataclass(frozen=True)
class ExecResult:
    exit_code: int | None
    stdout: bytes
    stderr: bytes
    timed_out: bool
    truncated: bool
    duration_s: float


class Sandbox(Protocol):
    def exec(
        self, argv: list[str], stdin: bytes, time_limit_s: float, output_cap: int
    ) -> ExecResult: ...


class SandboxUnavailableError(RuntimeError):
    """The sandbox itself cannot run calls (engine down, image or binary missing): an
    infrastructure failure, never the fault of a call."""


def prlimit_args(time_limit_s: float, memory_bytes: int) -> list[str]:
    """`prlimit` flags for one call: CPU seconds just past the wall-clock limit, address
    space, a 1 MiB file size cap and no core dumps."""
    return [
        f"--cpu={int(time_limit_s) + 1}",
        f"--as={memory_bytes}",
        f"--fsize={1 << 20}",
        "--core=0",
    ]


def portable_argv(argv: list[str], python: str) -> list[str]:
    """`argv` made to run where neither this checkout nor its virtualenv exists.

    A call whose argv[0] is this process's interpreter runs `python` instead, and a tool
    script of this package on its command line travels as `-c SOURCE`. So the sandbox image
    carries no streamrl code: changing a tool never needs an image rebuild, and an image
    can never run a stale copy. Other argv pass through unchanged.
    """
    if not argv or argv[0] not in (sys.executable, os.path.realpath(sys.executable)):
        return list(argv)
    out = [python]
    for arg in argv[1:]:
        source = _tool_source(arg) if arg.endswith(".py") else None
        out += ["-c", source] if source is not None else [arg]
    return out


@functools.cache
def _tool_source(path: str) -> str | None:
    p = Path(path)
    if p.parent.resolve() != TOOLS_DIR or not p.is_file():
        return None
    return p.read_text()


class SubprocessSandbox:
    """Runs each call as a child process group with rlimits, a deadline and an output cap.

    Limits are set by util-linux `prlimit` exec'ing the command, not by a Python
    `preexec_fn`: that would run Python between fork and exec, which is unsafe in a
    multithreaded process.
    """

    def __init__(self, memory_bytes: int = 512 * 2**20) -> None:
        self.memory_bytes = memory_bytes
        prlimit = shutil.which("prlimit")
        if prlimit is None:
            raise SandboxUnavailableError("the subprocess sandbox needs `prlimit` (util-linux)")
        self.prlimit = prlimit

    def _limited(self, argv: list[str], time_limit_s: float) -> list[str]:
        return [self.prlimit, *prlimit_args(time_limit_s, self.memory_bytes), "--", *argv]

    def close(self) -> None:
        """Nothing to release: each call's process is gone when `exec` returns."""

    def exec(
        self, argv: list[str], stdin: bytes, time_limit_s: float, output_cap: int
    ) -> ExecResult:
        with tempfile.TemporaryDirectory(prefix="streamrl-tool-") as cwd:
            return run_process(
                self._limited(argv, time_limit_s), stdin, time_limit_s, output_cap, cwd
            )


def run_process(
    cmd: list[str],
    stdin: bytes,
    time_limit_s: float,
    output_cap: int,
    cwd: str,
    pass_fds: tuple[int, ...] = (),
) -> ExecResult:
    """Run `cmd` in its own session with a bare environment: stdin fed, each output read up
    to `output_cap`, the whole process group killed at the time limit or the cap.
    `pass_fds` stay open in the command (the caller closes its own copies)."""
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=cwd,
        env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
        start_new_session=True,
        pass_fds=pass_fds,
    )
    out, err, timed_out, truncated = _drive(proc, stdin, start + time_limit_s, output_cap)
    return ExecResult(
        exit_code=proc.returncode,
        stdout=out,
        stderr=err,
        timed_out=timed_out,
        truncated=truncated,
        duration_s=time.monotonic() - start,
    )


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _drive(
    proc: subprocess.Popen[bytes], stdin: bytes, deadline: float, cap: int
) -> tuple[bytes, bytes, bool, bool]:
    """Feed stdin, read stdout/stderr up to `cap` bytes each, kill at the deadline.

    Reading stops at the cap and the process group is killed: a tool that floods its
    output must not fill the worker's memory.
    """
    assert proc.stdin and proc.stdout and proc.stderr
    try:
        proc.stdin.write(stdin)
        proc.stdin.close()
    except BrokenPipeError:
        pass
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    bufs = {out_fd: bytearray(), err_fd: bytearray()}
    sel = selectors.DefaultSelector()
    for f in (proc.stdout, proc.stderr):
        sel.register(f, selectors.EVENT_READ)
    timed_out = truncated = False
    try:
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            for key, _ in sel.select(timeout=min(left, 0.5)):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                buf = bufs[key.fd]
                buf += chunk
                if len(buf) > cap:
                    del buf[cap:]
                    truncated = True
            if truncated:
                break
    finally:
        sel.close()
        if timed_out or truncated:
            _kill_group(proc)
        proc.stdout.close()
        proc.stderr.close()
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
            proc.wait()
        # The group may hold children that outlived the leader: stop them too.
        _kill_group(proc)
    return bytes(bufs[out_fd]), bytes(bufs[err_fd]), timed_out, truncated
