"""The in-sandbox call server: the main process of a warm sandbox, running one call at a time.

Standard library only, for any python3 >= 3.11 with nothing installed: it never imports
streamrl. Run it as `python3 callserver.py [flags]` or `python3 -c "$SOURCE" [flags]` (so
a sandbox image carries no streamrl code); importing it runs nothing, and the host-side
client imports its framing functions and constants from here.

Protocol (version `PROTOCOL_VERSION`). Requests arrive on fd 0, responses leave on fd 1;
the server's own diagnostics go to fd 2 (its startup line, fatal errors: the host drains
or discards them). Integers are big-endian.

Request: struct `>II` (header length H, body length B), H bytes of UTF-8 JSON (the
header, an object), then B bytes: the call's whole stdin. 1 <= H <= `MAX_HEADER_BYTES`,
B <= `MAX_BODY_BYTES`. Header fields, all required, no others allowed:
    id            int in [0, 2**63): echoed in the result
    argv          non-empty list of str: the command; argv[0] is looked up in env PATH
    time_limit_s  number > 0: wall-clock seconds from the fork to the kill
    output_cap    int >= 0: bytes kept of each of stdout and stderr; beyond, the kill
    cpu_s         int >= 1: RLIMIT_CPU (soft and hard), seconds
    memory_bytes  int >= 0: RLIMIT_AS; 0 leaves it as the server has it
    fsize_bytes   int >= 0: RLIMIT_FSIZE (0 forbids growing any file)
    env           object of str -> str: the call's whole environment
    cwd           str: the call's working directory
Strings hold no NUL and env names no "=". A ping is `{"id": N, "argv": [], "ping": true}`
with B = 0: it is answered at once (a readiness check). A malformed request (a length out
of range, a stream that ends inside a request, a header that is not a JSON object, a
missing, unknown or mistyped field) is answered with an error result when its id could be
read, then the server exits with status `EXIT_MALFORMED`: the host recycles the sandbox.
At EOF between requests the server exits 0.

Response: a stream of frames, struct `>BI` (kind, payload length) then the payload.
Kind `KIND_STDOUT` / `KIND_STDERR`: a chunk of the call's stdout / stderr (at most
`CHUNK_BYTES`), streamed as it arrives. Kind `KIND_RESULT`: the JSON result, exactly one
per request, last:
    id          int: the request's id
    exit_code   int or null: the call's exit status; death by signal n is -n (as
                `subprocess` reports it); null when the call never ran (see error)
    timed_out   bool: the time limit passed and the call was killed
    truncated   bool: a stream passed output_cap and the call was killed
    duration_s  float: seconds from the fork until the call's process was reaped
    clean       bool: the cleanup after the call succeeded; false: recycle the sandbox
    error       null, or str when the server itself could not run the call (fork or
                setup failed, malformed request): recycle the sandbox
    server      only in a ping's result: {"protocol", "pid", "call_uid", "call_gid",
                "python_fork"}: the server's pid and how calls run
Frames of stdout/stderr may interleave in any order; their payloads, concatenated per
kind, are the call's outputs (each cut at output_cap).

A call. The server forks; the child starts a new session (its own process group), keeps
only the call's three pipes (as fds 0, 1, 2: it can neither read requests nor write
frames), sets RLIMIT_CPU, AS, FSIZE and CORE=0 and umask 022, drops to the call uid/gid
(`--call-uid`, no supplementary groups) when the server runs as root, enters cwd and
execs argv with env. argv[0] not found: exit 127, not executable: 126, each with a line on
stderr. The server feeds the body to the call's stdin, streams its output, and at the
time limit or the output cap kills the call's process group (SIGKILL). When the call's
process ends (or is killed) the server kills its process group, then every process left
below the server (the server is a child subreaper: processes that left the group are
reparented to it), then drains what the pipes still hold (`DRAIN_GRACE_S` at most).

The Python fork server. A call whose argv is `[python3|python, -c, SOURCE, *args]`, where
argv[0] found on env PATH is the server's own interpreter, and whose env sets the same
PYTHON* variables as the server's (PYTHONUNBUFFERED aside) and the same LC_ALL, LC_CTYPE
and LANG (after CPython's C locale coercion), is not exec'd: after the same
session/fd/rlimit/uid steps the child runs SOURCE as `python3 -c` would, so a call does
not pay for an interpreter start and the imports of `PRELOAD`. Every other call (other
flags, another interpreter, another env) is exec'd. As in a fresh interpreter:
`__main__` is a new module (`__name__`, `__doc__`, `__package__`, `__loader__`, `__spec__`,
`__annotations__`, `__builtins__`); sys.argv is ["-c", *args]; sys.path[0] is "";
sys.stdin/stdout/stderr are new text streams on fds 0/1/2 (the server's encoding and
errors; stderr backslashreplace and line-buffered, stdout block-buffered;
PYTHONUNBUFFERED honoured); os.environ is env (plus LC_CTYPE=C.UTF-8 where CPython's
locale coercion adds it); SIGINT raises KeyboardInterrupt, SIGPIPE and SIGXFSZ are
ignored; `random` is reseeded from os.urandom; SystemExit(None) exits 0, SystemExit(int)
that int, any other SystemExit prints it to stderr and exits 1; an uncaught exception
prints its traceback (no frame of this server) and exits 1, a KeyboardInterrupt dies of
SIGINT; at exit, non-daemon threads are joined, atexit functions run, stdio is flushed
(a stdout that cannot be flushed: status 120).
What differs from a fresh `python3 -c`:
  - sys.modules already holds the server's modules (PRELOAD, ctypes, argparse, selectors,
    ...) with whatever module state they have; `import json` costs nothing.
  - the str hash seed is the server's, shared by every call (set and dict-of-str order
    repeats from call to call); sys.flags, the locale and sys.path come from the server's
    start, not from the call's env (hence the PYTHON* rule above).
  - /proc/self/cmdline and `ps` show the server's command line; the process is not
    dumpable (inherited from the server, or reset by the uid change); sys.orig_argv is
    rebuilt; sys.executable is the server's (the same file as argv[0] on PATH).
  - memory inherited from the server may hold residue of earlier calls' requests
    (headers, bodies, outputs): a call that reads its own heap could find them. Exec'd
    calls start from a fresh image. The body buffer is zeroed after each call.
Flag `--no-python-fork` turns it off (every call exec'd).

Cleanup after every call: a forked child drops to the call uid (when root), kills every
process of that uid (`kill(-1, SIGKILL)`: leftovers that left the process group), removes
the SysV IPC objects of that uid, then empties each `--writable` dir (everything below it;
directories chmod'ed u+rwx when a delete fails). Its exit status is `clean`. Not root,
calls share the server's uid: there is no `kill(-1)` and no IPC removal (they would reach
the user's own processes), and only the subreaper kill stops leftovers.

Hardening at start: PR_SET_DUMPABLE 0 (the call cannot ptrace the server or open its
/proc files: its fds, its memory), PR_SET_CHILD_SUBREAPER, SIGINT ignored, SIGPIPE
ignored (a vanished host is an error, not a silent death), SIGTERM kills the running call
and exits 143. As root, the server first checks that it can drop to the call uid and
kill its processes (it needs CAP_SETUID, CAP_SETGID and CAP_KILL) and exits
`EXIT_STARTUP` otherwise. The startup line on
stderr says which of these hold.
"""

from __future__ import annotations

import argparse
import atexit
import builtins
import contextlib
import gc
import importlib.machinery
import io
import json
import math
import os
import random
import resource
import selectors
import shutil
import signal
import stat
import struct
import sys
import time
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, TypeGuard

if TYPE_CHECKING:
    import ctypes

PROTOCOL_VERSION = 1
REQUEST_PREFIX = struct.Struct(">II")  # header length, body length
FRAME_PREFIX = struct.Struct(">BI")  # kind, payload length
KIND_STDOUT = 1
KIND_STDERR = 2
KIND_RESULT = 3
FRAME_KINDS = (KIND_STDOUT, KIND_STDERR, KIND_RESULT)
MAX_HEADER_BYTES = 1 << 20
MAX_BODY_BYTES = 64 << 20
CHUNK_BYTES = 1 << 16  # most bytes of output in one frame
MAX_FRAME_BYTES = 1 << 20  # a frame longer than this is a broken stream
EXIT_MALFORMED = 2  # the server's status after a malformed request
EXIT_STARTUP = 3  # the server cannot run calls safely (no uid drop)
EXIT_NOT_EXECUTABLE = 126
EXIT_NOT_FOUND = 127
EXIT_FLUSH_FAILED = 120  # as CPython's, when stdout cannot be flushed at exit
# Used by no process of the streamrl stack (its images run as 10001): rootful podman maps
# no user namespace, so a uid's process count (RLIMIT_NPROC) is host-wide (review N3).
DEFAULT_CALL_UID = "20001:20001"
DEFAULT_WRITABLE = ("/work", "/tmp", "/var/tmp", "/dev/shm")
# Imported by the server at start, so that a forked `python3 -c` call finds them loaded.
PRELOAD = (
    "json", "math", "re", "decimal", "fractions", "collections", "itertools", "functools",
    "statistics", "datetime", "random", "string", "typing", "dataclasses", "textwrap",
    "operator", "heapq", "bisect",
)  # fmt: skip
PYTHON_NAMES = ("python3", "python")
LOCALE_VARS = ("LC_ALL", "LC_CTYPE", "LANG")
DRAIN_GRACE_S = 0.5  # after the call ended: how long its pipes may stay open
CLEANUP_TIMEOUT_S = 10.0  # the cleanup child, and the kill of leftovers
HEADER_FIELDS = (
    "id",
    "argv",
    "time_limit_s",
    "output_cap",
    "cpu_s",
    "memory_bytes",
    "fsize_bytes",
    "env",
    "cwd",
)
RESULT_FIELDS = ("id", "exit_code", "timed_out", "truncated", "duration_s", "clean", "error")
_MAX_ID = 1 << 63
_PR_SET_DUMPABLE = 4
_PR_SET_CHILD_SUBREAPER = 36
_CAP_KILL = 5  # root signals the calls (another uid) only with it
_IPC_RMID = 0
_SETUP_FAILED = 125  # a call child's status when its setup failed (reported on errpipe)
_MAX_MESSAGE = 1000  # characters of an error message in a result


# -- the wire


class MalformedRequestError(ValueError):
    """A request that breaks the protocol; `request_id` when its header gave one."""

    def __init__(self, message: str, request_id: int | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


@dataclass(frozen=True)
class Call:
    """One call's request header (units: seconds and bytes)."""

    id: int
    argv: tuple[str, ...]
    time_limit_s: float
    output_cap: int
    cpu_s: int
    memory_bytes: int
    fsize_bytes: int
    env: Mapping[str, str]
    cwd: str

    def header(self) -> dict[str, object]:
        """The JSON header of this call."""
        return {
            "id": self.id,
            "argv": list(self.argv),
            "time_limit_s": self.time_limit_s,
            "output_cap": self.output_cap,
            "cpu_s": self.cpu_s,
            "memory_bytes": self.memory_bytes,
            "fsize_bytes": self.fsize_bytes,
            "env": dict(self.env),
            "cwd": self.cwd,
        }


@dataclass(frozen=True)
class Ping:
    id: int

    def header(self) -> dict[str, object]:
        return {"id": self.id, "argv": [], "ping": True}


@dataclass(frozen=True)
class Result:
    """A call's final frame (see the module doc); `server` only answers a ping."""

    id: int
    exit_code: int | None
    timed_out: bool
    truncated: bool
    duration_s: float
    clean: bool
    error: str | None
    server: Mapping[str, object] | None = None

    def payload(self) -> bytes:
        body: dict[str, object] = {
            "id": self.id,
            "exit_code": self.exit_code,
            "timed_out": self.timed_out,
            "truncated": self.truncated,
            "duration_s": self.duration_s,
            "clean": self.clean,
            "error": self.error,
        }
        if self.server is not None:
            body["server"] = dict(self.server)
        return json.dumps(body).encode()

    @classmethod
    def from_payload(cls, payload: bytes) -> Result:
        """Parse a KIND_RESULT payload; ValueError when it is not one."""
        obj = json.loads(payload)
        if not isinstance(obj, dict) or set(obj) - {"server"} != set(RESULT_FIELDS):
            raise ValueError(f"not a result: {payload[:200]!r}")
        code, error, server = obj["exit_code"], obj["error"], obj.get("server")
        ok = (
            _is_int(obj["id"])
            and (code is None or _is_int(code))
            and all(isinstance(obj[k], bool) for k in ("timed_out", "truncated", "clean"))
            and isinstance(obj["duration_s"], int | float)
            and (error is None or isinstance(error, str))
            and (server is None or isinstance(server, dict))
        )
        if not ok:
            raise ValueError(f"mistyped result: {payload[:200]!r}")
        return cls(
            obj["id"],
            code,
            obj["timed_out"],
            obj["truncated"],
            float(obj["duration_s"]),
            obj["clean"],
            error,
            server,
        )


def encode_request(header: Mapping[str, object], body: bytes) -> bytes:
    """One request frame: prefix, JSON header, body. ValueError past the size limits."""
    raw = json.dumps(header).encode()
    if len(raw) > MAX_HEADER_BYTES or len(body) > MAX_BODY_BYTES:
        raise ValueError(f"request too large: header {len(raw)} B, body {len(body)} B")
    return REQUEST_PREFIX.pack(len(raw), len(body)) + raw + body


def encode_frame(kind: int, payload: bytes) -> bytes:
    """One response frame."""
    if kind not in FRAME_KINDS or len(payload) > MAX_FRAME_BYTES:
        raise ValueError(f"bad frame: kind {kind}, {len(payload)} B")
    return FRAME_PREFIX.pack(kind, len(payload)) + payload


def decode_frames(buffer: bytearray) -> list[tuple[int, bytes]]:
    """Remove the complete response frames at the start of `buffer` and return them as
    (kind, payload); an incomplete frame stays. ValueError on a broken stream."""
    frames = []
    while len(buffer) >= FRAME_PREFIX.size:
        kind, size = FRAME_PREFIX.unpack_from(buffer)
        if kind not in FRAME_KINDS or size > MAX_FRAME_BYTES:
            raise ValueError(f"broken frame stream: kind {kind}, length {size}")
        end = FRAME_PREFIX.size + size
        if len(buffer) < end:
            break
        frames.append((kind, bytes(buffer[FRAME_PREFIX.size : end])))
        del buffer[:end]
    return frames


def parse_header(raw: bytes) -> Call | Ping:
    """Validate one request header; MalformedRequestError names the first fault."""
    try:
        obj = json.loads(raw.decode("utf-8"))
    except ValueError as err:  # UnicodeDecodeError and JSONDecodeError alike
        raise MalformedRequestError(f"header is not UTF-8 JSON: {err}") from None
    if not isinstance(obj, dict):
        raise MalformedRequestError("header is not a JSON object")
    request_id = obj.get("id")  # read first: every later fault is reported under it
    if not isinstance(request_id, int) or isinstance(request_id, bool):
        raise MalformedRequestError(f"id must be an int, not {_brief(request_id)}")
    if not 0 <= request_id < _MAX_ID:
        raise MalformedRequestError(f"id must be an int in [0, 2**63), not {_brief(request_id)}")
    try:
        if obj.get("ping") is True:
            return _parse_ping(obj, request_id)
        return _parse_call(obj, request_id)
    except MalformedRequestError as err:
        raise MalformedRequestError(str(err), request_id) from None


def _parse_ping(obj: dict[str, object], request_id: int) -> Ping:
    if set(obj) != {"id", "argv", "ping"} or obj["argv"] != []:
        raise MalformedRequestError('a ping is exactly {"id", "argv": [], "ping": true}')
    return Ping(request_id)


def _parse_call(obj: dict[str, object], request_id: int) -> Call:
    unknown = sorted(set(obj) - set(HEADER_FIELDS) - {"ping"})
    missing = [k for k in HEADER_FIELDS if k not in obj]
    if unknown or missing:
        raise MalformedRequestError(f"unknown fields {unknown}, missing fields {missing}")
    if obj.get("ping", False) is not False:
        raise MalformedRequestError("ping must be true or false")
    argv, env, limit = obj["argv"], obj["env"], obj["time_limit_s"]
    if not isinstance(argv, list) or not argv or not all(_clean_str(a) for a in argv):
        raise MalformedRequestError("argv must be a non-empty list of str without NUL")
    if not isinstance(env, dict) or not all(
        _clean_str(k) and k and "=" not in k and _clean_str(v) for k, v in env.items()
    ):
        raise MalformedRequestError("env must map names (no '=', no NUL) to str")
    cwd = obj["cwd"]
    if not _clean_str(cwd) or not cwd:
        raise MalformedRequestError("cwd must be a non-empty str without NUL")
    if isinstance(limit, bool) or not isinstance(limit, int | float):
        raise MalformedRequestError("time_limit_s must be a number")
    if not (math.isfinite(limit) and limit > 0):
        raise MalformedRequestError(f"time_limit_s must be finite and > 0, not {limit}")
    return Call(
        id=request_id,
        argv=tuple(argv),
        time_limit_s=float(limit),
        output_cap=_bounded(obj, "output_cap", 0),
        cpu_s=_bounded(obj, "cpu_s", 1),
        memory_bytes=_bounded(obj, "memory_bytes", 0),
        fsize_bytes=_bounded(obj, "fsize_bytes", 0),
        env=dict(env),
        cwd=cwd,
    )


def _bounded(obj: dict[str, object], name: str, low: int) -> int:
    value = obj[name]
    if not _is_int(value) or not low <= value < _MAX_ID:
        raise MalformedRequestError(f"{name} must be an int in [{low}, 2**63), not {_brief(value)}")
    return int(value)


def _brief(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _clean_str(value: object) -> TypeGuard[str]:
    """A str that can be an exec argument: no NUL, encodable for the OS."""
    if not isinstance(value, str) or "\0" in value:
        return False
    try:
        os.fsencode(value)
    except UnicodeError:
        return False
    return True


# -- the server


@dataclass(frozen=True)
class ServerConfig:
    """How the server runs calls; fixed at its start."""

    call_uid: int
    call_gid: int
    drop: bool  # the server is root: calls drop to call_uid/call_gid
    writable: tuple[str, ...]  # emptied after every call
    python_fork: bool  # run `python3 -c` calls in a forked child of the server
    python: str  # the server's interpreter, resolved
    python_env: Mapping[str, str]  # the server's PYTHON* variables but PYTHONUNBUFFERED
    locale_env: Mapping[str, str]  # the server's LC_ALL, LC_CTYPE, LANG
    stdio_encoding: str
    stdio_errors: str
    libc: ctypes.CDLL | None  # prctl and the SysV IPC calls (None: no libc)
    children_file: str | None  # /proc/self/task/PID/children, when the kernel has it


def _python_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith("PYTHON") and k != "PYTHONUNBUFFERED"}


def _locale_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: env[k] for k in LOCALE_VARS if k in env}


def coerced_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` as a fresh python3 has it in os.environ: CPython's C locale coercion (PEP
    538) sets LC_CTYPE=C.UTF-8 when the locale would be C or POSIX."""
    out = dict(env)
    if out.get("PYTHONCOERCECLOCALE") == "0" or out.get("LC_ALL"):
        return out
    if (out.get("LC_CTYPE") or out.get("LANG") or "C") in ("C", "POSIX"):
        out["LC_CTYPE"] = "C.UTF-8"
    return out


def _plain_interpreter() -> bool:
    """Whether this interpreter started as a plain `python3`: no flag that changes how
    `-c` code runs (isolation, no site, ...) and no -X option."""
    f = sys.flags
    changed = (
        f.isolated,
        f.no_site,
        f.ignore_environment,
        f.no_user_site,
        f.safe_path,
        f.inspect,
        f.interactive,
    )
    return not any(changed) and not sys._xoptions


def _load_libc() -> ctypes.CDLL | None:
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True)
    except (ImportError, OSError):
        return None


def _prctl(libc: ctypes.CDLL | None, option: int, value: int) -> bool:
    return libc is not None and libc.prctl(option, value, 0, 0, 0) == 0


def _parse_uid(text: str) -> tuple[int, int]:
    uid, sep, gid = text.partition(":")
    if not (sep and uid.isdigit() and gid.isdigit()):
        raise argparse.ArgumentTypeError(f"expected UID:GID, not {text!r}")
    return int(uid), int(gid)


def _parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="callserver", description="Serve sandboxed calls on stdin/stdout."
    )
    parser.add_argument(
        "--call-uid",
        type=_parse_uid,
        default=_parse_uid(DEFAULT_CALL_UID),
        metavar="UID:GID",
        help=f"uid:gid calls run as when the server is root (default {DEFAULT_CALL_UID})",
    )
    parser.add_argument(
        "--writable",
        action="append",
        metavar="DIR",
        help=f"a dir emptied after every call; repeatable (default: {' '.join(DEFAULT_WRITABLE)})",
    )
    parser.add_argument(
        "--no-python-fork", action="store_true", help="exec every call, python3 -c too"
    )
    return parser.parse_args(argv)


def _drop_works(uid: int, gid: int) -> bool:
    """Whether a child of this server can drop to uid:gid (CAP_SETUID, CAP_SETGID)."""
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            _drop_to(uid, gid)
            status = 0
        finally:
            os._exit(status)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def _has_capability(bit: int) -> bool:
    """Whether this process has the capability in its effective set."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> bit & 1)
    return False


def _drop_to(uid: int, gid: int) -> None:
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    if os.getuid() != uid or os.geteuid() != uid or os.getegid() != gid:
        raise PermissionError(f"still uid {os.geteuid()} after dropping to {uid}")


def _on_sigterm(signum: int, frame: types.FrameType | None) -> None:
    raise SystemExit(128 + signum)


def _say(line: str) -> None:
    """A diagnostic line on the server's stderr."""
    sys.stderr.write(f"callserver: {line}\n")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    """Run the server until EOF on stdin; returns its exit status."""
    args = _parse_args(sys.argv[1:] if argv is None else argv)
    if sys.stderr is None:  # started with fd 2 closed: diagnostics go nowhere
        sys.stderr = open(os.open(os.devnull, os.O_WRONLY), "w")  # noqa: SIM115
    # A stray print must never reach the protocol channel.
    sys.stdout = sys.stderr
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_sigterm)
    libc = _load_libc()
    hardening = {
        "dumpable": "off" if _prctl(libc, _PR_SET_DUMPABLE, 0) else "ON (no prctl)",
        "subreaper": "on" if _prctl(libc, _PR_SET_CHILD_SUBREAPER, 1) else "off",
    }
    uid, gid = args.call_uid
    if os.geteuid() == 0 and not _drop_works(uid, gid):
        _say(f"fatal: running as root but cannot drop to uid {uid}:{gid} (CAP_SETUID/SETGID)")
        return EXIT_STARTUP
    if os.geteuid() == 0 and not _has_capability(_CAP_KILL):
        _say("fatal: running as root without CAP_KILL: it could not kill the calls")
        return EXIT_STARTUP
    cfg = _config(args, libc)
    for name in PRELOAD:
        __import__(name)
    # Objects alive now are never collected: forked calls do not copy their pages.
    gc.freeze()
    _say(_startup_line(cfg, hardening))
    try:
        return serve(cfg, 0, 1)
    except BrokenPipeError:
        _say("the host closed the response channel")
        return 1


def _config(args: argparse.Namespace, libc: ctypes.CDLL | None) -> ServerConfig:
    drop = os.geteuid() == 0
    uid, gid = args.call_uid if drop else (os.getuid(), os.getgid())
    children = f"/proc/self/task/{os.getpid()}/children"
    stdin = sys.stdin
    return ServerConfig(
        call_uid=uid,
        call_gid=gid,
        drop=drop,
        writable=tuple(args.writable or DEFAULT_WRITABLE),
        python_fork=_plain_interpreter() and not args.no_python_fork,
        python=os.path.realpath(sys.executable),
        python_env=_python_env(os.environ),
        locale_env=_locale_env(os.environ),
        # CPython gives stdin and stdout the same encoding and errors; a forked call's
        # stdio gets what this interpreter's got.
        stdio_encoding=stdin.encoding if stdin else "utf-8",
        stdio_errors=(stdin.errors or "strict") if stdin else "surrogateescape",
        libc=libc,
        children_file=children if os.path.exists(children) else None,
    )


def _startup_line(cfg: ServerConfig, hardening: Mapping[str, str]) -> str:
    how = "dropped from root" if cfg.drop else "the server's own uid: not root, no drop"
    fork = "on" if cfg.python_fork else "off"
    if not _plain_interpreter():
        fork += " (interpreter flags)"
    return (
        f"ready protocol={PROTOCOL_VERSION} pid={os.getpid()} "
        f"python={sys.version.split()[0]} euid={os.geteuid()} "
        f"calls_run_as={cfg.call_uid}:{cfg.call_gid} ({how}) "
        + " ".join(f"{k}={v}" for k, v in hardening.items())
        + f" python_fork={fork} leftover_kill={'uid+descendants' if cfg.drop else 'descendants'}"
        f" writable={','.join(cfg.writable)}"
    )


def serve(cfg: ServerConfig, fd_in: int, fd_out: int) -> int:
    """Answer requests from `fd_in` on `fd_out` until EOF (0) or a malformed request."""

    def emit(kind: int, payload: bytes) -> None:
        _write_all(fd_out, encode_frame(kind, payload))

    while True:
        try:
            request = read_request(fd_in)
        except MalformedRequestError as err:
            why = str(err)[:_MAX_MESSAGE]
            _say(f"malformed request (id {err.request_id}): {why}; exiting")
            if err.request_id is not None:
                emit(KIND_RESULT, _error_result(err.request_id, f"malformed request: {why}"))
            return EXIT_MALFORMED
        if request is None:
            return 0
        what, body = request
        if isinstance(what, Ping):
            emit(KIND_RESULT, _ping_result(cfg, what.id))
            continue
        try:
            result = run_call(cfg, what, body, emit)
        finally:
            body[:] = bytes(len(body))  # no residue for later forked calls
        emit(KIND_RESULT, result.payload())


def _error_result(request_id: int, error: str) -> bytes:
    return Result(request_id, None, False, False, 0.0, True, error[:_MAX_MESSAGE]).payload()


def _ping_result(cfg: ServerConfig, request_id: int) -> bytes:
    server = {
        "protocol": PROTOCOL_VERSION,
        "pid": os.getpid(),
        "call_uid": cfg.call_uid,
        "call_gid": cfg.call_gid,
        "python_fork": cfg.python_fork,
    }
    return Result(request_id, 0, False, False, 0.0, True, None, server).payload()


def read_request(fd: int) -> tuple[Call | Ping, bytearray] | None:
    """The next request on `fd`, or None at EOF before one starts."""
    first = os.read(fd, REQUEST_PREFIX.size)
    if not first:
        return None
    prefix = first + _read_exact(fd, REQUEST_PREFIX.size - len(first))
    header_len, body_len = REQUEST_PREFIX.unpack(prefix)
    if not 1 <= header_len <= MAX_HEADER_BYTES:
        raise MalformedRequestError(f"header length {header_len} not in [1, {MAX_HEADER_BYTES}]")
    request = parse_header(bytes(_read_exact(fd, header_len)))
    if body_len > MAX_BODY_BYTES or (isinstance(request, Ping) and body_len):
        raise MalformedRequestError(f"body length {body_len} refused", request.id)
    try:
        return request, _read_exact(fd, body_len)
    except MalformedRequestError as err:
        raise MalformedRequestError(str(err), request.id) from None


def _read_exact(fd: int, n: int) -> bytearray:
    """Exactly n bytes from fd; MalformedRequestError at EOF before."""
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, min(n - len(buf), 1 << 20))
        if not chunk:
            raise MalformedRequestError(f"the stream ended inside a request ({len(buf)}/{n} B)")
        buf += chunk
    return buf


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


# -- one call


class _Pump:
    """The server's side of a running call: feeds its stdin, streams its stdout and
    stderr as frames, each cut at the cap (beyond it: `truncated`, and the call stops)."""

    def __init__(
        self,
        pid: int,
        fds: tuple[int, int, int],
        body: bytearray,
        cap: int,
        emit: Callable[[int, bytes], None],
    ) -> None:
        self.pid = pid
        self.stdin: int | None = fds[0]
        self.kinds = {fds[1]: KIND_STDOUT, fds[2]: KIND_STDERR}
        self.sent = {KIND_STDOUT: 0, KIND_STDERR: 0}
        self.cap = cap
        self.emit = emit
        self.truncated = False
        self.todo = memoryview(body)
        self.sel = selectors.DefaultSelector()
        for fd in fds:
            os.set_blocking(fd, False)
        for fd in self.kinds:
            self.sel.register(fd, selectors.EVENT_READ)
        if self.todo:
            self.sel.register(fds[0], selectors.EVENT_WRITE)
        else:
            self._close_stdin()
        self.pidfd = _pidfd(pid)
        if self.pidfd is not None:
            self.sel.register(self.pidfd, selectors.EVENT_READ)

    def until_end(self, deadline: float) -> bool:
        """Serve the call until its process exits, a stream passes the cap or the deadline
        passes (then True: timed out). The process is left unreaped."""
        while not self.truncated and not _exited(self.pid):
            left = deadline - time.monotonic()
            if left <= 0:
                return True
            # Without a pidfd nothing wakes the select when the call exits: poll.
            self._step(left if self.pidfd is not None else min(left, 0.002))
        return False

    def drain(self, seconds: float) -> None:
        """Read what the pipes still hold until EOF, for at most `seconds` (a process
        that escaped every kill may hold them open)."""
        if self.pidfd is not None:
            self.sel.unregister(self.pidfd)  # readable for good once the call exited
            os.close(self.pidfd)
            self.pidfd = None
        if self.stdin is not None:
            self.sel.unregister(self.stdin)
            self._close_stdin()
        end = time.monotonic() + seconds
        while not self.truncated and self.sel.get_map():
            left = end - time.monotonic()
            if left <= 0:
                return
            self._step(left)

    def close(self) -> None:
        for key in list(self.sel.get_map().values()):
            self.sel.unregister(key.fd)
            if key.fd != self.stdin:
                os.close(key.fd)
        self.sel.close()
        self._close_stdin()

    def _step(self, timeout: float) -> None:
        for key, _ in self.sel.select(timeout):
            if key.fd == self.stdin:
                self._feed()
            elif key.fd in self.kinds:
                self._read(key.fd)

    def _feed(self) -> None:
        assert self.stdin is not None
        try:
            self.todo = self.todo[os.write(self.stdin, self.todo[:CHUNK_BYTES]) :]
        except BlockingIOError:
            return
        except OSError:  # the call closed its stdin: the rest is dropped
            self.todo = self.todo[:0]
        if not self.todo:
            self.sel.unregister(self.stdin)
            self._close_stdin()

    def _close_stdin(self) -> None:
        if self.stdin is not None:
            os.close(self.stdin)
            self.stdin = None

    def _read(self, fd: int) -> None:
        try:
            chunk = os.read(fd, CHUNK_BYTES)
        except BlockingIOError:
            return
        if not chunk:
            self.sel.unregister(fd)
            os.close(fd)
            return
        kind = self.kinds[fd]
        room = self.cap - self.sent[kind]
        if len(chunk) > room:
            chunk = chunk[: max(room, 0)]
            self.truncated = True
        if chunk:
            self.sent[kind] += len(chunk)
            self.emit(kind, chunk)


def run_call(
    cfg: ServerConfig, call: Call, body: bytearray, emit: Callable[[int, bytes], None]
) -> Result:
    """Run one call to its end, streaming its output through `emit`, then clean up."""
    start = time.monotonic()
    try:
        pid, fds, report_r = _spawn(cfg, call)
    except OSError as err:
        return Result(call.id, None, False, False, 0.0, _cleanup(cfg), f"cannot fork: {err}")
    status: int | None = None
    timed_out = truncated = False
    failure = None
    pump = None
    unowned: tuple[int, ...] = fds  # closed here unless a _Pump took them
    try:
        failure = _read_setup_failure(report_r)
        if failure is None:
            pump = _Pump(pid, fds, body, call.output_cap, emit)
            unowned = ()
            timed_out = pump.until_end(start + call.time_limit_s)
        status = _end_call(cfg, pid)
        if pump is not None:
            pump.drain(DRAIN_GRACE_S)
            truncated = pump.truncated
    finally:
        if status is None:  # an exception (the host went away, SIGTERM): stop the call
            _end_call(cfg, pid)
        if pump is not None:
            pump.close()
        for fd in unowned:
            os.close(fd)
    duration = time.monotonic() - start
    clean = _cleanup(cfg)
    if failure is not None:
        return Result(call.id, None, False, False, duration, clean, failure)
    return Result(call.id, status, timed_out, truncated, duration, clean, None)


def _spawn(cfg: ServerConfig, call: Call) -> tuple[int, tuple[int, int, int], int]:
    """Fork the call's child. Returns its pid, the server's ends of its stdin, stdout and
    stderr pipes, and the read end of the pipe on which the child reports a failed setup
    (it closes once the call runs)."""
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    report_r, report_w = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        for fd in (in_r, in_w, out_r, out_w, err_r, err_w, report_r, report_w):
            os.close(fd)
        raise
    if pid == 0:
        _child(cfg, call, (in_r, out_w, err_w), report_w)
    for fd in (in_r, out_w, err_w, report_w):
        os.close(fd)
    return pid, (in_w, out_r, err_r), report_r


def _read_setup_failure(report_r: int) -> str | None:
    """The child's setup failure, or None once it runs the call (the pipe closed)."""
    try:
        data = bytearray()
        while chunk := os.read(report_r, 4096):
            data += chunk[: 4 * _MAX_MESSAGE - len(data)]
    finally:
        os.close(report_r)
    return f"call setup failed: {data.decode(errors='replace')}" if data else None


def _pidfd(pid: int) -> int | None:
    """A descriptor that turns readable when the child exits (Linux >= 5.3)."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _exited(pid: int) -> bool:
    """Whether the child has exited, leaving it unreaped (its pid stays its group's)."""
    info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    return info is not None and info.si_pid == pid


def _end_call(cfg: ServerConfig, pid: int) -> int:
    """SIGKILL the call's process group while its leader is unreaped (so the pgid cannot
    have been reused), reap the leader, then kill every process left below the server.
    Returns the call's exit code (-n: killed by signal n)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    # Only now are the leader's own children (those that left the group) reparented here.
    _kill_descendants(cfg, deadline=time.monotonic() + CLEANUP_TIMEOUT_S)
    return status


def _children(cfg: ServerConfig) -> list[int]:
    """This server's child processes, zombies included."""
    if cfg.children_file is not None:
        with open(cfg.children_file) as f:
            return [int(p) for p in f.read().split()]
    me, found = os.getpid(), []
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{name}/stat", "rb") as f:
                if int(f.read().rsplit(b")", 1)[1].split()[1]) == me:
                    found.append(int(name))
    return found


def _kill_descendants(cfg: ServerConfig, deadline: float) -> bool:
    """SIGKILL and reap every child of the server. Orphans of the call are reparented to
    the server (a subreaper), and each one killed hands its own children over: so this
    reaches every process the call left behind. False if some outlive the deadline."""
    while True:
        left = []
        for p in _children(cfg):
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(p, os.WNOHANG)[0] == 0:
                    left.append(p)
        if not left:
            return True
        if time.monotonic() > deadline:
            return False
        for p in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p, signal.SIGKILL)
        time.sleep(0.001)


# -- the call's child


def _child(cfg: ServerConfig, call: Call, fds: tuple[int, int, int], report_w: int) -> NoReturn:
    """The forked call: never returns into the server's loop, whatever happens."""
    status = _SETUP_FAILED
    try:
        try:
            _enter_sandbox(cfg, call, fds, report_w)
        except BaseException as err:
            message = f"{type(err).__name__}: {err}"[:_MAX_MESSAGE]
            os.write(report_w, message.encode(errors="replace"))
            raise
        if _forkable(cfg, call):
            os.close(report_w)
            status = _run_python(cfg, call)
        else:
            status = _exec(call, report_w)
    finally:
        os._exit(status)


def _enter_sandbox(cfg: ServerConfig, call: Call, fds: tuple[int, int, int], report_w: int) -> None:
    """The call's process state: session, fds, signals, rlimits, ids, cwd."""
    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    # Only the call's stdio and the report pipe (close-on-exec) stay open.
    os.closerange(3, report_w)
    os.closerange(report_w + 1, max(os.sysconf("SC_OPEN_MAX"), 1024))
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    for sig in (signal.SIGINT, signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_DFL)  # ignored signals stay ignored across exec
    resource.setrlimit(resource.RLIMIT_CPU, (call.cpu_s, call.cpu_s))
    if call.memory_bytes:
        resource.setrlimit(resource.RLIMIT_AS, (call.memory_bytes, call.memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (call.fsize_bytes, call.fsize_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.umask(0o022)
    if cfg.drop:
        _drop_to(cfg.call_uid, cfg.call_gid)
    os.chdir(call.cwd)


def _exec(call: Call, report_w: int) -> int:
    """Exec argv (only returns on failure, with the shell's status for it)."""
    try:
        os.execvpe(call.argv[0], list(call.argv), dict(call.env))
    except (FileNotFoundError, NotADirectoryError):
        status, why = EXIT_NOT_FOUND, "command not found"
    except OSError as err:
        status, why = EXIT_NOT_EXECUTABLE, err.strerror or str(err)
    os.close(report_w)  # a failed exec is the call's outcome, not a setup failure
    with contextlib.suppress(OSError):
        os.write(2, f"callserver: {call.argv[0]}: {why}\n".encode(errors="replace"))
    return status


def _forkable(cfg: ServerConfig, call: Call) -> bool:
    """Whether the call is `python3 -c SOURCE ...` for this very interpreter and env."""
    argv = call.argv
    if not (cfg.python_fork and len(argv) >= 3 and argv[0] in PYTHON_NAMES):
        return False
    if argv[1] != "-c" or _python_env(call.env) != cfg.python_env:
        return False
    if _locale_env(coerced_env(call.env)) != cfg.locale_env:
        return False
    found = shutil.which(argv[0], path=call.env.get("PATH", os.defpath))
    return found is not None and os.path.realpath(found) == cfg.python


def _run_python(cfg: ServerConfig, call: Call) -> int:
    """Run SOURCE as `python3 -c SOURCE *args` would, in this forked child; returns the
    exit status (negative: die of that signal)."""
    source, args = call.argv[2], list(call.argv[3:])
    sys.argv = ["-c", *args]
    sys.orig_argv = [call.argv[0], "-c", source, *args]
    sys.path[:1] = [""]
    os.environ.clear()
    os.environ.update(coerced_env(call.env))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    _fresh_stdio(cfg, unbuffered=call.env.get("PYTHONUNBUFFERED", "") != "")
    random.seed(os.urandom(32))
    atexit._clear()
    main_module = types.ModuleType("__main__")
    main_module.__loader__ = importlib.machinery.BuiltinImporter
    main_module.__annotations__ = {}
    main_module.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main_module
    return _finish_python(_exec_source(source, main_module.__dict__))


def _fresh_stdio(cfg: ServerConfig, unbuffered: bool) -> None:
    """sys.stdin/stdout/stderr as CPython makes them at start, on the call's fds."""
    streams = []
    for fd, name in ((0, "<stdin>"), (1, "<stdout>"), (2, "<stderr>")):
        write = fd != 0
        # stdin is always buffered: TextIOWrapper needs read1().
        buffering = 0 if unbuffered and write else -1
        buf: Any = io.open(fd, "wb" if write else "rb", buffering, closefd=False)  # noqa: SIM115, UP020
        raw = buf if buffering == 0 else buf.raw
        raw.name = name
        line = not unbuffered and (raw.isatty() or fd == 2)
        errors = "backslashreplace" if fd == 2 else cfg.stdio_errors
        stream = io.TextIOWrapper(
            buf, cfg.stdio_encoding, errors, "\n", line_buffering=line, write_through=unbuffered
        )
        stream.mode = "w" if write else "r"  # type: ignore[misc]
        streams.append(stream)
    sys.stdin = sys.__stdin__ = streams[0]  # type: ignore[misc]
    sys.stdout = sys.__stdout__ = streams[1]  # type: ignore[misc]
    sys.stderr = sys.__stderr__ = streams[2]  # type: ignore[misc]


def _exec_source(source: str, namespace: dict[str, object]) -> int:
    """Compile and run SOURCE; handle its end as the interpreter does. The status."""
    try:
        exec(compile(source, "<string>", "exec"), namespace)
    except SystemExit as exc:
        return _system_exit_status(exc)
    except BaseException as exc:
        # This frame is the server's, not the call's: the traceback starts below it.
        tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
        exc.__traceback__ = tb
        sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, tb
        sys.excepthook(type(exc), exc, tb)
        return -signal.SIGINT if isinstance(exc, KeyboardInterrupt) else 1
    return 0


def _system_exit_status(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if _is_int(code) or isinstance(code, bool):
        number = int(code)
        return number & 0xFF if -(1 << 63) <= number < (1 << 63) else 0xFF
    with contextlib.suppress(Exception):
        sys.stderr.write(f"{code}\n")
    return 1


def _finish_python(status: int) -> int:
    """The interpreter's exit: join threads, run atexit, flush stdio."""
    threading = sys.modules.get("threading")
    # CPython's own shutdown hook; it waits for non-daemon threads.
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        with contextlib.suppress(BaseException):
            shutdown()
    atexit._run_exitfuncs()
    try:
        sys.stdout.flush()
    except Exception:
        status = EXIT_FLUSH_FAILED
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    if status < 0:  # die of the signal, as CPython does after a KeyboardInterrupt
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
        return 128 - status
    return status


# -- cleanup


def _cleanup(cfg: ServerConfig) -> bool:
    """After a call: in a child, as the call uid, kill every process of that uid, drop
    its SysV IPC objects and empty the writable dirs. True when all of it worked."""
    try:
        pid = os.fork()
    except OSError:
        return False
    if pid == 0:
        status = 1
        try:
            status = 0 if _cleanup_child(cfg) else 1
        finally:
            os._exit(status)
    code = _wait_for(pid, time.monotonic() + CLEANUP_TIMEOUT_S)
    # Processes it killed were reparented to this server (a subreaper): reap them.
    left_ok = _kill_descendants(cfg, deadline=time.monotonic() + CLEANUP_TIMEOUT_S)
    return code == 0 and left_ok


def _wait_for(pid: int, deadline: float) -> int | None:
    """The child's exit code; killed and None if it has not exited by the deadline."""
    pidfd = _pidfd(pid)
    try:
        while not _exited(pid):
            left = deadline - time.monotonic()
            if left <= 0:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return None
            if pidfd is not None:
                with selectors.DefaultSelector() as sel:
                    sel.register(pidfd, selectors.EVENT_READ)
                    sel.select(left)
            else:
                time.sleep(0.001)
    finally:
        if pidfd is not None:
            os.close(pidfd)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _cleanup_child(cfg: ServerConfig) -> bool:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    os.closerange(3, max(os.sysconf("SC_OPEN_MAX"), 1024))
    ok = True
    if cfg.drop:
        _drop_to(cfg.call_uid, cfg.call_gid)
        # Every process this uid may signal but this one: the call's leftovers.
        with contextlib.suppress(ProcessLookupError):
            os.kill(-1, signal.SIGKILL)
        ok = _remove_ipc(cfg)
    for path in cfg.writable:
        if not empty_dir(path):
            _say(f"cleanup: could not empty {path}")
            ok = False
    return ok


def _remove_ipc(cfg: ServerConfig) -> bool:
    """Remove the SysV shared memory, semaphores and message queues of the call uid."""
    libc = cfg.libc
    if libc is None:
        return True
    ok = True
    for kind, remove in (
        ("shm", lambda i: libc.shmctl(i, _IPC_RMID, None)),
        ("sem", lambda i: libc.semctl(i, 0, _IPC_RMID)),
        ("msg", lambda i: libc.msgctl(i, _IPC_RMID, None)),
    ):
        for ipc_id in _ipc_ids(f"/proc/sysvipc/{kind}", cfg.call_uid):
            if remove(ipc_id) != 0:
                ok = False
    return ok


def _ipc_ids(path: str, uid: int) -> list[int]:
    """Ids of the SysV IPC objects in a /proc/sysvipc table owned or created by uid."""
    try:
        with open(path) as f:
            head, *rows = f.read().splitlines()
    except (OSError, ValueError):
        return []
    names = head.split()  # the id is the second column: shmid, semid, msqid
    at_uid, at_cuid = names.index("uid"), names.index("cuid")
    return [int(c[1]) for c in map(str.split, rows) if str(uid) in (c[at_uid], c[at_cuid])]


def empty_dir(path: str) -> bool:
    """Delete everything below `path` (not `path`); where a delete is refused, make the
    directories u+rwx and try once more. True when it is empty (or absent)."""
    if not os.path.isdir(path):
        return True
    try:
        _remove_below(path)
        return True
    except OSError:
        pass
    _make_accessible(path)
    try:
        _remove_below(path)
    except OSError:
        return False
    return True


def _remove_below(path: str) -> None:
    with os.scandir(path) as entries:
        for entry in list(entries):
            if entry.is_dir(follow_symlinks=False):
                _remove_below(entry.path)
                os.rmdir(entry.path)
            else:
                os.unlink(entry.path)


def _make_accessible(path: str) -> None:
    """chmod u+rwx `path` (when this uid owns it) and every directory below it."""
    with contextlib.suppress(OSError):
        mode = os.lstat(path).st_mode
        os.chmod(path, stat.S_IMODE(mode) | stat.S_IRWXU)
    try:
        with os.scandir(path) as entries:
            subdirs = [e.path for e in entries if e.is_dir(follow_symlinks=False)]
    except OSError:
        return
    for sub in subdirs:
        _make_accessible(sub)


if __name__ == "__main__":
    sys.exit(main())
