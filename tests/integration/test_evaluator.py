"""The run's evaluator process (`streamrl eval --watch`, trainer.eval_every) on real
snapshots: a damaged one is set aside and the evaluator goes on; a drain ends it."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from streamrl.config import load_config
from streamrl.evaluation import watch as evalrun
from streamrl.model.tiny import ensure_checkpoint
from streamrl.run.launcher import evaluator_command
from tests.helpers import REPO, TINY


def test_evaluator_sets_aside_a_damaged_snapshot_and_drains(tmp_path: Path) -> None:
    sets = [f'model.cache_dir="{tmp_path / "cache"}"', "model.init=checkpoint",
            "rollout.max_turn_tokens=16", "trainer.eval_all=true"]  # fmt: skip
    base = ensure_checkpoint(load_config(TINY, sets))  # random weights
    run_dir = tmp_path / "run"
    root = evalrun.eval_dir(run_dir)
    bad = root / evalrun.PENDING / "step-2"
    shutil.copytree(base, bad)
    (bad / "model.safetensors").write_bytes(b"damaged")
    good = root / evalrun.PENDING / "step-4"
    shutil.copytree(base, good)
    (good / evalrun.SNAPSHOT_WRITTEN).write_text("123.5")
    # A claim a dead evaluator left behind is evaluated too.
    left = root / evalrun.RUNNING / "step-6"
    shutil.copytree(base, left)
    evalrun.request_drain(root)

    cmd = evaluator_command(TINY, run_dir, sets, tasks=8)
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert p.returncode == 0, p.stdout + p.stderr
    assert (root / evalrun.FAILED / "step-2").is_dir()
    log = (run_dir / "logs" / "evaluator.log").read_text()
    assert '"eval_snapshot_unreadable"' in log and "not a readable safetensors" in log
    assert '"eval_claims_released"' in log and '"evaluator_done"' in log
    r4 = json.loads((root / "step-4.json").read_text())
    assert (r4["step"], r4["n"], r4["written_at"]) == (4, 8, 123.5)
    assert r4["solve_rate"] == 0.0  # random weights never call the calculator right
    assert json.loads((root / "step-6.json").read_text())["step"] == 6
    assert evalrun.pending(root) == [] and not any((root / evalrun.RUNNING).iterdir())
    summary = evalrun.eval_summary(root)
    assert summary["eval"] == [[4, 0.0], [6, 0.0]]
