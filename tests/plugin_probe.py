"""A task plug-in whose import records where it ran (pid, and which of the launcher's
secrets and engine settings its environment held) in the file PROBE_ENV names."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.plugin_fixtures import EchoTask

PROBE_ENV = "STREAMRL_TEST_PLUGIN_PROBE"
WATCHED = ("REDIS_URL", "REDIS_PASSWORD_FILE", "DOCKER_HOST", "STREAMRL_COORDINATOR")

if os.environ.get(PROBE_ENV):
    seen = {"pid": os.getpid(), "env": sorted(k for k in WATCHED if k in os.environ)}
    Path(os.environ[PROBE_ENV]).write_text(json.dumps(seen))

__all__ = ["EchoTask"]
