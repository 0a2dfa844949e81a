"""A mixture of tasks (`[[tasks]]`, issue 32): which task each feeder cursor writes.

The feeder's cursor is one sequence of positions for the whole mixture; each position belongs
to one task of the mixture and names that task's own cursor (its generated prompt, or its
dataset row), so a position means the same task for ever, whichever process asks: the feeder
writing it, a grouper re-running it, a resumed run continuing after it, a report counting it.

The order is drawn by weight, stratified: the weights are resolved to whole parts per
thousand of their sum and reduced (3:1 stays 3:1, 0.7:0.3 is 7:3); the positions come in
blocks of `sum(parts)`, and each block holds exactly `parts[j]` positions of task j in an
order shuffled by `random.Random(f"{seed}:mixture:{block}")`. So every block is a seeded
random draw of its tasks, any window of the run is within one block of the weights (no
sampling drift to wait out), and a position's task and task cursor are computed from the
position alone: `at(k)`, its inverse `position(j, c)` and the counts `written(j, k)` are pure
functions, and a run resumed at cursor k continues in exactly the order it would have taken.

A task with an end (`epochs`) leaves holes once its own cursor passes that end: its later
positions write nothing (the feeder steps over them), the other tasks keep their order and
their proportions among themselves, and the mixture ends after the last position of the last
task to end (`end`), None while any task has no end.

A single `[task]` is a mixture of one: position k is its cursor k, labelled with its name.
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Sequence
from fractions import Fraction

from streamrl.config import Config, TaskConfig
from streamrl.tasks.base import build_task
from streamrl.tasks.registry import TaskSource, task_source
from streamrl.wire import Task

RESOLUTION = 1000  # weights resolve to whole parts of this many


def parts(weights: Sequence[float]) -> tuple[int, ...]:
    """Each weight's whole parts of a block: its share of RESOLUTION (at least 1), reduced
    by their common divisor. parts([3, 1]) == (3, 1); parts([0.7, 0.3]) == (7, 3)."""
    if not weights or any(not (w > 0 and math.isfinite(w)) for w in weights):
        raise ValueError(f"mixture weights must be positive and finite, got {list(weights)}")
    total = sum(Fraction(w) for w in weights)
    whole = [max(1, round(Fraction(w) / total * RESOLUTION)) for w in weights]
    d = math.gcd(*whole)
    return tuple(p // d for p in whole)


class Schedule:
    """The mixture's order (module doc): position k -> (task index, task cursor)."""

    def __init__(self, weights: Sequence[float], seed: int) -> None:
        self.parts = parts(weights)
        self.block = sum(self.parts)
        self.seed = seed
        self._order = functools.lru_cache(maxsize=64)(self._shuffled)

    def _shuffled(self, b: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Block b's task at each slot, and each slot's rank among its task's slots."""
        order = [j for j, p in enumerate(self.parts) for _ in range(p)]
        if len(self.parts) > 1:
            random.Random(f"{self.seed}:mixture:{b}").shuffle(order)
        seen = [0] * len(self.parts)
        rank = []
        for j in order:
            rank.append(seen[j])
            seen[j] += 1
        return tuple(order), tuple(rank)

    def at(self, k: int) -> tuple[int, int]:
        """(task index, that task's cursor) of position k."""
        if k < 0:
            raise ValueError(f"a mixture position is >= 0, got {k}")
        b, i = divmod(k, self.block)
        order, rank = self._order(b)
        j = order[i]
        return j, b * self.parts[j] + rank[i]

    def position(self, j: int, c: int) -> int:
        """The position of task j's cursor c (the inverse of `at`)."""
        b, r = divmod(c, self.parts[j])
        order, rank = self._order(b)
        for i, (oj, orank) in enumerate(zip(order, rank, strict=True)):
            if oj == j and orank == r:
                return b * self.block + i
        raise AssertionError("unreachable: every rank of every task is in its block")

    def written(self, j: int, k: int) -> int:
        """Positions of task j before position k (how many of its cursors k has passed)."""
        b, i = divmod(k, self.block)
        order, _ = self._order(b)
        return b * self.parts[j] + order[:i].count(j)


class Mixture:
    """The run's tasks (`Config.mixture`) and their order: what the feeder writes and a
    grouper rebuilds at each position."""

    def __init__(self, tasks: Sequence[TaskConfig], seed: int) -> None:
        self.configs = tuple(tasks)
        self.labels = tuple(t.label for t in self.configs)
        self.sources: tuple[TaskSource, ...] = tuple(task_source(t, seed) for t in self.configs)
        self.schedule = Schedule([t.weight for t in self.configs], seed)

    @property
    def single(self) -> bool:
        return len(self.configs) == 1

    def index(self, label: str) -> int:
        """The index of the task reported as `label`; KeyError names the mixture's."""
        try:
            return self.labels.index(label)
        except ValueError:
            raise KeyError(f"task {label!r} is not in the mixture {list(self.labels)}") from None

    @functools.cached_property
    def end(self) -> int | None:
        """The first position after every task's last (each task's `epochs`), or None when
        some task has no end."""
        ends = [s.end for s in self.sources]
        if any(e is None for e in ends):
            return None
        last = [self.schedule.position(j, e - 1) for j, e in enumerate(ends) if e]
        return max(last) + 1 if last else 0

    def label_at(self, k: int) -> str:
        """The label of position k's task."""
        return self.labels[self.schedule.at(k)[0]]

    def task(self, k: int, num_generations: int) -> Task | None:
        """The task at position k (the same for ever), or None: a hole, where its task had
        ended (module doc)."""
        j, c = self.schedule.at(k)
        source = self.sources[j]
        end = source.end
        if end is not None and c >= end:
            return None
        return build_task(self.labels[j], source.prompt(c), k, num_generations)

    def written(self, k: int) -> dict[str, int]:
        """Tasks written of each task (by label) once the feeder's cursor is at k."""
        out = {}
        for j, (label, source) in enumerate(zip(self.labels, self.sources, strict=True)):
            n = self.schedule.written(j, k)
            out[label] = n if source.end is None else min(n, source.end)
        return out


@functools.lru_cache(maxsize=8)
def _cached(tasks_json: tuple[str, ...], seed: int) -> Mixture:
    return Mixture([TaskConfig.model_validate_json(t) for t in tasks_json], seed)


def mixture(cfg: Config) -> Mixture:
    """The run's Mixture, shared by the callers in this process with the same config."""
    return _cached(tuple(t.model_dump_json() for t in cfg.mixture), cfg.run.seed)


def make_task(cfg: Config, cursor: int, num_generations: int) -> Task:
    """The task at a position the feeder wrote (what a grouper's re-run rebuilds)."""
    task = mixture(cfg).task(cursor, num_generations)
    if task is None:
        raise ValueError(f"position {cursor} of the mixture is a hole: no task was written there")
    return task
