"""The sandbox proxy's rules: which Docker API requests pass, as pure functions of the request
(and, for a container named by id, of what the engine says of it). The server that applies
them is `streamrl.tools.proxy`, whose module doc lists the requests allowed; a security
review reads the policy here, apart from the socket code.

The rules are data: a body key not listed is refused, whatever its value. JSON keys are
checked case-exactly and a key that repeats (in any letter case) is refused, since the
engine's Go decoder matches keys case-insensitively and keeps the last. Request heads and
bodies are bounded; `Transfer-Encoding` on a request is refused (the docker SDK always sends
`Content-Length`).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn
from urllib.parse import parse_qsl

from streamrl.tools import callserver
from streamrl.tools.containers import (
    DEFAULT_IMAGE,
    LABEL,
    LABEL_CREATED,
    LABEL_OWNER,
    LABEL_WORKER,
    OWNER_HEADER,
    WORKDIR,
)

REFUSED = "refused by the streamrl sandbox proxy"
_VERSION_PREFIX = re.compile(r"^/v\d+\.\d+(?=/)")
_PATH_OK = re.compile(r"^/[A-Za-z0-9/_.:@+-]*$")
_REF = r"(?P<ref>[A-Za-z0-9][A-Za-z0-9_.-]{0,127})"
FULL_ID = re.compile(r"^[0-9a-f]{64}$")
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")  # an HTTP header name
_USER = re.compile(r"^(\d+):(\d+)$")
_NAME = re.compile(r"^streamrl-[A-Za-z0-9_.-]{1,100}$")
ROOT = "0:0"  # the call server's user: it drops each call to the call uid
SERVER_CAPS = frozenset({"SETUID", "SETGID", "KILL"})  # what the call server may add
# Routes that run code in a sandbox or carry a call's data: bound to the owner token of the
# client that created the container or exec (review N6). The lifecycle routes (inspect,
# list, wait, kill, stop, remove) stay open to every client: a restarted tool worker reaps
# the containers its predecessor (another token) left.
BOUND_ROUTES = frozenset(
    {"container_create", "container_start", "container_attach", "exec_create", "exec_start",
     "exec_inspect"}
)  # fmt: skip
_OWNER_TOKEN = re.compile(r"^[0-9a-f]{32,128}$")  # 128 bits or more, hex


class Refused(Exception):
    """A request the proxy will not forward; `reason` ends the client's message."""

    def __init__(self, reason: str, status: int = 403) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status


@dataclass(frozen=True)
class ProxyConfig:
    """What the proxy listens on, forwards to and allows. Sizes bytes, times seconds."""

    upstream: str  # the engine's socket: unix:///path
    listen: str  # this proxy's socket: unix:///path
    image: str = DEFAULT_IMAGE  # the only image a container may be created from
    socket_mode: int = 0o660  # of the listening socket
    socket_group: str | None = None  # group name or gid given the listening socket
    max_head_bytes: int = 64 * 2**10  # request line and headers of one request
    max_body_bytes: int = 2**20  # one request body
    max_response_capture_bytes: int = 2**20  # a create response read to learn the new id
    max_memory_bytes: int = 16 * 2**30  # HostConfig.Memory of one container
    max_pids: int = 4096  # HostConfig.PidsLimit of one container
    max_cpus: float = 64.0  # HostConfig.NanoCpus / 1e9 of one container
    max_connections: int = 512  # open client connections; more get 503
    # Live containers created through this proxy (less those removed through it; checked
    # against the engine when the count reaches it): one more create is refused (429).
    max_containers: int = 256
    # An exec or attach stream that moves no byte either way this long is closed (a call
    # server's stream then ends with it: its container is recycled at its next call).
    stream_idle_s: float = 3600.0
    head_timeout_s: float = 30.0  # to receive one request's head and body
    tracked_max: int = 100_000  # container and exec ids remembered (oldest forgotten)

    def __post_init__(self) -> None:
        for url in (self.upstream, self.listen):
            if not url.startswith("unix:///"):
                raise ValueError(f"{url!r}: only unix:///path sockets are supported")
        if not 0 <= self.socket_mode <= 0o777:
            raise ValueError(f"socket_mode {self.socket_mode:o} is not a permission mode")
        if self.max_memory_bytes < 16 * 2**20 or self.max_pids < 8 or self.max_cpus <= 0:
            raise ValueError("max_memory_bytes must be >= 16 MiB, max_pids >= 8, max_cpus > 0")
        if self.max_containers < 1 or self.stream_idle_s <= 0:
            raise ValueError("max_containers must be >= 1 and stream_idle_s > 0")

    @property
    def upstream_path(self) -> str:
        return self.upstream.removeprefix("unix://")

    @property
    def listen_path(self) -> str:
        return self.listen.removeprefix("unix://")


# -- requests


@dataclass(frozen=True)
class Request:
    """One parsed client request. `path` is without its API version prefix."""

    method: str
    prefix: str  # "/v1.41" or ""
    path: str
    query: tuple[tuple[str, str], ...]
    headers: tuple[tuple[str, str], ...]  # names lower-cased, in order
    body: bytes = b""

    def header(self, name: str) -> str | None:
        values = [v for k, v in self.headers if k == name]
        if len(values) > 1:
            raise Refused(f"header {name} repeats", 400)
        return values[0] if values else None

    @property
    def upgrade(self) -> bool:
        conn = (self.header("connection") or "").lower()
        return "upgrade" in [t.strip() for t in conn.split(",")]


def parse_head(head: bytes) -> Request:
    """The request line and headers (up to the blank line); the body is read later."""
    try:
        text = head.decode("ascii")
    except UnicodeDecodeError:
        raise Refused("the request head is not ASCII", 400) from None
    line, *fields = text.removesuffix("\r\n\r\n").split("\r\n")
    for f in (line, *fields):
        # Review N17: a bare LF (a line end to some parsers) or another control character
        # in a line would reach the engine as it came; a tab is the one a value may hold.
        if _CONTROL.search(f):
            raise Refused(f"a control character in the request head: {f[:100]!r}", 400)
    parts = line.split(" ")
    if len(parts) != 3 or parts[2] not in ("HTTP/1.1", "HTTP/1.0"):
        raise Refused(f"bad request line {line[:100]!r}", 400)
    method, target, _ = parts
    headers = []
    for f in fields:
        name, sep, value = f.partition(":")
        if not sep or not _TOKEN.match(name):
            raise Refused(f"bad header line {f[:100]!r}", 400)
        headers.append((name.lower(), value.strip()))
    path, _, raw_query = target.partition("?")
    if not _PATH_OK.match(path) or "/." in path or "//" in path:
        raise Refused(f"path {path[:100]!r} has characters or segments the API never uses")
    prefix = m.group(0) if (m := _VERSION_PREFIX.match(path)) else ""
    query = tuple(parse_qsl(raw_query, keep_blank_values=True))
    keys = [k for k, _ in query]
    if len(set(keys)) != len(keys):
        raise Refused("a query parameter repeats")
    return Request(method, prefix, path[len(prefix) :], query, tuple(headers))


def body_length(req: Request, max_body: int) -> int:
    """How many body bytes follow the head; refuses what the proxy does not frame."""
    if req.header("transfer-encoding") is not None:
        raise Refused("Transfer-Encoding on a request is not accepted; send Content-Length")
    if (req.header("content-encoding") or "identity").lower() != "identity":
        raise Refused("compressed request bodies are not accepted")
    if req.header("expect") is not None:
        raise Refused("Expect is not supported", 417)
    raw = req.header("content-length") or "0"
    if not raw.isdigit():
        raise Refused(f"bad Content-Length {raw[:30]!r}", 400)
    if int(raw) > max_body:
        raise Refused(f"the body ({raw} bytes) is over the {max_body} byte limit", 413)
    return int(raw)


# -- the rules, as data

Check = Callable[[object, ProxyConfig], str | None]  # a value's fault, or None when it passes


@dataclass(frozen=True)
class Field:
    """One allowed key of a JSON object: its check and whether it must be present."""

    check: Check
    required: bool = False


def _is(expected: object) -> Check:
    return lambda v, _: (
        None if v == expected and type(v) is type(expected) else (f"must be {json.dumps(expected)}")
    )


def _bool(v: object, _: ProxyConfig) -> str | None:
    return None if isinstance(v, bool) else "must be true or false"


def _str_list(v: object, _: ProxyConfig) -> str | None:
    ok = isinstance(v, list) and all(isinstance(s, str) for s in v)
    return None if ok else "must be a list of strings"


def _argv(v: object, cfg: ProxyConfig) -> str | None:
    return _str_list(v, cfg) or (None if v else "must not be empty")


def _abs_path(v: object, _: ProxyConfig) -> str | None:
    ok = isinstance(v, str) and v.startswith("/") and ".." not in v.split("/")
    return None if ok else "must be an absolute path"


def _user(v: object, cfg: ProxyConfig) -> str | None:
    """A create's User: non-root, or exactly "0:0" (then only for the call server, which
    `_check_call_server` checks across the body's fields)."""
    return None if v == ROOT else _non_root(v, cfg)


def _server_caps(v: object, cfg: ProxyConfig) -> str | None:
    ok = isinstance(v, list) and _str_list(v, cfg) is None and set(v) <= SERVER_CAPS
    return None if ok else f"may only add {sorted(SERVER_CAPS)} (for the call server)"


def _non_root(v: object, _: ProxyConfig) -> str | None:
    m = _USER.match(v) if isinstance(v, str) else None
    if m is None:
        return "must be a numeric uid:gid (a name could resolve to root in the image)"
    return None if int(m[1]) > 0 and int(m[2]) > 0 else "must not be root (uid 0 or gid 0)"


def _int_in(low: int, high: Callable[[ProxyConfig], int]) -> Check:
    def check(v: object, cfg: ProxyConfig) -> str | None:
        top = high(cfg)
        ok = isinstance(v, int) and not isinstance(v, bool) and low <= v <= top
        return None if ok else f"must be an integer in [{low}, {top}]"

    return check


def _sandbox_image(v: object, cfg: ProxyConfig) -> str | None:
    return None if v in image_names(cfg.image) else f"must be the sandbox image {cfg.image!r}"


def _sandbox_labels(v: object, _: ProxyConfig) -> str | None:
    if not isinstance(v, dict) or not all(isinstance(x, str) for x in (*v, *v.values())):
        return "must map strings to strings"
    missing = [k for k in (LABEL, LABEL_WORKER, LABEL_OWNER, LABEL_CREATED) if k not in v]
    return f"must carry the sandbox labels; missing {missing}" if missing else None


def _drops_all(v: object, cfg: ProxyConfig) -> str | None:
    ok = isinstance(v, list) and _str_list(v, cfg) is None and "all" in [c.lower() for c in v]
    return None if ok else 'must drop "ALL" capabilities'


_NO_NEW_PRIVILEGES = ("no-new-privileges", "no-new-privileges:true", "no-new-privileges=true")


def _security_opt(v: object, cfg: ProxyConfig) -> str | None:
    ok = (
        isinstance(v, list)
        and _str_list(v, cfg) is None
        and v
        and all(o in _NO_NEW_PRIVILEGES for o in v)
    )
    return None if ok else 'must be exactly ["no-new-privileges"]'


_ULIMIT = {
    "Name": Field(
        lambda v, _: None if v in ("core", "nofile", "nproc") else "is not allowed", True
    ),
    "Soft": Field(_int_in(0, lambda _: 2**20), True),
    "Hard": Field(_int_in(0, lambda _: 2**20), True),
}


def _ulimits(v: object, cfg: ProxyConfig) -> str | None:
    if not isinstance(v, list):
        return "must be a list"
    for i, u in enumerate(v):
        if not isinstance(u, dict):
            return f"[{i}] must be an object"
        fault = check_object(u, _ULIMIT, cfg)
        if fault:
            return f"[{i}].{fault}"
    return None


TMPFS_PATHS = frozenset({"/tmp", WORKDIR})  # where the sandbox mounts its tmpfs
_TMPFS_NEEDED = frozenset({"nosuid", "nodev", "noexec"})
_TMPFS_OPTION = re.compile(r"^(rw|nosuid|nodev|noexec|size=\d+[kmg]?)$")


def _tmpfs(v: object, _: ProxyConfig) -> str | None:
    if not isinstance(v, dict):
        return "must map mount points to options"
    for path, opts in v.items():
        if path not in TMPFS_PATHS:
            return f"mounts {path!r}; only {sorted(TMPFS_PATHS)} may be tmpfs"
        options = opts.split(",") if isinstance(opts, str) else []
        if not options or not all(_TMPFS_OPTION.match(o) for o in options):
            return f"options for {path} must be from rw,nosuid,nodev,noexec,size="
        if not set(options) >= _TMPFS_NEEDED or not any(o.startswith("size=") for o in options):
            return f"options for {path} must hold nosuid,nodev,noexec and a size"
    return None


# HostConfig of a create body. Not listed, so refused: Privileged, Binds, Mounts,
# VolumesFrom, Devices, DeviceRequests, CapAdd, PidMode, IpcMode, UTSMode, UsernsMode,
# CgroupnsMode, Cgroup, Runtime, Sysctls, PortBindings, Links, ExtraHosts, ...
HOST_CONFIG: Mapping[str, Field] = {
    "NetworkMode": Field(_is("none"), required=True),
    "ReadonlyRootfs": Field(_is(True), required=True),
    "CapDrop": Field(_drops_all, required=True),
    "SecurityOpt": Field(_security_opt, required=True),
    "Memory": Field(_int_in(2**20, lambda cfg: cfg.max_memory_bytes), required=True),
    "MemorySwap": Field(_int_in(2**20, lambda cfg: cfg.max_memory_bytes), required=True),
    "PidsLimit": Field(_int_in(1, lambda cfg: cfg.max_pids), required=True),
    "NanoCpus": Field(_int_in(1, lambda cfg: int(cfg.max_cpus * 1e9)), required=True),
    "Init": Field(_bool),
    "Ulimits": Field(_ulimits),
    "Tmpfs": Field(_tmpfs),
    "CapAdd": Field(_server_caps),
}


_SIZE_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}


def _tmpfs_bytes(tmpfs: Mapping[str, str]) -> int:
    """The sizes of the (already checked) tmpfs mounts, added up."""
    total = 0
    for opts in tmpfs.values():
        for o in opts.split(","):
            if o.startswith("size="):
                digits = o[5:].rstrip("kmg")
                total += int(digits) * _SIZE_UNITS[o[5 + len(digits) :]]
    return total


def check_host_config(value: object, cfg: ProxyConfig) -> str | None:
    if not isinstance(value, dict):
        return "must be an object"
    fault = check_object(value, HOST_CONFIG, cfg)
    if not fault and value["MemorySwap"] != value["Memory"]:
        fault = "MemorySwap must equal Memory (no swap)"
    if not fault and (tmpfs := _tmpfs_bytes(value.get("Tmpfs") or {})) > value["Memory"]:
        # Review N6: tmpfs pages are the container's memory; mounts larger than it only
        # move the limit from the mount to the kernel's OOM killer.
        fault = (
            f"Tmpfs sizes add up to {tmpfs // 2**20} MiB, more than Memory "
            f"({value['Memory'] // 2**20} MiB)"
        )
    return f".{fault}" if fault else None


# The top level of a create body: what ContainerSandbox._run_options makes the SDK send.
CREATE: Mapping[str, Field] = {
    "Image": Field(_sandbox_image, required=True),
    "User": Field(_user, required=True),
    "Labels": Field(_sandbox_labels, required=True),
    "HostConfig": Field(check_host_config, required=True),
    "Cmd": Field(_argv),
    "WorkingDir": Field(_abs_path),
    "Tty": Field(_bool),
    "OpenStdin": Field(_bool),
    "StdinOnce": Field(_bool),
    "AttachStdin": Field(_bool),
    "AttachStdout": Field(_bool),
    "AttachStderr": Field(_bool),
    "NetworkDisabled": Field(_bool),  # the SDK always sends it; NetworkMode is the control
}

# An exec in a sandbox container: what ContainerSandbox._begin sends.
EXEC_CREATE: Mapping[str, Field] = {
    "User": Field(_non_root, required=True),
    "Privileged": Field(_is(False)),
    "Cmd": Field(_argv, required=True),
    "Container": Field(lambda v, _: None if isinstance(v, str) else "must be a string"),
    "Env": Field(_str_list),
    "WorkingDir": Field(_abs_path),
    "Tty": Field(_bool),
    "AttachStdin": Field(_bool),
    "AttachStdout": Field(_bool),
    "AttachStderr": Field(_bool),
}

EXEC_START: Mapping[str, Field] = {"Tty": Field(_is(False)), "Detach": Field(_bool)}


def check_object(value: object, fields: Mapping[str, Field], cfg: ProxyConfig) -> str:
    """The first fault of a JSON object against its fields, as "Key fault" or
    "Key.Sub fault" ('' when it passes)."""
    if not isinstance(value, dict):
        return "the body must be a JSON object"
    for key, val in value.items():
        rule = fields.get(key)
        if rule is None:
            return f"{key} is not allowed"
        fault = rule.check(val, cfg)
        if fault:
            return f"{key}{fault}" if fault[0] in ".[" else f"{key} {fault}"
    missing = [k for k, f in fields.items() if f.required and k not in value]
    return f"{missing[0]} is required" if missing else ""


def parse_json_body(body: bytes) -> object:
    """A request body as JSON; refuses repeated keys (in any letter case) and NaN."""

    def pairs(items: list[tuple[str, object]]) -> dict[str, object]:
        folded = [k.casefold() for k, _ in items]
        if len(set(folded)) != len(folded):
            raise Refused("a JSON key repeats (the engine matches keys in any case)")
        return dict(items)

    def constant(name: str) -> NoReturn:
        raise Refused(f"{name} is not JSON")

    try:
        return json.loads(body, object_pairs_hook=pairs, parse_constant=constant)
    except (ValueError, RecursionError):
        raise Refused("the body is not JSON") from None


def image_names(image: str) -> set[str]:
    """Names the engine may report for `image` (podman qualifies short names)."""
    first = image.split("/", 1)[0]
    qualified = "/" in image and ("." in first or ":" in first or first == "localhost")
    return {image} if qualified else {image, f"localhost/{image}"}


@dataclass(frozen=True)
class Route:
    """One allowed endpoint: method, path (its `ref` group names the object), allowed
    query keys, the object `ref` must be ("" none, "container", "exec"), and the body."""

    name: str
    method: str
    pattern: re.Pattern[str]
    query: frozenset[str] = frozenset()
    target: str = ""
    body: Mapping[str, Field] | None = None  # None: no body
    upgrade: bool = False


def _r(
    name: str,
    method: str,
    path: str,
    *query: str,
    target: str = "",
    body: Mapping[str, Field] | None = None,
    upgrade: bool = False,
) -> Route:
    pattern = re.compile(path.replace("{ref}", _REF))
    return Route(name, method, pattern, frozenset(query), target, body, upgrade)


_LIST_QUERY = ("all", "limit", "size", "trunc_cmd", "filters", "since", "before")
_ATTACH_QUERY = ("stdin", "stdout", "stderr", "stream")
ROUTES: tuple[Route, ...] = (
    _r("ping", "GET", "/_ping"),
    _r("ping", "HEAD", "/_ping"),
    _r("version", "GET", "/version"),
    _r("image_inspect", "GET", r"/images/(?P<image>[A-Za-z0-9/_.:@-]+)/json"),
    _r("container_list", "GET", "/containers/json", *_LIST_QUERY),
    _r("container_create", "POST", "/containers/create", "name", body=CREATE),
    _r("container_inspect", "GET", "/containers/{ref}/json", "size", target="container"),
    _r("container_start", "POST", "/containers/{ref}/start", target="container"),
    _r("container_kill", "POST", "/containers/{ref}/kill", "signal", target="container"),
    _r("container_stop", "POST", "/containers/{ref}/stop", "t", target="container"),
    _r("container_wait", "POST", "/containers/{ref}/wait", "condition", target="container"),
    _r("container_remove", "DELETE", "/containers/{ref}", "v", "force", "link", target="container"),
    # The call server's stdio (tools.call_server): the one stream to a sandbox's main process.
    _r(
        "container_attach",
        "POST",
        "/containers/{ref}/attach",
        *_ATTACH_QUERY,
        target="container",
        upgrade=True,
    ),
    _r("exec_create", "POST", "/containers/{ref}/exec", target="container", body=EXEC_CREATE),
    _r("exec_start", "POST", "/exec/{ref}/start", target="exec", body=EXEC_START, upgrade=True),
    _r("exec_inspect", "GET", "/exec/{ref}/json", target="exec"),
)


@dataclass(frozen=True)
class Allowed:
    """A request that passed the rules; `ref` still has to be a sandbox object."""

    route: Route
    ref: str  # the container or exec the path names ("" when none)
    span: tuple[int, int] = (0, 0)  # where `ref` is in the request's path


def check_request(req: Request, cfg: ProxyConfig) -> Allowed:
    """Match `req` (body included) against ROUTES and their rules; raises `Refused`."""
    route, m = _match(req)
    if req.upgrade and not route.upgrade:
        raise Refused(f"{route.name} may not upgrade the connection")
    extra = sorted({k for k, _ in req.query} - route.query)
    if extra:
        raise Refused(f"query parameters {extra} are not allowed on {route.name}")
    query = dict(req.query)
    if route.name == "image_inspect" and m["image"] not in image_names(cfg.image):
        raise Refused(f"only the sandbox image {cfg.image!r} may be inspected")
    if route.name == "container_list":
        _check_list_filters(query.get("filters", ""))
    name = query.get("name")
    if route.name == "container_create" and name is not None and not _NAME.match(name):
        raise Refused(f"a container name must match {_NAME.pattern}")
    if route.body is None:
        if req.body:
            raise Refused(f"{route.name} takes no body")
    else:
        body = parse_json_body(req.body)
        fault = check_object(body, route.body, cfg)
        if not fault and route.name == "container_create" and isinstance(body, dict):
            fault = _check_call_server(body, cfg)
        if fault:
            raise Refused(fault if route.name != "container_create" else f"create: {fault}")
    if "ref" not in route.pattern.groupindex:
        return Allowed(route, "")
    ref = m["ref"]
    if route.name == "exec_create" and json.loads(req.body).get("Container", ref) != ref:
        raise Refused("the body's Container differs from the path's")
    return Allowed(route, ref, m.span("ref"))


def owner_token(req: Request, route: Route) -> str:
    """The owner token a bound route must carry ('' for the open routes); raises `Refused`
    when it is missing or not one (a random hex string of 128 bits or more)."""
    if route.name not in BOUND_ROUTES:
        return ""
    token = req.header(OWNER_HEADER.lower())
    if token is None or not _OWNER_TOKEN.match(token):
        raise Refused(
            f"{route.name} needs the {OWNER_HEADER} header (a random token of 32 to 128 hex "
            "digits, one per sandbox: what binds its containers to it)"
        )
    return token


def _match(req: Request) -> tuple[Route, re.Match[str]]:
    for route in ROUTES:
        m = route.pattern.fullmatch(req.path)
        if m and route.method == req.method:
            return route, m
    raise Refused(f"{req.method} {req.path[:100]} is not a request the container sandbox makes")


def _check_call_server(body: Mapping[str, object], cfg: ProxyConfig) -> str:
    """A container that runs as root or adds capabilities must be the call server: its
    command exactly `python3 -c <this streamrl's callserver.py>` with only the server's
    flags (a non-root call uid, absolute writable dirs), root with only SERVER_CAPS.
    '' when the body passes."""
    host = body.get("HostConfig")
    caps = host.get("CapAdd") if isinstance(host, dict) else None
    if body.get("User") != ROOT and not caps:
        return ""
    cmd = body.get("Cmd")
    if not isinstance(cmd, list) or cmd[:3] != ["python3", "-c", _server_source()]:
        return "User 0:0 and CapAdd are only for the call server's own command"
    flags = cmd[3:]
    if len(flags) % 2:
        return "Cmd: the call server's flags come in pairs"
    for flag, value in zip(flags[::2], flags[1::2], strict=True):
        if flag == "--call-uid":
            fault = _non_root(value, cfg)
            if fault:
                return f"Cmd: --call-uid {fault}"
        elif flag != "--writable" or not isinstance(value, str) or not value.startswith("/"):
            return f"Cmd: {str(flag)[:40]!r} is not a call server flag this proxy allows"
    return ""


@functools.cache
def _server_source() -> str:
    return Path(callserver.__file__).read_text()


def _check_list_filters(raw: str) -> None:
    try:
        filters = json.loads(raw) if raw else {}
    except ValueError:
        raise Refused("filters is not JSON") from None
    labels = filters.get("label", []) if isinstance(filters, dict) else []
    if isinstance(labels, dict):  # the {"label": {"k=v": true}} form
        labels = list(labels)
    if not isinstance(labels, list) or not any(
        isinstance(lb, str) and lb.split("=", 1)[0] == LABEL for lb in labels
    ):
        raise Refused(f"a container list must filter on the label {LABEL}")


def check_container(info: object, cfg: ProxyConfig) -> str:
    """Why an engine's inspect of a container shows it is no sandbox container ('' if it is)."""
    config = info.get("Config") if isinstance(info, dict) else None
    config = config if isinstance(config, dict) else {}
    if LABEL not in (config.get("Labels") or {}):
        return f"it has no {LABEL} label"
    if config.get("Image") not in image_names(cfg.image):
        return f"it does not run the sandbox image {cfg.image!r}"
    return ""
