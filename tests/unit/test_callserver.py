"""The in-sandbox call server (`streamrl.tools.callserver`), run as a real process.

Each test starts the server as a subprocess on pipes and talks to it with the small
blocking client below (the production client lives on the host side). As root the
server runs in fresh pid and IPC namespaces (`unshare`): its cleanup kills every process
of the call uid (20001) and removes that uid's SysV IPC objects, and on this host the
sandbox containers' calls run as that same uid. Pids that calls print are then the
namespace's; a follow-up call checks them in the namespace's /proc.

The writable dirs of every server are temporary dirs of the test, never the real /tmp.
"""

from __future__ import annotations

import ast
import contextlib
import os
import selectors
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from streamrl.tools import callserver as cs

CALLSERVER = Path(cs.__file__).resolve()
# The interpreter a sandbox image has (Debian bookworm's python3); the venv's otherwise.
SERVER_PYTHON = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable
ROOT = os.geteuid() == 0
CALL_UID = 20001  # the server's default --call-uid
OWN_UID = 10002  # a non-root server's uid, in the tests that run one as root
PATH = "/usr/bin:/bin"
REPLY_TIMEOUT_S = 60.0
needs_root = pytest.mark.skipif(not ROOT, reason="the uid drop needs the server to be root")
# As root, a non-root server is started under setpriv.
needs_setpriv = pytest.mark.skipif(
    ROOT and shutil.which("setpriv") is None, reason="a non-root server needs setpriv here"
)

# Prints the pids among argv that are alive (not zombies), and the live members of the
# process groups they name.
ALIVE = """
import os, sys
wanted = {int(a) for a in sys.argv[1:]}
alive = []
for name in os.listdir('/proc'):
    if name.isdigit():
        try:
            with open(f'/proc/{name}/stat') as f:
                state, _, pgrp = f.read().rsplit(')', 1)[1].split()[:3]
        except OSError:
            continue
        if state != 'Z' and (int(name) in wanted or int(pgrp) in wanted):
            alive.append(int(name))
print(sorted(alive))
"""


@dataclass(frozen=True)
class Reply:
    stdout: bytes
    stderr: bytes
    result: cs.Result


class CallServerProcess:
    """A call server subprocess and a blocking client of it: one request at a time."""

    def __init__(self, argv: Sequence[str], stderr_path: Path, env: dict[str, str]) -> None:
        self.stderr_path = stderr_path
        with open(stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env
            )
        self.buffer = bytearray()
        self.next_id = 1

    def send(self, raw: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(raw)
        self.proc.stdin.flush()

    def reply(self, timeout_s: float = REPLY_TIMEOUT_S) -> Reply:
        """Read frames up to the next result."""
        out = {cs.KIND_STDOUT: bytearray(), cs.KIND_STDERR: bytearray()}
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while True:
                for kind, payload in cs.decode_frames(self.buffer):
                    if kind == cs.KIND_RESULT:
                        return Reply(bytes(out[1]), bytes(out[2]), cs.Result.from_payload(payload))
                    out[kind] += payload
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    raise AssertionError(f"no reply within {timeout_s} s")
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise EOFError(f"the server closed its stdout: {self.stderr()}")
                self.buffer += chunk

    def request(self, header: dict[str, object], body: bytes = b"") -> Reply:
        self.send(cs.encode_request(header, body))
        return self.reply()

    def ping(self) -> cs.Result:
        reply = self.request(cs.Ping(self._id()).header())
        assert reply.stdout == reply.stderr == b""
        return reply.result

    def call(
        self,
        argv: Sequence[str],
        *,
        env: dict[str, str],
        cwd: str,
        stdin: bytes = b"",
        time_limit_s: float = 20.0,
        output_cap: int = 1 << 20,
        cpu_s: int = 60,
        memory_bytes: int = 0,
        fsize_bytes: int = 16 << 20,
    ) -> Reply:
        header = cs.Call(
            id=self._id(),
            argv=tuple(argv),
            time_limit_s=time_limit_s,
            output_cap=output_cap,
            cpu_s=cpu_s,
            memory_bytes=memory_bytes,
            fsize_bytes=fsize_bytes,
            env=env,
            cwd=cwd,
        ).header()
        reply = self.request(header, stdin)
        assert reply.result.id == header["id"]
        return reply

    def wait(self, timeout_s: float = 30.0) -> int:
        return self.proc.wait(timeout=timeout_s)

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def close(self) -> int:
        """EOF on the server's stdin; returns its exit status."""
        assert self.proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):  # it may have exited already
            self.proc.stdin.close()
        try:
            return self.wait()
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            assert self.proc.stdout is not None
            self.proc.stdout.close()

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id


class Box:
    """Directories for one test's servers: writable dirs open to the call uid."""

    def __init__(self) -> None:
        self.base = Path(tempfile.mkdtemp(prefix="streamrl-callserver-"))
        self.base.chmod(0o755)  # the call uid must reach the dirs below
        self.work = self.base / "work"
        self.tmp = self.base / "tmp"
        for d in (self.work, self.tmp):
            d.mkdir()
            d.chmod(0o777)
        self.servers: list[CallServerProcess] = []

    @property
    def env(self) -> dict[str, str]:
        return {"PATH": PATH, "LANG": "C.UTF-8", "HOME": str(self.work), "TMPDIR": str(self.tmp)}

    def start(
        self,
        *flags: str,
        source_via_c: bool = False,
        as_uid: int | None = None,
        namespaces: bool = ROOT,
        env: dict[str, str] | None = None,
    ) -> CallServerProcess:
        """A server with this box's writable dirs. As root it runs in new pid and IPC
        namespaces unless `as_uid` makes it a non-root server (no uid-wide kill then)."""
        program = ["-c", CALLSERVER.read_text()] if source_via_c else [str(CALLSERVER)]
        argv = [SERVER_PYTHON, *program, "--writable", str(self.work), "--writable"]
        argv += [str(self.tmp), *flags]
        if as_uid is not None:
            argv = ["setpriv", f"--reuid={as_uid}", f"--regid={as_uid}", "--clear-groups", *argv]
        elif namespaces:
            if shutil.which("unshare") is None:
                pytest.skip("a root server runs in new namespaces: this host lacks unshare")
            # sh stays PID 1 of the namespace (the server is not: PID 1 ignores kills
            # from inside, which would make the kill test pass for the wrong reason).
            namespace = ["unshare", "--pid", "--ipc", "--fork", "--mount-proc", "--kill-child"]
            argv = [*namespace, "sh", "-c", '"$@"; exit $?', "sh", *argv]
        n = len(self.servers)
        env = {"PATH": PATH, "LANG": "C.UTF-8"} if env is None else env
        server = CallServerProcess(argv, self.base / f"server{n}.err", env)
        self.servers.append(server)
        return server

    def call(
        self,
        server: CallServerProcess,
        argv: Sequence[str],
        stdin: bytes = b"",
        time_limit_s: float = 20.0,
        output_cap: int = 1 << 20,
        cpu_s: int = 60,
        memory_bytes: int = 0,
        fsize_bytes: int = 16 << 20,
        env: dict[str, str] | None = None,
    ) -> Reply:
        """A call in the work dir, with this box's environment unless `env` is given."""
        return server.call(
            argv,
            env=self.env if env is None else env,
            cwd=str(self.work),
            stdin=stdin,
            time_limit_s=time_limit_s,
            output_cap=output_cap,
            cpu_s=cpu_s,
            memory_bytes=memory_bytes,
            fsize_bytes=fsize_bytes,
        )

    def close(self) -> None:
        try:
            for server in self.servers:
                server.close()
        finally:
            shutil.rmtree(self.base)


@pytest.fixture
def box() -> Iterator[Box]:
    b = Box()
    try:
        yield b
    finally:
        b.close()


@pytest.fixture
def server(box: Box) -> Iterator[CallServerProcess]:
    s = box.start()
    assert s.ping().exit_code == 0
    yield s
    assert s.close() == 0, s.stderr()


def py(source: str, *args: str) -> list[str]:
    return ["python3", "-c", source, *args]


def alive(box: Box, server: CallServerProcess, pids: Sequence[int]) -> list[int]:
    reply = box.call(server, py(ALIVE, *map(str, pids)))
    assert reply.result.exit_code == 0, reply.stderr
    return [int(p) for p in reply.stdout.decode().strip("[]\n").split(",") if p.strip()]


# -- commands


def test_echo_returns_stdout_and_exit_0(box: Box, server: CallServerProcess) -> None:
    reply = box.call(server, ["sh", "-c", "echo ok"])
    assert reply.stdout == b"ok\n"
    assert reply.stderr == b""
    r = reply.result
    assert (r.exit_code, r.timed_out, r.truncated, r.clean, r.error) == (
        0,
        False,
        False,
        True,
        None,
    )


def test_exit_codes_and_signals_propagate(box: Box, server: CallServerProcess) -> None:
    assert box.call(server, ["sh", "-c", "exit 7"]).result.exit_code == 7
    assert box.call(server, ["sh", "-c", "kill -TERM $$"]).result.exit_code == -signal.SIGTERM


def test_stderr_is_a_separate_stream(box: Box, server: CallServerProcess) -> None:
    reply = box.call(server, ["sh", "-c", "echo out; echo err >&2; echo out2"])
    assert (reply.stdout, reply.stderr) == (b"out\nout2\n", b"err\n")


def test_stdin_is_delivered_whole(box: Box, server: CallServerProcess) -> None:
    body = os.urandom(300_000)  # more than a pipe holds: fed while the call reads
    reply = box.call(server, ["cat"], stdin=body)
    assert reply.stdout == body
    assert reply.result.exit_code == 0


def test_a_call_that_ignores_its_stdin_still_ends(box: Box, server: CallServerProcess) -> None:
    reply = box.call(server, ["true"], stdin=b"x" * 1_000_000)
    assert (reply.result.exit_code, reply.result.timed_out) == (0, False)


def test_missing_and_unexecutable_commands_are_127_and_126(
    box: Box, server: CallServerProcess
) -> None:
    missing = box.call(server, ["no-such-command-here"])
    assert missing.result.exit_code == 127
    assert b"no-such-command-here: command not found" in missing.stderr
    script = box.base / "script"  # outside the writable dirs, which the cleanup empties
    script.write_text("#!/bin/sh\necho hi\n")
    script.chmod(0o644)
    reply = box.call(server, [str(script)])
    assert reply.result.exit_code == 126
    assert b"Permission denied" in reply.stderr


def test_a_bad_cwd_is_a_setup_error_and_the_server_goes_on(box: Box) -> None:
    server = box.start()
    reply = server.call(["true"], env=box.env, cwd=str(box.base / "missing"))
    assert reply.result.exit_code is None
    assert reply.result.error is not None and "FileNotFoundError" in reply.result.error
    assert box.call(server, ["sh", "-c", "echo ok"]).stdout == b"ok\n"
    assert server.close() == 0


def test_ping_answers_with_the_server_facts(box: Box, server: CallServerProcess) -> None:
    result = server.ping()
    assert (result.exit_code, result.error) == (0, None)
    assert result.server is not None
    assert result.server["protocol"] == cs.PROTOCOL_VERSION
    assert result.server["call_uid"] == (CALL_UID if ROOT else os.getuid())
    assert result.server["python_fork"] is True
    assert "ready protocol=1" in server.stderr()


# -- the Python fork server

INTROSPECT = """
import os, sys
print(sys.argv, __name__, list(globals()), repr(__doc__), __spec__, __loader__)
print(sys.path[0] == '', sys.orig_argv[1:], os.getcwd(), sorted(os.environ.items()))
for s in (sys.stdin, sys.stdout, sys.stderr):
    b = s.buffer
    print(s.name, s.mode, s.encoding, s.errors, s.line_buffering, s.write_through,
          type(b).__name__, getattr(b, 'raw', b).closefd)
print(sys.stdin.read())
import signal
print(signal.getsignal(signal.SIGINT) is signal.default_int_handler,
      signal.getsignal(signal.SIGPIPE), signal.getsignal(signal.SIGXFSZ),
      signal.getsignal(signal.SIGTERM))
print(os.getuid(), os.getgid(), os.getgroups(), os.getpgid(0) == os.getpid(), os.umask(0))
import resource
print(resource.getrlimit(resource.RLIMIT_CPU), resource.getrlimit(resource.RLIMIT_FSIZE),
      resource.getrlimit(resource.RLIMIT_CORE))
print(sorted(os.listdir('/proc/self/fd')))
"""


CMDLINE = "print(open('/proc/self/cmdline', 'rb').read().split(b'\\0')[1:2])"


def forked(box: Box, server: CallServerProcess, env: dict[str, str] | None = None) -> bool:
    """Whether a `python3 -c` call with this env runs in a fork of the server."""
    return b"callserver" in box.call(server, py(CMDLINE), env=env).stdout


def test_python_fork_matches_a_real_python3_c(box: Box, server: CallServerProcess) -> None:
    # argv[0] as a path is not the fork server's `python3`: that call execs a real one.
    fork = box.call(server, py(INTROSPECT, "a", "b c"), stdin=b"in")
    real = box.call(server, ["/usr/bin/env", *py(INTROSPECT, "a", "b c")], stdin=b"in")
    assert fork.stderr == real.stderr == b""
    assert fork.stdout.splitlines()[0].startswith(b"['-c', 'a', 'b c'] __main__ ")
    assert fork.stdout == real.stdout
    assert fork.result.exit_code == real.result.exit_code == 0
    simple = box.call(server, py("import sys; print(1); print(sys.argv)", "a", "b"))
    assert simple.stdout == b"1\n['-c', 'a', 'b']\n"
    # ... and it was forked from the server, not exec'd.
    assert forked(box, server)
    assert b"callserver" not in box.call(server, ["/usr/bin/env", *py(CMDLINE)]).stdout


@pytest.mark.parametrize(
    ("source", "status"),
    [
        ("raise SystemExit(3)", 3),
        ("import sys; sys.exit()", 0),
        ("import sys; sys.exit('bye')", 1),
        ("import sys; sys.exit(True)", 1),
        ("raise ValueError('boom')", 1),
        ("def f():\n    1 / 0\nf()", 1),
        ("1 +", 1),
        ("import atexit; atexit.register(print, 'at exit'); print('body')", 0),
        (
            "import threading, time\n"
            "threading.Thread(target=lambda: (time.sleep(0.2), print('joined'))).start()",
            0,
        ),
        ("import sys; sys.stdout.write('no newline')", 0),
    ],
)
def test_python_fork_ends_as_the_interpreter_does(
    box: Box, server: CallServerProcess, source: str, status: int
) -> None:
    fork = box.call(server, py(source))
    real = box.call(server, ["/usr/bin/env", *py(source)])
    assert fork.result.exit_code == real.result.exit_code == status
    assert (fork.stdout, fork.stderr) == (real.stdout, real.stderr)


def test_python_fork_follows_the_c_locale_coercion(box: Box) -> None:
    # As in a container: no locale in the server's env nor in the call's.
    server = box.start(env={"PATH": PATH})
    env = {"PATH": PATH, "HOME": str(box.work), "TMPDIR": str(box.tmp)}
    assert forked(box, server, env)
    fork = box.call(server, py(INTROSPECT), env=env)
    real = box.call(server, ["/usr/bin/env", *py(INTROSPECT)], env=env)
    assert b"('LC_CTYPE', 'C.UTF-8')" in fork.stdout
    assert (fork.stdout, fork.stderr) == (real.stdout, real.stderr)
    # Another locale than the server's: a real interpreter runs it.
    assert not forked(box, server, {**env, "LANG": "C.UTF-8"})
    unbuffered = {**env, "PYTHONUNBUFFERED": "1"}
    assert forked(box, server, unbuffered)
    fork = box.call(server, py(INTROSPECT), env=unbuffered)
    real = box.call(server, ["/usr/bin/env", *py(INTROSPECT)], env=unbuffered)
    assert b"FileIO" in fork.stdout
    assert (fork.stdout, fork.stderr) == (real.stdout, real.stderr)
    assert not forked(box, server, {**env, "PYTHONHASHSEED": "0"})
    assert server.close() == 0


def test_python_fork_traceback_names_only_the_call(box: Box, server: CallServerProcess) -> None:
    reply = box.call(server, py("raise ValueError('boom')"))
    assert reply.stderr == (
        b'Traceback (most recent call last):\n  File "<string>", line 1, in <module>\n'
        b"ValueError: boom\n"
    )
    assert reply.result.exit_code == 1


def test_python_fork_calls_are_independent(box: Box, server: CallServerProcess) -> None:
    first = box.call(
        server, py("import json, random; X = 1; json.leak = 1; print(random.random())")
    )
    second = box.call(
        server,
        py("import json, random; print('X' in globals(), hasattr(json, 'leak'), random.random())"),
    )
    seen_x, leaked, number = second.stdout.split()
    assert (seen_x, leaked) == (b"False", b"False")
    assert number != first.stdout.strip()  # each call has its own random state


# -- limits


def test_time_limit_kills_the_call(box: Box, server: CallServerProcess) -> None:
    t = time.monotonic()
    reply = box.call(server, ["sleep", "30"], time_limit_s=0.5)
    assert time.monotonic() - t < 5
    assert reply.result.timed_out
    assert reply.result.exit_code == -signal.SIGKILL
    assert reply.result.clean


def test_a_timed_out_call_leaves_no_process(box: Box, server: CallServerProcess) -> None:
    reply = box.call(server, ["sh", "-c", "echo $$; sleep 30 & echo $!; sleep 30"], time_limit_s=1)
    assert reply.result.timed_out
    group, background = map(int, reply.stdout.split())
    assert alive(box, server, [group, background]) == []


def test_a_finished_call_leaves_no_process(box: Box, server: CallServerProcess) -> None:
    # The background sleep holds stdout open: the call still ends when sh does.
    reply = box.call(server, ["sh", "-c", "sleep 30 & echo $!"])
    assert (reply.result.exit_code, reply.result.timed_out) == (0, False)
    assert alive(box, server, [int(reply.stdout)]) == []


def test_a_process_that_left_the_group_is_killed(box: Box, server: CallServerProcess) -> None:
    escape = (
        "import subprocess\n"
        "p = subprocess.Popen(['sleep', '30'], start_new_session=True)\n"  # keeps stdout open
        "print(p.pid, flush=True)\n"
    )
    reply = box.call(server, py(escape))
    assert (reply.result.exit_code, reply.result.timed_out, reply.result.clean) == (0, False, True)
    assert alive(box, server, [int(reply.stdout)]) == []


def test_output_cap_truncates_and_kills(box: Box, server: CallServerProcess) -> None:
    reply = box.call(server, ["yes"], output_cap=10_000)
    assert reply.stdout == b"y\n" * 5_000
    assert reply.result.truncated
    assert not reply.result.timed_out
    assert reply.result.exit_code == -signal.SIGKILL


def test_rlimits_apply_to_forked_and_execd_calls(box: Box, server: CallServerProcess) -> None:
    grab = "bytearray(400 << 20)"
    for argv in (py(grab), ["/usr/bin/env", *py(grab)]):
        reply = box.call(server, argv, memory_bytes=256 << 20)
        assert reply.result.exit_code == 1
        assert reply.stderr.endswith(b"MemoryError\n")
    # SIGXFSZ is back to its default in an exec'd call (the server ignores it).
    big = box.call(
        server, ["sh", "-c", "head -c 99999 /dev/zero > f; echo $?; wc -c < f"], fsize_bytes=4096
    )
    assert big.stdout.split() == [str(128 + signal.SIGXFSZ).encode(), b"4096"]
    spin = box.call(server, py("while True: pass"), cpu_s=1)
    assert (spin.result.exit_code, spin.result.timed_out) == (-signal.SIGKILL, False)


def test_output_cap_counts_each_stream(box: Box, server: CallServerProcess) -> None:
    reply = box.call(server, ["sh", "-c", "echo 1234; echo abcd >&2"], output_cap=5)
    assert (reply.stdout, reply.stderr) == (b"1234\n", b"abcd\n")
    assert not reply.result.truncated


# -- the protocol channel

TOUCH_CHANNEL = """
import errno, os, sys
server = int(sys.argv[1])
written = []
for fd in range(3, 21):
    try:
        os.write(fd, b'\\x03\\x00\\x00\\x00\\x02{}')
        written.append(fd)
    except OSError as e:
        assert e.errno == errno.EBADF, e
for path, mode in ((f'/proc/{server}/fd/1', 'wb'), (f'/proc/{server}/fd/0', 'rb')):
    try:
        open(path, mode).close()
        written.append(path)
    except OSError as e:
        print(type(e).__name__)
print(written)
"""


def test_a_call_cannot_touch_the_protocol_channel(box: Box, server: CallServerProcess) -> None:
    result = server.ping()
    assert result.server is not None
    server_pid = str(result.server["pid"])
    reply = box.call(server, py(TOUCH_CHANNEL, server_pid))
    assert reply.stdout == b"PermissionError\nPermissionError\n[]\n", reply.stderr
    shell = box.call(server, ["sh", "-c", "for fd in 3 4 5 9; do echo x >&$fd; done"])
    assert shell.stderr.count(b"Bad file descriptor") == 4
    # A call's output that looks like a frame is data, not a frame.
    fake = box.call(server, ["printf", "\\003\\000\\000\\000\\002{}"])
    assert fake.stdout == b"\x03\x00\x00\x00\x02{}"
    assert box.call(server, ["sh", "-c", "echo ok"]).stdout == b"ok\n"
    assert server.ping().exit_code == 0


# -- as root: the uid drop and the cleanup


@needs_root
def test_a_call_runs_as_the_call_uid_without_capabilities(
    box: Box, server: CallServerProcess
) -> None:
    reply = box.call(
        server, ["sh", "-c", "id -u; id -G; grep -E '^Cap(Eff|Prm)' /proc/self/status"]
    )
    assert reply.stdout.decode().split() == [
        str(CALL_UID),
        str(CALL_UID),
        "CapPrm:",
        "0000000000000000",
        "CapEff:",
        "0000000000000000",
    ]
    assert box.call(server, py("import os; print(os.getuid())")).stdout == f"{CALL_UID}\n".encode()


@needs_root
def test_a_call_cannot_kill_the_server(box: Box, server: CallServerProcess) -> None:
    result = server.ping()
    assert result.server is not None
    reply = box.call(server, ["kill", "-9", str(result.server["pid"])])
    assert reply.result.exit_code != 0
    assert b"Operation not permitted" in reply.stderr
    assert server.ping().exit_code == 0


PEEK = """
import ctypes, sys
pid = int(sys.argv[1])
try:
    open(f'/proc/{pid}/mem', 'rb').close()
    print('mem open')
except OSError as e:
    print(type(e).__name__)
libc = ctypes.CDLL(None, use_errno=True)
PTRACE_ATTACH = 16
print(libc.ptrace(PTRACE_ATTACH, pid, None, None), ctypes.get_errno())
"""


@needs_root
def test_a_call_cannot_read_or_trace_the_server(box: Box, server: CallServerProcess) -> None:
    result = server.ping()
    assert result.server is not None
    reply = box.call(server, py(PEEK, str(result.server["pid"])))
    assert reply.stdout == b"PermissionError\n-1 1\n", reply.stderr  # EPERM
    assert server.ping().exit_code == 0


MESS = """
set -e
mkdir -p a/b/c "$TMPDIR/t"
echo x > a/b/c/f; echo y > "$TMPDIR/t/g"; echo z > .hidden
mkdir locked; echo w > locked/f; chmod 000 locked
mkdir ro; echo v > ro/f; chmod 500 ro
ln -s "$1" link
ls -A | wc -l
"""


def test_writable_dirs_are_emptied_after_each_call(box: Box, server: CallServerProcess) -> None:
    outside = box.base / "outside"
    outside.write_text("keep me")
    outside.chmod(0o666)
    reply = box.call(server, ["sh", "-c", MESS, "sh", str(outside)])
    assert reply.stdout == b"5\n", reply.stderr
    assert reply.result.clean
    assert list(box.work.iterdir()) == list(box.tmp.iterdir()) == []
    assert outside.read_text() == "keep me"  # the symlink went, not its target


def _children_of(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def _is_sleep_of_call_uid(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return f"Uid:\t{CALL_UID}\t" in status and cmdline == b"sleep\x0060\x00"


@needs_root
@pytest.mark.skipif(shutil.which("nsenter") is None, reason="needs nsenter")
def test_the_cleanup_kills_every_process_of_the_call_uid(
    box: Box, server: CallServerProcess
) -> None:
    """A process of the call uid that no call started (so the subreaper never sees it)
    is killed by the cleanup's kill(-1) as that uid, in the server's pid namespace."""
    with open(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children") as f:
        init = f.read().split()[0]  # the namespace's PID 1 (sh), child of unshare
    drop = ["setpriv", f"--reuid={CALL_UID}", f"--regid={CALL_UID}", "--clear-groups"]
    outsider = subprocess.Popen(["nsenter", "-t", init, "-p", "-m", "--", *drop, "sleep", "60"])
    try:
        # nsenter forks into the namespace; its child becomes `sleep` as the call uid.
        deadline = time.monotonic() + 30
        while not any(_is_sleep_of_call_uid(c) for c in _children_of(outsider.pid)):
            assert time.monotonic() < deadline and outsider.poll() is None
            time.sleep(0.01)
        assert box.call(server, ["true"]).result.clean
        assert outsider.wait(timeout=10) != 0
    finally:
        if outsider.poll() is None:
            outsider.kill()
            outsider.wait()


@needs_root
def test_a_cleanup_that_fails_is_not_clean(box: Box, server: CallServerProcess) -> None:
    stuck = box.work / "root-owned"
    stuck.mkdir()
    (stuck / "f").write_text("the call uid cannot delete this")
    reply = box.call(server, ["true"])
    assert (reply.result.exit_code, reply.result.clean) == (0, False)
    assert "could not empty" in server.stderr()
    shutil.rmtree(stuck)
    assert box.call(server, ["true"]).result.clean


@needs_root
@needs_setpriv
@pytest.mark.parametrize(("cap", "said"), [("kill", "CAP_KILL"), ("setuid", "CAP_SETUID")])
def test_a_root_server_without_the_capabilities_it_needs_refuses_to_start(
    box: Box, cap: str, said: str
) -> None:
    drop = ["setpriv", f"--bounding-set=-{cap}", f"--inh-caps=-{cap}", SERVER_PYTHON]
    argv = [*drop, str(CALLSERVER), "--writable", str(box.work)]
    done = subprocess.run(
        argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=60, check=False
    )
    assert done.returncode == cs.EXIT_STARTUP
    assert said.encode() in done.stderr


SHM = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
IPC_PRIVATE, IPC_CREAT = 0, 0o1000
print(libc.shmget(IPC_PRIVATE, 4096, IPC_CREAT | 0o600))
"""


@needs_root
def test_sysv_ipc_of_the_call_is_removed(box: Box, server: CallServerProcess) -> None:
    shm_id = box.call(server, py(SHM)).stdout.strip()
    assert int(shm_id) >= 0
    table = box.call(server, ["cat", "/proc/sysvipc/shm"]).stdout.splitlines()[1:]
    assert shm_id not in [row.split()[1] for row in table]


# -- a server that is not root, and the source passed with -c


@needs_setpriv
def test_a_non_root_server_runs_calls_as_its_own_uid(box: Box) -> None:
    uid = OWN_UID if ROOT else os.getuid()
    server = box.start(source_via_c=True, as_uid=OWN_UID if ROOT else None, namespaces=False)
    result = server.ping()
    assert result.server is not None
    assert (result.server["call_uid"], result.server["python_fork"]) == (uid, True)
    assert "(the server's own uid: not root, no drop)" in server.stderr()
    assert "dumpable=off" in server.stderr()
    assert box.call(server, ["id", "-u"]).stdout == f"{uid}\n".encode()
    assert box.call(server, py("print(1)")).stdout == b"1\n"
    # Same uid as the server, yet its fds stay out of reach: it is not dumpable.
    touch = box.call(server, py(TOUCH_CHANNEL, str(result.server["pid"])))
    assert touch.stdout == b"PermissionError\nPermissionError\n[]\n", touch.stderr
    leftover = box.call(server, ["sh", "-c", "sleep 30 & echo $!"])
    assert alive(box, server, [int(leftover.stdout)]) == []
    assert server.close() == 0


@needs_setpriv
def test_sigterm_kills_the_running_call(box: Box) -> None:
    # Not in a namespace, so the pid printed is this host's.
    server = box.start(as_uid=OWN_UID if ROOT else None, namespaces=False)
    assert server.ping().exit_code == 0
    header = cs.Call(
        9, ("sh", "-c", "echo $$; exec sleep 30"), 30.0, 1000, 60, 0, 0, box.env, str(box.work)
    )
    server.send(cs.encode_request(header.header(), b""))
    assert server.proc.stdout is not None
    frame = bytearray()
    while not (frames := cs.decode_frames(frame)):
        frame += os.read(server.proc.stdout.fileno(), 100)
    assert frames[0][0] == cs.KIND_STDOUT
    call_pid = int(frames[0][1])
    server.proc.send_signal(signal.SIGTERM)
    assert server.wait() == 128 + signal.SIGTERM
    assert not Path(f"/proc/{call_pid}").exists()


def test_the_server_runs_from_its_source_given_with_c(box: Box) -> None:
    server = box.start(source_via_c=True)
    assert server.ping().exit_code == 0
    assert box.call(server, ["sh", "-c", "echo ok"]).stdout == b"ok\n"
    assert box.call(server, py("import sys; print(sys.argv)", "x")).stdout == b"['-c', 'x']\n"
    assert server.close() == 0


def test_no_python_fork_execs_every_call(box: Box) -> None:
    server = box.start("--no-python-fork")
    result = server.ping()
    assert result.server is not None and result.server["python_fork"] is False
    assert box.call(server, py(CMDLINE)).stdout == b"[b'-c']\n"
    assert server.close() == 0


# -- malformed requests


def test_garbage_makes_the_server_exit_2(box: Box) -> None:
    server = box.start()
    server.send(b"garbage! not a frame at all")
    assert server.wait() == cs.EXIT_MALFORMED
    assert server.proc.stdout is not None and server.proc.stdout.read() == b""
    assert "malformed request (id None)" in server.stderr()


def test_a_mistyped_field_is_answered_then_the_server_exits_2(box: Box) -> None:
    server = box.start()
    header = cs.Call(5, ("true",), 1.0, 100, 1, 0, 0, box.env, "/").header()
    header["time_limit_s"] = "soon"
    reply = server.request(header)
    assert reply.result.id == 5
    assert reply.result.exit_code is None
    assert reply.result.error is not None and "time_limit_s" in reply.result.error
    assert server.wait() == cs.EXIT_MALFORMED


def test_an_error_result_stays_small_whatever_the_request(box: Box) -> None:
    server = box.start()
    header = cs.Call(6, ("true",), 1.0, 100, 1, 0, 0, box.env, "/").header()
    header["output_cap"] = ["x" * 500_000]
    reply = server.request(header)
    assert reply.result.error is not None and "output_cap" in reply.result.error
    assert len(reply.result.error) < 2_000
    assert server.wait() == cs.EXIT_MALFORMED


def test_an_oversize_header_is_refused(box: Box) -> None:
    server = box.start()
    server.send(cs.REQUEST_PREFIX.pack(cs.MAX_HEADER_BYTES + 1, 0) + b"{}")
    assert server.wait() == cs.EXIT_MALFORMED
    assert "header length" in server.stderr()


def test_an_oversize_body_is_refused_under_its_id(box: Box) -> None:
    server = box.start()
    raw = cs.encode_request(cs.Ping(8).header(), b"")
    server.send(cs.REQUEST_PREFIX.pack(len(raw) - 8, cs.MAX_BODY_BYTES + 1) + raw[8:])
    reply = server.reply()
    assert reply.result.id == 8
    assert reply.result.error is not None and "body length" in reply.result.error
    assert server.wait() == cs.EXIT_MALFORMED


def test_a_stream_cut_inside_a_request_is_malformed(box: Box) -> None:
    server = box.start()
    server.send(cs.encode_request(cs.Ping(1).header(), b"")[:-3])
    assert server.close() == cs.EXIT_MALFORMED


# -- the wire helpers and the module itself


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"id": True}, "id"),
        ({"argv": []}, "argv"),
        ({"argv": ["a\0b"]}, "argv"),
        ({"env": {"A=B": "c"}}, "env"),
        ({"time_limit_s": float("inf")}, "time_limit_s"),
        ({"output_cap": -1}, "output_cap"),
        ({"cpu_s": 0}, "cpu_s"),
        ({"extra": 1}, "extra"),
    ],
)
def test_parse_header_names_the_bad_field(change: dict[str, object], named: str) -> None:
    header = cs.Call(3, ("true",), 1.0, 100, 1, 0, 0, {}, "/").header() | change
    with pytest.raises(cs.MalformedRequestError, match=named) as err:
        cs.parse_header(cs.encode_request(header, b"")[8:])
    assert err.value.request_id == (None if named == "id" else 3)


def test_a_header_round_trips() -> None:
    call = cs.Call(3, ("a", "b"), 1.5, 100, 2, 4096, 10, {"K": "v"}, "/w")
    raw = cs.encode_request(call.header(), b"xyz")
    header_len, body_len = cs.REQUEST_PREFIX.unpack_from(raw)
    assert cs.parse_header(raw[8 : 8 + header_len]) == call
    assert (body_len, raw[8 + header_len :]) == (3, b"xyz")
    assert cs.parse_header(cs.encode_request(cs.Ping(4).header(), b"")[8:]) == cs.Ping(4)


def test_decode_frames_keeps_an_incomplete_frame() -> None:
    stream = cs.encode_frame(cs.KIND_STDOUT, b"hello") + cs.encode_frame(cs.KIND_RESULT, b"{}")
    buffer = bytearray(stream[:-1])
    assert cs.decode_frames(buffer) == [(cs.KIND_STDOUT, b"hello")]
    buffer += stream[-1:]
    assert cs.decode_frames(buffer) == [(cs.KIND_RESULT, b"{}")]
    assert buffer == b""
    with pytest.raises(ValueError, match="broken frame stream"):
        cs.decode_frames(bytearray(b"\x09\x00\x00\x00\x00"))


def test_the_module_needs_only_the_standard_library() -> None:
    tree = ast.parse(CALLSERVER.read_text())
    imported = {
        (alias.name if isinstance(node, ast.Import) else node.module or "").split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert imported - {"__future__"} <= set(sys.stdlib_module_names)
    # Importing it starts nothing: no startup line, no read of stdin.
    code = f"import runpy; runpy.run_path({str(CALLSERVER)!r}, run_name='imported'); print('ok')"
    done = subprocess.run(
        [SERVER_PYTHON, "-I", "-c", code],
        capture_output=True,
        stdin=subprocess.DEVNULL,
        timeout=60,
        check=False,
    )
    assert (done.stdout, done.stderr) == (b"ok\n", b"")


# -- timing, printed and not asserted


def test_call_latency_p50(
    box: Box, server: CallServerProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    figures = {}
    for name, argv, expected in (
        ("sh -c 'echo ok'", ["sh", "-c", "echo ok"], b"ok\n"),
        ("python3 -c 'print(1)' (forked)", py("print(1)"), b"1\n"),
        ("env python3 -c 'print(1)' (exec'd)", ["env", *py("print(1)")], b"1\n"),
    ):
        times = []
        for _ in range(50):
            t = time.perf_counter()
            reply = box.call(server, argv)
            times.append(time.perf_counter() - t)
            assert (reply.stdout, reply.result.exit_code) == (expected, 0)
        figures[name] = statistics.median(times) * 1000
    with capsys.disabled():
        for name, ms in figures.items():
            print(f"\ncallserver p50 over 50 calls, {name}: {ms:.2f} ms")
