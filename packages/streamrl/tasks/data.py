"""Prompts from data: a local JSONL or Parquet file, or a directory that the `datasets`
library's `save_to_disk` wrote (a Dataset, or a DatasetDict of which `task.split` is read).

The feeder's cursor counts tasks over the whole run; cursor c reads row
`order(epoch)[c % n]` of epoch `c // n`, where `order` is a permutation seeded by the run
seed and the epoch (`task.shuffle`), or the file's order. So a cursor names one row for
ever, and a run resumed from its cursor continues exactly where the data was.
"""

from __future__ import annotations

import functools
import importlib
import json
import random
from pathlib import Path
from types import ModuleType
from typing import Protocol

from streamrl.config import TaskConfig
from streamrl.plugins import PluginError


class DataError(PluginError):
    """A dataset that cannot be read; names `task.dataset` and the file."""


# A data row: column -> value (JSON values from a JSONL file; Arrow's Python values, such as
# datetime or bytes, from a table), passed to the task as its prompt's data.
Row = dict[str, object]


class Rows(Protocol):
    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Row: ...


class JsonlRows:
    """A JSONL file read into memory once, one JSON object a line (blank lines skipped)."""

    def __init__(self, path: Path) -> None:
        rows: list[Row] = []
        with path.open(encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise DataError(
                        f"field `task.dataset`: {path} line {n} is not JSON: {err.msg}"
                    ) from None
                if not isinstance(row, dict):
                    raise DataError(f"field `task.dataset`: {path} line {n} is not an object")
                rows.append(row)
        self._rows = rows

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index: int) -> Row:
        return self._rows[index]


class Table(Protocol):
    """What `ArrowRows` uses of a `pyarrow.Table`."""

    @property
    def num_rows(self) -> int: ...

    def slice(self, offset: int, length: int) -> Table: ...

    def to_pylist(self) -> list[Row]: ...


class ArrowRows:
    """Rows of an Arrow table (Parquet, or a saved `datasets` dataset)."""

    def __init__(self, table: Table) -> None:
        self._table = table

    def __len__(self) -> int:
        return int(self._table.num_rows)

    def __getitem__(self, index: int) -> Row:
        row: Row = self._table.slice(index, 1).to_pylist()[0]
        return row


def open_rows(cfg: TaskConfig) -> Rows:
    """The rows `task.dataset` names, checked to hold `task.prompt_field`."""
    path = Path(cfg.dataset).expanduser()
    if not path.exists():
        raise DataError(f"field `task.dataset`: {path} does not exist")
    rows: Rows
    if path.is_dir():
        rows = _saved_dataset(path, cfg.split)
    elif path.suffix == ".jsonl":
        rows = JsonlRows(path)
    elif path.suffix == ".parquet":
        rows = ArrowRows(_module("pyarrow.parquet", path).read_table(path))
    else:
        raise DataError(
            f"field `task.dataset`: {path}: expected a .jsonl or .parquet file or a directory "
            "written by datasets' save_to_disk"
        )
    if len(rows) == 0:
        raise DataError(f"field `task.dataset`: {path} has no rows")
    if cfg.prompt_field not in rows[0]:
        raise DataError(
            f"field `task.prompt_field`: `{cfg.prompt_field}` is not a column of {path}; "
            f"columns: {sorted(rows[0])}"
        )
    return rows


def _module(name: str, path: Path) -> ModuleType:
    """An optional dependency of the data readers, or a DataError that says where it is."""
    try:
        return importlib.import_module(name)
    except ImportError:
        raise DataError(
            f"field `task.dataset`: reading {path} needs `{name.partition('.')[0]}`, which "
            "this environment lacks (the light image has none: run the feeder from the full one)"
        ) from None


def _saved_dataset(path: Path, split: str) -> Rows:
    datasets = _module("datasets", path)

    try:
        loaded = datasets.load_from_disk(str(path))
    except FileNotFoundError as err:
        raise DataError(
            f"field `task.dataset`: {path} is not a directory datasets' save_to_disk wrote: {err}"
        ) from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DataError(f"field `task.split`: no split `{split}` in {path}; {list(loaded)}")
        loaded = loaded[split]
    return ArrowRows(loaded.data.table)


class DataSource:
    """Dataset rows by cursor: epochs, a seeded shuffle per epoch and an end."""

    def __init__(self, rows: Rows, seed: int, shuffle: bool, epochs: int) -> None:
        self.rows = rows
        self.seed = seed
        self.shuffle = shuffle
        self.epochs = epochs

    @property
    def end(self) -> int | None:
        """The first cursor past the last epoch (None: no end)."""
        return self.epochs * len(self.rows) if self.epochs else None

    def row_index(self, cursor: int) -> int:
        epoch, position = divmod(cursor, len(self.rows))
        return self._order(epoch)[position] if self.shuffle else position

    def row(self, cursor: int) -> Row:
        return self.rows[self.row_index(cursor)]

    @functools.lru_cache(maxsize=4)  # noqa: B019 - one source per process, a few epochs
    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order
