"""Which test file runs first under pytest-xdist: the longest, so none of them is left for
the end while the other processes have run dry (a pytest plug-in; tests/conftest.py loads
it).

`make test` distributes whole files (`--dist loadfile --no-loadscope-reorder`: a file's
module-scoped fixtures are set up once) to the test processes in collection order, each
taking the next file when it is nearly done with its own. This plug-in sorts the files by
how long each took in a measured run, longest first (list scheduling, longest first: no
process ends more than one file's time after the others). The times are in
tests/durations.json, seconds per file; a file not in it counts one second per test. Tests
within a file keep their order. Refresh the times from a run of the whole suite:

    STREAMRL_TEST_DURATIONS_OUT=tests/durations.json make test

(the controller process adds up setup, call and teardown of every test per file and writes
them at the end, rounded; only when every test passed).
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import pytest

DURATIONS = Path(__file__).with_name("durations.json")
UNKNOWN_TEST_S = 1.0  # a test of a file the durations do not name


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def longest_files_first(nodeids: list[str], seconds: dict[str, float]) -> list[int]:
    """Positions of `nodeids` reordered so that whole files come longest first (by
    `seconds`, else UNKNOWN_TEST_S per test), ties in collection order; a file's tests stay
    together in their own order."""
    files: dict[str, list[int]] = defaultdict(list)
    for i, nodeid in enumerate(nodeids):
        files[file_of(nodeid)].append(i)
    rank = {name: n for n, name in enumerate(files)}

    def weight(name: str) -> float:
        known = seconds.get(name)
        return known if known is not None else UNKNOWN_TEST_S * len(files[name])

    order = sorted(files, key=lambda name: (-weight(name), rank[name]))
    return [i for name in order for i in files[name]]


def _load(path: Path) -> dict[str, float]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return {str(k): float(v) for k, v in data.items()}


@pytest.hookimpl(trylast=True)  # after `-m` and `-k` have deselected theirs
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("dist", "no") != "loadfile":
        return
    order = longest_files_first([item.nodeid for item in items], _load(DURATIONS))
    items[:] = [items[i] for i in order]


class DurationsRecorder:
    """In the controller (or a run without xdist): seconds per file, written at the end."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[file_of(report.nodeid)] += report.duration

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if exitstatus != 0:
            return
        rounded = {k: round(v, 1) for k, v in sorted(self.seconds.items())}
        self.out.write_text(json.dumps(rounded, indent=1) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    out = os.environ.get("STREAMRL_TEST_DURATIONS_OUT")
    if out and not hasattr(config, "workerinput"):  # not in an xdist worker
        config.pluginmanager.register(DurationsRecorder(Path(out)), "streamrl-durations")
