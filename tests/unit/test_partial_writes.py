"""What a trainer killed mid-write leaves is removed at the next trainer's start (review
part 3: one model size per kill, for ever), and nothing else is."""

from __future__ import annotations

from pathlib import Path

import structlog

from streamrl.names import RunPaths
from streamrl.trainer.hooks import remove_partial_writes


def test_partial_writes_go_and_the_rest_stays(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    paths.weights.mkdir(parents=True)
    pending = tmp_path / "eval" / "pending"
    pending.mkdir(parents=True)
    kept = [
        paths.weights / "v000003.weights",
        paths.export / "model.safetensors",
        pending / "step-4" / "model.safetensors",
        tmp_path / "eval" / ".step-4.json.tmp",  # the evaluator's own, maybe being written
    ]
    gone = [
        paths.weights / ".v000004.weights.k2j3.tmp",
        tmp_path / ".export-abc123" / "model.safetensors",
        pending / ".step-6-x1y2" / "model.safetensors",
    ]
    for f in (*kept, *gone):
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(b"x" * 64)
    removed = remove_partial_writes(tmp_path, structlog.get_logger())
    assert sorted(removed) == [".export-abc123", ".step-6-x1y2", ".v000004.weights.k2j3.tmp"]
    assert all(f.exists() for f in kept)
    assert not any(
        f.exists() or (f.parent.exists() and f.parent.name.startswith(".")) for f in gone
    )
    assert remove_partial_writes(tmp_path, structlog.get_logger()) == []


def test_a_stderr_file_rolls_over_and_its_writer_goes_on(tmp_path: Path) -> None:
    """Review part 3: `RUN_DIR/logs/<id>.stderr` grew without bound. The launcher rolls it
    over past run.log_max_mb by copy and truncate, so the worker that holds it open (append
    mode) keeps writing at its new end; `log_backups` copies are kept."""
    from streamrl.run.logs import cap_file

    path = tmp_path / "rollout-0.stderr"
    mb = 2**20
    with open(path, "ab") as writer:  # as the worker's stderr: opened once, in append mode
        for round_ in range(4):
            writer.write(bytes([65 + round_]) * (mb + 10))
            writer.flush()
            assert cap_file(path, 1.0, backups=2)
            writer.write(b"after\n")
            writer.flush()
            assert path.read_bytes() == b"after\n"  # written at the start of the emptied file
        assert not cap_file(path, 1.0, backups=2)  # under the limit: left alone
    backups = sorted(p.name for p in tmp_path.iterdir() if p != path)
    assert backups == ["rollout-0.stderr.1", "rollout-0.stderr.2"]
    assert (tmp_path / "rollout-0.stderr.1").read_bytes()[-1:] == b"D"  # the newest
    assert (tmp_path / "rollout-0.stderr.2").read_bytes()[-1:] == b"C"
    assert not cap_file(tmp_path / "missing.stderr", 1.0, 2)
