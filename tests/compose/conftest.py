"""The compose tests inside `make test`'s one pytest run (ops/make_test.sh): their images and
secrets are built beside the other tests, and these tests wait until they are there.

`make test` sets STREAMRL_IMAGES_READY to a file that its background build writes when it
ends: its exit status, then the path of its log. The compose tests are collected last
(tests/conftest.py), so one test process runs them while the other runs its last tests;
until the file exists they wait. `make compose-test` builds first and sets nothing.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

_WAIT_S = 1800.0  # the images from nothing on two busy cores take a few minutes


@pytest.fixture(scope="session", autouse=True)
def compose_images_ready() -> None:
    marker = os.environ.get("STREAMRL_IMAGES_READY")
    if not marker:
        return
    path = Path(marker)
    deadline = time.monotonic() + _WAIT_S
    while not path.is_file() or not path.read_text().endswith("\n"):
        if time.monotonic() > deadline:
            pytest.fail(f"the compose images were not built in {_WAIT_S:.0f} s ({path})")
        time.sleep(1.0)
    status, _, log = path.read_text().strip().partition(" ")
    if status != "0":
        tail = Path(log).read_text()[-3000:] if log and Path(log).is_file() else ""
        pytest.fail(f"the compose images or secrets failed (exit {status}); {log}:\n{tail}")
