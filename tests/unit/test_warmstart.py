"""Warm start: demonstrations laid out as episodes, loss goes down, results are cached."""

from __future__ import annotations

import os
import random
import shutil
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from streamrl.chat.hf import HFChat
from streamrl.config import Config, parse_config
from streamrl.model.checkpoint import load_checkpoint
from streamrl.model.tiny import ensure_checkpoint
from streamrl.plugins import PluginError
from streamrl.tasks.arithmetic import demonstration, make_task
from streamrl.tasks.registry import load_taskdef
from streamrl.tools.registry import CALCULATOR
from streamrl.trainer.warmstart import (
    cache_key,
    cache_path,
    demonstration_batch,
    demonstration_length,
    demonstration_loss,
    demonstration_transcript,
    warmstart_params,
)

TINY = {"d_model": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "d_ff": 64}


def _cfg(cache: Path, **model: object) -> Config:
    return parse_config({"model": {**TINY, "cache_dir": str(cache), **model}, "run": {"seed": 5}})


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache directory for the module, so the built-in checkpoint is built once."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def chat(cache: Path) -> HFChat:
    return HFChat.from_dir(ensure_checkpoint(_cfg(cache)))


def test_demonstration_is_laid_out_as_a_rollout_episode(cache: Path, chat: HFChat) -> None:
    cfg = _cfg(cache)
    t = demonstration_transcript(cfg, chat, cursor=7, rng=random.Random(0))
    task = make_task(cfg.task, cfg.run.seed, 7, cfg.rollout.num_generations)
    demo = demonstration(task, random.Random(0), cfg.model.warmstart_error_rate)
    # The rollout episode's incremental layout: prompt, sampled turn, tool results, sampled.
    dialogue = chat.dialogue([CALCULATOR.schema()])
    prompt = dialogue.prompt(task.prompt)
    call = chat.assistant_turn(demo.turns[0])
    assert dialogue.assistant(call) == demo.turns[0]
    result = dialogue.tool_results(demo.tool_results)
    answer = chat.assistant_turn(demo.turns[1])
    assert t.tokens == prompt + call + result + answer
    assert t.mask == [0] * len(prompt) + [1] * len(call) + [0] * len(result) + [1] * len(answer)
    assert t.prompt_len == len(prompt)
    # The same ids as the whole conversation rendered at once (less the template's final
    # newline after the last turn end).
    final = {"role": "assistant", "content": demo.turns[1]}
    whole = chat.render([*dialogue.messages, final], [CALCULATOR.schema()])
    assert chat.decode(t.tokens) == whole.removesuffix("\n")
    assert chat.encode(whole.removesuffix("\n")) == t.tokens
    # Trained tokens: exactly the two assistant turns, each with its turn-end token.
    tokens, mask = np.array(t.tokens), np.array(t.mask)
    end = chat.turn_end
    assert chat.decode(tokens[mask == 1].tolist()) == demo.turns[0] + end + demo.turns[1] + end
    assert "<tool_response>" in chat.decode(result) and "assistant" in chat.decode(result)


def test_demonstration_batch_is_right_padded(cache: Path, chat: HFChat) -> None:
    tokens, mask = demonstration_batch(_cfg(cache), chat, random.Random(1), batch=3)
    longest = max(int(np.flatnonzero(row != chat.pad_id).max()) + 1 for row in tokens)
    assert tokens.shape == mask.shape and tokens.shape[0] == 3
    assert tokens.shape[1] == demonstration_length(longest)
    assert tokens.dtype == np.int32 and mask.dtype == np.float32
    for row, m in zip(tokens, mask, strict=True):
        n = int(np.flatnonzero(row != chat.pad_id).max()) + 1
        assert m[n:].sum() == 0 and (row[n:] == chat.pad_id).all()
        assert m[:n].sum() > 0


def test_demonstration_lengths_pad_finely_when_short() -> None:
    # a multiple of 8 below 256 tokens (the default config's 96-132: 136, not 160), of the
    # trainer's 32 from there
    got = [demonstration_length(n) for n in (0, 1, 8, 9, 132, 255, 256, 257, 542)]
    assert got == [8, 8, 8, 16, 136, 256, 256, 288, 544]


def test_short_warmstart_lowers_loss_and_is_cached(cache: Path, chat: HFChat) -> None:
    cfg = _cfg(cache, warmstart_steps=40, warmstart_batch=4, warmstart_lr=3e-3)
    ckpt = ensure_checkpoint(cfg)
    spec, start = load_checkpoint(ckpt)
    loss = jax.jit(demonstration_loss, static_argnums=1)
    tokens, mask = demonstration_batch(cfg, chat, random.Random(123), batch=8)
    before = float(loss(start, spec, tokens, mask))
    events: list[str] = []
    params = warmstart_params(cfg, log=lambda event, **_: events.append(event))
    after = float(loss(params, spec, tokens, mask))
    assert after < before - 1.0, (before, after)  # ~6.2 nats (uniform over 512) at init
    assert events[-1] == "warmstart.trained"
    path = cache_path(cfg)
    assert path.parent == cache and (path / "model.safetensors").exists()
    assert str(jax.tree.structure(params)) == str(jax.tree.structure(start))

    begin = time.perf_counter()
    cached = warmstart_params(cfg, log=lambda event, **_: events.append(event))
    assert time.perf_counter() - begin < 1.0
    assert events[-1] == "warmstart.cache_hit"
    same = zip(jax.tree.leaves(params), jax.tree.leaves(cached), strict=True)
    assert all(np.array_equal(a, b) for a, b in same)

    # Anything that changes the result changes the key; the cache location does not.
    def key(**model: object) -> str:
        return cache_key(cfg.model_copy(update={"model": cfg.model.model_copy(update=model)}), ckpt)

    assert key() == cache_key(cfg)
    assert key(cache_dir=str(cache / "elsewhere")) == key()
    for change in ({"warmstart_lr": 1e-3}, {"warmstart_error_rate": 0.1}, {"dtype": "bfloat16"}):
        assert key(**change) != key(), change
    reseeded = cfg.model_copy(update={"run": cfg.run.model_copy(update={"seed": 6})})
    assert cache_key(reseeded, ckpt) != key()
    # model.seed, when set, seeds the starting policy instead of run.seed: one warm start
    # (and one built-in checkpoint) for runs of every run.seed.
    pinned = cfg.model_copy(update={"model": cfg.model.model_copy(update={"seed": 5})})
    assert pinned.model_seed == 5 and reseeded.model_seed == 6
    pinned6 = reseeded.model_copy(update={"model": pinned.model})
    assert cache_key(pinned6) == cache_key(pinned) == key()
    assert ensure_checkpoint(pinned6) == ckpt
    elsewhere = cfg.model_copy(update={"model": cfg.model.model_copy(update={"seed": 7})})
    assert cache_key(elsewhere) != key() and ensure_checkpoint(elsewhere) != ckpt
    demo = demonstration_transcript(pinned6, chat, 3, random.Random(1))
    assert demo.tokens == demonstration_transcript(cfg, chat, 3, random.Random(1)).tokens
    harder = cfg.model_copy(update={"task": cfg.task.model_copy(update={"max_operand": 9})})
    assert cache_key(harder, ckpt) != key()
    # who plays the episodes, and how many times, does not change the demonstrations
    for played in (
        {"agent": "openai:examples.openai_agent.agent:main"},
        {"agent_command": ["python3", "program.py"], "agent_dir": "examples/openai_agent"},
        {"epochs": 3, "max_backlog": 7},
    ):
        other = cfg.model_copy(update={"task": cfg.task.model_copy(update=played)})
        assert cache_key(other, ckpt) == key(), played


def test_user_checkpoint_key_follows_its_files(cache: Path, tmp_path: Path) -> None:
    user = tmp_path / "user"
    shutil.copytree(ensure_checkpoint(_cfg(cache)), user)
    cfg = _cfg(cache, checkpoint=str(user))
    first = cache_key(cfg)
    assert cache_key(cfg) == first
    os.utime(user / "model.safetensors", ns=(0, 0))  # new weights, same name and size
    assert cache_key(cfg) != first
    second = cache_key(cfg)
    (user / "chat_template.jinja").write_text("{{ messages }}")  # a new file changes it too
    assert cache_key(cfg) != second


def test_no_tool_errors_give_up_in_one_turn(cache: Path, chat: HFChat) -> None:
    """task.options.demo_error = "no_tool": an erring demonstration is one assistant turn,
    `<answer>?</answer>` with no tool call; the others call the calculator as usual."""
    cfg = parse_config(
        {
            "model": {**TINY, "cache_dir": str(cache), "warmstart_error_rate": 0.5},
            "run": {"seed": 5},
            "task": {"options": {"demo_error": "no_tool"}},
        }
    )
    rng = random.Random(3)
    transcripts = [demonstration_transcript(cfg, chat, i, rng) for i in range(60)]
    texts = [
        chat.decode([t for t, m in zip(tr.tokens, tr.mask, strict=True) if m]) for tr in transcripts
    ]
    gave_up = [t for t in texts if "<tool_call>" not in t]
    called = [t for t in texts if "<tool_call>" in t]
    assert 15 <= len(gave_up) <= 45 and len(gave_up) + len(called) == 60
    assert all(t == "<answer>?</answer>" + chat.turn_end for t in gave_up)
    # A demonstration that calls the tool answers right (only give-ups err).
    for tr, text in zip(transcripts, texts, strict=True):
        if "<tool_call>" in text:
            answer = text.split("<answer>")[1].split("</answer>")[0]
            assert f"<tool_response>{answer}</tool_response>" in chat.decode(tr.tokens)
    bad = parse_config({"task": {"options": {"demo_error": "nope"}}})
    with pytest.raises(PluginError, match=r"task\.options\.demo_error"):
        load_taskdef(bad.task, 0)
