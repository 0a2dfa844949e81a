"""Episode isolation with the real model and batched model server (no Redis needed)."""

import asyncio
import threading
from typing import Any

import structlog

from streamrl.chat import ChatFormat, ParsedTurn
from streamrl.config import parse_config
from streamrl.model.decoder import init_params
from streamrl.model.generate import Generator, GenRequest, GenResult, SamplingParams
from streamrl.rollout.env import StepResult
from streamrl.rollout.episode import EpisodeRunner
from streamrl.rollout.server import ModelServer, ModelServerError
from streamrl.tokenizer import CharTokenizer
from streamrl.wire import Task, Trajectory

CFG = parse_config(
    {
        "model": {"d_model": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "d_ff": 64},
        "rollout": {
            "max_turn_tokens": 16,
            "max_steps": 2,
            "env_step_timeout_s": 9.0,
            "episode_timeout_s": 30.0,
        },
        "tools": {"time_limit_s": 1.0, "result_margin_s": 1.0},
    }
)
TOK = CharTokenizer()
POISON = "POISON"


class PoisonGenerator(Generator):
    """A generator whose device call fails whenever a poisoned prompt is in the batch."""

    def generate(self, params: Any, requests: list[GenRequest]) -> list[GenResult]:
        if any(POISON in TOK.decode(r.prompt) for r in requests):
            raise RuntimeError("device call failed")
        return super().generate(params, requests)


class ScriptedEnv:
    """Answers any turn with one tool result, then ends with reward 1 on the next."""

    def __init__(self, prompt: str = "Compute 1+1 with the calculator.", mode: str = "ok"):
        self._prompt, self.mode, self.turns = prompt, mode, 0

    def prompt(self) -> str:
        return self._prompt

    async def step(self, turn: ParsedTurn, call_prefix: str) -> StepResult:
        self.turns += 1
        if self.mode == "raise":
            raise ValueError("environment exploded")
        if self.mode == "hang":
            await asyncio.sleep(3600)
        return StepResult(observations=["2"], done=self.turns > 1, reward=1.0)

    async def close(self) -> None:
        return None


def _task(i: int) -> Task:
    return Task(
        task_id=f"t{i}",
        group_id=f"g{i}",
        kind="scripted",
        prompt="",
        answer="",
        num_generations=1,
        cursor=i,
    )


async def _run_all(envs: list[ScriptedEnv], env_step_timeout_s: float = 9.0) -> list[Trajectory]:
    log = structlog.get_logger()
    # Every token stops a turn, so each turn is one sampled token and every episode reaches
    # its environment steps whatever the random weights sample.
    stop_ids = [t for t in range(TOK.vocab_size) if t != TOK.pad_id]
    gen = PoisonGenerator(
        CFG.model,
        TOK.vocab_size,
        stop_ids,
        TOK.pad_id,
        16,
        SamplingParams(temperature=1.0, top_p=1.0, top_k=0),
    )
    server = ModelServer(gen, init_params(CFG.model, TOK.vocab_size, 0), 7, 8, 20.0, log)
    rollout = CFG.rollout.model_copy(update={"env_step_timeout_s": env_step_timeout_s})
    runner = EpisodeRunner(server, TOK, rollout, 0, "test", log)
    serving = asyncio.create_task(server.serve())
    try:
        return list(
            await asyncio.gather(
                *(runner.run(_task(i), 0, lambda e=e: e) for i, e in enumerate(envs))
            )
        )
    finally:
        serving.cancel()


def test_failures_stay_inside_their_episode() -> None:
    threads_before = threading.active_count()
    envs = [ScriptedEnv() for _ in range(5)]
    envs += [
        ScriptedEnv(mode="raise"),
        ScriptedEnv(mode="hang"),
        ScriptedEnv(prompt=f"{POISON} 1+1"),
    ]
    trajs = asyncio.run(_run_all(envs, env_step_timeout_s=0.5))
    healthy, raised, hung, poisoned = trajs[:5], trajs[5], trajs[6], trajs[7]
    # Healthy episodes were batched with the failing ones and still completed.
    assert all(t.status == "ok" and t.reward == 1.0 for t in healthy)
    assert all(t.versions == [7] * len(t.versions) and t.versions for t in healthy)
    assert raised.status == "error" and raised.error == "ValueError: environment exploded"
    assert hung.status == "error"
    assert hung.error == "EpisodeError: environment step exceeded env_step_timeout_s (0.5s)"
    assert poisoned.status == "error" and poisoned.error == "RuntimeError: device call failed"
    # The hung step was cancelled, not left on a thread; the model thread is gone too.
    assert threading.active_count() <= threads_before + 1


def test_prompt_too_long_is_an_episode_error() -> None:
    [t] = asyncio.run(_run_all([ScriptedEnv(prompt="x" * 100)]))
    assert t.status == "error"
    assert "exceeds rollout.max_prompt_length (64)" in t.error


def test_trajectory_layout() -> None:
    [t] = asyncio.run(_run_all([ScriptedEnv()]))
    tokens, mask, lps = t.token_array(), t.mask_array(), t.logprob_array()
    assert len(tokens) == len(mask) == len(lps)
    chat = ChatFormat(TOK)
    prompt = chat.prompt("Compute 1+1 with the calculator.")
    assert tokens[: t.prompt_len].tolist() == prompt
    assert mask[: t.prompt_len].sum() == 0  # template is never trained on
    assert (lps[mask == 0] == 0).all() and (lps[mask == 1] < 0).all()


def test_broken_model_stops_the_server() -> None:
    """When every call fails, the server gives up (and with it the worker) instead of
    failing episodes for ever."""
    log = structlog.get_logger()
    gen = PoisonGenerator(
        CFG.model,
        TOK.vocab_size,
        [1],
        TOK.pad_id,
        16,
        SamplingParams(temperature=1.0, top_p=1.0, top_k=0),
    )
    server = ModelServer(
        gen, init_params(CFG.model, TOK.vocab_size, 0), 0, 4, 1.0, log, max_consecutive_failures=3
    )
    poisoned = TOK.encode(POISON)

    async def go() -> BaseException | None:
        serving = asyncio.create_task(server.serve())
        calls = [asyncio.create_task(server.generate(GenRequest(poisoned, 4, i))) for i in range(3)]
        await asyncio.gather(*calls, return_exceptions=True)
        try:
            await asyncio.wait_for(serving, 10)
        except ModelServerError as err:
            return err
        return None

    err = asyncio.run(go())
    assert isinstance(err, ModelServerError)
    assert str(err) == "3 model calls failed in a row; last: RuntimeError: device call failed"
