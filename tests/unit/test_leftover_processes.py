"""The suite's cleanup after each test (tests/conftest.py): processes naming the test's
temporary directory are stopped, SIGKILL for one that ignores SIGTERM; others are left."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import stop_processes_naming

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
