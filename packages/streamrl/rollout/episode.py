"""One agent-environment episode: model turn, tool step, next model turn, until it ends.

An episode ends when the environment says so (a final answer, `finish`), after `max_steps`
model turns, at its token limit or at `episode_timeout_s`. Whatever goes wrong inside it (a
model call the generator refuses, an environment that raises or hangs, a tool
infrastructure error) ends that episode with status `error` and a reason; the worker and
the other episodes carry on. Only a tripped circuit breaker (`CircuitOpenError`) escapes:
it stops the worker, and with it the run.

Model calls are limited to `max_model_calls` in flight per worker, apart from the tool
calls' own limits (`streamrl.agents.envs.ToolLimits`).

With `on_turn` given (`rollout.resume_episodes`), each turn boundary of an episode whose
environment can save its state hands an `EpisodeState` to it (the worker writes it to
Redis). `run(..., resume=state)` plays on from such a state: the agent and the dialogue are
replayed the saved turns (their sampled ids and the environment's answers; nothing is
sampled and no tool is called again), the environment takes its saved state back, and the
transcript, its per-turn policy versions and the time spent so far are the saved ones. The
whole transcript is encoded at each boundary (a cost linear in its length per turn).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import structlog

from streamrl.agents.base import Action, Agent, Environment, StepResult
from streamrl.agents.flow import CircuitOpenError
from streamrl.chat.transcript import Transcript
from streamrl.config import RolloutConfig
from streamrl.model.requests import GenRequest, GenResult
from streamrl.model.spec import PyTree
from streamrl.obs.tracing import TRAJ_FLOW, Span, Tracer, flow_id
from streamrl.rollout.admission import Occupancy
from streamrl.wire import EpisodeState, SavedTurn, Status, Task, Trajectory, pack_arrays


class ModelService(Protocol):
    """Where model turns come from: the engine server (or anything that samples)."""

    async def generate(self, request: GenRequest) -> tuple[GenResult, int]: ...

    def end_session(self, session: str) -> None: ...


class ModelServer(ModelService, Protocol):
    """What the rollout worker, its weight follower and the colocated trainer drive: the
    engine server (`streamrl.rollout.engine_server`) or the stub (`streamrl.rollout.stub`).
    `steps`: decode steps (stub: calls answered); `stall_s`: engine time lost to weight
    syncs; `stalled_s()`: how long the engine has had work and finished no step."""

    version: int
    steps: int
    stall_s: float

    def stalled_s(self) -> float: ...

    def occupancy(self) -> Occupancy | None: ...

    async def serve(self) -> None: ...

    def hold(self) -> None: ...

    def release(self) -> None: ...

    async def swap(self, params: PyTree, version: int) -> None: ...


if TYPE_CHECKING:  # hfchat loads transformers: the stub policy's rollout never needs it
    from streamrl.chat.hf import Dialogue

NewDialogue = Callable[[list[dict[str, Any]]], "Dialogue"]
# The agent and environment of one episode (built fresh for each).
NewEpisode = Callable[[], tuple[Agent, Environment]]
# Where an episode's state at each turn boundary goes (the rollout worker's next commit).
OnTurn = Callable[[EpisodeState], None]


class Runner(Protocol):
    """What plays a rollout worker's episodes: `EpisodeRunner` (an Agent on an
    Environment), or `streamrl.endpoint.agent.AgentRunner` (an agent of the OpenAI kind)."""

    async def run(
        self,
        task: Task,
        member: int,
        make_episode: NewEpisode,
        resume: EpisodeState | None = None,
        on_turn: OnTurn | None = None,
    ) -> Trajectory: ...


class EpisodeError(RuntimeError):
    """An episode that cannot go on; the message becomes the trajectory's `error`."""


class ModelCallTimeoutError(RuntimeError):
    """A model call outlived `rollout.model_call_timeout_s`: the episode ends as a timeout."""


class ModelCalls:
    """A worker's model calls, whoever makes them (the built-in runner, the endpoint): at
    most `rollout.max_model_calls` in flight (0: `max_concurrency`), each within
    `rollout.model_call_timeout_s` if set (past it `ModelCallTimeoutError`; the engine
    server frees the call's slot at its next chunk boundary), traced on the episode's
    track: waiting for a slot and the engine, then decoding (the whole call is decode when
    the server does not say when it took the request)."""

    def __init__(self, server: ModelService, cfg: RolloutConfig, tracer: Tracer) -> None:
        self.server = server
        self.cfg = cfg
        self.tracer = tracer
        self._slots = asyncio.Semaphore(cfg.max_model_calls or cfg.max_concurrency)

    async def __call__(self, request: GenRequest, track: int) -> tuple[GenResult, int]:
        """The call's result and the policy version that sampled it."""
        called_ns = time.time_ns()
        async with self._slots:
            result, version = await self._generate(request)
        end = time.time_ns()
        started_ns = result.started_ns
        if started_ns:
            started_ns = min(max(started_ns, called_ns), end)
            self.tracer.span(track, Span.MODEL_QUEUE, called_ns, started_ns)
        else:
            started_ns = called_ns
        self.tracer.span(track, Span.MODEL_DECODE, started_ns, end)
        return result, version

    async def _generate(self, request: GenRequest) -> tuple[GenResult, int]:
        limit = self.cfg.model_call_timeout_s
        if not limit:
            return await self.server.generate(request)
        try:
            async with asyncio.timeout(limit):
                return await self.server.generate(request)
        except TimeoutError:
            raise ModelCallTimeoutError(
                f"model call exceeded rollout.model_call_timeout_s ({limit:g}s)"
            ) from None


def traj_id(task: Task, member: int) -> str:
    return f"{task.group_id}-m{member}"


def trajectory(
    task: Task,
    member: int,
    tr: Transcript,
    reward: float,
    status: Status,
    error: str,
    num_tool_calls: int,
    timings: dict[str, float],
    worker: str,
) -> Trajectory:
    """The trajectory of member `member` of `task`, its transcript `tr`."""
    return Trajectory(
        traj_id=traj_id(task, member),
        group_id=task.group_id,
        task_id=task.task_id,
        member=member,
        num_generations=task.num_generations,
        **pack_arrays(tr.tokens, tr.mask, tr.logprobs),
        prompt_len=tr.prompt_len,
        reward=reward,
        status=status,
        versions=list(tr.versions),
        num_tool_calls=num_tool_calls,
        error=error,
        timings=timings,
        worker=worker,
        task=task.kind,
    )


def sample_seed(run_seed: int, tid: str, turn: int) -> int:
    """A stable per-turn sampling seed: a replayed episode samples the same way."""
    digest = hashlib.blake2b(f"{run_seed}:{tid}:{turn}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


@dataclass
class _State:
    transcript: Transcript = field(default_factory=Transcript)
    status: Status = "ok"
    reward: float = 0.0
    error: str = ""
    model_s: float = 0.0
    env_s: float = 0.0
    prefill_tokens: int = 0  # prompt positions the engine computed for this worker's turns
    turns: list[SavedTurn] = field(default_factory=list)
    run_seed: int = 0
    elapsed_s: float = 0.0  # play time before this worker's (a resumed episode's)
    on_turn: OnTurn | None = None  # where turn boundaries' states go; None: not saved
    track: int = 0  # the episode's trace track


class EpisodeRunner:
    """Runs episodes against a shared ModelServer.

    Traced (`tracer`), each episode on its own track ("episode", traj_id): the `episode`
    span (this worker's part of it), each model call's `model.queue` (a model slot, then
    the engine taking it) and `model.decode`, each `env.step`; the episode's span starts
    the flow to its group.

    Each model call carries the episode's traj id as its session, so the engine may keep
    the episode's KV cache between its turns (`rollout.kv_reuse`); the episode's end,
    whatever ends it, releases it (`end_session`)."""

    def __init__(
        self,
        server: ModelService,
        new_dialogue: NewDialogue,
        cfg: RolloutConfig,
        run_seed: int,
        worker: str,
        log: structlog.stdlib.BoundLogger,
        tracer: Tracer | None = None,
    ) -> None:
        self.server = server
        self.tracer = tracer or Tracer.disabled()
        self.new_dialogue = new_dialogue
        self.cfg = cfg
        self.run_seed = run_seed
        self.worker = worker
        self.log = log
        self.calls = ModelCalls(server, cfg, self.tracer)

    async def run(
        self,
        task: Task,
        member: int,
        make_episode: NewEpisode,
        resume: EpisodeState | None = None,
        on_turn: OnTurn | None = None,
    ) -> Trajectory:
        """Play one episode to its end (from `resume`'s turn boundary when given), handing
        the state at each turn boundary to `on_turn`; never raises for the episode's own
        failures."""
        tid = traj_id(task, member)
        st = _State(
            run_seed=self.run_seed, on_turn=on_turn, track=self.tracer.track("episode", tid)
        )
        start_ns = time.time_ns()
        start = time.monotonic()
        timeout_s = self.cfg.episode_timeout_s
        if resume is not None:
            st.model_s, st.env_s, st.elapsed_s = resume.model_s, resume.env_s, resume.elapsed_s
            st.run_seed = resume.run_seed
            timeout_s = max(0.0, timeout_s - resume.elapsed_s)  # one limit for all its play
        env: Environment | None = None
        agent: Agent | None = None
        try:
            agent, env = make_episode()
            # asyncio.timeout, not wait_for: no task of its own per episode (nor per step)
            async with asyncio.timeout(timeout_s):
                await self._play(tid, agent, env, st, resume, start)
        except CircuitOpenError:
            raise
        except TimeoutError:
            st.status, st.reward = "timeout", 0.0
            st.error = f"episode exceeded episode_timeout_s ({self.cfg.episode_timeout_s:g}s)"
        except ModelCallTimeoutError as err:
            st.status, st.reward, st.error = "timeout", 0.0, str(err)
            self.log.warning("model_call_timeout", traj_id=tid, error=st.error)
        except Exception as err:
            st.status, st.reward = "error", 0.0
            st.error = f"{type(err).__name__}: {err}"
            self.log.warning("episode_error", traj_id=tid, error=st.error)
        finally:
            self.server.end_session(tid)
            if env is not None:
                await _close(env, self.log, tid)
            if agent is not None:
                agent.close()
        tr = st.transcript
        num_calls = env.num_tool_calls if env is not None else 0
        timings = {
            "episode_s": st.elapsed_s + time.monotonic() - start,
            "model_s": st.model_s,
            "env_s": st.env_s,
            "prefill_tokens": st.prefill_tokens,
        }
        if resume is not None:
            timings["resumed_turn"] = resume.turn
            timings["saved_s"] = resume.model_s + resume.env_s
        flows = (flow_id(TRAJ_FLOW, tid),)
        self.tracer.span(st.track, Span.EPISODE, start_ns, time.time_ns(), flows=flows)
        return trajectory(
            task, member, tr, st.reward, st.status, st.error, int(num_calls), timings, self.worker
        )

    async def _play(
        self,
        tid: str,
        agent: Agent,
        env: Environment,
        st: _State,
        resume: EpisodeState | None,
        start: float,
    ) -> None:
        cfg = self.cfg
        tr = st.transcript
        reset = await env.reset()
        agent.reset(reset)
        dialogue = self.new_dialogue(reset.tools)
        prompt = dialogue.prompt(reset.prompt)
        if resume is not None:
            self._resume(tid, resume, agent, env, dialogue, st)
        elif len(prompt) > cfg.max_prompt_length:
            raise EpisodeError(
                f"prompt of {len(prompt)} tokens exceeds rollout.max_prompt_length "
                f"({cfg.max_prompt_length})"
            )
        else:
            tr.add_template(prompt)
            tr.prompt_len = len(prompt)
        limit = cfg.max_episode_tokens
        for turn in range(len(st.turns), cfg.max_steps):
            budget = limit - len(tr)
            if budget <= 0:
                st.status = "truncated"
                return
            request = GenRequest(
                prompt=list(tr.tokens),
                max_new_tokens=min(cfg.max_turn_tokens, budget),
                seed=sample_seed(st.run_seed, tid, turn),
                session=tid,
            )
            t0 = time.monotonic()
            result, version = await self.calls(request, st.track)
            st.model_s += time.monotonic() - t0
            st.prefill_tokens += result.prefill_tokens
            sampled_from = len(tr)
            tr.add_sampled(result.tokens, result.logprobs, version)
            if not result.stopped:
                st.status = "truncated"
                return
            action = agent.act(dialogue.assistant(result.tokens))
            t0 = time.monotonic()
            step_ns = time.time_ns()
            try:
                step = await self._env_step(env, action, f"{tid}-{turn}")
            finally:  # a step that fails or times out took its time too
                self.tracer.span(st.track, Span.ENV_STEP, step_ns, time.time_ns())
            st.env_s += time.monotonic() - t0
            agent.observe(step)
            if step.done:
                st.reward = step.reward
                return
            observation = dialogue.tool_results(step.observations)
            if len(tr) + len(observation) >= limit:
                st.status = "truncated"
                return
            tr.add_template(observation)
            st.turns.append(
                SavedTurn(
                    start=sampled_from,
                    end=sampled_from + len(result.tokens),
                    observations=list(step.observations),
                    info=dict(step.info),
                )
            )
            self._save(tid, env, st, start)
        st.status = "truncated"  # max_steps turns without a final answer

    def _save(self, tid: str, env: Environment, st: _State, start: float) -> None:
        """Hand the turn boundary's state to `on_turn`, if the environment has one."""
        if st.on_turn is None:
            return
        env_state = env.save_state()
        if env_state is None:  # it cannot be resumed: nothing more to save
            st.on_turn = None
            return
        tr = st.transcript
        st.on_turn(
            EpisodeState(
                traj_id=tid,
                **pack_arrays(tr.tokens, tr.mask, tr.logprobs),
                prompt_len=tr.prompt_len,
                versions=list(tr.versions),
                turns=list(st.turns),
                env=env_state,
                num_tool_calls=int(env.num_tool_calls),
                run_seed=st.run_seed,
                model_s=st.model_s,
                env_s=st.env_s,
                elapsed_s=st.elapsed_s + time.monotonic() - start,
                worker=self.worker,
            )
        )

    def _resume(
        self,
        tid: str,
        saved: EpisodeState,
        agent: Agent,
        env: Environment,
        dialogue: Dialogue,
        st: _State,
    ) -> None:
        """Take the episode back to `saved`'s turn boundary: its transcript; the agent and
        the dialogue replayed each saved turn (its sampled ids, the environment's answer);
        the environment's own state."""
        tr = st.transcript
        tr.tokens = np.frombuffer(saved.tokens, dtype="<i4").tolist()
        tr.mask = np.frombuffer(saved.loss_mask, dtype=np.uint8).tolist()
        tr.logprobs = np.frombuffer(saved.logprobs, dtype="<f4").tolist()
        tr.versions = list(saved.versions)
        tr.prompt_len = saved.prompt_len
        for t in saved.turns:
            agent.act(dialogue.assistant(tr.tokens[t.start : t.end]))
            step = StepResult(observations=list(t.observations), done=False, info=dict(t.info))
            agent.observe(step)
            dialogue.tool_results(step.observations)
        env.num_tool_calls = saved.num_tool_calls
        env.restore_state(saved.env)
        st.turns = list(saved.turns)
        self.log.info(
            "episode_resumed",
            traj_id=tid,
            turn=saved.turn,
            from_worker=saved.worker,
            saved_model_s=round(saved.model_s, 4),
            saved_env_s=round(saved.env_s, 4),
        )

    async def _env_step(self, env: Environment, action: Action, call_prefix: str) -> StepResult:
        try:
            async with asyncio.timeout(self.cfg.env_step_timeout_s):
                return await env.step(action, call_prefix)
        except TimeoutError:
            raise EpisodeError(
                f"environment step exceeded env_step_timeout_s ({self.cfg.env_step_timeout_s:g}s)"
            ) from None


async def _close(env: Environment, log: structlog.stdlib.BoundLogger, tid: str) -> None:
    try:
        async with asyncio.timeout(5.0):
            await env.close()
    except Exception:
        log.exception("env_close_failed", traj_id=tid)
