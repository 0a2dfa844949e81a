"""Warm start: demonstrations laid out as episodes, loss goes down, results are cached."""

from __future__ import annotations

import random
import time
from pathlib import Path

import jax
import numpy as np

from streamrl.chat import ChatFormat
from streamrl.config import Config, parse_config
from streamrl.tasks.arithmetic import demonstration, make_task
from streamrl.tokenizer import CharTokenizer
from streamrl.trainer.warmstart import (
    cache_path,
    demonstration_batch,
    demonstration_loss,
    demonstration_transcript,
    warmstart_params,
)

TOK = CharTokenizer()
CHAT = ChatFormat(TOK)


def _cfg(tmp_path: Path, **model: object) -> Config:
    tiny = {"d_model": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "d_ff": 64}
    return parse_config(
        {"model": {**tiny, "warmstart_cache": str(tmp_path), **model}, "run": {"seed": 5}}
    )


def test_demonstration_mask_covers_exactly_the_assistant_tokens(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    t = demonstration_transcript(cfg, CHAT, cursor=7, rng=random.Random(0))
    task = make_task(cfg.task, cfg.run.seed, 7, cfg.rollout.num_generations)
    demo = demonstration(task, random.Random(0), cfg.model.warmstart_error_rate)
    tokens, mask = np.array(t.tokens), np.array(t.mask)
    end = "<|end|>"
    assert TOK.decode(tokens[mask == 1].tolist()) == demo.turns[0] + end + demo.turns[1] + end
    expected = (
        CHAT.prompt(task.prompt)
        + CHAT.assistant_turn(demo.turns[0])
        + CHAT.tool_results(demo.tool_results)
        + CHAT.assistant_turn(demo.turns[1])
    )
    assert t.tokens == expected
    assert t.prompt_len == len(CHAT.prompt(task.prompt))
    # Template runs: prompt, then the tool result (after the first assistant turn).
    assert mask[: t.prompt_len].sum() == 0 and mask[t.prompt_len] == 1
    assert TOK.decode(tokens[mask == 0][t.prompt_len :].tolist()) == (
        f"<|tool|>{demo.tool_results[0]}<|end|><|assistant|>"
    )


def test_demonstration_batch_is_right_padded(tmp_path: Path) -> None:
    tokens, mask = demonstration_batch(_cfg(tmp_path), CHAT, random.Random(1), batch=3)
    assert tokens.shape == mask.shape and tokens.shape[0] == 3 and tokens.shape[1] % 32 == 0
    assert tokens.dtype == np.int32 and mask.dtype == np.float32
    for row, m in zip(tokens, mask, strict=True):
        n = int(np.flatnonzero(row != TOK.pad_id).max()) + 1
        assert m[n:].sum() == 0 and (row[n:] == TOK.pad_id).all()


def test_short_warmstart_lowers_loss_and_is_cached(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, warmstart_steps=40, warmstart_batch=4, warmstart_lr=3e-3)
    from streamrl.model.decoder import init_params

    loss = jax.jit(demonstration_loss, static_argnums=1)
    tokens, mask = demonstration_batch(cfg, CHAT, random.Random(123), batch=8)
    before = float(loss(init_params(cfg.model, TOK.vocab_size, cfg.run.seed), cfg, tokens, mask))
    events: list[str] = []
    params = warmstart_params(cfg, log=lambda event, **_: events.append(event))
    after = float(loss(params, cfg, tokens, mask))
    assert after < before - 1.0, (before, after)  # ~4.8 nats (uniform over 128) at init
    assert events[-1] == "warmstart.trained"
    path = cache_path(cfg)
    assert path.parent == tmp_path and path.exists()

    start = time.perf_counter()
    cached = warmstart_params(cfg, log=lambda event, **_: events.append(event))
    assert time.perf_counter() - start < 1.0
    assert events[-1] == "warmstart.cache_hit"
    same = zip(jax.tree.leaves(params), jax.tree.leaves(cached), strict=True)
    assert all(np.array_equal(a, b) for a, b in same)
    # Anything that changes the result changes the cache file; the cache location does not.
    assert (
        cache_path(cfg.model_copy(update={"run": cfg.run.model_copy(update={"seed": 6})})) != path
    )
    moved = cfg.model.model_copy(update={"warmstart_cache": str(tmp_path / "elsewhere")})
    assert cache_path(cfg.model_copy(update={"model": moved})).name == path.name
