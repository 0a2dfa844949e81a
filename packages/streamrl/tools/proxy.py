"""A filtering proxy in front of the container engine's Docker API socket.

Whoever may talk to a root engine's socket is root on the host (a privileged container,
a bind mount of /). The tools service must not hold that socket, yet needs the engine for
its sandbox containers. `SandboxProxy` listens on its own unix socket (mode 0660 by
default, for the tools user's group) and forwards to the engine only the requests that
`streamrl.tools.containers.ContainerSandbox` makes, in the shape it makes them:

    request                                  allowed when
    GET|HEAD /_ping, GET /version            always (the SDK asks on connect)
    GET  /images/{image}/json                {image} is the sandbox image
    GET  /containers/json                    a label filter names streamrl.sandbox
    POST /containers/create                  the body passes CREATE and HOST_CONFIG (**)
    GET  /containers/{id}/json               {id} is a sandbox container (*)
    POST /containers/{id}/start|kill|stop|wait, DELETE /containers/{id}      (*)
    POST /containers/{id}/exec               (*) and the body passes EXEC_CREATE (**)
    POST /exec/{id}/start, GET /exec/{id}/json    {id} was created through this proxy

(*) a sandbox container: created through this proxy, or one the engine reports with the
`streamrl.sandbox` label and the sandbox image (so a restarted proxy still lets a tool
worker reap its predecessor's containers). The request then names the container by its
full id, so a name cannot be re-pointed between the check and the use.

Every tool worker of a compose stack is this socket's peer as the same uid, so the peer's
credentials cannot tell them apart (review N6). Each `ContainerSandbox` sends a random token
of its own (`OWNER_HEADER`) on every request; a container or exec is bound to the token of
the request that created it, and the routes that run code or carry a call's data (create,
start, attach, exec create/start/inspect: `proxy_rules.BOUND_ROUTES`) must carry that
token: no tool worker can exec into or attach to another's sandbox. The lifecycle routes
need none (a restarted worker, a new token, reaps its predecessor's containers), and a
container this proxy did not create is no one's for the bound routes.

Everything else is answered 403 with {"message": "... refused by the streamrl sandbox
proxy: <reason>"} (the docker SDK shows it) and logged with the reason. The rules (**) are
data, in `streamrl.tools.proxy_rules`, apart from this server: a body key not listed is
refused, whatever its value.

One request per connection: the request goes upstream with `Connection: close` and the
response comes back with it, so every request is validated on its own. An exec start that
upgrades the connection (`Upgrade: tcp`, the call's stdin and output) is validated, then
spliced both ways until the engine ends it; the client's half-close reaches the engine.
Request heads and bodies are bounded (`proxy_rules`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import grp
import json
import os
import select
import signal
import socket
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass
from urllib.parse import quote, urlencode

import structlog

from streamrl.jsontypes import JSON
from streamrl.run.tasks import cancel_and_wait
from streamrl.tools.containers import LABEL
from streamrl.tools.proxy_rules import (
    BOUND_ROUTES,
    FULL_ID,
    REFUSED,
    Allowed,
    ProxyConfig,
    Refused,
    Request,
    body_length,
    check_container,
    check_request,
    owner_token,
    parse_head,
)

_PEERCRED = struct.Struct("3i")  # pid, uid, gid of a unix socket's peer
# Request headers passed upstream; the proxy writes Host, Content-Length and Connection
# itself and drops the rest (hop-by-hop ones, credentials, anything the engine might act on).
_FORWARDED = ("user-agent", "accept", "accept-encoding", "content-type")
_CHUNK = 65536
_HANGUP_POLL_S = 0.05  # how often a half-closed exec stream checks that its client is there


# -- the server


class _Ids:
    """A bounded map of ids to their owner tokens, in insertion order (the oldest are
    forgotten first)."""

    def __init__(self, cap: int) -> None:
        self._ids: OrderedDict[str, str] = OrderedDict()
        self._cap = cap

    def add(self, key: str, owner: str) -> None:
        self._ids[key] = owner
        while len(self._ids) > self._cap:
            self._ids.popitem(last=False)

    def owner(self, key: str) -> str | None:
        """The token of the client that created `key`; None if this proxy did not."""
        return self._ids.get(key)

    def discard(self, key: str) -> None:
        self._ids.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def keep_only(self, live: set[str]) -> None:
        """Forget the ids not in `live`."""
        for key in [k for k in self._ids if k not in live]:
            del self._ids[key]


@dataclass(frozen=True)
class _Head:
    status: int
    raw: bytes  # the response head as the engine sent it
    headers: tuple[tuple[str, str], ...]


class SandboxProxy:
    """Serves `cfg.listen` until `stop` is set; see the module doc for what passes."""

    def __init__(self, cfg: ProxyConfig, log: structlog.stdlib.BoundLogger) -> None:
        self.cfg = cfg
        self.log = log.bind(component="sandbox_proxy")
        self.containers = _Ids(cfg.tracked_max)
        self.execs = _Ids(cfg.tracked_max)
        self._active = 0
        self._creating = 0  # container creates forwarded, not answered yet (the quota's)
        # asyncio's stream server drops its reference to a connection's task once the
        # client hangs up: held here, a task still relaying (or closing) is never collected
        # mid-await, and stop() ends those left.
        self._tasks: set[asyncio.Task[None]] = set()

    async def serve(self, stop: asyncio.Event) -> None:
        path = self.cfg.listen_path
        old = os.umask(0o777 & ~self.cfg.socket_mode)  # no window with a wider mode
        try:
            server = await asyncio.start_unix_server(
                self._client, path, limit=self.cfg.max_head_bytes
            )
        finally:
            os.umask(old)
        if self.cfg.socket_group is not None:
            g = self.cfg.socket_group
            os.chown(path, -1, int(g) if g.isdigit() else grp.getgrnam(g).gr_gid)
        os.chmod(path, self.cfg.socket_mode)
        self.log.info(
            "sandbox_proxy_start",
            listen=path,
            upstream=self.cfg.upstream_path,
            image=self.cfg.image,
            mode=f"{self.cfg.socket_mode:04o}",
        )
        try:
            async with server:
                await stop.wait()
        finally:
            await cancel_and_wait(list(self._tasks))
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            self.log.info("sandbox_proxy_stop")

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        self._active += 1
        peer = _peer(writer)
        start = time.monotonic()
        try:
            if self._active > self.cfg.max_connections:
                self.log.warning("sandbox_proxy_busy", active=self._active, **peer)
                await _answer(writer, 503, f"{REFUSED}: too many connections")
            else:
                await self._one(reader, writer, peer, start)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client or the engine left mid-request; nothing more to say
        except Exception:
            # A bug or an engine answer this proxy cannot read: this connection ends, the
            # proxy keeps serving, and the log says why.
            self.log.exception("sandbox_proxy_error", **peer)
        finally:
            self._active -= 1
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _one(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        peer: dict[str, int],
        start: float,
    ) -> None:
        req: Request | None = None
        try:
            try:
                async with asyncio.timeout(self.cfg.head_timeout_s):
                    head = await reader.readuntil(b"\r\n\r\n")
                    req = parse_head(head)
                    n = body_length(req, self.cfg.max_body_bytes)
                    req = dataclasses.replace(req, body=await reader.readexactly(n))
            except asyncio.LimitOverrunError:
                raise Refused(f"request head over {self.cfg.max_head_bytes} bytes", 431) from None
            except TimeoutError:
                raise Refused("request not received in time", 408) from None
            allowed = check_request(req, self.cfg)
            owner = owner_token(req, allowed.route)
            target = await self._resolve(allowed, owner)
            creating = allowed.route.name == "container_create"
            if creating:
                await self._reserve_create()
        except Refused as err:
            where = f"{req.method} {req.prefix}{req.path}"[:200] if req else "request"
            self.log.warning(
                "sandbox_proxy_refused", request=where, reason=err.reason, status=err.status, **peer
            )
            await _answer(writer, err.status, f"{where} {REFUSED}: {err.reason}")
            return
        try:
            status = await self._forward(req, allowed, target, owner, reader, writer)
        finally:
            if creating:
                self._creating -= 1
        self.log.debug(
            "sandbox_proxy_request",
            route=allowed.route.name,
            ref=target[:12],
            status=status,
            s=round(time.monotonic() - start, 4),
            **peer,
        )

    async def _reserve_create(self) -> None:
        """Count a create against `max_containers`, or refuse it (429). At the quota the
        proxy first forgets the containers the engine no longer has (removed past it, or
        by the engine itself)."""
        quota = self.cfg.max_containers
        if len(self.containers) + self._creating >= quota:
            filters = quote(json.dumps({"label": [LABEL]}))
            status, found = await self._upstream_json(
                "GET", f"/containers/json?all=1&filters={filters}"
            )
            if status == 200 and isinstance(found, list):
                self.containers.keep_only(
                    {str(c.get("Id", "")) for c in found if isinstance(c, dict)}
                )
        if len(self.containers) + self._creating >= quota:
            raise Refused(f"{quota} sandbox containers are live (the proxy's quota)", 429)
        self._creating += 1

    async def _resolve(self, allowed: Allowed, owner: str) -> str:
        """The full id of the object the request names, once it is a sandbox object and,
        for a bound route, the object of the client whose `owner` token it carries."""
        kind, ref = allowed.route.target, allowed.ref
        bound = allowed.route.name in BOUND_ROUTES
        if kind == "exec":
            if ref not in self.execs:
                raise Refused(f"exec {ref[:64]} was not created through this proxy")
            if bound and self.execs.owner(ref) != owner:
                raise Refused(f"exec {ref[:12]} is another client's exec")
            return ref
        if kind != "container":
            return ref
        if ref in self.containers:
            if bound and self.containers.owner(ref) != owner:
                raise Refused(f"container {ref[:12]} is another client's sandbox")
            return ref
        status, info = await self._upstream_json("GET", f"/containers/{ref}/json")
        if status == 404:
            raise Refused(f"no such container: {ref}", 404)
        full_id = info.get("Id", "") if isinstance(info, dict) else None
        if (
            status != 200
            or not isinstance(info, dict)
            or not isinstance(full_id, str)
            or not FULL_ID.match(full_id)
        ):
            raise Refused(f"the engine could not inspect {ref} (status {status})", 502)
        fault = check_container(info, self.cfg)
        if fault:
            raise Refused(f"container {ref} is not a sandbox container: {fault}")
        if bound:  # a sandbox container this proxy did not make: no one's to use
            raise Refused(
                f"container {ref[:64]} is another client's sandbox (or was created before "
                "this proxy started): only its removal passes"
            )
        return str(info["Id"])

    async def _forward(
        self,
        req: Request,
        allowed: Allowed,
        target: str,
        owner: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> int:
        """Send the request upstream and relay the answer; returns the engine's status. What
        a create makes is bound to `owner`."""
        route = allowed.route
        start, end = allowed.span
        path = req.path[:start] + target + req.path[end:] if target else req.path
        try:
            up_reader, up_writer = await asyncio.open_unix_connection(
                self.cfg.upstream_path, limit=self.cfg.max_head_bytes
            )
        except OSError as err:
            await _answer(writer, 502, f"{REFUSED}: the engine does not answer: {err}")
            return 502
        try:
            up_writer.write(_request_bytes(req, req.prefix + path, req.upgrade))
            await up_writer.drain()
            head = await _read_head(up_reader)
            if head.status == 101 and route.upgrade:
                writer.write(head.raw)
                if await _splice(reader, writer, up_reader, up_writer, self.cfg.stream_idle_s):
                    self.log.warning(
                        "sandbox_proxy_stream_idle", route=route.name, ref=target[:12],
                        idle_s=self.cfg.stream_idle_s,
                    )  # fmt: skip
                return 101
            if route.name in ("container_create", "exec_create") and head.status == 201:
                await self._relay_created(route.name, head, up_reader, writer, owner)
            else:
                writer.write(_closing_head(head))
                await _copy(up_reader, writer, _content_length(head))
            if route.name == "container_remove" and head.status in (200, 204, 404):
                self.containers.discard(target)
            return head.status
        finally:
            up_writer.close()
            with contextlib.suppress(ConnectionError):
                await up_writer.wait_closed()

    async def _relay_created(
        self,
        name: str,
        head: _Head,
        up: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        owner: str,
    ) -> None:
        """Pass on a create's answer, remembering the id it made and its owner."""
        length = _content_length(head)
        raw = await _read_all(
            up,
            min(length, self.cfg.max_response_capture_bytes)
            if length
            else self.cfg.max_response_capture_bytes,
        )
        body = _dechunk(raw) if _chunked(head) else raw
        new_id = ""
        with contextlib.suppress(ValueError, AttributeError):
            new_id = str(json.loads(body).get("Id", ""))
        if FULL_ID.match(new_id):
            (self.containers if name == "container_create" else self.execs).add(new_id, owner)
            if name == "container_create":
                self.log.info("sandbox_proxy_container_created", id=new_id[:12])
        writer.write(_closing_head(head) + raw)
        await writer.drain()

    async def _upstream_json(self, method: str, path: str) -> tuple[int, JSON]:
        """One request of the proxy's own to the engine (an inspect): status and JSON."""
        try:
            r, w = await asyncio.open_unix_connection(self.cfg.upstream_path)
        except OSError as err:
            raise Refused(f"the engine does not answer: {err}", 502) from err
        try:
            w.write(
                f"{method} {path} HTTP/1.1\r\nHost: docker\r\nConnection: close\r\n\r\n".encode()
            )
            await w.drain()
            head = await _read_head(r)
            raw = await _read_all(r, self.cfg.max_response_capture_bytes)
        finally:
            w.close()
            with contextlib.suppress(ConnectionError):
                await w.wait_closed()
        body = _dechunk(raw) if _chunked(head) else raw
        try:
            return head.status, json.loads(body)
        except ValueError:
            return head.status, None


def _request_bytes(req: Request, target: str, upgrade: bool) -> bytes:
    query = f"?{urlencode(req.query)}" if req.query else ""
    lines = [f"{req.method} {target}{query} HTTP/1.1", "Host: docker"]
    lines += [f"{k}: {v}" for k, v in req.headers if k in _FORWARDED]
    if req.body or req.method in ("POST", "PUT"):
        lines.append(f"Content-Length: {len(req.body)}")
    lines += ["Connection: Upgrade", "Upgrade: tcp"] if upgrade else ["Connection: close"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("ascii") + req.body


async def _read_head(reader: asyncio.StreamReader) -> _Head:
    raw = await reader.readuntil(b"\r\n\r\n")
    lines = raw.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    headers = []
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers.append((name.strip().lower(), value.strip()))
    return _Head(int(parts[1]), raw, tuple(headers))


def _closing_head(head: _Head) -> bytes:
    """The response head with `Connection: close` (this connection serves one request)."""
    lines = head.raw.decode("latin-1").removesuffix("\r\n\r\n").split("\r\n")
    kept = [lines[0]] + [
        ln
        for ln in lines[1:]
        if ln.partition(":")[0].strip().lower() not in ("connection", "keep-alive")
    ]
    return ("\r\n".join([*kept, "Connection: close"]) + "\r\n\r\n").encode("latin-1")


def _content_length(head: _Head) -> int | None:
    if _chunked(head):
        return None
    values = [v for k, v in head.headers if k == "content-length"]
    return int(values[0]) if values and values[0].isdigit() else None


def _chunked(head: _Head) -> bool:
    return any(k == "transfer-encoding" and "chunked" in v.lower() for k, v in head.headers)


def _dechunk(raw: bytes) -> bytes:
    out = bytearray()
    while raw:
        size_line, _, rest = raw.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out += rest[:size]
        raw = rest[size + 2 :]
    return bytes(out)


async def _read_all(src: asyncio.StreamReader, cap: int) -> bytes:
    """Up to `cap` bytes, until the engine closes the connection."""
    out = bytearray()
    while len(out) < cap and (chunk := await src.read(min(_CHUNK, cap - len(out)))):
        out += chunk
    return bytes(out)


async def _copy(
    src: asyncio.StreamReader,
    dst: asyncio.StreamWriter,
    length: int | None,
    seen: list[float] | None = None,
) -> None:
    """Copy `length` bytes (None: until the engine closes) from src to dst; `seen[0]`:
    the monotonic time bytes last moved."""
    left = length
    while left is None or left > 0:
        chunk = await src.read(_CHUNK if left is None else min(_CHUNK, left))
        if not chunk:
            break
        dst.write(chunk)
        await dst.drain()
        if seen is not None:
            seen[0] = time.monotonic()
        if left is not None:
            left -= len(chunk)


async def _idle(seen: list[float], idle_s: float) -> None:
    """Returns once no byte has moved for `idle_s` (`seen[0]`: when one last did)."""
    while True:
        left = seen[0] + idle_s - time.monotonic()
        if left <= 0:
            return
        await asyncio.sleep(left)


async def _splice(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    up_reader: asyncio.StreamReader,
    up_writer: asyncio.StreamWriter,
    idle_s: float,
) -> bool:
    """Bytes both ways until the engine ends the stream or the client is gone, or no
    byte moved either way for `idle_s` (returns True then: review N6, held streams used to
    pile up against max_connections). The client's half-close (its stdin is done) is
    passed on; the call's output still flows. A client that closed for good (the sandbox
    gave up on a call past its time limit) closes the engine's side too, as it would have
    without the proxy."""
    seen = [time.monotonic()]

    async def to_engine() -> bool:
        try:
            await _copy(reader, up_writer, None, seen)
            if up_writer.can_write_eof():
                up_writer.write_eof()
        except (ConnectionError, OSError):
            return False
        return True

    async def to_client() -> None:
        with contextlib.suppress(ConnectionError, OSError):
            await _copy(up_reader, writer, None, seen)

    tasks = [asyncio.create_task(to_engine()), asyncio.create_task(to_client())]
    up, down = tasks
    idle = asyncio.create_task(_idle(seen, idle_s))
    try:
        await asyncio.wait([*tasks, idle], return_when=asyncio.FIRST_COMPLETED)
        if not idle.done() and not down.done() and up.done() and up.result():
            # EOF: a half-close, or the client is gone
            tasks.append(asyncio.create_task(_hung_up(writer)))
            await asyncio.wait([*tasks[1:], idle], return_when=asyncio.FIRST_COMPLETED)
        return idle.done() and not down.done()
    finally:
        await cancel_and_wait([*tasks, idle])


async def _hung_up(writer: asyncio.StreamWriter) -> None:
    """Returns once the client has closed both directions. A unix socket reports POLLHUP
    only then, not after the peer's shutdown(SHUT_WR), which reads as EOF just the same."""
    poller = select.poll()
    poller.register(writer.get_extra_info("socket").fileno(), select.POLLHUP)
    while not poller.poll(0):
        await asyncio.sleep(_HANGUP_POLL_S)


async def _answer(writer: asyncio.StreamWriter, status: int, message: str) -> None:
    body = json.dumps({"message": message}).encode()
    reasons = {
        400: "Bad Request",
        403: "Forbidden",
        404: "Not Found",
        408: "Request Timeout",
        413: "Content Too Large",
        417: "Expectation Failed",
        431: "Request Header Fields Too Large",
        502: "Bad Gateway",
        503: "Service Unavailable",
    }
    head = (
        f"HTTP/1.1 {status} {reasons.get(status, 'Error')}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    with contextlib.suppress(ConnectionError):
        writer.write(head.encode() + body)
        await writer.drain()


def _peer(writer: asyncio.StreamWriter) -> dict[str, int]:
    """pid, uid and gid of the client (SO_PEERCRED), for the log."""
    sock = writer.get_extra_info("socket")
    try:
        pid, uid, gid = _PEERCRED.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
        )
    except (OSError, AttributeError):
        return {}
    return {"peer_pid": pid, "peer_uid": uid, "peer_gid": gid}


def run(cfg: ProxyConfig, log: structlog.stdlib.BoundLogger) -> int:
    """Serve until SIGTERM or SIGINT; returns the exit status."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await SandboxProxy(cfg, log).serve(stop)

    asyncio.run(main())
    return 0
