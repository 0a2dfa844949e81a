"""`streamrl eval` as a subprocess with real JAX: a random-weight tiny checkpoint on the
held-out split, its JSON result, the gate against a much better baseline and against
itself, and the same policy read from a run directory's Orbax checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp
import pytest

from streamrl import checkpoints as ckpts
from streamrl.config import load_config
from streamrl.model.checkpoint import load_checkpoint
from streamrl.model.tiny import ensure_checkpoint
from streamrl.trainer.step import init_state, make_optimizer
from tests.helpers import REPO, TINY, devices_env

N, SAMPLES = 6, 2


def _sets(cache: Path) -> list[str]:
    # The tiny model as built (random weights, no warm start); short turns keep it quick.
    return [f"model.cache_dir={cache}", "model.init=checkpoint", "rollout.max_turn_tokens=16"]


def run_eval(cache: Path, *args: str) -> subprocess.CompletedProcess[str]:
    sets = [a for s in _sets(cache) for a in ("--set", s)]
    return subprocess.run(
        [sys.executable, "-m", "streamrl_workers.cli", "eval", "--config", str(TINY), *sets,
         *args],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def ckpt(cache: Path) -> Path:
    return ensure_checkpoint(load_config(TINY, _sets(cache)))


@pytest.fixture(scope="module")
def baseline(cache: Path, ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The random checkpoint's own result, greedy and 2 samples a task."""
    out = tmp_path_factory.mktemp("eval") / "base.json"
    r = run_eval(cache, "--checkpoint", str(ckpt), "--n", str(N), "--samples", str(SAMPLES),
                 "--json", "--output", str(out))  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == json.loads(out.read_text())
    return out


def _check_estimate(e: dict[str, Any], rate: bool) -> None:
    assert e["lo"] <= e["value"] <= e["hi"]
    if rate:
        assert e["lo"] >= 0.0 and e["hi"] <= 1.0


def _check_pass(p: dict[str, Any], episodes: int) -> None:
    assert p["episodes"] == episodes
    for name in ("solve_rate", "truncation_rate", "error_rate"):
        _check_estimate(p[name], rate=True)
        assert p[name]["n"] == episodes
    for name in ("reward_mean", "turns_mean", "tokens_mean"):
        _check_estimate(p[name], rate=False)
    wf = p["tool_call_wellformed_rate"]
    assert (wf is None) == (p["tool_calls"] == 0)
    if wf is not None:
        _check_estimate(wf, rate=True)
        assert wf["n"] == p["tool_calls"]
    # Every episode ran at least one model turn and sampled at least one token.
    assert p["turns_mean"]["lo"] >= 1 and p["tokens_mean"]["value"] >= 1


def test_the_result_is_complete_and_consistent(baseline: Path) -> None:
    res = json.loads(baseline.read_text())
    assert (res["n"], res["samples"], res["task"], res["step"]) == (N, SAMPLES, "arithmetic", None)
    assert res["split"]["first_cursor"] == 1_000_000_000 and len(res["split"]["digest"]) == 16
    _check_pass(res["greedy"], N)
    _check_pass(res["sampled"], N * SAMPLES)
    assert res["solve_rate"] == res["greedy"]["solve_rate"]["value"]
    pass_k = res["sampled"]["pass_at_k"]
    assert sorted(pass_k) == ["1", "2"]
    for e in pass_k.values():
        _check_estimate(e, rate=True)
        assert e["n"] == N  # over tasks
    # pass@1 of K samples is the sampled solve rate; pass@2 is at least pass@1.
    assert pass_k["1"]["value"] == pytest.approx(res["sampled"]["solve_rate"]["value"])
    assert pass_k["2"]["value"] >= pass_k["1"]["value"]
    # Random weights solve nothing (the gate test below relies on it).
    assert res["solve_rate"] == 0.0


def test_the_gate_fails_against_a_much_better_baseline_and_passes_against_itself(
    cache: Path, ckpt: Path, baseline: Path, tmp_path: Path
) -> None:
    better = json.loads(baseline.read_text())
    better["solve_rate"] = better["greedy"]["solve_rate"]["value"] = 0.95
    good = tmp_path / "good.json"
    good.write_text(json.dumps(better))
    args = ["--checkpoint", str(ckpt), "--n", str(N), "--json", "--tolerance", "0.1"]
    r = run_eval(cache, *args, "--gate", str(good))
    assert r.returncode == 1, r.stderr  # evalstats.EXIT_GATE_FAILED
    gate = json.loads(r.stdout)["gate"]
    assert not gate["passed"] and gate["baseline_solve_rate"] == 0.95
    assert "gate FAILED" in r.stderr and "below baseline 0.9500 - tolerance 0.1" in r.stderr
    r = run_eval(cache, *args, "--gate", str(baseline))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["gate"]["passed"] and "gate passed" in r.stderr
    # Not a result at all: a usage error, not a verdict.
    (tmp_path / "junk.json").write_text("{}")
    r = run_eval(cache, *args, "--gate", str(tmp_path / "junk.json"))
    assert r.returncode == 2 and "not a `streamrl eval --json` result" in r.stderr


def test_a_run_directory_is_evaluated_from_its_newest_complete_checkpoint(
    cache: Path, ckpt: Path, baseline: Path, tmp_path: Path
) -> None:
    r = run_eval(cache, "--run-dir", str(tmp_path), "--n", "2")
    assert r.returncode == 2 and "no complete checkpoint" in r.stderr
    # A trainer checkpoint (Orbax state, queue snapshot, commit marker) holding the tiny
    # checkpoint's own params: the same policy, so the same greedy episodes.
    cfg = load_config(TINY, _sets(cache))
    _, params = load_checkpoint(ckpt)
    optimizer = make_optimizer(cfg.trainer)
    state = init_state(params, optimizer)
    tree = {"params": state.params, "opt_state": state.opt_state, "step": state.step}
    save(tmp_path / "checkpoints", 7, tree, snapshot())
    r = run_eval(cache, "--run-dir", str(tmp_path), "--n", str(N), "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["step"] == 7 and res["policy"].endswith("00000007")
    base = json.loads(baseline.read_text())
    assert res["split"] == base["split"]
    for name in ("solve_rate", "truncation_rate", "tokens_mean", "transcripts_digest"):
        assert res["greedy"][name] == base["greedy"][name]
    # A newer checkpoint of other weights, written in shards by a trainer on a 2-device
    # mesh, is the one evaluated (whole, on this process's one device): other tokens.
    script = (
        "import sys, jax; from pathlib import Path; from streamrl.config import load_config; "
        "from streamrl.model.checkpoint import load_checkpoint; "
        "from streamrl.trainer.step import init_state, make_optimizer, make_train_mesh; "
        "from tests.integration.test_eval_cli import save, snapshot; "
        "cfg = load_config(sys.argv[1]); _, p = load_checkpoint(sys.argv[2]); "
        "p = jax.tree.map(lambda x: x * 3.0, p); o = make_optimizer(cfg.trainer); "
        "s = init_state(p, o, mesh=make_train_mesh(1, 2)); "
        "assert any(len(x.sharding.device_set) == 2 for x in jax.tree.leaves(s.params)); "
        "save(Path(sys.argv[3]), 8, {'params': s.params, 'opt_state': s.opt_state, "
        "'step': s.step}, snapshot())"
    )
    env = devices_env(2)
    w = subprocess.run([sys.executable, "-c", script, str(TINY), str(ckpt),
                        str(tmp_path / "checkpoints")], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert w.returncode == 0, w.stderr
    r = run_eval(cache, "--run-dir", str(tmp_path), "--n", str(N), "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["step"] == 8
    assert res["greedy"]["transcripts_digest"] != base["greedy"]["transcripts_digest"]


def snapshot() -> ckpts.QueueSnapshot:
    """An empty queue snapshot (the checkpoint's, of a run whose queues were empty)."""
    return ckpts.QueueSnapshot(ckpts.SNAPSHOT_VERSION, "run", 0, [], [], {}, {}, [], [], {}, {})


def save(root: Path, step: int, tree: Any, snap: ckpts.QueueSnapshot) -> None:
    """A trainer checkpoint of `tree` as the checkpoint hook writes one (Orbax state, meta,
    queue snapshot, commit marker)."""
    checkpointer = ocp.StandardCheckpointer()

    def write_state(path: Path) -> None:
        checkpointer.save(path.resolve(), tree)
        checkpointer.wait_until_finished()

    try:
        ckpts.write_checkpoint(root, step, write_state, {"lineage": []}, snap)
    finally:
        checkpointer.close()
