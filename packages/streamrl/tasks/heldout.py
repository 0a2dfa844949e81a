"""The held-out split: tasks no training path can draw, for `streamrl eval`.

Everything a run trains on comes from `TaskSource.task(cursor)`: the feeder's tasks, a
grouper's re-run of one, the warm start's demonstrations. For a generated task that is
`prompt(cursor % task.num_prompts)`, so the training set is exactly the texts of
`prompt(i)` for 0 <= i < num_prompts; for a data set (`task.dataset`) it is the prompt
texts of its rows.

The held-out split is drawn from outside that set and checked against it by text:

- a generated task: `prompt(num_prompts + k)` for k = 0, 1, 2, ..., keeping each prompt
  whose text no training prompt has (a small question space repeats questions across
  indices: those are skipped), until `n` are kept, in that order;
- a data set: the rows of `task.eval_dataset` (its `task.eval_split` when it is a saved
  DatasetDict), in file order, likewise minus any whose prompt text a training row has.

So a held-out task is never a training task, whatever the seeds: the text comparison is
the guarantee, not the index ranges. Both depend on `run.seed` and the task settings, as
the training set does: evaluate with the run's config. A warm start seeded apart from the
run (`model.seed`) draws its demonstrations from that seed's training set: its prompts are
left out too (`also_seeds`). The split is deterministic; the
first n of a larger split are the n of a smaller one. Held-out tasks carry cursors from
`HELDOUT_CURSOR` up (ids `t1000000000`...), apart from any training cursor a log shows.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from streamrl.config import TaskConfig
from streamrl.plugins import PluginError
from streamrl.tasks.base import Prompt, build_task
from streamrl.tasks.data import open_rows
from streamrl.tasks.registry import TaskSource, task_source
from streamrl.wire import Task

HELDOUT_CURSOR = 1_000_000_000  # the first held-out task's cursor (its ids say so)
TRIES_PER_TASK = 50  # generated candidates tried per task asked for before giving up


class HeldoutError(PluginError):
    """No held-out split can be made as asked; the message says why and what to change."""


def training_prompts(source: TaskSource) -> set[str]:
    """The text of every prompt training can draw from `source` (module docstring)."""
    if source.data is not None:
        rows = source.data.rows
        return {source.taskdef.from_row(rows[i]).text for i in range(len(rows))}
    return {source.taskdef.prompt(i).text for i in range(source.cfg.num_prompts)}


def _take_unseen(
    candidates: Iterable[Prompt], seen: set[str], n: int, *, repeats: bool
) -> list[Prompt]:
    """The first `n` candidates whose text is not in `seen` (fewer when they run out);
    without `repeats`, each text once."""
    out: list[Prompt] = []
    for p in candidates:
        if p.text in seen:
            continue
        if not repeats:
            seen.add(p.text)
        out.append(p)
        if len(out) == n:
            break
    return out


def heldout_prompts(
    cfg: TaskConfig, seed: int, n: int, also_seeds: Sequence[int] = ()
) -> list[Prompt]:
    """The first `n` prompts of the held-out split (module docstring), none of them a
    training prompt of `seed` or of any of `also_seeds`; HeldoutError when there are
    fewer."""
    if n < 1:
        raise HeldoutError(f"the held-out split needs n >= 1 tasks, got {n}")
    source = task_source(cfg, seed)
    train = training_prompts(source)
    for other in also_seeds:
        if other != seed:
            train |= training_prompts(task_source(cfg, other))
    if source.data is not None:
        if not cfg.eval_dataset:
            raise HeldoutError(
                f"field `task.eval_dataset`: task.dataset {cfg.dataset} is set, so held-out "
                "tasks need a data set of their own (a file, or a saved DatasetDict with "
                "split `task.eval_split`)"
            )
        rows = open_rows(
            cfg.model_copy(update={"dataset": cfg.eval_dataset, "split": cfg.eval_split})
        )
        rows_prompts = (source.taskdef.from_row(rows[i]) for i in range(len(rows)))
        out = _take_unseen(rows_prompts, set(train), n, repeats=True)
        if len(out) == n:
            return out
        raise HeldoutError(
            f"field `task.eval_dataset`: {cfg.eval_dataset} has {len(out)} rows whose prompt "
            f"no training row has, fewer than the {n} asked for"
        )
    generated = (source.taskdef.prompt(cfg.num_prompts + k) for k in range(n * TRIES_PER_TASK))
    # a repeat within the split would count one task twice
    out = _take_unseen(generated, set(train), n, repeats=False)
    if len(out) == n:
        return out
    raise HeldoutError(
        f"only {len(out)} of {n} held-out prompts in {n * TRIES_PER_TASK} tries: the task "
        f"generates few prompts that its {cfg.num_prompts} training prompts "
        "(`task.num_prompts`) do not already cover; lower task.num_prompts or widen the "
        "task (e.g. task.max_operand), or ask for fewer (--n)"
    )


def heldout_tasks(
    cfg: TaskConfig,
    seed: int,
    n: int,
    num_generations: int,
    also_seeds: Sequence[int] = (),
    first_cursor: int = HELDOUT_CURSOR,
) -> list[Task]:
    """The held-out split as tasks of `num_generations` members each, labelled with the
    task's label, their cursors (and so ids) counted from `first_cursor`."""
    prompts = heldout_prompts(cfg, seed, n, also_seeds)
    return [
        build_task(cfg.label, p, first_cursor + i, num_generations) for i, p in enumerate(prompts)
    ]


def mixture_heldout_tasks(
    tasks: Sequence[TaskConfig],
    seed: int,
    n: int,
    num_generations: int,
    also_seeds: Sequence[int] = (),
) -> list[Task]:
    """Every task's held-out split of `n` (a mixture's, task after task), the j-th task's
    cursors from HELDOUT_CURSOR + j * n, so no two share an id (a single task: its split)."""
    return [
        t
        for j, cfg in enumerate(tasks)
        for t in heldout_tasks(cfg, seed, n, num_generations, also_seeds, HELDOUT_CURSOR + j * n)
    ]
