"""Tracing's cost: the null-mode pipeline with `trace.enabled` off and on, in one run.

    .venv/bin/python -m ops.bench.tracing                       # 3 pairs of 2,000 groups
    .venv/bin/python -m ops.bench.tracing --pairs 5 --groups 1000 --out tracing.json

Each run is the null mode of ops/bench/stragglers.py (a whole `streamrl up` of
configs/stub.toml: stub policy and synthetic environment at 0 ms, C = `--concurrency`,
`--groups` groups), where the orchestration alone sets the pace and the rollout worker
is the busiest process: the worst case for the spans an episode writes (an episode span,
two model calls of two spans each, two env.step spans). Runs alternate off and on in
pairs, the order flipped each pair (off-on, on-off, ...), so that drift of the shared
machine falls on both sides.

Per run: episodes/s over the whole-run window (stragglers.py's definition), the rollout
worker's CPU seconds per 1,000 episodes (utime + stime over the same window) and, traced,
the bytes of trace written per episode. The table ends with the medians of each side and
their ratio (on / off; throughput loss = 1 - ratio), the target being a loss of 2 % at
most. On a shared 2-core machine single runs scatter by tens of percent: read the
medians and the CPU figures, not one pair.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from ops.bench import stragglers
from streamrl.obs.tracing import trace_files


def one_run(args: argparse.Namespace, work: Path, name: str, traced: bool) -> dict[str, Any]:
    c, g = args.concurrency, args.generations
    groups = stragglers.whole_steps(args.groups)
    sets = stragglers.base_sets(
        c, g, 0.0, ['task.options.latency="fixed"', "task.options.latency_s=0.0"]
    )
    run_dir = work / name
    r = stragglers.up(
        run_dir, groups, [*sets, f"trace.enabled={str(traced).lower()}", *args.set], 600
    )
    row: dict[str, Any] = {"run": name, "traced": traced, "wall_s": r.wall_s}
    if r.timed_out or r.returncode != 0:
        row["failed"] = "timed out" if r.timed_out else f"rc {r.returncode}: {r.output_tail}"
        return row
    m = stragglers.measure(run_dir)
    row["episodes"] = m.episodes
    row["episodes_per_s"] = m.episodes / m.window_s
    rollout = r.cpu.get("rollout-0", [])
    row["rollout_cpu_s_per_1000"] = (
        stragglers.cpu_in(rollout, m.start, m.last_group) / m.episodes * 1000 if rollout else None
    )
    row["trace_bytes_per_episode"] = (
        sum(p.stat().st_size for p in trace_files(run_dir)) / m.episodes if traced else 0.0
    )
    return row


def med(rows: list[dict[str, Any]], key: str) -> float:
    xs = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(xs) if xs else float("nan")


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        "\n| pair | tracing | episodes/s | rollout CPU s / 1,000 episodes | trace bytes / episode |"
    )
    print("|---:|---|---:|---:|---:|")
    for i, r in enumerate(rows):
        side = "on" if r["traced"] else "off"
        if "failed" in r:
            print(f"| {i // 2 + 1} | {side} | failed: {r['failed'][:60]} |||")
            continue
        cpu = r["rollout_cpu_s_per_1000"]
        print(
            f"| {i // 2 + 1} | {side} | {r['episodes_per_s']:,.0f} "
            f"| {cpu:.3f} | {r['trace_bytes_per_episode']:,.0f} |"
            if cpu is not None
            else f"| {i // 2 + 1} | {side} | {r['episodes_per_s']:,.0f} | - | - |"
        )
    off = [r for r in rows if not r["traced"] and "failed" not in r]
    on = [r for r in rows if r["traced"] and "failed" not in r]
    eps_off, eps_on = med(off, "episodes_per_s"), med(on, "episodes_per_s")
    cpu_off, cpu_on = med(off, "rollout_cpu_s_per_1000"), med(on, "rollout_cpu_s_per_1000")
    print(f"| median | off | {eps_off:,.0f} | {cpu_off:.3f} | 0 |")
    size = med(on, "trace_bytes_per_episode")
    print(f"| median | on | {eps_on:,.0f} | {cpu_on:.3f} | {size:,.0f} |")
    ratio = eps_on / eps_off
    print(
        f"\nthroughput on / off (medians): {ratio:.3f} (loss {100 * (1 - ratio):.1f} %, "
        f"target <= 2 %); rollout CPU on / off: {cpu_on / cpu_off:.3f}"
    )
    pairs = [
        (a, b)
        for a, b in zip(rows[::2], rows[1::2], strict=False)
        if "failed" not in a and "failed" not in b
    ]
    per_pair = [
        (b if b["traced"] else a)["episodes_per_s"] / (a if b["traced"] else b)["episodes_per_s"]
        for a, b in pairs
    ]
    if per_pair:
        print(f"per-pair ratios: {', '.join(f'{x:.3f}' for x in per_pair)}")


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--pairs", type=int, default=3, help="off/on pairs, alternating")
    p.add_argument("--groups", type=int, default=2000, help="groups per run")
    p.add_argument("--concurrency", type=int, default=128, help="rollout.max_concurrency")
    p.add_argument("--generations", type=int, default=4, help="rollout.num_generations")
    p.add_argument("--set", action="append", default=[], help="more config overrides")
    p.add_argument("--out", type=Path, help="write every figure as JSON here")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="tracing-bench-") as tmp:
        for i in range(args.pairs):
            order = (False, True) if i % 2 == 0 else (True, False)
            for traced in order:
                rows.append(one_run(args, Path(tmp), f"p{i}-{'on' if traced else 'off'}", traced))
                r = rows[-1]
                print(
                    f"# pair {i + 1} tracing {'on' if traced else 'off'}: "
                    + (r.get("failed") or f"{r['episodes_per_s']:,.0f} episodes/s"),
                    flush=True,
                )
    print_table(rows)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
