"""Stragglers: complete groups per minute through `streamrl up` against the Little's-law
bound and against a synchronous barrier, per latency mix and max_concurrency.

    .venv/bin/python ops/bench/stragglers.py                     # quick: C 8,64, heavy mix
    .venv/bin/python ops/bench/stragglers.py --concurrency 1,8,32,64,128,256 \
        --mixes fixed50,fixed500,heavy,lognormal --null --out results.json  # the full sweep
    .venv/bin/python ops/bench/stragglers.py --mixes heavy --concurrency 64 --tools 1,2,4
        # beside it: every step a real sandbox call through 1, 2, 4 tool workers

Each async run is a whole `streamrl up` of the default config (DEFAULTS below: the
synthetic task, `turns` = 2 steps per episode, each step's latency drawn from the mix, and
the stub policy, each model call answering after `--model-ms`; embedded Redis with AOF,
feeder, `--workers` rollout workers, grouper, trainer, a tool worker). Only what the user of
issue 29 sets is set: the task and its latency mix, G, C per rollout worker, the stub
latency and the data; the backlog, the trainer's batch, the ready-group cap and the
staleness bound are the defaults ("auto": derived from C and G), unless `--backlogs` or
`--set` says otherwise. A JSONL file of N prompts with `task.epochs = 1` makes the feeder
write exactly N tasks and the run ends by itself once every group is trained or dropped
(no --steps): the row says whether it did, and how many groups were trained and dropped.
N = `--waves` waves of W x C / G groups unless `--groups` says N. The null and tools modes
run configs/stub.toml with --steps, as before.

Definitions (C = rollout.max_concurrency, G = rollout.num_generations):

- episode time T: the expected sum of `turns` step latencies of the mix (closed form, the
  log-normal's cap included) plus `turns` x the stub model latency. Orchestration is free
  in T: it is what the episode would take alone.
- bound (Little's law): C / T / G groups per second, x 60 per minute: C episodes always
  running, none waiting on anything but its own steps and model calls.
- whole-run rate: N groups over the window from the first moment an episode could start
  to the last `group_emitted` event of the grouper. That start is the later of the first
  task written (the smallest task stream entry id among the trajectories, a Redis server
  millisecond timestamp) and the rollout worker's `rollout_ready` event (it has loaded
  the trainer's version 0; the feeder writes tasks about a second before that, while the
  trainer starts). Worker start-up and the trainer's last step are outside it; the ramp
  and the drain are inside. `from_first_task_s` in --out keeps the other start.
- steady-state rate: the middle 80 % of group emissions, (k90 - k10) / (t[k90] - t[k10])
  over the sorted emission times: ramp (the first C episodes starting together) and drain
  (the last stragglers with the slots going idle) excluded.
- efficiency: measured rate / bound, whole-run and steady-state.
- barrier: the same episodes in batches of C (in group then member order, so C/G whole
  groups when G divides C), each batch starting when the previous one has wholly finished:
  batch time = the longest episode of the batch. The rollout worker has no barrier mode,
  and none can be built honestly from outside: the feeder's backlog bound counts tasks not
  yet delivered, so a bound of C/G tasks refills as each group finishes (a sliding window,
  which is the async mode), and separate `streamrl up` runs per batch would mostly measure
  start-up. So the barrier is computed from the very latency draws the async run used (the
  synthetic task's seeded generator, replayed here with the same seed strings; the replay
  is checked against the rewards the grouper logged, drawn the same way) with zero
  orchestration cost: an ideal barrier, so the speedup async / barrier is a lower bound
  on what a real barrier through the same code would give.
- ideal async: the same draws with each episode started, in order, the moment a slot
  frees, at no cost; its efficiency (ideal / bound) is what the whole-run definition
  allows at this N: the ramp is free, but the drain of the last stragglers is not.
  "of ideal" is the measured whole-run rate over it. W workers of C slots are W x C slots
  to the bound and the ideal.
- latency p50/p99: per trajectory, from the `trajectories_committed` event of the rollout
  log that holds it (written once its batch is committed, just after the episode's end) to
  the trainer's `train_step` event whose `group_ids` holds its group. It includes waiting
  for the rest of the group and for a full step of `trainer.groups_per_step` groups.
- in flight: mean episodes running, by Little's law: steady episodes/s x T (at most C).

Tools mode (`--tools N,N`): every environment step a real `shell` call (`echo ok`) through
the run's tool workers and sandboxes (`task.options.latency = "tool"`, the config's
`tools.sandbox`), C = `--tools-concurrency`, `--tools-groups` groups, once per tool worker
count: episodes/s and tool calls/s (whole-run window as above), the sandbox backend the
workers used, and the trajectory-to-trained latency. No bound: a call's time is measured,
not drawn.

Null mode (`--null`): model and environment 0 ms, C = `--null-concurrency`, `--null-groups`
groups: episodes/s (whole-run window as above) and each process's CPU seconds per 1,000
episodes, from utime + stime of /proc/<pid>/stat of the launcher's children (the workers,
named by the launcher's `workers_started` event, and redis-server), polled every 0.2 s
while the run goes and taken between the last sample before the window and the first
after it (so start-up imports and shutdown are not counted).

A run that has not ended within its time limit (`--timeout-s`, or 120 s + 4 x its
expected length) is stopped (SIGTERM to the launcher, then SIGKILL to every process group
it started) and reported as such, never waited on.
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from streamrl.tasks.synthetic import SyntheticOptions

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "stub.toml"  # the null and tools modes
# The async sweep's config: what a user of the synthetic task writes, every other field at
# its default (the sweep adds G, C, the stub latency, the mix and the data with --set).
DEFAULTS = """\
[run]
name = "stragglers"
seed = 0

[task]
name = "synthetic"

[task.options]
turns = 2

[model]
kind = "stub"
"""
SEED = 0  # run.seed of configs/stub.toml: the latency draws are replayed with it
TURNS = 2  # task.options.turns of configs/stub.toml
GROUPS_PER_STEP = 25  # trainer.groups_per_step of configs/stub.toml
POLL_S = 0.2

# name -> (what it is, [task.options] overrides)
MIXES: dict[str, tuple[str, dict[str, Any]]] = {
    "fixed50": ("fixed 50 ms", {"latency": "fixed", "latency_s": 0.05}),
    "fixed500": ("fixed 500 ms", {"latency": "fixed", "latency_s": 0.5}),
    "heavy": (
        "90 % 50 ms / 10 % 1 s",
        {"latency": "mixture", "mixture": [[0.9, 0.05], [0.1, 1.0]]},
    ),
    "lognormal": (
        "log-normal, median 50 ms, sigma 1.5, cap 10 s",
        {"latency": "lognormal", "latency_s": 0.05, "sigma": 1.5, "max_latency_s": 10.0},
    ),
    # The heavy mix with each step a blocking call (time.sleep on a thread, as a sync
    # environment or tool does): what rollout.env_threads is for.
    "heavy-blocking": (
        "90 % 50 ms / 10 % 1 s, blocking steps",
        {"latency": "mixture", "mixture": [[0.9, 0.05], [0.1, 1.0]], "blocking": True},
    ),
}


def step_mean_s(o: SyntheticOptions) -> float:
    """Expected latency of one step, seconds (the capped log-normal in closed form)."""
    if o.latency == "fixed":
        return o.latency_s
    if o.latency == "mixture":
        return sum(p * s for p, s in o.mixture)
    m, sd, cap = o.latency_s, o.sigma, o.max_latency_s
    if m == 0:
        return 0.0
    if cap <= 0:
        return 0.0
    phi = statistics.NormalDist().cdf
    z = math.log(cap / m) / sd
    # E[min(cap, m e^{sd Z})] = m e^{sd^2/2} Phi(z - sd) + cap (1 - Phi(z))
    return m * math.exp(sd * sd / 2) * phi(z - sd) + cap * (1 - phi(z))


def draw_s(o: SyntheticOptions, group_id: str, member: int, step: int) -> float:
    """The step latency the synthetic environment drew (EpisodeContext.rng's seed string)."""
    return o.draw(random.Random(f"{SEED}:{group_id}:{member}:{('latency', step)}"))


def replayed_reward(group_id: str, member: int) -> float:
    """The reward the synthetic task drew: checks the replay of the seeded generators."""
    return random.Random(f"{SEED}:{group_id}:{member}:{('reward',)}").random()


def episode_times(o: SyntheticOptions, groups: int, g: int, model_s: float) -> list[float]:
    """Each episode's time alone (its drawn steps and model calls), group then member order."""
    return [
        sum(draw_s(o, f"g{i:09d}", m, s) for s in range(TURNS)) + TURNS * model_s
        for i in range(groups)
        for m in range(g)
    ]


def barrier_s(episodes: list[float], c: int) -> float:
    """Wall time of an ideal barrier: batches of c episodes, each as long as its longest."""
    return sum(max(episodes[i : i + c]) for i in range(0, len(episodes), c))


def ideal_async_s(episodes: list[float], c: int) -> float:
    """Wall time of an ideal async run: each episode starts, in order, the moment one of
    the c slots frees, at no cost; ends with the last episode (ramp and drain included)."""
    slots = [0.0] * c
    for t in episodes:
        heapq.heappush(slots, heapq.heappop(slots) + t)
    return max(slots)


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))] if s else float("nan")


def events(path: Path) -> list[dict[str, Any]]:
    """The JSON events of a worker log (none when it does not exist yet); a line not yet
    whole (a log read while its run writes it) is skipped."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line[:1] == "{":
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def ts(e: dict[str, Any]) -> float:
    return datetime.fromisoformat(e["timestamp"]).timestamp()


# --- one `streamrl up`, with its processes' CPU sampled -------------------------------


def proc_ticks(pid: int) -> tuple[int, str] | None:
    """utime + stime (clock ticks) and ppid of a live process, or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    if fields[0] == "Z":
        return None
    return int(fields[11]) + int(fields[12]), fields[1]


def children(ppid: int) -> dict[int, str]:
    """Live children of `ppid`: pid -> command name."""
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit() and (t := proc_ticks(int(d))) is not None and t[1] == str(ppid):
            try:
                out[int(d)] = Path(f"/proc/{d}/comm").read_text().strip()
            except OSError:
                continue
    return out


@dataclass
class Run:
    """One `streamrl up`: its directory, outcome and CPU samples."""

    run_dir: Path
    wall_s: float
    returncode: int | None
    timed_out: bool
    output_tail: str
    # process name -> [(unix time, cpu seconds)]
    cpu: dict[str, list[tuple[float, float]]] = field(default_factory=dict)


def up(
    run_dir: Path,
    groups: int,
    sets: list[str],
    timeout_s: float,
    config: Path = CONFIG,
    steps: bool = True,
) -> Run:
    """`streamrl up` of `groups` prompts, once each; `steps`: stop after groups /
    GROUPS_PER_STEP trainer steps (configs/stub.toml), else the run ends by itself."""
    data = run_dir.parent / f"{run_dir.name}.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"prompt {i}"}) + "\n" for i in range(groups)))
    cmd = [sys.executable, "-m", "streamrl_workers.cli", "up", "--config", str(config)]
    cmd += ["--run-dir", str(run_dir)]
    if steps:
        cmd += ["--steps", str(groups // GROUPS_PER_STEP)]
    for s in [f'task.dataset="{data}"', "task.epochs=1", *sets]:
        cmd += ["--set", s]
    log = run_dir.parent / f"{run_dir.name}.out"
    tck = os.sysconf("SC_CLK_TCK")
    cpu: dict[str, list[tuple[float, float]]] = {}
    names: dict[int, str] = {}
    start = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        timed_out = False
        while proc.poll() is None:
            if time.monotonic() - start > timeout_s:
                timed_out = True
                stop(proc, names)
                break
            for pid, comm in children(proc.pid).items():
                names.setdefault(pid, comm)
            for worker, pid in started(run_dir).items():
                names[pid] = worker
            now = time.time()
            for pid, name in names.items():
                if (t := proc_ticks(pid)) is not None:
                    cpu.setdefault(name, []).append((now, t[0] / tck))
            time.sleep(POLL_S)
    wall = time.monotonic() - start
    tail = log.read_text()[-2000:]
    return Run(run_dir, wall, proc.returncode, timed_out, tail, cpu)


def started(run_dir: Path) -> dict[str, int]:
    for e in events(run_dir / "logs" / "launcher.log"):
        if e.get("event") == "workers_started":
            return dict(e["pids"])
    return {}


def stop(proc: subprocess.Popen[bytes], names: dict[int, str]) -> None:
    """A stalled run: SIGTERM the launcher, then SIGKILL every group this run started."""
    proc.send_signal(signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=20)
    for pgid in [proc.pid, *names]:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            continue
    proc.wait()


# --- what a run's logs say ------------------------------------------------------------


@dataclass
class Measured:
    groups: int
    episodes: int
    window_s: float  # the rollout ready with tasks written -> last group emitted
    from_first_task_s: float  # first task written -> last group emitted
    steady_groups_per_s: float
    latency_p50_s: float
    latency_p99_s: float
    start: float
    last_group: float
    replay_ok: bool


def measure(run_dir: Path) -> Measured:
    logs = run_dir / "logs"
    # Every rollout worker's and grouper's log (rollout.num_workers, grouper.num_workers).
    rollout = [e for path in sorted(logs.glob("rollout-*.log")) for e in events(path)]
    # One `trajectories_committed` event per commit (a batch); older logs: `trajectory`.
    trajs = [
        {**t, "timestamp": e["timestamp"]}
        for e in rollout
        if e.get("event") == "trajectories_committed"
        for t in e["trajectories"]
    ] or [e for e in rollout if e.get("event") == "trajectory"]
    emitted = [
        e
        for path in sorted(logs.glob("grouper-*.log"))
        for e in events(path)
        if e.get("event") == "group_emitted"
    ]
    steps = [e for e in events(logs / "trainer-0.log") if e.get("event") == "train_step"]
    first_task = min(int(e["entry_id"].split("-")[0]) for e in trajs) / 1000
    # The first moment every rollout worker could start: the last one's readiness.
    ready = [ts(e) for e in rollout if e.get("event") == "rollout_ready"]
    start = max(first_task, *ready)
    t_emit = sorted(ts(e) for e in emitted)
    n = len(t_emit)
    k10, k90 = int(0.1 * (n - 1)), int(0.9 * (n - 1))
    steady = (k90 - k10) / (t_emit[k90] - t_emit[k10]) if k90 > k10 else float("nan")
    trained = {gid: ts(e) for e in steps for gid in e["group_ids"]}
    lat = [
        trained[e["traj_id"].rsplit("-m", 1)[0]] - ts(e)
        for e in trajs
        if e["traj_id"].rsplit("-m", 1)[0] in trained
    ]
    replay_ok = all(
        abs(r - replayed_reward(e["group_id"], m)) < 1e-12
        for e in emitted[:50]
        for m, r in enumerate(e["rewards"])
    )
    return Measured(
        groups=n,
        episodes=len(trajs),
        window_s=t_emit[-1] - start,
        from_first_task_s=t_emit[-1] - first_task,
        steady_groups_per_s=steady,
        latency_p50_s=pct(lat, 0.5),
        latency_p99_s=pct(lat, 0.99),
        start=start,
        last_group=t_emit[-1],
        replay_ok=replay_ok,
    )


def cpu_in(samples: list[tuple[float, float]], t0: float, t1: float) -> float:
    """CPU seconds between the last sample at or before t0 and the first at or after t1."""
    before = [c for t, c in samples if t <= t0] or [samples[0][1]]
    after = [c for t, c in samples if t >= t1] or [samples[-1][1]]
    return after[0] - before[-1]


# --- the sweep ------------------------------------------------------------------------


def whole_steps(groups: int) -> int:
    return max(1, math.ceil(groups / GROUPS_PER_STEP)) * GROUPS_PER_STEP


def tuned_backlog(c: int, g: int) -> int:
    """The backlog this bench set by hand before `task.max_backlog = "auto"`: up to one
    open task per running episode (a group stays open until its slowest member ends),
    plus two waves queued (less gave 0.77 instead of 0.9 of the bound at C = 256)."""
    return max(64, c + 2 * c // g)


def base_sets(c: int, g: int, model_s: float, extra: list[str], backlog: str = "auto") -> list[str]:
    # The null and tools modes on configs/stub.toml (the async sweep: default_sets). The
    # ready-groups bound is opened past what C episodes can use and nothing is dropped as
    # stale, so only max_concurrency limits these runs, which measure the orchestration's
    # and the tools' cost, not the defaults.
    size = {"auto": "auto", "tuned": str(tuned_backlog(c, g))}.get(backlog, backlog)
    return [
        f"rollout.max_concurrency={c}",
        f"rollout.num_generations={g}",
        f'task.max_backlog="{size}"' if size == "auto" else f"task.max_backlog={size}",
        f"rollout.max_ready_groups={max(50, 2 * c // g + 2 * GROUPS_PER_STEP)}",
        "grouper.off_policy_steps=1000000",
        f"model.stub_latency_s={model_s}",
        "model.stub_train_step_s=0.0",
        *extra,
    ]


def option_sets(opts: dict[str, Any]) -> list[str]:
    return [f"task.options.{k}={json.dumps(v)}" for k, v in opts.items()]


def default_sets(
    c: int, g: int, w: int, model_s: float, extra: list[str], backlog: str
) -> list[str]:
    """The async sweep's settings on DEFAULTS: C per worker, G, W workers, the stub latency;
    the backlog only when it is not the default "auto"."""
    sets = [
        f"rollout.max_concurrency={c}",
        f"rollout.num_generations={g}",
        f"rollout.num_workers={w}",
        f"model.stub_latency_s={model_s}",
        *extra,
    ]
    if backlog != "auto":
        size = tuned_backlog(w * c, g) if backlog == "tuned" else int(backlog)
        sets.append(f"task.max_backlog={size}")
    return sets


def run_point(
    args: argparse.Namespace, work: Path, mix: str, c: int, backlog: str = "auto", w: int = 1
) -> dict[str, Any]:
    g, model_s = args.generations, args.model_ms / 1000
    opts_d = MIXES[mix][1]
    opts = SyntheticOptions(turns=TURNS, **opts_d)
    episode_s = TURNS * (step_mean_s(opts) + model_s)
    slots = w * c
    bound = slots / episode_s / g  # groups/s
    row: dict[str, Any] = {
        "mix": mix, "W": w, "C": c, "G": g, "episode_s": episode_s, "backlog": backlog,
    }  # fmt: skip
    row["bound_gpm"] = bound * 60
    groups = args.groups or math.ceil(args.waves * slots / g)
    row["groups"] = groups
    episodes = episode_times(opts, groups, g, model_s)
    row["ideal_async_gpm"] = groups / ideal_async_s(episodes, slots) * 60
    if "barrier" in args.modes:
        row["barrier_gpm"] = groups / barrier_s(episodes, slots) * 60
    if "async" not in args.modes:
        return row
    expected = groups / bound
    limit = args.timeout_s or 120 + 4 * expected
    run_dir = work / f"{mix}-w{w}-c{c}-{backlog}"
    config = work / "defaults.toml"
    config.write_text(DEFAULTS)
    sets = default_sets(c, g, w, model_s, [*option_sets(opts_d), *args.set], backlog)
    r = up(run_dir, groups, sets, limit, config=config, steps=False)
    row["wall_s"] = r.wall_s
    if r.timed_out or r.returncode != 0:
        row["failed"] = f"timed out after {limit:.0f} s" if r.timed_out else f"rc {r.returncode}"
        row["output_tail"] = r.output_tail
        return row
    summary = json.loads((run_dir / "summary.json").read_text())
    row["groups_trained"] = summary["groups_trained"]
    row["groups_dropped"] = summary["groups_dropped"]
    row["trainer_steps"] = summary["trainer_steps"]
    # ended by itself: exit 0 without --steps, each of the N groups trained or dropped
    row["ended"] = row["groups_trained"] + row["groups_dropped"] == groups
    m = measure(run_dir)
    row.update(asdict(m))
    row["async_gpm"] = m.groups / m.window_s * 60
    row["steady_gpm"] = m.steady_groups_per_s * 60
    row["efficiency"] = row["async_gpm"] / row["bound_gpm"]
    row["of_ideal"] = row["async_gpm"] / row["ideal_async_gpm"]
    row["steady_efficiency"] = row["steady_gpm"] / row["bound_gpm"]
    row["in_flight"] = m.steady_groups_per_s * g * episode_s
    if "barrier_gpm" in row:
        row["speedup"] = row["async_gpm"] / row["barrier_gpm"]
        row["barrier_replay_checked"] = m.replay_ok
    return row


def measured_up(
    row: dict[str, Any], run_dir: Path, sets: list[str], timeout_s: float
) -> tuple[Run, Measured] | None:
    """One `streamrl up` of row["groups"] groups, measured into `row` (its figures,
    episodes/s whole and steady, wall_s); None, with row["failed"] and the output's tail,
    when it timed out or failed."""
    r = up(run_dir, row["groups"], sets, timeout_s)
    row["wall_s"] = r.wall_s
    if r.timed_out or r.returncode != 0:
        row["failed"] = "timed out" if r.timed_out else f"rc {r.returncode}"
        row["output_tail"] = r.output_tail
        return None
    m = measure(run_dir)
    row.update(asdict(m))
    row["episodes_per_s"] = m.episodes / m.window_s
    row["steady_episodes_per_s"] = m.steady_groups_per_s * row["G"]
    return r, m


def run_null(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    c, g, groups = args.null_concurrency, args.generations, whole_steps(args.null_groups)
    run_dir = work / f"null-c{c}"
    sets = base_sets(c, g, 0.0, ['task.options.latency="fixed"', "task.options.latency_s=0.0"])
    row: dict[str, Any] = {"C": c, "G": g, "groups": groups}
    done = measured_up(row, run_dir, [*sets, *args.set], args.timeout_s or 300)
    if done is None:
        return row
    r, m = done
    row["cpu_s_per_1000"] = {
        name: cpu_in(s, m.start, m.last_group) / m.episodes * 1000
        for name, s in sorted(r.cpu.items())
    }
    return row


def run_tools(args: argparse.Namespace, work: Path, workers: int) -> dict[str, Any]:
    """The tools mode: every environment step a real `shell` call (`echo ok`) through the
    run's tool workers and their sandboxes (`task.options.latency = "tool"`; the sandbox
    is the config's, `tools.sandbox = "auto"` unless --set says otherwise), the stub model
    at --model-ms, C = --tools-concurrency, `workers` tool workers."""
    c, g, groups = args.tools_concurrency, args.generations, whole_steps(args.tools_groups)
    model_s = args.model_ms / 1000
    run_dir = work / f"tools-c{c}-w{workers}"
    extra = ['task.options.latency="tool"', f"tools.num_workers={workers}"]
    sets = base_sets(c, g, model_s, [*extra, *args.set])
    row: dict[str, Any] = {"C": c, "G": g, "groups": groups, "workers": workers}
    done = measured_up(row, run_dir, sets, args.timeout_s or 600)
    if done is None:
        return row
    m = done[1]
    row["calls_per_s"] = m.episodes * TURNS / m.window_s
    backends = [
        e.get("kind")
        for path in sorted((run_dir / "logs").glob("tools-*.log"))
        for e in events(path)
        if e.get("event") == "sandbox_backend"
    ]
    row["sandbox"] = ",".join(sorted({str(b) for b in backends})) or "?"
    return row


def print_tools(rows: list[dict[str, Any]], model_ms: float) -> None:
    r0 = rows[0]
    print(
        f"\n### tools mode: each of {TURNS} steps a real `shell` call (`echo ok`), stub model "
        f"{model_ms:g} ms, C = {r0['C']}, {r0['groups']} groups\n"
    )
    print(
        "| tool workers | sandbox | episodes/s (whole / steady) | tool calls/s"
        " | latency p50 / p99 (s) |"
    )
    print("|---:|---|---:|---:|---:|")
    for r in rows:
        if "failed" in r:
            print(f"| {r['workers']} | - | {r['failed']} |||")
            continue
        print(
            f"| {r['workers']} | {r['sandbox']} | {r['episodes_per_s']:.1f} / "
            f"{r['steady_episodes_per_s']:.1f} | {r['calls_per_s']:.1f} "
            f"| {r['latency_p50_s']:.2f} / {r['latency_p99_s']:.2f} |"
        )


def fmt(x: Any, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def print_mix(mix: str, rows: list[dict[str, Any]], model_ms: float) -> None:
    print(f"\n### {MIXES[mix][0]} ({mix}), {TURNS} steps + {TURNS} model calls of {model_ms:g} ms")
    print(f"episode time T = {rows[0]['episode_s'] * 1000:.0f} ms\n")
    print(
        "| W x C | backlog | groups | trained / dropped | ended | bound g/min"
        " | async g/min (whole / steady) | efficiency (whole / steady) | ideal async eff."
        " | of ideal | barrier g/min | speedup | latency p50 / p99 (s) | in flight |"
    )
    print("|---:|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        b = r.get("backlog", "auto")
        wc = f"{r['W']} x {r['C']}"
        if "skipped" in r or "failed" in r:
            why = r.get("skipped") or r["failed"]
            print(
                f"| {wc} | {b} | {r.get('groups', '-')} ||| {r['bound_gpm']:.0f} | {why} ||||||||"
            )
            continue
        print(
            f"| {wc} | {b} | {r['groups']} "
            f"| {r.get('groups_trained', '-')} / {r.get('groups_dropped', '-')} "
            f"| {'yes' if r.get('ended') else 'no'} | {r['bound_gpm']:.0f} "
            f"| {fmt(r.get('async_gpm'), '.0f')} / {fmt(r.get('steady_gpm'), '.0f')} "
            f"| {fmt(r.get('efficiency'), '.2f')} / {fmt(r.get('steady_efficiency'), '.2f')} "
            f"| {r['ideal_async_gpm'] / r['bound_gpm']:.2f} | {fmt(r.get('of_ideal'), '.2f')} "
            f"| {fmt(r.get('barrier_gpm'), '.0f')} | {fmt(r.get('speedup'), '.2f')} "
            f"| {fmt(r.get('latency_p50_s'), '.2f')} / {fmt(r.get('latency_p99_s'), '.2f')} "
            f"| {fmt(r.get('in_flight'), '.1f')} |"
        )


def print_null(r: dict[str, Any]) -> None:
    print(f"\n### null mode: model and environment 0 ms, C = {r['C']}, {r['groups']} groups\n")
    if "failed" in r:
        print(f"failed: {r['failed']}")
        return
    print(
        f"episodes/s: {r['episodes_per_s']:.0f} whole run, "
        f"{r['steady_episodes_per_s']:.0f} steady ({r['episodes']} episodes)\n"
    )
    print("| process | CPU s per 1,000 episodes |")
    print("|---|---:|")
    for name, v in r["cpu_s_per_1000"].items():
        print(f"| {name} | {v:.2f} |")


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--concurrency", type=ints, default=[8, 64], help="max_concurrency (per worker) list"
    )
    p.add_argument(
        "--workers", type=ints, default=[1], help="rollout.num_workers list (async sweep)"
    )
    p.add_argument("--mixes", default="heavy", help=f"comma list of {','.join(MIXES)}")
    p.add_argument("--modes", default="async,barrier", help="async and/or barrier")
    p.add_argument("--groups", type=int, default=0, help="groups per run; 0: from --waves")
    p.add_argument("--waves", type=float, default=40, help="waves of C/G groups per run")
    p.add_argument("--generations", type=int, default=4, help="rollout.num_generations")
    p.add_argument("--model-ms", type=float, default=20, help="stub model latency per call")
    p.add_argument("--null", action="store_true", help="also the null mode")
    p.add_argument("--null-concurrency", type=int, default=128)
    p.add_argument("--null-groups", type=int, default=2000)
    p.add_argument(
        "--tools", type=ints, default=[], metavar="N,N",
        help="also the tools mode (every step a real sandbox call) with these tool workers",
    )  # fmt: skip
    p.add_argument("--tools-concurrency", type=int, default=64)
    p.add_argument("--tools-groups", type=int, default=400)
    p.add_argument("--timeout-s", type=float, default=0, help="per run; 0: from its size")
    p.add_argument("--set", action="append", default=[], help="more config overrides")
    p.add_argument("--out", type=Path, help="write every figure as JSON here")
    p.add_argument("--keep", action="store_true", help="keep the run directories")
    p.add_argument(
        "--backlogs",
        default="auto",
        help='comma list of "auto" (the default config), "tuned" (C + 2C/G, what this bench '
        "set by hand before) and fixed numbers (64: the default before auto)",
    )
    args = p.parse_args()
    args.backlogs = [b for b in args.backlogs.split(",") if b]
    if not all(b in ("auto", "tuned") or b.isdigit() for b in args.backlogs):
        p.error(f"unknown backlog: {args.backlogs}")
    args.modes = args.modes.split(",")
    mixes = [m for m in args.mixes.split(",") if m]
    unknown = [m for m in mixes if m not in MIXES] + [
        m for m in args.modes if m not in ("async", "barrier")
    ]
    if unknown:
        p.error(f"unknown mix or mode: {unknown}")

    results: dict[str, Any] = {"mixes": {}, "null": None, "tools": []}
    with tempfile.TemporaryDirectory(prefix="stragglers-") as tmp:
        work = Path(tmp)
        for mix in mixes:
            rows = []
            points = [
                (w, c, b) for w in args.workers for c in args.concurrency for b in args.backlogs
            ]
            for w, c, backlog in points:
                rows.append(run_point(args, work, mix, c, backlog, w))
                r = rows[-1]
                print(
                    f"# {mix} W={w} C={c} backlog {backlog}: "
                    + ", ".join(
                        f"{k} {r[k]:.3g}"
                        for k in ("async_gpm", "bound_gpm", "efficiency", "of_ideal", "wall_s")
                        if isinstance(r.get(k), float)
                    )
                    + (f" {r.get('failed', '')}" if "failed" in r else ""),
                    file=sys.stderr,
                    flush=True,
                )
            results["mixes"][mix] = rows
            print_mix(mix, rows, args.model_ms)
        if args.null:
            results["null"] = run_null(args, work)
            print_null(results["null"])
        if args.tools:
            results["tools"] = [run_tools(args, work, n) for n in args.tools]
            print_tools(results["tools"], args.model_ms)
        if args.keep:
            kept = Path(tempfile.mkdtemp(prefix="stragglers-kept-"))
            subprocess.run(["cp", "-r", f"{work}/.", str(kept)], check=True)
            print(f"\nrun directories kept in {kept}", file=sys.stderr)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
