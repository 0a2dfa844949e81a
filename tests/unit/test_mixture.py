"""Task mixtures (issue 32): the config's [[tasks]], the seeded stratified order and its
inverse, holes once a task ends, per-task figures and counters. Pure: no Redis."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from streamrl import counters
from streamrl.config import ConfigError, load_config, parse_config
from streamrl.obs.sinks import task_totals, train_values
from streamrl.obs.status import pooled_task_figures
from streamrl.run.summary import task_summary
from streamrl.tasks.mixture import Mixture, Schedule, make_task, mixture, parts
from streamrl.tasks.registry import check_plugins, load_episodes
from streamrl.wire import Group, TaskFigures, TrainMetrics, Trajectory, pack_arrays, task_figures
from tests.helpers import REPO

ARITH = {"name": "arithmetic", "num_prompts": 50}


def mix(*tasks: dict[str, Any], **top: Any) -> Any:
    return parse_config({"tasks": list(tasks), **top})


# -- the order ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("weights", "want"),
    [
        ([3, 1], (3, 1)),
        ([0.75, 0.25], (3, 1)),
        ([0.7, 0.3], (7, 3)),
        ([2, 2, 2], (1, 1, 1)),
        ([1, 2], (333, 667)),  # parts per thousand: 1/3 -> 333, 2/3 -> 667
        ([1, 1000], (1, 999)),  # a tiny weight still gets a part
        ([5], (1,)),
    ],
)
def test_weights_resolve_to_whole_parts_of_a_block(weights: list[float], want: tuple) -> None:
    assert parts(weights) == want


@pytest.mark.parametrize("weights", [[], [1, 0], [1, -2], [float("nan")], [float("inf"), 1]])
def test_bad_weights_are_refused(weights: list[float]) -> None:
    with pytest.raises(ValueError, match="positive and finite"):
        parts(weights)


def test_every_block_holds_each_task_by_its_parts_in_a_seeded_order() -> None:
    s = Schedule([3, 1], seed=0)
    assert s.block == 4
    blocks = [[s.at(b * 4 + i)[0] for i in range(4)] for b in range(50)]
    assert all(Counter(b) == {0: 3, 1: 1} for b in blocks)
    # the order within blocks is drawn, not fixed: the lone task 1 lands in every slot
    assert {b.index(1) for b in blocks} == {0, 1, 2, 3}
    # the same for ever, from any instance; another seed draws another order
    again = Schedule([3, 1], seed=0)
    assert [again.at(k) for k in range(200)] == [s.at(k) for k in range(200)]
    other = Schedule([3, 1], seed=1)
    assert [other.at(k)[0] for k in range(200)] != [s.at(k)[0] for k in range(200)]


def test_each_task_takes_its_own_cursors_in_turn_and_position_inverts_at() -> None:
    s = Schedule([0.7, 0.3], seed=5)
    seen: dict[int, list[int]] = {0: [], 1: []}
    for k in range(1000):
        j, c = s.at(k)
        seen[j].append(c)
        assert s.position(j, c) == k
        assert s.written(j, k) == c  # positions of task j before k: its cursor's index
    assert seen[0] == list(range(700)) and seen[1] == list(range(300))
    assert s.written(0, 1000) == 700 and s.written(1, 1000) == 300


def test_a_single_task_is_the_identity() -> None:
    s = Schedule([2.5], seed=9)
    assert [s.at(k) for k in range(5)] == [(0, k) for k in range(5)]


def test_a_mixture_labels_its_tasks_and_numbers_groups_by_position() -> None:
    cfg = mix({**ARITH, "id": "a", "weight": 3}, {**ARITH, "id": "b", "operators": "*"})
    m = mixture(cfg)
    assert m.labels == ("a", "b")
    for k in range(40):
        t = m.task(k, 4)
        assert t is not None
        assert t.kind == m.label_at(k) and t.cursor == k and t.group_id == f"g{k:09d}"
        assert make_task(cfg, k, 4) == t  # what a grouper's re-run rebuilds
        assert ("*" in t.prompt) == (t.kind == "b")
    assert m.written(40) == {"a": 30, "b": 10}


def test_tasks_that_end_leave_holes_and_the_mixture_ends_after_the_last() -> None:
    # a: 5 prompts x 2 epochs = 10 tasks; b: 3 prompts x 1 epoch = 3 tasks
    cfg = mix(
        {**ARITH, "id": "a", "num_prompts": 5, "epochs": 2, "weight": 1},
        {**ARITH, "id": "b", "num_prompts": 3, "epochs": 1, "weight": 1},
    )
    m = Mixture(cfg.mixture, cfg.run.seed)
    assert m.end is not None
    written = [m.task(k, 2) for k in range(m.end)]
    tasks = [t for t in written if t is not None]
    assert Counter(t.kind for t in tasks) == {"a": 10, "b": 3}
    assert written[-1] is not None  # the end is one past the last task written
    assert m.written(m.end) == {"a": 10, "b": 3}
    # b's 3 tasks come at its first 3 positions; its later ones are holes
    b_positions = [k for k in range(m.end) if m.label_at(k) == "b"]
    assert [written[k] is not None for k in b_positions] == [True] * 3 + [False] * (
        len(b_positions) - 3
    )
    # a task of no end keeps the mixture going
    forever = mix({**ARITH, "id": "a", "epochs": 1}, {**ARITH, "id": "b"})
    assert Mixture(forever.mixture, 0).end is None


# -- the config ------------------------------------------------------------------------------


def test_one_task_is_a_mixture_of_one_labelled_by_its_name() -> None:
    cfg = parse_config({"task": {"name": "arithmetic"}})
    assert cfg.mixture == (cfg.task,) and cfg.task.label == "arithmetic"
    assert mixture(cfg).task(3, 4) == make_task(cfg, 3, 4)
    assert make_task(cfg, 3, 4).kind == "arithmetic"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"task": {"name": "code"}, "tasks": [ARITH]},
            "[task] then holds only the feeder's max_backlog, but it sets task.name",
        ),
        (
            {"tasks": [ARITH, {**ARITH, "max_backlog": 4}]},
            "tasks[1].max_backlog: the feeder keeps one backlog",
        ),
        ({"tasks": [ARITH, ARITH]}, "both reported as 'arithmetic': give one of them an id"),
        (
            {"tasks": [ARITH, {**ARITH, "id": "b", "agent": "openai:x.y:main"}]},
            "tasks[1] (b): an agent of the OpenAI kind",
        ),
        (
            {
                "tasks": [ARITH, {**ARITH, "id": "b", "epochs": 1}],
                "grouper": {"order": "submission"},
            },
            'tasks[1].epochs (1) with grouper.order = "submission"',
        ),
        ({"tasks": [{**ARITH, "weight": 0}]}, "tasks.0.weight"),
        ({"tasks": [{**ARITH, "id": "no spaces"}]}, "tasks.0.id"),
    ],
)
def test_a_bad_mixture_is_refused_naming_the_field(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    assert message in str(err.value)


def test_the_mixture_config_loads_every_task_and_its_parts() -> None:
    cfg = load_config(REPO / "configs" / "mixture.toml")
    check_plugins(cfg)
    assert [(t.label, t.weight) for t in cfg.mixture] == [("arithmetic", 3), ("unitconv", 1)]
    episodes = load_episodes(cfg, _NoCaller())
    m = mixture(cfg)
    kinds = {}
    for k in range(8):
        task = m.task(k, 4)
        assert task is not None
        _, env = episodes.make(task, 0)
        kinds[task.kind] = type(env).__name__
    assert kinds == {"arithmetic": "ToolEnvironment", "unitconv": "ConversionEnvironment"}


class _NoCaller:
    async def call(self, name: str, arguments: str, call_id: str) -> Any:
        raise AssertionError("no tool call here")


# -- per-task figures ----------------------------------------------------------------------


def _traj(task: str, reward: float, member: int = 0) -> Trajectory:
    return Trajectory(
        traj_id=f"g-{member}", group_id="g", task_id="t", member=member, num_generations=2,
        **pack_arrays([1], [1], [0.0]), prompt_len=0, reward=reward, status="ok",
        versions=[0], task=task,
    )  # fmt: skip


def _group(task: str, *rewards: float) -> Group:
    members = [_traj(task, r, i) for i, r in enumerate(rewards)]
    return Group(group_id="g", task_id="t", members=members, advantages=[0.0] * len(rewards))


def test_a_steps_figures_per_task_by_hand() -> None:
    groups = [_group("a", 1.0, 0.0), _group("b", 0.5, 0.5), _group("a", 1.0, 1.0)]
    got = task_figures(groups, solved_reward=1.0)
    assert got == {
        "a": TaskFigures(groups=2, sequences=4, reward_mean=0.75, solve_rate=0.75),
        "b": TaskFigures(groups=1, sequences=2, reward_mean=0.5, solve_rate=0.0),
    }


def test_status_pools_steps_per_task_weighted_by_sequences() -> None:
    def step(**tasks: TaskFigures) -> TrainMetrics:
        return TrainMetrics(
            step=1, version=1, loss=0.0, reward_mean=0.0, num_groups=1, num_sequences=1,
            num_tokens=1, clip_fraction=0.0, grad_norm=0.0, max_policy_lag=0,
            step_time_s=1.0, tasks=tasks,
        )  # fmt: skip

    steps = [
        step(a=TaskFigures(groups=1, sequences=2, reward_mean=1.0, solve_rate=1.0)),
        step(
            a=TaskFigures(groups=3, sequences=6, reward_mean=0.0, solve_rate=0.5),
            b=TaskFigures(groups=1, sequences=4, reward_mean=0.25, solve_rate=0.0),
        ),
    ]
    got = pooled_task_figures(steps)
    # a: (2 x 1.0 + 6 x 0.0) / 8 = 0.25 reward; (2 x 1 + 6 x 0.5) / 8 = 0.625 solved
    assert got["a"] == TaskFigures(groups=4, sequences=8, reward_mean=0.25, solve_rate=0.625)
    assert got["b"] == TaskFigures(groups=1, sequences=4, reward_mean=0.25, solve_rate=0.0)
    values = train_values(steps[1], "all", per_task=True)
    assert values["task/all/reward"] == 0.0
    assert values["task/a/solve_rate"] == 0.5 and values["task/b/groups_in_step"] == 1.0
    assert "task/a/reward" not in train_values(steps[1], "all")  # one task: no per-task names


def test_per_task_counters_round_trip_through_the_stats_hash() -> None:
    name = counters.per_task("unit.conv-2", counters.GROUPS)
    assert name == "task/unit.conv-2/groups"
    assert counters.split_per_task(name) == ("unit.conv-2", counters.GROUPS)
    assert counters.split_per_task(counters.GROUPS) is None
    assert counters.split_per_task("task/x/not_a_counter") is None
    with pytest.raises(KeyError, match="not counted per task"):
        counters.per_task("a", counters.TOOL_CALLS)
    stats = {name: 7, counters.per_task("a", counters.TASKS): 3, counters.GROUPS: 9}
    assert counters.by_task(stats) == {"unit.conv-2": {"groups": 7}, "a": {"tasks": 3}}
    assert task_totals(stats) == {"task/unit.conv-2/groups": 7.0, "task/a/tasks": 3.0}


def test_the_summary_tasks_block_by_hand() -> None:
    stats = {
        counters.per_task("a", counters.TASKS): 30,
        counters.per_task("b", counters.TASKS): 10,
        counters.per_task("a", counters.GROUPS): 28,
        counters.per_task("b", counters.GROUPS_DROPPED): 1,
    }
    f = TaskFigures
    steps = [
        (1, {"a": f(groups=3, sequences=12, reward_mean=0.2, solve_rate=0.1)}),
        (2, {"a": f(groups=2, sequences=8, reward_mean=0.4, solve_rate=0.3),
             "b": f(groups=1, sequences=4, reward_mean=1.0, solve_rate=1.0)}),
    ]  # fmt: skip
    got = task_summary(stats, steps, {"b": [[0, 0.0], [2, 0.5]]})
    assert got["a"]["tasks"] == 30 and got["a"]["groups"] == 28 and got["a"]["groups_trained"] == 5
    assert (got["a"]["mean_reward_first"], got["a"]["mean_reward_last"]) == (0.2, 0.4)
    assert got["a"]["rewards_per_step"] == [[1, 0.2], [2, 0.4]]
    assert got["a"]["eval"] == [] and got["a"]["eval_solve_rate_last"] is None
    assert got["b"]["groups_dropped"] == 1 and got["b"]["trajectories"] == 0
    assert got["b"]["solve_rate_per_step"] == [[2, 1.0]] and got["b"]["eval_solve_rate_last"] == 0.5
    # a run of one task has no tasks block
    assert task_summary({}, [(1, {"arithmetic": steps[0][1]["a"]})], {}) == {}


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"name": "no_such_pkg.mod:Task"}, "field `tasks[1].name`: cannot import"),
        ({"name": "arithmetic", "options": {"nope": 1}}, "unknown key `tasks[1].options.nope`"),
        ({"name": "unitconv", "options": {"max_value": 9}}, "tasks[1].num_prompts"),
    ],
    ids=["bad-name", "bad-option", "no-heldout-split"],
)
def test_a_bad_mixture_entry_is_named_by_its_index(entry: dict[str, Any], message: str) -> None:
    """A task's own errors name `task.<field>`; in a mixture they name the entry."""
    cfg = mix(ARITH, {**entry, "id": "b"}, trainer={"eval_every": 5, "eval_tasks": 50})
    with pytest.raises(ConfigError) as err:
        check_plugins(cfg)
    assert message in str(err.value)
    assert "`task." not in str(err.value)
