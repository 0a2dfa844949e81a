"""`streamrl tools exec` as a subprocess: one call through the configured sandbox."""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO


def tools_exec(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "streamrl_workers.cli", "tools", "exec",
         "--config", "configs/tiny.toml", *args],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


@pytest.mark.parametrize("backend", ["subprocess", "auto"])
def test_one_call_prints_json(backend: str) -> None:
    code = "import sys; print(sum(range(10))); sys.exit(4)"
    p = tools_exec("--set", f"tools.sandbox={backend}", "--tool", "python",
                   "--args", json.dumps({"code": code}))  # fmt: skip
    if backend == "auto" and p.returncode == 3:  # no container engine and no bwrap here
        if os.environ.get("STREAMRL_REQUIRE_SANDBOX") == "1":
            pytest.fail(f"STREAMRL_REQUIRE_SANDBOX=1 but {p.stderr}")
        pytest.skip(f"no isolating sandbox here: {p.stderr}")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert set(out) == {"ok", "output", "error", "duration_s", "sandbox"}
    assert out["ok"] and out["output"] == "exit status: 4\nstdout:\n45" and out["duration_s"] > 0
    if backend == "auto" and os.environ.get("STREAMRL_REQUIRE_SANDBOX") == "1":
        assert out["sandbox"] == "ContainerSandbox"  # CI has an engine: auto must find it
    bad = tools_exec("--tool", "calculator", "--args", '{"expression": "1/0"}')
    assert bad.returncode == 0 and not json.loads(bad.stdout)["ok"]


def test_bad_input_names_the_problem() -> None:
    p = tools_exec("--tool", "browser", "--args", "{}")
    assert p.returncode == 2 and "unknown tool 'browser'" in p.stderr
    p = tools_exec("--set", "tools.sandbox=vm", "--tool", "shell", "--args", "{}")
    assert p.returncode == 2 and "tools.sandbox" in p.stderr
