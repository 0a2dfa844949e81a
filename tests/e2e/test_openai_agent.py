"""An agent of the OpenAI kind trained by `streamrl up` (issue 31): the example agent
(examples/openai_agent/agent.py, the `openai` client and nothing of streamrl) on the
default config, its episodes played through the rollout worker's endpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.e2e.test_up import assert_nothing_left, summary_of, up
from tests.helpers import REPO

EXAMPLE = REPO / "examples" / "openai_agent" / "openai_agent.toml"


def test_the_example_agent_trains_through_the_endpoint(tmp_path: Path, warm_cache: str) -> None:
    run_dir = tmp_path / "run"
    proc = up(run_dir, 2, f'model.cache_dir="{warm_cache}"', config=EXAMPLE)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    s = summary_of(run_dir)
    assert s["trainer_steps"] == 2 and s["dead_letters"] == 0
    assert_nothing_left(s, config=EXAMPLE)
    log = (run_dir / "logs" / "rollout-0.log").read_text().splitlines()
    events = [json.loads(line) for line in log]
    assert any(e["event"] == "endpoint_started" for e in events)
    trajs = [t for e in events if e["event"] == "trajectories_committed" for t in e["trajectories"]]
    assert trajs and all(t["status"] in ("ok", "truncated") for t in trajs)
    # the warm policy calls the calculator in some episodes: the agent ran it, sent the
    # result back, and the task's reward scored the call and the answer as it does the
    # built-in agent's (reward 1 needs a calculator call whose result is the answer)
    called = [t for t in trajs if t["tool_calls"] >= 1]
    assert called and len({len(t["versions"]) for t in called} - {1}) >= 1
    assert any(t["reward"] == 1.0 for t in called), [(t["traj_id"], t["reward"]) for t in called]


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")
def test_the_example_program_trains_in_its_sandbox(tmp_path: Path, warm_cache: str) -> None:
    # the same agent as an external program (program.py, the standard library alone),
    # one process per episode in bubblewrap, its network reaching only the endpoint
    run_dir = tmp_path / "run"
    program = ('task.agent=""', 'task.agent_command=["python3", "program.py"]',
               'task.agent_dir="examples/openai_agent"')  # fmt: skip
    proc = up(run_dir, 1, f'model.cache_dir="{warm_cache}"', *program, config=EXAMPLE)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    s = summary_of(run_dir)
    assert s["trainer_steps"] == 1 and s["dead_letters"] == 0
    assert_nothing_left(s, config=EXAMPLE)
    log = (run_dir / "logs" / "rollout-0.log").read_text().splitlines()
    events = [json.loads(line) for line in log]
    [started] = [e for e in events if e["event"] == "agent_program"]
    assert started["isolated"] is True and started["argv"] == ["python3", "program.py"]
    trajs = [t for e in events if e["event"] == "trajectories_committed" for t in e["trajectories"]]
    assert trajs and all(t["status"] in ("ok", "truncated") for t in trajs), trajs[:3]
    called = [t for t in trajs if t["tool_calls"] >= 1]
    assert called and any(t["reward"] == 1.0 for t in called)
