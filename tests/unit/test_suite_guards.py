"""The suite's own guards (tests/conftest.py): processes naming a test's temporary directory
are stopped after it, SIGKILL for one that ignores SIGTERM, others left; a failure whose
traceback formatting meets CPython's AST race is still reported as a failure."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import pytest_runtest_makereport, stop_processes_naming

# Ignores SIGTERM, so only the SIGKILL that follows the grace period ends it.
STUBBORN = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', "
    "flush=True); time.sleep(60)"
)


def test_processes_naming_the_directory_are_stopped_and_only_they(tmp_path: Path) -> None:
    mine = tmp_path / "run"
    other = Path(str(tmp_path) + "1") / "run"  # a sibling whose name extends this one's
    polite = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", str(mine)])
    stubborn = subprocess.Popen(
        [sys.executable, "-c", STUBBORN, f"--set=dir={mine}/cache"], stdout=subprocess.PIPE
    )
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", str(other)])
    try:
        assert stubborn.stdout is not None and stubborn.stdout.readline() == b"ready\n"
        found = stop_processes_naming(str(tmp_path), grace_s=1.0)
        assert sorted(found) == sorted([polite.pid, stubborn.pid])
        assert polite.wait(timeout=5) == -15  # SIGTERM
        assert stubborn.wait(timeout=5) == -9  # SIGKILL after the grace period
        assert bystander.poll() is None
    finally:
        for p in (polite, stubborn, bystander):
            p.kill()
            p.wait()
        if stubborn.stdout is not None:
            stubborn.stdout.close()


AST_RACE = "AST constructor recursion depth mismatch (before=147, after=185)"


def _report_after_ast_race(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, fails: int
) -> pytest.TestReport:
    """The suite's makereport wrapper, its inner report having met the AST race, with
    pytest's own formatting failing `fails` times more."""
    real = pytest.TestReport.from_item_and_call
    left = [fails]

    def flaky(item: pytest.Item, call: pytest.CallInfo[None]) -> pytest.TestReport:
        if left[0]:
            left[0] -= 1
            raise SystemError(AST_RACE)
        return real(item, call)

    monkeypatch.setattr(pytest.TestReport, "from_item_and_call", staticmethod(flaky))

    def divide() -> None:
        raise ZeroDivisionError("division by zero")

    call = pytest.CallInfo.from_call(divide, "call")
    wrapper = pytest_runtest_makereport(request.node, call)
    next(wrapper)
    with pytest.raises(StopIteration) as stop:
        wrapper.throw(SystemError(AST_RACE))
    report: pytest.TestReport = stop.value.value
    return report


def test_a_failure_whose_formatting_meets_the_ast_race_is_still_reported(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    again = _report_after_ast_race(request, monkeypatch, fails=1)
    assert again.failed and "ZeroDivisionError" in str(again.longrepr)
    assert "gh-106905" not in str(again.longrepr)  # formatted in full, the second time
    plain = _report_after_ast_race(request, monkeypatch, fails=5)
    assert plain.failed and plain.when == "call"
    assert str(plain.longrepr).startswith("ZeroDivisionError: division by zero")
    assert "gh-106905" in str(plain.longrepr)
