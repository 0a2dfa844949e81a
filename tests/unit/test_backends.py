"""Which sandbox a tool worker runs each call in (`streamrl.tools.backends.WorkerSandbox`):
no silent downgrade to the plain subprocess, and a missing backend probed again later.

The backends are injected (a `build` that fails or succeeds per kind, a fake clock), so
these are the rules alone; tests/integration/test_tools_sandbox.py runs the real ones."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import structlog
from structlog.testing import capture_logs

from streamrl.tools.backends import FIX, SandboxKind, WorkerSandbox, make_sandbox
from streamrl.tools.containers import ContainerConfig
from streamrl.tools.registry import CALCULATOR, PYTHON, RUN_TESTS, SHELL, python_tool, run_call
from streamrl.tools.sandbox import ExecResult, SandboxUnavailableError


class FakeBox:
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.closed = False

    def exec(
        self, argv: list[str], stdin: bytes, time_limit_s: float, output_cap: int
    ) -> ExecResult:
        return ExecResult(0, self.kind.encode(), b"", False, False, 0.0)

    def close(self) -> None:
        self.closed = True


class Host:
    """Which backends work right now, and every build asked of it."""

    def __init__(self, *up: str) -> None:
        self.up = set(up)
        self.built: list[str] = []
        self.boxes: list[FakeBox] = []
        self.now = 0.0

    def build(self, kind: SandboxKind) -> FakeBox:
        self.built.append(kind)
        if kind not in self.up:
            raise SandboxUnavailableError(f"no {kind} here")
        box = FakeBox(kind)
        self.boxes.append(box)
        return box

    def clock(self) -> float:
        return self.now

    def sandboxes(self, kind: SandboxKind = "auto") -> WorkerSandbox:
        return WorkerSandbox(kind, self.build, structlog.get_logger(), clock=self.clock)


def ran_in(box: WorkerSandbox, tool_name: str) -> str:
    """The backend a call of a built-in tool ran in (each fake prints its kind)."""
    args = {"calculator": '{"expression": "1"}', "python": '{"code": "1"}'}[tool_name]
    return run_call(box, tool_name, args, 1.0, 100).output.splitlines()[-1]


def test_auto_without_isolation_refuses_policy_code_and_runs_the_calculator() -> None:
    host = Host("subprocess")
    with capture_logs() as logs:
        box = host.sandboxes()
    assert box.active is None and host.built == ["container", "bwrap"]
    [event] = [e for e in logs if e["event"] == "sandbox_unavailable"]
    assert event["log_level"] == "error" and event["fix"] == FIX
    for tool in (PYTHON, SHELL, RUN_TESTS, python_tool("mine", "d", {}, "print(1)")):
        with pytest.raises(SandboxUnavailableError) as err:
            box.for_call(tool.name, tool.needs_isolation)
        message = str(err.value)
        assert f"tool `{tool.name}` runs code the policy wrote" in message
        assert "container: no container here; bwrap: no bwrap here" in message
        assert "make sandbox-host" in message and "DOCKER_HOST=" in message
        assert "bubblewrap" in message and 'tools.sandbox = "subprocess"' in message
    assert not CALCULATOR.needs_isolation
    assert ran_in(box, "calculator") == "subprocess"
    assert ran_in(box, "calculator") == "subprocess"  # one plain sandbox, built once
    assert host.built.count("subprocess") == 1
    box.close()
    assert all(b.closed for b in host.boxes)


def test_make_sandbox_auto_never_returns_the_plain_backend(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Review H3: with no engine and no bwrap, `auto` used to return SubprocessSandbox."""
    prlimit = shutil.which("prlimit")
    assert prlimit is not None
    (tmp_path / "prlimit").symlink_to(prlimit)  # the plain backend could run; bwrap cannot
    monkeypatch.setenv("PATH", str(tmp_path))
    down = ContainerConfig(docker_host="unix:///nonexistent/streamrl.sock")
    with pytest.raises(SandboxUnavailableError) as err:
        make_sandbox("auto", container=down)
    assert "container: no container engine answers at DOCKER_HOST=unix:///nonexistent/" in str(
        err.value
    )
    assert "bwrap: the bubblewrap sandbox needs bwrap" in str(err.value)
    assert str(err.value).endswith(FIX)


def test_explicit_subprocess_runs_everything_and_says_so_at_every_start() -> None:
    host = Host("subprocess")
    for _ in range(2):
        with capture_logs() as logs:
            box = host.sandboxes("subprocess")
        [event] = [e for e in logs if e["event"] == "sandbox_backend"]
        assert event["log_level"] == "error" and event["kind"] == "subprocess"
        assert not event["isolated"]
        assert ran_in(box, "python") == ran_in(box, "calculator") == "subprocess"
    assert host.built == ["subprocess", "subprocess"]


def test_an_explicit_backend_that_cannot_start_stops_the_worker() -> None:
    with pytest.raises(SandboxUnavailableError, match="no container here"):
        Host("bwrap", "subprocess").sandboxes("container")
    box = Host("bwrap").sandboxes("bwrap")
    assert ran_in(box, "python") == ran_in(box, "calculator") == "bwrap"


def test_a_backend_missing_at_start_is_probed_again_with_a_backoff() -> None:
    host = Host("subprocess")
    box = host.sandboxes()
    probes: list[float] = [0.0]  # construction probed at t=0
    for t in [x * 0.5 for x in range(1, 70)]:  # a call every half second for 34.5 s
        host.now = t
        before = len(host.built)
        with pytest.raises(SandboxUnavailableError):
            box.for_call("python", True)
        if len(host.built) > before:
            probes.append(t)
            assert host.built[before:] == ["container", "bwrap"]
    # 2 s, then doubling up to 15 s between probes: 0, 2, 6, 14, 29
    assert probes == [0.0, 2.0, 6.0, 14.0, 29.0]
    host.up.add("container")  # the engine answers now
    host.now = 35.0
    with pytest.raises(SandboxUnavailableError):  # not yet: the next probe is due at 44
        box.for_call("python", True)
    host.now = 44.0
    with capture_logs() as logs:
        assert ran_in(box, "python") == "container"
    assert box.active == "container"
    assert [e["kind"] for e in logs if e["event"] == "sandbox_backend"] == ["container"]
    # The strongest backend is up: no more probes, and the calculator runs in it too.
    built = len(host.built)
    host.now = 1000.0
    assert ran_in(box, "calculator") == "container" and len(host.built) == built


def test_auto_on_bwrap_moves_up_to_containers_once_the_engine_answers() -> None:
    host = Host("bwrap", "subprocess")
    with capture_logs() as logs:
        box = host.sandboxes()
    [start] = [e for e in logs if e["event"] == "sandbox_backend"]
    assert start["kind"] == "bwrap" and start["log_level"] == "warning"
    assert start["skipped"] == {"container": "no container here"}
    assert ran_in(box, "python") == "bwrap" and ran_in(box, "calculator") == "bwrap"
    host.up.add("container")
    host.now = 1.9
    assert ran_in(box, "python") == "bwrap"
    host.now = 2.0
    assert ran_in(box, "python") == "container"
    bwrap_box = next(b for b in host.boxes if b.kind == "bwrap")
    assert bwrap_box.closed  # the weaker backend is released
    assert host.built == ["container", "bwrap", "container"]


def test_tools_declare_whether_they_need_isolation() -> None:
    assert PYTHON.needs_isolation and SHELL.needs_isolation and RUN_TESTS.needs_isolation
    assert not CALCULATOR.needs_isolation
    assert python_tool("t", "d", {}, "print(1)").needs_isolation  # a user tool by default
    assert not python_tool("t", "d", {}, "print(1)", needs_isolation=False).needs_isolation
