"""Prompts from data: JSONL, Parquet and saved `datasets` directories, a seeded order per
epoch, the end after `task.epochs`, and errors that name the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from streamrl.config import ConfigError, parse_config
from streamrl.tasks.data import DataError
from streamrl.tasks.registry import TaskSource, check_plugins

ROWS = [{"question": f"q{i}", "solution": str(i * i), "level": i % 3} for i in range(10)]


def source(dataset: Path, **task: Any) -> TaskSource:
    cfg = parse_config(
        {
            "task": {
                "name": "tests.plugin_fixtures:EchoTask",
                "dataset": str(dataset),
                "prompt_field": "question",
                "answer_field": "solution",
                **task,
            }
        }
    )
    return TaskSource(cfg.task, seed=7)


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_rows_become_tasks(tmp_path: Path) -> None:
    src = source(write_jsonl(tmp_path / "p.jsonl", ROWS), shuffle=False)
    t = src.task(12, 4)  # epoch 1, position 2
    assert (t.prompt, t.answer, t.data, t.cursor, t.group_id) == (
        "q2",
        "4",
        {"question": "q2", "solution": "4", "level": 2},
        12,
        "g000000012",
    )
    assert src.end is None


def test_shuffle_is_seeded_new_each_epoch_and_a_permutation(tmp_path: Path) -> None:
    src = source(write_jsonl(tmp_path / "p.jsonl", ROWS), epochs=3)
    epochs = [[src.task(e * 10 + i, 2).prompt for i in range(10)] for e in range(3)]
    assert all(sorted(e) == sorted(str(r["question"]) for r in ROWS) for e in epochs)
    assert epochs[0] != epochs[1]  # reshuffled per epoch
    again = source(write_jsonl(tmp_path / "q.jsonl", ROWS), epochs=3)
    assert [again.task(i, 2).prompt for i in range(30)] == [
        p for e in epochs for p in e
    ]  # the same order
    assert src.end == 30


def test_parquet_and_saved_datasets_read_the_same_rows(tmp_path: Path) -> None:
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "p.parquet")
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[:2])}
    ).save_to_disk(str(tmp_path / "dd"))
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "ds"))
    want = [r["question"] for r in ROWS]
    for path, split in [("p.parquet", "train"), ("dd", "train"), ("ds", "ignored")]:
        src = source(tmp_path / path, shuffle=False, split=split)
        assert [src.task(i, 2).prompt for i in range(10)] == want, path
        assert src.task(3, 2).data == ROWS[3]
    test_split = source(tmp_path / "dd", shuffle=False, split="test")
    assert [test_split.task(i, 2).prompt for i in range(4)] == ["q0", "q1", "q0", "q1"]
    with pytest.raises(DataError, match=r"`task.split`: no split `dev`"):
        source(tmp_path / "dd", split="dev")


def test_bad_datasets_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"`task.dataset`: .*missing.jsonl does not exist"):
        source(tmp_path / "missing.jsonl")
    with pytest.raises(DataError, match=r"`task.prompt_field`: `question` is not a column"):
        source(write_jsonl(tmp_path / "p.jsonl", [{"text": "x"}]))
    (tmp_path / "bad.jsonl").write_text('{"question": "a"}\nnot json\n')
    with pytest.raises(DataError, match=r"bad.jsonl line 2 is not JSON"):
        source(tmp_path / "bad.jsonl")
    (tmp_path / "p.csv").write_text("question\na\n")
    with pytest.raises(DataError, match=r"expected a .jsonl or .parquet file"):
        source(tmp_path / "p.csv")
    # the launcher's check reaches the data too
    cfg = parse_config({"task": {"dataset": str(tmp_path / "none.jsonl")}})
    with pytest.raises(ConfigError, match=r"none.jsonl does not exist"):
        check_plugins(cfg)
