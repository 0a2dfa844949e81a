"""The host side of a sandbox's call server (`streamrl.tools.callserver`).

A warm container whose main process is the call server is reached through one connection
kept for its life: the container's attached stdio (Docker API `attach` with stdin, stdout
and stderr; the engine multiplexes stdout and stderr in its 8-byte frames). `CallChannel`
sends a request, reads the server's frames off the stdout stream until the call's result,
and keeps the tail of the server's own stderr for error messages.

`server_command()` is the container's command: `python3 -c SOURCE` with the server's
flags, so the image carries no streamrl code. As root in the container, with only
CAP_SETUID, CAP_SETGID and CAP_KILL, the server runs each call as the call uid.

`CallChannel.call` returns the call's `ExecResult` and whether the container may serve
another call: not after any limit was hit, a death by a signal, a failed cleanup, an
error of the server, a broken stream or a host-side deadline (the call's limit plus
`grace_s`), as with the exec path.
"""

from __future__ import annotations

import itertools
import selectors
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from streamrl.tools import callserver
from streamrl.tools.sandbox import ExecResult

__all__ = ["CallChannel", "CallChannelError", "Reply", "server_command"]

_ENGINE_FRAME_HEADER = 8  # the Docker API's stream multiplexing header: kind, 3 pad, length
_STDERR_TAIL = 4096  # bytes of the server's own stderr kept for messages


class CallChannelError(RuntimeError):
    """The channel broke: the server died, the stream ended or was malformed."""


def server_command(
    writable: Sequence[str], call_uid: str = callserver.DEFAULT_CALL_UID, python: str = "python3"
) -> list[str]:
    """The container command that runs the call server from its source."""
    source = Path(callserver.__file__).read_text()
    flags = ["--call-uid", call_uid]
    for d in writable:
        flags += ["--writable", d]
    return [python, "-c", source, *flags]


W = TypeVar("W")  # a backend's warm sandbox (container or namespace)


@dataclass(frozen=True)
class Reply:
    """One call's outcome: what the agent sees, and whether the sandbox stays usable."""

    result: ExecResult
    reusable: bool
    error: str | None  # the server's or the channel's own failure, if any
    sent: bool = True  # False: the channel was broken before the request left (retry it)


def serve_once(
    acquire: Callable[[], W],
    channel_of: Callable[[W], CallChannel],
    settle: Callable[[W, Reply | None], None],
    call: Callable[[CallChannel], Reply],
    on_retry: Callable[[Reply], None] | None = None,
) -> Reply:
    """One call through a warm sandbox's call server, as both backends make it: take a
    warm sandbox (`acquire`), `call` its channel, then `settle` it with the reply (release
    it or retire it; None: the call raised, and it must go, neither idle nor kept); a
    request that never left (the server died while idle: `Reply.sent` false) is sent once
    more, through a fresh acquire."""
    for attempt in range(2):
        warm = acquire()
        try:
            reply = call(channel_of(warm))
        except BaseException:
            settle(warm, None)
            raise
        settle(warm, reply)
        if reply.sent or attempt:
            return reply
        if on_retry is not None:
            on_retry(reply)
    raise AssertionError("unreachable")


def exec_result(reply: Reply, note: bytes = b"") -> ExecResult:
    """What the agent sees of a reply: the call's result, `note` and the channel's or the
    server's own error appended to its stderr."""
    r = reply.result
    stderr = r.stderr + note
    if reply.error is not None:
        stderr += f"\n[sandbox: {reply.error}]".encode()
    return ExecResult(r.exit_code, r.stdout, stderr, r.timed_out, r.truncated, r.duration_s)


class CallChannel:
    """One call server's stdio, attached: one call at a time (not thread-safe)."""

    def __init__(
        self,
        sock: socket.socket,
        grace_s: float = 5.0,
        *,
        engine_frames: bool = True,
        stderr_tail: Callable[[], bytes] | None = None,
    ) -> None:
        """`sock` carries the server's stdio: with `engine_frames` (a container's attached
        stream) its stdout and stderr in the engine's frames, else its stdout alone (a
        socket that is the server's fd 1, as the bubblewrap backend gives it); then
        `stderr_tail` reads the tail of its stderr for messages."""
        self.sock = sock
        self.grace_s = grace_s
        self._ids = itertools.count(1)
        self._engine_frames = engine_frames
        self._stderr_tail = stderr_tail
        self._engine = bytearray()  # engine frames not yet split
        self._out = bytearray()  # the server's stdout: call server frames not yet parsed
        self._err = bytearray()  # the tail of the server's own stderr
        self._broken: str | None = None

    @property
    def server_stderr(self) -> str:
        err = self._stderr_tail() if self._stderr_tail is not None else bytes(self._err)
        return err.decode(errors="replace")

    def ping(self, timeout_s: float) -> Mapping[str, object]:
        """The server's description once it answers (a readiness check)."""
        request_id = next(self._ids)
        self._send(callserver.encode_request(callserver.Ping(request_id).header(), b""))
        frames = self._until_result(time.monotonic() + timeout_s)
        if frames is None:
            raise CallChannelError(self._broken or f"no answer to a ping in {timeout_s:g} s")
        result = callserver.Result.from_payload(frames[-1][1])
        if result.id != request_id or result.server is None:
            raise CallChannelError(f"a ping got {result}")
        return result.server

    def call(
        self,
        argv: Sequence[str],
        stdin: bytes,
        time_limit_s: float,
        output_cap: int,
        env: Mapping[str, str],
        cwd: str,
        fsize_bytes: int,
        memory_bytes: int = 0,
    ) -> Reply:
        """One call; `memory_bytes` its RLIMIT_AS (0: none, a container's memory limit
        bounds it)."""
        start = time.monotonic()
        request_id = next(self._ids)
        call = callserver.Call(
            id=request_id,
            argv=tuple(argv),
            time_limit_s=time_limit_s,
            output_cap=output_cap,
            cpu_s=int(time_limit_s) + 1,
            memory_bytes=memory_bytes,
            fsize_bytes=fsize_bytes,
            env=dict(env),
            cwd=cwd,
        )
        self._poll()  # a server that died while idle shows as the stream's end, here
        try:
            self._send(callserver.encode_request(call.header(), stdin))
        except CallChannelError as err:
            return self._failed(start, str(err), timed_out=False, sent=False)
        frames = self._until_result(start + time_limit_s + self.grace_s)
        if frames is None:
            timed_out = self._broken is None
            why = self._broken or f"no result {self.grace_s:g} s after the call's time limit"
            return self._failed(start, why, timed_out=timed_out)
        stdout, stderr = bytearray(), bytearray()
        for kind, payload in frames[:-1]:
            (stdout if kind == callserver.KIND_STDOUT else stderr).extend(payload)
        try:
            result = callserver.Result.from_payload(frames[-1][1])
        except ValueError as err:
            self._broken = f"a malformed result from the call server: {err}"
            return self._failed(start, self._broken, timed_out=False)
        if result.id != request_id:
            self._broken = f"result of request {result.id}, expected {request_id}"
            return self._failed(start, self._broken, timed_out=False)
        code = result.exit_code
        reusable = (
            result.error is None
            and result.clean
            and not (result.timed_out or result.truncated)
            and code is not None
            and code >= 0
        )
        return Reply(
            ExecResult(
                exit_code=code,
                stdout=bytes(stdout[:output_cap]),
                stderr=bytes(stderr[:output_cap]),
                timed_out=result.timed_out,
                truncated=result.truncated,
                duration_s=time.monotonic() - start,
            ),
            reusable,
            result.error,
        )

    def _failed(self, start: float, why: str, timed_out: bool, sent: bool = True) -> Reply:
        tail = self.server_stderr.strip()
        message = f"{why}; the call server said: {tail[-500:]}" if tail else why
        result = ExecResult(None, b"", b"", timed_out, False, time.monotonic() - start)
        return Reply(result, False, message, sent)

    def _poll(self) -> None:
        """Take in what the stream holds now without waiting (between calls: only its end
        or the server's stderr)."""
        self.sock.setblocking(False)
        with selectors.DefaultSelector() as sel:
            sel.register(self.sock, selectors.EVENT_READ)
            while self._broken is None and sel.select(timeout=0):
                before = len(self._engine) + len(self._out) + len(self._err)
                self._receive()
                if len(self._engine) + len(self._out) + len(self._err) == before:
                    break

    def _send(self, data: bytes) -> None:
        if self._broken is not None:
            raise CallChannelError(self._broken)
        try:
            self.sock.settimeout(self.grace_s)
            self.sock.sendall(data)
        except OSError as err:
            self._broken = f"cannot send to the call server: {err}"
            raise CallChannelError(self._broken) from err

    def _until_result(self, deadline: float) -> list[tuple[int, bytes]] | None:
        """Frames read until (and with) the next result frame; None at the deadline or
        when the stream breaks (`_broken` says why)."""
        frames: list[tuple[int, bytes]] = []
        self.sock.setblocking(False)
        with selectors.DefaultSelector() as sel:
            sel.register(self.sock, selectors.EVENT_READ)
            while True:
                try:
                    got = callserver.decode_frames(self._out)
                except ValueError as err:
                    self._broken = f"a malformed frame from the call server: {err}"
                    return None
                for frame in got:
                    frames.append(frame)
                    if frame[0] == callserver.KIND_RESULT:
                        return frames
                if self._broken is not None:
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    self._broken = self._broken or "deadline"
                    return None
                if sel.select(timeout=min(left, 0.5)):
                    self._receive()

    def _receive(self) -> None:
        try:
            chunk = self.sock.recv(1 << 16)
        except BlockingIOError:
            return
        except OSError as err:
            self._broken = f"the call server's stream failed: {err}"
            return
        if not chunk:
            self._broken = "the call server's stream ended (the server exited)"
            return
        if not self._engine_frames:
            self._out += chunk
            return
        self._engine += chunk
        while len(self._engine) >= _ENGINE_FRAME_HEADER:
            kind = self._engine[0]
            size = int.from_bytes(self._engine[4:8], "big")
            if len(self._engine) < _ENGINE_FRAME_HEADER + size:
                break
            payload = self._engine[_ENGINE_FRAME_HEADER : _ENGINE_FRAME_HEADER + size]
            del self._engine[: _ENGINE_FRAME_HEADER + size]
            if kind == 1:
                self._out += payload
            else:
                self._err += payload
                del self._err[:-_STDERR_TAIL]
