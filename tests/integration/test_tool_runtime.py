"""The tool runtime a process installs for its calls: a job in a process without one fails
as an infrastructure error saying so (nothing is built behind its back), and one installed
runs the calls with its own tools, once."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import structlog

from streamrl.tools import jobs
from streamrl.tools.backends import WorkerSandbox, builder
from streamrl.tools.registry import TOOLS


@pytest.fixture
def clean() -> Iterator[None]:
    jobs.uninstall()
    yield
    jobs.uninstall()


def test_no_runtime_installed_is_an_infra_error(clean: None) -> None:
    result = jobs.execute_call("c0", "calculator", '{"expression": "6*7"}', 5.0, 1000, "w")
    assert not result.ok and result.infra
    assert "no tool runtime in this process" in result.error


def test_an_installed_runtime_runs_with_its_tools(clean: None) -> None:
    log = structlog.get_logger()
    # the plain subprocess sandbox: the calculator needs no isolation
    sandbox = WorkerSandbox("subprocess", builder(log=log), log)
    jobs.install(jobs.ToolRuntime(sandbox, {"calculator": TOOLS["calculator"]}))
    with pytest.raises(RuntimeError, match="installed already"):
        jobs.install(jobs.ToolRuntime(sandbox))
    result = jobs.execute_call("c1", "calculator", '{"expression": "6*7"}', 5.0, 1000, "w")
    assert (result.ok, result.output, result.infra) == (True, "42", False)
    other = jobs.execute_call("c2", "python", '{"code": "print(1)"}', 5.0, 1000, "w")
    assert not other.ok and not other.infra  # not one of this runtime's tools
    jobs.uninstall()
    assert "no tool runtime" in jobs.execute_call("c3", "calculator", "{}", 5.0, 1000, "w").error
