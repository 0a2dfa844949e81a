"""An episode resumed from a saved turn boundary, in process on the stub policy: it goes on
from that turn without sampling or calling a tool again, keeps the saved tokens, log-probs
and per-turn policy versions, and the agent, the dialogue and the environment are where
they were (the agent counts its turns, the scorer sees every call's record)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import numpy as np
import structlog

from streamrl.agents.base import Action, Agent, Environment
from streamrl.agents.envs import ToolEnvironment, ToolLimits, ToolRecord
from streamrl.agents.tools import CallContext, FinishTool, FunctionTool
from streamrl.chat.transcript import ToolCall
from streamrl.config import parse_config
from streamrl.rollout.episode import EpisodeRunner
from streamrl.rollout.stub import StubDialogue, StubServer
from streamrl.wire import EpisodeState, Trajectory, decode_state, encode_state
from tests.policies import scripted_task

LOG = structlog.get_logger()
TURNS = 4  # model turns: three `record` calls, then `finish`


class CountingAgent(Agent):
    """Calls `record(n=<its turn>)` each turn, `finish` on the last: its own turn count
    decides, so a resumed agent that was not replayed the saved turns calls wrong."""

    def __init__(self) -> None:
        self.turns = 0
        self.seen: list[list[str]] = []

    def act(self, text: str) -> Action:
        n, self.turns = self.turns, self.turns + 1
        if n == TURNS - 1:
            return Action(text=text, calls=[ToolCall("finish", json.dumps({"answer": "done"}))])
        return Action(text=text, calls=[ToolCall("record", json.dumps({"n": n}))])

    def observe(self, result: Any) -> None:
        self.seen.append(list(result.observations))


def _episode(calls: list[int]) -> tuple[CountingAgent, Environment]:
    def record(n: int) -> str:
        calls.append(n)  # the side effect: once per call made
        return f"recorded {n}"

    tool = FunctionTool(
        name="record",
        description="Record a number.",
        parameters={"type": "object", "properties": {"n": {"type": "integer"}}},
        fn=record,
    )

    async def score(answer: str | None, records: list[ToolRecord], ctx: CallContext) -> float:
        # The reward depends on every call's record: restored ones count too.
        return float(sum(int(str(r.args["n"])) for r in records)) if answer == "done" else -1.0

    env = ToolEnvironment("alpha bravo", [tool, FinishTool()], score, ToolLimits())
    return CountingAgent(), env


def _runner(server: StubServer) -> EpisodeRunner:
    cfg = parse_config({"model": {"kind": "stub"}, "rollout": {"max_steps": 6}}).rollout
    return EpisodeRunner(server, StubDialogue, cfg, 3, "w", LOG)


def test_resumed_episode_goes_on_from_its_saved_turn() -> None:
    states: list[EpisodeState] = []
    calls: list[int] = []
    agents: list[CountingAgent] = []

    def make() -> tuple[Agent, Environment]:
        agent, env = _episode(calls)
        agents.append(agent)
        return agent, env

    async def go() -> tuple[Trajectory, Trajectory]:
        first = _runner(StubServer(0.0, 8, version=2))
        whole = await first.run(
            scripted_task(0, "stub"),
            0,
            make,
            on_turn=lambda s: states.append(decode_state(encode_state(s))),
        )
        # The worker died after the second turn boundary: play on from it at version 5.
        calls.clear()
        resumed = await _runner(StubServer(0.0, 8, version=5)).run(
            scripted_task(0, "stub"), 0, make, resume=states[1]
        )
        return whole, resumed

    whole, resumed = asyncio.run(go())
    assert whole.status == resumed.status == "ok"
    assert [s.turn for s in states] == [1, 2, 3]  # a state at each turn boundary
    saved = states[1]
    assert calls == [2]  # turns 0 and 1's tool calls were not made again
    assert resumed.num_tool_calls == whole.num_tool_calls == TURNS - 1
    assert resumed.reward == whole.reward == 0 + 1 + 2  # the scorer saw the restored records
    assert agents[1].turns == TURNS  # the agent was replayed the two saved turns
    assert agents[1].seen == agents[0].seen[: len(agents[1].seen)]
    # The saved turns keep their tokens, log-probs, mask and policy versions.
    n = len(np.frombuffer(saved.tokens, "<i4"))
    assert resumed.tokens[: 4 * n] == saved.tokens == whole.tokens[: 4 * n]
    assert resumed.logprobs[: 4 * n] == saved.logprobs
    assert resumed.loss_mask[:n] == saved.loss_mask
    assert resumed.versions == [2, 2, 5, 5] and resumed.min_version == 2
    assert resumed.prompt_len == whole.prompt_len
    assert resumed.timings["resumed_turn"] == 2
    assert resumed.timings["saved_s"] == saved.model_s + saved.env_s


def test_an_environment_without_state_is_not_saved() -> None:
    class Plain(Environment):
        async def reset(self) -> Any:
            from streamrl.agents.base import Reset

            return Reset(prompt="x")

        async def step(self, action: Action, call_prefix: str) -> Any:
            from streamrl.agents.base import StepResult

            return StepResult(observations=["again"], done=False)

    states: list[EpisodeState] = []
    runner = _runner(StubServer(0.0, 8, version=0))
    pair = (CountingAgent(), Plain())
    traj = asyncio.run(runner.run(scripted_task(0, "stub"), 0, lambda: pair, on_turn=states.append))
    assert traj.status == "truncated" and len(traj.versions) == 6
    assert states == []  # it cannot be resumed: nothing is written for it
