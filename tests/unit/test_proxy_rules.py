"""The sandbox proxy's rules (streamrl.tools.proxy), as pure functions on parsed requests.

The allowed requests are not written out here: they are what the docker SDK sends when
`ContainerSandbox` (containers.py) calls it, captured at the SDK's HTTP layer, so these
tests follow the sandbox when it changes. Each forbidden variation is that request with one
thing changed, and must be refused with a reason that names the thing.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any, cast
from urllib.parse import urlencode, urlsplit

import docker
import pytest

from streamrl.tools.containers import OWNER_HEADER, ContainerConfig, ContainerSandbox, _Warm
from streamrl.tools.proxy_rules import (
    BOUND_ROUTES,
    ROUTES,
    ProxyConfig,
    Refused,
    Request,
    body_length,
    check_container,
    check_request,
    owner_token,
    parse_head,
)

CFG = ProxyConfig(upstream="unix:///engine.sock", listen="unix:///proxy.sock")
CID = "c" * 64  # a container id
EID = "e" * 64  # an exec id


class _Captured(Exception):
    """Raised instead of sending: carries what the SDK would have sent."""


@pytest.fixture
def sandbox(monkeypatch: pytest.MonkeyPatch) -> Iterator[ContainerSandbox]:
    """A ContainerSandbox whose docker client records its requests instead of sending them."""
    client = docker.DockerClient(base_url="unix:///nonexistent.sock", version="1.41")

    def capture(url: str, data: Any = None, params: Any = None, **kw: Any) -> Any:
        raise _Captured(url, params or {}, data or "", kw.get("headers") or {})

    monkeypatch.setattr(client.api, "_post", capture)
    sb = object.__new__(ContainerSandbox)  # no engine: only the request-building parts
    sb.cfg = ContainerConfig(namespace="unit")
    sb.owner = "host:1:2"
    sb.client = client
    yield sb
    client.close()


def sdk_request(call: Callable[[], Any]) -> Request:
    """The request `call` makes the SDK send, parsed as the proxy parses it."""
    with pytest.raises(_Captured) as info:
        call()
    url, params, data, headers = info.value.args
    return http_request("POST", urlsplit(url).path, params, data.encode(), headers)


def http_request(
    method: str,
    path: str,
    params: dict[str, Any] | None = None,
    body: bytes = b"",
    headers: dict[str, str] | None = None,
) -> Request:
    query = f"?{urlencode(params)}" if params else ""
    lines = [f"{method} {path}{query} HTTP/1.1", "Host: localhost"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    lines.append(f"Content-Length: {len(body)}")
    req = parse_head(("\r\n".join(lines) + "\r\n\r\n").encode())
    assert body_length(req, CFG.max_body_bytes) == len(body)
    return Request(req.method, req.prefix, req.path, req.query, req.headers, body)


def create_request(sb: ContainerSandbox) -> Request:
    return sdk_request(lambda: sb.client.containers.create(sb.cfg.image, **sb._run_options()))


def exec_create_request(sb: ContainerSandbox) -> Request:
    warm = _Warm(cast(Any, SimpleNamespace(id=CID)), 0.0)
    return sdk_request(lambda: sb._begin(warm, ["python3", "-c", "print(1)"]))


def with_body(req: Request, change: Callable[[dict[str, Any]], None]) -> Request:
    body = json.loads(req.body)
    change(body)
    raw = json.dumps(body).encode()
    return Request(req.method, req.prefix, req.path, req.query, req.headers, raw)


def refused(req: Request) -> str:
    with pytest.raises(Refused) as info:
        check_request(req, CFG)
    return info.value.reason


# -- what the sandbox sends passes


def test_the_sandbox_create_passes(sandbox: ContainerSandbox) -> None:
    req = create_request(sandbox)
    assert req.prefix == "/v1.41" and req.path == "/containers/create"
    allowed = check_request(req, CFG)
    assert allowed.route.name == "container_create" and allowed.ref == ""


def test_the_sandbox_exec_passes(sandbox: ContainerSandbox) -> None:
    allowed = check_request(exec_create_request(sandbox), CFG)
    assert allowed.route.name == "exec_create" and allowed.ref == CID
    start = sdk_request(lambda: sandbox.client.api.exec_start(EID, socket=True))
    assert start.upgrade
    allowed = check_request(start, CFG)
    assert allowed.route.name == "exec_start" and allowed.ref == EID


@pytest.mark.parametrize(
    ("method", "path", "params", "route"),
    [
        ("GET", "/version", None, "version"),
        ("GET", "/v1.41/_ping", None, "ping"),
        ("HEAD", "/_ping", None, "ping"),
        ("GET", "/v1.41/images/streamrl-sandbox:1/json", None, "image_inspect"),
        ("GET", "/v1.41/images/localhost/streamrl-sandbox:1/json", None, "image_inspect"),
        (
            "GET",
            "/v1.41/containers/json",
            {"all": 1, "filters": json.dumps({"label": ["streamrl.sandbox=ns"]})},
            "container_list",
        ),
        ("GET", f"/v1.41/containers/{CID}/json", None, "container_inspect"),
        ("POST", f"/v1.41/containers/{CID}/start", None, "container_start"),
        ("POST", f"/v1.41/containers/{CID}/kill", {"signal": "KILL"}, "container_kill"),
        ("POST", f"/v1.41/containers/{CID}/wait", None, "container_wait"),
        ("DELETE", f"/v1.41/containers/{CID}", {"v": True, "force": True}, "container_remove"),
        ("GET", f"/v1.41/exec/{EID}/json", None, "exec_inspect"),
    ],
)
def test_the_sandbox_reads_and_lifecycle_pass(
    method: str, path: str, params: dict[str, Any] | None, route: str
) -> None:
    assert check_request(http_request(method, path, params), CFG).route.name == route


# -- one thing changed: refused, saying what


def _set(where: str, key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(body: dict[str, Any]) -> None:
        (body[where] if where else body)[key] = value

    return change


def _drop(where: str, key: str) -> Callable[[dict[str, Any]], None]:
    return lambda body: (body[where] if where else body).pop(key)


CREATE_VARIATIONS = {
    "privileged": (_set("HostConfig", "Privileged", True), "HostConfig.Privileged is not allowed"),
    "bind mount of /": (_set("HostConfig", "Binds", ["/:/host"]), "HostConfig.Binds is not"),
    "mounts": (
        _set("HostConfig", "Mounts", [{"Type": "bind", "Source": "/", "Target": "/h"}]),
        "HostConfig.Mounts is not allowed",
    ),
    "volumes": (_set("", "Volumes", {"/data": {}}), "Volumes is not allowed"),
    "volumes from": (_set("HostConfig", "VolumesFrom", ["other"]), "HostConfig.VolumesFrom"),
    "devices": (
        _set("HostConfig", "Devices", [{"PathOnHost": "/dev/sda"}]),
        "HostConfig.Devices is not allowed",
    ),
    "network host": (_set("HostConfig", "NetworkMode", "host"), 'NetworkMode must be "none"'),
    "network default": (_drop("HostConfig", "NetworkMode"), "NetworkMode is required"),
    "writable root": (_set("HostConfig", "ReadonlyRootfs", False), "ReadonlyRootfs must be true"),
    "capabilities kept": (_set("HostConfig", "CapDrop", ["NET_RAW"]), 'must drop "ALL"'),
    "capability added": (_set("HostConfig", "CapAdd", ["SYS_ADMIN"]), "HostConfig.CapAdd may"),
    "server caps, another command": (
        _set("HostConfig", "CapAdd", ["SETUID"]),
        "only for the call server's own command",
    ),
    "seccomp off": (
        _set("HostConfig", "SecurityOpt", ["no-new-privileges", "seccomp=unconfined"]),
        "SecurityOpt must be exactly",
    ),
    "new privileges": (_drop("HostConfig", "SecurityOpt"), "HostConfig.SecurityOpt is required"),
    "host pid": (_set("HostConfig", "PidMode", "host"), "HostConfig.PidMode is not allowed"),
    "host ipc": (_set("HostConfig", "IpcMode", "host"), "HostConfig.IpcMode is not allowed"),
    "host uts": (_set("HostConfig", "UTSMode", "host"), "HostConfig.UTSMode is not allowed"),
    "host userns": (_set("HostConfig", "UsernsMode", "host"), "HostConfig.UsernsMode is not"),
    "host cgroupns": (_set("HostConfig", "CgroupnsMode", "host"), "HostConfig.CgroupnsMode"),
    "sysctls": (_set("HostConfig", "Sysctls", {"kernel.x": "1"}), "HostConfig.Sysctls is not"),
    "no memory limit": (_drop("HostConfig", "Memory"), "HostConfig.Memory is required"),
    "zero memory": (_set("HostConfig", "Memory", 0), "HostConfig.Memory must be an integer"),
    "swap": (_set("HostConfig", "MemorySwap", -1), "HostConfig.MemorySwap must be an integer"),
    "more swap": (_set("HostConfig", "MemorySwap", 2**30), "MemorySwap must equal Memory"),
    "no pids limit": (_drop("HostConfig", "PidsLimit"), "HostConfig.PidsLimit is required"),
    "unlimited pids": (_set("HostConfig", "PidsLimit", -1), "HostConfig.PidsLimit must be"),
    "tmpfs on /etc": (
        _set("HostConfig", "Tmpfs", {"/etc": "rw,nosuid,nodev,noexec,size=1"}),
        "HostConfig.Tmpfs mounts '/etc'",
    ),
    "tmpfs suid": (
        _set("HostConfig", "Tmpfs", {"/tmp": "rw,nodev,noexec,size=1"}),
        "must hold nosuid,nodev,noexec",
    ),
    "tmpfs owner": (
        _set("HostConfig", "Tmpfs", {"/tmp": "rw,nosuid,nodev,noexec,size=1,uid=0"}),
        "HostConfig.Tmpfs options for /tmp must be from",
    ),
    # Review N6: a tmpfs is memory; the mounts together may not pass the container's.
    "tmpfs larger than memory": (
        _set(
            "HostConfig",
            "Tmpfs",
            {
                "/tmp": "rw,nosuid,nodev,noexec,size=300m",
                "/work": "rw,nosuid,nodev,noexec,size=64m",
            },
        ),
        "HostConfig.Tmpfs sizes add up to 364 MiB, more than Memory (256 MiB)",
    ),
    "ulimit memlock": (
        _set("HostConfig", "Ulimits", [{"Name": "memlock", "Soft": 1, "Hard": 1}]),
        "HostConfig.Ulimits[0].Name is not allowed",
    ),
    "another image": (_set("", "Image", "alpine:3"), "Image must be the sandbox image"),
    "root user": (_set("", "User", "0:0"), "User 0:0 and CapAdd are only for the call server"),
    "root uid, other gid": (_set("", "User", "0:10001"), "User must not be root"),
    "root group": (_set("", "User", "10001:0"), "User must not be root"),
    "named user": (_set("", "User", "root"), "User must be a numeric uid:gid"),
    "default user": (_drop("", "User"), "User is required"),
    "no labels": (_drop("", "Labels"), "Labels is required"),
    "no owner label": (
        lambda body: body["Labels"].pop("streamrl.owner"),
        "Labels must carry the sandbox labels",
    ),
    "entrypoint": (_set("", "Entrypoint", ["/bin/sh"]), "Entrypoint is not allowed"),
    "lower-case key": (_set("HostConfig", "privileged", True), "HostConfig.privileged is not"),
    "no host config": (_drop("", "HostConfig"), "HostConfig is required"),
}


def server_create_request(sb: ContainerSandbox) -> Request:
    return sdk_request(lambda: sb.client.containers.create(sb.cfg.image, **sb.server_options()))


def test_the_call_server_create_and_attach_pass(sandbox: ContainerSandbox) -> None:
    """tools.call_server: root with SETUID, SETGID and KILL, for the server's own command."""
    req = server_create_request(sandbox)
    body = json.loads(req.body)
    assert body["User"] == "0:0" and body["HostConfig"]["CapAdd"] == ["SETUID", "SETGID", "KILL"]
    assert check_request(req, CFG).route.name == "container_create"
    params = {"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1}
    api: Any = sandbox.client.api
    api.post = api._post  # the capture: attach_socket posts through requests' own post
    attach = sdk_request(lambda: sandbox.client.api.attach_socket(CID, params=params))
    assert attach.upgrade
    allowed = check_request(attach, CFG)
    assert allowed.route.name == "container_attach" and allowed.ref == CID


def _cmd(change: Callable[[list[str]], None]) -> Callable[[dict[str, Any]], None]:
    return lambda body: change(body["Cmd"])


SERVER_VARIATIONS: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "another program as root": (
        _cmd(lambda cmd: cmd.__setitem__(slice(None), ["/bin/sh", "-c", "id"])),
        "only for the call server's own command",
    ),
    "a changed server source": (
        _cmd(lambda cmd: cmd.__setitem__(2, cmd[2] + "\nimport os; os.system('sh')")),
        "only for the call server's own command",
    ),
    "calls as root": (
        _cmd(lambda cmd: cmd.__setitem__(slice(3, 5), ["--call-uid", "0:0"])),
        "--call-uid must not be root",
    ),
    "another flag": (
        _cmd(lambda cmd: cmd.extend(["--no-python-fork", "/x"])),
        "'--no-python-fork' is not a call server flag",
    ),
    "a relative writable dir": (
        _cmd(lambda cmd: cmd.extend(["--writable", "etc"])),
        "is not a call server flag",
    ),
    "an odd flag": (_cmd(lambda cmd: cmd.append("--writable")), "flags come in pairs"),
    "sys_admin for the server": (
        _set("HostConfig", "CapAdd", ["SETUID", "SYS_ADMIN"]),
        "HostConfig.CapAdd may only add",
    ),
}


@pytest.mark.parametrize("case", sorted(SERVER_VARIATIONS))
def test_a_changed_call_server_create_is_refused(sandbox: ContainerSandbox, case: str) -> None:
    change, reason = SERVER_VARIATIONS[case]
    why = refused(with_body(server_create_request(sandbox), change))
    assert reason in why and why.startswith("create: "), why


@pytest.mark.parametrize("case", sorted(CREATE_VARIATIONS))
def test_a_changed_create_is_refused(sandbox: ContainerSandbox, case: str) -> None:
    change, reason = CREATE_VARIATIONS[case]
    why = refused(with_body(create_request(sandbox), change))
    assert reason in why and why.startswith("create: ")


def test_a_key_repeated_in_another_case_is_refused(sandbox: ContainerSandbox) -> None:
    # Go's decoder would take the lower-case key for NetworkMode: both must not pass.
    req = create_request(sandbox)
    raw = req.body.replace(
        b'"NetworkMode": "none"', b'"NetworkMode": "none", "networkmode": "host"'
    )
    assert raw != req.body
    req = Request(req.method, req.prefix, req.path, req.query, req.headers, raw)
    assert "a JSON key repeats" in refused(req)


def test_a_container_name_outside_the_sandbox_pattern_is_refused(
    sandbox: ContainerSandbox,
) -> None:
    req = create_request(sandbox)
    req = Request(req.method, req.prefix, req.path, (("name", "web"),), req.headers, req.body)
    assert "a container name must match" in refused(req)


EXEC_VARIATIONS = {
    "root": (_set("", "User", "0"), "User must be a numeric uid:gid"),
    "root uid:gid": (_set("", "User", "0:0"), "User must not be root"),
    "default user": (_drop("", "User"), "User is required"),
    "privileged": (_set("", "Privileged", True), "Privileged must be false"),
    "another container": (_set("", "Container", "d" * 64), "Container differs from the path"),
    "detach keys": (_set("", "DetachKeys", "ctrl-p"), "DetachKeys is not allowed"),
}


@pytest.mark.parametrize("case", sorted(EXEC_VARIATIONS))
def test_a_changed_exec_is_refused(sandbox: ContainerSandbox, case: str) -> None:
    change, reason = EXEC_VARIATIONS[case]
    assert reason in refused(with_body(exec_create_request(sandbox), change))


def test_an_exec_start_with_a_tty_is_refused(sandbox: ContainerSandbox) -> None:
    start = sdk_request(lambda: sandbox.client.api.exec_start(EID, socket=True, tty=True))
    assert "Tty must be false" in refused(start)


@pytest.mark.parametrize(
    ("method", "path", "params", "reason"),
    [
        ("GET", "/v1.41/info", None, "GET /info is not a request the container sandbox makes"),
        ("POST", "/v1.41/images/create", {"fromImage": "alpine"}, "is not a request"),
        ("POST", "/v1.41/build", None, "is not a request"),
        ("POST", "/v1.41/volumes/create", None, "is not a request"),
        ("POST", "/v1.41/networks/create", None, "is not a request"),
        ("GET", f"/v1.41/containers/{CID}/logs", None, "is not a request"),
        ("PUT", f"/v1.41/containers/{CID}/archive", {"path": "/"}, "is not a request"),
        ("GET", f"/v1.41/containers/{CID}/export", None, "is not a request"),
        (  # the call server's stream, but with the container's past output
            "POST",
            f"/v1.41/containers/{CID}/attach",
            {"stdin": 1, "stream": 1, "logs": 1},
            "query parameters ['logs']",
        ),
        ("POST", f"/v1.41/containers/{CID}/attach/ws", None, "is not a request"),
        ("POST", f"/v1.41/containers/{CID}/update", None, "is not a request"),
        ("POST", "/v1.41/containers/prune", None, "is not a request"),
        ("GET", "/v1.41/events", None, "is not a request"),
        ("POST", f"/v1.41/exec/{EID}/resize", None, "is not a request"),
        ("GET", "/v4.3.1/libpod/containers/json", None, "is not a request"),
        ("GET", "/v1.41/images/alpine:3/json", None, "only the sandbox image"),
        ("GET", "/v1.41/containers/json", None, "must filter on the label streamrl.sandbox"),
        (
            "GET",
            "/v1.41/containers/json",
            {"filters": json.dumps({"label": ["app=web"]})},
            "must filter on the label streamrl.sandbox",
        ),
        ("DELETE", f"/v1.41/containers/{CID}", {"force": 1, "x": 1}, "query parameters ['x']"),
        ("GET", "/v1.41/containers/../info", None, "segments the API never uses"),
        ("GET", "/v1.41/containers/a%2Fb/json", None, "characters or segments"),
    ],
)
def test_other_requests_are_refused(
    method: str, path: str, params: dict[str, Any] | None, reason: str
) -> None:
    def attempt() -> None:
        check_request(http_request(method, path, params), CFG)

    with pytest.raises(Refused) as info:
        attempt()
    assert reason in info.value.reason


def test_a_start_with_a_body_is_refused() -> None:
    req = http_request("POST", f"/v1.41/containers/{CID}/start", body=b'{"Binds": ["/:/h"]}')
    assert "container_start takes no body" in refused(req)


def test_an_upgrade_outside_exec_start_is_refused() -> None:
    req = http_request(
        "POST", f"/v1.41/containers/{CID}/wait", headers={"Connection": "Upgrade", "Upgrade": "tcp"}
    )
    assert "container_wait may not upgrade" in refused(req)


def test_framing_refusals() -> None:
    head = b"POST /v1.41/containers/create HTTP/1.1\r\nHost: x\r\n%s\r\n"

    def length(extra: bytes) -> int:
        return body_length(parse_head(head % extra), CFG.max_body_bytes)

    with pytest.raises(Refused, match="Transfer-Encoding on a request is not accepted"):
        length(b"Transfer-Encoding: chunked\r\n")
    with pytest.raises(Refused, match="over the 1048576 byte limit") as big:
        length(b"Content-Length: 1048577\r\n")
    assert big.value.status == 413
    with pytest.raises(Refused, match="bad Content-Length"):
        length(b"Content-Length: -1\r\n")
    with pytest.raises(Refused, match="header content-length repeats"):
        length(b"Content-Length: 1\r\nContent-Length: 2\r\n")
    with pytest.raises(Refused, match="compressed request bodies"):
        length(b"Content-Encoding: gzip\r\n")
    with pytest.raises(Refused, match="bad request line"):
        parse_head(b"GET /_ping\r\n\r\n")
    with pytest.raises(Refused, match="a query parameter repeats"):
        parse_head(b"GET /containers/json?all=1&all=0 HTTP/1.1\r\n\r\n")


@pytest.mark.parametrize("bad", [b"x\nX-Any: y", b"x\ry", b"x\x00y", b"x\x7fy", b"x\x1by"])
def test_control_characters_in_a_header_are_refused(bad: bytes) -> None:
    """Review N17: header values were forwarded as they came; a bare LF in one (which Go's
    textproto may take for a line end) reached the engine as a second header. Any control
    character but a tab is refused."""
    head = b"GET /_ping HTTP/1.1\r\nUser-Agent: " + bad + b"\r\n\r\n"
    with pytest.raises(Refused, match="control character"):
        parse_head(head)
    assert parse_head(b"GET /_ping HTTP/1.1\r\nUser-Agent: a\tb\r\n\r\n").headers == (
        ("user-agent", "a\tb"),
    )


def test_check_container_wants_the_label_and_the_image() -> None:
    sandbox = {
        "Config": {"Image": "localhost/streamrl-sandbox:1", "Labels": {"streamrl.sandbox": "x"}}
    }
    assert check_container(sandbox, CFG) == ""
    other = copy.deepcopy(sandbox)
    other["Config"]["Labels"] = {"app": "db"}
    assert "no streamrl.sandbox label" in check_container(other, CFG)
    other = copy.deepcopy(sandbox)
    other["Config"]["Image"] = "postgres:16"
    assert "does not run the sandbox image" in check_container(other, CFG)


def test_a_container_config_whose_tmpfs_outgrows_its_memory_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the proxy refuses (review N6) fails at the config: the two tmpfs mounts must
    fit in the container's memory; `tools.memory_mb` below 256 shrinks them to a quarter."""
    with pytest.raises(ValueError, match=r"tmpfs_bytes \(67108864\) x 2"):
        ContainerConfig(memory_bytes=64 * 2**20)
    ContainerConfig(memory_bytes=128 * 2**20)  # 2 x 64 MiB: fits exactly
    from streamrl.config import ToolsConfig
    from streamrl.tools import jobs

    built: dict[str, Any] = {}

    def builder(**kw: Any) -> Callable[[str], Any]:
        built.update(kw)
        return lambda kind: None

    monkeypatch.setattr(jobs, "builder", builder)
    monkeypatch.setattr(jobs, "WorkerSandbox", lambda *a: a)
    jobs.open_sandbox(ToolsConfig(memory_mb=32), "ns", "w", cast(Any, None))
    assert built["container"].tmpfs_bytes == 8 * 2**20
    assert built["container"].memory_bytes == 32 * 2**20


def test_bound_routes_need_an_owner_token_and_lifecycle_routes_do_not() -> None:
    """Review N6: what runs code in a sandbox carries the token of the sandbox that made it
    (the server compares it with the creator's); a missing, short or non-hex token is
    refused; removal and the other lifecycle requests need none (a restarted worker reaps
    its predecessor's containers)."""
    token = "0123456789abcdef" * 2
    req = http_request("POST", f"/containers/{CID}/exec")
    routes = {r.name: r for r in ROUTES}
    assert set(BOUND_ROUTES) <= set(routes)
    for name in ("exec_create", "exec_start", "container_start", "container_attach"):
        for bad in ({}, {OWNER_HEADER: "abc"}, {OWNER_HEADER: "g" * 32}):
            with pytest.raises(Refused, match=OWNER_HEADER):
                owner_token(http_request("POST", "/x", headers=bad), routes[name])
        assert owner_token(http_request("POST", "/x", headers={OWNER_HEADER: token}),
                           routes[name]) == token  # fmt: skip
    for name in ("container_remove", "container_kill", "container_inspect", "container_list"):
        assert name not in BOUND_ROUTES and owner_token(req, routes[name]) == ""
