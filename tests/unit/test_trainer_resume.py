"""A trainer checkpoint's meta.json as a typed struct: what older checkpoints mean, and the
window of records a resume may need."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import msgspec
import pytest

from streamrl import checkpoints as ckpts
from streamrl.trainer.resume import CheckpointMeta, window_start


def write_meta(root: Path, step: int, meta: Mapping[str, object]) -> Path:
    path = ckpts.step_dir(root, step)
    path.mkdir(parents=True)
    (path / ckpts.META).write_text(json.dumps(meta))
    return path


def test_meta_round_trips_as_the_json_it_always_was(tmp_path: Path) -> None:
    meta = CheckpointMeta(
        step=3, version=4, seed=0, lineage=[(2, ["g1"]), (3, ["g2", "g3"])],
        set_aside=[(3, ["1-0"])], lineage_from=2, groups_trained=9,
    )  # fmt: skip
    as_json = meta.to_dict()
    assert as_json["lineage"] == [[2, ["g1"]], [3, ["g2", "g3"]]]  # lists, as tests read them
    assert CheckpointMeta.read(write_meta(tmp_path, 3, as_json)) == meta
    assert meta.trained == 9


def test_an_older_meta_means_what_it_meant(tmp_path: Path) -> None:
    # written before the trainer set groups aside, kept a count, or recorded its window:
    # nothing set aside, the window's groups (1 + 2 = 3), keep every record (0)
    lineage = [[2, ["a"]], [3, ["b", "c"]]]
    old = CheckpointMeta.read(
        write_meta(tmp_path, 3, {"step": 3, "version": 3, "lineage": lineage})
    )
    assert (old.set_aside, old.trained, old.lineage_from, old.seed) == ([], 3, 0, None)


def test_a_meta_of_the_wrong_shape_is_refused(tmp_path: Path) -> None:
    path = write_meta(tmp_path, 1, {"step": "one", "version": 1, "lineage": []})
    with pytest.raises(msgspec.ValidationError, match="step"):
        CheckpointMeta.read(path)


def test_window_start_is_the_oldest_step_any_checkpoint_needs(tmp_path: Path) -> None:
    assert window_start(tmp_path) == 0  # no checkpoint
    for step, start in ((4, 3), (8, 6)):
        write_meta(tmp_path, step, {"step": step, "version": step, "lineage": [],
                                    "lineage_from": start})  # fmt: skip
    assert window_start(tmp_path) == 3
    (ckpts.step_dir(tmp_path, 8) / ckpts.META).write_text("{not json")
    assert window_start(tmp_path) == 0  # unreadable: keep everything
