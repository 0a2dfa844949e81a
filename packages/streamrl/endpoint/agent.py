"""An agent of the OpenAI kind as a coroutine: one episode played through the endpoint
(issue 31 item 3, the coroutine half).

`task.agent = "openai:package.module:main"` names an async function called once per episode
as `main(base_url=..., api_key=..., prompt=..., data=...)`: it talks to the endpoint with
any OpenAI-style client (the key is the episode's, the base URL the worker's endpoint) and
returns its answer (a string, or None), which the task's reward scores as the built-in
agent's `<answer>`, with the calls the policy made and the results the agent sent back for
them (`EndpointSession.tool_records`, what a built-in environment records). `play` runs it
under the episode's limits:

- `timeout_s` (rollout.episode_timeout_s): past it the coroutine is cancelled, status
  `timeout`; so is an episode one of whose model calls outlived
  `rollout.model_call_timeout_s` (the call answered 504 `model_call_timeout`);
- `max_calls` (rollout.max_steps): the endpoint refuses a call past it (400,
  `model_call_limit`), and a later call whose conversation fills the built-in agent's
  length (`rollout.max_prompt_length + max_response_length`; 400
  `context_length_exceeded`); an agent that then returns or raises ends `truncated`, as
  does one whose last call ran out of tokens (`finish_reason` `length`). A call samples at
  most `rollout.max_turn_tokens` and what that length leaves, as a built-in turn does;
- an exception out of the agent ends the episode `error` with its message; the worker goes
  on.

Whatever ends it, the episode's key dies and its KV slot is freed (`Endpoint.close`).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from streamrl.agents.tools import CallContext
from streamrl.config import OPENAI_AGENT, Config, RolloutConfig
from streamrl.endpoint.server import Endpoint, Episode
from streamrl.obs.tracing import Tracer
from streamrl.plugins import PluginError, load_object
from streamrl.rollout.episode import NewEpisode, OnTurn, sample_seed, traj_id, trajectory
from streamrl.tools.sandbox import SandboxUnavailableError
from streamrl.wire import EpisodeState, Status, Task, Trajectory

if TYPE_CHECKING:
    from streamrl.chat.hf import HFChat
    from streamrl.rollout.episode import ModelService
    from streamrl.tasks.registry import Episodes

PREFIX = OPENAI_AGENT
AgentMain = Callable[..., Awaitable[object]]


def is_openai_agent(ref: str) -> bool:
    return ref.startswith(PREFIX)


def load_agent(ref: str, field: str = "task.agent") -> AgentMain:
    """The async function `openai:package.module:main` names, or PluginError."""
    if not is_openai_agent(ref):
        raise PluginError(f"{field} = {ref!r}: an agent of the OpenAI kind is `openai:module:fn`")
    fn = load_object(ref.removeprefix(PREFIX), field)
    if not inspect.iscoroutinefunction(fn):
        raise PluginError(
            f"{field} = {ref!r}: {fn!r} is not an async function (`async def main(base_url, "
            "api_key, prompt, data)`)"
        )
    return fn


@dataclass(frozen=True)
class Outcome:
    """How an agent's episode ended: what the endpoint holds, the status, the answer."""

    episode: Episode
    status: Status
    answer: str | None
    error: str


async def play(
    endpoint: Endpoint,
    main: AgentMain,
    episode: str,
    prompt: str,
    data: Mapping[str, object],
    seed: Callable[[int], int],
    timeout_s: float,
    max_calls: int,
) -> Outcome:
    """Play one episode of the agent `main` (see the module's doc); never raises for the
    agent's own failures."""
    key = endpoint.open(episode, seed, max_calls=max_calls)
    status: Status = "ok"
    answer: str | None = None
    error = ""
    try:
        async with asyncio.timeout(timeout_s):
            result = await main(base_url=endpoint.base_url, api_key=key, prompt=prompt, data=data)
        answer = None if result is None else str(result)
    except TimeoutError:
        status, error = "timeout", f"the agent ran past episode_timeout_s ({timeout_s:g}s)"
    except SandboxUnavailableError:  # an agent program's sandbox: not the agent's failure
        raise
    except Exception as err:  # the agent's own failure ends its episode, not the worker
        status, error = "error", f"{type(err).__name__}: {err}"
    finally:
        ep = endpoint.close(key)
    if ep.timed_out:  # whatever the agent made of the refused call
        status, error = "timeout", "a model call exceeded rollout.model_call_timeout_s"
    limit = ep.limited and status in ("ok", "error")  # ended by a limit, however it took it
    if not ep.timed_out and (limit or (status == "ok" and ep.last_finish == "length")):
        status = "truncated"
    return Outcome(ep, status, answer, error)


class AgentRunner:
    """The rollout worker's runner when `task.agent` names an agent of the OpenAI kind: the
    same `run` as `EpisodeRunner`, each episode played by `play` and scored by the task's
    reward with the agent's answer.

    An episode is never resumed from a turn boundary (`resume` is ignored): the agent's own
    state (its coroutine, its messages) died with the worker that ran it, and the endpoint
    cannot rebuild it, so a task re-delivered after a rollout kill plays its episodes from
    the start (the same seeds: a greedy policy samples the same turns again)."""

    def __init__(
        self,
        endpoint: Endpoint,
        main: AgentMain,
        episodes: Episodes,
        cfg: RolloutConfig,
        run_seed: int,
        worker: str,
        log: structlog.stdlib.BoundLogger,
    ) -> None:
        self.endpoint = endpoint
        self.main = main
        self.episodes = episodes
        self.cfg = cfg
        self.run_seed = run_seed
        self.worker = worker
        self.log = log

    async def run(
        self,
        task: Task,
        member: int,
        make_episode: NewEpisode,
        resume: EpisodeState | None = None,
        on_turn: OnTurn | None = None,
    ) -> Trajectory:
        """Play one episode of `task` (`make_episode`, `resume`, `on_turn`: unused, see the
        class's doc)."""
        tid = traj_id(task, member)
        start = time.monotonic()
        out = await play(
            self.endpoint,
            self.main,
            tid,
            task.prompt,
            task.data,
            lambda turn: sample_seed(self.run_seed, tid, turn),
            self.cfg.episode_timeout_s,
            self.cfg.max_steps,
        )
        status, error, reward = out.status, out.error, 0.0
        calls = out.episode.session.tool_records()
        if status == "ok":
            ctx = self.episodes.context(task, member)
            try:
                reward = await ctx.score(out.answer, calls, CallContext(f"{tid}-score"))
            except Exception as err:  # a reward that fails makes this episode an error
                status, error = "error", f"{type(err).__name__}: {err}"
        if status != "ok":
            self.log.warning("agent_episode_ended", traj_id=tid, status=status, error=error)
        timings = {
            "episode_s": time.monotonic() - start,
            "model_s": out.episode.model_s,
            "prefill_tokens": float(out.episode.prefill_tokens),
            "model_calls": float(out.episode.calls),
            "refused_calls": float(out.episode.refused),
            "edited_calls": float(out.episode.edited),
        }
        tr = out.episode.session.transcript
        return trajectory(task, member, tr, reward, status, error, len(calls), timings, self.worker)


async def start_runner(
    cfg: Config,
    model: ModelService,
    chat: HFChat,
    episodes: Episodes,
    worker: str,
    log: structlog.stdlib.BoundLogger,
    tracer: Tracer | None = None,
) -> tuple[AgentRunner, Endpoint]:
    """The rollout worker's runner for `task.agent = "openai:..."` or `task.agent_command`,
    and its endpoint, started (the caller stops it). For a program: its sandbox checked
    here (bubblewrap, unless `tools.sandbox = "subprocess"`), so that a host that cannot
    run it fails at start, naming the fix."""
    from streamrl.endpoint.command import MEMORY_BYTES, CommandAgent
    from streamrl.tools.bwrap import BubblewrapConfig, BubblewrapSandbox

    t = cfg.task
    endpoint = Endpoint(model, chat, cfg.rollout, log, tracer=tracer)
    try:
        base_url = await endpoint.start(unix=bool(t.agent_command))
        if t.agent_command:
            box = None
            if cfg.tools.sandbox != "subprocess":
                box = BubblewrapSandbox(
                    BubblewrapConfig(
                        memory_bytes=MEMORY_BYTES,
                        max_processes=max(4, cfg.tools.pids_limit),
                        call_server=False,
                    )
                )
            main: AgentMain = CommandAgent(t.agent_command, t.agent_dir, endpoint.socket_path,
                                           box, cfg.rollout.episode_timeout_s)  # fmt: skip
            if box is None:  # as a tool worker says it: at error level, at every start
                log.error("agent_program", argv=t.agent_command, dir=t.agent_dir, isolated=False,
                          warning="tools.sandbox = subprocess: the agent program runs with "
                          "rlimits only, with this worker's network and file system")  # fmt: skip
            else:
                log.info("agent_program", argv=t.agent_command, dir=t.agent_dir, isolated=True)
        elif episodes.openai is not None:
            main = episodes.openai
        else:
            raise PluginError("start_runner: task.agent names no agent of the OpenAI kind")
    except BaseException:
        await endpoint.stop()
        raise
    log.info("endpoint_started", base_url=base_url, socket=endpoint.socket_path or None)
    runner = AgentRunner(endpoint, main, episodes, cfg.rollout, cfg.run.seed, worker, log)
    return runner, endpoint
