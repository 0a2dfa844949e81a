"""Episode isolation with the real model, engine and chat template (no Redis needed)."""

import asyncio
import contextlib
import functools
import re
import threading
from typing import Any

import numpy as np
import pytest
import structlog

from streamrl.agents.agents import ToolAgent
from streamrl.agents.base import Action, Agent, Environment, Reset, StepResult, ToolInfraError
from streamrl.agents.flow import CircuitOpenError
from streamrl.chat.hf import HFChat
from streamrl.config import Config
from streamrl.model.engine import Engine, EngineConfig
from streamrl.model.sampling import GenRequest, GenResult, SamplingParams
from streamrl.rollout.admission import Occupancy
from streamrl.rollout.engine_server import EngineServer, EngineServerError
from streamrl.rollout.episode import EpisodeRunner
from streamrl.wire import EpisodeState, Trajectory
from tests.policies import always_eos, scripted_task, tiny_policy

POISON = "POISON"
GREEDY = SamplingParams(temperature=1.0, top_p=1.0, top_k=1)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Config, HFChat, Any, Any]:
    cfg, chat, spec, params = tiny_policy(tmp_path_factory.mktemp("cache"))
    return cfg, chat, spec, always_eos(params)


class PoisonEngine(Engine):
    """Fails its device step whenever a poisoned prompt is in flight."""

    poison: tuple[int, ...] = ()

    def step(self) -> list[tuple[int, GenResult]]:
        live = [s for s in [*self._slots, *self._waiting] if s is not None]
        if any(self.poison and _contains(s.request.prompt, self.poison) for s in live):
            raise RuntimeError("device step failed")
        return super().step()


def _contains(seq: list[int], sub: tuple[int, ...]) -> bool:
    return any(tuple(seq[i : i + len(sub)]) == sub for i in range(len(seq) - len(sub) + 1))


class ScriptedEnv(Environment):
    """Answers any turn with one tool result, then ends with reward 1 on the next."""

    def __init__(self, prompt: str = "Compute 1+1 with the calculator.", mode: str = "ok"):
        self._prompt, self.mode, self.turns = prompt, mode, 0

    async def reset(self) -> Reset:
        return Reset(prompt=self._prompt)

    async def step(self, action: Action, call_prefix: str) -> StepResult:
        self.turns += 1
        if self.mode == "raise":
            raise ValueError("environment exploded")
        if self.mode == "infra":
            raise ToolInfraError("no tool worker answered")
        if self.mode == "circuit":
            raise CircuitOpenError("tool infrastructure errors for 60s: 20 of 20 calls failed")
        if self.mode == "hang":
            await asyncio.sleep(3600)
        return StepResult(observations=["2"], done=self.turns > 1, reward=1.0)

    async def close(self) -> None:
        return None


def _engine(
    setup: tuple[Config, HFChat, Any, Any],
    num_slots: int,
    kv: int,
    kind: type[Engine] = Engine,
    **options: Any,
) -> Engine:
    """The tiny policy's engine: `num_slots` slots of `kv` positions, greedy, the chat's
    stop and pad ids, decode chunks of 4 (`options` override or add EngineConfig fields)."""
    _, chat, spec, params = setup
    fields: dict[str, Any] = {
        "num_slots": num_slots,
        "kv_cache_size": kv,
        "max_prompt_length": kv - 1,
        "max_new_tokens": 16,
        "sampling": GREEDY,
        "stop_ids": tuple(chat.stop_ids),
        "pad_id": chat.pad_id,
        "decode_chunk": 4,
    }
    return kind(spec, params, EngineConfig(**(fields | options)))


def _same(env: Environment) -> tuple[Agent, Environment]:
    return ToolAgent(), env


async def _run_all(
    setup: tuple[Config, HFChat, Any, Any],
    envs: list[ScriptedEnv],
    env_step_timeout_s: float = 9.0,
    kv: int = 256,
    poison: str = "",
) -> list[Trajectory]:
    cfg, chat, _, _ = setup
    log = structlog.get_logger()
    engine = _engine(setup, 8, kv, PoisonEngine)
    assert isinstance(engine, PoisonEngine)
    engine.poison = tuple(chat.encode(poison)) if poison else ()
    server = EngineServer(engine, 7, log)
    rollout = cfg.rollout.model_copy(update={"env_step_timeout_s": env_step_timeout_s})
    runner = EpisodeRunner(server, chat.dialogue, rollout, 0, "test", log)
    serving = asyncio.create_task(server.serve())
    try:
        return list(
            await asyncio.gather(
                *(
                    runner.run(scripted_task(i, "scripted"), 0, functools.partial(_same, e))
                    for i, e in enumerate(envs)
                )
            )
        )
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)


def test_failures_stay_inside_their_episode(setup: Any) -> None:
    threads_before = threading.active_count()
    envs = [ScriptedEnv() for _ in range(5)]
    envs += [ScriptedEnv(mode="raise"), ScriptedEnv(mode="hang")]
    trajs = asyncio.run(_run_all(setup, envs, env_step_timeout_s=0.5))
    healthy, raised, hung = trajs[:5], trajs[5], trajs[6]
    assert all(t.status == "ok" and t.reward == 1.0 for t in healthy)
    assert all(t.versions == [7, 7] for t in healthy)
    assert raised.status == "error" and raised.error == "ValueError: environment exploded"
    assert hung.status == "error"
    assert hung.error == "EpisodeError: environment step exceeded env_step_timeout_s (0.5s)"
    # The hung step was cancelled, not left on a thread; the engine thread is gone too.
    assert threading.active_count() <= threads_before + 1


def test_infra_error_ends_the_episode_and_a_tripped_breaker_stops_the_worker(setup: Any) -> None:
    [t] = asyncio.run(_run_all(setup, [ScriptedEnv(mode="infra")]))
    assert t.status == "error" and t.error == "ToolInfraError: no tool worker answered"
    with pytest.raises(CircuitOpenError, match="for 60s: 20 of 20 calls failed"):
        asyncio.run(_run_all(setup, [ScriptedEnv(), ScriptedEnv(mode="circuit")]))


def test_request_the_engine_refuses_is_an_episode_error(setup: Any) -> None:
    """A model-side rejection (prompt plus turn do not fit the KV slot) ends that episode
    only, with the sizes named."""
    long = "Compute 1+1 with the calculator. " * 6
    trajs = asyncio.run(_run_all(setup, [ScriptedEnv(), ScriptedEnv(prompt=long)], kv=64))
    assert trajs[0].status == "ok"
    assert trajs[1].status == "error"
    assert re.fullmatch(
        r"ValueError: prompt of \d+ tokens exceeds max_prompt_length \(63\)", trajs[1].error
    )


def test_engine_failure_fails_its_episodes_and_serving_goes_on(setup: Any) -> None:
    trajs = asyncio.run(_run_all(setup, [ScriptedEnv(prompt=f"{POISON} 1+1")], poison=POISON))
    assert trajs[0].status == "error" and trajs[0].error == "RuntimeError: device step failed"
    after = asyncio.run(_run_all(setup, [ScriptedEnv()], poison=POISON))
    assert after[0].status == "ok"


def test_prompt_too_long_is_an_episode_error(setup: Any) -> None:
    [t] = asyncio.run(_run_all(setup, [ScriptedEnv(prompt="x " * 200)]))
    assert t.status == "error"
    assert "exceeds rollout.max_prompt_length (128)" in t.error


def test_trajectory_layout(setup: Any) -> None:
    _, chat, _, _ = setup
    [t] = asyncio.run(_run_all(setup, [ScriptedEnv()]))
    tokens, mask, lps = t.token_array(), t.mask_array(), t.logprob_array()
    assert len(tokens) == len(mask) == len(lps)
    prompt = chat.dialogue([]).prompt("Compute 1+1 with the calculator.")
    assert tokens[: t.prompt_len].tolist() == prompt
    assert mask[: t.prompt_len].sum() == 0  # template is never trained on
    assert mask.sum() == 2  # two one-token turns, each its stop token
    # the degenerate model is certain of its token: log-prob 0 up to rounding
    assert (lps[mask == 0] == 0).all() and (lps[mask == 1] <= 0).all()


def test_broken_engine_stops_the_server(setup: Any) -> None:
    """When every step fails, the server gives up (and with it the worker) instead of
    failing episodes for ever."""
    chat = setup[1]
    engine = _engine(setup, 4, 128, PoisonEngine, max_new_tokens=4, decode_chunk=8)
    assert isinstance(engine, PoisonEngine)
    engine.poison = tuple(chat.encode(POISON))
    server = EngineServer(engine, 0, structlog.get_logger(), max_consecutive_failures=3)

    async def go() -> BaseException | None:
        serving = asyncio.create_task(server.serve())
        for i in range(3):
            with contextlib.suppress(RuntimeError):
                await server.generate(GenRequest(chat.encode(POISON), 4, i))
        try:
            await asyncio.wait_for(serving, 10)
        except EngineServerError as err:
            return err
        return None

    err = asyncio.run(go())
    assert isinstance(err, EngineServerError)
    assert str(err) == "3 engine steps failed in a row; last: RuntimeError: device step failed"


class SavingEnv(Environment):
    """Three turns, each answered with a tool result; resumable (it saves its turns)."""

    def __init__(self) -> None:
        self.turns = 0

    async def reset(self) -> Reset:
        return Reset(prompt="Compute 1+1 with the calculator.")

    async def step(self, action: Action, call_prefix: str) -> StepResult:
        self.turns += 1
        return StepResult(observations=[f"result {self.turns}"], done=self.turns > 2, reward=1.0)

    def save_state(self) -> dict[str, Any] | None:
        return {"turns": self.turns}

    def restore_state(self, state: dict[str, Any]) -> None:
        self.turns = int(state["turns"])


def test_resume_on_the_real_engine(setup: Any) -> None:
    """An episode resumed from its first turn boundary on the JAX engine and the real chat
    template: the engine prefills the saved tokens, the replayed dialogue renders the next
    tool result as the uninterrupted episode did, and the first turn keeps its version."""
    cfg, chat, _, _ = setup
    log = structlog.get_logger()
    rollout = cfg.rollout.model_copy(update={"max_steps": 3})
    states: list[EpisodeState] = []

    async def play(version: int, resume: EpisodeState | None) -> Trajectory:
        engine = _engine(setup, 2, 256)
        server = EngineServer(engine, version, log)
        runner = EpisodeRunner(server, chat.dialogue, rollout, 0, "test", log)
        serving = asyncio.create_task(server.serve())
        try:
            task = scripted_task(0, "scripted")
            return await runner.run(
                task, 0, lambda: (ToolAgent(), SavingEnv()), resume=resume, on_turn=states.append
            )
        finally:
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)

    whole = asyncio.run(play(7, None))
    first = states[0]
    resumed = asyncio.run(play(8, first))
    assert whole.status == resumed.status == "ok" and first.turn == 1
    assert whole.versions == [7, 7, 7] and resumed.versions == [7, 8, 8]
    assert resumed.tokens == whole.tokens and resumed.loss_mask == whole.loss_mask
    assert resumed.logprobs[: len(first.logprobs)] == first.logprobs
    assert [s.turn for s in states] == [1, 2, 2]  # the resumed run saved its turn 2 only


def test_a_model_call_past_its_limit_ends_its_episode_as_a_timeout(setup: Any) -> None:
    """The engine held on purpose (no decoding): a call that outlives
    `rollout.model_call_timeout_s` is cancelled and its episode ends with status timeout,
    long before the episode's own limit; once the engine decodes again its slot is free
    and the next episode runs (issue 18, model-call timeout)."""
    cfg, chat, _, _ = setup
    log = structlog.get_logger()
    engine = _engine(setup, 2, 256)
    server = EngineServer(engine, 7, log)
    rollout = cfg.rollout.model_copy(
        update={"model_call_timeout_s": 0.5, "episode_timeout_s": 60.0}
    )
    runner = EpisodeRunner(server, chat.dialogue, rollout, 0, "test", log)
    warm = EpisodeRunner(server, chat.dialogue, cfg.rollout, 0, "test", log)  # no call limit

    async def go() -> tuple[Trajectory, Trajectory, float]:
        serving = asyncio.create_task(server.serve())
        try:
            # The engine's compilations first (a first call outlives 0.5 s on its own).
            await warm.run(scripted_task(2, "scripted"), 0, functools.partial(_same, ScriptedEnv()))
            server.hold()
            loop = asyncio.get_running_loop()
            start = loop.time()
            stuck = await runner.run(
                scripted_task(0, "scripted"), 0, functools.partial(_same, ScriptedEnv())
            )
            took = loop.time() - start
            server.release()
            after = await runner.run(
                scripted_task(1, "scripted"), 0, functools.partial(_same, ScriptedEnv())
            )
            return stuck, after, took
        finally:
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)

    with structlog.testing.capture_logs() as logs:
        stuck, after, took = asyncio.run(go())
    assert stuck.status == "timeout" and stuck.reward == 0.0
    assert stuck.error == "model call exceeded rollout.model_call_timeout_s (0.5s)"
    assert took < 10.0  # the call's limit, not the episode's 60 s
    assert [e["traj_id"] for e in logs if e["event"] == "model_call_timeout"] == [stuck.traj_id]
    assert after.status == "ok" and after.reward == 1.0
    assert not engine.has_work() and not server._calls  # the cancelled call's slot was freed


class ToolTurnsEnv(Environment):
    """`turns` tool results of about 40 tokens each, then the end (reward 1); `raise_at`:
    the environment raises at that step instead."""

    def __init__(self, n: int, turns: int = 6, raise_at: int = 0):
        self.n, self.turns, self.limit, self.raise_at = n, 0, turns, raise_at

    async def reset(self) -> Reset:  # distinct prompts: no group copies a first prefill
        return Reset(prompt=f"Compute {self.n}+1 with the calculator.")

    async def step(self, action: Action, call_prefix: str) -> StepResult:
        self.turns += 1
        if self.turns == self.raise_at:
            raise ValueError("environment exploded")
        result = " ".join(str(self.turns * 7 + i) for i in range(12))
        return StepResult(observations=[result], done=self.turns >= self.limit, reward=1.0)

    async def close(self) -> None:
        return None


async def _run_turns(
    setup: tuple[Config, HFChat, Any, Any], envs: list[ToolTurnsEnv], reuse: bool
) -> tuple[list[Trajectory], Engine]:
    cfg, chat, _, _ = setup
    log = structlog.get_logger()
    engine = _engine(setup, 4, 1024, kv_reuse=reuse)
    server = EngineServer(engine, 7, log)
    rollout = cfg.rollout.model_copy(update={"max_steps": 8, "max_response_length": 800})
    runner = EpisodeRunner(server, chat.dialogue, rollout, 0, "test", log)
    serving = asyncio.create_task(server.serve())
    seen: list[Occupancy] = []  # what adaptive admission sees, every 10 ms

    async def look() -> None:
        while True:
            seen.append(server.occupancy())
            await asyncio.sleep(0.01)

    looking = asyncio.create_task(look())
    try:
        trajs = await asyncio.gather(
            *(
                runner.run(scripted_task(i, "scripted"), 0, functools.partial(_same, e))
                for i, e in enumerate(envs)
            )
        )
        looking.cancel()
        # with reuse the 4 episodes hold the 4 slots across their turns (parked between)
        most = max(o.held for o in seen)
        assert {o.slots for o in seen} == {4} and seen[-1].evictions == 0
        # as many episodes as slots: no request ever lacks one (a next turn waiting to take
        # its parked slot back is not counted), so adaptive admission would never trim
        assert max(o.waiting for o in seen) == 0 and max(o.pressure for o in seen) <= 1
        assert most == 4 if reuse else 1 <= most <= 4
        # and the decode calls it timed by their rows (admission's latency term): the
        # calls that did not compile, each with one to `rows` active rows
        costs = server.occupancy().costs
        assert set(costs) == {1, 2, 4}
        assert 0 < sum(c.calls for c in costs.values()) <= engine.decode_calls
        assert all(c.calls <= c.active <= n * c.calls for n, c in costs.items())
        for _ in range(200):  # the episodes' end_session calls reach the engine thread
            if engine.parked == 0 and server._inbox.empty():
                break
            await asyncio.sleep(0.02)
        return list(trajs), engine
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)


def test_kv_reuse_prefills_each_episode_once(setup: Any) -> None:
    """Episodes of 6 turns through the engine server and the real chat template (issue 18):
    with `kv_reuse` each turn prefills only what the last turn added, so an episode's
    prefill tokens come to its transcript's length (less the last sampled token, never fed,
    and one token a turn: each prompt's last token is decoded, not prefilled); without, each turn
    prefills its whole transcript again, the sum of a growing series. Samples are the same;
    every episode's slot is freed at its end, the one that fails included."""
    envs = lambda: [ToolTurnsEnv(i) for i in range(3)] + [ToolTurnsEnv(3, raise_at=3)]  # noqa: E731
    on, on_engine = asyncio.run(_run_turns(setup, envs(), reuse=True))
    off, off_engine = asyncio.run(_run_turns(setup, envs(), reuse=False))
    for a, b in zip(on, off, strict=True):
        assert a.tokens == b.tokens and a.loss_mask == b.loss_mask
        np.testing.assert_allclose(a.logprob_array(), b.logprob_array(), atol=1e-5)
    assert [t.status for t in on] == ["ok"] * 3 + ["error"]
    for a, b in zip(on[:3], off[:3], strict=True):
        starts = np.flatnonzero(a.mask_array())  # each one-token turn's position
        assert len(starts) == 6 and len(a.token_array()) >= 240
        assert a.timings["prefill_tokens"] == len(a.token_array()) - 1 - 6
        assert b.timings["prefill_tokens"] == sum(int(i) - 1 for i in starts)
        assert b.timings["prefill_tokens"] > 3 * a.timings["prefill_tokens"]
    stats = on_engine.kv_stats()
    assert stats["reuse_hits"] == 3 * 5 + 2 and stats["evictions"] == 0
    assert on_engine.parked == 0 and off_engine.parked == 0  # no slot kept after its episode


class WedgedEngine(Engine):
    """A device step that hangs (a device hang, a peer-less collective) until released."""

    wedged = threading.Event()
    release = threading.Event()

    def step(self) -> list[tuple[int, GenResult]]:
        self.wedged.set()
        self.release.wait(30)
        return super().step()


def test_a_wedged_engine_step_shows_as_a_stall(setup: tuple[Config, HFChat, Any, Any]) -> None:
    """Review N9: the rollout's liveness ticked from its event loop, so an engine thread
    wedged in a step made every episode time out while the worker looked live. The
    server says how long it has had work and finished no step; the rollout stops its
    liveness tick past run.liveness_timeout_s (`RolloutWorker._tick`). Idle, it says ~0."""
    _, chat, _, _ = setup
    engine = _engine(setup, 2, 128, WedgedEngine)
    server = EngineServer(engine, 0, structlog.get_logger())

    async def go() -> tuple[float, float, float]:
        serving = asyncio.create_task(server.serve())
        try:
            await asyncio.sleep(0.3)
            idle = server.stalled_s()
            request = GenRequest(prompt=chat.encode("hello"), max_new_tokens=2, seed=1)
            call = asyncio.create_task(server.generate(request))
            while not WedgedEngine.wedged.is_set():
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.6)
            stalled = server.stalled_s()
            WedgedEngine.release.set()
            await asyncio.wait_for(call, 30)
            await asyncio.sleep(0.2)
            return idle, stalled, server.stalled_s()
        finally:
            WedgedEngine.release.set()
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)

    idle, stalled, after = asyncio.run(go())
    assert idle < 0.2 and stalled >= 0.6 and after < 0.2, (idle, stalled, after)
