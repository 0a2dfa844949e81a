"""An agent as an external program in a sandbox (issue 31 item 3, the process half).

`task.agent_command = ["python3", "agent.py"]` runs that program once per episode, its
working directory `task.agent_dir` (bound read-only at /agent; empty: a scratch /work),
with

- `OPENAI_BASE_URL` and `OPENAI_API_KEY` set: the episode's endpoint and key (any
  OpenAI-style client reads them);
- on stdin one JSON object, `{"prompt": ..., "data": {...}}`: the task's prompt and data;
- its stdout, stripped, the episode's answer, which the task's reward scores as the
  coroutine agent's return value (empty: None).

**Isolation.** Under bubblewrap (`tools.sandbox` auto, bwrap or container; the rollout
worker's host needs bwrap), each episode gets fresh namespaces as a fresh tool call does
(`BubblewrapSandbox.program_command`: read-only /usr, tmpfs /tmp and /work, no
capabilities, a root worker's program as an unprivileged uid, rlimits) and a network
namespace with loopback alone: the program reaches nothing but the endpoint, whose unix
socket is bound in and relayed to 127.0.0.1:8000 inside by `streamrl.endpoint.relay`
(OPENAI_BASE_URL is `http://127.0.0.1:8000/v1`). What it can run is what the host's /usr
holds (its interpreter, its packages) and its own directory. `tools.sandbox = "subprocess"`
runs it as a plain child process with rlimits, the worker's network and file system, and
OPENAI_BASE_URL the endpoint's TCP address: no isolation, for hosts without bubblewrap.

**Ends.** The episode ends when the program exits: status 0 is an answer; another status
ends the episode `error` with the tail of its stderr; past `rollout.episode_timeout_s` the
program and everything it started is killed (`timeout`), as is one that writes more than
`OUTPUT_CAP` bytes on stdout or stderr (`error`, "flooded"). A sandbox that cannot start
is not the program's fault: `SandboxUnavailableError` propagates and fails the worker (its
tasks are delivered again), as for a tool call.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

from streamrl.jsontypes import JSONObject
from streamrl.tools.bwrap import CALL_ENV, BubblewrapSandbox, StatusPipe
from streamrl.tools.sandbox import ExecResult, SandboxUnavailableError, prlimit_args

RELAY_PORT = 8000  # where the relay listens inside a sandbox (its own network namespace)
SOCKET_INSIDE = "/run/streamrl/endpoint.sock"
AGENT_DIR_INSIDE = "/agent"
OUTPUT_CAP = 1 << 20  # bytes of stdout, and of stderr, a program may write
MEMORY_BYTES = 1 << 30  # address space of each of its processes
STDERR_TAIL = 400
RELAY = Path(__file__).with_name("relay.py")  # runs inside the sandbox, as `-c` source


class AgentProgramError(RuntimeError):
    """The agent program failed: exited with another status than 0, or flooded."""


class CommandAgent:
    """`task.agent_command` as the `main` of an agent of the OpenAI kind: called as
    `await agent(base_url=..., api_key=..., prompt=..., data=...)` by
    `streamrl.endpoint.agent.play`, it runs the program (module doc) and returns its
    answer; raises `AgentProgramError` or `TimeoutError` for the program's failures."""

    def __init__(
        self,
        argv: list[str],
        agent_dir: str,
        socket_path: str,
        box: BubblewrapSandbox | None,
        timeout_s: float,
    ) -> None:
        if not argv:
            raise ValueError("task.agent_command: the program's argv is empty")
        if agent_dir and not Path(agent_dir).is_dir():
            raise ValueError(f"task.agent_dir = {agent_dir!r}: not a directory")
        self.argv = list(argv)
        self.agent_dir = str(Path(agent_dir).resolve()) if agent_dir else ""
        self.socket_path = socket_path
        self.box = box
        self.timeout_s = timeout_s
        self.python = box.cfg.python if box is not None else "/usr/bin/python3"
        self.relay = RELAY.read_text()
        prlimit = shutil.which("prlimit")
        if prlimit is None:
            raise SandboxUnavailableError("an agent program's sandbox needs `prlimit`")
        self.prlimit = prlimit

    async def __call__(
        self, *, base_url: str, api_key: str, prompt: str, data: JSONObject
    ) -> str | None:
        stdin = json.dumps({"prompt": prompt, "data": data}).encode()
        result = await (
            self._isolated(api_key, stdin) if self.box else self._plain(base_url, api_key, stdin)
        )
        if result.timed_out:
            raise TimeoutError(f"the agent program ran past {self.timeout_s:g}s")
        said = result.stderr.decode(errors="replace").strip()[-STDERR_TAIL:]
        if result.truncated:
            raise AgentProgramError(f"the agent program flooded its output (> {OUTPUT_CAP} B)")
        if result.exit_code != 0:
            raise AgentProgramError(
                f"the agent program exited with status {result.exit_code}"
                + (f": {said}" if said else "")
            )
        return result.stdout.decode(errors="replace").strip() or None

    async def _isolated(self, api_key: str, stdin: bytes) -> ExecResult:
        assert self.box is not None
        env = {
            **CALL_ENV,
            "OPENAI_BASE_URL": f"http://127.0.0.1:{RELAY_PORT}/v1",
            "OPENAI_API_KEY": api_key,
        }
        binds = [(self.socket_path, SOCKET_INSIDE)]
        argv = [self.python, "-I", "-S", "-c", self.relay, SOCKET_INSIDE, str(RELAY_PORT)]
        if self.agent_dir:
            binds.append((self.agent_dir, AGENT_DIR_INSIDE))
            argv += ["/usr/bin/env", "-C", AGENT_DIR_INSIDE, "--"]
        argv += self.argv
        with (
            StatusPipe() as status,
            self.box.program_command(argv, self.timeout_s, status.fd, env, binds) as cmd,
        ):
            result = await run_program(cmd, stdin, {"PATH": "/usr/bin:/bin"}, "/",
                                       self.timeout_s, pass_fds=(status.fd,))  # fmt: skip
            status.check(result, "the agent")
        return result

    async def _plain(self, base_url: str, api_key: str, stdin: bytes) -> ExecResult:
        env = {**CALL_ENV, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": api_key}
        cmd = [self.prlimit, *prlimit_args(self.timeout_s, MEMORY_BYTES), "--", *self.argv]
        with tempfile.TemporaryDirectory(prefix="streamrl-agent-") as scratch:
            env["HOME"] = scratch
            return await run_program(cmd, stdin, env, self.agent_dir or scratch, self.timeout_s)


async def run_program(
    cmd: list[str],
    stdin: bytes,
    env: dict[str, str],
    cwd: str,
    time_limit_s: float,
    cap: int = OUTPUT_CAP,
    pass_fds: tuple[int, ...] = (),
) -> ExecResult:
    """`cmd` in its own session, stdin fed, each output read up to `cap` bytes; its whole
    process group killed at the time limit, at the cap, or when the caller is cancelled
    (the asynchronous `streamrl.tools.sandbox.run_process`, so that an episode's program
    holds no thread while it runs)."""
    start = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        *cmd,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
        cwd=cwd,
        start_new_session=True,
        pass_fds=pass_fds,
    )
    flooded = asyncio.Event()

    async def feed() -> None:
        assert proc.stdin is not None
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            proc.stdin.write(stdin)
            await proc.stdin.drain()
        proc.stdin.close()

    async def read(stream: asyncio.StreamReader | None) -> bytes:
        assert stream is not None
        buf = bytearray()
        while chunk := await stream.read(65536):
            buf += chunk
            if len(buf) > cap:
                flooded.set()
                _kill_group(proc.pid)
                return bytes(buf[:cap])
        return bytes(buf)

    timed_out = False
    out = err = b""
    try:
        async with asyncio.timeout(time_limit_s):
            _, out, err = await asyncio.gather(feed(), read(proc.stdout), read(proc.stderr))
            await proc.wait()
    except TimeoutError:
        timed_out = True
    finally:
        _kill_group(proc.pid)  # what the program left behind goes with it
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
    return ExecResult(proc.returncode, out, err, timed_out, flooded.is_set(),
                      time.monotonic() - start)  # fmt: skip


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
