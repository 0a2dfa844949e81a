"""The built-in agent against the same agent through the OpenAI-compatible endpoint (issue 31).

    .venv/bin/python -m ops.bench.openai_agent                 # 3 rounds of both, 4 steps

Each row is a whole `streamrl up` of the default config (configs/tiny.toml, its warm start
cached under build/model-cache) for `--steps` trainer steps, the evaluator off, sampling
as configured (each turn's seed derives from the run seed, the trajectory and the turn, so
both agents draw the same samples; `--greedy`: `rollout.top_k = 1`): the built-in
ToolAgent, then `task.agent = "openai:examples.openai_agent.agent:main"` (the `openai`
client calling the rollout worker's endpoint, running the calculator itself). Rows
alternate, `--rounds` times.

Figures:
- trajectories/s of the rollout worker, from its `rollout_ready` to its last commit;
- the trajectories both runs of a round played at policy version 0 only (the first waves,
  before any weight update: the same policy on the same prompts and seeds), compared per
  trajectory id on what the logs give: tokens, turns, reward, calls. "same" counts those
  equal in all four.

The baseline is the built-in agent of the same round.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ops.bench.stragglers import events, ts

REPO = Path(__file__).resolve().parents[2]
AGENT = 'task.agent="openai:examples.openai_agent.agent:main"'


def run(work: Path, name: str, steps: int, sets: list[str]) -> dict[str, Any]:
    """One `streamrl up`: its rollout's trajectories/s, trajectories and mean reward."""
    run_dir = work / name
    cmd = [sys.executable, "-m", "streamrl_workers.cli", "up", "--config", "configs/tiny.toml",
           "--steps", str(steps), "--run-dir", str(run_dir), "--set", "trainer.eval_every=0",
           "--set", f'model.cache_dir="{REPO / "build" / "model-cache"}"']  # fmt: skip
    for s in sets:
        cmd += ["--set", s]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: rc {proc.returncode}\n{proc.stdout[-2000:]}")
    log = events(run_dir / "logs" / "rollout-0.log")
    ready = min(ts(e) for e in log if e["event"] == "rollout_ready")
    commits = [e for e in log if e["event"] == "trajectories_committed"]
    trajs = {t["traj_id"]: t for e in commits for t in e["trajectories"]}
    end = max(ts(e) for e in commits)
    return {
        "wall_s": time.monotonic() - start,
        "traj_s": len(trajs) / (end - ready),
        "trajs": trajs,
        "reward": statistics.fmean(t["reward"] for t in trajs.values()),
    }


def _key(t: dict[str, Any]) -> tuple[Any, ...]:
    return (t["tokens"], len(t["versions"]), t["reward"], t["tool_calls"])


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--greedy", action="store_true", help="rollout.top_k = 1 in both runs")
    args = p.parse_args()
    extra = ["rollout.top_k=1"] if args.greedy else []
    rows = []
    with tempfile.TemporaryDirectory(prefix="oa-bench-") as tmp:
        work = Path(tmp)
        for r in range(args.rounds):
            built = run(work, f"builtin-{r}", args.steps, extra)
            agent = run(work, f"endpoint-{r}", args.steps, [*extra, AGENT])
            v0 = [
                tid
                for tid, t in built["trajs"].items()
                if set(t["versions"]) == {0}
                and tid in agent["trajs"]
                and set(agent["trajs"][tid]["versions"]) == {0}
            ]
            same = sum(_key(built["trajs"][t]) == _key(agent["trajs"][t]) for t in v0)
            rows.append((r, built, agent, len(v0), same))
            print(f"# round {r}: {built['traj_s']:.2f} vs {agent['traj_s']:.2f} traj/s, "
                  f"{same} of {len(v0)} v0 trajectories the same", file=sys.stderr)  # fmt: skip
    how = "greedy" if args.greedy else "sampled (the same per-turn seeds)"
    print(f"\n### built-in agent vs the endpoint agent: default config, {how}, {args.steps} "
          f"steps, {args.rounds} rounds\n")  # fmt: skip
    print("| round | built-in traj/s | endpoint traj/s | ratio | v0 trajectories compared "
          "| same | mean reward built-in / endpoint |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---|")
    for r, b, a, n, same in rows:
        print(f"| {r} | {b['traj_s']:.2f} | {a['traj_s']:.2f} | {a['traj_s'] / b['traj_s']:.2f} "
              f"| {n} | {same} | {b['reward']:.3f} / {a['reward']:.3f} |")  # fmt: skip
    ratios = [a["traj_s"] / b["traj_s"] for _, b, a, _, _ in rows]
    print(f"\nmedian ratio {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
