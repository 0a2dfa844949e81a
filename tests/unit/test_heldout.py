"""The held-out split: disjoint from everything training can draw, deterministic, and an
error (not a silently smaller or overlapping split) when it cannot be made."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from streamrl.config import TaskConfig
from streamrl.tasks.heldout import (
    HELDOUT_CURSOR,
    HeldoutError,
    heldout_prompts,
    heldout_tasks,
)
from streamrl.tasks.registry import demonstration, make_task


def _trained(cfg: TaskConfig, seed: int) -> set[str]:
    """Every prompt the feeder (two whole cycles of cursors) and the warm start draw."""
    fed = {make_task(cfg, seed, c, 4).prompt for c in range(2 * cfg.num_prompts)}
    rng = random.Random(0)
    demos = {
        demonstration(cfg, seed, rng.randrange(cfg.num_prompts), rng, 0.0).task.prompt
        for _ in range(2 * cfg.num_prompts)
    }
    return fed | demos


@pytest.mark.parametrize("seed", [0, 1])
def test_a_small_question_space_is_split_without_overlap(seed: int) -> None:
    # 10 x 10 operands x 2 operators = 200 questions; training's 120 prompts cover about
    # half of them (with repeats), so many held-out candidates are training questions.
    cfg = TaskConfig(num_prompts=120, max_operand=9)
    held = heldout_tasks(cfg, seed, 40, 4)
    prompts = [t.prompt for t in held]
    assert len(set(prompts)) == 40  # no task twice
    assert not set(prompts) & _trained(cfg, seed)
    assert [t.cursor for t in held] == list(range(HELDOUT_CURSOR, HELDOUT_CURSOR + 40))
    question = re.compile(r"Compute (\d+)([+-])(\d+) with the calculator\.")
    for t in held:
        m = question.fullmatch(t.prompt)
        assert m is not None and t.num_generations == 4
        a, op, b = m.groups()
        assert int(t.answer) == (int(a) + int(b) if op == "+" else int(a) - int(b))
    # Deterministic, and the first n of a larger split are the n of a smaller one.
    assert [p.text for p in heldout_prompts(cfg, seed, 10)] == prompts[:10]


def test_the_default_task_split_is_disjoint_from_its_training_prompts() -> None:
    cfg = TaskConfig()  # 10 000 prompts of 20 000 questions
    prompts = {p.text for p in heldout_prompts(cfg, 0, 200)}
    assert len(prompts) == 200
    assert not prompts & {make_task(cfg, 0, c, 4).prompt for c in range(cfg.num_prompts)}


def test_no_split_when_training_covers_every_question() -> None:
    cfg = TaskConfig(num_prompts=1000, max_operand=3)  # 32 questions, all trained on
    with pytest.raises(HeldoutError, match=r"only 0 of 5 held-out prompts.*task.num_prompts"):
        heldout_prompts(cfg, 0, 5)
    with pytest.raises(HeldoutError, match="n >= 1"):
        heldout_prompts(cfg, 0, 0)


def _jsonl(path: Path, rows: list[dict[str, str]]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_a_dataset_task_needs_its_own_held_out_rows_minus_training_ones(tmp_path: Path) -> None:
    train = [{"prompt": f"q{i}", "answer": str(i)} for i in range(5)]
    held = [{"prompt": "q3", "answer": "3"}, {"prompt": "h1", "answer": "a"},
            {"prompt": "h2", "answer": "b"}]  # fmt: skip
    cfg = TaskConfig(name="synthetic", dataset=_jsonl(tmp_path / "train.jsonl", train))
    with pytest.raises(HeldoutError, match=r"task\.eval_dataset"):
        heldout_prompts(cfg, 0, 1)
    cfg = cfg.model_copy(update={"eval_dataset": _jsonl(tmp_path / "eval.jsonl", held)})
    # q3 is a training row: left out.
    assert [(p.text, p.answer) for p in heldout_prompts(cfg, 0, 2)] == [("h1", "a"), ("h2", "b")]
    with pytest.raises(HeldoutError, match="2 rows whose prompt no training row has"):
        heldout_prompts(cfg, 0, 3)


def test_a_warm_start_of_another_seed_has_its_prompts_left_out_too() -> None:
    # model.seed 5 with run.seed 1: the warm start demonstrates seed 5's training prompts.
    cfg = TaskConfig(num_prompts=120, max_operand=9)
    held = {t.prompt for t in heldout_tasks(cfg, 1, 30, 4, also_seeds=(5,))}
    assert len(held) == 30
    assert not held & (_trained(cfg, 1) | _trained(cfg, 5))
    # Without it the run's own split does contain some of seed 5's training prompts.
    own = {t.prompt for t in heldout_tasks(cfg, 1, 30, 4)}
    assert own & _trained(cfg, 5)
    # The run's own seed among also_seeds changes nothing.
    assert [p.text for p in heldout_prompts(cfg, 1, 30, also_seeds=(1,))] == [
        p.text for p in heldout_prompts(cfg, 1, 30)
    ]
