"""`streamrl.evaluation`'s pure parts: tool-call counting, one pass's figures, pass@k, a
mixture's figures per task."""

from __future__ import annotations

import msgspec
import pytest

from streamrl.agents.agents import ToolAgent
from streamrl.agents.base import Reset
from streamrl.config import TaskConfig
from streamrl.evaluation import (
    CountingAgent,
    Outcome,
    by_task,
    pass_ks,
    summarize,
    summarize_sampled,
)
from streamrl.tasks.arithmetic import calculator_call, make_task
from streamrl.tools.registry import CALCULATOR


def test_tool_calls_are_counted_and_judged_well_formed() -> None:
    agent = CountingAgent(ToolAgent())
    agent.reset(Reset(prompt="Compute 1+2", tools=[CALCULATOR.schema()]))
    agent.act(calculator_call("1+2"))  # well formed
    agent.act('<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>')
    agent.act('<tool_call>{"name": "python", "arguments": {"code": "1"}}</tool_call>')
    agent.act("<tool_call>{not json</tool_call>")
    agent.act("<answer>3</answer>")  # no call at all
    assert (agent.calls, agent.wellformed) == (4, 1)


def _o(task: int, reward: float, status: str = "ok", calls: int = 1, wf: int = 1) -> Outcome:
    return Outcome(task, reward, status, turns=2, tokens=10, calls=calls, wellformed=wf)


def test_a_pass_summary_counts_every_episode_once() -> None:
    outs = [
        _o(0, 1.0),
        _o(1, 0.5, calls=2, wf=1),  # partial credit: not solved at threshold 1
        _o(2, 0.0, "truncated", calls=0, wf=0),
        _o(3, 0.0, "timeout"),
        _o(4, 0.0, "error"),
    ]
    s = summarize(outs, 1.0)
    assert s["episodes"] == 5
    assert (s["solve_rate"]["value"], s["solve_rate"]["n"]) == (0.2, 5)
    assert s["reward_mean"]["value"] == pytest.approx(0.3)
    assert s["truncation_rate"]["value"] == 0.2 and s["error_rate"]["value"] == 0.4
    # pooled over calls: 1 + 1 + 0 + 1 + 1 well formed of 1 + 2 + 0 + 1 + 1
    wellformed = s["tool_call_wellformed_rate"]
    assert wellformed is not None and (s["tool_calls"], wellformed["value"]) == (5, 0.8)
    assert summarize(outs, 0.5)["solve_rate"]["value"] == 0.4
    assert summarize([_o(0, 1.0, calls=0, wf=0)], 1.0)["tool_call_wellformed_rate"] is None


def test_sampled_pass_at_k_over_tasks() -> None:
    assert pass_ks(1) == [1] and pass_ks(4) == [1, 2, 4] and pass_ks(6) == [1, 2, 4, 6]
    # task 0: 1 of 4 solved (pass@2 = 1 - C(3,2)/C(4,2) = 0.5), task 1: none, task 2: all.
    outs = [_o(0, r) for r in (1, 0, 0, 0)] + [_o(1, 0.0)] * 4 + [_o(2, 1.0)] * 4
    s = summarize_sampled(outs, 3, 4, 1.0)
    assert s["samples"] == 4 and s["solve_rate"]["value"] == pytest.approx(5 / 12)
    k = s["pass_at_k"]
    assert k["1"]["value"] == pytest.approx((0.25 + 0 + 1) / 3)
    assert k["2"]["value"] == pytest.approx((0.5 + 0 + 1) / 3)
    assert k["4"]["value"] == pytest.approx(2 / 3) and k["4"]["n"] == 3


def test_a_mixture_is_summarized_per_task_by_hand() -> None:
    """Issue 32: tasks 0-1 of `a`, 2 of `b` (indices into the split); greedy: a solves one
    of two, b its one; sampled (2 each): a's task 1 twice, b's task none. Each task's part
    counts its own episodes, its pass@k over its own tasks (indices from 0)."""
    split = [make_task(TaskConfig(), 0, c, 2) for c in range(3)]
    split = [msgspec.structs.replace(t, kind=k) for t, k in zip(split, "aab", strict=True)]
    greedy = [_o(0, 0.0), _o(1, 1.0), _o(2, 1.0)]
    sampled = [_o(0, 0.0), _o(0, 0.0), _o(1, 1.0), _o(1, 1.0), _o(2, 0.0), _o(2, 0.0)]
    got = by_task(split, greedy, sampled, 2, 1.0)
    assert list(got) == ["a", "b"]
    assert (got["a"]["n"], got["a"]["solve_rate"], got["b"]["solve_rate"]) == (2, 0.5, 1.0)
    assert got["a"]["greedy"]["episodes"] == 2 and got["b"]["greedy"]["episodes"] == 1
    a_sampled, b_sampled = got["a"]["sampled"], got["b"]["sampled"]
    assert a_sampled is not None and b_sampled is not None
    assert a_sampled["pass_at_k"]["2"]["value"] == pytest.approx(0.5)
    assert b_sampled["solve_rate"]["value"] == 0.0
    assert by_task(split, greedy, [], 0, 1.0)["a"]["sampled"] is None
