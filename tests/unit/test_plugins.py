"""Plug-ins by import path and entry point: loading, options, type checks, reward checks and
the errors that name the field (tests/plugin_fixtures.py holds the plug-ins)."""

from __future__ import annotations

import ast
import asyncio
import math
import random
from pathlib import Path
from typing import Any

import pytest

from streamrl.agents.envs import ToolLimits
from streamrl.config import ConfigError, parse_config
from streamrl.errors import FatalError
from streamrl.plugins import PluginError, load_object, resolve_ref
from streamrl.tasks.base import RewardError, checked_reward
from streamrl.tasks.data import DataError
from streamrl.tasks.registry import (
    BUILTIN_TASKS,
    TaskSource,
    check_plugins,
    load_episodes,
    make_task,
)
from streamrl.tasks.synthetic import SyntheticOptions
from streamrl.tools.registry import TOOLS, load_tools
from streamrl.wire import ToolResult

REPO = Path(__file__).resolve().parents[2]
FIX = "tests.plugin_fixtures"


class NoTools:
    async def call(self, name: str, arguments: str, call_id: str) -> ToolResult:
        raise AssertionError("no tool call expected")


def cfg_with(**task: Any) -> Any:
    return parse_config({"task": task})


def test_builtin_names_and_import_paths_give_the_same_task() -> None:
    by_name = make_task(cfg_with(name="arithmetic").task, 0, 7, 4)
    by_path = make_task(cfg_with(name=BUILTIN_TASKS["arithmetic"]).task, 0, 7, 4)
    assert (by_name.prompt, by_name.answer) == (by_path.prompt, by_path.answer)
    assert by_name.kind == "arithmetic" and by_path.kind == BUILTIN_TASKS["arithmetic"]


def test_missing_module_and_attribute_are_named() -> None:
    with pytest.raises(PluginError, match=r"`task.name`: cannot import `no_such_pkg.mod`.*"
                       r"no module named `no_such_pkg`"):  # fmt: skip
        check_plugins(cfg_with(name="no_such_pkg.mod:Task"))
    with pytest.raises(
        PluginError,
        match=rf"`task.name`: `{FIX}:Missing`: module `{FIX}` has no attribute `Missing`",
    ):
        check_plugins(cfg_with(name=f"{FIX}:Missing"))
    with pytest.raises(PluginError, match=r"not an import path"):
        load_object("no_colon", "task.reward")


def test_plugin_errors_are_config_errors_and_fatal() -> None:
    # `up` turns a ConfigError into exit 2 with its message; a worker started alone exits
    # with FATAL_EXIT_CODE, so its launcher stops instead of restarting it again and again
    assert issubclass(PluginError, ConfigError) and issubclass(PluginError, FatalError)
    assert issubclass(DataError, PluginError)


def test_wrong_kinds_of_object_are_refused() -> None:
    with pytest.raises(PluginError, match=r"`task.name`: .* class NotATask, not a subclass"):
        check_plugins(cfg_with(name=f"{FIX}:NotATask"))
    with pytest.raises(PluginError, match=r"`task.reward`: .*NOT_CALLABLE` is a int, not call"):
        check_plugins(cfg_with(reward=f"{FIX}:NOT_CALLABLE"))


def test_entry_point_names_resolve() -> None:
    # examples/unitconv registers `unitconv` in the streamrl.tasks group (installed by make)
    assert resolve_ref("unitconv", "task.name", BUILTIN_TASKS, "streamrl.tasks") == (
        "unitconv.task:UnitConversion"
    )
    with pytest.raises(PluginError, match=r"unknown name `nope`; known: \[.*'arithmetic'.*"
                       r"'unitconv'"):  # fmt: skip
        check_plugins(cfg_with(name="nope"))


def test_options_are_validated_by_the_plugin_model() -> None:
    ok = make_task(cfg_with(name=f"{FIX}:EchoTask", options={"repeat": 2}).task, 0, 3, 4)
    assert ok.prompt == "hello hello 3"
    with pytest.raises(PluginError, match=r"unknown key `task.options.repaet`"):
        check_plugins(cfg_with(name=f"{FIX}:EchoTask", options={"repaet": 2}))
    with pytest.raises(PluginError, match=r"field `task.options.repeat`: .*integer"):
        check_plugins(cfg_with(name=f"{FIX}:EchoTask", options={"repeat": "many"}))
    with pytest.raises(PluginError, match=r"field `task.options.repeat`: .*less than or equal"):
        check_plugins(cfg_with(name=f"{FIX}:EchoTask", options={"repeat": 11}))
    # a built-in task without options refuses any
    with pytest.raises(PluginError, match=r"unknown key `task.options.x`"):
        check_plugins(cfg_with(name="arithmetic", options={"x": 1}))


def test_reward_values_are_checked() -> None:
    assert checked_reward(1) == 1.0 and checked_reward(0.25) == 0.25
    bad_values = [
        (math.nan, "not a finite"),
        (math.inf, "not a finite"),
        ("1.0", r"str '1\.0', not a number"),
        (True, "bool"),
        (None, "NoneType"),
    ]
    for bad, why in bad_values:
        with pytest.raises(RewardError, match=why):
            checked_reward(bad)


def _score(cfg: Any, member: int) -> float:
    episodes = load_episodes(cfg, NoTools(), ToolLimits())
    task = TaskSource(cfg.task, 0).task(0, 4)

    async def go() -> float:
        agent, env = episodes.make(task, member)
        await env.reset()
        result = await env.step(agent.act("<answer>x</answer>"), "c")
        return result.reward

    return asyncio.run(go())


def test_reward_override_and_async_rewards() -> None:
    cfg = cfg_with(name=f"{FIX}:EchoTask")
    assert _score(cfg, 3) == 3.0
    assert _score(cfg_with(name=f"{FIX}:EchoTask", reward=f"{FIX}:async_reward"), 3) == 0.5
    with pytest.raises(RewardError, match=r"str '1\.0'"):
        _score(cfg_with(name=f"{FIX}:EchoTask", reward=f"{FIX}:string_reward"), 3)


def test_agent_override_by_builtin_name() -> None:
    cfg = cfg_with(name=f"{FIX}:EchoTask", agent="model")
    agent, _ = load_episodes(cfg, NoTools(), ToolLimits()).make(make_task(cfg.task, 0, 0, 4), 0)
    # the model agent takes the whole turn as the answer, tool-call syntax and all
    assert agent.act("<tool_call>{}</tool_call>").answer == "<tool_call>{}</tool_call>"


def test_extra_tools_are_loaded_and_checked() -> None:
    tools = load_tools(parse_config({"tools": {"extra": [f"{FIX}:UPPER"]}}).tools)
    assert set(tools) == {*TOOLS, "upper"}
    cases = [
        (f"{FIX}:BAD_SCHEMA", r"`tests.plugin_fixtures:BAD_SCHEMA`: tool `bad`: parameters."
                              r"required \['text'\] must list properties \[\]"),
        (f"{FIX}:UNTYPED", r"tool `untyped`: property `x` needs a type"),
        (f"{FIX}:EchoTask", r"holds a type, not a streamrl.api.WorkerTool"),
        ("streamrl.tools.registry:PYTHON", r"a tool named `python` exists already"),
    ]  # fmt: skip
    for ref, why in cases:
        with pytest.raises(PluginError, match=r"field `tools.extra`: .*" + why):
            load_tools(parse_config({"tools": {"extra": [ref]}}).tools)
    with pytest.raises(PluginError, match=r"`tools.non_idempotent`: unknown tool `sendmail`"):
        load_tools(parse_config({"tools": {"non_idempotent": ["shell", "sendmail"]}}).tools)
    assert "upper" in load_tools(
        parse_config({"tools": {"extra": [f"{FIX}:UPPER"], "non_idempotent": ["upper"]}}).tools
    )


def test_synthetic_latencies_are_seeded_and_validated() -> None:
    mix = SyntheticOptions(latency="mixture", mixture=[(0.9, 0.05), (0.1, 1.0)])
    draws = [mix.draw(random.Random(i)) for i in range(2000)]
    assert set(draws) == {0.05, 1.0}
    assert 0.07 < draws.count(1.0) / len(draws) < 0.13
    assert draws == [mix.draw(random.Random(i)) for i in range(2000)]  # seeded
    logn = SyntheticOptions(latency="lognormal", latency_s=0.1, sigma=1.0, max_latency_s=2.0)
    ln = sorted(logn.draw(random.Random(i)) for i in range(2001))
    assert 0.08 < ln[1000] < 0.12 and ln[-1] <= 2.0  # median latency_s, capped
    assert SyntheticOptions(latency_s=0.3).draw(random.Random(0)) == 0.3
    with pytest.raises(ValueError, match=r"probabilities sum to 0.9, not 1"):
        SyntheticOptions(latency="mixture", mixture=[(0.5, 0.1), (0.4, 1.0)])


def test_synthetic_episode_takes_its_turns() -> None:
    cfg = cfg_with(name="synthetic", options={"turns": 3, "latency_s": 0.0})
    episodes = load_episodes(cfg, NoTools(), ToolLimits())
    task = make_task(cfg.task, 0, 5, 4)

    async def go() -> list[bool]:
        agent, env = episodes.make(task, 1)
        await env.reset()
        return [(await env.step(agent.act("x"), f"c{i}")).done for i in range(3)]

    assert asyncio.run(go()) == [False, False, True]


class RecordingTools:
    """The tool workers' client, answering each call at once (what a step sends)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str]] = []

    async def call(self, name: str, arguments: str, call_id: str) -> ToolResult:
        self.calls.append((name, arguments, call_id))
        return ToolResult(call_id=call_id, ok=True, output="ok", worker="w")


def test_synthetic_tool_steps_are_real_calls() -> None:
    """`latency = "tool"`: each step is one call of the tool (the shell's `echo ok` by
    default), its id derived from the step, its output the next observation."""
    cfg = cfg_with(name="synthetic", options={"turns": 3, "latency": "tool"})
    tools = RecordingTools()
    episodes = load_episodes(cfg, tools, ToolLimits())
    task = make_task(cfg.task, 0, 5, 4)

    async def go() -> list[tuple[bool, list[str]]]:
        agent, env = episodes.make(task, 1)
        await env.reset()
        out = []
        for i in range(3):
            r = await env.step(agent.act("x"), f"c{i}")
            out.append((r.done, r.observations))
        return out

    assert asyncio.run(go()) == [(False, ["ok"]), (False, ["ok"]), (True, [])]
    assert tools.calls == [("shell", '{"command": "echo ok"}', f"c{i}-step{i}") for i in range(3)]
    assert SyntheticOptions(latency="tool").draw(random.Random(0)) == 0.0


def test_example_package_uses_only_the_public_api() -> None:
    """The worked example imports streamrl only as `from streamrl import api`."""
    for path in (REPO / "examples" / "unitconv" / "unitconv").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and "streamrl" in node.module:
                assert node.module == "streamrl" and [a.name for a in node.names] == ["api"], (
                    f"{path.name} imports {node.module}"
                )
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("streamrl") for a in node.names), path.name
    import unitconv.task

    assert issubclass(unitconv.task.UnitConversion, __import__("streamrl.api").api.TaskDef)


def test_up_checks_plugins_in_a_process_of_their_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review N19: `streamrl up` imported the user's plug-ins in the launcher, which holds
    the operator password and parents every worker. They load in a throw-away process
    now, whose environment names no Redis, password file or container engine; a plug-in
    that fails still stops `up` with the field named."""
    import json
    import os
    import sys

    from streamrl.run.launcher import check_plugins_apart

    probe = tmp_path / "probe.json"
    config = tmp_path / "run.toml"
    config.write_text('[task]\nname = "arithmetic"\n')
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("STREAMRL_TEST_PLUGIN_PROBE", str(probe))
    for name in ("REDIS_URL", "REDIS_PASSWORD_FILE", "DOCKER_HOST"):
        monkeypatch.setenv(name, "secret-or-socket")
    assert check_plugins_apart(config, ["task.name=tests.plugin_probe:EchoTask"]) == 0
    seen = json.loads(probe.read_text())
    assert seen["pid"] != os.getpid() and seen["env"] == []
    assert "tests.plugin_probe" not in sys.modules
    assert check_plugins_apart(config, ["task.name=tests.plugin_probe:Missing"]) == 2
