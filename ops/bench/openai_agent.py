"""The built-in agent against the same agent through the OpenAI-compatible endpoint (issue 31).

    .venv/bin/python -m ops.bench.openai_agent                 # 40 prompts x 3 epochs, 3 rounds
    .venv/bin/python -m ops.bench.openai_agent --greedy        # rollout.top_k = 1
    .venv/bin/python -m ops.bench.openai_agent --greedy --set model.warmstart_error_rate=0
                    # greedy on a warm start that always uses the calculator: tool turns

Each row is a `streamrl up` of the default config (configs/tiny.toml, its warm start
cached under build/model-cache) on `--prompts` generated prompts, `--epochs` times,
sampling as configured (each turn's seed derives from the run seed, the trajectory and the
turn, so both agents draw the same samples; `--greedy`: `rollout.top_k = 1`): the built-in
ToolAgent (its calculator calls run by the tool workers), then
`task.agent = "openai:examples.openai_agent.agent:main"` (the `openai` client calling the
rollout worker's endpoint, running the calculator itself). The trainer is stopped
(SIGSTOP) once rollout is ready, so that every trajectory is played by the same version-0
policy and the rollout has the 2 cores to itself: the rows differ only in how an episode
is played (`rollout.max_ready_groups` is raised to every group, so that groups the stopped
trainer does not take never hold rollout back). The run is stopped once every trajectory
is committed. Rows alternate, `--rounds` times, after a warm-up round not counted; all
share one persistent XLA compilation cache, so the counted rounds measure the agents, not
the compiler.

Figures:
- trajectories/s of the rollout worker at steady state: the trajectories committed after
  the first quarter over the time from that commit to the last (the first quarter is when
  each process traces and lowers the engine's programs for the shapes it meets, which the
  persistent cache does not save and which varies with the order the shapes come in);
- the trajectories both runs of a round played, compared per trajectory id on what the
  logs give: tokens, turns, reward, calls. "same" counts those equal in all four.

The baseline is the built-in agent of the same round.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ops.bench.admission import rollout_alone, xla_cache_env
from ops.bench.stragglers import events, ts

REPO = Path(__file__).resolve().parents[2]
AGENT = 'task.agent="openai:examples.openai_agent.agent:main"'


def run(work: Path, name: str, prompts: int, epochs: int, sets: list[str]) -> dict[str, Any]:
    """One `streamrl up`, rollout alone: its trajectories/s, trajectories and mean reward."""
    run_dir = work / name
    cmd = [sys.executable, "-m", "streamrl_workers.cli", "up", "--config", "configs/tiny.toml",
           "--run-dir", str(run_dir), "--set", "trainer.eval_every=0",
           "--set", f"task.num_prompts={prompts}", "--set", f"task.epochs={epochs}",
           "--set", f"rollout.max_ready_groups={prompts * epochs}",
           "--set", f'model.cache_dir="{REPO / "build" / "model-cache"}"']  # fmt: skip
    for s in sets:
        cmd += ["--set", s]
    env = xla_cache_env(work)
    with (work / f"{name}.out").open("w") as sink:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True, env=env)  # fmt: skip
    why = rollout_alone(proc, run_dir, prompts * epochs * 4, timeout_s=900)
    proc.wait(timeout=120)
    if why:
        raise SystemExit(f"{name}: {why}; see {work / f'{name}.out'}")
    log = events(run_dir / "logs" / "rollout-0.log")
    commits = sorted((e for e in log if e["event"] == "trajectories_committed"), key=ts)
    trajs = {t["traj_id"]: t for e in commits for t in e["trajectories"]}
    done = 0
    for e in commits:  # the commit that completes the first quarter starts the window
        done += len(e["trajectories"])
        if done >= len(trajs) / 4:
            start = ts(e)
            break
    return {
        "traj_s": (len(trajs) - done) / (ts(commits[-1]) - start),
        "trajs": trajs,
        "reward": statistics.fmean(t["reward"] for t in trajs.values()),
        "turns": statistics.fmean(len(t["versions"]) for t in trajs.values()),
    }


def _key(t: dict[str, Any]) -> tuple[Any, ...]:
    return (t["tokens"], len(t["versions"]), t["reward"], t["tool_calls"])


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--prompts", type=int, default=40, help="generated prompts (4 episodes each)")
    p.add_argument("--epochs", type=int, default=3, help="times each prompt is played")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--greedy", action="store_true", help="rollout.top_k = 1 in both runs")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="a setting of both runs (a row that changes one says so)")  # fmt: skip
    args = p.parse_args()
    extra = [*(["rollout.top_k=1"] if args.greedy else []), *args.set]
    rows = []
    with tempfile.TemporaryDirectory(prefix="oa-bench-") as tmp:
        work = Path(tmp)
        for r in range(-1, args.rounds):  # round -1 warms the compilation cache
            built = run(work, f"builtin-{r}", args.prompts, args.epochs, extra)
            agent = run(work, f"endpoint-{r}", args.prompts, args.epochs, [*extra, AGENT])
            both = sorted(set(built["trajs"]) & set(agent["trajs"]))
            same = sum(_key(built["trajs"][t]) == _key(agent["trajs"][t]) for t in both)
            print(f"# round {r}: {built['traj_s']:.2f} vs {agent['traj_s']:.2f} traj/s, "
                  f"{same} of {len(both)} trajectories the same", file=sys.stderr)  # fmt: skip
            if r >= 0:
                rows.append((r, built, agent, len(both), same))
    how = "greedy" if args.greedy else "sampled (the same per-turn seeds)"
    if args.set:
        how += ", " + ", ".join(args.set)
    print(f"\n### built-in agent vs the endpoint agent: default config, rollout alone, {how}, "
          f"{args.prompts} prompts x {args.epochs} epochs, {args.rounds} rounds after a "
          "warm-up; trajectories/s after the first quarter\n")  # fmt: skip
    print("| round | built-in traj/s | endpoint traj/s | ratio | trajectories compared | same "
          "| mean turns built-in / endpoint | mean reward built-in / endpoint |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---|---|")
    for r, b, a, n, same in rows:
        print(f"| {r} | {b['traj_s']:.2f} | {a['traj_s']:.2f} | {a['traj_s'] / b['traj_s']:.2f} "
              f"| {n} | {same} | {b['turns']:.2f} / {a['turns']:.2f} "
              f"| {b['reward']:.3f} / {a['reward']:.3f} |")  # fmt: skip
    ratios = [a["traj_s"] / b["traj_s"] for _, b, a, _, _ in rows]
    print(f"\nmedian ratio {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
