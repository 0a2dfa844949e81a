"""Adaptive admission against fixed concurrency on the real engine (issue 29 item 4).

    .venv/bin/python -m ops.bench.admission --rollout-only       # C 8,16,32,64 and auto
    .venv/bin/python -m ops.bench.admission --fixed 16,64 --groups 32 --repeats 3

Each row is a whole `streamrl up` of the built-in tiny transformer (random init: its
answers are noise, which is all a throughput bench needs) on the synthetic task with
`--turns` environment steps an episode (each a drawn latency, 90 % 50 ms / 10 % 500 ms):
multi-turn episodes whose KV slot is parked between turns, first prompts of
`--prompt-words` words (about 4 tokens each: a conversation long enough that re-prefilling
an evicted one is not free). The engine's pool has `--slots` slots
(`rollout.max_batch_size`); each fixed row sets `rollout.max_concurrency`, the auto row
sets it to "auto" (cap `--cap`). `--groups` prompts, `task.epochs = 1`. `--rollout-only`
stops the trainer (SIGSTOP) once rollout is ready, so that the engine has the 2 cores
alone and the rows differ only in admission.

Rows run in interleaved rounds (`--repeats`, after `--warmup` rounds not counted), all
with one persistent XLA compilation cache, so the counted rounds measure the engine, not
the compiler; the table gives each row's median and its runs.

Figures, per row:
- goodput: tokens of the trajectories the policy finished (ok or truncated; prompt and
  sampled, as committed) over the window from the rollout worker's `rollout_ready` to its
  last commit;
- episodes/s over the same window;
- evictions: parked sessions the engine evicted for another request (each one prefills its
  whole conversation again), from the rollout's `rollout_stop` line;
- the admission limit at the end, its trims and its latency ceiling (None: none capped);
- the engine's decode calls by their rows (a bucket): milliseconds a call took per active
  row, the cost per token that the latency ceiling compares;
- the engine's decode calls: rows a call (and the share of them active: the rest pad the
  batch to a power of two) and the positions a row attended (the call's live span).

The baseline is the best fixed row of the same run (the highest median goodput): "of best
fixed" is a row's median goodput over it; "paired" the median over rounds of the row's
goodput over the baseline's in the same round, and "rounds >= it" in how many rounds the
row reached the baseline's goodput (the machine's slow and fast minutes fall on both sides
of a paired ratio).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ops.bench.stragglers import events, ts

REPO = Path(__file__).resolve().parents[2]
VOCAB = ("alpha", "bravo", "charlie", "delta", "echo", "the", "of", "and", "to", "value")

CONFIG = """\
[run]
name = "admission"
seed = 0

[task]
name = "synthetic"

[task.options]
turns = {turns}
latency = "mixture"
mixture = [[0.9, 0.05], [0.1, 0.5]]

[model]
max_seq_len = 1024

[rollout]
max_batch_size = {slots}
kv_cache_size = 1024
max_prompt_length = 768
max_response_length = 256
"""


def _rollout_events(run_dir: Path) -> list[dict[str, Any]]:
    logs = sorted((run_dir / "logs").glob("rollout-*.log"))
    return [e for p in logs for e in events(p)]


def _committed(run_dir: Path) -> int:
    return sum(
        len(e["trajectories"])
        for e in _rollout_events(run_dir)
        if e.get("event") == "trajectories_committed"
    )


def rollout_alone(
    proc: subprocess.Popen[str], run_dir: Path, episodes: int, timeout_s: float
) -> str:
    """--rollout-only: stop the trainer (SIGSTOP) once rollout is ready, so the engine has
    the CPU to itself; once `episodes` trajectories are committed, let it go and stop the
    run (SIGTERM to the launcher). Returns why it gave up, or ""."""
    deadline = time.monotonic() + timeout_s
    trainer = 0
    while not trainer or not any(
        e.get("event") == "rollout_ready" for e in _rollout_events(run_dir)
    ):
        if proc.poll() is not None or time.monotonic() > deadline:
            return "the run did not get ready"
        launcher = run_dir / "logs" / "launcher.log"
        if launcher.exists():
            for e in events(launcher):
                if e.get("event") == "workers_started":
                    trainer = int(e["pids"]["trainer-0"])
        time.sleep(0.2)
    os.kill(trainer, signal.SIGSTOP)
    try:
        while _committed(run_dir) < episodes:
            if proc.poll() is not None or time.monotonic() > deadline:
                return f"{_committed(run_dir)} of {episodes} episodes in time"
            time.sleep(0.2)
    finally:
        with contextlib.suppress(ProcessLookupError):  # gone: restarted by the launcher
            os.kill(trainer, signal.SIGCONT)
        os.killpg(proc.pid, signal.SIGTERM)
    return ""


def xla_cache_env(work: Path) -> dict[str, str]:
    """This process's environment with one persistent XLA compilation cache under `work`
    for every run of a bench: the programs a run compiles are read back by the later ones,
    so their figures measure the engine, not XLA (a warm-up round fills it)."""
    return {
        **os.environ,
        "JAX_COMPILATION_CACHE_DIR": str(work / "xla-cache"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }


def long_prompt(i: int, words: int) -> str:
    """Prompt i: its number, then `words` words drawn from a seeded generator (a long first
    prompt makes every re-prefill of an evicted conversation cost what it does on a real
    model, relative to a decode step)."""
    rng = random.Random(i)
    return f"prompt {i}: " + " ".join(rng.choice(VOCAB) for _ in range(words))


def run_row(
    work: Path,
    name: str,
    sets: list[str],
    groups: int,
    timeout_s: float,
    rollout_only: bool = False,
    words: int = 0,
) -> dict[str, Any]:
    run_dir = work / name
    data = work / f"{name}.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": long_prompt(i, words)}) + "\n" for i in range(groups))
    )
    cmd = [sys.executable, "-m", "streamrl_workers.cli", "up", "--config", str(work / "c.toml")]
    cmd += ["--run-dir", str(run_dir)]
    for s in [f'task.dataset="{data}"', "task.epochs=1", *sets]:
        cmd += ["--set", s]
    start = time.monotonic()
    row: dict[str, Any] = {"row": name}
    out = work / f"{name}.out"
    env = xla_cache_env(work)
    with out.open("w") as sink:
        proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, text=True,
            start_new_session=True, env=env,
        )  # fmt: skip
    if rollout_only:
        why = rollout_alone(proc, run_dir, groups * 4, timeout_s)
        proc.wait(timeout=120)
        if why:
            row["failed"] = why
            return row
        code = 0  # stopped by the bench: its exit code says nothing
    else:
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)  # the launcher stops its workers
            proc.wait(timeout=60)
            row["failed"] = f"timed out after {timeout_s:.0f} s"
            return row
    row["wall_s"] = round(time.monotonic() - start, 1)
    if code != 0:
        row["failed"] = f"rc {code}: {out.read_text()[-400:]}"
        return row
    logs = [e for p in sorted((run_dir / "logs").glob("rollout-*.log")) for e in events(p)]
    ready = max(ts(e) for e in logs if e.get("event") == "rollout_ready")
    commits = [e for e in logs if e.get("event") == "trajectories_committed"]
    trajs = [t for e in commits for t in e["trajectories"]]
    end = max(ts(e) for e in commits)
    ok = [t for t in trajs if t["status"] in ("ok", "truncated")]  # finished by the policy
    [stop] = [e for e in logs if e.get("event") == "rollout_stop"]
    window = end - ready
    row.update(
        episodes=len(trajs),
        ok=len(ok),
        window_s=round(window, 2),
        goodput_tok_s=sum(t["tokens"] for t in ok) / window,
        tokens_per_episode=sum(t["tokens"] for t in ok) / max(1, len(ok)),
        episodes_s=len(trajs) / window,
        evictions=stop["kv"].get("evictions", 0),
        **decode_batches(stop["kv"]),
        limit=stop.get("admission_limit"),
        trims=stop.get("admission_trims"),
        grows=stop.get("admission_grows"),
        ceiling=stop.get("admission_ceiling"),
        costs=row_costs(stop.get("decode_costs", {})),
    )
    return row


def row_costs(costs: dict[str, list[float]]) -> dict[str, float]:
    """Milliseconds a decode call took per active row, by the call's rows (the engine's
    `decode_costs`: what adaptive admission's latency term compares), for buckets of 20
    calls or more."""
    return {n: round(1000 * c[2] / c[1], 3) for n, c in costs.items() if c[0] >= 20 and c[1]}


def decode_batches(kv: dict[str, int]) -> dict[str, float]:
    """What the engine's decode calls covered (its `kv_stats`): rows a call (active ones
    plus padding to a power of two), the share of them active, and the positions each row
    attended (the call's live span: the bucket of its longest row's reach, so a long
    conversation in a batch makes every row of it attend that far)."""
    calls, rows = kv.get("decode_calls", 0), kv.get("decode_rows", 0)
    if not calls or not rows:
        return {}
    return {
        "rows_per_call": rows / calls,
        "active_share": kv.get("decode_active", 0) / rows,
        "span_per_row": kv.get("decode_positions", 0) / rows,
    }


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--fixed", default="8,16,32,64", help="fixed max_concurrency list")
    p.add_argument("--slots", type=int, default=16, help="rollout.max_batch_size")
    p.add_argument("--cap", type=int, default=64, help='the cap of "auto"')
    p.add_argument("--turns", type=int, default=3, help="environment steps an episode")
    p.add_argument("--groups", type=int, default=24, help="prompts (groups) per run")
    p.add_argument("--prompt-words", type=int, default=150, help="words of each first prompt")
    p.add_argument("--repeats", type=int, default=3, help="rounds of every row, interleaved")
    p.add_argument(
        "--warmup", type=int, default=1, help="rounds first run and not counted (they compile)"
    )
    p.add_argument("--timeout-s", type=float, default=600)
    p.add_argument("--set", action="append", default=[], help="more overrides, every row")
    p.add_argument(
        "--rollout-only",
        action="store_true",
        help="stop the trainer (SIGSTOP) while rollout runs: the engine has the CPU alone; "
        "the ready-group cap is opened and the run is stopped once every episode committed",
    )
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="admission-") as tmp:
        work = Path(tmp)
        (work / "c.toml").write_text(CONFIG.format(turns=args.turns, slots=args.slots))
        common = [f"rollout.max_steps={args.turns + 1}", "trainer.checkpoint_every=1000"]
        common += args.set
        if args.rollout_only:
            common.append("rollout.max_ready_groups=100000")
        points = [(f"fixed C={c}", [f"rollout.max_concurrency={c}"]) for c in args.fixed.split(",")]
        points.append(
            (
                f"auto (cap {args.cap})",
                ['rollout.max_concurrency="auto"', f"rollout.max_concurrency_cap={args.cap}"],
            )
        )
        # interleaved: a slow minute hits every row alike
        for rnd in range(-args.warmup, args.repeats):
            for i, (name, sets) in enumerate(points):
                row = run_row(
                    work,
                    f"r{rnd + args.warmup}-{i}",
                    [*common, *sets],
                    args.groups,
                    args.timeout_s,
                    args.rollout_only,
                    args.prompt_words,
                )
                row["row"], row["round"] = name, rnd
                if rnd >= 0:
                    runs.setdefault(name, []).append(row)
                print(f"# round {rnd}: {row}", file=sys.stderr, flush=True)
    rows: list[dict[str, Any]] = []
    for name, rs in runs.items():
        ok = [r for r in rs if "failed" not in r]
        rows.append(
            {
                "row": name,
                "runs": len(rs),
                "failed": [r["failed"] for r in rs if "failed" in r],
                "goodput": median([r["goodput_tok_s"] for r in ok]),
                "goodputs": [round(r["goodput_tok_s"]) for r in ok],
                "episodes_s": median([r["episodes_s"] for r in ok]),
                "evictions": median([r["evictions"] for r in ok]),
                "tokens": median([r["tokens_per_episode"] for r in ok]),
                "limit": [r["limit"] for r in ok],
                "trims": sum(r["trims"] or 0 for r in ok),
                "ceiling": [r.get("ceiling") for r in ok],
                "costs": {
                    n: median([r["costs"][n] for r in ok if n in r.get("costs", {})])
                    for n in sorted({n for r in ok for n in r.get("costs", {})}, key=int)
                },
                "wall_s": median([r["wall_s"] for r in ok]),
                **{
                    k: median([r[k] for r in ok if k in r])
                    for k in ("rows_per_call", "active_share", "span_per_row")
                },
            }
        )
    fixed = [r for r in rows if r["row"].startswith("fixed")]
    best_row = max(fixed, key=lambda r: r["goodput"])["row"] if fixed else ""
    best = max((r["goodput"] for r in fixed), default=float("nan"))
    # Paired: each round's goodput over the best fixed row's in the same round, the median
    # of those (a slow minute of the machine hits both sides of a ratio alike).
    base = {r["round"]: r["goodput_tok_s"] for r in runs.get(best_row, []) if "failed" not in r}
    for r in rows:
        ratios = [
            x["goodput_tok_s"] / base[x["round"]]
            for x in runs[r["row"]]
            if "failed" not in x and x["round"] in base
        ]
        r["paired"] = median(ratios)
        r["wins"] = sum(x >= 1 for x in ratios)
    print(
        f"\n### admission: tiny transformer, {args.slots} KV slots, "
        f"first prompts of {args.prompt_words} words, synthetic task of {args.turns} steps "
        f"(90 % 50 ms / 10 % 500 ms), {args.groups} groups of 4, medians of {args.repeats} "
        f"interleaved rounds after {args.warmup} not counted (compilation)\n"
    )
    print(
        "| row | goodput tok/s (runs) | of best fixed | paired | rounds >= it | episodes/s "
        "| tokens/episode | evictions | limit at end | trims | decode rows/call (active) "
        "| span/row | ceiling | decode ms a row, by rows a call | wall s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---|---|---:|")
    for r in rows:
        failed = f" ({len(r['failed'])} failed: {r['failed'][0][:80]})" if r["failed"] else ""
        print(
            f"| {r['row']}{failed} | {r['goodput']:.0f} ({', '.join(map(str, r['goodputs']))}) "
            f"| {r['goodput'] / best:.2f} | {r['paired']:.2f} | {r['wins']}/{r['runs']} "
            f"| {r['episodes_s']:.2f} | {r['tokens']:.0f} "
            f"| {r['evictions']:.0f} | {', '.join(map(str, r['limit']))} | {r['trims']} "
            f"| {r['rows_per_call']:.1f} ({r['active_share']:.0%}) | {r['span_per_row']:.0f} "
            f"| {', '.join(str(c) for c in r['ceiling'])} "
            f"| {' '.join(f'{n}: {ms:.2f}' for n, ms in r['costs'].items())} "
            f"| {r['wall_s']:.0f} |"
        )
    if args.out:
        args.out.write_text(json.dumps({"rows": rows, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
